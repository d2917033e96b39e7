"""Fold a stream of protocol messages into the current state of a job.

The hub and every dashboard run the same reducer over the same history, so they agree on what
each rank is doing. Times are seconds, sizes bytes; a value that cannot exist (no GPU) is None.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any

from scalemon import metrics
from scalemon.protocol import HUB_RANK, Message

STEP_FIELDS = metrics.latest_of("step")
HEARTBEAT_FIELDS = metrics.latest_of("heartbeat")
EXTRA_NAMES_MAX = 64
"""A rank's `extra` keeps at most this many names (the first ones seen), so a script that
logs a new name every step cannot grow the state without bound."""
TERMINAL_STATES = ("exited", "finished")


def _no_values() -> dict[str, Any]:
    return dict.fromkeys(STEP_FIELDS + HEARTBEAT_FIELDS)


@dataclass
class RankView:
    """Everything known about one rank: identity, state, and in `metrics` the latest value of
    every `step` and `heartbeat` metric of the table (None until known), in `extra` the last
    value of each name the script passed to `log(**extra)`."""

    rank: int
    host: str | None = None
    pid: int | None = None
    local_rank: int | None = None
    restart_count: int | None = None
    device: str | None = None
    backend: str | None = None
    agent_version: str | None = None
    torch_version: str | None = None
    state: str = "running"
    state_reason: str | None = None
    exit_code: int | None = None
    error: str | None = None
    step: int | None = None
    steps_received: int = 0
    last_seen_t: float | None = None
    last_seq: int | None = None
    seq_seen: int = 0
    seq_gaps: int = 0
    metrics: dict[str, Any] = field(default_factory=_no_values)
    extra: dict[str, Any] = field(default_factory=dict)

    def value(self, name: str, now: float | None = None) -> Any:
        """The current value of metric `name` of the table (KeyError for other names): from
        the messages, from `extra` for well-known extra names, or computed (`now` for ages)."""
        metric = metrics.BY_NAME[name]
        if metric.source == "extra":
            return self.extra.get(name)
        if name == "heartbeat_age_s":
            if self.last_seen_t is None:
                return None
            return (time.time() if now is None else now) - self.last_seen_t
        return self.metrics[name]

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        """A JSON-ready dict: identity and state, then every metric under its own name."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("metrics", "extra")}
        out.update(self.metrics)
        out["extra"] = dict(self.extra)
        out["heartbeat_age_s"] = self.value("heartbeat_age_s", now)
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
        view.agent_version, view.torch_version = b.get("agent_version"), b.get("torch_version")
        view.state, view.state_reason, view.exit_code, view.error = "running", None, None, None
        self.world_size = max(self.world_size or 0, b["world_size"])
        if b.get("config") is not None:
            self.info.setdefault("config", {})[msg.rank] = b["config"]

    def _on_step(self, msg: Message, view: RankView) -> None:
        b = msg.body
        view.step = b["step"]
        view.steps_received += 1
        view.metrics.update({name: b.get(name) for name in STEP_FIELDS})  # absent -> None
        extra = b.get("extra")
        if extra:
            if len(view.extra) + len(extra) <= EXTRA_NAMES_MAX:
                view.extra.update(extra)
            else:  # only names already known, and new ones while there is room
                for name, value in extra.items():
                    if name in view.extra or len(view.extra) < EXTRA_NAMES_MAX:
                        view.extra[name] = value
        if view.state == "lost":
            view.state, view.state_reason = "running", None

    def _on_heartbeat(self, msg: Message, view: RankView) -> None:
        b = msg.body
        view.metrics.update({name: b.get(name) for name in HEARTBEAT_FIELDS})
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
            view.metrics["dropped"] = b["dropped"]

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
