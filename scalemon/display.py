"""Values for people: table text in display units, and the columns of the rank tables, from
the table of metrics. None means "cannot exist here" and always reads "n/a"."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scalemon import metrics
from scalemon.metrics import Metric

NA = "n/a"


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


@dataclass(frozen=True)
class Column:
    """One column of a rank table: `key` is a metric name or one of the frame columns."""

    key: str
    heading: str
    width: int
    metric: Metric | None = None
    align_left: bool = False


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
