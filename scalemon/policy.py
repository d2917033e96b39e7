"""The thresholds and classifications that name trouble, in one place: when a job is hung, a
rank stuck or a straggler, and what a rank counts as in a node row. The dashboard, the
`scalemon snapshot` text and JSON, the summary and the hub's alerts all ask here, so they
never disagree about a rank.
"""

from __future__ import annotations

HANG_AFTER_S = 10.0
"""A job where no rank completed a step for this long is hung (`reports.hangs.job_hang`); the agents
send their stack and collectives in flight once their training thread is stuck this long."""

HEARTBEAT_S = 1.0
"""A rank's heartbeat interval while it does not complete steps (starting, stuck, hung)."""
HEARTBEAT_STEPPING_S = 5.0
"""...and while it completes steps in a job of `HEARTBEAT_THIN_FROM` ranks or more: its steps
already tell the hub it lives, so at 16,384 ranks the hub takes 3,300 heartbeats a second, not
16,384. A rank that stops stepping beats every second again at once."""
HEARTBEAT_THIN_FROM = 512
"""Ranks from which a stepping rank's heartbeats are thinned (the dashboard's per-node view,
`scalemon.text.display.AGGREGATE_AT`, starts here too)."""


def heartbeat_stepping_s(world_size: int | None) -> float:
    """The heartbeat interval of a rank that completes steps, in a job of `world_size` ranks
    (what the hub and the relays tell the agents in the answer to their syncs)."""
    return HEARTBEAT_STEPPING_S if (world_size or 0) >= HEARTBEAT_THIN_FROM else HEARTBEAT_S


STUCK_MIN_S = 10.0
"""The least time (seconds) in one phase, or without any step, that reads as stuck."""
STUCK_STEPS = 10.0
"""...and at least this many median step times."""

STRAGGLER_MIN_S = 0.010
"""The least straggler measure (seconds) that names a straggler, however short the steps."""
STRAGGLER_STEP_SHARE = 0.1
"""...and at least this share of the median step time."""

NODE_STATES = ("failed", "gone", "unreachable", "silent", "frozen", "restarting", "stuck",
               "straggler", "running", "finished")
"""What a rank is, worst first (`rank_status`); a node's worst state is the first of these that
one of its ranks is in. `gone`, `unreachable`, `silent` and `frozen` are the hub's words for a
running rank that stopped sending (`protocol.SILENT_RANK_STATES`): its process ended without
reporting an exit; its node's relay is silent too; nothing on its node can look at its process;
its process exists but sends nothing (the job hangs on it)."""
GONE_KINDS = ("gone", "unreachable", "silent")
"""The `rank_kind`s of a rank that stopped sending and is taken for ended (a node row counts
them together in its `gone` column; the rank's own word is in its worst state and the rank
table)."""
TROUBLE_KINDS = ("failed", *GONE_KINDS, "frozen")
"""The `rank_kind`s listed above a big job's node table and first in its order: the ranks that
failed or stopped sending."""


def stuck_after_s(median_step_s: float | None) -> float:
    """How long a rank may stay in one phase, or a running job go without a step, before it
    reads as stuck (stalled): `STUCK_MIN_S`, and `STUCK_STEPS` median step times."""
    return max(STUCK_MIN_S, STUCK_STEPS * (median_step_s or 0.0))


def is_stuck(phase: str | None, phase_since_s: float | None, stuck_after: float) -> bool:
    """True when a rank has been in `phase` for longer than `stuck_after` seconds."""
    return bool(phase) and phase_since_s is not None and phase_since_s > stuck_after


def straggler_bar(median_step_s: float | None) -> float:
    """How much later (seconds) than the first rank a rank must arrive, or how much longer
    than the median rank it must compute, to be named a straggler: `STRAGGLER_MIN_S`, and
    `STRAGGLER_STEP_SHARE` of the median step time."""
    return max(STRAGGLER_MIN_S, STRAGGLER_STEP_SHARE * (median_step_s or 0.0))


def rank_kind(state: str, exit_code: int | None) -> str:
    """What a node row counts a rank as: running (restarting included), frozen, gone,
    unreachable or silent (the hub's word for a rank that stopped sending; `lost`, of a hub
    before 1.12, reads as `silent`, as the reducer reads it), failed (exited other than with
    0) or finished (exited with 0, or stopped by its user, too)."""
    if state in _SILENT_KINDS:
        return state
    if state == "lost":
        return "silent"
    if state == "stopped":
        return "finished"
    if state == "exited":
        return "finished" if exit_code == 0 else "failed"
    return "finished" if state == "finished" else "running"


_SILENT_KINDS = frozenset((*GONE_KINDS, "frozen"))


def rank_status(state: str, exit_code: int | None, phase: str | None,
                phase_since_s: float | None, straggler: bool, stuck_after: float) -> str:
    """The `NODE_STATES` entry of one rank: its `rank_kind` when it does not run; else
    restarting, stuck (`is_stuck`), straggler (`straggler`: its measure is over the bar) or
    running. Called for every rank on every redraw of a big job's node table: the common case,
    a running rank, goes straight to the stuck and straggler checks."""
    if state != "running":
        kind = rank_kind(state, exit_code)
        if kind != "running":
            return kind
        if state == "restarting":
            return "restarting"
    if is_stuck(phase, phase_since_s, stuck_after):
        return "stuck"
    return "straggler" if straggler else "running"
