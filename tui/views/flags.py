"""What the flags screen draws, built from `DashboardData` under its lock: a row per flag of the
panel (tier, the value in effect on every rank, whether the ranks disagree) and the latest
toggles of the audit. Also the header's one-segment flag note.

Each flag's tier is the reducer's (`FlagState.strictest`); the values are grouped by value in
one pass over the ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from scalemon.flags import FLAGS, LIVE, NEW_COMMUNICATOR, RESTART, tier_text
from scalemon.state.flagstate import FlagState, log_count_text
from scalemon.text.ranks import rank_list

from ..model import DashboardData

AUDIT_ROWS = 10
"""Toggles the screen lists (the newest)."""
VALUE_CHARS = 48
"""A row's value text is cut to this many characters (the why line below has it whole)."""
AUDIT_HEADINGS = ("time", "who", "change", "tier", "planned step", "from step", "state",
                  "text")
TIER_STYLES = {LIVE: "green", NEW_COMMUNICATOR: "yellow", RESTART: "red"}
STATE_STYLES = {"applied": "green", "restarted": "green", "requested": "yellow",
                "restarting": "yellow", "partial": "bold red", "failed": "bold red",
                "refused": "bold red"}
IN_PROGRESS = ("requested", "restarting")
UNSET = "unset"


@dataclass
class FlagRow:
    """One flag of the panel as the screen shows it."""

    name: str
    tier: str
    why: str
    hint: str
    value: str
    """One value when the reporting ranks agree (`unset`, `?` when none reported), else the
    ranks grouped by value."""
    values: dict[str, list[int]]
    """Value (UNSET for None) -> the ranks that have it, over the ranks that reported."""
    mismatch: bool


@dataclass
class AuditRow:
    """One toggle of the audit: cells in AUDIT_HEADINGS order and its state."""

    id: int
    cells: tuple[str, ...]
    state: str


@dataclass
class FlagsView:
    """What the flags screen draws."""

    rows: list[FlagRow]
    audit: list[AuditRow]  # newest first
    ranks: list[int]  # every known rank
    unreported: list[int]  # ranks whose agent sent no `flags` report
    restart_blockers: list[str]  # why a restart-tier change cannot be made now
    toggles: int  # toggles in the audit


def flags_view(data: DashboardData) -> FlagsView:
    """The flag rows and the newest AUDIT_ROWS toggles of the job."""
    with data.lock:
        flags = data.state.flags
        ranks = sorted(set(data.state.ranks) | set(flags.ranks))
        reported = {r: f.values for r, f in flags.ranks.items() if f.values}
        tiers = {name: flags.strictest(name, sorted(reported)) for name in FLAGS}
        latest = [_copy(t) for t in flags.toggles_json()[-AUDIT_ROWS:]]
        blockers = flags.restart_blockers(ranks)
        count = len(flags.toggles)
    rows = [_row(name, *tiers[name], reported) for name in FLAGS]
    audit = [_audit_row(t) for t in reversed(latest)]
    unreported = [r for r in ranks if r not in reported]
    return FlagsView(rows, audit, ranks, unreported, blockers, count)


def _copy(toggle: dict[str, Any]) -> dict[str, Any]:
    """A toggle record copied (its `results` change under the lock)."""
    return {**toggle, "results": dict(toggle.get("results") or {})}


def _row(name: str, tier: str, why: str, reported: dict[int, dict]) -> FlagRow:
    by_value: dict[str, list[int]] = {}
    for rank in sorted(reported):
        value = reported[rank].get(name)
        by_value.setdefault(UNSET if value is None else value, []).append(rank)
    if not by_value:
        text = "?"
    elif len(by_value) == 1:
        text = next(iter(by_value))
    else:
        text = values_text(by_value)
    if len(text) > VALUE_CHARS:
        text = text[:VALUE_CHARS - 1] + "…"
    return FlagRow(name, tier, why, FLAGS[name].hint, text, by_value, len(by_value) > 1)


def values_text(by_value: dict[str, list[int]]) -> str:
    """Ranks grouped by value: `0-2,5: INFO · 3,4: unset` (most ranks first)."""
    groups = sorted(by_value.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    return " · ".join(f"{rank_list(ranks)}: {value}" for value, ranks in groups)


def assignment(name: str, value: str) -> str:
    """`NAME=VALUE`, `NAME= (unset)` for the empty value."""
    return f"{name}={value}" if value else f"{name}= (unset)"


def _audit_row(t: dict[str, Any]) -> AuditRow:
    who = f"{t.get('user') or '?'}@{t.get('client_host') or '?'}"
    when = time.strftime("%H:%M:%S", time.localtime(t["t"])) if t.get("t") else "?"
    tier = tier_text(t["tier"]) if t.get("tier") else "-"
    cells = (when, who, assignment(t.get("name", "?"), t.get("value", "")), tier,
             _opt(t.get("at_step")), _opt(t.get("step")), t.get("state") or "?",
             outcome_text(t))
    return AuditRow(int(t.get("id", 0)), cells, t.get("state") or "")


def outcome_text(t: dict[str, Any]) -> str:
    """The toggle's text, and the ranks that did not apply it with why (first three)."""
    text = t.get("text") or ""
    results = t.get("results") or {}
    bad = [(int(r), res) for r, res in results.items() if res.get("outcome") == "failed"]
    if bad:
        bad.sort()
        parts = [f"rank {r}: {res.get('text') or 'failed'}" for r, res in bad[:3]]
        more = f" (+{len(bad) - 3} ranks)" if len(bad) > 3 else ""
        text = (text + "; " if text else "") + "failed on " + "; ".join(parts) + more
    elif results and not text:
        text = f"{len(results)} rank(s) answered"
    counted = log_count_text(t)
    if counted and t.get("state") not in IN_PROGRESS:
        text = (text + "; " if text else "") + counted
    return text


def _opt(value: object) -> str:
    return "-" if value is None else str(value)


# ---- the header ---------------------------------------------------------------------------

def header_note(flags: FlagState) -> tuple[str, str]:
    """(text, style) of the header's flag segment, ("", "") for none: a toggle under way, else
    the flags whose value differs across ranks. Call with the data's lock held."""
    if flags.toggles:
        latest = flags.toggles[max(flags.toggles)]
        if latest.get("state") in IN_PROGRESS:
            change = f"{latest.get('name', '?')}={latest.get('value', '')}"
            return f"toggle {change}: {latest['state']}", "bold yellow"
    differ = mismatched(flags)
    if not differ:
        return "", ""
    more = f" +{len(differ) - 1}" if len(differ) > 1 else ""
    return f"flags differ across ranks: {differ[0]}{more} (f)", "bold red"


def mismatched(flags: FlagState) -> list[str]:
    """The flags of the panel whose value is not the same on every rank that reported."""
    reported = [f.values for f in flags.ranks.values() if f.values]
    if len(reported) < 2:
        return []
    first = reported[0]
    if all(v == first for v in reported):  # the usual case, at C speed
        return []
    return [name for name in FLAGS
            if any(v.get(name) != first.get(name) for v in reported[1:])]
