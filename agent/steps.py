"""A step's message, built in two halves: the training thread captures raw values in a few
microseconds, and the sender thread turns them into the `step` body once they are ready."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .heartbeat import Phase
from .timing import EventPool, Interval, summarize


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


@dataclass
class StepShared:
    """What every step record of a run uses: loss-scale accounting, the CUDA event pool and
    pinned buffers (None on CPU), and the phase whose completed-collective count it advances."""

    scales: ScaleTracker
    phase: Phase
    events: EventPool | None = None
    pinned: list[torch.Tensor] = field(default_factory=list)


class StepRecord:
    """One logged step whose device values may still be in flight."""

    __slots__ = ("body", "opt_spans", "comm_spans", "shared", "event", "buf", "has")

    def __init__(
        self, body: dict[str, Any], opt_spans: list[Interval], comm_spans: list[Interval],
        shared: StepShared,
    ) -> None:
        self.body = body
        self.opt_spans = opt_spans
        self.comm_spans = comm_spans
        self.shared = shared
        self.event: torch.cuda.Event | None = None
        self.buf: torch.Tensor | None = None
        self.has = (False, False)

    def stage(self, loss: Any, scale: torch.Tensor | None) -> None:
        """Copy device scalars to pinned host memory behind a CUDA event (no sync)."""
        pinned = self.shared.pinned
        buf = pinned.pop() if pinned else torch.empty(2, pin_memory=True)
        for i, value in enumerate((loss, scale)):
            if isinstance(value, torch.Tensor):
                buf[i].copy_(value.detach().reshape(()), non_blocking=True)
            elif value is not None:
                buf[i] = float(value)
        self.buf = buf
        self.has = (loss is not None, scale is not None)
        self.event = self.shared.events.record()

    def resolve(self, deadline: float | None) -> dict[str, Any] | None:
        """The finished body, or None while the device has not reached this step (waiting
        until the monotonic `deadline` at most, when one is given)."""
        if self.event is not None:
            while not self.event.query():
                if deadline is None or time.monotonic() >= deadline:
                    return None
                time.sleep(0.001)
            loss, scale = self.buf.tolist()  # host memory, written by the completed copy
            self.body["loss"] = loss if self.has[0] else None
            self.body["loss_scale"] = scale if self.has[1] else None
            self.shared.pinned.append(self.buf)
            self.shared.events.put(self.event)
            self.shared.phase.collectives_completed += len(self.comm_spans)
        events = self.shared.events
        opt = summarize(self.opt_spans, events)
        comm = summarize(self.comm_spans, events)
        body = self.body
        body["optimizer_time_s"] = opt["seconds"]
        body["allreduce_time_s"] = comm["seconds"]
        body["allreduce_count"] = comm["count"]
        body["allreduce_bytes"] = comm["bytes"]
        body["allreduce_issue_t"] = comm["issue_t"]
        self.shared.scales.account(body)
        return body
