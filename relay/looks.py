"""The relay's looks at its node's ranks' processes, asked by the hub in the answer to a report
(`probe`: [{"rank", "pid", "native"}]) and sent back in a later report (`probes`): the same
`scalemon.proc.probe.look_at` the hub runs for the ranks on its own host, on worker threads so
forwarding never waits."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from scalemon.proc.probe import look_at

log = logging.getLogger("scalemon.relay")

WORKERS = 2
MAX_ASKED = 256
"""Looks under way at once; further asks are answered when these are done (the hub asks
again for a rank it still waits for)."""


class RelayLooks:
    """Looks asked by the hub, under way and done."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._running: dict[int, Future] = {}

    def ask(self, asks: Any) -> None:
        """Start the looks the hub's answer asked for (malformed entries are ignored)."""
        if not isinstance(asks, list):
            return
        for ask in asks[:MAX_ASKED]:
            if not isinstance(ask, dict):
                continue
            rank, pid = ask.get("rank"), ask.get("pid")
            if type(rank) is not int or type(pid) is not int or pid <= 0:
                continue
            if rank in self._running or len(self._running) >= MAX_ASKED:
                continue
            if self._pool is None:
                self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="scalemon-look")
            native = ask.get("native") is not False
            self._running[rank] = self._pool.submit(look_at, pid, native)

    def take(self) -> list[dict[str, Any]]:
        """The looks finished since the last call, for the next report."""
        done = []
        for rank, future in list(self._running.items()):
            if not future.done():
                continue
            del self._running[rank]
            try:
                done.append({"rank": rank, **future.result()})
            except Exception as exc:  # look_at never raises; a bug must not stop forwarding
                log.exception("looking at rank %d's process failed", rank)
                done.append({"rank": rank, "error": f"the relay's look failed: {exc}"})
        return done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
