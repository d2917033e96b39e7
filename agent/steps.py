"""A step's message, built in two halves: the training thread captures raw values in a few
microseconds, and the sender thread turns them into the `step` body once they are ready."""

from __future__ import annotations

from typing import Any

import torch

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


class StepRecord:
    """One logged step whose device values may still be in flight."""

    __slots__ = ("body", "opt_spans", "comm_spans", "event", "buf", "has", "events", "pinned",
                 "scales")

    def __init__(
        self, body: dict[str, Any], opt_spans: list[Interval], comm_spans: list[Interval],
        scales: ScaleTracker, events: EventPool | None = None, pinned: list | None = None,
    ) -> None:
        self.body = body
        self.opt_spans = opt_spans
        self.comm_spans = comm_spans
        self.scales = scales
        self.events = events
        self.pinned = pinned
        self.event: torch.cuda.Event | None = None
        self.buf: torch.Tensor | None = None
        self.has = (False, False)

    def stage(self, loss: Any, scale: torch.Tensor | None) -> None:
        """Copy device scalars to pinned host memory behind a CUDA event (no sync)."""
        buf = self.pinned.pop() if self.pinned else torch.empty(2, pin_memory=True)
        for i, value in enumerate((loss, scale)):
            if isinstance(value, torch.Tensor):
                buf[i].copy_(value.detach().reshape(()), non_blocking=True)
            elif value is not None:
                buf[i] = float(value)
        self.buf = buf
        self.has = (loss is not None, scale is not None)
        self.event = self.events.get()
        self.event.record()

    def resolve(self, wait: bool) -> dict[str, Any] | None:
        """The finished body, or None while the device has not reached this step."""
        if self.event is not None:
            if wait:
                self.event.synchronize()
            elif not self.event.query():
                return None
            loss, scale = self.buf.tolist()
            self.body["loss"] = loss if self.has[0] else None
            self.body["loss_scale"] = scale if self.has[1] else None
            self.pinned.append(self.buf)
            self.events.put(self.event)
        opt = summarize(self.opt_spans, self.events)
        comm = summarize(self.comm_spans, self.events)
        body = self.body
        body["optimizer_time_s"] = opt["seconds"]
        body["allreduce_time_s"] = comm["seconds"]
        body["allreduce_count"] = comm["count"]
        body["allreduce_bytes"] = comm["bytes"]
        body["allreduce_issue_t"] = comm["issue_t"]
        self.scales.account(body)
        return body
