"""Fold a stream of protocol messages into the current state of a job.

The hub and every dashboard run the same reducer over the same history, so they agree on what
each rank is doing. Times are seconds, sizes bytes; a value that cannot exist (no GPU) is None.

One model, three ways to carry it: the records are its input (the history); a `JobState`
(inside the hub's `fold.JobFold`) is the model itself, handed whole to a dashboard that
attaches as the pickled seed (`scalemon.link.seed`). What people read of it is made from it,
never by it (`scalemon.reports`): its JSON (`reports.snapshot`, what `scalemon snapshot
--json` prints), the collectives table (`reports.groups`), the hang (`reports.hangs`); the
thresholds are `scalemon.policy`'s.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from scalemon import metrics
from scalemon.collectives import CollectiveStats, P2PStats
from scalemon.policy import HANG_AFTER_S
from scalemon.protocol import HUB_RANK, SILENT_RANK_STATES, Message
from scalemon.state import alerts as alerting
from scalemon.state import ending, failures, hangend
from scalemon.state.arrival import ArrivalTracker
from scalemon.state.ending import ENDED_RANK_STATES, TERMINAL_STATES, VANISHED_STATES
from scalemon.state.failures import first_line, is_peer_loss, signal_text, without_guess
from scalemon.state.flagstate import FlagState
from scalemon.state.mesh import job_mesh, pipeline_info, rank_coords
from scalemon.state.stepcomm import check_step_comm, set_step_comm
from scalemon.throughput import TokenWindow

STEP_FIELDS = metrics.latest_of("step")

HEARTBEAT_FIELDS = metrics.latest_of("heartbeat")
SENT_WHEN_CHANGED = metrics.SENT_WHEN_CHANGED
EXTRA_NAMES_MAX = 64
"""A rank's `extra` keeps at most this many names (the first ones seen), so a script that
logs a new name every step cannot grow the state without bound."""
JOB_ENDED_STATES = ("finished", "stopped", "crashed", "lost")
"""Job states of a job whose every rank ended: every rank finished; the user stopped it, or its
ranks ended by a stop signal (`ending.STOP_SIGNALS`); a rank failed first with an error of its
own; the job lost a rank first: it vanished without an exit (gone, unreachable or silent)."""


def _no_values() -> dict[str, Any]:
    return dict.fromkeys(STEP_FIELDS + HEARTBEAT_FIELDS)


_INTERNAL = {"json": False}
"""A `RankView` field the reducer keeps for itself: not in `to_json`."""
_OWN_JSON = {"json": False}
"""A `RankView` field `to_json` writes its own way (metrics flat, extra, alerts)."""


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
    ended_t: float | None = None
    """When the rank exited or was found gone (its own clock for an exit, the hub's else)."""
    process: dict[str, Any] | None = None
    """What the hub or the node's relay last read of the silent rank's process (1.12:
    `scalemon.proc.facts.ProcessFacts.to_wire`); None while the rank speaks."""
    where: str | None = None
    """Where a frozen rank is stuck, from its stacks read from outside ("frozen in native code
    holding the GIL: sleep <- freeze_holding_the_gil() at faults.py:11")."""
    outside_stacks: dict[str, Any] | None = field(default=None, repr=False)
    """The latest stacks read from outside the process (`rank_stacks`: reading, process,
    reader), kept after the rank speaks again until its next hello."""
    peer_loss: bool = False
    """Exited with an error that reads like a peer's death (`failures.is_peer_loss`)."""
    end_signal: str | None = field(default=None, metadata=_INTERNAL)
    """"SIGTERM": the stop signal its `exit` says it ended by (`ending.stop_signal`): the rank
    was stopped, it did not fail."""
    monitor_off: str | None = None
    """Why this rank's agent switched itself off (`monitor_off` message); None while it runs."""
    step: int | None = None
    steps_received: int = 0
    last_seen_t: float | None = None
    last_seq: int | None = None
    seq_seen: int = 0
    seq_gaps: int = 0
    metrics: dict[str, Any] = field(default_factory=_no_values, metadata=_OWN_JSON)
    extra: dict[str, Any] = field(default_factory=dict, metadata=_OWN_JSON)
    alerts: dict[str, dict[str, Any]] = field(default_factory=dict, metadata=_OWN_JSON)
    """Training-health alerts in force (`scalemon.state.alerts`), by kind."""
    skip_streak: list[int] | None = field(default=None, repr=False, metadata=_INTERNAL)
    """[first step, count] of the steps skipped in a row so far (None: the last was not)."""
    last_step_t: float | None = None
    compute_over_median_s: float | None = None
    """How much longer than the median rank's this rank's compute time is (seconds, smoothed
    over steps; a `JobFold` keeps it): the straggler measure before any collective is seen."""
    lateness: deque[float] | None = field(default=None, repr=False, metadata=_INTERNAL)
    collectives: CollectiveStats = field(default_factory=CollectiveStats, repr=False,
                                         metadata=_INTERNAL)
    p2p: P2PStats = field(default_factory=P2PStats, repr=False, metadata=_INTERNAL)
    """Its sends and receives per (group, op, src, dst) (`collectives` messages' `p2p`)."""
    comm_hook: bool = field(default=False, repr=False, metadata=_INTERNAL)
    """This process's `step` messages carry the gloo comm hook's all-reduce figures: they win
    over the recorder's (`collectives.steps`)."""
    step_comm: list[Any] | None = field(default=None, repr=False, metadata=_INTERNAL)
    """The latest step's all-reduce figures from the recorder (a `STEP_COMM_FIELDS` row)."""
    derived: dict[str, float] = field(default_factory=dict, repr=False, metadata=_INTERNAL)
    """The table's derived metrics of the latest step (`metrics.derived_values`: tokens/s
    where the script measures none, compute time), computed once as the step is folded."""
    token_window: TokenWindow = field(default_factory=TokenWindow, repr=False,
                                      metadata=_INTERNAL)
    """Its latest steps' tokens and wall times: its `tokens_per_s` (`scalemon.throughput`)."""

    def value(self, name: str, now: float | None = None) -> Any:
        """The current value of metric `name` of the table (KeyError for other names): from
        the messages, from `extra` for well-known extra names, or computed (`now` for ages)."""
        metric = metrics.BY_NAME[name]
        if metric.source == "extra":
            if name not in self.extra and name in self.derived:  # the script measures none
                return self.derived[name]
            return self.extra.get(name)
        if name == "heartbeat_age_s":  # a rank that ended sends none: no age to count
            if self.last_seen_t is None or self.state in TERMINAL_STATES:
                return None
            return (time.time() if now is None else now) - self.last_seen_t
        if name == "arrival_lateness_s":
            return statistics.median(self.lateness) if self.lateness else None
        return self.metrics[name]


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
    last_step_t: float | None = None
    hang_after_s: float = HANG_AFTER_S
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Process groups by name (the same on every rank): {"desc": str, "ranks": [int]}."""
    arrival: ArrivalTracker = field(default_factory=ArrivalTracker, repr=False)
    bad_collectives: int = 0
    bad_p2p: int = 0
    """Malformed `p2p` rows of `collectives` messages, skipped (the good ones are kept)."""
    hosts: set[str] = field(default_factory=set, repr=False)
    host_offsets: dict[str, dict[int, float]] = field(default_factory=dict, repr=False)
    """Each host's ranks' latest `clock_offset_s` (one clock per host)."""
    fr_dumps: list[dict[str, Any]] = field(default_factory=list)
    """Flight Recorder dumps the hub asked for, newest last, with torch's analysis."""
    hub_notes: list[dict[str, Any]] = field(default_factory=list)
    """What the hub said about itself (history repaired, records skipped), newest last."""
    flags: FlagState = field(default_factory=FlagState, repr=False)
    """Flags in effect per rank, the toggles asked for, NCCL's and torch's log lines."""
    relays: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each node's relay as the hub last recorded it (state, counts, clock offset, gaps)."""
    stop: dict[str, Any] | None = None
    """The user's request to stop the job (`job_stop` record: t, reason, user, host), while
    it holds: ranks that end after it are `stopped`, not failed."""
    attempts: list[dict[str, Any]] = field(default_factory=list)
    """The launcher's attempts at the job (torchrun `--max-restarts`), oldest first: attempt
    (the restart count), start, and for those that ended: end, how (crashed, lost, restart,
    finished, stopped, ended), first_failure (its text), last_step. The current one is
    completed by `attempts_json`."""
    max_restarts: int | None = None
    """The launcher's restart budget, as the ranks' hellos said (None: not known)."""
    hang_end: dict[str, Any] | None = field(default=None, repr=False)
    """The hang the job was in when its first rank ended abnormally or its user stopped it
    (`hangend`): kept until a new attempt or run of the job, or news that it was no hang."""

    def __post_init__(self) -> None:
        # message type -> handler, looked up once (subclasses may override `_on_<type>`)
        self._handlers = {name[4:]: getattr(self, name) for name in dir(self)
                          if name.startswith("_on_")}

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the handler table (bound methods), made again on load."""
        return {k: v for k, v in self.__dict__.items() if k != "_handlers"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

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
        if (self.stop or self.hang_end) is not None and self.state in JOB_ENDED_STATES:
            self.stop = self.hang_end = None  # a new run of the job, after the ended one
        self._note_attempt(b.get("restart_count") or 0, msg.t, b.get("max_restarts"))
        view.alerts, view.skip_streak = {}, None
        view.process = view.where = view.outside_stacks = None
        view.host, view.pid, view.local_rank = b["host"], b["pid"], b["local_rank"]
        self.hosts.add(b["host"])
        view.restart_count = b.get("restart_count")
        view.device, view.backend = b.get("device"), b.get("backend")
        view.agent_version, view.torch_version = b.get("agent_version"), b.get("torch_version")
        view.state, view.state_reason, view.exit_code, view.error = "running", None, None, None
        view.ended_t, view.peer_loss, view.monitor_off, view.end_signal = None, False, None, None
        view.comm_hook, view.step_comm = False, None
        view.token_window.clear()  # a new process: no step ended before its first
        self.world_size = max(self.world_size or 0, b["world_size"])
        self.arrival.world = max(self.arrival.world, self.world_size)  # its budgets' share
        if b.get("config") is not None:
            self.info.setdefault("config", {})[msg.rank] = b["config"]

    def _on_step(self, msg: Message, view: RankView) -> None:
        b = msg.body
        view.step = b["step"]
        view.steps_received += 1
        view.last_step_t = msg.t
        if self.last_step_t is None or msg.t > self.last_step_t:
            self.last_step_t = msg.t
        # absent fields -> None
        view.metrics.update(zip(STEP_FIELDS, map(b.get, STEP_FIELDS), strict=True))
        if b.get("allreduce_count") or b.get("allreduce_time_s") is not None:
            view.comm_hook = True
        elif view.step_comm is not None and not view.comm_hook:
            set_step_comm(view.metrics, view.step_comm)  # the recorder's, of an earlier step
        view.skip_streak = alerting.fold_step(view.alerts, view.skip_streak, b["step"], b, msg.t)
        extra = b.get("extra")
        if extra:
            if len(view.extra) + len(extra) <= EXTRA_NAMES_MAX:
                view.extra.update(extra)
            else:  # only names already known, and new ones while there is room
                for name, value in extra.items():
                    if name in view.extra or len(view.extra) < EXTRA_NAMES_MAX:
                        view.extra[name] = value
        view.token_window.add(b.get("tokens"), b.get("step_time_s"))
        own_rate = "tokens_per_s" in view.extra  # the script's: never mixed with the steps'
        view.derived = metrics.derived_values(b, None if own_rate else view.token_window.rate())
        if self.hang_end is not None:
            hangend.forget(self, msg.rank, msg.t)  # a step ended: the job ran then
        if view.state in SILENT_RANK_STATES:
            _speaks_again(self, view)

    def _on_heartbeat(self, msg: Message, view: RankView) -> None:
        b = msg.body
        same = b.get("same")  # 1.14: nested values as the rank's previous heartbeat's
        kept = {n: view.metrics[n] for n in SENT_WHEN_CHANGED if n in same} if same else None
        view.metrics.update(zip(HEARTBEAT_FIELDS, map(b.get, HEARTBEAT_FIELDS), strict=True))
        if kept:
            view.metrics.update(kept)
        offset = b.get("clock_offset_s")
        if view.host is not None and isinstance(offset, (int, float)):
            self.host_offsets.setdefault(view.host, {})[msg.rank] = offset
        if view.state in SILENT_RANK_STATES:
            _speaks_again(self, view)

    def _on_collectives(self, msg: Message, view: RankView) -> None:
        b = msg.body
        try:
            for name, group in b["groups"].items():
                # a big group's members are listed by its first rank only (1.13): the others'
                # empty lists say nothing
                if name not in self.groups and group["ranks"]:
                    ranks = [int(r) for r in group["ranks"]]
                    self.groups[name] = {"desc": str(group.get("desc") or ""), "ranks": ranks}
                    self.arrival.set_group(name, ranks)
            view.collectives.merge_wire(b["stats"])
            offset = self.clock_offset(view)
            arrival = self.arrival
            for group, seq, t in b["issues"]:
                arrival.issued(group, seq, msg.rank, t + offset)
            if b.get("steps"):
                self._step_comm(view, b["steps"])
        except (KeyError, TypeError, ValueError):
            self.bad_collectives += 1  # counted, shown; the rest of the history goes on
        if b.get("p2p") is not None:
            self.bad_p2p += view.p2p.merge_wire(b["p2p"])
        if view.lateness is None:
            view.lateness = self.arrival.series(msg.rank)

    @staticmethod
    def _step_comm(view: RankView, rows: list[Any]) -> None:
        """The recorder's per-step all-reduce figures: the latest step's become the rank's
        `allreduce_*` values (until a newer one), as a step message of its own would; not
        where the rank's step messages carry the comm hook's. ValueError for a bad row."""
        for row in rows:
            check_step_comm(row)
        if view.comm_hook:
            return
        for row in rows:
            step = row[0]
            if view.step_comm is None or step >= view.step_comm[0]:
                view.step_comm = row
        if view.step_comm is not None:
            set_step_comm(view.metrics, view.step_comm)

    def _on_info(self, msg: Message, view: RankView) -> None:
        self.info.setdefault(msg.body["key"], {})[msg.rank] = msg.body["value"]

    def mesh(self, rank: int) -> dict[str, int] | None:
        """`rank`'s coordinates in the job's device mesh ({"pp": 0, "dp": 1, "tp": 0}): as
        its agent said (info "mesh"), else from the groups named "mesh_<dim>"; None without."""
        return rank_coords(self.info.get("mesh", {}), self.groups, rank)

    def job_mesh(self) -> dict[str, Any] | None:
        """The job's mesh: {"dims": [...], "shape": {dim: size}}, or None (`state.mesh`)."""
        return job_mesh(self.info.get("mesh", {}), self.groups)

    def pipeline(self) -> dict[str, Any] | None:
        """The pipeline the script described (`Monitor.describe_pipeline`): {"schedule",
        "stages", "microbatches", "virtual_stages"}, or None."""
        return pipeline_info(self.info.get("pipeline", {}))

    def _on_exit(self, msg: Message, view: RankView) -> None:
        b = msg.body
        state = {"finished": "finished", "restart": "restarting"}.get(b["reason"], "exited")
        if state == "exited" and hangend.abnormal_exit(b):
            hangend.note(self, msg.t)  # before this rank's end changes the job
        view.state, view.state_reason = state, signal_text(b) or b["reason"]
        if view.state == "exited" and self.stop is not None:
            view.state, view.state_reason = "stopped", self.stop_text(view.state_reason)
        view.exit_code = b.get("exit_code")
        view.error = b.get("error")
        view.ended_t = msg.t
        view.peer_loss = view.state == "exited" and is_peer_loss(view.error)
        view.end_signal = ending.stop_signal(b) if view.state in ("exited", "stopped") else None
        if b.get("dropped") is not None:
            view.metrics["dropped"] = b["dropped"]

    def _on_monitor_off(self, msg: Message, view: RankView) -> None:
        view.monitor_off = msg.body["reason"]

    def _on_flags(self, msg: Message, view: RankView) -> None:
        self.flags.on_flags(msg)

    def _on_toggle_result(self, msg: Message, view: RankView) -> None:
        self.flags.on_toggle_result(msg)

    def _on_log_lines(self, msg: Message, view: RankView) -> None:
        self.flags.on_log_lines(msg)

    def _on_toggle(self, msg: Message) -> None:
        self.flags.on_toggle(msg)

    def _on_relay(self, msg: Message) -> None:
        b = msg.body
        seen = self.relays.get(b["node"], {})
        gaps = seen.get("gaps", 0) + (1 if b["state"] == "up" and seen else 0)
        gap_total = seen.get("gap_total_s", 0.0) + (b.get("gap_s") or 0.0)
        self.relays[b["node"]] = {**seen, **{k: v for k, v in b.items() if v is not None},
                                  "t": msg.t, "gaps": gaps, "gap_total_s": gap_total}

    def _on_hub_note(self, msg: Message) -> None:
        self.hub_notes = [*self.hub_notes[-19:], {"t": msg.t, **msg.body}]

    def _on_fr_dump(self, msg: Message) -> None:
        b = dict(msg.body)
        for i, old in enumerate(self.fr_dumps):
            if old["directory"] == b["directory"]:
                self.fr_dumps[i] = b
                return
        self.fr_dumps = [*self.fr_dumps[-4:], b]

    def _on_rank_state(self, msg: Message) -> None:
        b = msg.body
        view = self.rank(b["target"])
        state = "silent" if b["state"] == "lost" else b["state"]  # a hub before 1.12 said lost
        if state == "running" and view.state in ENDED_RANK_STATES:
            return None  # never brings back a rank that ended
        if state in VANISHED_STATES or (state == "exited" and b.get("exit_code") != 0):
            hangend.note(self, msg.t, view.last_seen_t, view.rank)  # it died after last heard
        view.state, view.state_reason = state, b.get("reason")
        if b.get("process") is not None:
            view.process = b["process"]
        if state == "frozen":
            view.where = b.get("where") or view.where
        if state in (*VANISHED_STATES, "exited") and self.stop is not None:
            how = without_guess(b.get("reason"))  # the user stopped it: no "killed?"
            view.state, view.state_reason = "stopped", self.stop_text(how)
        if b.get("exit_code") is not None:
            view.exit_code = b["exit_code"]
        if view.state in ENDED_RANK_STATES and view.ended_t is None:
            view.ended_t = msg.t
        return None

    def _on_rank_stacks(self, msg: Message) -> None:
        b = msg.body
        view = self.rank(b["target"])
        view.outside_stacks = {"reading": b["reading"], "process": b.get("process"),
                               "reader": b.get("reader"), "t": msg.t}
        if b.get("process") is not None and view.state in SILENT_RANK_STATES:
            view.process = b["process"]

    def _note_attempt(self, count: int, t: float, max_restarts: int | None) -> None:
        """A hello of the launcher's attempt `count`: a later attempt than the current one
        closes the current one with how it ended (before this hello resets its rank)."""
        if max_restarts is not None:
            self.max_restarts = max_restarts
        current = self.attempts[-1] if self.attempts else None
        if current is not None and count <= current["attempt"]:
            return
        if current is not None:
            current.update(self._attempt_end(t))
            self.hang_end = None  # the last attempt's hang: this one has none yet
        self.attempts.append({"attempt": count, "start": t, "end": None, "how": None,
                              "first_failure": None, "last_step": None})

    def _attempt_end(self, t: float) -> dict[str, Any]:
        """How the current attempt ended, read off the ranks before the next attempt's hellos
        reset them: its first failure, or a restart for a flag change, or its job state."""
        views = list(self.ranks.values())
        failure = self.first_failure()
        if failure is not None:
            how = "lost" if failure["state"] in VANISHED_STATES else "crashed"
        elif any(v.state == "restarting" for v in views):
            how = "restart"
        elif views and all(v.state in ENDED_RANK_STATES for v in views):
            how = self.state
        else:
            how = "ended"  # ranks that never said how they ended
        ends = [v.ended_t for v in views if v.ended_t is not None]
        steps = [v.step for v in views if v.step is not None]
        return {"end": max(ends) if ends else t, "how": how,
                "first_failure": failure["text"] if failure else None,
                "last_step": max(steps) if steps else None}

    def attempts_json(self) -> list[dict[str, Any]]:
        """Every attempt, the current one completed from the job as it stands (`end` and
        `how` once it ended; `how` is the job's state while it runs)."""
        if not self.attempts:
            return []
        current = dict(self.attempts[-1])
        state = self.state
        views = list(self.ranks.values())
        steps = [v.step for v in views if v.step is not None]
        current["last_step"] = max(steps) if steps else None
        current["how"] = state
        if state in JOB_ENDED_STATES:
            ends = [v.ended_t for v in views if v.ended_t is not None]
            current["end"] = max(ends) if ends else None
            failure = self.first_failure()
            current["first_failure"] = failure["text"] if failure else None
        return [*(dict(a) for a in self.attempts[:-1]), current]

    def _on_job_stop(self, msg: Message) -> None:
        hangend.note(self, msg.t)
        self.stop = {"t": msg.t, "reason": msg.body.get("reason"),
                     "user": msg.body.get("user"), "host": msg.body.get("host")}

    def stop_text(self, how: str | None = None) -> str:
        """"stopped by the user (scalemon demo: q, ann@node1); process 4242 gone": why a rank
        that ended after the user's stop request is `stopped`, with what the rank or the hub
        saw (`how`); without a stop request, how the job's ranks ended ("ended by SIGTERM
        (ranks 0,1, exit 143)": a job `stopped` by a signal)."""
        if self.stop is None:
            return how or ending.ranks_end_text(self.ranks)
        return ending.stop_text(self.stop, how)

    def alerts(self) -> list[dict[str, Any]]:
        """The job's training-health alerts, one per kind over the ranks (`state.alerts`)."""
        return alerting.job_alerts((r, v.alerts) for r, v in sorted(self.ranks.items())
                                 if v.alerts)

    def failed(self) -> list[RankView]:
        """Ranks that failed (lost, or exited with a non-zero code or an error), in the order
        that explains the job: ranks that failed for a reason of their own before those that
        only lost a peer, each kind earliest first. A script that just ends without calling
        `finish()` exits with no code and no error (its agent's atexit), and a rank ended by
        a stop signal (`end_signal`) was stopped: not failures; nor are ranks that only lost a
        peer where some rank was stopped so (the peer that went away)."""
        views = [v for v in self.ranks.values()
                 if v.state in VANISHED_STATES or (v.state == "exited" and not v.end_signal and (
                     v.exit_code not in (0, None) or v.error or v.peer_loss))]
        if all(v.peer_loss for v in views) and any(v.end_signal for v in self.ranks.values()):
            return []
        return sorted(views, key=lambda v: (v.peer_loss, v.ended_t or float("inf"), v.rank))

    def first_failure(self) -> dict[str, Any] | None:
        """The rank that failed first for a reason of its own (or, when every failed rank only
        lost a peer, the earliest), with its error's first line and the ranks that failed only
        because a peer went away; None while no rank failed."""
        failed = self.failed()
        if not failed:
            return None
        first = failed[0]
        why = first_line(first.error) or first.state_reason or first.state
        peer_loss = sorted(v.rank for v in failed[1:] if v.peer_loss)
        return {
            "rank": first.rank, "state": first.state, "exit_code": first.exit_code,
            "step": first.step, "t": first.ended_t, "error": why, "peer_loss": peer_loss,
            "text": failures.failure_text(first.rank, first.step, why, peer_loss),
        }

    @property
    def state(self) -> str:
        """waiting (no rank yet), running, degraded (a rank failed, others run), restarting,
        stopping (the user asked to stop it), or once every rank ended: finished, stopped (by
        its user), crashed (the first failure is a rank's error) or lost (the first failure
        is a rank that vanished without an exit); `restarting` too once every rank ended with
        a failure while the launcher has restarts left (`max_restarts`). A hang is told by
        `reports.hangs.job_hang`, not here."""
        views = list(self.ranks.values())
        expected = self.world_size or len(views)
        if not views:
            return "waiting"
        states = [v.state for v in views]
        if len(views) >= expected and all(s in ENDED_RANK_STATES for s in states):
            failed = self.failed()
            if failed and self._restarts_left():
                return "restarting"
            if failed:
                return "lost" if failed[0].state in VANISHED_STATES else "crashed"
            stopped = "stopped" in states or any(v.end_signal for v in views)
            return "stopped" if stopped else "finished"
        if "restarting" in states:
            return "restarting"
        if self.stop is not None:
            return "stopping"
        if any(s in (*VANISHED_STATES, "exited") for s in states):
            return "degraded"
        return "running"

    def _restarts_left(self) -> bool:
        """True when the launcher said it restarts failed workers and the current attempt is
        not its last."""
        if not self.max_restarts or not self.attempts:
            return False
        return self.attempts[-1]["attempt"] < self.max_restarts

    def clock_offset(self, view: RankView) -> float:
        """Seconds to add to a time of `view`'s host clock to get the hub's: 0 while every rank
        seen runs on one host (one clock), else the median of that host's ranks' estimates."""
        if len(self.hosts) <= 1:
            return 0.0
        offsets = self.host_offsets.get(view.host or "")
        return statistics.median(offsets.values()) if offsets else 0.0

    def hang_possible(self) -> bool:
        """True while the job could be hung: a step was completed and the job runs (not
        waiting, restarting, stopping or ended); whether it is: `reports.hangs.job_hang`."""
        return self.last_step_t is not None and self.state not in (
            *JOB_ENDED_STATES, "waiting", "restarting", "stopping")


def _speaks_again(st: JobState, view: RankView) -> None:
    """A rank the hub took for frozen, gone or unreachable sent a message: it runs (and a hang
    kept as it vanished was none: `hangend.forget`)."""
    hangend.forget(st, view.rank)
    view.state, view.state_reason, view.where = "running", None, None
    view.process = None
    if view.ended_t is not None and view.exit_code is None:
        view.ended_t = None

