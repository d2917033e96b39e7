"""The rank table's rows: one row of text cells per rank, in `COLUMNS` order, and a style key
(straggler, frozen, gone, exited, stuck, ...) for the rank table widget and the node screen."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scalemon import metrics, policy, throughput
from scalemon.protocol import SILENT_RANK_STATES
from scalemon.reports.snapshot_text import script_rate_columns
from scalemon.state import alerts as alerting
from scalemon.state.jobstate import RankView
from scalemon.text import display
from scalemon.text.display import NA, Column

COLUMNS: tuple[Column, ...] = display.rank_columns()
"""The rank table: rank, state, step, one column per metric of the table that has one, host."""
MESH_AT = 1
"""Where the mesh column goes, when a rank reported its place in a device mesh: after the
rank."""
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
    style: str  # "", "straggler", "frozen", "gone", "unreachable", "silent", "exited",
    #              "stuck", "finished", "stopped", "alert", "heading" (a group-by heading, not
    #              a rank: `heading_row`)


def columns(mesh_width: int | None = None, views: Iterable[RankView] | None = None
            ) -> tuple[Column, ...]:
    """The rank table's columns; with `mesh_width`, a "mesh" column that wide after the rank
    ("pp0 dp1 tp0"); with `views`, a column shown only when seen (the pipeline bubble) only
    where one of those ranks has a value, and the tokens/s heading "tok/s (script)" where one
    of them shows its script's own rate (`scalemon.throughput`)."""
    views = None if views is None else list(views)
    base = COLUMNS if views is None else display.rank_columns(
        seen=(v.metrics for v in views))
    if views is not None and any(throughput.view_figure(v)[1] == throughput.SCRIPT
                                 for v in views):
        base = script_rate_columns(base)
    if mesh_width is None:
        return base
    return (*base[:MESH_AT], Column("mesh", "mesh", mesh_width, align_left=True),
            *base[MESH_AT:])


def heading_row(key: int, axis: str, value: int | None, ranks: int, width: int) -> Row:
    """The heading over the ranks of one value of the mesh axis the table is grouped by
    ("tp 0" in the mesh column, "4 ranks" in the state column), keyed by `key` (negative: not
    a rank), in a table of `width` columns with a mesh column (`columns`)."""
    label = f"{axis} {value}" if value is not None else f"no {axis}"
    count = f"{ranks} rank{'s' if ranks != 1 else ''}"
    return Row(key, ("──", label, count, *("",) * (width - 3)), "heading")


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
    values["tokens_per_s"] = throughput.rank_figure_at(v, now).live  # none once it stops
    return values


def rank_row(v: RankView, now: float, straggler: bool, median_step: float | None,
             first_failed: int | None = None, mesh: str | None = None,
             table: tuple[Column, ...] = COLUMNS) -> Row:
    """The row of rank `v` in the columns `table`: `straggler` when the header names it,
    `median_step` (the running ranks' median step time) for the stuck rule, `first_failed`
    the rank that failed first; `mesh`: the mesh column's text, where the table has one
    (`columns`)."""
    state, style = v.state, ""
    phase, since = v.metrics["phase"], v.metrics["phase_since_s"]
    if v.state in SILENT_RANK_STATES:  # the hub's word for a rank that stopped sending
        style = v.state
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
             "host": v.host or NA, "mesh": NA if mesh is None else mesh}
    cells = tuple(display.metric_text(c.metric, values) if c.metric is not None else frame[c.key]
                  for c in table)
    return Row(v.rank, cells, style)
