"""Several nodes and a login node on one machine, for bench/relay_kill.py and the tests: each a
home of its own sharing only `jobs/` and `keys/` (as a cluster's shared home does), a node-local
runtime directory, and `SCALEMON_NODE` for its name."""

from __future__ import annotations

import os
from pathlib import Path

import psutil

NODES = ("node0", "node1")


def make_cluster(root: Path) -> dict[str, Path]:
    """Homes of node0, node1 and the login node under `root`, sharing jobs/ and keys/ only."""
    for shared in ("jobs", "keys"):
        (root / "shared" / shared).mkdir(parents=True, mode=0o700)
    homes = {}
    for name in (*NODES, "login"):
        home = root / name / "home"
        home.mkdir(parents=True, mode=0o700)
        (root / name / "rt").mkdir(mode=0o700)
        for shared in ("jobs", "keys"):
            (home / shared).symlink_to(root / "shared" / shared)
        homes[name] = home
    return homes


def node_env(home: Path, node: str, linger_s: int = 30) -> dict[str, str]:
    """The environment of a process on `node` (this machine's, without its SCALEMON_*)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCALEMON_")}
    env.update(SCALEMON_HOME=str(home), SCALEMON_NODE=node,
               SCALEMON_RUNTIME_DIR=str(home.parent / "rt"), OMP_NUM_THREADS="1",
               SCALEMON_LISTEN="tcp://127.0.0.1:0", SCALEMON_HUB_ARGS=f"--linger {linger_s}")
    return env


def relay_pid(home: Path) -> int | None:
    """The pid of the live relay of the node whose home is `home`, if any."""
    for lock in (home.parent / "rt").rglob("relay.lock"):
        text = lock.read_text().strip()
        if text.isdigit() and psutil.pid_exists(int(text)):
            return int(text)
    return None
