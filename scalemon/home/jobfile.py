"""A hub's job file (`$SCALEMON_HOME/jobs/<job>.json`): what a hub writes about itself so
that commands and ranks find it, and what is left of a job once its hub is gone."""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from scalemon.home.address import HubAddress
from scalemon.home.paths import jobs_dir
from scalemon.home.safefs import (
    UnsafePathError,
    check_dir,
    private_dir,
    read_private,
    write_private,
)
from scalemon.settings import node_name, scalemon_home


@dataclass
class JobFile:
    """What a live hub writes about itself to `$SCALEMON_HOME/jobs/<job>.json`."""

    job: str
    address: str
    host: str
    pid: int
    started: float
    world_size: int | None
    run_dir: str
    protocol: list[int]
    state: str = "running"
    """"running" while the job runs; from the moment it ended, its final state (`ENDED_STATES`:
    "finished", "stopped", "crashed", "lost", "abandoned"), also while the hub lingers to serve
    it, so readers never count an ended job as live. A hub that died leaves "running" with a
    pid that is gone."""
    ended: float | None = None
    """When the job ended (files of older hubs: when the hub exited after it)."""
    hub_stopped: float | None = None
    """When the hub exited after the job ended; None while it serves (lingering included)."""
    tcp: dict[str, str] | None = None
    """The hub's CurveZMQ tcp endpoints {"ingest", "feed", "rpc"} with a host name other nodes
    resolve; None for an ipc-only hub."""
    server_key: str | None = None
    """The hub's Curve public key (z85), which tcp clients must know; None without tcp."""
    metrics_url: str | None = None
    """Where the hub serves OpenMetrics (`http://HOST:PORT/metrics`); None when it does not."""

    def write(self, home: Path | None = None) -> Path:
        """Atomically (re)write the job file."""
        home = home or scalemon_home()
        # jobs/ may be a link of this user's (shared between nodes' homes): its own top
        path = private_dir(jobs_dir(home), top=jobs_dir(home)) / f"{self.job}.json"
        write_private(path, json.dumps(asdict(self), indent=1).encode())
        return path

    @classmethod
    def read(cls, path: Path) -> JobFile:
        """Parse a job file; raises ValueError naming the file when it is unreadable, and
        UnsafePathError when it is not to be trusted (a link, another user's, writable by
        others)."""
        try:
            data = json.loads(read_private(path))
            optional = {"state", "ended", "hub_stopped", "tcp", "server_key",
                        "metrics_url"}  # older hubs
            jf = cls(**{k: data[k] for k in cls.__dataclass_fields__
                        if k not in optional or k in data})
        except UnsafePathError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"unreadable job file {path}: {exc}") from None
        if "hub_stopped" not in data and jf.state != "running":  # older hubs: only at exit
            jf.hub_stopped = jf.ended or jf.started
        return jf

    def hub_address(self) -> HubAddress:
        """The hub's endpoints: ipc on the hub's host, else its Curve tcp ones; its control
        socket where the hub runs on this host."""
        address = HubAddress.parse(self.address)
        local = self.host == node_name()
        if self.tcp and (not local or not address.ingest.startswith("ipc://")):
            address = HubAddress(self.tcp["ingest"], self.tcp["feed"], self.tcp["rpc"])
        control = address.control
        if control is None and local:
            control = f"ipc://{Path(self.run_dir) / 'control.sock'}"
        return HubAddress(address.ingest, address.feed, address.rpc, control, self.server_key)

    def check_trusted(self) -> None:
        """Raise UnsafePathError when this job's hub is on this host and its ipc sockets are in
        a directory that is not safely this user's: whoever owns it could impersonate the
        hub."""
        if self.host != node_name():
            return
        for address in (self.address, f"ipc://{self.run_dir}"):
            if address.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):  # gone with its hub
                    check_dir(Path(address[len("ipc://"):].rstrip("/")))

    def serving(self) -> bool:
        """True when the hub process still runs, lingering after the job ended included
        (always assumed for another host until the file says the hub exited)."""
        if self.hub_stopped is not None:
            return False
        return self.host != node_name() or pid_alive(self.pid)

    def is_alive(self) -> bool:
        """True when the job is live: it runs, and its hub serves."""
        return self.state == "running" and self.serving()


ENDED_STATES = ("finished", "stopped", "crashed", "lost", "abandoned")
"""A job file's `state` once its job ended (older hubs also wrote "ended")."""
STATE_WORDS = {"finished": "finished",
               "stopped": "was stopped by its user or a stop signal",
               "crashed": "crashed", "lost": "lost a rank", "abandoned": "was abandoned",
               "ended": "ended"}
"""A job file's final `state` in a sentence: "the job was stopped by its user or a stop
signal" (SIGTERM, SIGINT, SIGHUP: a scheduler's cancel or preemption too)."""


def pid_alive(pid: int) -> bool:
    """True when process `pid` of this machine exists and is not a zombie."""
    try:
        proc = psutil.Process(pid)
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
