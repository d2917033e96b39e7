"""Values for people: table text in display units, and the columns of the rank tables, from
the table of metrics. None means "cannot exist here" and always reads "n/a"."""

from __future__ import annotations

import math
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from scalemon import metrics
from scalemon.metrics import Metric
from scalemon.policy import NODE_STATES, rank_kind, rank_status, straggler_bar, stuck_after_s
from scalemon.stragglers import ARRIVAL_BASIS, json_measure

NA = "n/a"
OFF = "off"
"""The loss scale of a rank whose AMP scaler is disabled (`scaler` "off"): no scaling, which is
not the same as a value that cannot be known."""


def num(value: float | None, digits: int = 4) -> str:
    """A plain number with `digits` decimals; nan/inf spelled out."""
    if value is None:
        return NA
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}"


def scale(value: float | None) -> str:
    """An AMP loss scale: whole numbers up to a million, then scientific."""
    if value is None:
        return NA
    if not math.isfinite(value):
        return str(value)
    return f"{value:.0f}" if abs(value) < 1e6 else f"{value:.2g}"


def si(value: float | None, unit: str = "") -> str:
    """A rate with k/M/G prefixes: 12.3k."""
    if value is None or not math.isfinite(value):
        return NA
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.1f}{prefix}{unit}"
    return f"{value:.1f}{unit}"


def duration(seconds: float | None) -> str:
    """Elapsed time as h:mm:ss."""
    if seconds is None or not math.isfinite(seconds):
        return NA
    s = max(0, int(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def age(seconds: float | None) -> str:
    """Seconds since something, one decimal below a minute."""
    if seconds is None:
        return NA
    seconds = max(0.0, seconds)
    return f"{seconds:.1f}" if seconds < 60 else f"{seconds:.0f}"


def flat_text(value: object, prefix: str = "") -> str:
    """A nested value (a run configuration, an `info` fact) on one line: `a=1 b.c=2`."""
    if isinstance(value, dict):
        return " ".join(flat_text(item, f"{prefix}{key}.") if isinstance(item, dict) else
                        f"{prefix}{key}={flat_text(item)}" for key, item in value.items())
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


# --- metrics of the table, for people -------------------------------------------------------


def metric_text(metric: Metric, values: Mapping[str, Any]) -> str:
    """`values[metric.name]` as table text in the metric's display unit ("n/a" when None).
    `values` maps metric names to values (a rank's, for `used_of` the total's too)."""
    show = metric.show
    value = values.get(metric.name)
    if show is None:
        return NA if value is None else str(value)
    if show.style == "used_of":
        total = values.get(show.of or "")
        if value is None or total is None:
            return NA
        return f"{value * show.scale:.1f}/{total * show.scale:.0f}"
    if value is None and show.style == "loss_scale" and values.get("scaler") == OFF:
        return OFF
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return NA if value is None else str(value)
    shown = value * show.scale
    if not math.isfinite(shown):
        return str(shown)
    if show.style == "signed":
        return f"{shown:+.{show.digits}f}"
    if show.style == "loss_scale":
        return scale(shown)
    if show.style == "si":
        return si(shown)
    if show.style == "int":
        return f"{shown:.0f}"
    if show.style == "age":
        return age(shown)
    return f"{shown:.{show.digits}f}"


def shown(name: str, value: float) -> float:
    """`value` of metric `name` (wire unit: seconds, bytes) in its display unit (`Show`)."""
    show = metrics.BY_NAME[name].show
    return value * show.scale if show is not None else value


def unit(name: str) -> str:
    """The display unit of metric `name` ("ms"), "" for none."""
    show = metrics.BY_NAME[name].show
    return show.unit if show is not None else ""


LATE = "arrival_lateness_s"
"""The straggler measure's metric: both of its bases (arrival, compute over the median) are
seconds shown in its unit."""


@dataclass(frozen=True)
class Column:
    """One column of a rank table: `key` is a metric name or one of the frame columns."""

    key: str
    heading: str
    width: int
    metric: Metric | None = None
    align_left: bool = False
    group: str = ""
    """The heading over a node table's sub-columns of one metric ("step ms" over min med
    max); the sub-column's `key` is the metric's name and the part: `step_time_s.med`."""


FRAME_LEFT = (Column("rank", "rank", 4), Column("state", "state", 10, align_left=True),
              Column("step", "step", 6))
FRAME_RIGHT = (Column("host", "host", 14, align_left=True),)


def rank_columns(dashboard: bool = True) -> tuple[Column, ...]:
    """The rank table's columns: rank, state and step, a column per metric of the table that
    has one (in table order), then the host. Without `dashboard`, the metrics only a
    dashboard computes are left out (the `scalemon snapshot` table)."""
    middle = tuple(
        Column(m.name, m.show.heading, max(m.show.width, len(m.show.heading)), m)
        for m in metrics.COLUMNS
        if m.show is not None and (dashboard or m.source != "dashboard")
    )
    return FRAME_LEFT + middle + FRAME_RIGHT


# --- many ranks: a row per node -------------------------------------------------------------

AGGREGATE_AT = 512
"""From this many ranks on, the dashboard's overview and the `scalemon snapshot` text show a
row per node (host) instead of a row per rank (`snapshot --json` always has every rank)."""
NO_HOST = "?"
"""The node shown for ranks whose host is not known yet (no hello seen)."""
KEY_METRICS = tuple(m.name for m in sorted(
    (m for m in metrics.METRICS if m.show and m.show.key), key=lambda m: m.show.key or 0))
"""Metrics whose node rows show the min, the median and the max over the node's ranks; the
other metric columns show the node's worst value (`LOW_IS_WORSE`: the min, else the max)."""
LOW_IS_WORSE = frozenset(m.name for m in metrics.METRICS if m.show and m.show.low_is_worse)


def node_columns(dashboard: bool = True) -> tuple[Column, ...]:
    """A node table's columns: node, ranks, worst state, the ranks running / lost / failed /
    finished, the step range; then min, median and max of each `KEY_METRICS` and the worst
    value of every other metric of the rank table (`group` heads the sub-columns of one
    metric). Without `dashboard`, the metrics only a dashboard computes are left out."""
    frame = (Column("node", "node", 14, align_left=True), Column("ranks", "ranks", 5),
             Column("worst", "worst", 10, align_left=True), Column("running", "run", 4),
             Column("lost", "lost", 4), Column("failed", "fail", 4),
             Column("finished", "fin", 4), Column("step", "step", 11))
    by_name = {c.metric.name: c.metric for c in rank_columns(dashboard) if c.metric}
    keys = [by_name[name] for name in KEY_METRICS if name in by_name]
    rest = [m for name, m in by_name.items() if name not in KEY_METRICS]
    columns = list(frame)
    for m in keys + rest:
        assert m.show is not None
        parts = (("min", "med", "max") if m.name in KEY_METRICS else
                 ("min",) if m.name in LOW_IS_WORSE else ("max",))
        width = max(m.show.width, 4)
        if len(parts) == 1:  # one sub-column: wide enough for the metric's heading
            width = max(width, len(m.show.heading))
        columns.extend(Column(f"{m.name}.{part}", part, width, m, group=m.show.heading)
                       for part in parts)
    return tuple(columns)


def spread(values: Iterable[Any]) -> tuple[float, float, float] | None:
    """(min, median, max) of the finite numbers among `values`; None when there is none."""
    xs = sorted(v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(v))
    if not xs:
        return None
    n = len(xs)
    mid = xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
    return xs[0], mid, xs[-1]


def node_cells(columns: tuple[Column, ...], host: str | None, kinds: list[str], worst: str,
               steps: list[int | None], values: list[Mapping[str, Any]]) -> tuple[str, ...]:
    """The text of one node row in `columns` order: `kinds` (`rank_kind`), `steps` and
    `values` (metric name -> value) of each of the node's ranks, its `worst` state."""
    frame = {"node": host or NO_HOST, "ranks": str(len(kinds)), "worst": worst,
             "running": str(kinds.count("running")), "lost": str(kinds.count("lost")),
             "failed": str(kinds.count("failed")), "finished": str(kinds.count("finished"))}
    known = [s for s in steps if s is not None]
    low, high = (min(known), max(known)) if known else (None, None)
    frame["step"] = NA if low is None else str(low) if low == high else f"{low}–{high}"
    spreads: dict[str, tuple[float, float, float] | None] = {}
    cells = []
    for c in columns:
        if c.metric is None:
            cells.append(frame[c.key])
            continue
        name = c.metric.name
        if name not in spreads:
            spreads[name] = spread(v.get(name) for v in values)
        s = spreads[name]
        if s is None:
            off = c.metric.show is not None and c.metric.show.style == "loss_scale" and \
                values and all(v.get("scaler") == OFF for v in values)
            cells.append(OFF if off else NA)
            continue
        value = s[("min", "med", "max").index(c.key.rsplit(".", 1)[1])]
        shown = {name: value}
        of = c.metric.show.of if c.metric.show is not None else None
        if of:
            totals = [t for v in values if isinstance(t := v.get(of), (int, float))]
            shown[of] = max(totals) if totals else None
        cells.append(metric_text(c.metric, shown))
    return tuple(cells)


def node_order_key(worst: str, median_step_s: float | None, slow: bool, late_max: float | None,
                   first_rank: int) -> tuple[int, float, float, int]:
    """Sort key of a node row: nodes with a failed or lost rank first; then those with a rank
    restarting, stuck or straggling, or a median step time above the job's (`slow`), slowest
    median step time then latest rank first; the others last. Within the first and the last
    group rows keep the order of their first rank, so they do not move with noise."""
    tier = NODE_STATES.index(worst)
    if tier <= 1:
        return (0, 0.0, 0.0, first_rank)
    if tier <= 4 or slow:
        return (1, -(median_step_s or 0.0), -(late_max or 0.0), first_rank)
    return (2, 0.0, 0.0, first_rank)


# --- the `scalemon snapshot` text of a big job ------------------------------------------------

TOP_STRAGGLERS = 8
"""Slowest ranks listed above a node table (by the straggler measure: arrival lateness, or
before any collective compute time over the median rank's)."""
FAILED_LISTED = 12
"""Lost or failed ranks listed above a node table; the others are counted."""


def node_snapshot_lines(ranks: list[dict[str, Any]], width: int = 60) -> list[str]:
    """The ranks of a `scalemon snapshot` (`JobState.to_json()["ranks"]`) as people read a
    big job: the slowest ranks by the straggler measure (`stragglers.json_measure`, the
    dashboard's), the lost and failed ranks, a row per node
    (trouble first: `node_order_key`) and each `log()` extra's spread over the ranks."""
    late, basis, median_step = json_measure(ranks)  # the dashboard's measure and bar
    bar = straggler_bar(median_step)
    hosts = {r["rank"]: r.get("host") or NO_HOST for r in ranks}
    by_node: dict[str | None, list[dict[str, Any]]] = {}
    for r in ranks:
        by_node.setdefault(r.get("host") or None, []).append(r)
    lines = [f"ranks: {len(ranks)} on {len(by_node)} nodes, a row per node from "
             f"{AGGREGATE_AT} ranks on (--json has every rank)"]
    slowest = sorted(late.items(), key=lambda rv: (-rv[1], rv[0]))[:TOP_STRAGGLERS]
    ms = unit(LATE)
    by = (f"arrival at collectives ({ms} after the first rank" if basis == ARRIVAL_BASIS else
          f"compute time, no collective seen by every rank yet ({ms} over the median rank")
    lines.append(f"slowest ranks by {by}; a straggler from {shown(LATE, bar):.3g} {ms}):"
                 if slowest else "slowest ranks: n/a (no collective seen by every rank yet)")
    lines.extend(f"  rank {r:<6} {hosts[r]:<14} {shown(LATE, v):+8.1f} {ms}"
                 + ("  straggler" if v > bar else "") for r, v in slowest)
    failed = sorted((r for r in ranks if rank_kind(r["state"], r.get("exit_code"))
                     in ("lost", "failed")),
                    key=lambda r: (bool(r.get("peer_loss")), r.get("ended_t") or math.inf,
                                   r["rank"]))
    lines.append(f"lost or failed ranks: {len(failed) or 'none'}")
    for r in failed[:FAILED_LISTED]:
        reason = r.get("state_reason")
        code = "" if r.get("exit_code") is None else f" exit code {r['exit_code']}"
        why = f" ({reason})" if reason and reason != r["state"] else ""
        peer = ", peer lost" if r.get("peer_loss") else ""
        lines.append(f"  rank {r['rank']:<6} {hosts[r['rank']]:<14} {r['state']}{code}{why}"
                     f"{peer}")
    if len(failed) > FAILED_LISTED:
        lines.append(f"  +{len(failed) - FAILED_LISTED} more (--json has them all)")
    lines.extend(_node_table_lines(by_node, late, bar, median_step))
    lines.extend(_extra_lines(ranks, width))
    return lines


def _snapshot_worst(rank: dict[str, Any], late: dict[int, float], bar: float,
                    stuck_after: float) -> str:
    """The `NODE_STATES` entry of one rank of a snapshot (`policy.rank_status`)."""
    since = rank.get("phase_since_s")
    return rank_status(rank["state"], rank.get("exit_code"), rank.get("phase"),
                       since if isinstance(since, (int, float)) else None,
                       late.get(rank["rank"], 0.0) > bar, stuck_after)


def snapshot_values(rank: Mapping[str, Any]) -> dict[str, Any]:
    """A snapshot rank's values by metric name, as the dashboard reads them: its messages'
    fields and its `extra`, and tokens/s derived from `tokens / step_time_s` where the
    script gave tokens but no rate of its own (`metrics.tokens_per_s`)."""
    values = {**rank, **(rank.get("extra") or {})}
    if values.get("tokens_per_s") is None:
        values["tokens_per_s"] = metrics.tokens_per_s(values)
    return values


def _node_table_lines(by_node: dict[str | None, list[dict[str, Any]]], late: dict[int, float],
                      bar: float, median_step: float | None) -> list[str]:
    """A row per node, trouble first, under a two-line heading (metric, then min/med/max)."""
    columns = node_columns(dashboard=False)
    stuck_after = stuck_after_s(median_step)
    keyed = []
    for host, members in by_node.items():
        worsts = [_snapshot_worst(r, late, bar, stuck_after) for r in members]
        worst = min(worsts, key=NODE_STATES.index)
        values = [snapshot_values(r) for r in members]
        cells = node_cells(columns, host, [rank_kind(r["state"], r.get("exit_code"))
                                           for r in members], worst,
                           [r.get("step") for r in members], values)
        s = spread(r.get("step_time_s") for r in members if r["state"] == "running")
        node_late = [late[r["rank"]] for r in members if r["rank"] in late]
        slow = s is not None and median_step is not None and s[1] > median_step + bar
        key = node_order_key(worst, s[1] if s else None, slow,
                             max(node_late) if node_late else None,
                             min(r["rank"] for r in members))
        keyed.append((key, cells))
    keyed.sort(key=lambda kc: kc[0])
    rows = [cells for _, cells in keyed]
    widths = [max([len(c.heading)] + [len(row[i]) for row in rows])
              for i, c in enumerate(columns)]
    for group in {c.group for c in columns if c.group}:  # a group heading fits its columns
        at = [i for i, c in enumerate(columns) if c.group == group]
        short = len(group) - (sum(widths[i] for i in at) + len(at) - 1)
        if short > 0:
            widths[at[-1]] += short

    def line(texts: list[str] | tuple[str, ...]) -> str:
        return " ".join(t.ljust(w) if c.align_left else t.rjust(w)
                        for c, t, w in zip(columns, texts, widths, strict=True)).rstrip()

    groups, i = [], 0
    while i < len(columns):
        j = i
        while j + 1 < len(columns) and columns[j + 1].group and \
                columns[j + 1].group == columns[i].group:
            j += 1
        span = sum(widths[i:j + 1]) + (j - i)
        groups.append(columns[i].group.center(span) if columns[i].group else " " * span)
        i = j + 1
    return [" ".join(groups).rstrip(), line([c.heading for c in columns])] + \
        [line(row) for row in rows]


def _extra_lines(ranks: list[dict[str, Any]], width: int) -> list[str]:
    """Each `log()` extra's spread over the ranks that log it (numbers), or its values."""
    by_name: dict[str, list[Any]] = {}
    for r in ranks:
        for name, value in (r.get("extra") or {}).items():
            by_name.setdefault(name, []).append(value)
    lines = []
    for name in sorted(by_name):
        values = by_name[name]
        s = spread(values)
        if s is not None:
            text = " / ".join(flat_text(float(v)) for v in s) + " (min / median / max)"
        else:
            distinct = {flat_text(v) for v in values}
            text = distinct.pop() if len(distinct) == 1 else f"{len(distinct)} distinct values"
        text = text if len(text) <= width else text[: width - 1] + "…"
        lines.append(f"extra {name} ({len(values)} ranks): {text}")
    return lines


def exit_text(code: int) -> str:
    """A process's exit status in words: `exit code N` or `killed by SIGNAME`."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
