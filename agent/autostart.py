"""Finding the job's hub, and starting one on rank 0 when none is configured or running; on the
other nodes of a job that spans several, starting each node's relay on its local rank 0."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from scalemon import settings
from scalemon.home.address import HubAddress
from scalemon.home.paths import relay_dir, run_dir
from scalemon.home.pidlock import is_locked
from scalemon.home.safefs import private_dir

from .env import RankEnv

log = logging.getLogger("scalemon.agent")

HUB_ARGS_ENV = "SCALEMON_HUB_ARGS"
"""Extra `scalemon hub` options for an auto-started hub, e.g. "--linger 60 --lost-after 10"."""


def hub_address(env: RankEnv, configured: str | None = None) -> HubAddress:
    """The hub this rank sends to: `configured`, else (on a node other than rank 0's) its node's
    relay, else $SCALEMON_HUB, else the job's own hub (started here when this is rank 0 and
    none runs yet; listening on CurveZMQ tcp too when the job spans several nodes)."""
    if configured:
        return HubAddress.parse(configured)
    if env.multi_node and env.node_rank != 0:
        directory = relay_dir(env.job)
        if env.local_rank == 0:
            start_relay_if_needed(env, directory)
        return HubAddress.for_directory(directory)
    from_env = settings.raw("SCALEMON_HUB")
    if from_env:
        try:
            return HubAddress.parse(from_env)
        except ValueError as exc:  # say which setting is wrong, not only that one is
            raise ValueError(f"SCALEMON_HUB={from_env!r} is not a hub address: {exc}") from None
    directory = private_dir(run_dir(env.job))
    address = HubAddress.for_directory(directory)
    if env.rank == 0:
        start_hub_if_needed(env, directory)
    return address


def hub_is_running(directory: Path, lock: str = "hub.lock") -> bool:
    """True when a hub (or, with lock="relay.lock", a relay) holds this directory's lock."""
    return is_locked(directory / lock)


def start_hub_if_needed(env: RankEnv, directory: Path) -> int | None:
    """Start `scalemon hub` for this job in its own session; returns its pid or None."""
    if hub_is_running(directory) or _still_starting(directory / "hub.log"):
        return None
    cmd = [
        sys.executable, "-m", "scalemon.hub",
        "--job", env.job,
        "--world-size", str(env.world_size),
        "--home", str(settings.scalemon_home()),
        *settings.words(HUB_ARGS_ENV),
    ]
    if env.multi_node and not settings.raw("SCALEMON_LISTEN"):
        cmd += ["--listen", "tcp://*:0"]  # the other nodes' relays and the login node
    pid = _spawn(cmd, directory / "hub.log")
    log.info("scalemon: started hub pid %d for job %s", pid, env.job)
    return pid


def start_relay_if_needed(env: RankEnv, directory: Path) -> int | None:
    """Start this node's relay for the job in its own session; returns its pid or None."""
    if hub_is_running(directory, "relay.lock") or _still_starting(directory / "relay.log"):
        return None
    cmd = [sys.executable, "-m", "scalemon.relay", "--job", env.job,
           "--home", str(settings.scalemon_home())]
    pid = _spawn(cmd, directory / "relay.log")
    log.info("scalemon: started relay pid %d for job %s on this node", pid, env.job)
    return pid


_spawned: dict[Path, subprocess.Popen] = {}
"""What this process started last, by log path: a hub or relay that has not taken its lock yet
(still importing, on a loaded machine) is not started a second time."""


def _still_starting(log_path: Path) -> bool:
    """True while the hub or relay this process started for `log_path` runs (reaps it once it
    exited: a killed relay does not linger as a zombie of the rank)."""
    proc = _spawned.get(log_path)
    return proc is not None and proc.poll() is None


def _spawn(cmd: list[str], log_path: Path) -> int:
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True,
            # in its run directory: a `scalemon/` folder where the job was started (a checkout
            # of scalemon itself) cannot shadow the installed package, and the job's working
            # directory is not held by a process that outlives it
            cwd=log_path.parent,
        )
    _spawned[log_path] = proc
    return proc.pid
