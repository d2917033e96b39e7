"""Collectives across ranks: bus bandwidth, duration histograms, arrival skew and hangs.

Pure Python, shared by the hub and the dashboards (through `JobState`) and by the agent, which
aggregates what the Flight Recorder saw into rows of `CollectiveStats` before sending.

Definitions (nccl-tests, `doc/PERFORMANCE.md`): `algbw = S / t` with S the size of the whole
buffer (the gathered output of an all_gather, the scattered input of a reduce_scatter, the
buffer of an all_reduce) and `busbw = algbw * factor(op, n)`, n the ranks of the group, 1 GB =
1e9 bytes.
"""

from __future__ import annotations

import bisect
import math
import os
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from scalemon.policy import HANG_AFTER_S

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


# --- arrival skew ---------------------------------------------------------------------------

ARRIVAL_WINDOW = 100
"""Lateness samples per rank whose median is its `arrival_lateness_s`."""
PENDING_PER_GROUP = 512
"""Collectives of a group waiting for the issue times of all its ranks, at most."""
HEAT_SAMPLES = 2000
"""(issue time, lateness) samples kept per rank for the dashboard's heat map."""


class ArrivalTracker:
    """How late each rank issues the same collective (group, sequence number) as the first
    rank of its group, on the hub's clock (each rank's issue times plus its clock offset).

    A rank that computes slowly arrives last and then waits least in the collective, so its
    lateness, not the collective's duration, names it."""

    def __init__(self) -> None:
        self.members: dict[str, tuple[int, ...]] = {}
        self._member_sets: dict[str, frozenset[int]] = {}  # membership tests in O(1)
        self.pending: dict[str, dict[int, dict[int, float]]] = {}
        self.lateness: dict[int, deque[float]] = {}
        self.heat: dict[int, deque[tuple[float, float]]] = {}
        self.complete = 0

    def set_group(self, group: str, ranks: Iterable[int]) -> None:
        """The global ranks of `group` (every rank sends them; the first word stands)."""
        if group not in self.members:
            self.members[group] = tuple(sorted(ranks))
            self._member_sets[group] = frozenset(self.members[group])

    def issued(self, group: str, seq: int, rank: int, t: float) -> None:
        """Rank `rank` issued collective `seq` of `group` at hub-clock time `t`."""
        members = self._member_sets.get(group)
        if members is None or len(members) < 2 or rank not in members:
            return
        pending = self.pending.setdefault(group, {})
        times = pending.get(seq)
        if times is None:
            if len(pending) >= PENDING_PER_GROUP:  # ranks that never report it: forget
                del pending[min(pending)]
            times = pending[seq] = {}
        times[rank] = t
        if len(times) == len(members):
            del pending[seq]
            self._settle(times)

    def series(self, rank: int) -> deque[float]:
        """The lateness samples of `rank` (created empty: a view can hold it from the start)."""
        samples = self.lateness.get(rank)
        if samples is None:
            samples = self.lateness[rank] = deque(maxlen=ARRIVAL_WINDOW)
        return samples

    def _settle(self, times: dict[int, float]) -> None:
        first = min(times.values())
        self.complete += 1
        for rank, t in times.items():
            late = t - first
            self.lateness.setdefault(rank, deque(maxlen=ARRIVAL_WINDOW)).append(late)
            self.heat.setdefault(rank, deque(maxlen=HEAT_SAMPLES)).append((first, late))

    def median(self, rank: int) -> float | None:
        """Median lateness of `rank` over its last `ARRIVAL_WINDOW` collectives, or None."""
        samples = self.lateness.get(rank)
        return statistics.median(samples) if samples else None


# --- hangs ----------------------------------------------------------------------------------

HANG_AFTER_ENV = "SCALEMON_HANG_AFTER"

CAUSES = ("gone", "python", "desync", "teardown", "deadlock", "stuck")
"""Why a rank at the end of a wait-for chain holds the others up: its process is gone; it is
alive and waits in no collective (in Python: a loop, I/O, a sleep, a branch that skips the
collective); it issued another collective (op or size) than the rest of its group at the same
sequence number; it waits in teardown for ranks that finished; it waits in a cycle of ranks
that wait for each other (collectives issued in different orders); or it waits in a
collective every member issued alike (`stuck`: the network or the communication library, not
a rank: not counted as a culprit)."""


def hang_after_default(env: dict[str, str] | None = None) -> float:
    """The hang threshold: `SCALEMON_HANG_AFTER` seconds when set to a positive number, else
    `policy.HANG_AFTER_S` (a bad value is ignored: the default stands)."""
    raw = (os.environ if env is None else env).get(HANG_AFTER_ENV, "")
    try:
        value = float(raw)
    except ValueError:
        return HANG_AFTER_S
    return value if math.isfinite(value) and value > 0 else HANG_AFTER_S


def _issued(status: dict[int, dict[str, list[int]]], rank: int, group: str) -> int:
    item = status.get(rank, {}).get(group)
    return item[0] if item else 0


def _inflight_at(inflight: dict[int, list[list[Any]]], rank: int, group: str,
                 seq: int) -> list[Any] | None:
    for item in inflight.get(rank) or ():
        if len(item) >= 3 and item[0] == group and item[1] == seq:
            return item
    return None


class _Laggards:
    """Per group and issued count: the members that issued less (and the dead ones), and the
    first collective those alive did not issue; each computed once, shared by every rank that
    waits there (thousands of ranks wait in one collective)."""

    def __init__(self, status: dict[int, dict[str, list[int]]],
                 members: dict[str, tuple[int, ...]], gone: set[int], finished: set[int]) -> None:
        self.status, self.members, self.gone, self.finished = status, members, gone, finished
        self._order: dict[str, list[tuple[int, int]]] = {}
        self._found: dict[tuple[str, int], tuple[list[int], int | None]] = {}

    def of(self, group: str, issued: int) -> tuple[list[int], int | None]:
        """(ranks that issued less than `issued` of `group` or are gone, the lowest last
        issued + 1 of those alive with a status, or None)."""
        key = (group, issued)
        found = self._found.get(key)
        if found is None:
            order = self._order.get(group)
            if order is None:
                order = self._order[group] = sorted(
                    (_issued(self.status, m, group), m) for m in self.members[group])
            below = order[:bisect.bisect_left(order, (issued, -1))]
            late = sorted({m for _, m in below} | {m for m in self.members[group]
                                                   if m in self.gone})
            alive = [i for i, m in below if m not in self.gone and m not in self.finished
                     and group in self.status.get(m, {})]
            found = self._found[key] = (late, min(alive) + 1 if alive else None)
        return found


def _rank_waits(rank: int, groups: dict[str, list[int]], laggards: _Laggards,
                inflight: dict[int, list[list[Any]]]) -> list[dict[str, Any]]:
    """Every group `rank` waits in: those where it issued more than it completed."""
    waits = []
    for group, item in groups.items():
        if group not in laggards.members or not isinstance(item, (list, tuple)) or len(item) != 2:
            continue
        issued, completed = item
        if issued <= completed:
            continue
        late, first = laggards.of(group, issued)
        if rank in late:  # gone itself: not waiting
            late = [m for m in late if m != rank]
        seq = first if first is not None else completed + 1
        entry = _inflight_at(inflight, rank, group, seq)
        waits.append({"group": group, "seq": seq, "op": entry[2] if entry else None,
                      "t": entry[3] if entry and len(entry) > 3 else None, "for": late})
    # the binding wait: one that waits for ranks, the latest issued of those
    waits.sort(key=lambda w: (not w["for"], -(w["t"] or 0.0),
                              -len(laggards.members[w["group"]]), w["group"]))
    return waits


def _desync(group: str, seq: int, ranks: tuple[int, ...],
            inflight: dict[int, list[list[Any]]]) -> dict[str, Any] | None:
    """Members of `group` that issued another op or size as #seq than the most did, or None
    (also when too few members sent what they issued)."""
    issued: dict[tuple[Any, Any], list[int]] = {}
    for rank in ranks:
        entry = _inflight_at(inflight, rank, group, seq)
        if entry is not None:
            size = entry[4] if len(entry) > 4 else None
            issued.setdefault((entry[2], size), []).append(rank)
    if len(issued) < 2:
        return None
    kinds = sorted(issued.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    odd = sorted(r for _, rs in kinds[1:] for r in rs)
    return {"group": group, "seq": seq, "ranks": odd, "others": kinds[0][1],
            "issued": [{"op": o, "bytes": b, "ranks": rs} for (o, b), rs in kinds]}


def wait_for_graph(
    status: dict[int, dict[str, list[int]]], members: dict[str, tuple[int, ...]],
    gone: set[int] | frozenset[int] = frozenset(), *,
    finished: set[int] | frozenset[int] = frozenset(),
    inflight: dict[int, list[list[Any]]] | None = None,
) -> dict[str, Any] | None:
    """Who waits for whom in a hung job, and who is at the end of each chain; pure, from plain
    data, shared by the hub (heartbeats) and the Flight Recorder dump analysis.

    Inputs, all by global rank:
    - `status[rank][group] = [last_issued_seq, last_completed_seq]`, each group the rank
      belongs to (a member without an entry issued nothing in that group);
    - `members[group]`: the group's global ranks (groups not listed are ignored);
    - `gone`: ranks whose process is gone (lost, or exited with an error);
    - `finished`: ranks that ended normally (they will issue nothing more);
    - `inflight[rank]`: collectives the rank issued and has not completed, as lists
      `[group, seq, op, issue_time, nbytes]` (the last two optional): names each op, and tells
      a desync (another op or size at the same sequence number).

    A living rank waits in group G when it issued more of G than it completed; it waits for
    the members of G that issued less than it did and for G's gone members, in collective
    #(first the laggards did not issue). Following these edges from every waiting rank ends
    at ranks that wait for nobody: the culprits, each with a cause of `CAUSES` (`stuck`
    ranks are not counted as culprits). A rank that only waits for finished ranks is itself
    the end (`teardown`); ranks that only wait for each other are a `deadlock`.

    Returns None when no rank waits, else {"group", "seq" (the collective that names the
    first culprit), "culprits", "waiting" (the waiting ranks that are not culprits),
    "waits" {rank: {"group", "seq", "op", "t", "for"}}, "causes" {rank: {"cause", ...}},
    "chains" (paths from ranks nobody waits for to a culprit), "desync" (list)}."""
    inflight = inflight or {}
    gone, finished = set(gone), set(finished)
    waits: dict[int, dict[str, Any]] = {}
    laggards = _Laggards(status, members, gone, finished)
    for rank, groups in status.items():
        if rank in gone or rank in finished or not isinstance(groups, dict):
            continue
        found = _rank_waits(rank, groups, laggards, inflight)
        if found:
            waits[rank] = found[0]
    if not waits:
        return None
    causes: dict[int, dict[str, Any]] = {}
    desyncs: list[dict[str, Any]] = []
    checked: dict[tuple[str, int], dict[str, Any] | None] = {}
    alive_of: dict[int, list[int]] = {}  # per list of awaited ranks (shared): the unfinished
    for rank, wait in sorted(waits.items()):
        awaited = alive_of.get(id(wait["for"]))
        seen = awaited is not None
        if awaited is None:
            awaited = alive_of[id(wait["for"])] = [r for r in wait["for"] if r not in finished]
        if wait["for"] and not awaited:
            causes[rank] = {"cause": "teardown", "for": wait["for"]}
        elif not wait["for"]:
            key = (wait["group"], wait["seq"])
            if key not in checked:
                checked[key] = _desync(*key, members[wait["group"]], inflight)
                if checked[key] is not None:
                    desyncs.append(checked[key])
                    for odd in checked[key]["ranks"]:
                        causes[odd] = {"cause": "desync", "group": key[0], "seq": key[1]}
            if checked[key] is None:
                causes[rank] = {"cause": "stuck"}
        for r in () if seen else awaited:
            if r in gone:
                causes[r] = {"cause": "gone"}
            elif r not in waits:
                causes[r] = {"cause": "python"}
    for rank in _cycles(waits, causes, finished):
        causes[rank] = {"cause": "deadlock", "for": waits[rank]["for"]}
    for desync in desyncs:  # ranks of the majority wait for the odd ones
        for other in desync["others"]:
            if other in waits and other not in causes:
                waits[other]["for"] = sorted(set(waits[other]["for"]) | set(desync["ranks"]))
    culprits = sorted(r for r, c in causes.items() if c["cause"] != "stuck")
    group, seq = _primary(waits, culprits)
    blamed = set(culprits)
    return {
        "group": group, "seq": seq, "culprits": culprits,
        "waiting": sorted(r for r in waits if r not in blamed),
        "waits": waits, "causes": causes, "desync": desyncs,
        "chains": _chains(waits, causes),
    }


def _cycles(waits: dict[int, dict[str, Any]], causes: dict[int, dict[str, Any]],
            finished: set[int]) -> list[int]:
    """Waiting ranks that reach no culprit: those on cycles of ranks waiting for each other
    (and those that only wait for them)."""
    ends = set(causes)
    reach: dict[int, bool] = dict.fromkeys(ends, True)
    changed = True
    while changed:  # a fixed point: at most one pass per link of the longest chain
        changed = False
        for rank, wait in waits.items():
            if not reach.get(rank) and any(reach.get(r) for r in wait["for"]
                                           if r not in finished):
                reach[rank] = changed = True
    stuck = {r for r in waits if not reach.get(r)}
    if not stuck:
        return []
    # peel the ranks nobody in `stuck` waits for: what remains lies on cycles
    remaining = set(stuck)
    while True:
        awaited = {r for rank in remaining for r in waits[rank]["for"]}
        peel = {r for r in remaining if r not in awaited}
        if not peel:
            return sorted(remaining)
        remaining -= peel


def _primary(waits: dict[int, dict[str, Any]], culprits: list[int]) -> tuple[Any, Any]:
    """The collective that names the first culprit: the one most ranks wait in directly for
    it (or that it waits in itself), larger groups first."""
    if not culprits:
        wait = waits[min(waits)]
        return wait["group"], wait["seq"]
    first = culprits[0]
    counts: dict[tuple[str, int], int] = {}
    has_first: dict[int, bool] = {}  # per shared list of awaited ranks
    for rank, wait in waits.items():
        key = id(wait["for"])
        if key not in has_first:
            has_first[key] = first in wait["for"]
        if has_first[key] or rank == first:
            key = (wait["group"], wait["seq"])
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        return None, None
    group, seq = min(counts, key=lambda k: (-counts[k], k))
    return group, seq


CHAINS_MAX = 32


def _chains(waits: dict[int, dict[str, Any]], causes: dict[int, dict[str, Any]]) -> list[list[int]]:
    """One path per rank nobody waits for, from it through the ranks it waits for (those that
    wait themselves first) to where the path ends (a culprit, or a rank met before), at most
    `CHAINS_MAX`."""
    lists = {id(w["for"]): w["for"] for w in waits.values()}  # shared: each once
    awaited = {r for ranks in lists.values() for r in ranks}
    roots = sorted(r for r in waits if r not in awaited)
    if not roots:  # every waiting rank is awaited: a cycle; start at the smallest rank
        roots = [min(waits)]
    chains = []
    for root in roots[:CHAINS_MAX]:
        path = [root]
        while path[-1] in waits and (path[-1] not in causes or len(path) == 1):
            nxt = waits[path[-1]]["for"]
            # the longest way: through ranks that wait themselves, then to a culprit
            step = next((r for r in nxt if r in waits and r not in causes and r not in path),
                        next((r for r in nxt if r in causes), nxt[0])) if nxt else None
            if step is None or step in path:
                break
            path.append(step)
        chains.append(path)
    return chains


def find_culprits(
    status: dict[int, dict[str, list[int]]], members: dict[str, tuple[int, ...]],
    gone: set[int], **options: Any,
) -> dict[str, Any] | None:
    """Who holds up whom, from each rank's last issued and completed collective per group
    (`status[rank][group] = [last_issued_seq, last_completed_seq]`): `wait_for_graph`
    (`options`: its `finished` and `inflight`). The culprits are the ranks at the ends of the
    wait-for chains, not every rank missing from some group; when every rank issued what it
    waits in (alike), there is none and the waiting ranks are all named. Returns
    {"group", "seq", "culprits", "waiting", ...} or None when no rank waits."""
    return wait_for_graph(status, members, gone, **options)
