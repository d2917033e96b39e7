"""What the job's history says about flags: each rank's values in effect, the toggles people
asked for and what became of them, and the lines of NCCL's and torch's logs the agents
streamed. Part of the reducer (`JobState.flags`), so hub, snapshot and dashboards agree."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from scalemon.flags import FLAGS, LIVE, NEW_COMMUNICATOR, RESTART, TIERS
from scalemon.protocol import Message
from scalemon.text import display

LOG_LINES_KEPT = 5000
"""Log lines the reducer keeps (the newest); older ones stay in the history."""
TOGGLES_KEPT = 200
UNKNOWN = "unknown"
"""The state of a toggle known only from a rank's `toggle_result` (no hub request seen)."""


@dataclass
class RankFlags:
    """One rank's flags as its agent last reported them."""

    values: dict[str, str | None] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)
    """name -> [tier on this rank, why], where it differs from the table's."""
    restart: dict[str, Any] | None = None
    """{"ok": bool, "reason": str}: whether a restart-tier change can restart this rank."""
    rebuild: bool = False
    log_dropped: int = 0


@dataclass
class LogLine:
    """One line of a rank's NCCL or torch log."""

    t: float
    rank: int
    source: str
    text: str

    def to_json(self) -> dict[str, Any]:
        """As in `scalemon snapshot --json` (`log`)."""
        return {"t": self.t, "rank": self.rank, "source": self.source, "text": self.text}


@dataclass
class FlagState:
    """Flags, toggles and log lines of one job."""

    ranks: dict[int, RankFlags] = field(default_factory=dict)
    toggles: dict[int, dict[str, Any]] = field(default_factory=dict)
    """The audit, by toggle id: the latest record of each (see protocol `toggle`)."""
    log: deque[LogLine] = field(default_factory=lambda: deque(maxlen=LOG_LINES_KEPT))
    log_total: int = 0

    def rank(self, rank: int) -> RankFlags:
        """The flags of `rank`, created on first sight."""
        found = self.ranks.get(rank)
        if found is None:
            found = self.ranks[rank] = RankFlags()
        return found

    # --- reducer ---------------------------------------------------------------------------
    def on_flags(self, msg: Message) -> None:
        """A rank's `flags` report."""
        b = msg.body
        view = self.rank(msg.rank)
        view.values = {k: v if isinstance(v, str) else None
                       for k, v in b["values"].items() if isinstance(k, str)}
        view.notes = {k: v for k, v in (b.get("notes") or {}).items()  # tiers known here only
                      if isinstance(v, list) and len(v) == 2 and v[0] in TIERS}
        view.restart = b.get("restart")
        view.rebuild = bool(b.get("rebuild"))

    def on_toggle(self, msg: Message) -> None:
        """A hub `toggle` record: the latest state of toggle `id`."""
        b = dict(msg.body)
        old = self.toggles.get(b["id"], {})
        self.toggles[b["id"]] = {**old, **{k: v for k, v in b.items() if v is not None},
                                 "t": old.get("t", msg.t), "updated_t": msg.t}
        while len(self.toggles) > TOGGLES_KEPT:
            self.toggles.pop(min(self.toggles))

    def on_toggle_result(self, msg: Message) -> None:
        """A rank's answer to a toggle: kept under the toggle's `results`."""
        b = msg.body
        toggle = self.toggles.get(b["id"])
        if toggle is None:  # an id no `toggle` record named: shown as such, never a crash
            toggle = self.toggles[b["id"]] = {
                "id": b["id"], "name": b["name"], "value": b["value"], "t": msg.t,
                "state": UNKNOWN, "text": f"rank {msg.rank} answered a toggle id this hub "
                                          "holds no request for"}
            while len(self.toggles) > TOGGLES_KEPT:
                self.toggles.pop(min(self.toggles))
        results = toggle.setdefault("results", {})
        earlier = results.get(str(msg.rank))
        if isinstance(b.get("log_lines"), int) and earlier is not None:
            # the follow-up of an NCCL_DEBUG change: the lines of its first seconds
            earlier.update(log_lines=b["log_lines"], log_text=b.get("text"))
            return
        results[str(msg.rank)] = {"outcome": b["outcome"], "step": b.get("step"),
                                  "text": b.get("text")}
        if isinstance(b.get("log_window_s"), (int, float)):
            results[str(msg.rank)]["log_window_s"] = b["log_window_s"]
        if isinstance(b.get("log_lines"), int):  # a follow-up whose first answer is not here
            results[str(msg.rank)].update(log_lines=b["log_lines"], log_text=b.get("text"))

    def on_log_lines(self, msg: Message) -> None:
        """New lines of a rank's log."""
        b = msg.body
        source = b["source"]
        for line in b["lines"]:
            if isinstance(line, str):
                self.log.append(LogLine(msg.t, msg.rank, source, line))
                self.log_total += 1
        if isinstance(b.get("dropped"), int):
            self.rank(msg.rank).log_dropped += b["dropped"]

    # --- views -----------------------------------------------------------------------------
    def values_of(self, rank: int) -> dict[str, str | None]:
        """Every flag of the panel for `rank` (None where unset or not reported)."""
        known = self.ranks.get(rank)
        values = known.values if known else {}
        return {name: values.get(name) for name in FLAGS}

    def tier_on(self, name: str, rank: int) -> tuple[str, str]:
        """(tier, why) of flag `name` on `rank`: the table's unless the rank said otherwise."""
        flag = FLAGS[name]
        known = self.ranks.get(rank)
        note = known.notes.get(name) if known else None
        if note:
            return note[0], note[1]
        return flag.tier, flag.why

    def strictest(self, name: str, ranks: list[int]) -> tuple[str, str]:
        """(tier, why) a change of `name` gets on these ranks: the strictest of theirs, with
        the rank that makes it so."""
        flag = FLAGS[name]
        tier, why = flag.tier, flag.why
        for r in ranks:
            rank_tier, rank_why = self.tier_on(name, r)
            if TIER_ORDER[rank_tier] > TIER_ORDER[tier]:
                tier, why = rank_tier, f"rank {r}: {rank_why}"
        return tier, why

    def table(self, ranks: list[int]) -> list[dict[str, Any]]:
        """A row per flag of the panel: tier (the strictest over `ranks`) and why, the value on
        every rank, and whether the ranks disagree (a classic cause of hangs)."""
        rows = []
        reporting = {str(k) for k, f in self.ranks.items() if f.values}
        for name, flag in FLAGS.items():
            values = {str(r): self.values_of(r)[name] for r in ranks}
            tier, why = self.strictest(name, ranks)
            reported = [v for r, v in values.items() if r in reporting]
            rows.append({
                "name": name, "tier": tier, "why": why, "hint": flag.hint,
                "values": values,
                "mismatch": len(set(reported)) > 1,
            })
        return rows

    def restart_blockers(self, ranks: list[int]) -> list[str]:
        """Why a restart-tier change cannot be made now (empty: it can), rank by rank."""
        out = []
        for r in ranks:
            known = self.ranks.get(r)
            restart = known.restart if known else None
            if not restart:
                out.append(f"rank {r}: its agent did not report whether it can restart")
            elif not restart.get("ok"):
                out.append(f"rank {r}: {restart.get('reason')}")
        return out

    def effective_tier(self, name: str, ranks: list[int]) -> str:
        """The tier a change of `name` gets on these ranks: the strictest of theirs."""
        return self.strictest(name, ranks)[0]

    def toggles_json(self) -> list[dict[str, Any]]:
        """The audit, oldest first."""
        return [self.toggles[i] for i in sorted(self.toggles)]


def log_counts_due(toggle: dict[str, Any]) -> list[int]:
    """The ranks that promised a count of NCCL log lines for `toggle` and have not sent it."""
    return sorted(int(r) for r, res in (toggle.get("results") or {}).items()
                  if res.get("log_window_s") is not None and "log_lines" not in res)


def log_count_text(toggle: dict[str, Any]) -> str | None:
    """The NCCL log lines that came in the first seconds after `toggle` was applied, in words
    (None when no rank promised a count). Says "no line" unless a rank counted some."""
    promised = {int(r): res for r, res in (toggle.get("results") or {}).items()
                if res.get("log_window_s") is not None}
    if not promised:
        return None
    window = max(res["log_window_s"] for res in promised.values())
    counted = {r: res["log_lines"] for r, res in promised.items()
               if isinstance(res.get("log_lines"), int)}
    missing = sorted(set(promised) - set(counted))
    total = sum(counted.values())
    if total > 0:
        per = ", ".join(f"rank {r}: {n}" for r, n in sorted(counted.items())[:8])
        text = f"NCCL log: {total} line(s) in the {window:g} s after it was applied ({per})"
        quiet = sorted(r for r, n in counted.items() if n == 0)
        if quiet:
            why = (promised[quiet[0]].get("log_text") or "").split(": ", 1)[-1]
            text += f"; none on rank(s) {quiet[:8]}" + (f" (rank {quiet[0]}: {why})" if why
                                                        else "")
    elif counted:
        first = min(counted)
        text = (f"NCCL log: no line in the {window:g} s after it was applied on "
                f"{'any rank' if not missing else f'rank(s) {sorted(counted)[:8]}'}")
        why = promised[first].get("log_text") or ""
        if why:
            text += f" (rank {first}: {why.split(': ', 1)[-1]})"
    else:
        text = f"NCCL log: no count yet (it comes {window:g} s after the change)"
    if missing and counted:
        text += f"; rank(s) {missing[:8]} sent no count yet"
    return text


TIER_ORDER = {LIVE: 0, NEW_COMMUNICATOR: 1, RESTART: 2}
"""Tiers from the least to the most disruptive."""


def toggle_line(t: dict[str, Any]) -> str:
    """One audit entry in words."""
    when = time.strftime("%H:%M:%S", time.localtime(t.get("t") or 0))
    who = f"{t.get('user') or '?'}@{t.get('client_host') or '?'}"
    step = f" step {t['step']}" if t.get("step") is not None else (
        f" planned step {t['at_step']}" if t.get("at_step") is not None else "")
    tier = f" ({t['tier']})" if t.get("tier") else ""
    counted = log_count_text(t) if t.get("state") in ("applied", "partial") else None
    return (f"#{t.get('id')} {when} {who} {t.get('name')}={t.get('value') or ''}{tier}{step}: "
            f"{t.get('state') or '?'} {display.NA if not t.get('text') else '- ' + t['text']}"
            + (f"; {counted}" if counted else "") + _answers(t))


def _answers(t: dict[str, Any]) -> str:
    """For a toggle known only from ranks' answers: what each rank said."""
    if t.get("state") != UNKNOWN:
        return ""
    return "".join(f"; rank {r}: {res.get('outcome')} {res.get('text') or ''}".rstrip()
                   for r, res in sorted((t.get("results") or {}).items()))
