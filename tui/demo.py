"""`scalemon demo`: start a monitored 2-rank run of the demo trainer and watch it.

The job runs under torchrun in its own session (`--device auto`, NCCL, when NVML counts a GPU
per rank, else `--device cpu` with gloo), its output goes to a log file, and the dashboard
attaches to it by job id. Quitting the dashboard stops the job and its hub; `scalemon snapshot
<job>` can still replay the history afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from scalemon.jobs import JobFile, jobs_dir, private_dir, scalemon_home


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `scalemon demo`."""
    parser.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--max-steps", type=int, default=100_000,
                        help="steps to train (default 100000: until you quit)")
    parser.add_argument("--step-delay", type=float, default=0.05, metavar="S",
                        help="sleep S seconds per step so it is easy to watch (default 0.05)")
    parser.add_argument("--preset", default="tiny", help="model size preset (default tiny)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--job", help="job id (default demo-<host>-<pid>)")


def free_port() -> int:
    """A free TCP port for torchrun's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count() -> int:
    """Number of NVIDIA GPUs (0 without NVML or a driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0


def trainer_path() -> str:
    """The installed demo trainer script (works from any directory)."""
    spec = importlib.util.find_spec("scalemon.demo_train.train")
    if spec is None or spec.origin is None:
        raise RuntimeError("scalemon.demo_train.train is not installed")
    return spec.origin


def demo_device(ranks: int, gpus: int) -> str:
    """`cpu` unless NVML counts a GPU for every rank (NCCL needs one each); then `auto`, so a
    torch that cannot use them (a CPU build) still trains, on the CPU."""
    return "auto" if 0 < ranks <= gpus else "cpu"


def job_command(args: argparse.Namespace, device: str) -> list[str]:
    """The torchrun command line of the demo job."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
        "--master-port", str(free_port()), "--", trainer_path(), "--monitor",
        "--device", device, "--max-steps", str(args.max_steps),
        "--step-delay", str(args.step_delay), "--preset", args.preset,
        "--batch-size", str(args.batch_size),
    ]


def job_env(job: str) -> dict[str, str]:
    """Environment of the job: its id and a short hub linger."""
    env = os.environ.copy()
    env.update(SCALEMON_JOB_ID=job, SCALEMON_HUB_ARGS=env.get("SCALEMON_HUB_ARGS",
                                                              "--linger 30"))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start_job(args: argparse.Namespace, job: str) -> tuple[subprocess.Popen, Path]:
    """Start torchrun in a new session; returns the process and its log file."""
    log_path = private_dir(scalemon_home() / "demo") / f"{job}.log"
    with open(log_path, "wb") as log:
        device = demo_device(args.ranks, gpu_count())
        proc = subprocess.Popen(job_command(args, device), env=job_env(job),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, log_path


def stop_job(proc: subprocess.Popen, job: str, grace_s: float = 10.0) -> None:
    """Stop the job's process group (SIGTERM, then SIGKILL) and then its hub."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    end = time.monotonic() + 5.0  # stragglers of the group, if torchrun died first
    while time.monotonic() < end:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.1)
    stop_hub(job)


def stop_hub(job: str) -> None:
    """SIGTERM the job's hub (it flushes its history and removes its job file)."""
    path = jobs_dir() / f"{job}.json"
    try:
        jf = JobFile.read(path)
    except ValueError:
        return
    if jf.job == job and jf.host == socket.gethostname():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(jf.pid, signal.SIGTERM)


def demo(args: argparse.Namespace) -> int:
    """Run the demo job and the dashboard on it; returns the exit code."""
    from scalemon.tui.app import DashboardApp, run_app
    from scalemon.tui.feed import HubFeed

    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0])
    job = args.job or f"demo-{host}-{os.getpid()}"
    proc, log_path = start_job(args, job)
    try:
        app = DashboardApp(HubFeed(job=job), job_process=proc, job_log=log_path)
        run_app(app)
    finally:
        stop_job(proc, job)
    print(f"scalemon demo: stopped job {job} (log: {log_path}); "
          f"`scalemon snapshot {job}` replays its history")
    return 0
