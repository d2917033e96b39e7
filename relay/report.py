"""The relay's own report to the hub (a `relay` request with its counts, every `REPORT_S`),
and its node's clock offset, estimated from the hub's answers as the agents do: the fastest of
the recent round trips."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from scalemon import protocol

from .looks import RelayLooks
from .syncs import SyncAnswers

REPORT_S = 2.0
PROBES_BYTES = 256 << 10
"""Looks one report carries at most, packed (the hub's rpc socket takes 1 MiB messages)."""
OWN_ID = b"relay"
"""The routing frame of the relay's own requests on its DEALER (ranks' ids start with 0)."""


class Report:
    """Sends the relay's report when due and reads the hub's answers to it. `warn(key, text)`
    says a problem once per key."""

    def __init__(self, node: str, every_s: float, warn: Callable[[str, str], None]) -> None:
        self.node = node
        self.every_s = every_s
        self._warn = warn
        self._round_trips: deque[tuple[float, float]] = deque(maxlen=8)
        self._sent: float | None = None
        self._next = 0.0
        self.answered: float | None = None
        """time.monotonic() of the hub's last answer; None since (re)connecting."""
        self.looks = RelayLooks()
        """Looks at the node's ranks' processes the hub asked for (1.12)."""
        self._probes: list[dict[str, Any]] = []  # finished looks not yet reported
        self.syncs = SyncAnswers()
        """The node's ranks' syncs, answered here once the hub hands over their commands."""

    def reset(self) -> None:
        """A new hub (or the same at a new address): start over, round trips quick again."""
        self.answered = None
        self._round_trips.clear()
        self._sent = None
        self._next = 0.0
        self.syncs.reset()

    @property
    def clock_offset_s(self) -> float | None:
        """The hub's clock minus this node's, from the fastest recent round trip."""
        trips = list(self._round_trips)
        return min(trips)[1] if len(trips) >= 3 else None

    def send_if_due(self, dealer: zmq.Socket, now: float,
                    stats: Callable[[], dict[str, Any]]) -> None:
        """Send the report (`stats()`) when due, or again when the last one went unanswered."""
        overdue = self._sent is not None and now - self._sent > 5.0
        self._probes.extend(self.looks.take())
        looks_due = bool(self._probes) and self._sent is None
        if (self._sent is None or overdue) and (now >= self._next or looks_due):
            probes = self._next_probes()
            request = protocol.encode_request("relay", node=self.node, pid=os.getpid(),
                                              t=time.time(), stats=stats(),
                                              ranks=sorted(self.syncs.ranks),
                                              **({"probes": probes} if probes else {}))
            try:
                dealer.send_multipart([OWN_ID, request], zmq.NOBLOCK)
                self._sent = now
            except zmq.Again:
                self._probes[:0] = probes  # in the next report
            # round trips are quick at first (3 in a second) so the clock is known early
            self._next = now + (self.every_s if len(self._round_trips) >= 3 else 0.3)

    def _next_probes(self) -> list[dict[str, Any]]:
        """The finished looks one report carries: up to `PROBES_BYTES` of them (a reading is
        bounded, see `scalemon.proc.stacks`); the rest go in the next reports."""
        taken, size = [], 0
        while self._probes:
            size += len(msgpack.packb(self._probes[0], use_bin_type=True))
            if taken and size > PROBES_BYTES:
                break
            taken.append(self._probes.pop(0))
        return taken

    def read_reply(self, frame: bytes) -> None:
        """Take the hub's answer to a report: it answered now, and with its clock."""
        t1 = time.time()
        self._sent = None
        self.answered = time.monotonic()
        try:
            reply = protocol.decode_reply(frame)
        except protocol.ProtocolError as exc:
            self._warn("reply", f"the hub's answer was unusable: {exc}")
            return
        if not reply.get("ok", True):
            self._warn("refused", f"the hub refused the relay's report: {reply.get('error')}")
            return
        self.looks.ask(reply.get("probe"))
        self.syncs.take_reply(reply)
        t0, hub_t = reply.get("t0"), reply.get("t")
        if isinstance(t0, float) and isinstance(hub_t, (int, float)) and 0 <= t1 - t0 < 1.0:
            self._round_trips.append((t1 - t0, hub_t - (t0 + t1) / 2))
