"""Timing the optimizer step and DDP's gradient all-reduce without syncing the device.

On CUDA both use `torch.cuda.Event(enable_timing=True)` pairs whose elapsed time is read only
after a later event says they completed. On CPU (gloo) host `perf_counter` is the truth: the
optimizer runs on the calling thread and gloo completes the all-reduce future on its own thread,
where the callback takes the end time.

The hooks run on the training thread once or a few times per step, so they do as little as
possible: a clock read, a few attribute writes and a list append. A span is a small list
`[issued_at, start, end, sent]`: `issued_at` a host `perf_counter` reading, `start`/`end`
floats on the host or recorded CUDA events, `end` None until the span closed, `sent` None or the
tensor sent (its byte count is read later, on the sender thread).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist

from scalemon import settings

from .c10d import sequence_number
from .cudagraphs import CAPTURE
from .cudart import CudaDirect
from .heartbeat import Phase
from .hosttiming import original
from .warn import Warnings

log = logging.getLogger("scalemon.agent")


def _all_reduce(*args: Any, **kwargs: Any) -> Any:
    """torch's all_reduce, not the host timer's wrapper (the hook times its own)."""
    return original(dist.all_reduce)(*args, **kwargs)


is_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
"""True while torch.compile traces the caller: a hook then returns at once, so dynamo neither
breaks the graph at it nor fails a `fullgraph=True` compile. torch's function itself, called
without a wrapper of ours, and the one that dynamo answers but that is one Python frame when
run (`is_compiling` is two): each frame costs on the hot path, with caches cold from the step.
(Under a non-strict `torch.export` the hooks then run, doing host work only.)"""


def _torch_stream_key(index: int) -> tuple:
    """The current stream of device `index` as (stream id, device index, device type), as
    torch's own C call gives it (the fallback for a torch without that call)."""
    stream = torch.cuda.current_stream(index)
    return stream.stream_id, stream.device_index, stream.device_type


current_stream_key = getattr(torch._C, "_cuda_getCurrentStream", None) or _torch_stream_key
"""`current_stream_key(index)`: the current stream of device `index` as a hashable key
(stream id, device index, device type), without building a `Stream` object."""


def _event_record() -> Any:
    """`Event.record(stream)` without the Python wrapper's own current-stream lookup (the C
    method where `torch.cuda.Event` is the C event class's subclass, as in torch 2.4-2.13)."""
    base = getattr(torch._C, "_CudaEventBase", None)
    if base is not None and hasattr(base, "record") and issubclass(torch.cuda.Event, base):
        return base.record
    return lambda ev, stream: ev.record(stream)


_record = _event_record()

Span = list  # [issued_at, start: float|Event, end: float|Event|None, sent: Tensor|None, ...]


class EventPool:
    """Reusable CUDA timing events of one device (creating one costs more than recording it).

    `record()` runs on the training thread several times a step, so it skips what torch's
    Python wrappers redo on every call: the current stream is looked up as a plain tuple (one
    C call) and turned into a `Stream` object only when it changed. With `direct` (cudart.py)
    a reused event is recorded without releasing the GIL; a new one goes through torch, which
    creates it."""

    def __init__(self, device: torch.device, direct: CudaDirect | None = None,
                 warnings: Warnings | None = None) -> None:
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.direct = direct
        self.warnings = warnings or Warnings()
        self._free: list[torch.cuda.Event] = []
        self._stream_key: tuple | None = None
        self._stream: torch.cuda.Stream | None = None
        self._handle = 0  # the current stream's raw cudaStream_t
        self._streams: dict[tuple, torch.cuda.Stream] = {}  # by `current_stream_key`

    def stream_handle(self) -> int:
        """The raw handle of the current stream of the model's device (cached by stream)."""
        key = current_stream_key(self.index)
        if key != self._stream_key:
            self._use_stream(key)
        return self._handle

    def _use_stream(self, key: tuple) -> None:
        """The current stream changed (or is read the first time): cache its `Stream`."""
        self._stream = self.stream_of(key)
        self._handle = self._stream.cuda_stream
        self._stream_key = key

    def stream_of(self, key: tuple) -> torch.cuda.Stream:
        """The `Stream` of a key `current_stream_key` gave (made once per stream)."""
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(
                stream_id=key[0], device_index=key[1], device_type=key[2])
        return stream

    def record(self) -> torch.cuda.Event:
        """A free event, recorded now on the current stream of the model's device (which need
        not be the current device). On the training thread: no other call of ours, one C call
        to read the stream and, with `direct`, one to record."""
        key = current_stream_key(self.index)
        if key != self._stream_key:
            self._use_stream(key)
        free = self._free
        direct = self.direct
        if free and direct is not None:
            ev = free.pop()  # (the sender thread puts events back: pop is atomic)
            try:
                direct.record(ev, self._handle)
                return ev
            except Exception as exc:  # torch's calls from now on
                self.no_direct(exc)
        else:
            ev = self._take() or torch.cuda.Event(enable_timing=True)
        _record(ev, self._stream)
        return ev

    def record_on(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """A free event recorded on `stream` through torch's call: for the sender thread,
        behind the copies it queued there."""
        ev = self._take() or torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def stream(self) -> torch.cuda.Stream:
        """The current stream of the model's device, as a `Stream` (cached by stream)."""
        self.stream_handle()
        return self._stream

    def _take(self) -> torch.cuda.Event | None:
        """A free event, or None (the training and sender threads both take from the pool)."""
        try:
            return self._free.pop()
        except IndexError:
            return None

    def no_direct(self, exc: Exception) -> None:
        """Stop using the direct calls after one failed (said once)."""
        self.direct = None
        self.warnings.once("cuda-direct", "scalemon: a direct CUDA call failed (%s); the agent "
                           "uses torch's calls instead", exc)

    def put(self, *events: torch.cuda.Event) -> None:
        """Return events once their elapsed time was read."""
        self._free.extend(events)


class SpanTimer:
    """Collects the spans of one kind (optimizer steps, all-reduces) until the step's `log()`
    swaps the list for a new one.

    `every_s` > 0 samples: only the calls of a step that begins at least `every_s` after the
    last timed one are timed (on CUDA each timed call costs two event records on the training
    thread); the others are counted in `untimed`, so that the step says its figure is an
    earlier step's. `timing` is the decision for the step in progress (None: not made yet;
    `log()` resets it)."""

    def __init__(self, events: EventPool | None, every_s: float = 0.0) -> None:
        self.events = events  # None: host timing
        self.every_s = every_s
        self.spans: list[Span] = []
        self.untimed = 0
        self.timing: bool | None = None
        self.next_at = 0.0

    def timed_now(self, t: float) -> bool:
        """Whether the call starting at `t` (perf_counter) is timed: the step's first call
        decides for all of the step's calls."""
        timing = self.timing
        if timing is None:
            timing = self.timing = t >= self.next_at
            if timing:
                self.next_at = t + self.every_s
        return timing


def span_seconds(span: Span) -> float | None:
    """A span's duration, None while open; for CUDA call only once its events completed."""
    start, end = span[1], span[2]
    if end is None:
        return None
    if type(start) is float:
        return end - start
    return start.elapsed_time(end) / 1000.0


def summarize(spans: list[Span], events: EventPool | None, wall_offset: float) -> dict[str, Any]:
    """Total seconds, count, bytes and first issue time (wall clock: `perf_counter` time plus
    `wall_offset`) of completed spans; recycles their CUDA events."""
    total = 0.0
    complete = 0
    for span in spans:
        s = span_seconds(span)
        if s is not None:
            total += s
            complete += 1
        if events is not None and type(span[1]) is not float:
            events.put(*(ev for ev in span[1:3] if ev is not None))
    return {
        "seconds": total if complete else None,
        "count": len(spans),
        "bytes": sum(span[3].nbytes for span in spans if span[3] is not None),
        "issue_t": min(span[0] for span in spans) + wall_offset if spans else None,
    }


OPTIMIZER_TIMING_ENV = "SCALEMON_OPTIMIZER_TIMING_S"
OPTIMIZER_TIMING_CUDA_S = 0.5
"""On CUDA the optimizer step is timed (two event records on the training thread) on one step
every this many seconds at most; the steps between carry that figure (`optimizer_timed_step`).
On CPU the host clock costs nothing to speak of: every step is timed."""


def optimizer_timing_every_s(cuda: bool, warnings: Warnings) -> float:
    """Seconds between timed optimizer steps: SCALEMON_OPTIMIZER_TIMING_S (0: every step), else
    `OPTIMIZER_TIMING_CUDA_S` on CUDA and 0 on CPU."""
    default = OPTIMIZER_TIMING_CUDA_S if cuda else 0.0
    text = (settings.raw(OPTIMIZER_TIMING_ENV) or "").strip()
    if not text:
        return default
    try:
        value = float(text)
        if not 0.0 <= value < float("inf"):
            raise ValueError
    except ValueError:
        warnings.once("optimizer-timing-env", "scalemon: %s=%r is not a number of seconds >= 0; "
                      "using %g", OPTIMIZER_TIMING_ENV, text, default)
        return default
    return value


WRAPPED_OPTIMIZER_ATTRS = ("optimizer", "_optimizer")
"""Where optimizer wrappers keep the optimizer they step: accelerate's AcceleratedOptimizer and
DeepSpeed's ZeRO optimizers (`optimizer`), Lightning's LightningOptimizer (`_optimizer`)."""


def hookable_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The optimizer whose step hooks time `optimizer`'s steps: itself when it is a torch
    optimizer with step hooks, else the one it wraps (a wrapper that does not run
    `Optimizer.__init__` has no hooks, and its `step()` steps the wrapped one, only when
    the step is not skipped: accumulation, an inf gradient); None when there is none."""
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        if (isinstance(optimizer, torch.optim.Optimizer)
                and "_optimizer_step_pre_hooks" in vars(optimizer)):
            return optimizer
        attrs = getattr(optimizer, "__dict__", {})
        optimizer = next((attrs[name] for name in WRAPPED_OPTIMIZER_ATTRS
                          if attrs.get(name) is not None), None)
    return None


def _with_closure_wrapped(optimizer: Any, args: tuple, kwargs: dict,
                          wrap: Any) -> tuple[tuple, dict] | None:
    """`optimizer.step`'s arguments as a step pre-hook gets them (`args` begins with the
    optimizer) with its closure (`closure=` or the first positional argument after the
    optimizer, when callable and not a module) replaced by `wrap(closure)`; None when it has
    no closure."""
    closure = kwargs.get("closure")
    if callable(closure):
        return args, {**kwargs, "closure": wrap(closure)}
    at = 1 if args and args[0] is optimizer else 0
    if len(args) > at and callable(args[at]) and not isinstance(args[at], torch.nn.Module):
        return (*args[:at], wrap(args[at]), *args[at + 1:]), kwargs
    return None


class OptimizerTimer:
    """Times `optimizer.step()` through the optimizer's own step hooks: every call, or the
    calls of sampled steps (`SpanTimer.every_s`).

    A step given a closure (`optimizer.step(closure)`: Lightning's automatic optimization,
    LBFGS) runs the script's forward and backward inside it, before the update: the span then
    starts when the closure returns (the pre-hook hands the step a wrapped closure), so the
    optimizer's time is the update's, not the whole step's. A closure called several times in
    one step (LBFGS) restarts the span each time: the figure is the update after the last
    call."""

    def __init__(self, optimizer: torch.optim.Optimizer, timer: SpanTimer, phase: Phase,
                 on_error: Any = None) -> None:
        self.timer = timer
        self.phase = phase
        self.on_error = on_error  # called with the reason when a hook fails (never raises)
        self._open: Span | None = None
        self._started = False  # the step in progress opened its span (or was sampled out)
        self._handles = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
        ]

    def _pre(self, optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # The hot path (every step, caches cold): no call of ours unless the step has a
        # closure, an open span to drop, or is timed; `_start` inlined for a sampled-out step.
        if is_compiling():  # a compiled optimizer.step(): nothing to time from inside
            return None
        t = perf_counter()
        if self._open is not None:
            self._drop_open()
        self._started = False
        phase = self.phase
        wrapped = (_with_closure_wrapped(optimizer, args, kwargs, self._after_closure)
                   if kwargs or len(args) > 1 or (args and args[0] is not optimizer)
                   else None)  # torch passes (optimizer,) for a plain `step()`
        if wrapped is not None:  # forward and backward run first, inside the step
            phase.name, phase.since = "forward-backward", t
        else:
            timer = self.timer
            timing = timer.timing
            if timing is None and timer.every_s:  # the step's first call decides (timed_now)
                timing = timer.timing = t >= timer.next_at
                if timing:
                    timer.next_at = t + timer.every_s
            if timing is False:  # sampled out: nothing on the device
                phase.name, phase.since = "optimizer", t
                timer.untimed += 1
            else:
                self._start(t)
        phase.cost_s += perf_counter() - t
        return wrapped

    def _after_closure(self, closure: Any) -> Any:
        """`closure` that opens the step's span when it returns."""

        def closure_then_update(*args: Any, **kwargs: Any) -> Any:
            if self._started:  # LBFGS: a closure between updates
                self.phase.name, self.phase.since = "forward-backward", time.perf_counter()
            result = closure(*args, **kwargs)
            t = time.perf_counter()
            if self._started and self._open is None:  # sampled out, captured or failed
                self.phase.name, self.phase.since = "optimizer", t
            else:  # the first call, or called again (LBFGS): the span starts anew
                self._drop_open()
                self._start(t)
            self._started = True
            self.phase.cost_s += time.perf_counter() - t
            return result

        return closure_then_update

    def _start(self, t: float) -> None:
        """The update starts at `t`: open the span (unless the step is sampled out)."""
        phase = self.phase
        phase.name, phase.since = "optimizer", t
        timer = self.timer
        if timer.every_s and not timer.timed_now(t):  # sampled out: nothing on the device
            timer.untimed += 1
        elif CAPTURE.active and timer.events is not None:  # a step captured into a CUDA graph
            pass  # (its replays run no hooks: they go untimed)
        else:
            try:  # the optimizer step must go on whatever happens here
                events = timer.events
                self._open = [t, t if events is None else events.record(), None, None]
            except Exception as exc:
                self._failed("before", exc)

    def _drop_open(self) -> None:
        """Forget an open span (a step that raised before its post-hook ran, or a closure
        called again): its start event goes back to the pool."""
        span, self._open = self._open, None
        if span is not None and self.timer.events is not None and type(span[1]) is not float:
            self.timer.events.put(span[1])

    def _post(self, *_: Any) -> None:
        if is_compiling():
            return
        t = perf_counter()
        span = self._open
        if span is not None:
            self._open = None
            try:
                timer = self.timer
                events = timer.events
                span[2] = t if events is None else events.record()
                timer.spans.append(span)
            except Exception as exc:
                self._failed("after", exc)
        phase = self.phase
        phase.name, phase.since = "after-optimizer", t
        phase.cost_s += perf_counter() - t

    def _failed(self, when: str, exc: Exception) -> None:
        reason = f"optimizer hook ({when} step): {type(exc).__name__}: {exc}"
        if self.on_error is not None:
            with contextlib.suppress(Exception):
                self.on_error(reason)
        else:
            log.warning("scalemon: %s", reason)

    def remove(self) -> None:
        """Unregister the hooks."""
        for handle in self._handles:
            handle.remove()


class AllReduceTimer:
    """A DDP communication hook: the default averaging all-reduce, timed per bucket."""

    def __init__(self, timer: SpanTimer, phase: Phase, warnings: Warnings | None = None,
                 calls: deque | None = None) -> None:
        self.timer = timer
        self.calls = calls  # HostCall lists for the recorder (durations on gloo)
        self.phase = phase
        self.warnings = warnings or Warnings()
        self._group: Any = None
        self._group_size = 1

    def register(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> bool:
        """Install on a DDP model (before its first backward). DDP takes one comm hook: when
        the model has one already, returns False and leaves it alone."""
        if getattr(ddp_model, "_comm_hooks", None):  # DDP's record of Python comm hooks
            log.warning("scalemon: all-reduce timing off: the script registered its own DDP "
                        "comm hook (DDP takes one)")
            return False
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
        t = time.perf_counter()
        tensor = bucket.buffer()
        phase = self.phase
        span = None
        try:
            phase.name, phase.since = "allreduce", t
            events = self.timer.events
            span = [t, t if events is None else events.record(), None, tensor, None]
            self.timer.spans.append(span)
        except Exception as exc:  # the all-reduce itself must go on
            span = None
            self.warnings.once("comm-hook", "scalemon: timing a DDP bucket's all-reduce failed "
                               "(%s: %s); such buckets go untimed", type(exc).__name__, exc)
        phase.cost_s += time.perf_counter() - t
        tensor.div_(self._group_size)
        fut = _all_reduce(tensor, group=self._group, async_op=True).get_future()
        if span is not None and self.calls is not None:
            t2 = time.perf_counter()
            try:
                span[4] = call = [self._group, sequence_number(self._group), None, None]
                self.calls.append(call)
            except Exception:  # a torch without sequence numbers: no duration for the table
                span[4] = None
            phase.cost_s += time.perf_counter() - t2
        return fut.then(lambda f: self._done(f, span))

    def _done(self, fut: torch.futures.Future, span: Span | None) -> torch.Tensor:
        """Close the span: gloo runs this once the data arrived; NCCL runs it at once, so on
        CUDA completion is counted when the step's events say so (steps.py)."""
        if span is not None:
            try:
                events = self.timer.events
                if events is None:
                    span[2] = time.perf_counter()
                    if span[4] is not None:
                        span[4][3] = span[2] - span[1]
                else:
                    span[2] = events.record()
            except Exception as exc:  # the gradients must still come back to DDP
                self.warnings.once("comm-done", "scalemon: closing an all-reduce span failed "
                                   "(%s: %s); such buckets go untimed", type(exc).__name__, exc)
        return fut.value()[0]
