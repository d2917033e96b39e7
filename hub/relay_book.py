"""The hub's book of the nodes' relays: it answers their reports and says in the history when
a relay comes up (after what gap), drops messages, learns its node's clock, or goes silent."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from scalemon.protocol import ProtocolError

log = logging.getLogger("scalemon.hub")

REPORT_EVERY_S = 60.0
"""A relay's counts go into the history at least this often, and at most every DROPS_EVERY_S
while it drops."""
DROPS_EVERY_S = 10.0
MAX_RELAYS = 65_536
"""Nodes whose relays the hub keeps track of; a further one is refused."""
STATS_KEYS = ("received", "forwarded", "dropped", "clock_offset_s")
"""What the hub keeps of a relay's stats."""


@dataclass
class _Relay:
    pid: int
    last: float  # monotonic time of its last report
    stats: dict[str, Any] = field(default_factory=dict)
    recorded: float = 0.0  # monotonic time of its last record
    dropped_said: int = 0
    offset_said: bool = False
    lost: bool = False


class RelayBook:
    """Relays by node; `records` holds the `relay` bodies the hub has yet to write."""

    def __init__(self, lost_after_s: float) -> None:
        self.lost_after_s = lost_after_s
        self.relays: dict[str, _Relay] = {}
        self.records: list[dict[str, Any]] = []
        self._asks: dict[str, dict[int, tuple[int, bool]]] = {}

    def ask(self, node: str, rank: int, pid: int, native: bool = True) -> None:
        """Have `node`'s relay look at rank `rank`'s process (pid `pid`; native frames too when
        `native`): asked in the answer to its next report (`take_asks`), answered in the
        report after (`hub/looks.py`)."""
        self._asks.setdefault(node, {})[rank] = (pid, native)

    def take_asks(self, node: str) -> list[dict[str, Any]]:
        """The looks to ask of `node`'s relay now, each once: [{"rank", "pid", "native"}]."""
        asks = self._asks.pop(node, {})
        return [{"rank": r, "pid": p, "native": n} for r, (p, n) in sorted(asks.items())]

    def report(self, node: str, pid: int, stats: dict[str, Any],
               now: float | None = None) -> None:
        """Take one relay's report (its counts since it started)."""
        now = time.monotonic() if now is None else now
        stats = {k: stats.get(k) for k in STATS_KEYS
                 if isinstance(stats.get(k), (int, float)) or stats.get(k) is None}
        seen = self.relays.get(node)
        if seen is None and len(self.relays) >= MAX_RELAYS:
            raise ProtocolError(f"relay.node is over the hub's limit of {MAX_RELAYS} relays "
                                f"(a new node {node[:60]!r})")
        if seen is None or seen.pid != pid:
            gap = now - seen.last if seen is not None else None
            relay = self.relays[node] = _Relay(pid, now, stats, recorded=now)
            text = (f"relay of {node} (pid {pid}) up" if seen is None else
                    f"relay of {node} replaced: pid {seen.pid} -> {pid}; nothing was "
                    f"forwarded from {node} for {gap:.1f} s")
            if seen is not None:
                log.warning("%s", text)
            self.records.append(self._body(node, relay, "up", gap_s=gap, text=text))
            return
        seen.last, seen.stats, seen.lost = now, stats, False
        dropped = int(stats.get("dropped") or 0)
        offset_new = stats.get("clock_offset_s") is not None and not seen.offset_said
        drops_due = dropped > seen.dropped_said and now - seen.recorded >= DROPS_EVERY_S
        if offset_new or drops_due or now - seen.recorded >= REPORT_EVERY_S:
            seen.recorded, seen.dropped_said = now, dropped
            seen.offset_said = seen.offset_said or offset_new
            self.records.append(self._body(node, seen, "report"))

    def advance(self, now: float | None = None) -> None:
        """Record relays that stopped reporting."""
        now = time.monotonic() if now is None else now
        for node, relay in self.relays.items():
            silent = now - relay.last
            if not relay.lost and silent > self.lost_after_s:
                relay.lost = True
                text = f"relay of {node} (pid {relay.pid}) silent for {silent:.1f} s"
                log.warning("%s", text)
                self.records.append(self._body(node, relay, "lost", text=text))

    def silent_for(self, node: str | None, now: float | None = None) -> float | None:
        """Seconds since `node`'s relay last reported; None for a node without a relay."""
        relay = self.relays.get(node or "")
        if relay is None:
            return None
        return (time.monotonic() if now is None else now) - relay.last

    @staticmethod
    def _body(node: str, relay: _Relay, state: str, gap_s: float | None = None,
              text: str | None = None) -> dict[str, Any]:
        s = relay.stats
        offset = s.get("clock_offset_s")
        return {"node": node, "state": state, "pid": relay.pid,
                "received": _int(s.get("received")), "forwarded": _int(s.get("forwarded")),
                "dropped": _int(s.get("dropped")),
                "clock_offset_s": float(offset) if isinstance(offset, (int, float)) else None,
                "gap_s": gap_s, "text": text}


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) else None
