"""The log screen (`L`): the newest lines of NCCL's debug output and torch's stderr streamed by
the agents, each with its rank and source, filtered by the query in the filter bar (`/`)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.events import Resize
from textual.widgets import Input, Static

from ..messages import RedrawNeeded
from ..model import DashboardData
from ..safe_text import clean
from ..views.log import (
    QUERY_HELPS,
    LogFilter,
    LogView,
    log_view,
    parse_filter,
)
from ..widgets.fit import KeysFooter
from .base import DataScreen

TITLE = "log  ·  /: filter  ·  Enter: back to the lines  ·  Esc back"
SOURCE_STYLES = {"nccl": "cyan", "stderr": "magenta"}


class LogScreen(DataScreen):
    """NCCL's and torch's log lines of every rank. Esc goes back (from the filter bar: to the
    lines)."""

    BINDINGS = [
        Binding("escape,backspace", "back", "Back"),
        Binding("slash", "filter", "Filter", key_display="/"),
    ]
    DEFAULT_CSS = """
    LogScreen #log-title { height: auto; padding: 0 1; background: $boost; text-style: bold; }
    LogScreen #log-filter { margin: 0 1; }
    LogScreen #log-counts { height: auto; padding: 0 1; }
    LogScreen #log-body { height: 1fr; padding: 0 1; }
    LogScreen #log-body > Static { height: auto; }
    """

    def __init__(self, query: str = "") -> None:
        super().__init__()
        self.query_text = query
        self.filter: LogFilter = parse_filter(query)
        self.view: LogView | None = None
        self._drawn: tuple | None = None  # (total, kept, query) of what is drawn

    def compose(self) -> ComposeResult:
        yield Static(TITLE, id="log-title")
        yield Input(self.query_text, placeholder=f"filter: {QUERY_HELPS[0]}", compact=True,
                    id="log-filter")
        yield Static(id="log-counts")
        with VerticalScroll(id="log-body"):
            yield Static(id="log-lines")
        yield KeysFooter()

    def on_mount(self) -> None:
        self.query_one("#log-body").focus()

    def on_resize(self, event: Resize) -> None:
        """The filter's hint that fits the width whole (`QUERY_HELPS`)."""
        field = self.query_one("#log-filter", Input)
        room = event.size.width - 3  # the field's margins, the cursor
        field.placeholder = next((f"filter: {h}" for h in QUERY_HELPS if len(h) + 8 <= room),
                                 f"filter: {QUERY_HELPS[-1]}")

    # ---- drawing -------------------------------------------------------------------------

    def refresh_view(self, data: DashboardData, now: float, plots: bool) -> None:
        """Redraw when new lines came or the filter changed; stay at the end if there."""
        with data.lock:
            key = (data.state.flags.log_total, len(data.state.flags.log), self.query_text)
        if key == self._drawn:
            return
        view = log_view(data, self.filter)
        self.view = view
        body = self.query_one("#log-body", VerticalScroll)
        follow = body.scroll_y >= body.max_scroll_y - 1
        self.query_one("#log-counts", Static).update(_counts(view, self.filter))
        self.query_one("#log-lines", Static).update(_lines(view))
        if follow:
            body.call_after_refresh(body.scroll_end, animate=False)
        self._drawn = key

    # ---- filtering -----------------------------------------------------------------------

    def on_input_changed(self, event: Input.Changed) -> None:
        """Filter as the query is typed."""
        self.query_text = event.value
        self.filter = parse_filter(event.value)
        self.post_message(RedrawNeeded(plots=False))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter in the filter bar: back to the lines."""
        self.query_one("#log-body").focus()

    def action_filter(self) -> None:
        """Edit the filter."""
        self.query_one("#log-filter", Input).focus()

    def action_back(self) -> None:
        """From the filter bar to the lines; from the lines back to where it was opened."""
        if isinstance(self.focused, Input):
            self.query_one("#log-body").focus()
        else:
            self.dismiss()


def _counts(view: LogView, f: LogFilter) -> Text:
    t = Text()
    t.append(f"{len(view.lines)} shown", style="bold")
    if view.matched > len(view.lines):
        t.append(f" (newest of {view.matched} matching)")
    t.append(f"  ·  {view.kept} kept  ·  {view.total} received", style="dim")
    if view.dropped:
        ranks = ", ".join(f"rank {r}: {n}" for r, n in sorted(view.dropped.items())[:8])
        more = f" (+{len(view.dropped) - 8} ranks)" if len(view.dropped) > 8 else ""
        t.append(f"  ·  dropped by the agents: {ranks}{more}", style="bold yellow")
    if f.error:
        t.append(clean(f"\nfilter: {f.error}"), style="bold red")
    return t


def _lines(view: LogView) -> Text:
    if not view.total:
        return Text(view.hint, style="dim")
    if not view.lines:
        return Text(f"no line of the {view.kept} kept matches the filter", style="dim")
    t = Text()
    for i, line in enumerate(view.lines):
        if i:
            t.append("\n")
        t.append(f"{line.rank:>4} ", style="bold")
        t.append(f"{clean(line.source, one_line=True):<6} ",
                 style=SOURCE_STYLES.get(line.source, "dim"))
        style = "bold red" if " WARN " in line.text or "Error" in line.text else ""
        t.append(clean(line.text), style=style)  # as the rank wrote it: never markup
    return t
