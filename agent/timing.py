"""Timing the optimizer step and DDP's gradient all-reduce without syncing the device.

On CUDA both use `torch.cuda.Event(enable_timing=True)` pairs whose elapsed time is read only
after a later event says they completed. On CPU (gloo) host `perf_counter` is the truth: the
optimizer runs on the calling thread and gloo completes the all-reduce future on its own thread,
where the callback takes the end time.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from .heartbeat import Phase

log = logging.getLogger("scalemon.agent")


class EventPool:
    """Reusable CUDA timing events of one device (creating one costs more than recording it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: list[torch.cuda.Event] = []

    def record(self) -> torch.cuda.Event:
        """A free event, recorded now on the current stream of the model's device (which need
        not be the current device)."""
        ev = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def put(self, *events: torch.cuda.Event) -> None:
        """Return events once their elapsed time was read."""
        self._free.extend(events)


class Interval:
    """One timed span: host seconds, or a pair of CUDA events read later."""

    __slots__ = ("start", "end", "nbytes", "issue_t")

    def __init__(self, start: Any, nbytes: int = 0, issue_t: float = 0.0) -> None:
        self.start = start
        self.end: Any = None
        self.nbytes = nbytes
        self.issue_t = issue_t

    def seconds(self) -> float | None:
        """Duration; for CUDA events call only once they completed."""
        if self.end is None:
            return None
        if isinstance(self.start, float):
            return self.end - self.start
        return self.start.elapsed_time(self.end) / 1000.0


class SpanTimer:
    """Collects the intervals of one kind (optimizer steps, all-reduces) between two `take`s."""

    def __init__(self, events: EventPool | None) -> None:
        self.events = events  # None: host timing
        self.spans: list[Interval] = []

    def begin(self, nbytes: int = 0) -> Interval:
        """Open a span now (on the device's current stream for CUDA)."""
        start = time.perf_counter() if self.events is None else self.events.record()
        span = Interval(start, nbytes, time.time())
        self.spans.append(span)
        return span

    def end(self, span: Interval) -> None:
        """Close `span` now."""
        span.end = time.perf_counter() if self.events is None else self.events.record()

    def take(self) -> list[Interval]:
        """The spans since the last take (the caller resolves and recycles them)."""
        spans, self.spans = self.spans, []
        return spans


def summarize(spans: list[Interval], events: EventPool | None) -> dict[str, Any]:
    """Total seconds, count, bytes and first issue time of completed spans; recycles events."""
    total = 0.0
    complete = 0
    for span in spans:
        s = span.seconds()
        if s is not None:
            total += s
            complete += 1
        if events is not None and not isinstance(span.start, float):
            events.put(span.start, *([span.end] if span.end is not None else []))
    return {
        "seconds": total if complete else None,
        "count": len(spans),
        "bytes": sum(s.nbytes for s in spans),
        "issue_t": spans[0].issue_t if spans else None,
    }


class OptimizerTimer:
    """Times every `optimizer.step()` through the optimizer's own step hooks."""

    def __init__(self, optimizer: torch.optim.Optimizer, timer: SpanTimer, phase: Phase) -> None:
        self.timer = timer
        self.phase = phase
        self._open: Interval | None = None
        self._handles = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
        ]

    def _pre(self, *_: Any) -> None:
        t0 = time.perf_counter()
        self.phase.set("optimizer")
        self._open = self.timer.begin()
        self.phase.cost_s += time.perf_counter() - t0

    def _post(self, *_: Any) -> None:
        t0 = time.perf_counter()
        if self._open is not None:
            self.timer.end(self._open)
            self._open = None
        self.phase.set("after-optimizer")
        self.phase.cost_s += time.perf_counter() - t0

    def remove(self) -> None:
        """Unregister the hooks."""
        for handle in self._handles:
            handle.remove()


class AllReduceTimer:
    """A DDP communication hook: the default averaging all-reduce, timed per bucket."""

    def __init__(self, timer: SpanTimer, phase: Phase) -> None:
        self.timer = timer
        self.phase = phase
        self._group: Any = None
        self._group_size = 1
        self._lock = threading.Lock()  # gloo completes futures on several threads

    def register(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> bool:
        """Install on a DDP model (before its first backward). DDP takes one comm hook: when
        the model has one already, returns False and leaves it alone."""
        self._group = ddp_model.process_group or dist.group.WORLD
        self._group_size = self._group.size()
        try:
            ddp_model.register_comm_hook(state=self._group, hook=self.hook)
        except RuntimeError as exc:
            log.warning("scalemon: all-reduce timing off, the model has a comm hook (%s)", exc)
            return False
        return True

    def hook(self, process_group, bucket):  # noqa: ANN001, ANN201 - DDP inspects annotations
        """Average the bucket across ranks, recording when it was issued and completed.

        Unannotated on purpose: DDP compares the annotations with the real classes, and
        `from __future__ import annotations` turns them into strings."""
        t0 = time.perf_counter()
        tensor = bucket.buffer()
        try:
            self.phase.set("allreduce")
            self.phase.collectives_issued += 1
            span = self.timer.begin(tensor.nbytes)
        except Exception:
            span = None
        self.phase.cost_s += time.perf_counter() - t0
        tensor.div_(self._group_size)
        fut = dist.all_reduce(tensor, group=self._group, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            if span is not None:
                try:
                    self.timer.end(span)
                    if self.timer.events is None:
                        # gloo runs this once the data arrived; NCCL runs it at once, so on
                        # CUDA completion is counted when the step's events say so (steps.py)
                        with self._lock:
                            self.phase.collectives_completed += 1
                except Exception:
                    pass
            return f.value()[0]

        return fut.then(done)
