"""Flag toggles on the hub: check a request, plan the step, relay it, follow it to its end.

A toggle is refused before any rank sees it when the flag or value is not in the table
(`scalemon.flags`), when no rank runs, while another toggle is under way, or (restart tier) when
a rank cannot checkpoint and be restarted by torchrun. Otherwise every running rank gets a
`set_flag` command naming the step boundary to apply it at: a few seconds ahead of the fastest
rank, so the command (relayed on the agents' once-a-second sync) reaches every rank in time.
Each state of a toggle is written into the history as a `toggle` record and appended to
the audit (`hub.audit`: who, from where, what, when, outcome).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scalemon import flags
from scalemon.flags import RESTART, FlagError
from scalemon.protocol import ProtocolError
from scalemon.state.jobstate import JobState

from .audit import Audit

log = logging.getLogger("scalemon.hub")

LEAD_S = 4.0
"""How far ahead of the fastest rank a toggle is planned, in seconds of its steps."""
MIN_LEAD_STEPS = 3
ANSWER_WAIT_S = 60.0
"""A rank that has not answered this long after the planned step's time is named as missing."""
RESTART_WAIT_S = 300.0
"""Restarted workers must say hello again within this (torchrun restart plus start-up)."""
ACTIVE = ("requested", "restarting")


class ToggleRefused(ProtocolError):
    """A toggle the hub will not make; the text says why (not a malformed request)."""


@dataclass
class Pending:
    """A toggle under way."""

    id: int
    name: str
    value: str
    tier: str
    at_step: int
    ranks: list[int]
    since: float = field(default_factory=time.monotonic)
    restart_counts: dict[int, int] = field(default_factory=dict)
    restart_step: int | None = None
    restarting_since: float | None = None


class Toggles:
    """The hub's toggles; records go out through `records` (drained by the hub)."""

    def __init__(self, run_dir: Path, state: JobState, audit: Audit | None = None) -> None:
        self.audit = audit or Audit(run_dir)
        self.state = state
        self.records: list[dict[str, Any]] = []  # `toggle` bodies to write into the history
        self.commands: dict[int, list[dict[str, Any]]] = {}  # per rank, taken by `sync`
        self.pending: Pending | None = None
        self._next_id = 1 + max(state.flags.toggles, default=0)

    # --- a request -------------------------------------------------------------------------
    def request(self, name: str, value: str, restart: bool,
                who: dict[str, str]) -> dict[str, Any]:
        """Check and plan a toggle asked by `who` (`user`, `client_host`, `role`, `via`: as the
        hub knows the asker); returns the reply, raises ToggleRefused (in the audit too)."""
        toggle_id = self._new_id()
        base = {"id": toggle_id, "name": name[:100], "value": value[:200], **who}
        try:
            tier, running = self._plan(name, value, restart)
        except FlagError as exc:
            self._emit({**base, "state": "refused", "text": str(exc)})
            raise ToggleRefused(f"refused: {exc}") from None
        at_step = self._at_step(running, tier)
        self.pending = Pending(toggle_id, name, value, tier, at_step, running)
        for rank in running:
            view = self.state.ranks[rank]
            self.pending.restart_counts[rank] = view.restart_count or 0
            self.commands.setdefault(rank, []).append({
                "name": "set_flag", "id": toggle_id, "flag": name, "value": value,
                "tier": tier, "at_step": at_step})
        text = (f"{name}={value or '(unset)'} ({tier}) planned for step {at_step} on "
                f"{len(running)} rank(s)")
        self._emit({**base, "state": "requested", "tier": tier, "at_step": at_step,
                    "ranks": {"planned": running}, "text": text})
        return {"id": toggle_id, "tier": tier, "at_step": at_step, "ranks": running,
                "text": text}

    def _plan(self, name: str, value: str, restart: bool) -> tuple[str, list[int]]:
        flag = flags.check(name, value)  # raises FlagError
        if self.pending is not None:
            p = self.pending
            raise FlagError(f"toggle #{p.id} ({p.name}={p.value}) is still under way; wait for "
                            "it to finish (`scalemon snapshot` shows it under toggles)")
        running = sorted(r for r, v in self.state.ranks.items() if v.state == "running")
        if not running:
            raise FlagError("no rank of the job is running: there is nothing to change")
        tier = RESTART if restart else self.state.flags.effective_tier(flag.name, running)
        if tier == RESTART:
            blockers = self.state.flags.restart_blockers(running)
            if blockers:
                raise FlagError(f"{name} needs a restart of the job, which cannot be done "
                                f"safely: {'; '.join(blockers[:4])}")
        return tier, running

    def _at_step(self, ranks: list[int], tier: str) -> int:
        """A step boundary a few seconds ahead of the fastest rank."""
        views = [self.state.ranks[r] for r in ranks]
        fastest = max((v.step or 0) for v in views)
        times = [v.metrics.get("step_time_s") for v in views]
        times = [t for t in times if isinstance(t, (int, float)) and t > 0]
        step_s = max(times) if times else 1.0
        lead = max(MIN_LEAD_STEPS, math.ceil(LEAD_S / step_s))
        return fastest + lead

    def take_commands(self, rank: int) -> list[dict[str, Any]]:
        """The commands queued for `rank` (handed over on its sync)."""
        return self.commands.pop(rank, [])

    # --- following a toggle ----------------------------------------------------------------
    def advance(self, now: float) -> None:
        """Move the pending toggle on once its ranks answered (or failed to)."""
        p = self.pending
        if p is None:
            return
        record = self.state.flags.toggles.get(p.id, {})
        results = record.get("results") or {}
        if p.restarting_since is not None:
            self._follow_restart(p, now)
            return
        answered = {int(r): res for r, res in results.items()}
        gone = [r for r in p.ranks if r not in answered
                and self.state.ranks[r].state in ("lost", "exited", "finished")]
        waiting = [r for r in p.ranks if r not in answered and r not in gone]
        if waiting and now - p.since < self._answer_wait(p):
            return
        outcomes = {res["outcome"] for res in answered.values()}
        step = max((res.get("step") or 0 for res in answered.values()), default=None)
        if "restarting" in outcomes and not waiting:
            p.restarting_since, p.restart_step = now, step
            self._emit({"id": p.id, "name": p.name, "value": p.value, "state": "restarting",
                        "step": step, "text": f"checkpointed at step {step}; the workers stop "
                        "and torchrun starts them again with the new value"})
            return
        failed = {r: res.get("text") or res["outcome"] for r, res in answered.items()
                  if res["outcome"] != "applied"}
        for r in gone:
            failed[r] = f"rank {self.state.ranks[r].state} before applying it"
        for r in waiting:
            failed[r] = f"no answer within {self._answer_wait(p):.0f} s"
        applied = [r for r in p.ranks if r not in failed]
        steps = {res.get("step") for r, res in answered.items() if r in applied}
        if not failed:
            state = "applied"
            text = (f"{p.name}={p.value or '(unset)'} in effect on every rank from step "
                    f"{step}" + ("" if len(steps) <= 1 else
                                 f" (ranks applied it at steps {sorted(steps)})"))
            notes = {res.get("text") for res in answered.values() if res.get("text")}
            if notes:
                text += "; " + " ".join(sorted(notes))[:400]
        else:
            state = "partial" if applied else "failed"
            why = "; ".join(f"rank {r}: {t}" for r, t in sorted(failed.items())[:4])
            text = f"{p.name}={p.value or '(unset)'} {state}: {why}"
        self.pending = None
        self._emit({"id": p.id, "name": p.name, "value": p.value, "state": state,
                    "step": step, "text": text})

    def _answer_wait(self, p: Pending) -> float:
        """Time for every rank to reach the planned step and answer."""
        views = [self.state.ranks[r] for r in p.ranks]
        times = [v.metrics.get("step_time_s") for v in views]
        step_s = max([t for t in times if isinstance(t, (int, float)) and t > 0] or [1.0])
        behind = p.at_step - min((v.step or 0) for v in views)
        return ANSWER_WAIT_S + max(0, behind) * step_s

    def _follow_restart(self, p: Pending, now: float) -> None:
        back = [r for r in p.ranks  # said hello again (it may have finished since)
                if (self.state.ranks[r].restart_count or 0) > p.restart_counts.get(r, 0)]
        in_effect = [r for r in back
                     if self.state.flags.values_of(r).get(p.name) == (p.value or None)]
        if len(in_effect) == len(p.ranks):
            self.pending = None
            self._emit({"id": p.id, "name": p.name, "value": p.value, "state": "restarted",
                        "step": p.restart_step,
                        "text": f"restarted at step {p.restart_step} for "
                                f"{p.name}={p.value or '(unset)'}; in effect on every rank"})
        elif now - p.restarting_since >= RESTART_WAIT_S:
            missing = sorted(set(p.ranks) - set(in_effect))
            self.pending = None
            self._emit({"id": p.id, "name": p.name, "value": p.value, "state": "failed",
                        "step": p.restart_step,
                        "text": f"after the restart at step {p.restart_step}, rank(s) "
                                f"{missing} did not come back with {p.name}={p.value} within "
                                f"{RESTART_WAIT_S:.0f} s (torchrun --max-restarts used up? "
                                "see the job's output)"})

    # --- audit -------------------------------------------------------------------------------
    def refuse(self, name: str, value: str, who: dict[str, str], text: str) -> None:
        """A toggle refused before planning (by role, or a malformed request): a `refused`
        record in the history and the audit, with its own id."""
        self._emit({"id": self._new_id(), "name": name[:100], "value": value[:200], **who,
                    "state": "refused", "text": text[:1000]})

    def _new_id(self) -> int:
        """The next toggle's id (refused ones take one too: the audit names each)."""
        self._next_id += 1
        return self._next_id - 1

    def _emit(self, body: dict[str, Any]) -> None:
        self.records.append(body)
        self.audit.write({"event": "toggle", **body})
