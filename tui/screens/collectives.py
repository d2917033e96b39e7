"""The collectives screen: the pipeline's bubble and the MoE balance (where the job has them),
durations and bus bandwidth by (group, op, size), sends and receives by (src -> dst), the
arrival lateness heat map, the ranks by lateness and the Flight Recorder's health on each
rank."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Static

from scalemon.text.display import NA

from ..model import DashboardData
from ..safe_text import literal_text
from ..views.collectives import (
    BUSBW_HELP,
    HEALTH_HEADINGS,
    P2P_HEADINGS,
    TABLE_HEADINGS,
    Collectives,
    CollRow,
    RankHealth,
    collectives,
)
from ..widgets.fit import Fit, KeysFooter
from ..widgets.heatmap import HeatMap
from .base import DataScreen

RANKING_ROWS = 32
"""Ranks listed by lateness at most (those whose recorder lost entries are listed too)."""
OP_COLUMNS = 3
"""The collectives table's columns that name the row's (group, op) and its ranks."""
SHORT_HEALTH_HEADINGS = ("rank", "late ms", "", "issued", "done", "entries", "lost",
                         "read ms", "read %")
"""The ranking's headings where the long ones (`HEALTH_HEADINGS`) do not fit."""
SHORT_HEALTH_HELP = ("done: completed; entries: held by the Flight Recorder; lost: entries "
                     "lost as its ring wrapped; read: time spent reading it (ms, % of the run)")
BAR_COLUMN, LOST_COLUMN = 2, 6
"""The ranking's columns of the lateness bar and of the entries lost."""
RIGHT = {"n", "count", "bytes", "p50 ms", "p99 ms", "busbw GB/s", "late ms", "issued",
         "completed", "recorder entries", "lost (ring wrapped)", "read ms", "read % of run",
         "time", "bandwidth", "done", "entries", "lost", "read %"}


class CollectivesScreen(DataScreen):
    """Every collective the Flight Recorder saw, and who arrives late to them. Esc goes back."""

    BINDINGS = [Binding("escape,backspace", "back", "Back")]
    DEFAULT_CSS = """
    CollectivesScreen #coll-title { height: auto; padding: 0 1; background: $boost;
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
        yield KeysFooter()

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


def _table(view: Collectives) -> RenderableType:
    """The collectives by (group, op, size); group and op names as the ranks sent them. Where
    a row of every column does not fit, each (group, op) heads its own rows; why values are
    n/a is said once, under the table."""
    if not view.rows:
        return Text("no collectives yet: the agents send what the Flight Recorder saw about "
                    "once a second (torch >= 2.11; NCCL, or gloo)", style="dim")
    wide, tight = (_whole_table(view, padding) for padding in ((0, 1), (0, 1, 0, 0)))
    parts: list[RenderableType] = [literal_text("; ".join(view.groups), style="dim"),
                                   Fit(wide, tight, _by_op(view))]
    if view.notes:
        parts.append(literal_text("\n".join(view.notes), style="dim"))
    return Group(*parts)


def _whole_table(view: Collectives, padding: tuple[int, ...]) -> Table:
    """A row per (group, op, size) with every column, its cells `padding` apart."""
    table = Table(box=None, padding=padding, header_style="bold", expand=False)
    for heading in TABLE_HEADINGS:
        table.add_column(heading, justify="right" if heading in RIGHT else "left",
                         no_wrap=True)
    for row in view.rows:
        table.add_row(*_row_cells(row))
    return table


def _row_cells(row: CollRow) -> list[Text]:
    style = "bold" if row.total else ("dim" if row.size else "")
    cells = [literal_text(c, style="dim" if c == NA else style) for c in row.cells]
    if row.size:
        cells[3] = literal_text("  " + row.cells[3], style=style)
    return cells


def _by_op(view: Collectives) -> Group:
    """The table for narrow terminals: a line naming each (group, op) and its ranks over its
    rows of sizes, all in the same columns."""
    headings = TABLE_HEADINGS[OP_COLUMNS:]
    rows = [_row_cells(row)[OP_COLUMNS:] for row in view.rows]
    widths = [max(len(h), *(r[i].cell_len for r in rows)) for i, h in enumerate(headings)]

    def table(header: bool) -> Table:
        t = Table(box=None, padding=(0, 1, 0, 0), header_style="bold", expand=False,
                  show_header=header)
        for heading, width in zip(headings, widths, strict=True):
            t.add_column(heading, justify="right" if heading in RIGHT else "left",
                         no_wrap=True, width=width)
        return t

    parts: list[RenderableType] = [table(header=True)]
    for row, cells in zip(view.rows, rows, strict=True):
        if row.cells[1]:  # an op's first row: its name, then its table
            group, op, ranks = row.cells[:OP_COLUMNS]
            parts.append(literal_text(f"{group}  {op}  ({ranks} ranks)", style="bold"))
            parts.append(table(header=False))
        block = parts[-1]
        assert isinstance(block, Table)
        block.add_row(*cells)
    return Group(*parts)


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


def _ranks(view: Collectives) -> Group:
    """Ranks by arrival lateness, largest first, with their recorder's health: with short
    headings (explained under the table) where the long ones do not fit, then without the
    lateness bars."""
    shown = [h for i, h in enumerate(view.health) if i < RANKING_ROWS or h.lost]
    more = (f"(+{len(view.health) - len(shown)} ranks less late, whose recorder lost "
            "nothing)" if len(shown) < len(view.health) else "")
    short = _ranks_table(shown, SHORT_HEALTH_HEADINGS, more, SHORT_HEALTH_HELP)
    no_bars = _ranks_table(shown, SHORT_HEALTH_HEADINGS, more, SHORT_HEALTH_HELP, bars=False)
    return Group(_health_title(view), Fit(_ranks_table(shown, HEALTH_HEADINGS, more), short,
                                          no_bars))


def _ranks_table(shown: list[RankHealth], headings: tuple[str, ...], *captions: str,
                 bars: bool = True) -> Table:
    table = Table(box=None, padding=(0, 1), header_style="bold", expand=False)
    for i, heading in enumerate(headings):
        if bars or i != BAR_COLUMN:
            table.add_column(heading, justify="right" if heading in RIGHT else "left",
                             no_wrap=True)
    for h in shown:
        cells = [Text(str(h.rank)), *(literal_text(c) for c in h.cells)]
        cells[BAR_COLUMN].stylize("yellow")
        if h.lost:
            cells[LOST_COLUMN].stylize("bold red")
        table.add_row(*(c for i, c in enumerate(cells) if bars or i != BAR_COLUMN))
    caption = "\n".join(c for c in captions if c)
    if caption:
        table.caption = Text(caption, style="dim")
        table.caption_justify = "left"
    return table


def _health_title(view: Collectives) -> Text:
    """What the ranking is, and whether any rank's recorder lost entries."""
    t = Text("arrival skew by rank, largest first (median over its last 100 collectives; "
             "fewer from 10,000 ranks on)",
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
