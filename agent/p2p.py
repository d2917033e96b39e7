"""Point-to-point sends and receives on gloo, seen on the host.

gloo's Flight Recorder records no send or recv at all (torch 2.13), so on gloo (where the host
timer of `hosttiming.py` is installed) the agent replaces, at class level, the methods every
P2P call of torch goes through: `ProcessGroup.send`, `recv` and `recv_anysource` (torch's
`send`, `recv`, `isend`, `irecv` and gloo's `batch_isend_irecv` call them) and `Work.wait`.
Each P2P op leaves a `P2PRecord` (group, op, peer's global rank, bytes, issue time) for the
recorder's thread; the `wait()` of its work adds the time the caller spent inside it to the
step's wait (per peer), and ends the op: gloo's P2P works have no future, so an op's duration
is from its issue to the end of the `wait()` that saw it complete (to the wait's start when it
was complete already: an upper bound).

They also keep the sequence numbers apart: on gloo a group's sequence number and the
recorder's `pg_status` count P2P ops too (they are op ids), while the recorder's entries'
`collective_seq_id` counts collectives only. `OpIds` remembers the op ids of a group's P2P ops,
so that an op id becomes a collective sequence number (`collective_seq`).

A few µs per op on the training thread; every wrapper runs the original call as it is and
only its own work inside try/except.
"""

from __future__ import annotations

import functools
import itertools
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from . import c10d

RUNS_KEPT = 256
"""Runs of consecutive P2P op ids remembered per group (each collective ends one)."""
INFLIGHT_KEPT = 4096
"""P2P works whose `wait()` has not returned, remembered at most (the oldest are forgotten)."""
INFLIGHT_ROWS = 32
"""P2P ops in flight a heartbeat lists at most (the newest)."""


class OpIds:
    """The op ids of one group's P2P ops, as runs of consecutive ids (`[first, last, P2P ops
    before first]`), to turn op ids into collective sequence numbers."""

    __slots__ = ("runs", "total")

    def __init__(self) -> None:
        self.runs: deque[list[int]] = deque(maxlen=RUNS_KEPT)
        self.total = 0

    def add(self, op_id: int) -> None:
        """One more P2P op, with op id `op_id` (the group's sequence number after it)."""
        runs = self.runs
        if runs and runs[-1][1] == op_id - 1:
            runs[-1][1] = op_id
        else:
            runs.append([op_id, op_id, self.total])
        self.total += 1

    def collective_seq(self, op_id: int) -> int:
        """The collective sequence number of the collective with op id `op_id`: `op_id` less
        the P2P ops with an op id at or below it."""
        runs = list(self.runs)  # the training thread may add one meanwhile
        for first, last, before in reversed(runs):
            if first <= op_id:
                return op_id - (before + min(last, op_id) - first + 1)
        return op_id - (runs[0][2] if runs else 0)  # older than what is kept: best effort


class P2PRecord:
    """One P2P op as the training thread issued it."""

    __slots__ = ("group", "op", "peer", "nbytes", "t", "perf", "seconds", "_work")

    def __init__(self, group: Any, op: str, peer: int | None, nbytes: int, work: Any) -> None:
        self.group = group  # the process group object
        self.op = op  # "send" or "recv"
        self.peer = peer  # the peer's global rank; None: any source, not known yet
        self.nbytes = nbytes
        self.t = time.time()  # issue time, Unix s (this host's clock, as the recorder's)
        self.perf = time.perf_counter()
        self.seconds: float | None = None  # issue to completion, once a wait() saw it
        self.work = work  # until its wait() returned

    @property
    def work(self) -> Any:
        """The op's Work until its wait() returned (None after, or once the script dropped
        it: a weak reference, so that a Work never waited for, and its tensors, are not kept
        alive here)."""
        ref = self._work
        return ref() if ref is not None else None

    @work.setter
    def work(self, work: Any) -> None:
        try:
            self._work = weakref.ref(work) if work is not None else None
        except TypeError:  # a Work type without weak references: none kept
            self._work = None


class StepP2P:
    """The training thread's P2P and all_to_all counters since the last `log()`."""

    __slots__ = ("count", "nbytes", "wait_s", "waits", "a2a_send", "a2a_recv", "touched")

    def __init__(self) -> None:
        self.count = self.nbytes = 0
        self.wait_s = 0.0
        self.waits: dict[int | None, float] = {}
        self.a2a_send: int | None = None
        self.a2a_recv: int | None = None
        self.touched = False

    def add_a2a(self, sent: int, received: int) -> None:
        """One all_to_all of this rank: `sent` bytes out, `received` in."""
        self.a2a_send = (self.a2a_send or 0) + sent
        self.a2a_recv = (self.a2a_recv or 0) + received
        self.touched = True

    def take(self) -> tuple | None:
        """`(count, bytes, wait_s, waits by peer, a2a sent, a2a received)` since the last
        call, and start again; None when there was nothing."""
        if not self.touched:
            return None
        out = (self.count, self.nbytes, self.wait_s, self.waits, self.a2a_send, self.a2a_recv)
        self.count = self.nbytes = 0
        self.wait_s = 0.0
        self.waits = {}
        self.a2a_send = self.a2a_recv = None
        self.touched = False
        return out


STEP_FIELDS = ("p2p_count", "p2p_bytes", "p2p_wait_s", "p2p_waits", "pipeline_bubble",
               "a2a_send_bytes", "a2a_recv_bytes")
"""The step message's P2P and all_to_all fields (all null in a step without any)."""


def step_fields(taken: tuple | None, step_time_s: float | None) -> dict[str, Any]:
    """The step message's P2P fields from `StepP2P.take()`'s tuple."""
    if taken is None:
        return dict.fromkeys(STEP_FIELDS)
    count, nbytes, wait_s, waits, a2a_send, a2a_recv = taken
    p2p = bool(count or waits)
    bubble = None
    if p2p and step_time_s:
        bubble = min(1.0, max(0.0, wait_s / step_time_s))
    return {
        "p2p_count": count if p2p else None,
        "p2p_bytes": nbytes if p2p else None,
        "p2p_wait_s": wait_s if p2p else None,
        "p2p_waits": {("any" if peer is None else str(peer)): s for peer, s in waits.items()}
        if p2p else None,
        "pipeline_bubble": bubble,
        "a2a_send_bytes": a2a_send,
        "a2a_recv_bytes": a2a_recv,
    }


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class P2PTimer:
    """Wraps `ProcessGroup.send/recv/recv_anysource` and `Work.wait` (gloo) and keeps what
    they saw: records for the recorder, the step's counters, the ops in flight."""

    def __init__(self, max_records: int = 100_000) -> None:
        self.records: deque[P2PRecord] = deque(maxlen=max_records)  # drained by the recorder
        self.inflight: dict[int, P2PRecord] = {}  # by id(work), until its wait() returned
        self.ids: dict[Any, OpIds] = {}  # per process group
        self.step = StepP2P()
        self.waiting: P2PRecord | None = None  # the op whose wait() a thread is inside now
        self._peers: dict[tuple[Any, int], int] = {}  # (group, group rank) -> global rank
        self._originals: dict[str, Any] = {}  # the classes' own attributes (descriptors)
        self._classes: tuple[Any, Any] | None = None

    # --- installing ------------------------------------------------------------------------
    def install(self) -> None:
        """Replace the classes' methods by recording ones (undone by `remove`)."""
        group_cls, work_cls = self._classes = c10d.p2p_classes()
        if hasattr(work_cls.wait, "__scalemon_original__"):
            return  # another timer of this process has them
        # a pybind11 method is an `instancemethod` in the class's dict, which getattr unwraps:
        # the dict's own object is what goes back (the unwrapped function would not bind)
        try:
            for name, op in (("send", "send"), ("recv", "recv"), ("recv_anysource", "recv")):
                original = vars(group_cls)[name]
                setattr(group_cls, name, self._wrap_issue(getattr(group_cls, name), op,
                                                          name != "recv_anysource"))
                self._originals[name] = original
            original = vars(work_cls)["wait"]
            work_cls.wait = self._wrap_wait(work_cls.wait)
            self._originals["wait"] = original
        except BaseException:  # all or nothing: what was replaced goes back
            self.remove()
            raise

    def remove(self) -> None:
        """Put the original methods back."""
        if self._classes is None or not self._originals:
            return
        group_cls, work_cls = self._classes
        for name, original in self._originals.items():  # what install replaced, no more
            setattr(work_cls if name == "wait" else group_cls, name, original)
        self._originals.clear()

    def _wrap_issue(self, fn: Callable[..., Any], op: str, has_peer: bool) -> Callable[..., Any]:
        issued = self._issued

        @functools.wraps(fn)
        def issue(pg: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
            work = fn(pg, tensors, *args, **kwargs)
            try:
                peer = None
                if has_peer:
                    peer = args[0] if args else kwargs.get("dstRank" if op == "send" else "srcRank")
                issued(pg, op, peer, tensors, work)
            except Exception:  # recording is never worth the op
                pass
            return work

        issue.__scalemon_original__ = fn  # type: ignore[attr-defined]
        return issue

    def _wrap_wait(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        inflight = self.inflight
        timer = self

        @functools.wraps(fn)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            record = inflight.get(id(work))
            if record is None or record.work is not work:  # a collective's: as it is
                return fn(work, *args, **kwargs)
            try:
                done = work.is_completed()
                t = time.perf_counter()
                timer.waiting = record
            except Exception:
                return fn(work, *args, **kwargs)
            try:
                result = fn(work, *args, **kwargs)
            except BaseException:
                try:  # noqa: SIM105 (the wait path: no context manager)
                    timer._waited(record, t, done, False)
                except Exception:
                    pass
                raise
            try:  # noqa: SIM105
                # wait(timeout) returns False when the op did not complete in time
                timer._waited(record, t, done, result is not False)
            except Exception:
                pass
            return result

        wait.__scalemon_original__ = fn  # type: ignore[attr-defined]
        return wait

    # --- on the training thread ------------------------------------------------------------
    def _issued(self, pg: Any, op: str, peer: int | None, tensors: Any, work: Any) -> None:
        ids = self.ids.get(pg)
        if ids is None:
            ids = self.ids[pg] = OpIds()
        ids.add(c10d.sequence_number(pg))
        if peer is not None:
            peer = self._global(pg, peer)
        record = P2PRecord(pg, op, peer, _bytes(tensors), work)
        self.records.append(record)
        if work is not None:
            inflight = self.inflight
            inflight[id(work)] = record
            if len(inflight) > INFLIGHT_KEPT:  # works never waited for: forget the oldest
                for key in list(itertools.islice(inflight, len(inflight) - INFLIGHT_KEPT)):
                    inflight.pop(key).work = None
        step = self.step
        step.count += 1
        step.nbytes += record.nbytes
        step.touched = True

    def _global(self, pg: Any, group_rank: int) -> int:
        key = (pg, group_rank)
        peer = self._peers.get(key)
        if peer is None:
            import torch.distributed as dist

            peer = self._peers[key] = int(dist.get_global_rank(pg, group_rank))
        return peer

    def _waited(self, record: P2PRecord, t: float, done_before: bool, returned: bool) -> None:
        """After a P2P `wait()` that began at `t` (the op complete then: `done_before`) and
        `returned` (else it raised)."""
        end = time.perf_counter()
        self.waiting = None
        work = record.work
        if record.peer is None and work is not None and returned:
            group_rank = c10d.source_rank(work)
            if group_rank is not None:
                record.peer = self._global(record.group, group_rank)
        if work is not None and (done_before or returned):
            record.seconds = (t if done_before else end) - record.perf
            self.inflight.pop(id(work), None)
            record.work = None
        step = self.step
        step.wait_s += end - t
        step.waits[record.peer] = step.waits.get(record.peer, 0.0) + end - t
        step.touched = True

    # --- from other threads ----------------------------------------------------------------
    def p2p_ops(self, group: Any) -> int:
        """How many P2P ops this process issued on `group` (None: the default group)."""
        if not self.ids:
            return 0
        pg = group if group is not None else c10d.default_group()
        ids = self.ids.get(pg)
        return ids.total if ids is not None else 0

    def by_name(self, names: Mapping[Any, str]) -> dict[str, OpIds]:
        """The groups' `OpIds` by group name (`names`: c10d.group_names())."""
        return {str(names[pg]): ids for pg, ids in list(self.ids.items()) if pg in names}

    def inflight_rows(self, names: Mapping[Any, str]) -> list[list[Any]] | None:
        """While a thread waits in a P2P `wait()`: every P2P op issued and not completed, as
        `[group, op, peer, issue time (Unix s), bytes]` (the newest `INFLIGHT_ROWS`); else
        None."""
        if self.waiting is None:
            return None
        rows = []
        for record in list(self.inflight.values()):
            work = record.work
            try:
                if work is None or work.is_completed():
                    continue
            except Exception:
                continue
            rows.append([str(names.get(record.group, "?")), record.op,
                         -1 if record.peer is None else record.peer, record.t, record.nbytes])
        return rows[-INFLIGHT_ROWS:]

