"""Collectives in numbers: bus bandwidth, sizes, duration histograms and the rows of
`collectives.stats` that agents send and hubs pool (`CollectiveStats`).

Pure Python, shared by the agent (which aggregates what the Flight Recorder saw into rows of
`CollectiveStats` before sending), the state (which pools them per rank) and the reports.
Arrival skew lives in `state.arrival`, the wait-for analysis of a hang in `reports.waitfor`.

Definitions (nccl-tests, `doc/PERFORMANCE.md`): `algbw = S / t` with S the size of the whole
buffer (the gathered output of an all_gather, the scattered input of a reduce_scatter, the
buffer of an all_reduce) and `busbw = algbw * factor(op, n)`, n the ranks of the group, 1 GB =
1e9 bytes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

DTYPE_BYTES = {
    "Float": 4, "Half": 2, "BFloat16": 2, "Double": 8, "Long": 8, "Int": 4, "Short": 2,
    "Char": 1, "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16,
    "Float8_e4m3fn": 1, "Float8_e5m2": 1, "Float8_e4m3fnuz": 1, "Float8_e5m2fnuz": 1,
    "UInt16": 2, "UInt32": 4, "UInt64": 8,
}
"""Element size of the dtype names the Flight Recorder writes."""

_ALL_REDUCE = {"all_reduce", "allreduce", "allreduce_coalesced", "all_reduce_coalesced"}
_N_MINUS_1 = {
    "all_gather", "allgather", "_allgather_base", "all_gather_into_tensor", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base",
    "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all", "alltoall",
    "alltoall_base", "all_to_all_single", "gather", "scatter",
}
_ONE = {"broadcast", "reduce", "send", "recv", "recv_anysource", "_broadcast_oop",
        "_reduce_oop"}

HIST_PER_DECADE = 10
HIST_MIN_S = 1e-6
HIST_BUCKETS = 100  # 1 µs .. 10^4 s
STATS_FIELDS = ("group", "op", "size_bucket", "count", "bytes", "timed", "time_sum_s",
                "time_max_s", "hist")
"""The columns of one row of `collectives.stats` on the wire (docs/protocol.md)."""


def bus_factor(op: str, n: int) -> float | None:
    """nccl-tests' bus bandwidth factor of `op` in a group of `n` ranks (None: no data moved,
    e.g. barrier, or an op it does not define)."""
    if n < 1:
        return None
    if op in _ALL_REDUCE:
        return 2 * (n - 1) / n
    if op in _N_MINUS_1:
        return (n - 1) / n
    if op in _ONE:
        return 1.0
    return None


def pg_config_ranks(config: Any) -> list[int] | None:
    """A group's ranks from a Flight Recorder `pg_config` item, sorted: NCCL writes them as text
    ("[0, 1]", in every format so far), others as a list; None when absent or malformed."""
    if not isinstance(config, dict):
        return None
    ranks = config.get("ranks")
    if isinstance(ranks, str):
        try:
            ranks = [int(r) for r in ranks.strip("[] ").split(",") if r.strip()]
        except ValueError:
            return None
    if isinstance(ranks, list) and ranks and all(type(r) is int for r in ranks):
        return sorted(ranks)
    return None


def is_all_reduce(op: str) -> bool:
    """True for the all_reduce ops (plain and coalesced), as `op_name` gives them."""
    return op in _ALL_REDUCE


def op_name(profiling_name: str) -> str:
    """The op as torch names it, from the recorder's `profiling_name` ("nccl:all_reduce")."""
    return profiling_name.split(":", 1)[-1]


def tensor_bytes(sizes: Iterable[Iterable[int]], dtypes: Iterable[str]) -> int:
    """Bytes of the tensors the recorder lists (sizes and dtype names side by side)."""
    total = 0
    for shape, dtype in zip(sizes, dtypes, strict=False):
        total += math.prod(shape) * DTYPE_BYTES.get(dtype, 4)
    return total


def buffer_bytes(entry: dict[str, Any]) -> int:
    """S of one recorder entry: the larger of its input and output (the gathered output of an
    all_gather, the input of a reduce_scatter, the buffer of the others)."""
    return max(tensor_bytes(entry.get("input_sizes") or (), entry.get("input_dtypes") or ()),
               tensor_bytes(entry.get("output_sizes") or (), entry.get("output_dtypes") or ()))


def size_bucket(nbytes: int) -> int:
    """Bucket b holds sizes in (2^(b-1), 2^b]; 0 holds 0 and 1 byte."""
    return max(0, int(nbytes - 1).bit_length()) if nbytes > 0 else 0


def bucket_text(bucket: int) -> str:
    """The upper bound of a size bucket for people: "≤ 4 MiB"."""
    value = float(2**bucket)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"≤ {value:g} {unit}"
        value /= 1024
    return f"≤ {value:g} TiB"


def hist_index(seconds: float) -> int:
    """The duration histogram bucket of `seconds` (10 per decade from 1 µs)."""
    if seconds <= HIST_MIN_S:
        return 0
    return min(HIST_BUCKETS - 1, int(HIST_PER_DECADE * math.log10(seconds / HIST_MIN_S)))


def hist_seconds(index: int) -> float:
    """The geometric middle of histogram bucket `index`."""
    return HIST_MIN_S * 10 ** ((index + 0.5) / HIST_PER_DECADE)


def hist_quantile(hist: dict[int, int], q: float) -> float | None:
    """The `q` quantile of a duration histogram (within half a bucket, ±12 %)."""
    total = sum(hist.values())
    if not total:
        return None
    rank = q * (total - 1)
    seen = 0
    for index in sorted(hist):
        seen += hist[index]
        if seen > rank:
            return hist_seconds(index)
    return hist_seconds(max(hist))


@dataclass
class StatRow:
    """Collectives of one (group, op, size bucket): how many, how big, how long."""

    count: int = 0
    bytes: int = 0
    timed: int = 0
    time_sum_s: float = 0.0
    time_max_s: float = 0.0
    hist: dict[int, int] = field(default_factory=dict)

    def add_time(self, seconds: float) -> None:
        """Count one measured duration."""
        self.timed += 1
        self.time_sum_s += seconds
        self.time_max_s = max(self.time_max_s, seconds)
        index = hist_index(seconds)
        self.hist[index] = self.hist.get(index, 0) + 1

    def merge(self, other: StatRow) -> None:
        """Add another row of the same key."""
        self.count += other.count
        self.bytes += other.bytes
        self.timed += other.timed
        self.time_sum_s += other.time_sum_s
        self.time_max_s = max(self.time_max_s, other.time_max_s)
        for index, n in other.hist.items():
            self.hist[index] = self.hist.get(index, 0) + n


Key = tuple[str, str, int]  # group name, op, size bucket


class CollectiveStats:
    """Rows by (group, op, size bucket), as the agent sends them and the reducer sums them."""

    def __init__(self) -> None:
        self.rows: dict[Key, StatRow] = {}

    def row(self, group: str, op: str, bucket: int) -> StatRow:
        """The row of a key, created empty."""
        key = (group, op, bucket)
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = StatRow()
        return row

    def to_wire(self) -> list[list[Any]]:
        """Rows as lists in `STATS_FIELDS` order (hist as [index, count] pairs)."""
        return [[g, op, b, r.count, r.bytes, r.timed, r.time_sum_s, r.time_max_s,
                 [[i, n] for i, n in sorted(r.hist.items())]]
                for (g, op, b), r in self.rows.items()]

    def merge_wire(self, rows: list[list[Any]]) -> None:
        """Add rows received from `to_wire`; a malformed row raises ValueError."""
        for item in rows:
            try:
                g, op, b, count, nbytes, timed, tsum, tmax, hist = item
                other = StatRow(int(count), int(nbytes), int(timed), float(tsum), float(tmax),
                                {int(i): int(n) for i, n in hist})
            except (TypeError, ValueError) as exc:
                raise ValueError(f"bad collectives.stats row {item!r}: {exc}") from None
            if not (isinstance(g, str) and isinstance(op, str) and type(b) is int):
                raise ValueError(f"bad collectives.stats key in {item!r}")
            self.row(g, op, b).merge(other)


P2P_FIELDS = ("group", "op", "src", "dst", "count", "bytes", "time_s", "timed")
"""The columns of one row of `collectives.p2p` (1.11): the group's name, "send" or "recv", the
sender's and the receiver's global ranks, how many ops and bytes, their summed duration (s) and
how many of them had one."""
P2P_OPS = ("send", "recv")
P2PKey = tuple[str, str, int, int]
"""(group name, op, src global rank, dst global rank)."""

_P2P_NAME = re.compile(r"^(?:\w+:)?(send|recv)\s+(\d+)\s*(->|<-)\s*(\d+)")


def p2p_group_ranks(profiling_name: str) -> tuple[str, int, int] | None:
    """(op, src, dst) in group ranks from an NCCL P2P entry's name ("nccl:send 0->1": this rank
    0 sends to 1; "nccl:recv 1<-0": this rank 1 receives from 0); None for any other name."""
    match = _P2P_NAME.match(profiling_name)
    if match is None:
        return None
    op, a, arrow, b = match.groups()
    left, right = int(a), int(b)
    return (op, left, right) if arrow == "->" else (op, right, left)


@dataclass
class P2PRow:
    """Send or recv ops of one (group, op, src, dst): how many, how big, how long."""

    count: int = 0
    bytes: int = 0
    time_s: float = 0.0
    """Summed duration of the `timed` ones (seconds)."""
    timed: int = 0

    def add(self, nbytes: int, seconds: float | None) -> None:
        """Count one op (`seconds`: its duration, None where unknown)."""
        self.count += 1
        self.bytes += nbytes
        if seconds is not None:
            self.time_s += seconds
            self.timed += 1

    def merge(self, other: P2PRow) -> None:
        """Add another row of the same key."""
        self.count += other.count
        self.bytes += other.bytes
        self.time_s += other.time_s
        self.timed += other.timed


def parse_p2p_row(item: Any) -> tuple[P2PKey, P2PRow]:
    """One wire row (`P2P_FIELDS`) as (key, row); ValueError for a malformed one."""
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
    """Rows by (group, op, src, dst): what an agent counts and sends (`add`, `to_wire`), and
    what a rank sent, summed over its `collectives` messages (`merge_wire`)."""

    def __init__(self) -> None:
        self.rows: dict[P2PKey, P2PRow] = {}

    def add(self, group: str, op: str, src: int, dst: int, nbytes: int,
            seconds: float | None) -> None:
        """Count one op (`seconds`: its duration, None where unknown)."""
        row = self.rows.get((group, op, src, dst))
        if row is None:
            row = self.rows[(group, op, src, dst)] = P2PRow()
        row.add(nbytes, seconds)

    def to_wire(self) -> list[list[Any]]:
        """Rows as lists in `P2P_FIELDS` order."""
        return [[g, op, src, dst, row.count, row.bytes, row.time_s, row.timed]
                for (g, op, src, dst), row in self.rows.items()]

    def merge_wire(self, rows: Any) -> int:
        """Add the rows of a message; returns how many were malformed (skipped)."""
        if not isinstance(rows, list):
            return 1
        bad = 0
        for item in rows:
            try:
                key, row = parse_p2p_row(item)
            except ValueError:
                bad += 1
                continue
            self.rows.setdefault(key, P2PRow()).merge(row)
        return bad
