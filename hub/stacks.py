"""`scalemon stacks`: ranks' stacks read from outside their processes on demand (the `stacks`
request), live ranks included. A request starts looks (`hub/looks.py`) and answers at once
with its id; asked again with the id, the hub answers with what came so far, until every rank
has its stacks or its reason for none. Each answer carries only the ranks it did not carry
before, up to `REPLY_BYTES` of them: a big job's readings come over several answers."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from scalemon.protocol import ProtocolError
from scalemon.state.jobstate import ENDED_RANK_STATES

from .core import HubCore
from .looks import RELAY_WAIT_S

MAX_RANKS = 1024
"""Ranks one request reads at most (name ranks with --rank for the others)."""
KEPT = 16
"""Requests kept at once; the oldest is forgotten past this."""
GIVE_UP_S = RELAY_WAIT_S + 15.0
"""A request is done this long after it started, whatever has not come."""
REPLY_BYTES = 8 << 20
"""Readings one answer carries at most, packed (a native reading is up to 256 KiB)."""


@dataclass
class _Request:
    started: float  # time.time()
    started_mono: float
    native: bool
    pending: set[int]
    unsent: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Ranks read (or given up) and not yet in an answer."""


class StacksRequests:
    """The `stacks` requests under way."""

    def __init__(self, core: HubCore) -> None:
        self.core = core
        self._ids = itertools.count(1)
        self._requests: dict[int, _Request] = {}

    def answer(self, args: dict[str, Any], now: float) -> dict[str, Any]:
        """Start a request (`id` 0) or tell one's progress."""
        if args["id"] == 0:
            return self._start(args["ranks"], args["native"], now)
        request = self._requests.get(args["id"])
        if request is None:
            raise ProtocolError(f"stacks.id {args['id']} is not a request under way (they "
                                f"are forgotten {GIVE_UP_S:.0f} s after they start)")
        return self._progress(args["id"], request, now)

    def _start(self, asked: list[Any], native: bool, now: float) -> dict[str, Any]:
        if any(type(r) is not int for r in asked):
            raise ProtocolError("stacks.ranks must be rank numbers")
        state = self.core.state
        ranks = sorted(set(asked)) if asked else sorted(state.ranks)
        note = None
        if len(ranks) > MAX_RANKS:
            note = (f"{len(ranks)} ranks asked; the first {MAX_RANKS} are read (name others "
                    "with --rank)")
            ranks = ranks[:MAX_RANKS]
        request = _Request(time.time(), now, native, set())
        for rank in ranks:
            view = state.ranks.get(rank)
            if view is None:
                request.unsent[str(rank)] = {"error": "no such rank has reported to the hub"}
            elif view.state in ENDED_RANK_STATES:
                request.unsent[str(rank)] = {
                    "error": f"the rank is {view.state}"
                             + (f" ({view.state_reason})" if view.state_reason else "")
                             + ": no process to read"}
            elif (why := self.core.looks.ask(rank, view.pid, view.host, now,
                                              native)) is not None:
                request.unsent[str(rank)] = {"error": f"its process cannot be looked at: {why}"}
            else:
                request.pending.add(rank)
        request_id = next(self._ids)
        self._requests[request_id] = request
        while len(self._requests) > KEPT:
            del self._requests[min(self._requests)]
        reply = self._progress(request_id, request, now)
        return {**reply, "note": note} if note else reply

    def _progress(self, request_id: int, request: _Request, now: float) -> dict[str, Any]:
        latest = self.core.looks.latest
        for rank in sorted(request.pending):
            look = latest.get(rank)
            if look is not None and look["t"] >= request.started:
                request.pending.discard(rank)
                request.unsent[str(rank)] = {k: look.get(k) for k in (
                    "pid", "process", "reading", "where", "reader", "error")}
        if request.pending and now - request.started_mono > GIVE_UP_S:
            for rank in request.pending:
                request.unsent[str(rank)] = {"error": f"no look came within {GIVE_UP_S:.0f} s"}
            request.pending.clear()
        ranks, size = {}, 0
        for key in list(request.unsent):
            size += len(msgpack.packb(request.unsent[key], use_bin_type=True))
            if ranks and size > REPLY_BYTES:
                break
            ranks[key] = request.unsent.pop(key)
        done = not request.pending and not request.unsent
        reply = {"id": request_id, "done": done, "ranks": ranks,
                 "pending": sorted(request.pending)}
        if done:
            self._requests.pop(request_id, None)
        return reply
