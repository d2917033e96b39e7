"""Finding the job's hub, and starting one on rank 0 when none is configured or running."""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
from pathlib import Path

from scalemon.jobs import HubAddress, private_dir, run_dir, scalemon_home

from .env import RankEnv

log = logging.getLogger("scalemon.agent")

HUB_ARGS_ENV = "SCALEMON_HUB_ARGS"
"""Extra `scalemon hub` options for an auto-started hub, e.g. "--linger 60 --lost-after 10"."""


def hub_address(env: RankEnv, configured: str | None = None) -> HubAddress:
    """The hub this rank sends to: `configured`, else $SCALEMON_HUB, else the job's own hub
    (started here when this is rank 0 and none runs yet)."""
    if configured:
        return HubAddress.parse(configured)
    from_env = os.environ.get("SCALEMON_HUB")
    if from_env:
        try:
            return HubAddress.parse(from_env)
        except ValueError as exc:  # say which setting is wrong, not only that one is
            raise ValueError(f"SCALEMON_HUB={from_env!r} is not a hub address: {exc}") from None
    directory = private_dir(run_dir(env.job))
    address = HubAddress.for_directory(directory)
    group_rank = os.environ.get("GROUP_RANK", "0")
    if env.rank == 0:
        start_hub_if_needed(env, directory)
    elif group_rank != "0":
        log.warning(
            "scalemon: rank %d is not on rank 0's node, so it cannot reach the job's ipc hub; "
            "set SCALEMON_HUB to a hub address reachable from every node", env.rank,
        )
    return address


def hub_is_running(directory: Path) -> bool:
    """True when a hub holds the lock of this run directory."""
    lock_path = directory / "hub.lock"
    if not lock_path.exists():
        return False
    with open(lock_path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def start_hub_if_needed(env: RankEnv, directory: Path) -> int | None:
    """Start `scalemon hub` for this job in its own session; returns its pid or None."""
    if hub_is_running(directory):
        return None
    cmd = [
        sys.executable, "-m", "scalemon.hub",
        "--job", env.job,
        "--world-size", str(env.world_size),
        "--home", str(scalemon_home()),
        *os.environ.get(HUB_ARGS_ENV, "").split(),
    ]
    with open(directory / "hub.log", "ab") as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True,
        )
    log.info("scalemon: started hub pid %d for job %s", proc.pid, env.job)
    return proc.pid
