"""The flags screen (`f`): every flag scalemon can change in the running job, its tier (when a
change takes effect), the value in effect on the ranks (mismatches in bold red), and the
latest toggles with what became of them. `Enter` or `t` changes the flag under the cursor,
`R` changes it with a restart of the job; the app sends the change off the UI thread.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Static

from scalemon.flags import FLAGS, FlagError, check, parse_assignment, tier_text

from ..model import DashboardData
from ..safe_text import clean, literal_text
from ..views.flags import (
    AUDIT_HEADINGS,
    STATE_STYLES,
    TIER_STYLES,
    UNSET,
    FlagRow,
    FlagsView,
    flags_view,
    values_text,
)
from ..widgets.fit import KeysFooter
from .base import DataScreen

TITLE = "flags  ·  Enter/t: change  ·  R: change with a restart  ·  Esc back"
NAMES = tuple(FLAGS)
"""The table's rows, in the catalogue's order."""


class ToggleRequested(Message):
    """Change flag `name` to `value` on every rank (`restart`: by restarting the job)."""

    def __init__(self, name: str, value: str, restart: bool) -> None:
        super().__init__()
        self.name = name
        self.value = value
        self.restart = restart


class ToggleDialog(ModalScreen[tuple[str, str] | None]):
    """A one-line `NAME=VALUE` input, checked here before it goes anywhere: a value the
    catalogue refuses stays in the dialog with the reason under it. Esc cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    ToggleDialog { align: center middle; }
    ToggleDialog > Vertical { width: 90%; max-width: 100; height: auto; padding: 0 1;
                              border: round $accent; background: $surface; }
    ToggleDialog Static { height: auto; }
    ToggleDialog #toggle-error { color: $error; text-style: bold; }
    """

    def __init__(self, text: str, title: str, notes: str,
                 on_refused: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.text = text
        self.title_text = title
        self.notes = notes
        self.on_refused = on_refused

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(literal_text(self.title_text, style="bold"), id="toggle-title")
            yield Static(literal_text(self.notes, style="dim"), id="toggle-notes")
            yield Input(self.text, placeholder="NAME=VALUE (NAME= unsets it)",
                        select_on_focus=False, id="toggle-input")
            yield Static(id="toggle-error")

    def on_mount(self) -> None:
        field = self.query_one(Input)
        field.focus()
        field.cursor_position = len(self.text)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Check the assignment; send it back to the flags screen, or say what is wrong."""
        event.stop()
        try:
            name, value = parse_assignment(event.value.strip())
            check(name, value)
        except FlagError as exc:
            text = clean(f"refused: {exc}")
            self.query_one("#toggle-error", Static).update(Text(text))
            self.app.notify(text, severity="error", timeout=8, markup=False)
            if self.on_refused is not None:
                self.on_refused(text)
            return
        self.dismiss((name, value))

    def action_cancel(self) -> None:
        """Close without changing anything."""
        self.dismiss(None)


class FlagsScreen(DataScreen):
    """The flags of the job and the toggle audit. Esc goes back."""

    BINDINGS = [
        Binding("escape,backspace", "back", "Back"),
        Binding("t", "change(False)", "Change"),
        Binding("R", "change(True)", "Change + restart"),
    ]
    DEFAULT_CSS = """
    FlagsScreen #flags-title { height: auto; padding: 0 1; background: $boost;
                               text-style: bold; }
    FlagsScreen #flags-status { height: auto; padding: 0 1; }
    FlagsScreen #flags-info { height: auto; padding: 0 1; }
    FlagsScreen #flags-table { height: 1fr; min-height: 4; margin: 0 1;
                               scrollbar-size-horizontal: 0; }
    FlagsScreen #flags-why { height: auto; padding: 0 1; margin-bottom: 1; }
    FlagsScreen #flags-audit { height: auto; max-height: 40%; padding: 0 1; }
    FlagsScreen #flags-audit > Static { height: auto; }
    """

    def __init__(self, status: tuple[str, bool] | None = None) -> None:
        super().__init__()
        self.status = status  # (text, ok) of the last toggle request, from the app
        self.view: FlagsView | None = None
        self._cells: dict[str, tuple[Text, Text, Text]] = {}

    def compose(self) -> ComposeResult:
        yield Static(TITLE, id="flags-title")
        yield Static(id="flags-status")
        yield Static(id="flags-info")
        table: DataTable = DataTable(cursor_type="row", id="flags-table")
        table.add_column("flag", key="name")
        table.add_column("tier", key="tier")
        table.add_column("value", key="value")  # as in effect: fits 60 columns
        for name in NAMES:
            table.add_row(name, "", "", key=name)
        yield table
        yield Static(id="flags-why")
        with VerticalScroll(id="flags-audit"):
            yield Static(id="flags-audit-table")
        yield KeysFooter()

    def on_mount(self) -> None:
        self.query_one(DataTable).focus()
        self._show_status()

    # ---- drawing -------------------------------------------------------------------------

    def refresh_view(self, data: DashboardData, now: float, plots: bool) -> None:
        """Redraw the rows whose text changed, the why line and the audit."""
        view = flags_view(data)
        self.view = view
        table = self.query_one(DataTable)
        for row in view.rows:
            cells = _cells(row)
            if self._cells.get(row.name) != cells:
                for key, cell in zip(("name", "tier", "value"), cells, strict=True):
                    table.update_cell(row.name, key, cell, update_width=True)
                self._cells[row.name] = cells
        self.query_one("#flags-info", Static).update(_info(view))
        self.query_one("#flags-audit-table", Static).update(_audit(view))
        self._show_why()

    def _show_why(self) -> None:
        row = self.cursor_row()
        self.query_one("#flags-why", Static).update(_why(row) if row else "")

    def _show_status(self) -> None:
        status = self.query_one("#flags-status", Static)
        if self.status is None:
            status.update(Text("no change asked from this dashboard yet", style="dim"))
        else:
            text, ok = self.status
            status.update(literal_text(text, style="green" if ok else "bold red"))

    def show_status(self, text: str, ok: bool) -> None:
        """What became of a toggle request (the app's answer, or the local check's)."""
        self.status = (text, ok)
        if self.is_mounted:
            self._show_status()

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        """Another row under the cursor: its why."""
        if self.view is not None:
            self._show_why()

    def cursor_row(self) -> FlagRow | None:
        """The flag under the cursor (None before the first draw)."""
        if self.view is None:
            return None
        index = self.query_one(DataTable).cursor_row
        return self.view.rows[index] if 0 <= index < len(self.view.rows) else None

    # ---- changing a flag -----------------------------------------------------------------

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter on a row: change that flag."""
        event.stop()
        self.action_change(False)

    def action_change(self, restart: bool) -> None:
        """Ask for NAME=VALUE in a dialog prefilled with the flag under the cursor."""
        name = NAMES[max(0, self.query_one(DataTable).cursor_row)]
        row = self.cursor_row()
        current = row.value if row is not None and not row.mismatch else ""
        current = "" if current in (UNSET, "?") else clean(current, one_line=True)
        flag = FLAGS[name]
        tier = row.tier if row is not None else flag.tier
        if restart:
            title = f"restart the job with this value of {name}"
        else:
            title = f"change {name} on every rank ({tier_text(tier)})"
        notes = f"values: {flag.hint}" + ("; empty unsets it" if flag.unsettable else "")
        blockers = self.view.restart_blockers if self.view is not None else []
        if (restart or tier == "restart") and blockers:
            notes += "\na restart cannot be made now: " + "; ".join(blockers[:3])
        dialog = ToggleDialog(f"{name}={current}", title, notes,
                              on_refused=lambda text: self.show_status(text, ok=False))

        def submitted(result: tuple[str, str] | None) -> None:
            if result is None:
                return
            self.show_status(f"asking the hub: {result[0]}={result[1]}"
                             f"{' with a restart' if restart else ''} ...", ok=True)
            self.post_message(ToggleRequested(result[0], result[1], restart))

        self.app.push_screen(dialog, callback=submitted)

    def action_back(self) -> None:
        """Back to where it was opened."""
        self.dismiss()


def _cells(row: FlagRow) -> tuple[Text, Text, Text]:
    bad = "bold red" if row.mismatch else ""
    name = literal_text(row.name, style=bad, one_line=True)
    tier = Text(tier_text(row.tier), style=TIER_STYLES.get(row.tier, ""))
    if row.mismatch:
        value = literal_text("MISMATCH " + row.value, style="bold red", one_line=True)
    elif row.value == "?":
        value = Text("not reported", style="dim")
    else:
        value = literal_text(row.value, style="dim" if row.value == UNSET else "bold",
                             one_line=True)
    return name, tier, value


def _why(row: FlagRow) -> Text:
    t = Text()
    t.append(row.name, style="bold")
    t.append(f" ({tier_text(row.tier)}): ", style=TIER_STYLES.get(row.tier, ""))
    t.append(clean(row.why))  # "rank 3: <what its agent said>"
    t.append("\nvalues: ", style="dim").append(row.hint, style="dim")
    if row.mismatch:
        t.append("\non the ranks: ", style="bold red")
        t.append(clean(values_text(row.values)), style="bold red")
    return t


def _info(view: FlagsView) -> Text:
    t = Text()
    reported = len(view.ranks) - len(view.unreported)
    t.append(f"{reported} of {len(view.ranks)} ranks reported their flags", style="dim")
    if view.unreported and reported:
        t.append(f"; not ranks {','.join(map(str, view.unreported[:8]))}", style="yellow")
    if not reported:
        t.append(" (agents of scalemon >= 1.2 send them)", style="dim")
    mismatched = [r.name for r in view.rows if r.mismatch]
    if mismatched:
        t.append(f"  ·  differ across ranks: {', '.join(mismatched)}", style="bold red")
    return t


def _audit(view: FlagsView) -> Table | Text:
    if not view.audit:
        return Text("toggle audit: no flag changed yet", style="dim")
    shown = f"latest {len(view.audit)} of {view.toggles}" if view.toggles > len(view.audit) \
        else f"{view.toggles}"
    table = Table(box=None, padding=(0, 1), header_style="bold", expand=False,
                  title=Text(f"toggle audit, newest first ({shown})", style="bold"),
                  title_justify="left")
    for heading in AUDIT_HEADINGS:
        table.add_column(heading, no_wrap=heading != "text",
                         justify="right" if heading.endswith("step") else "left")
    for row in view.audit:
        style = STATE_STYLES.get(row.state, "")
        cells = [literal_text(c) for c in row.cells]
        cells[6].stylize(style)
        if style.endswith("red"):
            cells[7].stylize(style)
        table.add_row(*cells)
    return table
