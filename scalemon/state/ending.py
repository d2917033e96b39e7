"""How ranks and jobs end, in states and in words: the rank states of an end, the signals that
stop a job (not a failure of its ranks), and the sentences for a stop.

SIGTERM, SIGINT and SIGHUP are how users, torchrun and schedulers (scancel, preemption) stop a
job: a rank whose agent reports it ended by one of them (`exit` reason "signal", agent/sigexit.py)
did not fail; a job whose ranks all ended so (or finished) is `stopped`, not crashed.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any, Protocol

from scalemon.state.failures import SIGNAL_REASON, first_line
from scalemon.text.ranks import ranks_text

TERMINAL_STATES = ("exited", "finished", "stopped")
"""Rank states of a process that ended and said so (or was stopped by its user)."""
VANISHED_STATES = ("gone", "unreachable", "silent")
"""Rank states of a rank that stopped sending and is taken for ended: its process is gone, or
nothing can look at it (its node's relay is silent too, or no reader is on its node). A `frozen`
rank's process still exists: it has not ended (the job hangs on it, `reports.hangs`)."""
ENDED_RANK_STATES = (*TERMINAL_STATES, *VANISHED_STATES)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals that stop a job (a user's `kill`, Ctrl-C, torchrun's stop, a scheduler's): a rank
ended by one of them did not fail."""
STOPPED_BY_USER = "stopped by the user"


class Ended(Protocol):
    """What the words of an end read of a rank (`jobstate.RankView`)."""

    state: str
    state_reason: str | None
    exit_code: int | None
    error: str | None


def stop_signal(body: Mapping[str, Any]) -> str | None:
    """"SIGTERM": the stop signal (`STOP_SIGNALS`) an `exit` body says the rank ended by; None
    for any other end (another signal, such as SIGSEGV or SIGABRT, is a failure)."""
    code = body.get("exit_code")
    if body.get("reason") != SIGNAL_REASON or not isinstance(code, int):
        return None
    return next((s.name for s in STOP_SIGNALS if code == 128 + s), None)


def with_reason(state: str, reason: str | None) -> str:
    """A rank's state with its reason: "exited (ended by SIGTERM, exit 143)", or the reason
    alone where it starts with the state ("stopped by the user (...); ended by ...")."""
    if not reason or reason == state:
        return state
    return reason if reason.startswith(state + " ") else f"{state} ({reason})"


def stop_text(stop: Mapping[str, Any], how: str | None = None) -> str:
    """"stopped by the user (scalemon demo: Ctrl-C, ann@node1); ended by SIGTERM, exit 143":
    the user's stop request `stop` (`job_stop`: reason, user, host), with `how` the rank ended
    (what it or the hub saw)."""
    who = f"{stop['user']}@{stop['host']}" if stop.get("user") and stop.get("host") else ""
    details = ", ".join(d for d in (stop.get("reason"), who) if d)
    text = STOPPED_BY_USER + (f" ({details})" if details else "")
    return text + (f"; {how}" if how else "")


def ranks_end_text(ranks: Mapping[int, Ended]) -> str:
    """How the ranks that ended ended, in words: "ended by SIGTERM (ranks 0,1, exit 143)",
    "rank 1 gone without reporting an exit", "rank 2 finished"."""
    how: dict[tuple[str, str], list[int]] = {}  # (what, a detail) -> the ranks
    for rank, v in sorted(ranks.items()):
        if v.state not in ENDED_RANK_STATES:
            continue
        if v.state_reason and v.state_reason.startswith("ended by "):
            what, _, code = v.state_reason.partition(", ")  # "ended by SIGTERM", "exit 143"
            how.setdefault((what, f", {code}" if code else ""), []).append(rank)
        elif v.state in VANISHED_STATES:
            how.setdefault((f"{v.state} without reporting an exit", ""), []).append(rank)
        elif v.state == "exited":
            why = first_line(v.error) or (f"exit code {v.exit_code}"
                                          if v.exit_code is not None else "no exit code")
            how.setdefault((f"exited: {why}", ""), []).append(rank)
        else:
            how.setdefault((v.state, ""), []).append(rank)
    if not how:
        return "its ranks run on"
    return "; ".join(f"{what} ({ranks_text(ranks)}{detail})" if what.startswith("ended by ")
                     else f"{ranks_text(ranks)} {what}" for (what, detail), ranks in how.items())
