"""Replies made off the hub's loop (hub/forked_replies.py) for two requests:

- `seed`: the hub's fold pickled (scalemon/link/seed.py), at 16,384 ranks some 20 MB and a
  second or more of Python. A request joins the seed being made whatever came since: the
  reply says the record it continues from (`seq`), and the dashboard reads the records after
  it. A seed made less than `SEED_REUSE_S` ago serves the next request while no record came.
- `state` of a big job (`FORK_STATE_FROM_RANKS`): the job's state as JSON
  (`snapshot_json`), a second at 16,384 ranks, more while it is hung (its hang report). A
  request joins only a reply made at its own record count; a smaller job's is made at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from scalemon.link import seed
from scalemon.reports.snapshot import snapshot_json

from .core import HubCore
from .forked import timed
from .forked_replies import ForkedReplies, Origin, Send

log = logging.getLogger("scalemon.hub")

SEED_REUSE_S = 1.0
"""A seed made this recently serves the next dashboard too, while no record came since."""
FORK_STATE_FROM_RANKS = 1024
"""From this many ranks a `state` reply is made in a forked child."""


class Seeds(ForkedReplies):
    """Answers `seed` requests: at once from a fresh seed, else when the one being made is
    done (`ask` returns None then)."""

    op = "seed"

    def __init__(self, core: HubCore, send: Send) -> None:
        super().__init__(send)
        self.core = core
        self._cache: tuple[int, float, dict[str, Any]] | None = None

    def ask(self, origin: Origin, head: int) -> dict[str, Any] | None:
        cached = self._cache
        if cached is not None and cached[0] == head and time.monotonic() - cached[1] < SEED_REUSE_S:
            return cached[2]
        return super().ask(origin, head)

    def joins(self, made: int, head: int) -> bool:
        return True  # the reply's `seq` says where the records after it start

    def too_many(self, head: int, waiting: int) -> dict[str, Any]:
        return {"seed": None, "seq": head, "why": (
            f"{waiting} dashboards already wait for the hub's fold: replay the history")}

    def failed(self, head: int) -> dict[str, Any]:
        return {"seed": None, "seq": head,
                "why": "the hub could not make its fold: replay the history"}

    def _dump(self, head: int) -> bytes:
        fold = self.core.fold
        fold.next_seq = head  # every record below was folded, or skipped as invalid
        return seed.dump(fold)

    def work(self, head: int) -> tuple[Callable[[], Any], Any]:
        return (lambda: timed(lambda: self._dump(head))), None

    def reply(self, head: int, result: Any, context: Any) -> dict[str, Any]:
        blob, took = result
        if len(blob) > seed.MAX_SEED_BYTES:
            reply: dict[str, Any] = {"seed": None, "seq": head, "why": (
                f"the fold holds {len(blob) >> 20} MiB, over {seed.MAX_SEED_BYTES >> 20} MiB: "
                "replay the history")}
        else:
            reply = {"seed": blob, "seq": head, "format": seed.FORMAT}
        reply["hang_after_s"] = self.core.fold.state.hang_after_s  # the dashboard's threshold
        reply["digest"] = True  # a big job's digest on the feed (hub/digest.py)
        log.info("seed at record %d: %d bytes in %.3f s", head, len(blob), took)
        self._cache = (head, time.monotonic(), reply)
        return reply


class States(ForkedReplies):
    """Answers `state` requests: a big job's made in a forked child (`ask` returns None
    then), a smaller one's at once."""

    op = "state"

    def __init__(self, core: HubCore, send: Send, stats: Callable[[], dict[str, Any]]) -> None:
        super().__init__(send)
        self.core = core
        self.stats = stats

    def ask(self, origin: Origin, head: int) -> dict[str, Any] | None:
        state = self.core.state
        if len(state.ranks) < FORK_STATE_FROM_RANKS:
            return {"state": snapshot_json(state), "hub": self.stats(), "head": head}
        return super().ask(origin, head)

    def work(self, head: int) -> tuple[Callable[[], Any], Any]:
        state = self.core.state
        return (lambda: snapshot_json(state)), self.stats()  # the counters as of the fork

    def reply(self, head: int, result: Any, context: Any) -> dict[str, Any]:
        return {"state": result, "hub": context, "head": head}
