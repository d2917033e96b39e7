"""What the overview screen draws (`Overview`): the header's figures (`views.header`), the
rank table's rows (`views.rows`, formatted only for the rows on screen) or, for a big job, a
row per node (`views.nodes`), and the four overview plots, all copied from `DashboardData`
under one hold of its lock. The node screen draws the same, narrowed to one node's ranks and
without plots.
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections.abc import Callable, Collection
from dataclasses import dataclass

from scalemon import metrics
from scalemon.metrics import Metric
from scalemon.reports import parallel_text
from scalemon.state.jobstate import RankView
from scalemon.text import display
from scalemon.text.display import AGGREGATE_AT, Column

from ..model import DashboardData
from ..plotdata import Line, PlotSpec, scaled
from . import nodes as nodeview
from .header import Summary, summary
from .nodes import NodeView
from .rows import COLUMNS, Row, columns, heading_row, rank_row, rank_values
from .totals import totals_for

MAX_LINES = 4
"""Up to this many ranks a plot draws one line per rank; above, a min..max band and the mean."""


@dataclass
class Overview:
    """What the overview screen draws."""

    summary: Summary
    rank_ids: list[int]  # every known rank, in order (grouped: headings' keys, negative, too)
    rows: list[Row]  # the rows asked for (all by default), in rank order; none for nodes
    plots: dict[str, PlotSpec] | None  # None when plots were not asked for
    nodes: NodeView | None = None  # a row per node instead of per rank, when asked for
    columns: tuple[Column, ...] = COLUMNS  # the rank table's (a mesh column where known)
    axes: tuple[str, ...] = ()  # the device mesh's axes, where ranks reported one
    group_by: str | None = None  # the axis the table is grouped by (one of `axes`)


def overview(data: DashboardData, now: float | None = None, plots: bool = True,
             visible: tuple[int, int] | None = None, *, nodes: bool | None = False,
             ranks: Collection[int] | None = None, group_by: str | None = None) -> Overview:
    """Header figures, the table rows at positions `visible` (start, stop) of the sorted
    ranks (all when None: only what is on screen needs formatting) and, when `plots`,
    the four overview plots. `ranks`: only these ranks in the table (a node's). `nodes`:
    a row per node instead (`Overview.nodes`, `visible` then counts node rows); None: when
    the job has `AGGREGATE_AT` ranks or more. Where ranks reported their place in a device
    mesh the table has a mesh column, and `group_by` (one of its axes) orders the ranks by
    their coordinate on that axis under a heading per value."""
    now = time.time() if now is None else now
    with data.lock:
        rank_ids = sorted(data.state.ranks)
        if nodes is None:
            nodes = len(rank_ids) >= AGGREGATE_AT
        totals = totals_for(data, now, with_nodes=nodes)
        header = summary(data, now, totals)
        median_step, failure = totals.median_step, totals.failure
        straggling = {r for r, _ in header.stragglers}
        if ranks is not None:
            wanted = set(ranks)
            rank_ids = [r for r in rank_ids if r in wanted]
        first = failure["rank"] if failure else None
        node_view = None
        rows: list[Row] = []
        if nodes:
            late = data.lateness.values
            node_view = nodeview.node_view(data, totals, lambda v: rank_values(v, now, late),
                                           visible)
        table_columns, axes = COLUMNS, ()
        if not nodes:
            rank_ids, rows, table_columns, axes, group_by = _rank_rows(
                data, rank_ids, visible, group_by,
                lambda v, mesh, table: rank_row(v, now, v.rank in straggling, median_step,
                                                first, mesh, table))
        specs = _overview_plots(data) if plots else None
    return Overview(header, rank_ids, rows, specs, node_view, table_columns, axes,
                    group_by if axes else None)


def _rank_rows(data: DashboardData, rank_ids: list[int], visible: tuple[int, int] | None,
               group_by: str | None,
               row: Callable[[RankView, str | None, tuple[Column, ...]], Row]
               ) -> tuple[list[int], list[Row], tuple[Column, ...], tuple[str, ...], str | None]:
    """The rank table (call under the lock): its keys (grouped by the mesh axis `group_by`:
    a heading, then that coordinate's ranks), the rows at positions `visible` (`row` makes a
    rank's from its view and mesh cell), its columns (a mesh column where the job has a
    mesh), the mesh's axes and the axis grouped by (None: not one of the axes)."""
    st = data.state
    mesh = st.job_mesh()
    if mesh is None:
        table = columns(None, (st.ranks[r] for r in rank_ids))
        shown = rank_ids if visible is None else rank_ids[visible[0]:visible[1]]
        return rank_ids, [row(st.ranks[r], None, table) for r in shown], table, (), None
    axes = tuple(mesh["dims"])
    width = max(len("mesh"), len(" ".join(f"{d}{max(0, n - 1)}"
                                          for d, n in mesh["shape"].items())))
    if group_by not in axes:
        group_by = None
    keys, headings = rank_ids, {}
    if group_by is not None:
        coords = {r: st.mesh(r) for r in rank_ids}
        keys = []
        for i, (value, members) in enumerate(parallel_text.grouped(rank_ids, coords,
                                                                   group_by)):
            headings[-1 - i] = (value, len(members))
            keys.extend((-1 - i, *members))
    table_columns = columns(width, (st.ranks[r] for r in rank_ids))
    rows = []
    for key in keys if visible is None else keys[visible[0]:visible[1]]:
        if key < 0:
            rows.append(heading_row(key, str(group_by), *headings[key], len(table_columns)))
        else:
            rows.append(row(st.ranks[key], parallel_text.mesh_text(st.mesh(key), list(axes)),
                            table_columns))
    return keys, rows, table_columns, axes, group_by


def lines_per_rank(data: DashboardData) -> bool:
    """True when the loss and memory plots draw one line per rank (else a band)."""
    if data.loss_mode == "ranks":
        return True
    if data.loss_mode == "band":
        return False
    return len(data.tracks) <= MAX_LINES


def _scale(name: str) -> float:
    show = metrics.BY_NAME[name].show
    return show.scale if show is not None else 1.0


def _per_rank(data: DashboardData, name: str, label: str = "r{rank}") -> list[Line]:
    lines = []
    for i, rank in enumerate(sorted(data.tracks)):
        line = Line.from_series(label.format(rank=rank), data.tracks[rank].series.get(name),
                                color=i, scale=_scale(name))
        if line is not None:
            lines.append(line)
    return lines


def _band(data: DashboardData, name: str, label: str = "mean") -> list[Line]:
    agg = data.agg.get(name)
    if agg is None or not len(agg):
        return []
    scale = _scale(name)
    return [line for line in (Line.from_series("min..max", agg, color=-1, band=True, scale=scale),
                              Line.from_series(label, agg, color=0, mean=True, scale=scale))
            if line]


OVERVIEW_PANELS = ("loss", "scale", "time", "memory")
"""The overview's plots; which metrics each draws comes from the table (`Show.overview`)."""
OVERVIEW_LINES = {panel: metrics.overview_lines(panel) for panel in OVERVIEW_PANELS}
"""Each overview plot's metrics, in their order (read from the table once, not per redraw)."""


def _overview_plots(data: DashboardData) -> dict[str, PlotSpec]:
    per_rank = lines_per_rank(data)
    lines = OVERVIEW_LINES
    plots: dict[str, PlotSpec] = {}
    loss = lines["loss"][0]
    plots["loss"] = PlotSpec(loss.show.plot if loss.show else loss.name,
                             lines=_per_rank(data, loss.name) if per_rank else
                             _band(data, loss.name))
    scale = lines["scale"][0]
    plots["scale"] = PlotSpec(
        scale.show.plot if scale.show else scale.name,
        lines=_band(data, scale.name, _label(scale))[1:], log=True,
        marks=data.skipped.array(), marks_label="skipped",
        empty=f"n/a: {scale.show.na if scale.show else ''}")
    plots["time"] = PlotSpec(
        "time", unit=display.unit(lines["time"][0].name),
        lines=[line for line in (
            Line.from_series(_label(m), data.agg[m.name], color, mean=True, scale=_scale(m.name))
            for color, m in enumerate(lines["time"])) if line])
    plots["memory"] = _memory_plot(data, lines["memory"][0].name, per_rank)
    return plots


def _label(metric: Metric) -> str:
    """A metric's line label in an overview plot (`Overview.label`)."""
    overview = metric.show.overview if metric.show else None
    return overview.label if overview else metric.name


def _memory_plot(data: DashboardData, name: str, per_rank: bool) -> PlotSpec:
    """The overview's memory plot: metric `name` (GPU memory), else each rank's RSS."""
    has_gpu_mem = len(data.agg[name]) > 0 or any(name in t.series for t in data.tracks.values())
    if has_gpu_mem:
        mem_title, mem_name = "GPU alloc", name
    elif data.big():  # no per-rank series but those of the ranks opened
        mem_title, mem_name = "RSS of the ranks opened, no GPU", "rss_bytes"
    else:
        mem_title, mem_name = "RSS, no GPU", "rss_bytes"
    if per_rank:
        mem_lines = _per_rank(data, mem_name)
    elif has_gpu_mem:
        mem_lines = _band(data, mem_name)
    else:
        mem_lines = _rss_band(data)
    return PlotSpec(mem_title, unit=display.unit(name), lines=mem_lines)


def _rss_band(data: DashboardData) -> list[Line]:
    parts = [t.series["rss_bytes"].arrays() for t in data.tracks.values()
             if "rss_bytes" in t.series]
    if not parts:
        return []
    x, lo, hi = (array("d", itertools.chain.from_iterable(p[i] for p in parts))
                 for i in range(3))
    scale = _scale("rss_bytes")
    return [Line("min..max", x, scaled(lo, scale), scaled(hi, scale), color=-1, band=True)]
