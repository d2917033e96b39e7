"""Finding the job's hub from a node of its own: the address given (`--hub`, `$SCALEMON_HUB`),
else the job file on the shared `$SCALEMON_HOME`, else, after a while, `$MASTER_ADDR` at the
fixed port of `$SCALEMON_LISTEN`; and saying, once, why none is found."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from scalemon import settings
from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir

LOOKUP_WARN_S = 20.0
"""Without a hub for this long, say why none is found (and try $MASTER_ADDR)."""


class HubFinder:
    """Where one job's hub is, looked up again on every `find` (a restarted hub binds new
    ports). `warn(key, text)` says a problem once per key."""

    def __init__(self, job: str, home: Path | None, fixed: str | None,
                 warn: Callable[[str, str], None]) -> None:
        self.job = job
        self.home = home
        self.fixed = fixed
        self._warn = warn
        self._looking_since = time.monotonic()

    def find(self) -> HubAddress | None:
        """The hub's tcp endpoints with its key: the given address, else the job file, else
        $MASTER_ADDR at the fixed port of $SCALEMON_LISTEN; None while none is known."""
        if self.fixed:
            return HubAddress.parse(self.fixed)
        path = jobs_dir(self.home) / f"{self.job}.json"
        try:
            jf = JobFile.read(path)
        except (ValueError, OSError):  # unreadable, or not trusted (another user's, a link)
            jf = None
        if jf is not None and jf.serving() and jf.tcp:
            return HubAddress(jf.tcp["ingest"], jf.tcp["feed"], jf.tcp["rpc"],
                              server_key=jf.server_key)
        waited = time.monotonic() - self._looking_since
        fallback = master_addr_hub()
        if waited >= LOOKUP_WARN_S:
            self._warn("lookup", self.lookup_text(path, jf, waited, fallback))
            if fallback is not None:
                return fallback
        return None

    def lookup_text(self, path: Path, jf: JobFile | None, waited: float,
                    fallback: HubAddress | None) -> str:
        """Why no hub is found after `waited` seconds, and what to do (or what is tried)."""
        if jf is None:
            why = (f"no job file {path} after {waited:.0f} s: is $SCALEMON_HOME "
                   f"({path.parent.parent}) shared between this node and rank 0's? ")
        elif not jf.tcp:
            why = (f"the hub of job {self.job} (on {jf.host}) does not listen on tcp: start "
                   "it with --listen tcp://*:0 (SCALEMON_LISTEN). ")
        else:
            why = f"the job file {path} says the job {jf.state}. "
        if fallback is not None:
            return why + f"Trying the hub at {fallback.base} ($MASTER_ADDR, $SCALEMON_LISTEN)"
        return why + ("Set SCALEMON_HOME to a directory every node shares, or SCALEMON_LISTEN "
                      "to a fixed port (tcp://*:PORT) on every node so relays find the hub at "
                      "$MASTER_ADDR; until then this node's metrics are held, then dropped")


def master_addr_hub() -> HubAddress | None:
    """tcp://$MASTER_ADDR:PORT where $SCALEMON_LISTEN names a fixed PORT, else None."""
    listen, master = settings.raw("SCALEMON_LISTEN") or "", os.environ.get("MASTER_ADDR")
    port = listen.rpartition(":")[2]
    if not master or not listen.startswith("tcp://") or not port.isdigit() or port == "0":
        return None
    try:
        return HubAddress.parse(f"tcp://{master}:{port}")
    except ValueError:  # a port past 65533: the hub could not bind it either
        return None
