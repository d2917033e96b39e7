"""Fold a stream of protocol messages into the current state of a job.

The hub and every dashboard run the same reducer over the same history, so they agree on what
each rank is doing. Times are seconds, sizes bytes; a value that cannot exist (no GPU) is None.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from scalemon.protocol import HUB_RANK, Message

STEP_FIELDS = (
    "loss",
    "tokens",
    "step_time_s",
    "loss_scale",
    "skipped",
    "skipped_steps",
    "optimizer_time_s",
    "allreduce_time_s",
    "allreduce_count",
    "allreduce_bytes",
    "allreduce_issue_t",
    "mem_allocated_bytes",
    "mem_reserved_bytes",
    "mem_peak_bytes",
    "agent_time_s",
)
HEARTBEAT_FIELDS = (
    "phase",
    "phase_since_s",
    "collectives_issued",
    "collectives_completed",
    "cpu_pct",
    "rss_bytes",
    "gpu_util_pct",
    "gpu_mem_used_bytes",
    "gpu_mem_total_bytes",
    "gpu_power_w",
    "gpu_temp_c",
    "dropped",
    "queued",
)
TERMINAL_STATES = ("exited", "finished")


@dataclass
class RankView:
    """Everything known about one rank: identity, state and the latest value of each metric."""

    rank: int
    host: str | None = None
    pid: int | None = None
    local_rank: int | None = None
    restart_count: int | None = None
    device: str | None = None
    backend: str | None = None
    state: str = "running"
    state_reason: str | None = None
    exit_code: int | None = None
    step: int | None = None
    steps_received: int = 0
    last_seen_t: float | None = None
    last_seq: int | None = None
    seq_seen: int = 0
    seq_gaps: int = 0
    loss: float | None = None
    tokens: int | None = None
    step_time_s: float | None = None
    loss_scale: float | None = None
    skipped: bool | None = None
    skipped_steps: int | None = None
    optimizer_time_s: float | None = None
    allreduce_time_s: float | None = None
    allreduce_count: int | None = None
    allreduce_bytes: int | None = None
    allreduce_issue_t: float | None = None
    mem_allocated_bytes: int | None = None
    mem_reserved_bytes: int | None = None
    mem_peak_bytes: int | None = None
    agent_time_s: float | None = None
    phase: str | None = None
    phase_since_s: float | None = None
    collectives_issued: int | None = None
    collectives_completed: int | None = None
    cpu_pct: float | None = None
    rss_bytes: int | None = None
    gpu_util_pct: float | None = None
    gpu_mem_used_bytes: int | None = None
    gpu_mem_total_bytes: int | None = None
    gpu_power_w: float | None = None
    gpu_temp_c: float | None = None
    dropped: int | None = None
    queued: int | None = None
    error: str | None = None

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        """A JSON-ready dict, with `heartbeat_age_s` computed against `now`."""
        out = asdict(self)
        now = time.time() if now is None else now
        out["heartbeat_age_s"] = None if self.last_seen_t is None else now - self.last_seen_t
        return out


@dataclass
class JobState:
    """The reducer: `apply` each message in history order."""

    job: str | None = None
    world_size: int | None = None
    ranks: dict[int, RankView] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    messages: int = 0
    started_t: float | None = None
    last_t: float | None = None

    def __post_init__(self) -> None:
        # message type -> handler, looked up once (subclasses may override `_on_<type>`)
        self._handlers = {name[4:]: getattr(self, name) for name in dir(self)
                          if name.startswith("_on_")}

    def rank(self, rank: int) -> RankView:
        """The view of `rank`, created on first sight."""
        view = self.ranks.get(rank)
        if view is None:
            view = self.ranks[rank] = RankView(rank)
        return view

    def apply(self, msg: Message) -> RankView | None:
        """Fold one message in; returns the rank view it changed (None for hub-level ones)."""
        self.messages += 1
        self.job = self.job or msg.job
        t = msg.t
        if self.started_t is None or t < self.started_t:
            self.started_t = t
        if self.last_t is None or t > self.last_t:
            self.last_t = t
        handler = self._handlers.get(msg.type)
        if msg.rank == HUB_RANK:
            return handler(msg) if handler else None
        view = self.ranks.get(msg.rank) or self.rank(msg.rank)
        if msg.type == "hello":  # a new agent process numbers from 0 again
            view.last_seq, view.seq_seen = None, 0
        view.seq_seen += 1
        if view.last_seq is None or msg.seq > view.last_seq:
            view.last_seq = msg.seq
        # messages may arrive out of order (steps wait for the device), so count, not compare
        view.seq_gaps = max(0, view.last_seq + 1 - view.seq_seen)
        view.last_seen_t = t
        if handler:
            handler(msg, view)
        return view

    def _on_hello(self, msg: Message, view: RankView) -> None:
        b = msg.body
        view.host, view.pid, view.local_rank = b["host"], b["pid"], b["local_rank"]
        view.restart_count = b.get("restart_count")
        view.device, view.backend = b.get("device"), b.get("backend")
        view.state, view.state_reason, view.exit_code, view.error = "running", None, None, None
        self.world_size = max(self.world_size or 0, b["world_size"])

    def _on_step(self, msg: Message, view: RankView) -> None:
        b = msg.body
        view.step = b["step"]
        view.steps_received += 1
        vars(view).update({name: b.get(name) for name in STEP_FIELDS})  # absent -> None
        if view.state == "lost":
            view.state, view.state_reason = "running", None

    def _on_heartbeat(self, msg: Message, view: RankView) -> None:
        b = msg.body
        vars(view).update({name: b.get(name) for name in HEARTBEAT_FIELDS})
        if view.state == "lost":
            view.state, view.state_reason = "running", None

    def _on_info(self, msg: Message, view: RankView) -> None:
        self.info.setdefault(msg.body["key"], {})[msg.rank] = msg.body["value"]

    def _on_exit(self, msg: Message, view: RankView) -> None:
        b = msg.body
        view.state = "finished" if b["reason"] == "finished" else "exited"
        view.state_reason = b["reason"]
        view.exit_code = b.get("exit_code")
        view.error = b.get("error")
        if b.get("dropped") is not None:
            view.dropped = b["dropped"]

    def _on_rank_state(self, msg: Message) -> None:
        b = msg.body
        view = self.rank(b["target"])
        view.state, view.state_reason = b["state"], b.get("reason")
        if b.get("exit_code") is not None:
            view.exit_code = b["exit_code"]
        return None

    @property
    def state(self) -> str:
        """running, finished (every rank finished), ended (all stopped), degraded or waiting."""
        views = list(self.ranks.values())
        expected = self.world_size or len(views)
        if not views:
            return "waiting"
        states = [v.state for v in views]
        if len(views) >= expected and all(s == "finished" for s in states):
            return "finished"
        if len(views) >= expected and all(s in (*TERMINAL_STATES, "lost") for s in states):
            return "ended"
        if any(s in ("lost", "exited") for s in states):
            return "degraded"
        return "running"

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        """The whole state as JSON-ready data (what `scalemon snapshot --json` prints)."""
        now = time.time() if now is None else now
        return {
            "job": self.job,
            "world_size": self.world_size,
            "state": self.state,
            "messages": self.messages,
            "started_t": self.started_t,
            "last_t": self.last_t,
            "info": {k: {str(r): v for r, v in d.items()} for k, d in self.info.items()},
            "ranks": [self.ranks[r].to_json(now) for r in sorted(self.ranks)],
        }
