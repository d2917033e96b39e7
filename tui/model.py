"""`DashboardData`: everything the dashboard knows about one job, folded from hub records.

The receiver thread calls `apply_batch` (or `load_seed`, the hub's own fold of the history up to
some record, when it attaches); the UI thread reads through `views`, which copies what a
redraw needs while holding `lock`. The fold itself (`scalemon.state.fold.JobFold`: the `JobState`
reducer, per-rank series and rates, job-wide min/mean/max per step) is shared with the hub.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from scalemon import settings
from scalemon.protocol import Message
from scalemon.state.fold import (
    JobFold,
    SeriesBackfill,
)
from scalemon.state.jobstate import JobState, RankView

FOLD_ATTRIBUTES = frozenset(JobFold().__dict__) - {
    "_job", "_cap", "_hang_after_s", "_world_size", "watched", "hang_after_given"}
"""What a seed sets: what the fold folded, not how each side configured it."""
CHUNK = 2000
"""Records folded per lock hold, so a long history never freezes the screen."""
SCREEN_WAIT_S = 0.25
"""Longest the receiver waits for a redraw to finish before it goes on anyway."""
HOLD_S = 0.005
"""Longest the receiver holds the lock at a time, whatever the records cost to fold."""


@dataclass
class ConnState:
    """How the receiver is doing: connecting, connected, waiting, disconnected or offline."""

    status: str = "connecting"
    detail: str = ""
    since: float = field(default_factory=time.time)


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


class MeshCoords:
    """Each rank's device-mesh coordinates (`JobState.mesh`), kept while the job's groups and
    the ranks' mesh descriptions stay as they were (a redraw of thousands of ranks would
    otherwise work each out from every group again)."""

    def __init__(self) -> None:
        self._key: tuple[int, int, int] | None = None
        self._coords: dict[int, dict[str, int] | None] = {}

    def of(self, state: JobState) -> dict[int, dict[str, int] | None]:
        """rank -> coordinates (None: not in a mesh), for every known rank (under the lock)."""
        infos = state.info.get("mesh")
        key = (len(state.groups), len(infos or ()), id(infos))
        if key != self._key:
            self._key, self._coords = key, {}
        coords = self._coords
        if len(coords) != len(state.ranks):
            for rank in state.ranks:
                if rank not in coords:
                    coords[rank] = state.mesh(rank)
        return coords


class DashboardData(JobFold):
    """Thread-safe fold of one job's records for the dashboard. `hang_after_s`: a job where no
    rank completed a step for this long is hung (`reports.hangs.job_hang`)."""

    def __init__(self, job: str | None = None, cap: int | None = None,
                 hang_after_s: float | None = None) -> None:
        self.lock = threading.Lock()
        self.hang_after_given = hang_after_s is not None  # else the hub's, once it said
        self.version = 0  # bumped on every change the screen may show
        self.conn = ConnState()
        self.rejected = 0  # records the receiver could not decode
        self.loss_mode = "auto"  # "auto", "ranks" or "band"
        self.seeded_at: int | None = None
        """The record the hub's fold (`load_seed`) started this one at; None: replayed."""
        self.launched_t: float | None = None
        """When this dashboard's app launched the job itself (`scalemon demo`): the wait for
        its first rank is told as its start-up."""
        self.to_watch: set[int] = set()  # ranks the screen asked for, the receiver fetches
        self.digest_followed = False
        """A big job: the hub's digest is followed instead of every record (`digest_feed`)."""
        self.partial_series: dict[int, int] = {}
        """Watched ranks whose series start later than their records (rank -> first step)."""
        self.busy = False
        """The receiver holds the lock for long (a big job's pass over its ranks): the screen
        draws at a later tick rather than wait for it."""
        self._screen_idle = threading.Event()  # cleared while the screen is being drawn
        self._screen_idle.set()
        if hang_after_s is None:
            hang_after_s = settings.hang_after_s()
        super().__init__(job, cap, hang_after_s)

    def expect_job(self, job: str) -> None:
        """The job's id, known before any of its records came (the dashboard attaches to it
        by id): the header names it while the job starts (under the lock)."""
        self._job = self._job or job
        self.state.job = self.state.job or job

    def clear(self) -> None:
        """Forget every record folded (under the lock, or before the data is shared)."""
        super().clear()
        self.partial_series = {}
        self.history_identity: dict | None = None  # of the history the records came from
        self.lateness = LatenessMedians()
        self.seeded_at = None
        self.digests = 0  # the hub's digests folded (a big job's)
        self.mesh_coords = MeshCoords()
        self.totals: Any = None
        """A big job's pass over its ranks (`views.totals.RankTotals`), made by the receiver
        after each digest; None: each redraw makes its own."""

    # ---- receiver side -------------------------------------------------------------------

    def drawing(self, active: bool) -> None:
        """The UI thread starts (True) or finished (False) drawing the screen."""
        if active:
            self._screen_idle.clear()
        else:
            self._screen_idle.set()

    def wait_for_screen(self) -> None:
        """Let a redraw under way finish first (at most SCREEN_WAIT_S): decoding and folding
        on this thread would take the interpreter from the UI thread and stretch the redraw;
        the records wait in the socket meanwhile."""
        self._screen_idle.wait(SCREEN_WAIT_S)

    def reset(self) -> None:
        """Forget everything (the hub's history was recreated)."""
        with self.lock:
            self.clear()
            self.version += 1

    def load_seed(self, fold: JobFold, identity: dict | None, hold: bool = False) -> None:
        """Start over from `fold`, the hub's fold of its history up to `fold.next_seq`
        (`identity`: that history's); what this dashboard watches stays watched. `hold`: no
        redraw until the caller clears `busy` (a big job's first pass over its ranks is made
        first, else a redraw would make it on the screen's thread)."""
        with self.lock:
            self.busy = hold
            self.clear()
            self.to_watch |= self.watched  # their series come again from the hub
            self.__dict__.update({k: v for k, v in vars(fold).items() if k in FOLD_ATTRIBUTES})
            self.state.hang_after_s = self._hang_after_s
            self.watched = set()
            self.history_identity = identity
            self.seeded_at = self.next_seq
            self.version += 1

    def set_hang_after(self, seconds: float) -> None:
        """Call the job hung after `seconds` without a completed step (kept across resets)."""
        with self.lock:
            self.hang_after_given = True
            self._hang_after_s = self.state.hang_after_s = seconds
            self.version += 1

    def hub_hang_after(self, seconds: object) -> None:
        """The hub's threshold (its `seed` reply): this dashboard's too, unless one was given."""
        if isinstance(seconds, (int, float)) and seconds > 0 and not self.hang_after_given:
            with self.lock:
                self._hang_after_s = self.state.hang_after_s = float(seconds)
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
            self.wait_for_screen()
            with self.lock:
                until = time.perf_counter() + HOLD_S
                for seq, msg in batch[start:start + CHUNK]:
                    try:
                        self.apply(seq, msg)
                    except Exception:  # a record the fold cannot take: counted, shown
                        self.rejected += 1
                        self.next_seq = seq + 1
                    start += 1
                    if time.perf_counter() > until:
                        break
                self.version += 1
            if start < len(batch):
                time.sleep(0)  # let a thread waiting for the lock (the UI) take it

    def apply_messages(self, messages: Iterable[Message]) -> None:
        """Fold messages that carry no record numbers (a replay)."""
        self.apply_batch((self.next_seq + i, m) for i, m in enumerate(messages))

    # ---- a rank's series in a big job ----------------------------------------------------

    def show_rank(self, rank: int) -> bool:
        """The screen shows `rank`'s series: True when they must first come from the hub
        (a big job's rank not watched yet; the receiver fetches them, `take_watch`)."""
        with self.lock:
            if not self.needs_backfill(rank):
                self.watched.add(rank)
                return False
            self.to_watch.add(rank)
            self.version += 1
            return True

    def show_ranks(self, ranks: Iterable[int]) -> None:
        """The screen shows `ranks` (a node's): while the hub's digest is followed their
        records are fetched, as a shown rank's (`show_rank`); else nothing changes."""
        with self.lock:
            if self.digest_followed:
                self.to_watch.update(r for r in ranks if r not in self.watched)

    def hide_ranks(self, ranks: Iterable[int]) -> None:
        """The screen no longer shows `ranks`: while the hub's digest is followed their
        records are no longer fetched (a small job's series are kept as before)."""
        with self.lock:
            if self.digest_followed:
                self.watched.difference_update(ranks)
                self.to_watch.difference_update(ranks)

    def take_watch(self) -> list[int]:
        """The ranks whose series the receiver is to fetch (each returned once)."""
        with self.lock:
            ranks, self.to_watch = sorted(self.to_watch), set()
            return ranks

    def watch_with(self, rank: int, messages: list[Message] | None,
                   complete: bool = True) -> SeriesBackfill:
        """Keep `rank`'s series from `messages` (its records before `next_seq`; `complete`:
        all of them since its first) on."""
        with self.lock:
            done = self.watch(rank, messages)
            if not complete and done.first_step is not None:
                self.partial_series[rank] = done.first_step
            self.version += 1
            return done

    def rank_ids(self) -> list[int]:
        """Known ranks in order."""
        with self.lock:
            return sorted(self.state.ranks)
