"""The node's ranks' `sync` round trips answered by the relay itself, so that the hub's cost
grows with the nodes, not with every rank's once-a-second request.

A rank's sync asks for the hub's clock, its hang threshold and heartbeat interval, and the
commands queued for the rank. The relay knows the hub's clock from its own round trips (`Report`:
the fastest recent one), and the hub hands it the threshold and the commands of the ranks it
answers for in the reply to each report (protocol 1.13: the report's `ranks`, the reply's
`commands`, `hang_after_s` and `answers_syncs`). Until both are known (a new hub, an older hub
that does not say `answers_syncs`) every sync passes through to the hub as before.

The clock the relay gives is its node's clock plus its offset to the hub: the rank, on the
same node, measures the same offset the relay did, within the relay's round trip to the hub.
"""

from __future__ import annotations

import time
from typing import Any

from scalemon import protocol
from scalemon.protocol import ProtocolError

MAX_HELD_COMMANDS = 64
"""Commands held for one rank that has not asked for them yet; older ones beyond are dropped
(a rank that stopped syncing takes none of them anyway)."""


class SyncAnswers:
    """Answers the node's ranks' syncs once the hub's clock, threshold and consent are known;
    holds the commands the hub handed over until each rank's next sync."""

    def __init__(self) -> None:
        self.hang_after_s: float | None = None
        self.heartbeat_stepping_s: float | None = None
        self.enabled = False
        """True once the hub said it hands over the ranks' commands (`answers_syncs`)."""
        self.hub_version: tuple[int, int] = protocol.PROTOCOL_VERSION
        """The version the answers give: the hub's where it is older than the relay (its
        ranks then send what that hub reads: a 1.13 hub takes a left-out heartbeat value for
        null), else the relay's own."""
        self.ranks: set[int] = set()
        """Ranks whose syncs this relay answered: their commands come in the report's reply."""
        self.answered = 0
        self.passed = 0
        self._held: dict[int, list[dict[str, Any]]] = {}

    def reset(self) -> None:
        """A new hub: pass syncs through until it says it hands over the commands."""
        self.enabled = False
        self.hang_after_s = None

    def take_reply(self, reply: dict[str, Any]) -> None:
        """Read the hub's answer to the relay's report: its consent, threshold and commands."""
        self.enabled = reply.get("answers_syncs") is True
        self.hub_version = spoken_version(reply.get("v"))
        self.hang_after_s = _seconds(reply.get("hang_after_s")) or self.hang_after_s
        self.heartbeat_stepping_s = (_seconds(reply.get("heartbeat_stepping_s"))
                                     or self.heartbeat_stepping_s)
        for item in reply.get("commands") or ():
            if not (isinstance(item, (list, tuple)) and len(item) == 2
                    and type(item[0]) is int and isinstance(item[1], list)):
                continue  # not ours to judge further: the agent checks each command
            held = self._held.setdefault(item[0], [])
            held.extend(c for c in item[1] if isinstance(c, dict))
            del held[:max(0, len(held) - MAX_HELD_COMMANDS)]

    def answer(self, payload: bytes, clock_offset_s: float | None) -> bytes | None:
        """The reply to a rank's request `payload`, or None when it goes to the hub: not a
        sync, not readable (the hub says what is wrong), or the relay cannot answer yet."""
        if not self.enabled or clock_offset_s is None or self.hang_after_s is None:
            self.passed += 1
            return None
        try:
            op, args = protocol.decode_request(payload)
        except ProtocolError:
            self.passed += 1
            return None
        if op != "sync":
            self.passed += 1
            return None
        rank = args["rank"]
        self.ranks.add(rank)
        self.answered += 1
        return protocol.encode_reply(t0=args["t"], t=time.time() + clock_offset_s,
                                     hang_after_s=self.hang_after_s,
                                     heartbeat_stepping_s=self.heartbeat_stepping_s,
                                     commands=self._held.pop(rank, []), via="relay",
                                     version=self.hub_version)


def spoken_version(hub: Any) -> tuple[int, int]:
    """The older of the hub's version (a reply's `v`) and ours; ours where `v` is unreadable
    (the reply was decoded, so its major is ours)."""
    if (isinstance(hub, (list, tuple)) and len(hub) == 2
            and all(type(x) is int for x in hub)):
        return min((hub[0], hub[1]), protocol.PROTOCOL_VERSION)
    return protocol.PROTOCOL_VERSION


def _seconds(value: Any) -> float | None:
    """A number of seconds the hub gave: a positive int or float (not a bool), else None."""
    if type(value) in (int, float) and value > 0:
        return float(value)
    return None
