"""When each rank issues each collective, per process group: the arrival skew that names
stragglers (a rank late to every collective makes the others wait in it). Part of the
`JobState`; reset-safe and bounded."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable

# --- arrival skew ---------------------------------------------------------------------------

ARRIVAL_WINDOW = 100
"""Lateness samples per rank whose median is its `arrival_lateness_s` (fewer in a big job)."""
ARRIVAL_BUDGET = 1_000_000
"""Lateness samples kept over every rank, at most: `ARRIVAL_WINDOW` a rank up to 10,000
ranks, 61 at 16,384 (`arrival_window`): 100 a rank made 15 MB of a 16,384-rank seed."""
PENDING_PER_GROUP = 512
"""Collectives of a group waiting for the issue times of all its ranks, at most."""
HEAT_SPAN_S = 600.0
"""The dashboard's heat map covers at most the last this many seconds."""
HEAT_BUDGET = 250_000
"""Heat cells kept over every rank, at most: a rank keeps those of the last `HEAT_SPAN_S`,
each `heat_cell_s` wide (1 s up to 416 ranks, 39 s at 16,384: 16 cells). A sample per
collective (2,000 a rank, before) took 213 KB a rank after 2,000 collectives: 3.5 GB at
16,384 ranks, and a seed far over its limit."""


def arrival_window(world: int) -> int:
    """How many lateness samples a rank of a job of `world` ranks keeps for its median."""
    return max(16, min(ARRIVAL_WINDOW, ARRIVAL_BUDGET // max(1, world)))


def heat_cell_s(world: int) -> float:
    """How long a heat cell of a job of `world` ranks lasts: its samples are summed in it."""
    return max(1.0, HEAT_SPAN_S * world / HEAT_BUDGET)


class ArrivalTracker:
    """How late each rank issues the same collective (group, sequence number) as the first
    rank of its group, on the hub's clock (each rank's issue times plus its clock offset).

    A rank that computes slowly arrives last and then waits least in the collective, so its
    lateness, not the collective's duration, names it."""

    world = 0
    """The job's size as known so far (its world size, its largest group): how many lateness
    samples a rank keeps (`arrival_window`) and the heat cells' width (`heat_cell_s`)."""

    def __init__(self) -> None:
        self.members: dict[str, tuple[int, ...]] = {}
        self._member_sets: dict[str, frozenset[int]] = {}  # membership tests in O(1)
        self.pending: dict[str, dict[int, dict[int, float]]] = {}
        self.lateness: dict[int, deque[float]] = {}
        self.heat: dict[int, deque[tuple[float, float, int]]] = {}
        """Per rank, its heat cells in time order: (the cell's start, a multiple of
        `heat_cell_s`; the sum of the lateness of the collectives first issued in it; how
        many)."""
        self.complete = 0

    def __setstate__(self, state: dict) -> None:
        """A tracker pickled before `world` was kept has it made from its groups."""
        self.__dict__.update(state)
        if "world" not in state:
            self.world = max(map(len, self.members.values()), default=0)

    def set_group(self, group: str, ranks: Iterable[int]) -> None:
        """The global ranks of `group` (every rank sends them; the first word stands)."""
        if group not in self.members:
            self.members[group] = tuple(sorted(ranks))
            self._member_sets[group] = frozenset(self.members[group])
            self.world = max(self.world, len(self.members[group]))

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
            samples = self.lateness[rank] = deque(maxlen=arrival_window(self.world))
        return samples

    def _settle(self, times: dict[int, float]) -> None:
        first = min(times.values())
        self.complete += 1
        cell_s, window = heat_cell_s(self.world), arrival_window(self.world)
        start = math.floor(first / cell_s) * cell_s  # cells on one grid: none overlap
        lateness, heat = self.lateness, self.heat
        for rank, t in times.items():
            late = t - first
            samples = lateness.get(rank)
            if samples is None:
                samples = lateness[rank] = deque(maxlen=window)
            samples.append(late)
            cells = heat.get(rank)
            if cells is None:
                cells = heat[rank] = deque(maxlen=math.ceil(HEAT_SPAN_S / cell_s))
            if cells and cells[-1][0] == start and len(last := cells[-1]) == 3:
                cells[-1] = (start, last[1] + late, last[2] + 1)  # the same cell
            else:
                cells.append((start, late, 1))

    def median(self, rank: int) -> float | None:
        """Median lateness of `rank` over its last `arrival_window` collectives, or None."""
        samples = self.lateness.get(rank)
        return statistics.median(samples) if samples else None
