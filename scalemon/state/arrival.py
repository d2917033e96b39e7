"""When each rank issues each collective, per process group: the arrival skew that names
stragglers (a rank late to every collective makes the others wait in it). Part of the
`JobState`; reset-safe and bounded."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable

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
