"""Each step's all-reduce time and count, from the Flight Recorder, on every backend.

The training thread's `log(step)` leaves one `(step, perf_counter())` tuple in a bounded deque
(`MARKS_KEPT` of them; nothing else on the training thread). The recorder thread attributes every
all_reduce-type collective it takes from the ring (of any process group, p2p excluded) to the
step whose interval holds its issue time (`time_created_ns`): issued after `log(k-1)` and at or
before `log(k)` -> step k. It sums per step the count, the bytes, the durations (NCCL's
`duration_ms`, on gloo the host timer's) and keeps the first issue time.

A step is sent (`rows`) once it is complete: its `log()` happened before the read that took its
entries began (so every collective it issued was in the ring), no NCCL entry issued before that
`log()` is still held back waiting to complete, and every duration the host timer will give is
known; or `GIVE_UP_S` after its `log()`, with what is known by then.
"""

from __future__ import annotations

import time
from collections import deque

MARKS_KEPT = 8192
"""Step boundaries remembered between two reads (the reads are at most ~10 s apart)."""
GIVE_UP_S = 30.0
"""A step still waiting for durations this long after its `log()` is sent with what is known."""
ITEMS_KEPT = 100_000
"""All-reduces waiting for their step, at most (beyond, the older half is dropped)."""

StepRow = list  # [step, count, timed, seconds (None: none timed), bytes, first issue t (Unix s)]


class Item:
    """One all-reduce taken from the ring, waiting for its step to complete."""

    __slots__ = ("t", "seconds", "nbytes", "waiting")

    def __init__(self, t: float, seconds: float | None, nbytes: int, waiting: bool) -> None:
        self.t = t  # issue time, Unix s (this host's clock)
        self.seconds = seconds
        self.nbytes = nbytes
        self.waiting = waiting  # a host-timed duration may still come

    def timed(self, seconds: float | None) -> None:
        """The host timer's duration arrived (None: it never will)."""
        self.seconds, self.waiting = seconds, False


class StepComm:
    """Attributes the recorder's all-reduces to steps and says when a step is complete."""

    def __init__(self, marks: deque[tuple[int, float]] | None,
                 give_up_s: float = GIVE_UP_S) -> None:
        self.marks = marks
        self.give_up_s = give_up_s
        # (perf_counter, Unix time, step or None: an interval of lost marks), ascending
        self._bounds: deque[tuple[float, float, int | None]] = deque()
        self._items: list[Item] = []  # taken, not yet sent, in no particular order
        self._done_wall: float | None = None  # the last sent step's log() (Unix s)
        self.late = 0  # all-reduces not counted: after their step was sent, or dropped
        self.lost_marks = 0  # times the training thread's marks overflowed between two reads

    def add(self, t: float, seconds: float | None, nbytes: int, waiting: bool) -> Item | None:
        """Take one all-reduce issued at Unix time `t` (None when steps are not followed)."""
        if self.marks is None:
            return None
        if self._done_wall is not None and t <= self._done_wall:
            self.late += 1
            return None
        item = Item(t, seconds, nbytes, waiting)
        self._items.append(item)
        if len(self._items) > ITEMS_KEPT:  # no log() for long: keep the newest half
            self._items.sort(key=_issue_time)
            self.late += len(self._items) - ITEMS_KEPT // 2
            del self._items[: len(self._items) - ITEMS_KEPT // 2]
        return item

    def rows(self, read_started: float, held_since: float | None,
             now: float | None = None) -> list[StepRow]:
        """The steps complete now, oldest first. `read_started`: `perf_counter()` when the read
        that took the entries began; `held_since`: Unix issue time of the oldest entry held
        back until it completes (None: none)."""
        if self.marks is None:
            return []
        self._pull_marks()
        now = time.perf_counter() if now is None else now
        items = self._items
        items.sort(key=_issue_time)  # mostly sorted already
        out: list[StepRow] = []
        first = 0  # items[:first] went out
        while self._bounds:
            perf, wall, step = self._bounds[0]
            if perf >= read_started:
                break  # logged during or after the read: entries may be missing
            end = first
            while end < len(items) and items[end].t <= wall:
                end += 1
            mine = items[first:end]
            overdue = now - perf >= self.give_up_s
            if not overdue and ((held_since is not None and held_since <= wall)
                                or any(i.waiting for i in mine)):
                break  # steps go out in order
            self._bounds.popleft()
            self._done_wall, first = wall, end
            if mine and step is not None:
                out.append(_row(step, mine))
        del items[:first]
        return out

    def _pull_marks(self) -> None:
        """Move the training thread's new marks into `_bounds`, in Unix time. A full deque may
        have lost older marks: its oldest then closes an interval of unknown steps, not sent."""
        marks = self.marks
        full = marks.maxlen is not None and len(marks) >= marks.maxlen
        offset = time.time() - time.perf_counter()
        fresh = len(self._bounds)
        while marks:
            step, perf = marks.popleft()
            self._bounds.append((perf, perf + offset, step))
        if full and len(self._bounds) > fresh:  # its interval may span several steps
            perf, wall, _ = self._bounds[fresh]
            self._bounds[fresh] = (perf, wall, None)
            self.lost_marks += 1


def _issue_time(item: Item) -> float:
    return item.t


def _row(step: int, items: list[Item]) -> StepRow:
    timed = [i.seconds for i in items if i.seconds is not None]
    return [step, len(items), len(timed), sum(timed) if timed else None,
            sum(i.nbytes for i in items), min(i.t for i in items)]
