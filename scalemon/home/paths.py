"""Where scalemon keeps things: `$SCALEMON_HOME`, run directories and the relays' node-local
directories (the variables themselves: `scalemon.settings`).

Layout (all directories mode 0700, since ipc sockets are reachable by whoever can open them)::

    $SCALEMON_HOME/                       default ~/.scalemon (often on the cluster's shared home)
        jobs/<job>.json                   one per hub: endpoints, host, pid, world size, state
        keys/                             CurveZMQ keys (scalemon.home.keys)
        run/<job>/ingest.sock  feed.sock  rpc.sock  hub.lock  history.smlog  hub.log
    $SCALEMON_RUNTIME_DIR/                default /tmp/scalemon-<uid>: on the node's own disk
        relay/<node>/<job>/ingest.sock  rpc.sock  relay.lock  relay.log
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from scalemon.home.safefs import private_dir
from scalemon.protocol import check_job_id
from scalemon.settings import node_name, runtime_dir, scalemon_home

_IPC_PATH_MAX = 100  # sun_path is 108 bytes on Linux; keep a margin


def relay_dir(job: str, node: str | None = None) -> Path:
    """The private node-local directory of job `job`'s relay on `node` (default: this one),
    made short enough for ipc socket paths."""
    node = re.sub(r"[^A-Za-z0-9._-]", "-", node or node_name())[:64] or "node"
    path = runtime_dir() / "relay" / node / check_job_id(job)
    if len(str(path / "control.sock")) > _IPC_PATH_MAX:
        digest = hashlib.sha1(f"{node}/{job}".encode()).hexdigest()[:16]
        path = runtime_dir() / "r" / digest
    return private_dir(path)


def run_dir(job: str, home: Path | None = None) -> Path:
    """The private directory holding a job's sockets and history."""
    return (home or scalemon_home()) / "run" / check_job_id(job)


def jobs_dir(home: Path | None = None) -> Path:
    """Directory of job files."""
    return (home or scalemon_home()) / "jobs"
