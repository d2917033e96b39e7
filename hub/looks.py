"""The hub's looks at ranks' processes from outside (`scalemon.proc.probe.look_at`): for the
ranks on its own host on worker threads (py-spy takes a moment; the hub's loop never waits),
for the ranks on other nodes through their relays (asked in the answer to a relay's report,
answered in its next report). Liveness asks for a silent rank, `scalemon stacks` for any."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from scalemon.proc.probe import look_at

from .relay_book import RelayBook

log = logging.getLogger("scalemon.hub")

WORKERS = 2
"""Looks read at once on the hub's host."""
RELAY_WAIT_S = 30.0
"""A look asked of a relay that has not answered in this long is given up (a relay reads two
at a time, each up to some 10 s); a later answer is still taken."""
MAX_PROBES = 256
"""A relay's report carries at most this many looks; the rest are ignored."""


class Looks:
    """Looks under way and done, by rank. `take()` hands each finished look over once."""

    def __init__(self, host: str, relays: RelayBook) -> None:
        self.host = host
        self.relays = relays
        self._pool: ThreadPoolExecutor | None = None
        self._local: dict[int, tuple[Future, int]] = {}
        self._remote: dict[int, tuple[str, float]] = {}
        self._late: dict[int, str] = {}  # remote looks given up, whose answer may still come
        self._done: list[dict[str, Any]] = []
        self.latest: dict[int, dict[str, Any]] = {}
        """Each rank's latest finished look (with `t`: when it finished, time.time())."""

    def ask(self, rank: int, pid: int | None, host: str | None, now: float,
            native: bool = True) -> str | None:
        """Start a look at `rank`'s process (pid `pid` on `host`; its native frames too when
        `native`), unless one is under way; None when one is (or was already), else why none
        can be made."""
        if rank in self._local or rank in self._remote:
            return None
        if not pid:
            return "its agent never said its process id"
        if host == self.host:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="scalemon-look")
            self._local[rank] = (self._pool.submit(look_at, pid, native), pid)
            return None
        silent = self.relays.silent_for(host, now)
        if silent is None:
            return f"no scalemon relay reports from its node {host}"
        self.relays.ask(host or "", rank, pid, native)
        self._remote[rank] = (host or "", now)
        self._late.pop(rank, None)
        return None

    def answered(self, node: str, probes: list[Any]) -> None:
        """A relay's report carried these looks (`relay` request's `probes`): each for a rank
        of its node asked for, others ignored."""
        for probe in probes[:MAX_PROBES]:
            if not isinstance(probe, dict) or type(probe.get("rank")) is not int:
                continue
            asked = self._remote.get(probe["rank"])
            if asked is not None and asked[0] == node:
                del self._remote[probe["rank"]]
            elif self._late.get(probe["rank"]) == node:
                del self._late[probe["rank"]]
            else:
                continue
            self._finish(probe["rank"], {
                "pid": probe.get("pid"), "process": _dict(probe.get("process")),
                "reading": _dict(probe.get("reading")),
                "where": probe.get("where") if isinstance(probe.get("where"), str) else None,
                "reader": f"relay of {node}"})

    def take(self, now: float) -> list[dict[str, Any]]:
        """The looks that finished since the last call, each {"rank", "pid", "process",
        "reading", "where", "reader", "t"} or with "error" (the relay never answered)."""
        for rank, (future, pid) in list(self._local.items()):
            if not future.done():
                continue
            del self._local[rank]
            try:
                look = future.result()
            except Exception as exc:  # look_at never raises; a bug there must not stop the hub
                log.exception("looking at rank %d's process failed", rank)
                look = {"pid": pid, "process": None, "reading": None, "where": None,
                        "error": f"looking at process {pid} failed: {exc}"}
            self._finish(rank, {**look, "reader": f"hub on {self.host} (pid {os.getpid()})"})
        for rank, (node, asked) in list(self._remote.items()):
            if now - asked > RELAY_WAIT_S:
                del self._remote[rank]
                self._late[rank] = node
                self._finish(rank, {"pid": None, "process": None, "reading": None,
                                    "where": None, "reader": f"relay of {node}",
                                    "error": f"the relay of {node} did not look at the "
                                             f"process within {RELAY_WAIT_S:.0f} s (a relay "
                                             "older than scalemon 1.12 cannot)"})
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        """Stop the worker threads (a look under way is left to finish on its own)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _finish(self, rank: int, look: dict[str, Any]) -> None:
        look = {"rank": rank, **look, "t": time.time()}
        self.latest[rank] = look
        self._done.append(look)


def _dict(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None
