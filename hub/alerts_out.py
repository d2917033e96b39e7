"""Alerts out: `$SCALEMON_ALERT_CMD` runs a command with each alert as JSON on its stdin.

Only the hub's own environment names the command (the owner's, read once at start): never a
request, never a rank's message. An alert fires when a condition appears in the job state:

* the training-health alerts of `scalemon.state.alerts` (`loss_not_finite`, `loss_scale_floor`,
  `skipped_steps`), per rank;
* `hang`: the job's hang (`reports.hangs.job_hang`) becomes non-null; the report is made
  again as newer heartbeats arrive (every `REMAKE_S` while it is provisional, its ranks not all
  heard since the hang began, or as soon as they are, every `REMAKE_FINAL_S` after; never
  more often than `REMAKE_COST_X` times its own cost), and an alert with `update` (its
  number) goes out when it stops being provisional and, after, when its culprits change (a
  guess that changes is not sent again): a hub that was behind when the hang began converges
  on the right rank;
* `straggler`: a rank is named a straggler (`scalemon.reports.stragglers`, the dashboard's
  rule) at every
  look for `STRAGGLER_STEPS` steps of its own;
* `memory`: a rank's device memory in use (NVML's, else the allocator's reserved, else allocated
  bytes) is over `MEMORY_FRACTION` of the device's total;
* `rank_frozen`, `rank_gone`, `rank_unreachable`, `rank_silent`: a running rank stopped
  sending and the hub says which (`protocol.SILENT_RANK_STATES`): its process exists but sends
  nothing (the text says where it is stuck, from its stacks read from outside); its process
  ended without reporting an exit; its node's relay is silent too; nothing on its node can look
  at its process. A rank that goes from one to another (frozen, then gone) alerts again.

Sending is rate-limited: one alert per (kind, rank) every `PER_KEY_S` (a hang's updates
excepted: they are paced as above; a provisional hang and the hang named are limited apart),
and `PER_MINUTE` alerts a minute over all (the job's hang excepted: ranks found silent in a
hung job must not hold it back); a suppressed alert is logged and audited, and the next
alert sent says how many were suppressed before it. The command runs in the background (a
thread waits for it), is killed with its process group after `TIMEOUT_S`, and never holds up
the hub loop; its output goes to `alerts.log` in the run directory. Every alert, sent or
suppressed, and every outcome of the command is appended to the hub's audit (`toggles.log`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shlex
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from scalemon import settings
from scalemon.protocol import SILENT_RANK_STATES
from scalemon.reports import stragglers as rule
from scalemon.reports.hangs import job_hang, unheard_since_hang
from scalemon.state import alerts as alerting
from scalemon.state.jobstate import JobState
from scalemon.text.display import LATE, shown, unit

from .forked import ForkedCall, timed
from .liveness import scan_every_s

log = logging.getLogger("scalemon.hub")

ALERT_CMD_ENV = "SCALEMON_ALERT_CMD"
STRAGGLER_STEPS = 20
MEMORY_FRACTION = 0.95
PER_KEY_S = 60.0
PER_MINUTE = 10
TIMEOUT_S = 10.0
SCAN_EVERY_S = 1.0
"""The whole state is looked at at most this often (the hub's housekeeping runs more often)."""
REMAKE_S = 5.0
"""A provisional hang report is made again at most this often (as newer heartbeats arrive)."""
REMAKE_FINAL_S = 30.0
"""...and a final one (every running rank heard since the hang began) this often."""
REMAKE_COST_X = 10.0
"""...and never more often than this many times what making it cost (0.6 s at 16,384 ranks:
every 6 s at most, a tenth of the hub's main thread while the hang lasts)."""
HANG_OFF_LOOP_FROM = 1024
"""From this many ranks the hang report is made in a forked child of the hub (hub/forked.py):
at 16,384 ranks it takes 0.6-4 s, which the hub's loop would otherwise stand still for."""
SUPPRESSIONS_AUDITED = 20
"""Suppressed alerts written to the audit one by one per minute; more are counted and written
as one entry (a job that loses thousands of ranks at once must not fill the disk)."""
OUTPUT_FILE = "alerts.log"

HANG, STRAGGLER, MEMORY = "hang", "straggler", "memory"
RANK_KINDS = {state: f"rank_{state}" for state in SILENT_RANK_STATES}
"""The alert kind of each word the hub says of a rank that stopped sending: `rank_frozen`,
`rank_gone`, `rank_unreachable`, `rank_silent`."""
KINDS = (*alerting.KINDS, HANG, STRAGGLER, MEMORY, *RANK_KINDS.values())

Key = tuple[str, int | None]


class CommandRunner:
    """Runs the alert command once per alert in a thread of its own; `outcomes()` gives what
    became of each run (for the hub thread to audit)."""

    def __init__(self, argv: list[str], output: Path, timeout_s: float = TIMEOUT_S) -> None:
        self.argv = argv
        self.output = output
        self.timeout_s = timeout_s
        self._outcomes: deque[dict[str, Any]] = deque()
        self.running = 0

    def start(self, alert: dict[str, Any]) -> None:
        """Run the command with `alert` on stdin, in the background."""
        data = (json.dumps(alert, allow_nan=False, default=str) + "\n").encode()
        self.running += 1
        threading.Thread(target=self._run, args=(data, alert), daemon=True,
                         name="scalemon-alert").start()

    def _run(self, data: bytes, alert: dict[str, Any]) -> None:
        outcome: dict[str, Any] = {"event": "alert command", "kind": alert["kind"],
                                   "rank": alert["rank"]}
        started = time.monotonic()
        try:
            with open(self.output, "ab") as out:
                proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=out,
                                        stderr=out, start_new_session=True, close_fds=True)
        except OSError as exc:
            outcome.update(outcome="could not start", error=f"{type(exc).__name__}: {exc}")
            self._done(outcome)
            return
        try:
            proc.communicate(data, timeout=self.timeout_s)
            outcome.update(outcome="exited", exit_code=proc.returncode)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # its own session: children too
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            outcome.update(outcome=f"killed after the {self.timeout_s:g} s timeout",
                           exit_code=proc.returncode)
        except OSError as exc:  # stdin closed early (BrokenPipe): it still ends
            proc.wait()
            outcome.update(outcome="exited without reading the alert", exit_code=proc.returncode,
                           error=str(exc))
        outcome["seconds"] = round(time.monotonic() - started, 3)
        self._done(outcome)

    def _done(self, outcome: dict[str, Any]) -> None:
        self._outcomes.append(outcome)  # deque: thread-safe append/popleft

    def outcomes(self) -> list[dict[str, Any]]:
        """What became of the runs that ended since the last call."""
        out = []
        while self._outcomes:
            out.append(self._outcomes.popleft())
            self.running -= 1
        return out


class AlertsOut:
    """Watches the job state for alerts (`check`, from the hub's housekeeping) and hands each
    one, rate-limited, to `send` (the command runner's `start`)."""

    def __init__(self, job: str, audit: Any, send: Callable[[dict[str, Any]], None],
                 state: JobState | None = None, outcomes: Callable[[], list] | None = None
                 ) -> None:
        self.job = job
        self.audit = audit
        self.send = send
        self._outcomes = outcomes or (lambda: [])
        self._active: dict[Key, Any] = {}  # condition -> its episode (what makes it new)
        self._straggling: dict[int, int | None] = {}  # rank -> its step when first named
        self._last_sent: dict[Key, float] = {}
        self._sent_times: deque[float] = deque()
        self._suppressed_since_sent = 0
        self._suppressions: deque[float] = deque()
        self._suppressions_unsaid = 0
        self._next_scan = 0.0
        self._hang_alert: dict[str, Any] | None = None
        self._hang_remake = (0.0, 0.0, -1)  # (when due, not before, state.messages then)
        self._hang_job: ForkedCall | None = None  # a report being made off the loop
        self._hang_job_messages = -1  # state.messages when it was started
        self.sent = 0
        self.suppressed = 0
        self._off_loop = False  # the first look, at start, is made here
        if state is not None:  # what the replayed history already holds fired long ago
            self._active = {key: alert["_episode"] for key, alert in
                            self._conditions(state, time.time(), time.monotonic()).items()}
        self._off_loop = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str], job: str, audit: Any, state: JobState,
                 run_dir: Path) -> AlertsOut | None:
        """The alerts of `$SCALEMON_ALERT_CMD` (None when unset; a value that does not split
        into a command is logged, audited and left off)."""
        text = (settings.raw(ALERT_CMD_ENV, environ) or "").strip()
        if not text:
            return None
        try:
            argv = shlex.split(text)
        except ValueError as exc:
            why = f"{ALERT_CMD_ENV} {text!r} is not a command line ({exc}): alerts are not sent"
            log.error("%s", why)
            audit.write({"event": "alert command refused", "why": why})
            return None
        runner = CommandRunner(argv, run_dir / OUTPUT_FILE)
        log.info("alerts go to %s (%s)", argv[0], ALERT_CMD_ENV)
        audit.write({"event": "alert command", "argv": argv, "outcome": "configured"})
        return cls(job, audit, runner.start, state, runner.outcomes)

    # --- the loop's side ------------------------------------------------------------------
    def check(self, state: JobState, now: float) -> list[dict[str, Any]]:
        """Look at the state (at most every `SCAN_EVERY_S` of the monotonic `now`, less often
        for a big job: `liveness.scan_every_s`, 4 s at 16,384 ranks); send the alerts that
        appeared since the last look. Returns them (sent or suppressed)."""
        for outcome in self._outcomes():
            self.audit.write(outcome)
            if outcome.get("outcome") != "exited" or outcome.get("exit_code"):
                log.warning("alert command: %s", outcome)
        if now < self._next_scan:
            return []
        self._next_scan = now + max(SCAN_EVERY_S, scan_every_s(len(state.ranks)))
        wall = time.time()
        current = self._conditions(state, wall, now)
        fired = [{k: v for k, v in alert.items() if k != "_episode"}
                 for key, alert in current.items()
                 if key not in self._active or self._active[key] != alert["_episode"]]
        self._active = {key: alert["_episode"] for key, alert in current.items()}
        fired.sort(key=lambda a: (KINDS.index(a["kind"]), a["rank"] if a["rank"] is not None
                                  else -1))
        for alert in fired:
            self._deliver(alert, now)
        self._say_suppressions(now)
        return fired

    def _deliver(self, alert: dict[str, Any], now: float) -> None:
        key = (alert["kind"], alert["rank"])
        if alert.get("provisional"):  # a guess (a hub behind) never holds back the hang named
            key = (f"{HANG} provisional", None)
        while self._sent_times and now - self._sent_times[0] >= 60.0:
            self._sent_times.popleft()
        why = None
        last = self._last_sent.get(key)
        if last is not None and now - last < PER_KEY_S and not alert.get("update"):
            why = (f"this kind of alert of this rank was sent {now - last:.0f} s ago (at most "
                   f"one per {PER_KEY_S:g} s)")
        elif len(self._sent_times) >= PER_MINUTE and alert["kind"] != HANG:  # one per job
            why = f"{PER_MINUTE} alerts were sent in the last minute (at most {PER_MINUTE})"
        entry = {"event": "alert", "kind": alert["kind"], "rank": alert["rank"],
                 "step": alert["step"], "text": alert["text"]}
        if why is not None:
            self.suppressed += 1
            self._suppressed_since_sent += 1
            self._suppress(entry, why, now)
            return
        alert["suppressed"] = self._suppressed_since_sent
        self._suppressed_since_sent = 0
        self._last_sent[key] = now
        self._sent_times.append(now)
        self.sent += 1
        log.warning("alert: %s", alert["text"])
        self.audit.write({**entry, "sent": True})
        self.send(alert)

    def _suppress(self, entry: dict[str, Any], why: str, now: float) -> None:
        while self._suppressions and now - self._suppressions[0] >= 60.0:
            self._suppressions.popleft()
        if len(self._suppressions) >= SUPPRESSIONS_AUDITED:
            self._suppressions_unsaid += 1
            return
        self._suppressions.append(now)
        log.warning("alert not sent: %s: %s", entry["text"], why)
        self.audit.write({**entry, "sent": False, "why": why})

    def _say_suppressions(self, now: float) -> None:
        if self._suppressions_unsaid and (not self._suppressions
                                          or now - self._suppressions[0] >= 60.0):
            log.warning("%d more alerts not sent (rate limit)", self._suppressions_unsaid)
            self.audit.write({"event": "alerts suppressed", "count": self._suppressions_unsaid,
                              "why": "rate limit; each one not written"})
            self._suppressions_unsaid = 0

    # --- what is wrong now --------------------------------------------------------------
    def _alert(self, kind: str, rank: int | None, step: int | None, text: str, value: Any,
               episode: Any, state: JobState, wall: float, **extra: Any) -> dict[str, Any]:
        view = state.ranks.get(rank) if rank is not None else None
        if isinstance(value, float) and not math.isfinite(value):
            value = None  # strict JSON: null; the text says what it was ("loss is NaN")
        return {"kind": kind, "job": self.job, "rank": rank, "step": step, "text": text,
                "value": value, "host": view.host if view else None, "t": wall,
                **extra, "_episode": episode}

    def _conditions(self, state: JobState, wall: float, now: float
                    ) -> dict[Key, dict[str, Any]]:
        """Every alert condition that holds now, by (kind, rank)."""
        out: dict[Key, dict[str, Any]] = {}
        running: list[int] = []
        for rank, view in state.ranks.items():
            for kind, a in view.alerts.items():
                out[(kind, rank)] = self._alert(
                    kind, rank, a.get("since_step"),
                    alerting.alert_text(kind, [rank], a.get("since_step"), a.get("value")),
                    a.get("value"), a.get("since_step"), state, wall)
            kind = RANK_KINDS.get(view.state)
            if kind is not None:
                why = (view.where if view.state == "frozen" else None) or view.state_reason
                out[(kind, rank)] = self._alert(
                    kind, rank, view.step, f"rank {rank} {view.state}: {why or 'no reason given'}",
                    None, view.ended_t, state, wall)
            if view.state != "running":
                continue
            running.append(rank)
            memory = _memory(view.metrics)
            if memory is not None and memory[0] > MEMORY_FRACTION:
                fraction, used, total = memory
                out[(MEMORY, rank)] = self._alert(
                    MEMORY, rank, view.step,
                    f"device memory {fraction:.0%} in use on rank {rank} ({used / 2**30:.2f} "
                    f"of {total / 2**30:.2f} GiB)", fraction, True, state, wall)
        out.update(self._stragglers(state, running, wall))
        out.update(self._hang(state, wall, now))
        return out

    def _hang(self, state: JobState, wall: float, now: float) -> dict[Key, dict[str, Any]]:
        """The hang, while `job_hang` finds one. Its report (costly on a big job) is made when
        it begins, then again when due (`REMAKE_S`, `REMAKE_FINAL_S`, `REMAKE_COST_X`) and
        messages came since, while no step completes and the job runs; a new episode (an
        `update` alert) when it stops being provisional or, once not, its culprits change.
        From `HANG_OFF_LOOP_FROM` ranks it is made in a forked child and taken at the look
        after it is done (the child's end brings that look forward)."""
        key: Key = (HANG, None)
        if state.last_step_t is None or wall - state.last_step_t < state.hang_after_s:
            self._drop_hang_job()
            return {}
        held = self._hang_alert
        ongoing = (key in self._active and held is not None
                   and state.state in ("running", "degraded"))
        kept = {key: held} if ongoing and held is not None else {}
        job = self._hang_job
        if job is not None:
            if not job.done.is_set():
                return kept  # made off the loop: taken at the next look once done
            self._hang_job = None
            messages = self._hang_job_messages
            if job.result is not None:
                hang, cost = job.result
            else:
                log.error("could not make the hang report off the loop: %s", job.error)
                hang, cost = timed(lambda: job_hang(state, wall))
        else:
            due, earliest, messages = self._hang_remake
            if ongoing and (now < earliest or messages == state.messages or (
                    now < due and not (held["provisional"] and not unheard_since_hang(state)))):
                return kept  # made again when due, or as soon as every rank was heard
            messages = state.messages
            if (self._off_loop and len(state.ranks) >= HANG_OFF_LOOP_FROM
                    and self._start_hang_job(state, wall)):
                return kept
            hang, cost = timed(lambda: job_hang(state, wall))
        self._hang_alert = None
        if hang is None:
            return {}
        again = REMAKE_S if hang.get("provisional") else REMAKE_FINAL_S
        self._hang_remake = (now + max(again, REMAKE_COST_X * cost), now + REMAKE_COST_X * cost,
                             messages)
        culprits = [int(r) for r in hang.get("culprits") or []]
        provisional = bool(hang.get("provisional"))
        episode = (None if provisional else culprits, provisional)  # a guess is not news
        if ongoing and held is not None and held["_episode"][:2] == episode:
            self._hang_alert = held  # the same finding: no new alert
            return {key: held}
        update = held["_episode"][2] + 1 if ongoing and held is not None else 0
        alert = self._alert(
            HANG, None,
            max((v.step for v in state.ranks.values() if v.step is not None), default=None),
            f"job hung{f' (update {update})' if update else ''}: {hang['text']}",
            hang["since_s"], (*episode, update), state, wall,
            ranks=culprits, provisional=provisional,
            not_heard=hang.get("not_heard", 0),
            update=update)  # the job's alert: its culprits in `ranks`
        self._hang_alert = alert
        return {key: alert}

    def _start_hang_job(self, state: JobState, wall: float) -> bool:
        """Start making the hang report in a forked child; False where it cannot be (no
        fork), to be made here. The next look comes as soon as it is done."""
        if not hasattr(os, "fork"):
            return False
        try:
            self._hang_job = ForkedCall(lambda: timed(lambda: job_hang(state, wall)),
                                        self._hang_made, "hang-report")
        except OSError as exc:  # out of memory, process limit
            log.warning("could not fork to make the hang report (%s): making it here", exc)
            return False
        self._hang_job_messages = state.messages
        return True

    def _hang_made(self, _job: ForkedCall) -> None:
        """From the child's reading thread: look again at the next housekeeping."""
        self._next_scan = 0.0

    def _drop_hang_job(self) -> None:
        """A report being made for a hang that is over: ended, its outcome unused."""
        if self._hang_job is not None:
            self._hang_job.kill()
            self._hang_job = None

    def close(self) -> None:
        """End a hang report being made (the hub stops)."""
        self._drop_hang_job()

    def _stragglers(self, state: JobState, running: list[int], wall: float
                    ) -> dict[Key, dict[str, Any]]:
        views = state.ranks
        number = (int, float)
        lateness = {r: v if isinstance(v := views[r].value("arrival_lateness_s"), number)
                    else None for r in running}
        compute = {r: views[r].compute_over_median_s for r in running}
        values, basis = rule.measure(running, lateness, compute)
        median = rule.median_step_s(views[r].metrics.get("step_time_s") for r in running)
        named = dict(rule.stragglers(values, median))
        self._straggling = {r: self._straggling.get(r, views[r].step) for r in named}
        out = {}
        for rank, since in self._straggling.items():
            step = views[rank].step
            if since is None or step is None or step - since < STRAGGLER_STEPS:
                continue
            measure = rule.MEASURE_FIELDS.get(basis, basis)
            out[(STRAGGLER, rank)] = self._alert(
                STRAGGLER, rank, step,
                f"rank {rank} has been a straggler for {step - since} steps (since step "
                f"{since}): {measure} {shown(LATE, named[rank]):.1f} {unit(LATE)} over the bar "
                f"of {shown(LATE, rule.straggler_bar(median)):.1f} {unit(LATE)}", named[rank],
                since, state, wall,
                measure=measure, since_step=since)
        return out


def _memory(values: Mapping[str, Any]) -> tuple[float, int, int] | None:
    """(fraction, used, total) of a rank's device memory, where its total is known."""
    total = values.get("gpu_mem_total_bytes")
    if not isinstance(total, int) or total <= 0:
        return None
    for name in ("gpu_mem_used_bytes", "mem_reserved_bytes", "mem_allocated_bytes"):
        used = values.get(name)
        if isinstance(used, int) and not isinstance(used, bool) and used >= 0:
            return used / total, used, total
    return None
