"""`JobFold`: a job's history folded into what a dashboard draws.

Besides the shared `JobState` reducer it keeps, per rank, bounded series of every metric
(x = step; a rank's arrival lateness at collectives after each `collectives` message), its
step rate samples and its compute time against the median rank (smoothed), and
job-wide min/mean/max of the plotted metrics per step.

The hub folds every record into one of these as it stores it, so a dashboard that attaches late
starts from the hub's fold (`scalemon.link.seed`) instead of replaying the whole history: what it
costs does not grow with the length of the run. From `SERIES_ALL_BELOW` ranks on the per-rank
series are kept only for the ranks in `watched` (the hub keeps none): a dashboard asks for
them when it shows a rank, so neither side holds series for thousands of ranks.
"""

from __future__ import annotations

import statistics
from array import array
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from scalemon import metrics
from scalemon.policy import HANG_AFTER_S
from scalemon.protocol import HUB_RANK, Message
from scalemon.state.jobstate import JobState, RankView
from scalemon.state.series import Marks, Series
from scalemon.state.stepcomm import check_step_comm
from scalemon.text.display import AGGREGATE_AT
from scalemon.throughput import TokenWindow

STEP_WINDOW = 32
"""Steps whose cross-rank aggregate is still open; older ones are closed with what arrived."""
EMA = 0.3
SERIES_ALL_BELOW = AGGREGATE_AT
"""Below this world size every rank's series are kept; from it on only the watched ranks'."""

AGGREGATED = tuple(m.name for m in metrics.AGGREGATED)
"""Metrics whose min/mean/max over ranks the overview plots draw (`Show.overview`)."""
AGGREGATED_STEP = tuple(m.name for m in metrics.AGGREGATED if m.source == "step")
AGGREGATED_ROW = (*AGGREGATED_STEP, *(name for name in AGGREGATED if name not in AGGREGATED_STEP))
"""The order of a `StepAcc` row: the step body's aggregated fields, then the derived ones."""
AGGREGATED_DERIVED = AGGREGATED_ROW[len(AGGREGATED_STEP):]
NAN = float("nan")
_NAN_STEP = (NAN,) * len(AGGREGATED_STEP)
_NAN_DERIVED = (NAN,) * len(AGGREGATED_DERIVED)
_NUMBER_TYPES = frozenset((float, int))
_FOLDED = tuple(m for m in metrics.METRICS if m in metrics.PLOTTED or m.aggregated)
STEP_PLOTTED = tuple(m.name for m in _FOLDED if m.source == "step")
EXTRA_PLOTTED = tuple(m.name for m in _FOLDED if m.source == "extra")
HEARTBEAT_PLOTTED = tuple(m.name for m in _FOLDED if m.source == "heartbeat")
MAX_EXTRA_SERIES = 16
"""Numeric `log(**extra)` names plotted per rank (the first ones seen) besides the table's."""


class RankTrack:
    """The per-rank history the reducer does not keep."""

    __slots__ = ("series", "extras", "skipped", "samples", "cap", "_rate", "_rate_of")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.series: dict[str, Series] = {}  # by metric name, values in the metric's wire unit
        self.extras: dict[str, Series] = {}  # numeric log(**extra) names not in the table
        self.skipped = Marks()
        self.samples: deque[tuple[float, int]] = deque(maxlen=24)  # (t, step)
        self._rate: float | None = None
        self._rate_of: tuple[float, int] | None = None  # the sample it ends with

    def add(self, name: str, x: float, value: float) -> None:
        """Append to series `name`, made on first use."""
        series = self.series.get(name)
        if series is None:
            series = self.series[name] = Series(self.cap)
        series.add(x, value)

    def add_extra(self, name: str, x: float, value: float) -> None:
        """Append to the series of extra value `name` (up to MAX_EXTRA_SERIES names)."""
        series = self.extras.get(name)
        if series is None:
            if len(self.extras) >= MAX_EXTRA_SERIES:
                return
            series = self.extras[name] = Series(self.cap)
        series.add(x, value)

    def add_step_series(self, body: dict[str, Any], values: dict[str, float]) -> None:
        """The series of one `step` body (`values`: its `step_values`)."""
        step = body["step"]
        for name, value in values.items():
            self.add(name, step, value)
        for name, value in extra_values(body).items():
            self.add_extra(name, step, value)

    def add_heartbeat_series(self, body: dict[str, Any], step: int | None) -> None:
        """The series of one `heartbeat` body, at its step (else `step`, else 0)."""
        x = body.get("step")
        x = float(x if isinstance(x, int) else (step or 0))
        for name, value in heartbeat_values(body).items():
            self.add(name, x, value)

    def steps_per_s(self, now: float) -> float | None:
        """Steps/s over the last 10 s of samples; 0 when nothing came for 5 s. Kept until the
        next sample: the header asks every rank at every redraw. (Tokens/s is the rank's
        `tokens_per_s`, `scalemon.throughput`.)"""
        if len(self.samples) < 2:
            return None
        last = self.samples[-1]
        t1, s1 = last
        if now - t1 > 5.0:
            return 0.0
        if last is not self._rate_of:  # a new sample since: recount (else: as before)
            self._rate_of = last
            t0, s0 = next((s for s in self.samples if s[0] >= t1 - 10.0), self.samples[0])
            self._rate = None if t1 <= t0 else (s1 - s0) / (t1 - t0)
        return self._rate


class StepAcc:
    """One step's values over the ranks, reduced when the step closes (`bands`): each rank's
    row of the `AGGREGATED_ROW` values one after another in `values` (NaN: absent or not a
    number; a flat array, so that a step of thousands of ranks adds no objects for the
    garbage collector to walk), and each rank's compute time for the median."""

    __slots__ = ("ranks", "values", "compute")

    def __init__(self) -> None:
        self.ranks = 0
        self.values = array("d")
        self.compute: dict[int, float] = {}

    def add(self, row: list[Any]) -> None:
        """Add one rank's row (`AGGREGATED_ROW` order): numbers kept, anything else NaN."""
        if _NUMBER_TYPES.issuperset(map(type, row)):  # bools are not numbers here
            self.values.fromlist(row)
        else:
            self.values.fromlist([float(v) if type(v) is float or type(v) is int else NAN
                                  for v in row])

    def bands(self) -> Iterator[tuple[str, float, float, float]]:
        """(metric, min, max, mean) of each `AGGREGATED_ROW` metric some rank had a finite
        number for (the sum in arrival order)."""
        width = len(AGGREGATED_ROW)
        for i, name in enumerate(AGGREGATED_ROW):
            column = self.values[i::width].tolist()
            total = sum(column)
            if total - total != 0.0:  # a NaN or an inf among them (or a sum past the floats)
                column = [v for v in column if v - v == 0.0]  # the finite ones
                total = sum(column)
            if column:  # no NaN: min, max and sum in C, the same numbers as the filtered list's
                yield name, min(column), max(column), total / len(column)


def _expected_at_steps(view: RankView) -> bool:
    """Whether a rank counts among those each step waits for: running, and it completed one."""
    return view.state == "running" and view.steps_received > 0


def record_key(msg: Message) -> tuple:
    """What identifies a record across hub restarts: sender, its seq, type and time."""
    return (msg.rank, msg.seq, msg.type, msg.t)


def _numbers(values: dict[str, Any], names: tuple[str, ...]) -> dict[str, float]:
    """The numeric ones among `values[name]` for `names`, as floats; others left out (bools
    too: msgpack gives exact types, so a type test is the whole check)."""
    out: dict[str, float] = {}
    get = values.get
    for name in names:
        value = get(name)
        kind = type(value)
        if kind is float or kind is int:
            out[name] = float(value)
    return out


def step_values(body: dict[str, Any], derived: dict[str, float]) -> dict[str, float]:
    """The plotted numbers of one `step` body by metric name, in wire units (seconds, bytes),
    with the well-known extras; absent ones left out; then the step's `derived` metrics
    (`metrics.derived_values`: compute time, the rank's tokens/s as of the step)."""
    out = _numbers(body, STEP_PLOTTED)
    extra = body.get("extra")
    if extra:
        out.update(_numbers(extra, EXTRA_PLOTTED))
    for name, value in derived.items():
        out.setdefault(name, value)
    return out


def extra_values(body: dict[str, Any]) -> dict[str, float]:
    """The numeric `log(**extra)` values of a `step` body that the table does not name."""
    extra = body.get("extra")
    if not extra:
        return {}
    return _numbers(extra, tuple(name for name in extra if name not in metrics.BY_NAME))


def step_comm_times(rows: Any) -> list[tuple[float, int]]:
    """(all-reduce seconds, step) of the well-formed, timed rows of a `collectives.steps`."""
    out = []
    for row in rows or ():
        try:
            check_step_comm(row)
        except ValueError:
            continue
        if row[3] is not None:
            out.append((float(row[3]), row[0]))
    return out


def heartbeat_values(body: dict[str, Any]) -> dict[str, float]:
    """The plotted numbers of one `heartbeat` body by metric name, in wire units."""
    return _numbers(body, HEARTBEAT_PLOTTED)


@dataclass
class SeriesBackfill:
    """What `JobFold.backfill` folded into a watched rank's series."""

    records: int
    first_step: int | None  # the earliest step among them (None: no step record)


class JobFold:
    """A job's records folded in history order (`apply`). `cap` fixes the buckets of every
    per-rank series (default: 512 up to 64 ranks, else 256); `hang_after_s`: a job where no
    rank completed a step for this long is hung (`reports.hangs.job_hang`)."""

    def __init__(self, job: str | None = None, cap: int | None = None,
                 hang_after_s: float = HANG_AFTER_S, world_size: int | None = None) -> None:
        self._job = job
        self._cap = cap
        self._hang_after_s = hang_after_s
        self._world_size = world_size
        self.watched: set[int] = set()
        """Ranks whose series are kept in a job of SERIES_ALL_BELOW ranks or more."""
        self.clear()

    def clear(self) -> None:
        """Forget every record folded (the watched ranks stay watched)."""
        self.state = JobState(job=self._job, world_size=self._world_size,
                              hang_after_s=self._hang_after_s)
        self.next_seq = 0  # record number of the next record expected
        self.last_key: tuple | None = None  # identity of the last record folded
        self.records = 0
        self.by_type: dict[str, int] = {}
        self.tracks: dict[int, RankTrack] = {}
        self.agg: dict[str, Series] = {name: Series(1024) for name in AGGREGATED}
        self.skipped = Marks()
        self._open: dict[int, StepAcc] = {}
        self._comm_open: dict[int, list[float]] = {}  # step -> [ranks, lo, hi, sum] (recorder)
        self._closed: deque[int] = deque(maxlen=4 * STEP_WINDOW)
        self._expected: int | None = None
        """The ranks expected at each step (`_running_ranks`), kept up to date as records
        change a rank's state; None: counted at the next step."""
        self.last_step_t: float | None = None

    # ---- folding ---------------------------------------------------------------------------

    def apply(self, seq: int, msg: Message) -> None:
        """Fold record number `seq` in (records come in history order)."""
        self._apply(msg)
        self.next_seq = seq + 1
        self.last_key = (msg.rank, msg.seq, msg.type, msg.t)  # record_key(msg), inlined

    def big(self) -> bool:
        """True for a job of SERIES_ALL_BELOW ranks or more (per-rank series only when
        watched)."""
        world = self.state.world_size or len(self.state.ranks)
        return world >= SERIES_ALL_BELOW

    def keeps_series(self, rank: int) -> bool:
        """True when rank `rank`'s series are kept."""
        return rank in self.watched or not self.big()

    def _cap_now(self) -> int:
        if self._cap:
            return self._cap
        world = self.state.world_size or len(self.state.ranks)
        return 512 if world <= 64 else 256

    def track(self, rank: int) -> RankTrack:
        """The per-rank history of `rank`, made on first use."""
        track = self.tracks.get(rank)
        if track is None:
            track = self.tracks[rank] = RankTrack(self._cap_now())
        return track

    def _apply(self, msg: Message) -> None:
        self.records += 1
        mtype, rank = msg.type, msg.rank
        by_type = self.by_type
        by_type[mtype] = by_type.get(mtype, 0) + 1
        state = self.state
        # the one rank whose state a record can change: its sender's, or a hub record's target
        changed = rank if rank != HUB_RANK else msg.body.get("target")
        before = state.ranks.get(changed) if type(changed) is int else None
        counted = before is not None and _expected_at_steps(before)
        try:
            view = state.apply(msg)
        except Exception:  # a record the reducer failed on, part done: counted at the next step
            self._expected = None
            raise
        if self._expected is not None and type(changed) is int:
            after = state.ranks.get(changed)
            now = after is not None and _expected_at_steps(after)
            if now != counted:  # one rank more or fewer to expect at each step
                self._expected += 1 if now else -1
        if view is None:  # hub record (rank_state)
            return
        if mtype == "step":
            self._on_step(msg, view)
        elif mtype == "heartbeat":
            if rank in self.watched or not self.big():  # keeps_series(rank)
                self.track(rank).add_heartbeat_series(msg.body, view.step)
        elif mtype == "collectives":
            if self.keeps_series(msg.rank):
                late = view.value("arrival_lateness_s")
                x = msg.body.get("step")
                x = x if isinstance(x, int) else view.step
                if late is not None and x is not None:
                    self.track(msg.rank).add("arrival_lateness_s", float(x), late)
            rows = msg.body.get("steps")
            if rows and not view.comm_hook:
                self._on_step_comm(msg.rank, rows)

    def _on_step(self, msg: Message, view: RankView) -> None:
        rank, body, t = msg.rank, msg.body, msg.t
        step = body["step"]
        track = self.tracks.get(rank) or self.track(rank)
        if rank in self.watched or not self.big():
            track.add_step_series(body, step_values(body, view.derived))  # derived by the state
        if body.get("skipped"):
            track.skipped.add(step)
            self.skipped.add(step)
        samples = track.samples
        if not samples or t - samples[-1][0] >= 0.5:
            samples.append((t, step))
        if self.last_step_t is None or t > self.last_step_t:
            self.last_step_t = t
        self._accumulate(rank, step, body, view.derived)

    def _accumulate(self, rank: int, step: int, body: dict[str, Any],
                    derived: dict[str, float]) -> None:
        """Rank `rank`'s values at `step` into the step's aggregate (reduced when it closes)."""
        acc = self._open.get(step)
        if acc is None:
            if step in self._closed:
                return  # arrived after its step was closed: kept per rank only
            acc = self._open[step] = StepAcc()
        acc.ranks += 1
        row = list(map(body.get, AGGREGATED_STEP, _NAN_STEP))  # absent: NaN
        row += map(derived.get, AGGREGATED_DERIVED, _NAN_DERIVED)
        acc.add(row)
        compute = derived.get("compute_s")
        if compute is not None:
            acc.compute[rank] = compute
        if self._expected is None:
            self._expected = self._running_ranks()
        if acc.ranks >= self._expected:
            self._close(step)
        if len(self._open) > STEP_WINDOW:
            for old in sorted(self._open)[: len(self._open) - STEP_WINDOW]:
                self._close(old)

    def _running_ranks(self) -> int:
        """The ranks expected at each step: running ones that completed a step (counted over
        every rank: once, then `_apply` follows each record's change; before, a count after
        each change made a big job's wave of rank states cost ranks x changes)."""
        return sum(1 for v in self.state.ranks.values() if _expected_at_steps(v))

    def _on_step_comm(self, rank: int, rows: Any) -> None:
        """The recorder's per-step all-reduce time of `rank` (`collectives.steps`, seconds
        after the steps): into its series and the cross-rank band of those steps."""
        keep = self.keeps_series(rank)
        for seconds, step in step_comm_times(rows):
            if keep:
                self.track(rank).add("allreduce_time_s", step, seconds)
            self._comm_accumulate(step, seconds)

    def _comm_accumulate(self, step: int, seconds: float) -> None:
        acc = self._comm_open.get(step)
        if acc is None:
            acc = self._comm_open[step] = [0, seconds, seconds, 0.0]
        acc[0] += 1
        acc[1], acc[2], acc[3] = min(acc[1], seconds), max(acc[2], seconds), acc[3] + seconds
        if self._expected is None:
            self._expected = self._running_ranks()
        if acc[0] >= self._expected:
            self._comm_close(step)
        if len(self._comm_open) > STEP_WINDOW:
            for old in sorted(self._comm_open)[: len(self._comm_open) - STEP_WINDOW]:
                self._comm_close(old)

    def _comm_close(self, step: int) -> None:
        n, lo, hi, total = self._comm_open.pop(step)
        self.agg["allreduce_time_s"].add(step, lo, hi, total / n)

    def _close(self, step: int) -> None:
        acc = self._open.pop(step)
        self._closed.append(step)
        for name, lo, hi, mean in acc.bands():
            self.agg[name].add(step, lo, hi, mean)
        if len(acc.compute) >= 2:
            median = statistics.median(acc.compute.values())
            for rank, c in acc.compute.items():
                view = self.state.ranks.get(rank)
                if view is None:
                    continue
                slower, before = c - median, view.compute_over_median_s
                view.compute_over_median_s = slower if before is None else (
                    (1 - EMA) * before + EMA * slower)

    # ---- the series of a watched rank in a big job -------------------------------------------

    def needs_backfill(self, rank: int) -> bool:
        """True when showing `rank`'s series needs its earlier records (a big job's rank not
        watched yet)."""
        return rank not in self.watched and self.big()

    def watch(self, rank: int, messages: list[Message] | None = None) -> SeriesBackfill:
        """Keep `rank`'s series from now on, starting from `messages`: its records from before
        `next_seq`, in history order (from the hub; None where it could not give them).
        Only its series are folded (the job state holds the records already); its arrival
        lateness, which needs every rank's records, starts now."""
        track = self.track(rank)
        if not self.needs_backfill(rank):
            self.watched.add(rank)
            return SeriesBackfill(0, None)
        track.series, track.extras = {}, {}
        first: int | None = None
        step: int | None = None
        view = self.state.ranks.get(rank)
        own_rate = view is not None and "tokens_per_s" in view.extra
        window = TokenWindow()  # its tokens/s as of each step, as the state folded it
        for msg in messages or ():
            if msg.rank != rank:
                continue
            if msg.type == "step":
                step = msg.body["step"]
                first = step if first is None else min(first, step)
                window.add(msg.body.get("tokens"), msg.body.get("step_time_s"))
                derived = metrics.derived_values(msg.body, None if own_rate else window.rate())
                track.add_step_series(msg.body, step_values(msg.body, derived))
            elif msg.type == "hello":  # a new process: no step ended before its first
                window.clear()
            elif msg.type == "heartbeat":
                track.add_heartbeat_series(msg.body, step)
            elif msg.type == "collectives" and view is not None and not view.comm_hook:
                for seconds, comm_step in step_comm_times(msg.body.get("steps")):
                    track.add("allreduce_time_s", comm_step, seconds)
        self.watched.add(rank)
        return SeriesBackfill(len(messages or ()), first)
