"""The overview screen: job header, per-rank table and four plots.

A job of `AGGREGATE_AT` ranks or more shows a row per node instead of per rank, under the
slowest ranks, those that failed or stopped sending and a histogram of how late the ranks
are; `n` switches between the two at any size. Enter on a node shows its ranks
(`OpenNode`). Where the ranks reported their place in a device mesh, `g` groups the rank table
by one mesh axis after the other, then no more.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal

from ..messages import OpenNode, OpenRank, RedrawNeeded
from ..model import DashboardData
from ..views.nodes import NodeView
from ..views.overview import overview
from ..widgets.fit import KeysFooter
from ..widgets.header import JobHeader
from ..widgets.node_table import NodeTable
from ..widgets.plot import LinePlot
from ..widgets.rank_table import RankTable
from ..widgets.watch import (
    HistogramPanel,
    TextPanel,
    failed_text,
    slowest_text,
)
from .base import DataScreen

PLOTS = ("loss", "scale", "time", "memory")
MODES = ("auto", "ranks", "nodes")
"""auto: a row per node from `AGGREGATE_AT` ranks on; `n` picks the other one by hand."""


class OverviewScreen(DataScreen):
    """Everything about the job on one screen."""

    BINDINGS = [Binding("n", "toggle_nodes", "Per node/rank", show=False),
                Binding("g", "group_by", "Group by mesh axis")]
    DEFAULT_CSS = """
    OverviewScreen { layout: vertical; }
    OverviewScreen #plots { grid-size: 2 2; grid-gutter: 0 1; height: 1fr; min-height: 6; }
    OverviewScreen #watch { height: 9; display: none; }
    OverviewScreen #slowest { width: 34; }
    OverviewScreen #nodes { display: none; }
    """
    """The node table and its panels start hidden; `_switch` shows one table or the other by
    each widget's own `display` (a class on the screen restyled every widget under it)."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = "auto"
        self.group_by: str | None = None
        """The mesh axis the rank table is grouped by (None: in rank order)."""
        self.axes: tuple[str, ...] = ()  # the mesh's axes, as of the last redraw
        self._nodes_shown = False

    def compose(self) -> ComposeResult:
        yield JobHeader(id="header")
        with Horizontal(id="watch"):
            yield TextPanel(id="slowest")
            yield TextPanel(id="failed")
            yield HistogramPanel(id="spread")
        yield NodeTable(id="nodes")
        yield RankTable(id="ranks")
        with Grid(id="plots"):
            for name in PLOTS:
                yield LinePlot(id=f"plot-{name}")
        yield KeysFooter()

    def on_mount(self) -> None:
        self.query_one(RankTable).focus()
        self.query_one(RankTable).tooltip = (
            "Enter: this rank's detail.  late ms = how much later the rank issues its "
            "collectives than the first rank (median of its last 100, fewer from 10,000 ranks "
            "on); allred ms (gloo) overlaps backward under DDP.  c: collectives, h: hang view, "
            "f: flags, L: log, n: a row per node, g: group by a mesh axis (3-D parallel jobs).")
        self.query_one(NodeTable).tooltip = (
            "A row per node, trouble first: ranks that failed or stopped sending (frozen, gone, "
            "unreachable, silent), then stragglers and slow nodes.  frz: frozen ranks; gone: "
            "gone, unreachable or silent ones.  min / med / max over the node's ranks; one "
            "value: the node's worst.  "
            "Enter: the node's ranks.  n: a row per rank.")
        self.query_one("#plot-time", LinePlot).tooltip = (
            "compute = step - all-reduce - optimizer (at least 0). Under DDP the all-reduce "
            "overlaps backward, so compute is a lower bound and the three need not add up.")

    @property
    def showing_nodes(self) -> bool:
        """True while the table has a row per node."""
        return self._nodes_shown

    def refresh_view(self, data: DashboardData, now: float, plots: bool) -> None:
        """Redraw from the data (plots only when `plots`)."""
        table, nodes = self.query_one(RankTable), self.query_one(NodeTable)
        visible = nodes.visible() if self.showing_nodes else table.visible()
        view = overview(data, now, plots=plots, visible=visible,
                        nodes=None if self.mode == "auto" else self.mode == "nodes",
                        group_by=self.group_by)
        if view.axes != self.axes:  # `g` is offered where there is a mesh to group by
            self.axes = view.axes
            self.refresh_bindings()
        self.query_one(JobHeader).show(view.summary)
        if (view.nodes is not None) != self.showing_nodes:
            self._switch(view.nodes is not None)
        if view.nodes is not None:
            self._show_nodes(view.nodes)
        else:
            table.show_rows(view.rank_ids, view.rows, view.columns)
        if view.plots is not None:
            for name in PLOTS:
                self.query_one(f"#plot-{name}", LinePlot).update_spec(view.plots[name])

    def _switch(self, nodes: bool) -> None:
        """Show the other table (focused), and format its rows on screen at the next tick."""
        self._nodes_shown = nodes
        node_table, rank_table = self.query_one(NodeTable), self.query_one(RankTable)
        self.query_one("#watch").display = node_table.display = nodes
        rank_table.display = not nodes
        (node_table if nodes else rank_table).focus()
        self.post_message(RedrawNeeded(plots=False))

    def _show_nodes(self, view: NodeView) -> None:
        self.query_one(NodeTable).show_nodes(view.hosts, view.rows)
        self.query_one("#slowest", TextPanel).show(slowest_text(view.watch))
        self.query_one("#failed", TextPanel).show(failed_text(view.watch))
        self.query_one(HistogramPanel).show_histogram(view.histogram)

    def action_toggle_nodes(self) -> None:
        """A row per node <-> a row per rank."""
        self.mode = "ranks" if self.showing_nodes else "nodes"
        self.post_message(RedrawNeeded(plots=False))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """`g` (in the footer too) only where the ranks reported a device mesh."""
        if action == "group_by":
            return bool(self.axes)
        return True

    def action_group_by(self) -> None:
        """Group the rank table by the next mesh axis; after the last, rank order again."""
        order = [*self.axes, None]
        at = order.index(self.group_by) if self.group_by in order else len(order) - 1
        self.group_by = order[(at + 1) % len(order)]
        self.post_message(RedrawNeeded(plots=False))

    def on_rank_table_scrolled(self, event: RankTable.Scrolled) -> None:
        """Format the rows that came into view at the next tick."""
        self.post_message(RedrawNeeded(plots=False))

    def on_node_table_scrolled(self, event: NodeTable.Scrolled) -> None:
        """Format the rows that came into view at the next tick."""
        self.post_message(RedrawNeeded(plots=False))

    def on_rank_table_selected(self, event: RankTable.Selected) -> None:
        """Enter (or a click on the highlighted row) opens the rank's detail."""
        self.post_message(OpenRank(event.rank))

    def on_node_table_selected(self, event: NodeTable.Selected) -> None:
        """Enter (or a click on the highlighted row) shows the node's ranks."""
        self.post_message(OpenNode(event.host))
