"""What machine a benchmark ran on, for its results file, and a free port on it for a
benchmark's torchrun rendezvous (bench scripts import this module from their own directory)."""

from __future__ import annotations

import json
import os
import platform
import re
import socket
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
    """The CPU's model name, or what platform knows."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        return re.search(r"model name\s*:\s*(.+)", text).group(1).strip()
    except (OSError, AttributeError):
        return platform.processor() or "unknown CPU"


def cpu_name() -> str:
    """`<model> (<n> CPUs)`."""
    return f"{cpu_model()} ({os.cpu_count()} CPUs)"


def append_result(stem: str, result: dict) -> Path:
    """Append `result` to bench/results/<stem>-<device>.json, a list of runs (`device`: "cpu"
    for a CPU, else the device's name as a slug); returns the path."""
    device = str(result.get("device", "cpu")).lower()
    slug = "cpu" if "cpu" in device else re.sub(r"[^a-z0-9]+", "-", device).strip("-")
    path = RESULTS / f"{stem}-{slug}.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    runs = json.loads(path.read_text()) if path.exists() else []
    runs.append(result)
    path.write_text(json.dumps(runs, indent=1) + "\n")
    print(f"saved {path.relative_to(RESULTS.parent.parent)}")
    return path


def free_port() -> int:
    """A free TCP port on this machine's loopback (torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(home: Path, linger_s: int = 30) -> dict[str, str]:
    """The environment of one benchmarked job: a private SCALEMON_HOME (its id the folder's
    name), one thread per rank, its hub lingering `linger_s` after the job ends."""
    env = os.environ.copy()
    for name in ("TORCHELASTIC_RESTART_COUNT", "SCALEMON_HUB", "SCALEMON_JOB_ID"):
        env.pop(name, None)
    env.update(OMP_NUM_THREADS="1", SCALEMON_HOME=str(home), SCALEMON_JOB_ID=home.name,
               SCALEMON_HUB_ARGS=f"--linger {linger_s}")
    return env


def machine_busy_pct(seconds: float) -> float:
    """How busy the whole machine is over `seconds`, in % of one core (others' work too)."""
    import time

    import psutil

    def busy(c: object) -> float:
        return sum(c) - c.idle - getattr(c, "iowait", 0.0)  # type: ignore[attr-defined]

    a = psutil.cpu_times()
    time.sleep(seconds)
    return 100.0 * (busy(psutil.cpu_times()) - busy(a)) / seconds
