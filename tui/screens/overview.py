"""The overview screen: job header, per-rank table and four plots."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Grid
from textual.widgets import Footer

from scalemon.tui.messages import OpenRank, RedrawNeeded
from scalemon.tui.model import DashboardData
from scalemon.tui.screens.base import DataScreen
from scalemon.tui.views import overview
from scalemon.tui.widgets.header import JobHeader
from scalemon.tui.widgets.plot import LinePlot
from scalemon.tui.widgets.rank_table import RankTable

PLOTS = ("loss", "scale", "time", "memory")


class OverviewScreen(DataScreen):
    """Everything about the job on one screen."""

    DEFAULT_CSS = """
    OverviewScreen { layout: vertical; }
    OverviewScreen #plots { grid-size: 2 2; grid-gutter: 0 1; height: 1fr; min-height: 8; }
    """

    def compose(self) -> ComposeResult:
        yield JobHeader(id="header")
        yield RankTable(id="ranks")
        with Grid(id="plots"):
            for name in PLOTS:
                yield LinePlot(id=f"plot-{name}")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(RankTable).focus()
        self.query_one(RankTable).tooltip = (
            "Enter: this rank's detail.  late ms = how much later the rank issues its "
            "collectives than the first rank (median of its last 100); allred ms (gloo) "
            "overlaps backward under DDP.  c: collectives, h: hang view, f: flags, L: log.")
        self.query_one("#plot-time", LinePlot).tooltip = (
            "compute = step - all-reduce - optimizer (at least 0). Under DDP the all-reduce "
            "overlaps backward, so compute is a lower bound and the three need not add up.")

    def refresh_view(self, data: DashboardData, now: float, plots: bool) -> None:
        """Redraw from the data (plots only when `plots`)."""
        table = self.query_one(RankTable)
        view = overview(data, now, plots=plots, visible=table.visible())
        self.query_one(JobHeader).show(view.summary)
        table.show_rows(view.rank_ids, view.rows)
        if view.plots is not None:
            for name in PLOTS:
                self.query_one(f"#plot-{name}", LinePlot).update_spec(view.plots[name])

    def on_rank_table_scrolled(self, event: RankTable.Scrolled) -> None:
        """Format the rows that came into view at the next tick."""
        self.post_message(RedrawNeeded(plots=False))

    def on_rank_table_selected(self, event: RankTable.Selected) -> None:
        """Enter (or a click on the highlighted row) opens the rank's detail."""
        self.post_message(OpenRank(event.rank))
