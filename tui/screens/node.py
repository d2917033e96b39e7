"""The ranks of one node: the job header and the rank table of that node's ranks. Enter opens a
rank's detail; Escape goes back to the overview."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Static

from scalemon.text.display import NO_HOST

from ..messages import OpenRank, RedrawNeeded
from ..model import DashboardData
from ..safe_text import literal_text
from ..views.nodes import node_ranks
from ..views.overview import overview
from ..widgets.fit import KeysFooter
from ..widgets.header import JobHeader
from ..widgets.rank_table import RankTable
from .base import DataScreen


class NodeScreen(DataScreen):
    """The ranks of node `host` (None: those whose host is not known yet)."""

    BINDINGS = [Binding("escape,backspace", "back", "Back")]
    DEFAULT_CSS = """
    NodeScreen { layout: vertical; }
    NodeScreen #node-title { height: auto; padding: 0 1; background: $boost; text-style: bold; }
    NodeScreen RankTable { height: 1fr; max-height: 100%; }
    """

    def __init__(self, host: str | None) -> None:
        super().__init__()
        self.host = host
        self.shown: list[int] = []

    def compose(self) -> ComposeResult:
        yield JobHeader(id="header")
        yield Static(id="node-title")
        yield RankTable(id="ranks")
        yield KeysFooter()

    def on_mount(self) -> None:
        self.query_one(RankTable).focus()

    def refresh_view(self, data: DashboardData, now: float, plots: bool) -> None:
        """Redraw the header and the node's rows on screen."""
        table = self.query_one(RankTable)
        ranks = node_ranks(data, self.host)
        data.show_ranks(ranks)  # a big job's: their records fetched while shown
        self.shown = ranks
        view = overview(data, now, plots=False, visible=table.visible(), ranks=ranks)
        self.query_one(JobHeader).show(view.summary)
        title = (f"node {self.host or NO_HOST}  ·  {len(ranks)} ranks  ·  "
                 "Enter: a rank's detail  ·  Esc back")
        # Text, never markup: a host name is what a rank sent
        self.query_one("#node-title", Static).update(literal_text(title, one_line=True))
        table.show_rows(view.rank_ids, view.rows, view.columns)

    def on_unmount(self) -> None:
        """Left: a big job's ranks of this node are no longer fetched."""
        self.app_data().hide_ranks(self.shown)

    def on_rank_table_scrolled(self, event: RankTable.Scrolled) -> None:
        """Format the rows that came into view at the next tick."""
        self.post_message(RedrawNeeded(plots=False))

    def on_rank_table_selected(self, event: RankTable.Selected) -> None:
        """Enter (or a click on the highlighted row) opens the rank's detail."""
        self.post_message(OpenRank(event.rank))

    def action_back(self) -> None:
        """Back to the overview."""
        self.dismiss()
