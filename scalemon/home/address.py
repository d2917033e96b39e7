"""A hub's address: its ingest, feed, rpc and control endpoints, parsed from what people type
(`ipc:///dir`, `tcp://host:port`) and written back the same way."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from scalemon.home.paths import _IPC_PATH_MAX

_PORT_MAX = 65535


@dataclass(frozen=True)
class HubAddress:
    """The endpoints of one hub: ranks PUSH to `ingest`, dashboards SUB to `feed` and send
    requests to `rpc`; commands that steer the job go to `control`, an ipc socket in the hub's
    private run directory (None where that directory is not known, e.g. a bare tcp address)."""

    ingest: str
    feed: str
    rpc: str
    control: str | None = None
    server_key: str | None = None
    """The hub's Curve public key for tcp endpoints (from its job file), where known."""

    @classmethod
    def parse(cls, address: str) -> HubAddress:
        """From `ipc:///dir` (sockets inside dir), `tcp://host:port` (ports port..port+2;
        port 0 stays 0 for all three: each binds a free port) or `tcp://host:I,F,R` (the
        ingest, feed and rpc ports of a hub that bound free ones: what `base` says for it)."""
        if address.startswith("ipc://"):
            base = address[len("ipc://") :].rstrip("/")
            if not base:
                raise ValueError(f"{address!r}: ipc address needs a directory")
            return cls.for_directory(Path(base))
        if address.startswith("tcp://"):
            host, _, port = address[len("tcp://") :].rpartition(":")
            ports = port.split(",")
            if not host or len(ports) not in (1, 3) or not all(p.isdigit() for p in ports):
                raise ValueError(f"{address!r}: expected tcp://HOST:PORT (or "
                                 "tcp://HOST:INGEST,FEED,RPC, as `scalemon jobs` prints it)")
            numbers = [int(p) for p in ports]
            if len(numbers) == 1:
                first = numbers[0]
                if first > _PORT_MAX - 2:
                    raise ValueError(f"{address!r}: a tcp hub uses ports PORT to PORT+2, so "
                                     f"PORT must be from 0 to {_PORT_MAX - 2}, not {first}")
                numbers = [first + i if first else 0 for i in range(3)]
            elif max(numbers) > _PORT_MAX:
                raise ValueError(f"{address!r}: ports must be from 0 to {_PORT_MAX}")
            return cls(*(f"tcp://{host}:{p}" for p in numbers))
        raise ValueError(f"hub address {address!r} must start with ipc:// or tcp://")

    @classmethod
    def for_directory(cls, run_dir: Path) -> HubAddress:
        """ipc endpoints inside `run_dir`."""
        paths = [run_dir / name
                 for name in ("ingest.sock", "feed.sock", "rpc.sock", "control.sock")]
        longest = max(len(str(p)) for p in paths)
        if longest > _IPC_PATH_MAX:
            raise ValueError(
                f"ipc socket path under {run_dir} is {longest} bytes, over the {_IPC_PATH_MAX} "
                "the OS allows: set SCALEMON_HOME to a shorter directory"
            )
        return cls(*(f"ipc://{p}" for p in paths))

    @property
    def base(self) -> str:
        """The address string `parse` accepts."""
        if self.ingest.startswith("ipc://"):
            return "ipc://" + str(Path(self.ingest[len("ipc://") :]).parent)
        hosts, ports = zip(*(e.rpartition(":")[::2] for e in (self.ingest, self.feed, self.rpc)),
                           strict=True)
        if len(set(hosts)) > 1 or not all(p.isdigit() for p in ports):
            return self.ingest  # not one hub's: nothing `parse` would give back
        first, feed, rpc = (int(p) for p in ports)
        if (feed, rpc) in ((first + 1, first + 2), (0, 0)):
            return self.ingest
        return f"{hosts[0]}:{first},{feed},{rpc}"  # free ports the hub bound
