"""`DashboardData`: everything the dashboard knows about one job, folded from hub records.

The receiver thread calls `apply_batch`; the UI thread reads through `views`, which copies what
a redraw needs while holding `lock`. Besides the shared `JobState` reducer it keeps, per rank,
bounded series of every metric (x = step; a rank's arrival lateness at collectives after
each `collectives` message), job-wide min/mean/max per step, each rank's compute time against
the median rank (smoothed) and samples for step and token rates.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from scalemon import metrics
from scalemon.jobstate import HANG_AFTER_S, JobState, RankView
from scalemon.protocol import Message
from scalemon.tui.series import Marks, Series

STEP_WINDOW = 32
"""Steps whose cross-rank aggregate is still open; older ones are closed with what arrived."""
EMA = 0.3
CHUNK = 2000
"""Records folded per lock hold, so a long history never freezes the screen."""
HOLD_S = 0.02
"""Longest the receiver holds the lock at a time, whatever the records cost to fold."""

AGGREGATED = ("loss", "loss_scale", "compute_s", "allreduce_time_s", "optimizer_time_s",
              "mem_allocated_bytes")
"""Metrics whose min/mean/max over ranks the overview plots draw."""
STEP_PLOTTED = tuple(m.name for m in metrics.PLOTTED if m.source == "step")
EXTRA_PLOTTED = tuple(m.name for m in metrics.PLOTTED if m.source == "extra")
HEARTBEAT_PLOTTED = tuple(m.name for m in metrics.PLOTTED if m.source == "heartbeat")
MAX_EXTRA_SERIES = 16
"""Numeric `log(**extra)` names plotted per rank (the first ones seen) besides the table's."""


@dataclass
class ConnState:
    """How the receiver is doing: connecting, connected, waiting, disconnected or offline."""

    status: str = "connecting"
    detail: str = ""
    since: float = field(default_factory=time.time)


class RankTrack:
    """The per-rank history the reducer does not keep."""

    __slots__ = ("series", "extras", "skipped", "samples", "tokens", "compute_ema", "cap",
                 "_rates", "_rates_of")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.series: dict[str, Series] = {}  # by metric name, values in the metric's wire unit
        self.extras: dict[str, Series] = {}  # numeric log(**extra) names not in the table
        self.skipped = Marks()
        self.samples: deque[tuple[float, int, int]] = deque(maxlen=24)  # (t, step, tokens)
        self.tokens = 0
        self.compute_ema: float | None = None
        self._rates: tuple[float | None, float | None] = (None, None)
        self._rates_of: tuple[float, int, int] | None = None  # the sample they end with

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

    def rates(self, now: float) -> tuple[float | None, float | None]:
        """(steps/s, tokens/s) over the last 10 s of samples; 0 when nothing came for 5 s.
        Kept until the next sample: the header asks every rank at every redraw."""
        if len(self.samples) < 2:
            return None, None
        last = self.samples[-1]
        t1, s1, k1 = last
        if now - t1 > 5.0:
            return 0.0, 0.0
        if last is not self._rates_of:  # a new sample since: recount (else: as before)
            self._rates_of = last
            t0, s0, k0 = next((s for s in self.samples if s[0] >= t1 - 10.0), self.samples[0])
            self._rates = ((None, None) if t1 <= t0 else
                           ((s1 - s0) / (t1 - t0), (k1 - k0) / (t1 - t0)))
        return self._rates


class LatenessMedians:
    """Each rank's median arrival lateness (`RankView.value("arrival_lateness_s")`), kept
    between redraws: a median sorts up to 100 samples, too much to redo for thousands of
    ranks at every redraw. Recomputed when a collective settled since (`ArrivalTracker.
    complete` moved): every rank at once up to `per_call` ranks, else `per_call` ranks a call
    in turn, so a redraw of a 4096-rank job redoes an eighth of them (values up to 8 redraws
    old) and never all at once."""

    def __init__(self, per_call: int = 512) -> None:
        self.per_call = per_call
        self.values: dict[int, float | None] = {}
        self._samples: dict[int, object] = {}  # the deque each value was computed from
        self._complete = -1  # ArrivalTracker.complete when the pass under way started
        self._pending: list[int] = []  # ranks of that pass still to recompute

    def get(self, state: JobState) -> dict[int, float | None]:
        """rank -> median lateness in seconds (None: no sample yet), for every known rank;
        call under the data's lock."""
        views = state.ranks
        for rank, view in views.items():  # new ranks, or a deque replaced: at once
            if self._samples.get(rank, self) is not view.lateness:
                self._compute(rank, view)
        if len(self.values) != len(views):
            for rank in [r for r in self.values if r not in views]:
                del self.values[rank], self._samples[rank]
        if not self._pending and state.arrival.complete != self._complete:
            self._complete = state.arrival.complete
            self._pending = sorted(views, reverse=True)
        if len(self._pending) <= self.per_call:
            todo, self._pending = self._pending, []
        else:
            todo, self._pending = self._pending[-self.per_call:], self._pending[:-self.per_call]
        for rank in todo:
            view = views.get(rank)
            if view is not None:
                self._compute(rank, view)
        return self.values

    def _compute(self, rank: int, view: RankView) -> None:
        samples = view.lateness
        self._samples[rank] = samples
        self.values[rank] = statistics.median(samples) if samples else None


class _StepAcc:
    """Cross-rank min/max/sum of each metric at one step, plus each rank's compute time."""

    __slots__ = ("ranks", "lo", "hi", "sum", "n", "compute")

    def __init__(self) -> None:
        self.ranks = 0
        self.lo: dict[str, float] = {}
        self.hi: dict[str, float] = {}
        self.sum: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self.compute: dict[int, float] = {}


def record_key(msg: Message) -> tuple:
    """What identifies a record across hub restarts: sender, its seq, type and time."""
    return (msg.rank, msg.seq, msg.type, msg.t)


def _number(value: Any) -> float | None:
    """A finite-or-not float from a body field; None for absent, null or non-numbers."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _numbers(values: dict[str, Any], names: tuple[str, ...]) -> dict[str, float]:
    """The numeric ones among `values[name]` for `names`, as floats; others left out."""
    out: dict[str, float] = {}
    for name in names:
        value = _number(values.get(name))
        if value is not None:
            out[name] = value
    return out


def step_values(body: dict[str, Any]) -> dict[str, float]:
    """The plotted numbers of one `step` body by metric name, in wire units (seconds, bytes),
    with the well-known extras and the dashboard's `compute_s`; absent ones left out."""
    out = _numbers(body, STEP_PLOTTED)
    extra = body.get("extra")
    if extra:
        out.update(_numbers(extra, EXTRA_PLOTTED))
    step_time = out.get("step_time_s")
    if step_time is not None:
        busy = out.get("allreduce_time_s", 0.0) + out.get("optimizer_time_s", 0.0)
        out["compute_s"] = max(0.0, step_time - busy)
    return out


def extra_values(body: dict[str, Any]) -> dict[str, float]:
    """The numeric `log(**extra)` values of a `step` body that the table does not name."""
    extra = body.get("extra")
    if not extra:
        return {}
    return _numbers(extra, tuple(name for name in extra if name not in metrics.BY_NAME))


def heartbeat_values(body: dict[str, Any]) -> dict[str, float]:
    """The plotted numbers of one `heartbeat` body by metric name, in wire units."""
    return _numbers(body, HEARTBEAT_PLOTTED)


class DashboardData:
    """Thread-safe fold of one job's records for the dashboard. `hang_after_s`: a job where no
    rank completed a step for this long is hung (`JobState.hang`)."""

    def __init__(self, job: str | None = None, cap: int | None = None,
                 hang_after_s: float = HANG_AFTER_S) -> None:
        self.lock = threading.Lock()
        self._job = job
        self._cap = cap
        self._hang_after_s = hang_after_s
        self.version = 0  # bumped on every change the screen may show
        self.conn = ConnState()
        self.rejected = 0  # records the receiver could not decode
        self.loss_mode = "auto"  # "auto", "ranks" or "band"
        self._reset()

    def _reset(self) -> None:
        self.state = JobState(job=self._job, hang_after_s=self._hang_after_s)
        self.next_seq = 0  # record number of the next record expected from the hub
        self.history_identity: dict | None = None  # of the history the records came from
        self.last_key: tuple | None = None  # identity of the last record folded
        self.records = 0
        self.by_type: dict[str, int] = {}
        self.tracks: dict[int, RankTrack] = {}
        self.agg: dict[str, Series] = {name: Series(1024) for name in AGGREGATED}
        self.skipped = Marks()
        self._open: dict[int, _StepAcc] = {}
        self._closed: deque[int] = deque(maxlen=4 * STEP_WINDOW)
        self._expected: int | None = None  # ranks expected at each step; None = recount
        self.last_step_t: float | None = None
        self.lateness = LatenessMedians()

    # ---- receiver side -------------------------------------------------------------------

    def reset(self) -> None:
        """Forget everything (the hub's history was recreated)."""
        with self.lock:
            self._reset()
            self.version += 1

    def set_hang_after(self, seconds: float) -> None:
        """Call the job hung after `seconds` without a completed step (kept across resets)."""
        with self.lock:
            self._hang_after_s = self.state.hang_after_s = seconds
            self.version += 1

    def set_conn(self, status: str, detail: str = "") -> bool:
        """Record the receiver's status; True when it changed."""
        with self.lock:
            if self.conn.status == status and self.conn.detail == detail:
                return False
            since = self.conn.since if self.conn.status == status else time.time()
            self.conn = ConnState(status, detail, since)
            self.version += 1
            return True

    def apply_batch(self, batch: Iterable[tuple[int, Message]]) -> None:
        """Fold (record number, message) pairs in, up to CHUNK per lock hold and for at
        most HOLD_S at a time (thousands of ranks: a few hundred records), so a redraw
        waiting for the lock waits little; between holds the thread lets others run."""
        batch = list(batch)
        start = 0
        while start < len(batch):
            with self.lock:
                until = time.perf_counter() + HOLD_S
                for seq, msg in batch[start:start + CHUNK]:
                    self._apply(msg)
                    self.next_seq = seq + 1
                    self.last_key = record_key(msg)
                    start += 1
                    if time.perf_counter() > until:
                        break
                self.version += 1
            if start < len(batch):
                time.sleep(0)  # let a thread waiting for the lock (the UI) take it

    def apply_messages(self, messages: Iterable[Message]) -> None:
        """Fold messages that carry no record numbers (a replay)."""
        self.apply_batch((self.next_seq + i, m) for i, m in enumerate(messages))

    def _cap_now(self) -> int:
        if self._cap:
            return self._cap
        world = self.state.world_size or len(self.state.ranks)
        return 512 if world <= 64 else 256

    def _track(self, rank: int) -> RankTrack:
        track = self.tracks.get(rank)
        if track is None:
            track = self.tracks[rank] = RankTrack(self._cap_now())
            self._expected = None
        return track

    def _apply(self, msg: Message) -> None:
        self.records += 1
        self.by_type[msg.type] = self.by_type.get(msg.type, 0) + 1
        before = self.state.ranks.get(msg.rank)
        old_state = before.state if before is not None else None
        view = self.state.apply(msg)
        if view is None:  # hub record (rank_state)
            self._expected = None
            return
        if view.state != old_state:
            self._expected = None
        if msg.type == "step":
            self._on_step(msg, view)
        elif msg.type == "heartbeat":
            track = self._track(msg.rank)
            x = msg.body.get("step")
            x = float(x if isinstance(x, int) else (view.step or 0))
            for name, value in heartbeat_values(msg.body).items():
                track.add(name, x, value)
        elif msg.type == "collectives":
            late = view.value("arrival_lateness_s")
            if late is not None:
                x = msg.body.get("step")
                x = x if isinstance(x, int) else view.step
                if x is not None:
                    self._track(msg.rank).add("arrival_lateness_s", float(x), late)

    def _on_step(self, msg: Message, view: RankView) -> None:
        track = self._track(msg.rank)
        step = msg.body["step"]
        values = step_values(msg.body)
        for name, value in values.items():
            track.add(name, step, value)
        for name, value in extra_values(msg.body).items():
            track.add_extra(name, step, value)
        if msg.body.get("skipped"):
            track.skipped.add(step)
            self.skipped.add(step)
        tokens = msg.body.get("tokens")
        if isinstance(tokens, int) and not isinstance(tokens, bool):
            track.tokens += tokens
        if not track.samples or msg.t - track.samples[-1][0] >= 0.5:
            track.samples.append((msg.t, step, track.tokens))
        self.last_step_t = msg.t if self.last_step_t is None else max(self.last_step_t, msg.t)
        if view.steps_received == 1:
            self._expected = None
        self._accumulate(msg.rank, step, values)

    def _accumulate(self, rank: int, step: int, values: dict[str, float]) -> None:
        if step in self._closed and step not in self._open:
            return  # arrived after its step was closed: kept per rank only
        acc = self._open.get(step)
        if acc is None:
            acc = self._open[step] = _StepAcc()
        acc.ranks += 1
        for name in AGGREGATED:
            value = values.get(name)
            if value is None or not math.isfinite(value):
                continue
            if name in acc.n:
                acc.lo[name] = min(acc.lo[name], value)
                acc.hi[name] = max(acc.hi[name], value)
                acc.sum[name] += value
                acc.n[name] += 1
            else:
                acc.lo[name] = acc.hi[name] = acc.sum[name] = value
                acc.n[name] = 1
        if "compute_s" in values:
            acc.compute[rank] = values["compute_s"]
        if self._expected is None:
            self._expected = sum(1 for v in self.state.ranks.values()
                                 if v.state == "running" and v.steps_received)
        if acc.ranks >= max(1, self._expected):
            self._close(step)
        if len(self._open) > STEP_WINDOW:
            for old in sorted(self._open)[: len(self._open) - STEP_WINDOW]:
                self._close(old)

    def _close(self, step: int) -> None:
        acc = self._open.pop(step)
        self._closed.append(step)
        for name, n in acc.n.items():
            self.agg[name].add(step, acc.lo[name], acc.hi[name], acc.sum[name] / n)
        if len(acc.compute) >= 2:
            median = statistics.median(acc.compute.values())
            for rank, c in acc.compute.items():
                track = self._track(rank)
                slower = c - median
                track.compute_ema = slower if track.compute_ema is None else (
                    (1 - EMA) * track.compute_ema + EMA * slower)

    def rank_ids(self) -> list[int]:
        """Known ranks in order."""
        with self.lock:
            return sorted(self.state.ranks)
