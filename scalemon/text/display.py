"""Values for people: table text in display units, and the columns of the rank and node tables,
from the table of metrics. None means "cannot exist here" and always reads "n/a"."""

from __future__ import annotations

import math
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from scalemon import metrics
from scalemon.metrics import Metric
from scalemon.policy import GONE_KINDS, TROUBLE_KINDS

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


FRAME_LEFT = (Column("rank", "rank", 4), Column("state", "state", 11, align_left=True),
              Column("step", "step", 6))
FRAME_RIGHT = (Column("host", "host", 14, align_left=True),)


def rank_columns(dashboard: bool = True, seen: Iterable[Mapping[str, Any]] | None = None
                 ) -> tuple[Column, ...]:
    """The rank table's columns: rank, state and step, a column per metric of the table that
    has one (in table order), then the host. Without `dashboard`, the metrics only a
    dashboard computes are left out (the `scalemon snapshot` table). With `seen`, the ranks'
    values (name -> value maps), a metric shown only when seen (`Show.when_seen`) has its
    column only where one of them has a value."""
    shown = None if seen is None else seen_names(seen)
    middle = tuple(
        Column(m.name, m.show.heading, max(m.show.width, len(m.show.heading)), m)
        for m in metrics.COLUMNS
        if m.show is not None and (dashboard or m.source != "dashboard")
        and (shown is None or not m.show.when_seen or m.name in shown)
    )
    return FRAME_LEFT + middle + FRAME_RIGHT


WHEN_SEEN = tuple(m.name for m in metrics.COLUMNS if m.show is not None and m.show.when_seen)
"""The metrics whose column the rank tables show only while some rank has a value."""


def seen_names(values: Iterable[Mapping[str, Any]]) -> set[str]:
    """The `WHEN_SEEN` metrics that one of `values` (name -> value maps) has a value of."""
    names = set(WHEN_SEEN)
    found: set[str] = set()
    for row in values:
        found.update(n for n in names - found if row.get(n) is not None)
        if found == names:
            break
    return found


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
    """A node table's columns: node, ranks, worst state, the ranks running / frozen / gone
    (gone, unreachable or silent: taken for ended, `policy.GONE_KINDS`) / failed / finished,
    the step range; then min, median and max of each `KEY_METRICS` and the worst
    value of every other metric of the rank table (`group` heads the sub-columns of one
    metric). Without `dashboard`, the metrics only a dashboard computes are left out."""
    frame = (Column("node", "node", 14, align_left=True), Column("ranks", "ranks", 5),
             Column("worst", "worst", 11, align_left=True), Column("running", "run", 4),
             Column("frozen", "frz", 4), Column("gone", "gone", 4), Column("failed", "fail", 4),
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
             "running": str(kinds.count("running")), "frozen": str(kinds.count("frozen")),
             "gone": str(sum(kinds.count(k) for k in GONE_KINDS)),
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
    """Sort key of a node row: nodes with a rank that failed or stopped sending (frozen, gone,
    unreachable, silent: `policy.TROUBLE_KINDS`) first; then those with a rank restarting,
    stuck or straggling, or a median step time above the job's (`slow`), slowest median step
    time then latest rank first; the others last. Within the first and the last group rows
    keep the order of their first rank, so they do not move with noise."""
    if worst in TROUBLE_KINDS:
        return (0, 0.0, 0.0, first_rank)
    if worst in ("restarting", "stuck", "straggler") or slow:
        return (1, -(median_step_s or 0.0), -(late_max or 0.0), first_rank)
    return (2, 0.0, 0.0, first_rank)


def exit_text(code: int) -> str:
    """A process's exit status in words: `exit code N` or `killed by SIGNAME`."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def text_of(value: Any, spec: str = "") -> str:
    """`value` formatted with `spec`; "n/a" for None."""
    if value is None:
        return NA
    return format(value, spec) if spec else str(value)
