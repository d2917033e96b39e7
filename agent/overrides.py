"""The job's flag overrides: what `scalemon toggle` changed, kept for the workers torchrun starts
again (after a restart-tier toggle, or after a crash).

Every rank writes the same file, `flags.json` in the job's run directory on its node, each time
it applies a toggle. `import scalemon.agent` applies it to `os.environ` in a restarted worker
of the same torchrun run (same TORCHELASTIC_RUN_ID, a higher TORCHELASTIC_RESTART_COUNT than
when it was written), before the script imports torch where it imports scalemon.agent first,
so values torch reads at import (TORCH_CPP_LOG_LEVEL) and NCCL reads at its first communicator
are in effect from the start. With the static rendezvous (run id "none") the run is told by the
pid of the torchrun agent, the workers' parent. This module imports nothing heavy (no torch).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

OVERRIDE_FILE = "flags.json"

applied: dict[str, str | None] = {}
"""What this process took from the override file at import (name -> value, None: unset)."""
restart_step: int | None = None
"""The step a restart-tier toggle checkpointed at, when this worker is the restart after it."""
torch_imported_first = False
"""True when torch was imported before the overrides were applied (TORCH_CPP_LOG_LEVEL and
other import-time values then did not take)."""
start_env: dict[str, str | None] = {}
"""Restart-tier flags as they were when this process started (after the overrides)."""


def _run_id(env: Any) -> str | None:
    """This torchrun run: its run id, or with the default static rendezvous (run id "none")
    the pid of the torchrun agent that starts (and restarts) the workers."""
    if "TORCHELASTIC_RESTART_COUNT" not in env:
        return None
    run_id = env.get("TORCHELASTIC_RUN_ID")
    return run_id if run_id and run_id != "none" else f"agent-{os.getppid()}"


def override_path(job: str) -> Path:
    """Where the job's overrides live on this node."""
    from scalemon.home.paths import run_dir

    return run_dir(job) / OVERRIDE_FILE


def read(path: Path) -> dict[str, Any] | None:
    """The override file, or None when absent or unreadable (a broken file never stops a
    worker: it is ignored with a message on stderr)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        print(f"scalemon: ignoring the flag override file {path}: {exc}", file=sys.stderr)
        return None
    return data if isinstance(data, dict) else None


def write(job: str, values: dict[str, str | None], restart_at: int | None = None) -> Path:
    """Merge `values` into the job's override file (atomically; every rank writes alike)."""
    from scalemon.flags import FLAGS
    from scalemon.home.safefs import private_dir

    path = override_path(job)
    private_dir(path.parent)
    old = read(path) or {}
    merged = {k: v for k, v in {**(old.get("values") or {}), **values}.items() if k in FLAGS}
    data = {
        "run_id": _run_id(os.environ),
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        "values": merged,
        "restart_step": restart_at,
    }
    tmp = path.with_name(f"{OVERRIDE_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
    return path


def apply_at_import() -> None:
    """In a restarted torchrun worker, set the job's overrides in `os.environ`."""
    global restart_step, torch_imported_first
    env = os.environ
    try:
        from scalemon.flags import FLAGS, PG_TIMEOUT

        if "RANK" not in env or _run_id(env) is None:
            return
        from .env import read_rank_env

        job = read_rank_env().job
        data = read(override_path(job))
        count = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if (not data or data.get("run_id") != _run_id(env)
                or not count > int(data.get("restart_count", 0))):
            return
        torch_imported_first = "torch" in sys.modules
        for name, value in (data.get("values") or {}).items():
            if name not in FLAGS or name == PG_TIMEOUT:
                continue  # a setting, not an environment variable: applied by the agent
            if value is None or value == "":
                env.pop(name, None)
            else:
                env[name] = str(value)
            applied[name] = value or None
        if isinstance(data.get("restart_step"), int):
            restart_step = data["restart_step"]
    except Exception as exc:  # never stop a worker over the monitor's file
        print(f"scalemon: flag overrides not applied: {type(exc).__name__}: {exc}",
              file=sys.stderr)
    finally:
        _note_start_env()


def _note_start_env() -> None:
    from scalemon.flags import FLAGS, RESTART

    for name, flag in FLAGS.items():
        if flag.tier == RESTART:
            start_env[name] = os.environ.get(name)


def pg_timeout_override(job: str) -> str | None:
    """The process-group timeout a toggle set earlier in this run (applied by `init`)."""
    data = read(override_path(job))
    if not data or data.get("run_id") != _run_id(os.environ):
        return None
    value = (data.get("values") or {}).get("pg_timeout_s")
    return value if isinstance(value, str) else None
