"""A step's message, built in two halves: the training thread captures raw values in a few
microseconds, and the sender thread turns them into the `step` body once they are ready."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .heartbeat import Phase
from .timing import EventPool, Span, summarize
from .transport import PLAIN_TYPES, local_value, plain_value
from .warn import Warnings


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
    allreduce_spans: list[Span]
    staged: tuple | None
    """On CUDA the staged device scalars (`StepFinisher.stage`: event, (pinned buffer, its 0-d
    slots), has loss, has scale, names of staged `extra` values); else None. On CUDA the
    memory counters are read by the sender thread (`finish`)."""


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

    def stage(self, loss: Any, scale: torch.Tensor | None, extra: dict[str, Any] | None) -> tuple:
        """Copy device scalars (loss, loss scale, and one-element CUDA tensors among the extra
        values) to pinned host memory behind a CUDA event (no sync)."""
        names = [k for k, v in extra.items() if _device_scalar(v)] if extra else []
        loss, scale = self._stageable(loss, "loss"), self._stageable(scale, "the loss scale")
        values = [loss, scale, *(extra[k] for k in names)]
        free = self.pinned.get(len(values))
        buf, slots = free.pop() if free else _pinned_slots(len(values))
        events = self.events
        direct, stream = events.direct, events.stream_handle()
        for slot, value in zip(slots, values):  # noqa: B905 - same length by construction
            if isinstance(value, torch.Tensor):
                if direct is not None and _direct_copyable(value, events.index):
                    try:
                        direct.copy_scalar(slot, value, stream)
                        continue
                    except Exception as exc:  # torch's copy from now on
                        events.no_direct(exc)
                        direct = None
                if value.requires_grad:
                    value = value.detach()
                slot.copy_(value if value.dim() == 0 else value.reshape(()), non_blocking=True)
            elif value is not None:
                slot.fill_(value)
        return (events.record(stream), (buf, slots), loss is not None, scale is not None,
                names)

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
            if isinstance(value, torch.Tensor):
                value = local_value(value)
                if value.numel() == 1:
                    return value
                raise ValueError(f"a tensor of {value.numel()} elements")
            return float(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            self.warnings.once(f"log-{name}", "scalemon: %s given to log() cannot be read "
                               "(%s); it is left out", name, exc)
            return None

    def finish(self, raw: RawStep, deadline: float | None) -> dict[str, Any] | None:
        """The finished body of `raw` (a `RawStep`, or a plain tuple in its order), or None
        while the device has not reached this step (waiting until the monotonic `deadline` at
        most, when one is given)."""
        (step, tokens, step_time, agent_time, extra, loss, scale, opt_spans, comm_spans,
         staged) = raw
        body: dict[str, Any] = {"step": step, "tokens": tokens, "step_time_s": step_time,
                                "agent_time_s": agent_time, "loss": loss, "loss_scale": scale,
                                "scaler": self.scaler.state if self.scaler is not None else None}
        body.update(NO_DEVICE_MEMORY)  # CUDA: the counters come with the staged values
        if staged is not None:
            event, pinned, has_loss, has_scale, names = staged
            while not event.query():
                if deadline is None or time.monotonic() >= deadline:
                    return None
                time.sleep(0.001)
            values = pinned[0].tolist()  # host memory, written by the completed copy
            body["loss"] = values[0] if has_loss else None
            body["loss_scale"] = values[1] if has_scale else None
            for name, value in zip(names, values[2:], strict=True):
                extra[name] = value
            self.pinned.setdefault(len(values), []).append(pinned)
            self.events.put(event)
            if self.read_memory is not None:
                self._add_memory(body)
        if extra:
            body["extra"] = self._sendable(extra)
        wall_offset = time.time() - time.perf_counter()
        opt = summarize(opt_spans, self.events, wall_offset)
        comm = summarize(comm_spans, self.events, wall_offset)
        body["optimizer_time_s"] = opt["seconds"]
        body["allreduce_time_s"] = comm["seconds"]
        body["allreduce_count"] = comm["count"]
        body["allreduce_bytes"] = comm["bytes"]
        body["allreduce_issue_t"] = comm["issue_t"]
        self.scales.account(body)
        return body

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


def _device_scalar(value: Any) -> bool:
    """A one-element CUDA tensor (not a DTensor: `_sendable` reads those)."""
    return type(value) is torch.Tensor and value.is_cuda and value.numel() == 1
