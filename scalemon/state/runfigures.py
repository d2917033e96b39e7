"""What a summary reads of a run's history, in a form of bounded size: `RunFigures`.

`summarize` (scalemon.reports.summary) takes its numbers from `RunFigures`, made either from
every record of the history kept in memory (`reports.summary.figures_of`, exact) or from a
`RunDigest` (scalemon.state.digest) folded once and checkpointed beside the history, which
holds only counters, maxima, per-step sums and `Quantiles`: a 100M-record history sums up in
seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

EXACT_MAX = 4096
"""A `Quantiles` keeps its values exactly up to this many, then in buckets."""
ALPHA = 0.005
"""The relative error of a bucketed quantile: the value it gives is within 0.5% of the value at
the quantile's rank (or, interpolated, of a value between the two nearest)."""
_GAMMA = (1 + ALPHA) / (1 - ALPHA)
_LOG_GAMMA = math.log(_GAMMA)
_BIAS = 1 << 20


def finite(value: Any) -> float | None:
    """`value` as a float when it is a finite number, else None."""
    if type(value) in (int, float) and math.isfinite(value):
        return float(value)
    return None


def exact_quantile(values: Iterable[float], q: float) -> float | None:
    """The `q` quantile (0..1) of the finite `values`, interpolated linearly between the two
    nearest (numpy's default); None without one."""
    data = sorted(v for v in values if finite(v) is not None)
    if not data:
        return None
    at = q * (len(data) - 1)
    low = math.floor(at)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (at - low)


class Quantiles:
    """Finite numbers for their quantiles: exact up to `cap` of them, beyond that counted in
    log-spaced buckets (a DDSketch: relative error `ALPHA`, mergeable, a few hundred buckets
    for values spanning a factor of ten)."""

    __slots__ = ("values", "buckets", "n", "cap")

    def __init__(self, cap: float = EXACT_MAX) -> None:
        self.values: list[float] | None = []
        self.buckets: dict[int, int] | None = None
        self.n = 0
        self.cap = cap

    def add(self, value: Any) -> None:
        """Count `value` when it is a finite number."""
        if type(value) not in (int, float) or not math.isfinite(value):
            return
        self.n += 1
        if self.values is not None:
            self.values.append(float(value))
            if len(self.values) > self.cap:
                self._to_buckets()
        else:
            key = _bucket(value)
            buckets = self.buckets
            assert buckets is not None
            buckets[key] = buckets.get(key, 0) + 1

    def _to_buckets(self) -> None:
        values, self.values, self.buckets = self.values or [], None, {}
        for value in values:
            key = _bucket(value)
            self.buckets[key] = self.buckets.get(key, 0) + 1

    @property
    def exact(self) -> bool:
        """Whether every value is kept (quantiles exact)."""
        return self.values is not None

    def quantile(self, q: float) -> float | None:
        """The `q` quantile, as `exact_quantile` computes it (within `ALPHA` once bucketed)."""
        if self.values is not None:
            return exact_quantile(self.values, q)
        if not self.n:
            return None
        at = q * (self.n - 1)
        low = math.floor(at)
        high = min(low + 1, self.n - 1)
        a, b = self._at_rank(low), self._at_rank(high)
        return a + (b - a) * (at - low)

    def _at_rank(self, rank: int) -> float:
        seen = 0
        assert self.buckets is not None
        for key in sorted(self.buckets):
            seen += self.buckets[key]
            if seen > rank:
                return _value(key)
        return _value(max(self.buckets))

    def stats(self, quantiles: Mapping[str, float]) -> dict[str, Any]:
        """{name: quantile} for `quantiles`, and `samples`: how many values."""
        out: dict[str, Any] = {name: self.quantile(q) for name, q in quantiles.items()}
        out["samples"] = self.n
        return out


def _bucket(value: float) -> int:
    if value == 0:
        return 0
    key = math.ceil(math.log(abs(value)) / _LOG_GAMMA) + _BIAS
    return key if value > 0 else -key


def _value(key: int) -> float:
    if key == 0:
        return 0.0
    mid = 2 * _GAMMA ** (abs(key) - _BIAS) / (_GAMMA + 1)
    return mid if key > 0 else -mid


def quantiles_of(values: Iterable[float]) -> Quantiles:
    """Exact `Quantiles` of `values`."""
    out = Quantiles(cap=math.inf)
    for value in values:
        out.add(value)
    return out


class StepClock:
    """When steps were completed, to the second: for each second with a step record, the
    earliest time and the latest (with its step). Gaps of a second or more between records
    (stalls) are found exactly, shorter ones not at all (two records in one second hide what
    lies between them); in size it is bounded by the run's length in seconds."""

    RESOLUTION_S = 1.0
    """The shortest stall it finds (`stalls` counts from here whatever it is asked)."""

    __slots__ = ("seconds", "first", "last")

    def __init__(self) -> None:
        self.seconds: dict[int, list[float]] = {}  # second -> [earliest t, latest t, its step]
        self.first: float | None = None
        self.last: float | None = None

    def add(self, t: float, step: int) -> None:
        """One step record sent at `t`."""
        second = math.floor(t)
        slot = self.seconds.get(second)
        if slot is None:
            self.seconds[second] = [t, t, step]
        else:
            if t < slot[0]:
                slot[0] = t
            if t > slot[1] or (t == slot[1] and step > slot[2]):
                slot[1], slot[2] = t, step
        if self.first is None or t < self.first:
            self.first = t
        if self.last is None or t > self.last:
            self.last = t

    def stalls(self, after: float | None) -> list[tuple[float, int, float]]:
        """(t0, step at t0, seconds) of every gap of at least `after` seconds between one step
        record and the next; `after` below `RESOLUTION_S` counts as that (`stall_floor`)."""
        if after is None:
            return []
        after = self.stall_floor(after)
        out = []
        slots = [self.seconds[s] for s in sorted(self.seconds)]
        for (_, t0, s0), (t1, _, _) in zip(slots, slots[1:], strict=False):
            if t1 - t0 >= after:
                out.append((t0, int(s0), t1 - t0))
        return out

    @classmethod
    def stall_floor(cls, after: float) -> float:
        """The shortest stall `stalls(after)` finds: `after`, or `RESOLUTION_S` if longer."""
        return max(after, cls.RESOLUTION_S)


@dataclass
class RunFigures:
    """The numbers `summarize` needs from a run's history."""

    last_step: dict[int, int] = field(default_factory=dict)
    """rank -> the highest step it logged."""
    step_count: int = 0
    first_step: int | None = None
    clock: StepClock = field(default_factory=StepClock)
    loss_rank: int | None = None
    loss: dict[int, float] = field(default_factory=dict)
    """step -> loss of `loss_rank`, the lowest rank that logs one (NaN included)."""
    tokens_job: Quantiles = field(default_factory=Quantiles)
    tokens_per_rank: Quantiles = field(default_factory=Quantiles)
    tokens_ranks: list[int] = field(default_factory=list)
    """The ranks whose tokens/s count for the job (`throughput.counted`)."""
    own_rate: set[int] = field(default_factory=set)
    mfu: Quantiles = field(default_factory=Quantiles)
    step_time: dict[int, Quantiles] = field(default_factory=dict)
    step_time_all: Quantiles = field(default_factory=Quantiles)
    compute_median: dict[int, float | None] = field(default_factory=dict)
    bubbles: Quantiles = field(default_factory=Quantiles)
    bubble_ranks: int = 0
    memory: dict[int, dict[str, float | None]] = field(default_factory=dict)
    """rank -> the largest `mem_allocated_bytes` and `mem_peak_bytes` of its steps."""
    heartbeat_max: dict[int, dict[str, float]] = field(default_factory=dict)
    ranks: set[int] = field(default_factory=set)
    """The ranks with step records."""
    exact: bool = True
    """False where a quantile is bucketed or a step repeated (`RunDigest`)."""


def series_of(steps: Mapping[int, Mapping[int, Mapping[str, float]]], name: str
              ) -> dict[int, dict[int, float]]:
    """rank -> step -> metric `name` (as sent, NaN included), for the steps that have it."""
    return {rank: {s: v[name] for s, v in by_step.items() if name in v}
            for rank, by_step in steps.items()}


def per_step_total(series: dict[int, dict[int, float]], combine: str,
                   total: Callable[[list[tuple[int, float]]], float | None] | None = None,
                   ) -> list[float]:
    """Per step, the ranks' values summed (`sum`) or averaged (`mean`) or `total`led: only the
    steps where every rank that reports the metric at all has a finite value."""
    ranks = [r for r, s in series.items() if s]
    if not ranks:
        return []
    steps = set.intersection(*(set(series[r]) for r in ranks))
    out = []
    for step in sorted(steps):
        values = [finite(series[r][step]) for r in ranks]
        if any(v is None for v in values):
            continue
        if total is not None:
            got = total([(r, v) for r, v in zip(ranks, values, strict=True) if v is not None])
            if got is not None:
                out.append(got)
            continue
        added = math.fsum(v for v in values if v is not None)
        out.append(added if combine == "sum" else added / len(values))
    return out
