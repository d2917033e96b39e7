"""Point-to-point traffic (send/recv) per rank, as the `collectives` message's `p2p` rows carry
it: count, bytes and time per (group, op, src, dst), summed since the rank's first message.
Part of a `RankView`; the rows as people read them are `reports.pipeline.p2p_rows`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

P2P_FIELDS = ("group", "op", "src", "dst", "count", "bytes", "time_s_sum", "timed_count")
"""The columns of one row of the `collectives` message's `p2p` (protocol 1.11)."""
P2P_OPS = ("send", "recv")

Key = tuple[str, str, int, int]
"""(group name, op, src global rank, dst global rank)."""


@dataclass
class P2PRow:
    """Send or recv ops of one (group, op, src, dst): how many, how big, how long."""

    count: int = 0
    bytes: int = 0
    time_s: float = 0.0
    """Summed duration of the `timed` ones (seconds)."""
    timed: int = 0

    def merge(self, other: P2PRow) -> None:
        """Add another row of the same key."""
        self.count += other.count
        self.bytes += other.bytes
        self.time_s += other.time_s
        self.timed += other.timed


def parse_row(item: Any) -> tuple[Key, P2PRow]:
    """One wire row as (key, row); ValueError for a malformed one."""
    if type(item) is not list or len(item) != len(P2P_FIELDS):
        raise ValueError(f"bad p2p row {item!r}")
    group, op, src, dst, count, nbytes, time_s, timed = item
    ints = (src, dst, count, nbytes, timed)
    if not (isinstance(group, str) and op in P2P_OPS and all(type(v) is int for v in ints)
            and type(time_s) in (int, float) and min(count, nbytes, timed) >= 0
            and time_s >= 0 and min(src, dst) >= 0):
        raise ValueError(f"bad p2p row {item!r}")
    return (group, op, src, dst), P2PRow(count, nbytes, float(time_s), timed)


class P2PStats:
    """A rank's P2P rows by (group, op, src, dst), summed over its `collectives` messages."""

    def __init__(self) -> None:
        self.rows: dict[Key, P2PRow] = {}

    def merge_wire(self, rows: Any) -> int:
        """Add the rows of a message; returns how many were malformed (skipped)."""
        if not isinstance(rows, list):
            return 1
        bad = 0
        for item in rows:
            try:
                key, row = parse_row(item)
            except ValueError:
                bad += 1
                continue
            self.rows.setdefault(key, P2PRow()).merge(row)
        return bad
