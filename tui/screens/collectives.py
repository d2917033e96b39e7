"""The collectives screen: the pipeline's bubble and the MoE balance (where the job has them),
durations and bus bandwidth by (group, op, size), sends and receives by (src -> dst), the
arrival lateness heat map, the ranks by lateness and the Flight Recorder's health on each
rank."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Footer, Static

from scalemon.text.display import NA

from ..model import DashboardData
from ..safe_text import literal_text
from ..views.collectives import (
    BUSBW_HELP,
    HEALTH_HEADINGS,
    P2P_HEADINGS,
    TABLE_HEADINGS,
    Collectives,
    collectives,
)
from ..widgets.heatmap import HeatMap
from .base import DataScreen

RANKING_ROWS = 32
"""Ranks listed by lateness at most (those whose recorder lost entries are listed too)."""
RIGHT = {"n", "count", "bytes", "p50 ms", "p99 ms", "busbw GB/s", "late ms", "issued",
         "completed", "recorder entries", "lost (ring wrapped)", "read ms", "read % of run",
         "time", "bandwidth"}


class CollectivesScreen(DataScreen):
    """Every collective the Flight Recorder saw, and who arrives late to them. Esc goes back."""

    BINDINGS = [Binding("escape,backspace", "back", "Back")]
    DEFAULT_CSS = """
    CollectivesScreen #coll-title { height: 1; padding: 0 1; background: $boost;
                                    text-style: bold; }
    CollectivesScreen #coll-body > Static { height: auto; padding: 0 1; }
    CollectivesScreen #coll-body > .section { margin-top: 1; }
    """

    def compose(self) -> ComposeResult:
        yield Static("collectives  ·  Esc back", id="coll-title")
        with VerticalScroll(id="coll-body"):
            parallel = Static(id="coll-parallel")
            parallel.display = False  # while the job has no pipeline nor MoE figures
            yield parallel
            yield Static(id="coll-table")
            p2p = Static(id="coll-p2p", classes="section")
            p2p.display = False  # while no rank sent or received point to point
            yield p2p
            yield Static(Text(BUSBW_HELP), id="coll-help")
            yield HeatMap(id="coll-heat", classes="section")
            yield Static(id="coll-ranks", classes="section")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#coll-body").focus()

    def refresh_view(self, data: DashboardData, now: float, plots: bool) -> None:
        """Redraw at the plots' pace: the table sums every rank's rows."""
        if not plots:
            return
        heat = self.query_one(HeatMap)
        view = collectives(data, heat.columns())
        parallel = self.query_one("#coll-parallel", Static)
        parallel.display = bool(view.parallel)
        parallel.update(literal_text("\n".join(view.parallel), style="bold"))
        self.query_one("#coll-table", Static).update(_table(view))
        p2p = self.query_one("#coll-p2p", Static)
        p2p.display = bool(view.p2p)
        p2p.update(_p2p(view))
        heat.show(view.heat)
        self.query_one("#coll-ranks", Static).update(_ranks(view))

    def action_back(self) -> None:
        """Back to where it was opened."""
        self.dismiss()


def _table(view: Collectives) -> Table | Text:
    """The collectives by (group, op, size); group and op names as the ranks sent them."""
    if not view.rows:
        return Text("no collectives yet: the agents send what the Flight Recorder saw about "
                    "once a second (torch >= 2.11; NCCL, or gloo)", style="dim")
    table = Table(box=None, padding=(0, 1), header_style="bold", expand=False,
                  title=literal_text("; ".join(view.groups), style="dim"), title_justify="left")
    for heading in TABLE_HEADINGS:
        table.add_column(heading, justify="right" if heading in RIGHT else "left",
                         no_wrap=heading != "note")
    for row in view.rows:
        style = "bold" if row.total else ("dim" if row.size else "")
        cells = [literal_text(c, style="dim" if c == NA else style) for c in row.cells]
        if row.size:
            cells[3] = literal_text("  " + row.cells[3], style=style)
        table.add_row(*cells)
    return table


def _p2p(view: Collectives) -> Table:
    """Sends and receives by (src -> dst), global ranks; a send row is its sender's figures,
    a recv row its receiver's."""
    table = Table(box=None, padding=(0, 1), header_style="bold", expand=False)
    for heading in P2P_HEADINGS:
        table.add_column(heading, justify="right" if heading in RIGHT else "left",
                         no_wrap=True)
    for cells in view.p2p:
        table.add_row(*(literal_text(c, style="dim" if c == NA else "") for c in cells))
    return table


def _ranks(view: Collectives) -> Text | Table:
    """Ranks by arrival lateness, largest first, with their recorder's health."""
    table = Table(box=None, padding=(0, 1), header_style="bold", expand=False,
                  title=_health_title(view), title_justify="left")
    for heading in HEALTH_HEADINGS:
        table.add_column(heading, justify="right" if heading in RIGHT else "left",
                         no_wrap=True)
    shown = [h for i, h in enumerate(view.health) if i < RANKING_ROWS or h.lost]
    for h in shown:
        cells = [Text(str(h.rank)), *(literal_text(c) for c in h.cells)]
        cells[2].stylize("yellow")
        if h.lost:
            cells[6].stylize("bold red")
        table.add_row(*cells)
    if len(shown) < len(view.health):
        table.caption = Text(f"(+{len(view.health) - len(shown)} ranks less late, whose "
                             "recorder lost nothing)", style="dim")
        table.caption_justify = "left"
    return table


def _health_title(view: Collectives) -> Text:
    t = Text("arrival skew by rank, largest first (median over its last 100 collectives)",
             style="bold")
    t.append("\nFlight Recorder: ")
    if view.wrapped:
        ranks = ", ".join(f"rank {r} ({n} entries)" for r, n in view.wrapped)
        t.append(f"ring wrapped between reads on {ranks}: those collectives are missing from "
                 "the table; raise TORCH_FR_BUFFER_SIZE", style="bold red")
    else:
        t.append("no entry lost on any rank", style="green")
    if view.bad:
        t.append(f"; {view.bad} malformed collectives messages skipped", style="bold red")
    return t
