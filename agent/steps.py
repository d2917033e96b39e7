"""A step's message, built in two halves: the training thread captures raw values in a few
microseconds, and the sender thread turns them into the `step` body once they are ready."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from .cudagraphs import CAPTURE, capture_mode_thread_local
from .heartbeat import Phase
from .p2p import step_fields
from .timing import EventPool, Span, current_stream_key, summarize
from .values import PLAIN_TYPES, on_device, plain_value, stageable
from .warn import Warnings

log = logging.getLogger("scalemon.agent")


class RawStep(NamedTuple):
    """What the training thread leaves per step (a tuple: cheaper to build than a dict there);
    the sender thread turns it into the `step` body (`StepFinisher.finish`)."""

    step: int
    tokens: int | None
    step_time_s: float | None
    agent_time_s: float
    extra: dict[str, Any] | None
    loss: float | None
    """A host float; None on CUDA, where it is in `staged`."""
    loss_scale: float | None
    """A host float; None on CUDA, where it is in `staged`."""
    optimizer_spans: list[Span]
    optimizer_untimed: int
    """`optimizer.step()` calls of this step that were not timed (sampled out)."""
    allreduce_spans: list[Span]
    staged: Staged | tuple | None
    """On CUDA the step's device scalars on their way to the host (`StepFinisher.stage`: a
    `Staged`, or for the common step the tuple the sender makes one of); else None. On CUDA
    the memory counters are read by the sender thread (`finish`)."""
    p2p: tuple | None = None
    """The step's P2P and all_to_all counters (`p2p.StepP2P.take`; gloo only), or None."""


new_raw_step: Callable[[tuple], RawStep] = functools.partial(tuple.__new__, RawStep)
"""A `RawStep` from a tuple of its 12 values, by C calls alone (the named tuple's own
constructor is a Python function: a frame on the training thread)."""


class Staged:
    """One step's device scalars on their way to pinned host memory (CUDA).

    The loss and the one-element CUDA tensors among the extra values are only noted on the
    training thread, with their version counters (`Tensor._version`, which every in-place
    operation bumps when it is queued); the sender thread queues their copies on the same
    stream later, behind everything the training thread queued by then, and reads a value
    only if no in-place operation on it was queued since `log()` (else the value is lost, said
    once, and copies are made at `log()` from then on). The loss scale, which GradScaler
    updates in place every step, is copied at `log()`. An event the sender records after its
    copies says when all of them, and the step's optimizer events before them, completed."""

    __slots__ = ("stream", "pinned", "later", "floats", "has_loss", "has_scale", "names",
                 "event", "lost")

    def __init__(self, stream: Any, pinned: tuple | None, later: list, floats: list,
                 has_loss: bool, has_scale: bool, names: Sequence[str]) -> None:
        self.stream = stream  # the training thread's current stream at log(), as its key
        self.pinned = pinned  # (pinned float32 buffer, its 0-d slots); None: not taken yet
        self.later = later  # (slot, tensor, version, data_ptr) for the sender to copy
        self.floats = floats  # (slot, host float): values that were no device tensors
        self.has_loss = has_loss
        self.has_scale = has_scale
        self.names = names  # the staged extra values' names (slots 2, 3, ...)
        self.event: Any = None  # recorded by the sender after queueing `later`
        self.lost: list[int] = []  # slots whose tensor changed before it could be read


MEMORY_READ_EVERY_S = 0.2
"""CUDA memory counters are read at most this often (steps in between carry the last read)."""
MEMORY_COUNTERS = {
    "mem_allocated_bytes": ("allocated_bytes", "all", "current"),
    "mem_reserved_bytes": ("reserved_bytes", "all", "current"),
    "mem_peak_bytes": ("allocated_bytes", "all", "peak"),
    "mem_alloc_retries": ("num_alloc_retries",),
}
"""The step's allocator metrics: where each is in `torch.cuda.memory_stats_as_nested_dict`."""
NO_DEVICE_MEMORY = dict.fromkeys(MEMORY_COUNTERS)
NO_NAMES: tuple[str, ...] = ()
"""The names of a step's staged extra values when it has none (shared, never changed)."""


class ScaleTracker:
    """Derives skipped steps from the AMP loss scale: GradScaler lowers it exactly when a step
    had inf/NaN gradients and was skipped. Used by the sender thread only, in step order."""

    def __init__(self, init_scale: float | None) -> None:
        self.previous = init_scale
        self.skipped_steps = 0

    def account(self, body: dict[str, Any]) -> None:
        scale = body.get("loss_scale")
        if scale is None:
            return
        skipped = self.previous is not None and scale < self.previous
        self.skipped_steps += int(skipped)
        body["skipped"] = skipped
        body["skipped_steps"] = self.skipped_steps
        self.previous = scale


class StepFinisher:
    """Stages device scalars on the training thread (CUDA) and finishes step bodies on the
    sender thread. Holds what every step of a run shares: loss-scale accounting, the CUDA
    event pool and pinned buffers (None and unused on CPU), and the phase whose
    completed-collective count it advances on CUDA."""

    def __init__(self, scales: ScaleTracker, phase: Phase, events: EventPool | None,
                 warnings: Warnings | None = None, scaler: Any = None,
                 read_memory: Callable[[], dict[str, Any]] | None = None) -> None:
        self.scales = scales
        self.read_memory = read_memory  # CUDA: the allocator's counters, read when finishing
        self._memory: dict[str, Any] | None = None
        self._memory_at = 0.0
        self.scaler = scaler  # a ScaleReader: its `state` is `step.scaler`
        self.phase = phase
        self.events = events
        self.warnings = warnings or Warnings()
        self.pinned: dict[int, list[tuple]] = {}  # free (pinned buffer, slots) by length
        self.defer = True
        """Device values are copied by the sender thread (`Staged`); False once one of them
        changed before it was read: from then on they are copied at `log()`."""
        self._last_optimizer: tuple[float, int] | None = None  # (seconds, step) last timed
        self._last_later: list = []  # the previous step's `Staged.later`
        self._sender_ready = False  # the sender thread's CUDA capture mode was set
        self._finishing: tuple | None = None  # (RawStep, its Staged) while not ready

    def stage(self, loss: Any, scale: Any, extra: dict[str, Any] | None) -> Staged:
        """Note the step's device scalars (loss, loss scale, one-element CUDA tensors among
        the extra values) for copying to pinned host memory without a sync (`Staged`): on the
        training thread only the loss scale is copied, and only host work is done for the
        rest.

        The common step (its loss a tensor on the model's device, no extra values, values
        deferred, the previous step's tensor not reused) is only noted here, in a tuple the
        sender turns into a `Staged` (`_staged_of`), with no call of ours; any other step goes
        the general way (`_stage_any`), which returns a `Staged`."""
        # Every call here runs with caches cold from the step, a tensor's call (cold C++) the
        # costliest: four of them. A CPU tensor's device is -1, so `get_device` tells a tensor
        # on the model's GPU; the sender checks that it has one element (`_queue_later`) and
        # detaches it, if need be (`_queue_copy`: held until then, its graph has freed its
        # tensors). No CUDA graph is being captured while `defer` holds (`on_graph_capture`).
        events = self.events
        if (extra or not self.defer or type(loss) is not torch.Tensor
                or loss.get_device() != events.index
                or not (scale is None or type(scale) is torch.Tensor)):
            return self._stage_any(loss, scale, extra)
        try:  # an inference-mode tensor keeps no version; a given-back graph output raises
            later = [(0, loss, loss._version, loss.data_ptr())]
            previous = self._last_later
            if previous and (len(previous) > 1 or previous[0][1]._version != previous[0][2]
                             or previous[0][3] == later[0][3]):
                return self._stage_any(loss, scale, extra)  # which tells reuse (`_reused`)
        except RuntimeError:
            return self._stage_any(loss, scale, extra)
        self._last_later = later
        pinned = None
        if scale is not None:  # GradScaler's scale, updated in place each step: copied now
            pinned = self._take_pinned(2)
            self._copy_now(pinned[1][1], scale)
        return current_stream_key(events.index), later, pinned

    def _staged_of(self, raw: tuple, noted: tuple) -> Staged:
        """On the sender thread: the `Staged` of the step `raw`, whose `stage` left only the
        tuple `noted` (made once: `finish` is called again while the step is not ready)."""
        if self._finishing is not None and self._finishing[0] is raw:
            return self._finishing[1]
        key, later, pinned = noted
        staged = Staged(key, pinned, later, [], True, pinned is not None, NO_NAMES)
        self._finishing = (raw, staged)
        return staged

    def _take_pinned(self, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A free pinned buffer of `n` floats with its slots (either thread may take one)."""
        try:
            return self.pinned[n].pop()
        except (KeyError, IndexError):
            return _pinned_slots(n)

    def _stage_any(self, loss: Any, scale: Any, extra: dict[str, Any] | None) -> Staged:
        """`stage` for any step: values on the host or another device, extra values, a CUDA
        graph capture in progress, values copied at `log()`, tensors the script reuses."""
        if CAPTURE.active:  # inside a CUDA graph capture: any copy would be captured
            self.warnings.once("log-in-capture", "scalemon: log() was called while a CUDA graph "
                               "was being captured; device values of such calls are left out")
            loss, scale = _host_only(loss), _host_only(scale)
            for name in [k for k, v in extra.items() if _device_scalar(v)] if extra else ():
                del extra[name]  # the step's own dict (log's keywords): the sender sends it
        names = [k for k, v in extra.items() if _device_scalar(v)] if extra else []
        loss, scale = self._stageable(loss, "loss"), self._stageable(scale, "the loss scale")
        values = [loss, scale, *(extra[k] for k in names)]
        buf, slots = self._take_pinned(len(values))
        events = self.events
        later, floats = [], []
        for i, value in enumerate(values):
            if value is None:
                continue
            if type(value) is float:
                floats.append((i, value))
                continue
            if i != 1 and self.defer and _device_scalar(value) and (
                    value.get_device() == events.index):
                tensor = value.detach() if value.requires_grad else value
                try:
                    later.append((i, tensor, tensor._version, tensor.data_ptr()))
                    continue
                except RuntimeError:  # an inference-mode tensor keeps no version: copy now
                    pass
            self._copy_now(slots[i], value)
        if self._last_later and self._reused(later):
            self.defer = False
            log.info("scalemon: a tensor given to log() is reused by the script (changed in "
                     "place, or the same storage again); device values are copied at log() "
                     "from now on")
            for i, tensor, *_ in later:
                self._copy_now(slots[i], tensor)
            later = []
        self._last_later = later
        return Staged(current_stream_key(events.index), (buf, slots), later, floats,
                      loss is not None, scale is not None, names)

    def _reused(self, later: list) -> bool:
        """Whether the script reuses the tensors it logs, by the previous step's: one changed
        in place since (an accumulator logged, then reset), or one whose storage is logged
        again (a static output buffer that the next CUDA-graph replay overwrites without a
        version change). The sender may then come too late for this step's values too, so they
        are copied now (whether the previous step's could still be read, the sender says)."""
        previous = self._last_later
        try:
            if any(tensor._version != version for _, tensor, version, _ in previous):
                return True
        except RuntimeError:  # a CUDA-graph output already given back: its storage says so
            return True
        storages = {ptr for *_, ptr in previous}  # (their storages live: `later` holds them)
        return any(ptr in storages for *_, ptr in later)

    def on_graph_capture(self) -> None:
        """A CUDA graph capture began in this process (cudagraphs.py): its outputs are
        overwritten by each replay without a version change, so values are copied at `log()`
        from now on."""
        if self.defer:
            self.defer = False
            log.info("scalemon: a CUDA graph was captured; device values given to log() are "
                     "copied at log() from now on")

    def _copy_now(self, slot: torch.Tensor, value: torch.Tensor) -> None:
        """Queue the copy of `value` into `slot` on the current stream, from the training
        thread (the GIL-keeping direct call where it applies)."""
        events = self.events
        direct = events.direct
        if direct is not None and _direct_copyable(value, events.index):
            try:
                direct.copy_scalar(slot, value, events.stream_handle())
                return
            except Exception as exc:  # torch's copy from now on
                events.no_direct(exc)
        if value.requires_grad:
            value = value.detach()
        _queue_copy(slot, value)

    def _queue_later(self, staged: Staged, step: int) -> None:
        """On the sender thread: queue the copies `stage` left, on the step's stream, then an
        event behind them. A tensor changed in place since `log()` (its version moved, before
        or after its copy was queued) is not read: its value is lost, said once, and `stage`
        copies at `log()` from then on."""
        if staged.pinned is None:  # (the common step leaves taking it to this thread)
            staged.pinned = self._take_pinned(2 + len(staged.names))
        slots = staged.pinned[1]
        stream = self.events.stream_of(staged.stream)
        with torch.cuda.stream(stream):
            for i, tensor, version, _ in staged.later:
                if i == 0 and tensor.numel() != 1:  # (`stage` leaves this check to here)
                    staged.lost.append(i)
                    self.warnings.once("log-loss", "scalemon: %s given to log() cannot be read "
                                       "(%s); it is left out", "loss",
                                       f"a tensor of {tensor.numel()} elements")
                    continue
                why = copy_if_unchanged(slots[i], tensor, version)
                if why is not None:
                    staged.lost.append(i)
                    self._stop_deferring(step, _value_name(i, staged.names), why)
            staged.event = self.events.record_on(stream)

    def _stop_deferring(self, step: int, name: str, why: str) -> None:
        self.defer = False
        self.warnings.once("deferred-copy", "scalemon: %s of step %d could not be read (%s), so "
                           "it is left out of that step; from now on the monitor copies device "
                           "values at log() instead, on the training thread", name, step, why)

    def _add_memory(self, body: dict[str, Any]) -> None:
        """The allocator's counters, read here on the sender thread rather than on the
        training thread (tens of microseconds of Python, during which the training thread
        cannot run Python either), and at most every `MEMORY_READ_EVERY_S`: the values of a
        moment after the step, or of the last read."""
        now = time.monotonic()
        try:
            if self._memory is None or now - self._memory_at >= MEMORY_READ_EVERY_S:
                self._memory, self._memory_at = self.read_memory(), now
            body.update(self._memory)
        except Exception as exc:  # memory shows n/a; the step still goes
            self.warnings.once("cuda-memory", "scalemon: reading the CUDA allocator's counters "
                               "failed (%s: %s); memory is n/a", type(exc).__name__, exc)

    def _stageable(self, value: Any, name: str) -> Any:
        """`value` if it is a one-element tensor, else it as a float; None (said once) for a
        value that is neither (a loss of several elements, a string)."""
        if value is None:
            return None
        try:
            return stageable(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            self.warnings.once(f"log-{name}", "scalemon: %s given to log() cannot be read "
                               "(%s); it is left out", name, exc)
            return None

    def finish(self, raw: RawStep, deadline: float | None) -> dict[str, Any] | None:
        """The finished body of `raw` (a `RawStep`, or a plain tuple in its order), or None
        while the device has not reached this step (waiting until the monotonic `deadline` at
        most, when one is given)."""
        (step, tokens, step_time, agent_time, extra, loss, scale, opt_spans, opt_untimed,
         comm_spans, staged) = raw[:11]
        body: dict[str, Any] = {"step": step, "tokens": tokens, "step_time_s": step_time,
                                "agent_time_s": agent_time, "loss": loss, "loss_scale": scale,
                                "scaler": self.scaler.state if self.scaler is not None else None}
        body.update(NO_DEVICE_MEMORY)  # CUDA: the counters come with the staged values
        if staged is not None:
            if type(staged) is tuple:  # the common step's, as `stage` noted it
                staged = self._staged_of(raw, staged)
            if not self._sender_ready:  # the first CUDA work of the sender thread
                self._sender_ready = True
                capture_mode_thread_local()
            if staged.event is None:
                self._queue_later(staged, step)
            event = staged.event
            while not event.query():
                if deadline is None or time.monotonic() >= deadline:
                    return None
                time.sleep(0.001)
            values = staged.pinned[0].tolist()  # host memory, written by the completed copies
            for i, value in staged.floats:
                values[i] = value
            for i in staged.lost:
                values[i] = None
            body["loss"] = values[0] if staged.has_loss else None
            body["loss_scale"] = values[1] if staged.has_scale else None
            for name, value in zip(staged.names, values[2:], strict=True):
                if value is None:
                    del extra[name]
                else:
                    extra[name] = value
            self.pinned.setdefault(len(values), []).append(staged.pinned)
            self.events.put(event)
            staged.later = []  # the tensors may go
            self._finishing = None
            if self.read_memory is not None:
                self._add_memory(body)
        if extra:
            body["extra"] = self._sendable(extra)
        wall_offset = time.time() - time.perf_counter()
        opt = summarize(opt_spans, self.events, wall_offset)
        comm = summarize(comm_spans, self.events, wall_offset)
        self._add_optimizer(body, step, opt["seconds"], opt_untimed)
        body["allreduce_time_s"] = comm["seconds"]
        body["allreduce_count"] = comm["count"]
        body["allreduce_bytes"] = comm["bytes"]
        body["allreduce_issue_t"] = comm["issue_t"]
        body.update(step_fields(raw[11] if len(raw) > 11 else None, step_time))
        self.scales.account(body)
        return body

    def _add_optimizer(self, body: dict[str, Any], step: int, seconds: float | None,
                       untimed: int) -> None:
        """`optimizer_time_s` and the step it was measured at: this one, or, for a step whose
        optimizer calls were sampled out, the last timed step's figure."""
        if seconds is not None:
            self._last_optimizer = (seconds, step)
            body["optimizer_time_s"], body["optimizer_timed_step"] = seconds, step
        elif untimed and self._last_optimizer is not None:
            body["optimizer_time_s"], body["optimizer_timed_step"] = self._last_optimizer
        else:
            body["optimizer_time_s"] = body["optimizer_timed_step"] = None

    def _sendable(self, extra: dict[str, Any]) -> dict[str, Any]:
        """`extra` with NumPy/tensor scalars made plain; a value that cannot be sent (a tensor
        with several elements, an object) is left out, with a warning once per name, so one
        bad value never costs the step."""
        out = {}
        for name, value in extra.items():
            try:
                value = plain_value(value)
            except Exception as exc:  # a DTensor that needs a collective, a failing __float__
                self.warnings.once(f"extra:{name}", "scalemon: log(%s=...) cannot be read: %s; "
                                   "that value is left out", name, exc)
                continue
            if type(value) in PLAIN_TYPES:
                out[name] = value
            else:
                self.warnings.once(f"extra:{name}", "scalemon: log(%s=...) is of type %s; only "
                                   "numbers, strings and one-element tensors are sent, so that "
                                   "value is left out", name, type(value).__name__)
        return out


def _pinned_slots(n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A pinned host buffer of `n` floats and a 0-d view of each element (made once, so that
    staging a value costs one copy launch)."""
    buf = torch.empty(n, pin_memory=True)
    return buf, list(buf.unbind())


def cuda_memory(device: torch.device) -> dict[str, int | None]:
    """Allocator counters of `device` (host-side, no sync; thread-safe in the allocator), from
    one call: each of `torch.cuda.memory_allocated()` and friends flattens the allocator's
    whole statistics (some hundred entries) in Python, three times the work for three
    numbers."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    return {name: _nested(stats, path) for name, path in MEMORY_COUNTERS.items()}


def _nested(stats: dict[str, Any], path: tuple[str, ...]) -> Any:
    """`stats[path[0]][path[1]]...`, None where a level is missing."""
    value: Any = stats
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _direct_copyable(value: torch.Tensor, index: int) -> bool:
    """A float32 tensor of one element on CUDA device `index` (the stream's), whose 4 bytes a
    raw copy can take."""
    return (value.dtype is torch.float32 and value.is_cuda and value.numel() == 1
            and value.get_device() == index)


def _queue_copy(slot: torch.Tensor, value: torch.Tensor) -> None:
    """Queue the copy of one-element `value` into the 0-dim `slot`, not waiting for it (a
    value that requires grad is detached first: `slot` must not join its graph)."""
    if value.requires_grad:
        value = value.detach()
    slot.copy_(value if value.dim() == 0 else value.reshape(()), non_blocking=True)


def copy_if_unchanged(slot: torch.Tensor, tensor: torch.Tensor, version: int) -> str | None:
    """Queue the copy of the one-element `tensor` into `slot` (on the current stream, not
    waiting) unless an in-place operation on it was queued since its version was `version`,
    checked before and after queueing; None when the copy holds the value of then, else why
    it does not (the slot's content is then not to be read)."""
    try:
        if tensor._version == version:
            _queue_copy(slot, tensor)
            if tensor._version == version:
                return None
        return "the script changed it in place after log()"
    except Exception as exc:  # a CUDA-graph output already overwritten, say
        return f"{type(exc).__name__}: {exc}"


def _host_only(value: Any) -> Any:
    """`value`, or None where it is a tensor on a GPU."""
    return None if on_device(value) else value


def _value_name(slot: int, names: list[str]) -> str:
    """What a staged slot holds, in words."""
    return "the loss" if slot == 0 else f"log({names[slot - 2]}=...)"


def _device_scalar(value: Any) -> bool:
    """A one-element CUDA tensor (not a DTensor: `_sendable` reads those)."""
    return type(value) is torch.Tensor and value.is_cuda and value.numel() == 1
