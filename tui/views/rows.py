"""The rank table's rows: one row of text cells per rank, in `COLUMNS` order, and a style key
(straggler, lost, exited, stuck, ...) for the rank table widget and the node screen."""

from __future__ import annotations

from dataclasses import dataclass

from scalemon import metrics, policy
from scalemon.state import alerts as alerting
from scalemon.state.jobstate import RankView
from scalemon.text import display
from scalemon.text.display import NA, Column

COLUMNS: tuple[Column, ...] = display.rank_columns()
"""The rank table: rank, state, step, one column per metric of the table that has one, host."""
MONITOR_OFF = "mon. off"
"""The state cell of a rank whose agent switched itself off (the reason is in its detail)."""

PHASES = {"allreduce": "allred", "optimizer": "optim", "after-optimizer": "post-opt",
          "forward": "fwd", "backward": "bwd"}
"""Short names of the phases a stuck rank's state cell shows."""


@dataclass
class Row:
    """One rank's table row: text cells in COLUMNS order and a style key."""

    rank: int
    cells: tuple[str, ...]
    style: str  # "", "straggler", "lost", "exited", "stuck", "finished", "stopped", "alert"


def rank_values(v: RankView, now: float,
                late: dict[int, float | None] | None = None) -> dict[str, object]:
    """Every metric of the table for one rank, by name: from the messages, the well-known
    extras, and what the reducer computes (heartbeat age, arrival lateness: from `late`,
    `DashboardData.lateness`, when given)."""
    values: dict[str, object] = dict(v.metrics)
    for m in metrics.KEPT:
        if m.source != "step" and m.source != "heartbeat":
            if late is not None and m.name == "arrival_lateness_s":
                values[m.name] = late.get(v.rank)
            else:
                values[m.name] = v.value(m.name, now)
    return values


def rank_row(v: RankView, now: float, straggler: bool, median_step: float | None,
             first_failed: int | None = None) -> Row:
    """The row of rank `v`: `straggler` when the header names it, `median_step` (the running
    ranks' median step time) for the stuck rule, `first_failed` the rank that failed first."""
    state, style = v.state, ""
    phase, since = v.metrics["phase"], v.metrics["phase_since_s"]
    if v.state == "lost":
        style = "lost"
    elif v.state == "exited":
        state, style = f"exited {NA if v.exit_code is None else v.exit_code}", "exited"
        if v.rank == first_failed:
            state = "failed 1st"
        elif v.peer_loss:
            state = "peer lost"
    elif v.monitor_off:  # its steps stopped for that reason, not because it is stuck
        state, style = MONITOR_OFF, "stuck"
    elif v.state == "finished":
        style = "finished"
    elif v.state == "stopped":
        style = "stopped"
    elif (alert := alerting.worst(v.alerts)) is not None:
        state, style = alerting.short_text(alert), "alert"
    elif policy.is_stuck(phase, since, policy.stuck_after_s(median_step)):
        state, style = f"{PHASES.get(phase, phase)} {since:.0f}s", "stuck"
    elif straggler:
        style = "straggler"
    values = rank_values(v, now)
    frame = {"rank": str(v.rank), "state": state, "step": NA if v.step is None else str(v.step),
             "host": v.host or NA}
    cells = tuple(display.metric_text(c.metric, values) if c.metric is not None else frame[c.key]
                  for c in COLUMNS)
    return Row(v.rank, cells, style)
