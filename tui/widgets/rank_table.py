"""`RankTable`: one row per rank, drawn with the Line API.

Only the visible rows are drawn, each from a strip cached until that rank's cells change, so a
redraw of a 512-rank table costs about as much as one of 8 ranks. The header row stays at the
top and the rank column stays at the left while the rest scrolls. Up/down/PgUp/PgDn/Home/End
move the cursor, left/right scroll sideways, Enter or a click on the highlighted row (or a
double click) posts `RankTable.Selected`.
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from scalemon.display import NA
from scalemon.tui.safe_text import clean
from scalemon.tui.views import COLUMNS, Row

PAD = 1  # blank cells on each side of a column
ROW_STYLES = {
    "": Style(),
    "straggler": Style(color="yellow", bold=True),
    "lost": Style(color="red", bold=True),
    "exited": Style(color="red"),
    "stuck": Style(color="magenta", bold=True),
    "finished": Style(color="green"),
}
NA_STYLE = Style(dim=True)


class RankTable(ScrollView, can_focus=True):
    """The per-rank table of the overview."""

    BINDINGS = [
        Binding("up", "cursor(-1)", "Up", show=False),
        Binding("down", "cursor(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "cursor_to(0)", "First", show=False),
        Binding("end", "cursor_to(-1)", "Last", show=False),
        Binding("enter", "select", "Rank detail"),
    ]
    COMPONENT_CLASSES = {"ranktable--header", "ranktable--cursor"}
    DEFAULT_CSS = """
    RankTable { height: auto; max-height: 45%; }
    RankTable > .ranktable--header { text-style: bold; background: $panel; }
    RankTable > .ranktable--cursor { background: $block-cursor-background;
                                     color: $block-cursor-foreground; }
    """

    cursor: reactive[int] = reactive(0, always_update=True)

    class Selected(Message):
        """Enter or click on a rank's row."""

        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.rank_ids: list[int] = []
        self.rows: dict[int, Row] = {}  # latest formatted row of every rank shown so far
        self._strips: dict[int, tuple[tuple[str, tuple[str, ...]], Strip]] = {}
        self._widths = [c.width + 2 * PAD for c in COLUMNS]
        self._total = sum(self._widths)
        self.virtual_size = Size(self._total, 1)

    # ---- data ----------------------------------------------------------------------------

    def visible(self) -> tuple[int, int]:
        """(start, stop) positions of the rows on screen, for the model to format."""
        top = self.scroll_offset.y
        return top, top + max(self.size.height, self.app.size.height)  # before first layout

    def show_rows(self, rank_ids: list[int], rows: list[Row]) -> int:
        """Show every rank of `rank_ids`, with new text for `rows`; returns rows changed."""
        changed = 0
        if rank_ids != self.rank_ids:
            self.rank_ids = list(rank_ids)
            known = set(rank_ids)
            self.rows = {r: row for r, row in self.rows.items() if r in known}
            self._strips = {r: strip for r, strip in self._strips.items() if r in known}
            self.cursor = min(self.cursor, max(0, len(rank_ids) - 1))
            self.virtual_size = Size(self._total, len(rank_ids) + 1)
            changed = len(rank_ids)
        for row in rows:
            old = self.rows.get(row.rank)
            if old is None or old.cells != row.cells or old.style != row.style:
                self.rows[row.rank] = row
                changed += 1
        if changed:
            self.refresh()
        return changed

    def cells_by_rank(self) -> dict[int, tuple[str, ...]]:
        """The table as text (tests)."""
        return {rank: row.cells for rank, row in self.rows.items()}

    def rank_at_cursor(self) -> int | None:
        """The rank of the highlighted row."""
        return self.rank_ids[self.cursor] if 0 <= self.cursor < len(self.rank_ids) else None

    # ---- drawing -------------------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        """Line 0 is the header; the others are rows from the vertical scroll position."""
        width = self.size.width
        scroll_x, scroll_y = self.scroll_offset
        if y == 0:
            strip = self._header()
        else:
            index = y - 1 + scroll_y
            if index >= len(self.rank_ids):
                return Strip.blank(width, self.rich_style)
            strip = self._row_strip(index)
        fixed = self._widths[0]
        head = strip.crop(0, fixed)
        rest = strip.crop(fixed + scroll_x, fixed + scroll_x + max(0, width - fixed))
        return Strip.join([head, rest]).adjust_cell_length(width, self.rich_style)

    def _header(self) -> Strip:
        style = self.get_component_rich_style("ranktable--header")
        text = "".join(_pad(c.heading, c.width, not c.align_left) for c in COLUMNS)
        return Strip([Segment(text, style)], self._total)

    def _row_strip(self, index: int) -> Strip:
        rank = self.rank_ids[index]
        row = self.rows.get(rank)
        if row is None:  # not formatted yet: the next redraw brings it
            row = Row(rank, (str(rank),) + ("",) * (len(COLUMNS) - 1), "")
        key = (row.style + ("*" if index == self.cursor else ""), row.cells)
        cached = self._strips.get(row.rank)
        if cached is not None and cached[0] == key:
            return cached[1]
        base = ROW_STYLES.get(row.style, Style())
        if index == self.cursor:
            base = base + self.get_component_rich_style("ranktable--cursor")
        segments = []
        for column, text in zip(COLUMNS, row.cells, strict=True):
            style = base + NA_STYLE if text == NA else base
            segments.append(Segment(_pad(text, column.width, not column.align_left), style))
        strip = Strip(segments, self._total)
        self._strips[row.rank] = (key, strip)
        return strip

    # ---- cursor and selection ------------------------------------------------------------

    def watch_scroll_y(self, old: float, new: float) -> None:
        """Rows that scrolled into view need their text: redraw soon."""
        super().watch_scroll_y(old, new)
        self.post_message(self.Scrolled())

    class Scrolled(Message):
        """The visible rows changed."""

    def watch_cursor(self, old: int, new: int) -> None:
        """Repaint, and bring the cursor row into view after the refresh: a scroll now would
        be clamped to the size laid out before (before the first layout, or right after new
        ranks arrived, to the top), and nothing would scroll again."""
        self.refresh()
        self.call_after_refresh(self.scroll_to_cursor)

    def on_resize(self) -> None:
        """A new height may hide the cursor row."""
        self.call_after_refresh(self.scroll_to_cursor)

    def scroll_to_cursor(self) -> None:
        """Scroll the least that shows the cursor row below the header."""
        visible = max(1, self.scrollable_content_region.height - 1)
        top = self.scroll_offset.y
        if self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False)
        elif self.cursor >= top + visible:
            self.scroll_to(y=self.cursor - visible + 1, animate=False)

    def action_cursor(self, delta: int) -> None:
        """Move the cursor."""
        if self.rank_ids:
            self.cursor = max(0, min(len(self.rank_ids) - 1, self.cursor + delta))

    def action_page(self, direction: int) -> None:
        """Move the cursor by a screenful."""
        self.action_cursor(direction * max(1, self.scrollable_content_region.height - 2))

    def action_cursor_to(self, index: int) -> None:
        """First (0) or last (-1) row."""
        if self.rank_ids:
            self.cursor = index % len(self.rank_ids)

    def action_select(self) -> None:
        """Open the highlighted rank."""
        rank = self.rank_at_cursor()
        if rank is not None:
            self.post_message(self.Selected(rank))

    def on_click(self, event: events.Click) -> None:
        """A click moves the cursor; on the highlighted row (or a double click) it selects."""
        if event.y < 1:
            return
        index = event.y - 1 + self.scroll_offset.y
        if not 0 <= index < len(self.rank_ids):
            return
        if index == self.cursor or event.chain >= 2:
            self.cursor = index
            self.action_select()
        else:
            self.cursor = index


def _pad(text: str, width: int, right: bool) -> str:
    """A cell `width` wide; what a rank sent (a host) may hold control characters: made
    harmless, as segments go to the terminal as they are."""
    text = clean(text, one_line=True)[:width]
    return " " * PAD + (text.rjust(width) if right else text.ljust(width)) + " " * PAD
