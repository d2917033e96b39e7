"""A step's message, built in two halves: the training thread captures raw values in a few
microseconds, and the sender thread turns them into the `step` body once they are ready."""

from __future__ import annotations

import time
from typing import Any

import torch

from .heartbeat import Phase
from .timing import EventPool, Span, summarize
from .transport import PLAIN_TYPES, local_value, plain_value
from .warn import Warnings

# What the training thread leaves per step, one tuple (cheaper to build than a dict there):
# step, tokens, step time, agent time, extra, loss and loss scale (host floats; None on CUDA),
# device memory (dict or None), optimizer spans, all-reduce spans, and on CUDA the staged device
# scalars (event, pinned buffer, has loss, has scale, names of staged `extra` values), else None.
RawStep = tuple[
    int, "int | None", "float | None", float, "dict | None", "float | None", "float | None",
    "dict | None", list[Span], list[Span], "tuple | None",
]
NO_DEVICE_MEMORY = {"mem_allocated_bytes": None, "mem_reserved_bytes": None, "mem_peak_bytes": None}


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
                 warnings: Warnings | None = None, scaler: Any = None) -> None:
        self.scales = scales
        self.scaler = scaler  # a ScaleReader: its `state` is `step.scaler`
        self.phase = phase
        self.events = events
        self.warnings = warnings or Warnings()
        self.pinned: dict[int, list[torch.Tensor]] = {}  # free pinned buffers by length

    def stage(self, loss: Any, scale: torch.Tensor | None, extra: dict[str, Any] | None) -> tuple:
        """Copy device scalars (loss, loss scale, and one-element CUDA tensors among the extra
        values) to pinned host memory behind a CUDA event (no sync)."""
        names = [k for k, v in extra.items() if _device_scalar(v)] if extra else []
        loss, scale = self._stageable(loss, "loss"), self._stageable(scale, "the loss scale")
        values = [loss, scale, *(extra[k] for k in names)]
        free = self.pinned.get(len(values))
        buf = free.pop() if free else torch.empty(len(values), pin_memory=True)
        for i, value in enumerate(values):
            if isinstance(value, torch.Tensor):
                buf[i].copy_(value.detach().reshape(()), non_blocking=True)
            elif value is not None:
                buf[i] = value
        return (self.events.record(), buf, loss is not None, scale is not None, names)

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
        """The finished body, or None while the device has not reached this step (waiting
        until the monotonic `deadline` at most, when one is given)."""
        (step, tokens, step_time, agent_time, extra, loss, scale, memory, opt_spans, comm_spans,
         staged) = raw
        body: dict[str, Any] = {"step": step, "tokens": tokens, "step_time_s": step_time,
                                "agent_time_s": agent_time, "loss": loss, "loss_scale": scale,
                                "scaler": self.scaler.state if self.scaler is not None else None}
        body.update(memory or NO_DEVICE_MEMORY)
        if staged is not None:
            event, buf, has_loss, has_scale, names = staged
            while not event.query():
                if deadline is None or time.monotonic() >= deadline:
                    return None
                time.sleep(0.001)
            values = buf.tolist()  # host memory, written by the completed copy
            body["loss"] = values[0] if has_loss else None
            body["loss_scale"] = values[1] if has_scale else None
            for name, value in zip(names, values[2:], strict=True):
                extra[name] = value
            self.pinned.setdefault(len(values), []).append(buf)
            self.events.put(event)
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


def _device_scalar(value: Any) -> bool:
    """A one-element CUDA tensor (not a DTensor: `_sendable` reads those)."""
    return type(value) is torch.Tensor and value.is_cuda and value.numel() == 1
