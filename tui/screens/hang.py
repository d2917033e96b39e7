"""The hang screen: who holds up the job, where every rank is, their stacks, and `d` for a
Flight Recorder dump. The app shows it by itself once per hang; Esc goes back."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Static

from ..messages import DumpRequested
from ..model import DashboardData
from ..safe_text import clean, literal_text
from ..views.hang import HangView, hang_view
from ..widgets.fit import Fit, KeysFooter, cells_width, longest_word, widest
from .base import DataScreen

ROLE_STYLES = {"culprit": "bold red", "waiting": "yellow", "": ""}
TABLE_ROWS = 64
"""Ranks in the table at most (culprits first); the rest are counted."""


class HangScreen(DataScreen):
    """The job's hang, from `reports.hangs.job_hang`. Text from ranks (stacks, the analysis)
    is shown as typed, never read as markup."""

    BINDINGS = [
        Binding("escape,backspace", "back", "Back"),
        Binding("d", "dump", "Flight Recorder dump"),
    ]
    DEFAULT_CSS = """
    HangScreen #hang-title { height: auto; padding: 0 1; background: $error; color: $text;
                             text-style: bold; }
    HangScreen #hang-text { height: auto; padding: 1 2; text-style: bold; }
    HangScreen #hang-body { scrollbar-size-vertical: 1; }
    HangScreen #hang-body > Static { height: auto; padding: 0 0 0 1; }
    HangScreen #hang-body > .section { margin-top: 1; }
    """

    def __init__(self, status: str | None = None) -> None:
        super().__init__()
        self.status = status  # what became of the last dump request
        self.view: HangView | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="hang-title")
        yield Static(id="hang-text")
        with VerticalScroll(id="hang-body"):
            yield Static(id="hang-why")
            yield Static(id="hang-ranks", classes="section")
            yield Static(id="hang-dump", classes="section")
            ras = Static(id="hang-ras", classes="section")
            ras.display = False  # while no node's NCCL RAS report came
            yield ras
            yield Static(id="hang-stacks", classes="section")
        yield KeysFooter()

    def on_mount(self) -> None:
        self.query_one("#hang-body").focus()

    def refresh_view(self, data: DashboardData, now: float, plots: bool) -> None:
        """Redraw; after the hang ended the last one stays below the new headline."""
        view = hang_view(data, now)
        title = self.query_one("#hang-title", Static)
        headline = self.query_one("#hang-text", Static)
        if view.hung:
            hung = "JOB ENDED HUNG" if view.ended else "JOB HUNG"
            title.update(f"{hung}  ·  d: Flight Recorder dump  ·  Esc back")
            headline.update(literal_text(view.text, style="bold red"))
            if plots or self.view is None:  # hundreds of rows: at the plots' pace
                self.query_one("#hang-why", Static).update(_why(view))
                self.query_one("#hang-ranks", Static).update(_table(view))
                self.query_one("#hang-stacks", Static).update(_stacks(view))
                ras = self.query_one("#hang-ras", Static)
                ras.display = bool(view.ras)
                ras.update(_ras(view))
        else:
            title.update("hang view  ·  d: Flight Recorder dump  ·  Esc back")
            last = "; below: the last hang seen" if self.view is not None else ""
            headline.update(literal_text(view.text + last, style="bold green"))
        self.query_one("#hang-dump", Static).update(self._dump_text(view))
        if view.hung:
            self.view = view

    def _dump_text(self, view: HangView) -> Text:
        t = Text()
        if self.status:
            t.append(clean(self.status) + "\n", style="bold")
        for i, (line, style) in enumerate(view.dump):  # paths, the analysis
            t.append(("\n" if i else "") + clean(line), style=style)
        return t

    def show_status(self, status: str) -> None:
        """What became of a dump request (the app answers `DumpRequested` with this)."""
        self.status = status

    def action_dump(self) -> None:
        """Ask the app for a Flight Recorder dump."""
        self.status = "asking the hub for a Flight Recorder dump..."
        self.post_message(DumpRequested())

    def action_back(self) -> None:
        """Back to where it was shown."""
        self.dismiss()


def _table(view: HangView) -> Fit:
    """Each rank's whereabouts: a table where it fits (its cells 2, then 1 blank apart),
    else a line per rank that wraps, each value after its heading."""
    rest = view.rows[TABLE_ROWS:]
    waiting = sum(r.role == "waiting" for r in rest)
    caption = Text(f"(+{len(rest)} ranks, {waiting} of them waiting in the collective)",
                   style="dim") if rest else None
    shown = view.rows[:TABLE_ROWS]
    tables: list[tuple[int, Table]] = []
    for wrapping in ((), ("frame",), ("in flight",)):  # "in flight" on one line where it fits
        widths = [(longest_word if heading in wrapping else widest)(
            [*heading.split("\n"), *(row.cells[i] for row in shown)])
            for i, heading in enumerate(view.headings)]
        for padding, need in (((0, 1), cells_width(widths, 2, 1)),
                              ((0, 1, 0, 0), cells_width(widths, 1) + 1)):
            tables.append((need, _rank_table(view, padding, wrapping, caption)))
    lines = Text()
    for row in view.rows[:TABLE_ROWS]:
        words = [f"{heading.replace(chr(10), ' ')} {cell}" if heading != "role" else cell
                 for heading, cell in zip(view.headings, row.cells, strict=True) if cell]
        lines.append(("\n" if lines else "") + clean("  ".join(words), one_line=True),
                     style=ROLE_STYLES[row.role])
    if caption is not None:
        lines.append("\n").append_text(caption)
    return Fit(*tables, lines)


def _rank_table(view: HangView, padding: tuple[int, ...], wrapping: tuple[str, ...],
                caption: Text | None) -> Table:
    """The ranks' table, its cells `padding` apart, the columns `wrapping` names wrapped."""
    table = Table(box=None, padding=padding, header_style="bold", expand=False,
                  caption=caption, caption_justify="left")
    for heading in view.headings:  # "<group>\nissued/done": group names come from ranks
        lines = heading.split("\n")  # each line shown as typed
        title = Text("\n").join(literal_text(line, one_line=True) for line in lines)
        table.add_column(title, no_wrap=heading not in wrapping)
    for row in view.rows[:TABLE_ROWS]:
        style = ROLE_STYLES[row.role]
        table.add_row(*(literal_text(c, style=style) for c in row.cells))
    return table


def _why(view: HangView) -> Text:
    t = Text()
    for i, (line, role) in enumerate(view.why):  # text from ranks' stacks: never markup
        t.append(("\n" if i else "") + clean(line), style=ROLE_STYLES[role])
    return t


def _ras(view: HangView) -> Text:
    t = Text()
    for i, (heading, report) in enumerate(view.ras):
        t.append(("\n\n" if i else "") + clean(heading), style="bold")
        t.append("\n" + clean(report.rstrip("\n")))
    return t


def _stacks(view: HangView) -> Text:
    t = Text()
    t.append("Python stacks of the training threads", style="bold underline")
    for heading, role, stack in view.stacks:
        t.append("\n\n" + clean(heading), style=ROLE_STYLES[role] or "bold")
        t.append("\n" + clean(stack.rstrip("\n")))
    return t
