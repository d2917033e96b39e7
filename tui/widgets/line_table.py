"""`LineTable`: rows of text cells under a fixed heading, drawn with the Line API (the rank
table and the node table).

Only the visible rows are drawn, each from a strip cached until its cells change, so a redraw
of a 512-row table costs about as much as one of 8. The heading stays at the top and the first
column at the left while the rest scrolls, a whole column at a time: a column that does
not fit is left out, never cut (an arrow at the end of the heading says more columns are off to
that side), and there is no horizontal scroll bar. Up/down/PgUp/PgDn/Home/End move the cursor,
left/right scroll sideways, Enter or a click on the highlighted row (or a double click) selects
the row (`selected`, which a subclass turns into its message).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Generic, Protocol, TypeVar

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from scalemon.text.display import NA, Column

from ..safe_text import clean

PAD = 1  # blank cells on each side of a column
ROW_STYLES = {
    "": Style(),
    "straggler": Style(color="yellow", bold=True),
    # a rank that stopped sending, by the hub's word: frozen (its process exists: the job hangs
    # on it) white on purple, apart from the stuck style and from an alert's white on red (a
    # 256-colour purple: themes map ANSI magenta to red); gone (its process ended); unreachable
    # and silent (taken for ended: nothing could look at its process) in italics
    "frozen": Style(color="bright_white", bgcolor="dark_magenta", bold=True),
    "gone": Style(color="red", bold=True),
    "unreachable": Style(color="red", bold=True, italic=True),
    "silent": Style(color="red", bold=True, italic=True),
    "exited": Style(color="red"),
    "stuck": Style(color="magenta", bold=True),
    "finished": Style(color="green"),
    "stopped": Style(color="cyan"),
    "alert": Style(color="white", bgcolor="red", bold=True),
    "heading": Style(color="cyan", bold=True, underline=True),
}
NA_STYLE = Style(dim=True)

K = TypeVar("K", bound=Hashable)


class TableRow(Protocol):
    """What a table shows of a row: its cells (in column order) and a `ROW_STYLES` key."""

    @property
    def cells(self) -> tuple[str, ...]: ...

    @property
    def style(self) -> str: ...


class LineTable(ScrollView, Generic[K], can_focus=True):
    """A table of `columns` with a row per key; a subclass names its component classes
    (`HEADER`, `CURSOR`), how the heading reads (`header_texts`) and what a selection posts
    (`selected`)."""

    BINDINGS = [
        Binding("up", "cursor(-1)", "Up", show=False),
        Binding("down", "cursor(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "cursor_to(0)", "First", show=False),
        Binding("end", "cursor_to(-1)", "Last", show=False),
    ]
    DEFAULT_CSS = """
    LineTable { scrollbar-size-horizontal: 0; }
    """
    HEADER = ""
    CURSOR = ""
    FOLLOW = False
    """Keep the cursor on its row's key when the rows are reordered (else on its position)."""

    cursor: reactive[int] = reactive(0, always_update=True)

    class Scrolled(Message):
        """The visible rows changed."""

    def __init__(self, columns: tuple[Column, ...], *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.keys: list[K] = []
        self.rows: dict[K, TableRow] = {}  # latest formatted row of every key shown so far
        self._strips: dict[K, tuple[tuple[str, tuple[str, ...]], Strip]] = {}
        self._set_columns(columns)

    def _set_columns(self, columns: tuple[Column, ...]) -> None:
        self.columns = columns
        self._widths = [c.width + 2 * PAD for c in columns]
        self._total = sum(self._widths)
        self._head = self.header_texts()
        self.virtual_size = Size(self._total, len(self.keys) + len(self._head))

    def set_columns(self, columns: tuple[Column, ...]) -> bool:
        """Show `columns` from now on (a column that comes and goes); the rows shown so far
        are dropped until the next `show_keys` brings them in the new columns. True when the
        columns changed."""
        if columns == self.columns:
            return False
        self.rows, self._strips = {}, {}
        self._set_columns(columns)
        self.refresh()
        return True

    # ---- for subclasses ------------------------------------------------------------------

    def header_texts(self) -> list[str]:
        """The heading lines (one: each column's heading)."""
        return ["".join(_pad(c.heading, c.width, not c.align_left) for c in self.columns)]

    def placeholder(self, key: K) -> tuple[str, ...]:
        """The cells of a row not formatted yet (the next redraw brings it)."""
        return (str(key),) + ("",) * (len(self.columns) - 1)

    def selected(self, key: K) -> None:
        """Enter or a click on the row of `key`."""

    # ---- data ----------------------------------------------------------------------------

    def visible(self) -> tuple[int, int]:
        """(start, stop) positions of the rows on screen, for the model to format."""
        top = self.scroll_offset.y
        return top, top + max(self.size.height, self.app.size.height)  # before first layout

    def show_keys(self, keys: Sequence[K], rows: dict[K, TableRow]) -> int:
        """Show a row per key of `keys`, with new text for those in `rows`; returns rows
        changed."""
        changed = 0
        if list(keys) != self.keys:
            at_cursor = self.key_at_cursor()
            self.keys = list(keys)
            known = set(keys)
            self.rows = {k: row for k, row in self.rows.items() if k in known}
            self._strips = {k: strip for k, strip in self._strips.items() if k in known}
            cursor = min(self.cursor, max(0, len(keys) - 1))
            if self.FOLLOW and at_cursor in known:
                cursor = self.keys.index(at_cursor)  # type: ignore[arg-type]
            self.cursor = cursor  # and into view once laid out (`watch_cursor`)
            self.virtual_size = Size(self._total, len(keys) + len(self._head))
            changed = len(keys)
        for key, row in rows.items():
            old = self.rows.get(key)
            if old is None or old.cells != row.cells or old.style != row.style:
                self.rows[key] = row
                changed += 1
        if changed:
            self.refresh()
        return changed

    def key_at_cursor(self) -> K | None:
        """The key of the highlighted row."""
        return self.keys[self.cursor] if 0 <= self.cursor < len(self.keys) else None

    # ---- drawing -------------------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        """The heading lines, then the rows from the vertical scroll position."""
        width = self.scrollable_content_region.width  # not under the vertical scroll bar
        scroll_x, scroll_y = self.scroll_offset
        if y < len(self._head):
            strip = Strip([Segment(self._head[y], self.get_component_rich_style(self.HEADER))],
                          self._total)
        else:
            index = y - len(self._head) + scroll_y
            if index >= len(self.keys):
                return Strip.blank(width, self.rich_style)
            strip = self._row_strip(index)
        fixed = self._widths[0]
        start, stop, more = self._window(scroll_x, width - fixed)
        line = Strip.join([strip.crop(0, fixed), strip.crop(fixed + start, fixed + stop)])
        line = line.adjust_cell_length(width, self.rich_style)
        if y == len(self._head) - 1 and width > fixed + 1:  # columns left out: an arrow
            style = self.get_component_rich_style(self.HEADER)
            if start > 0:
                line = Strip.join([line.crop(0, fixed), Strip([Segment("←", style)], 1),
                                   line.crop(fixed + 1, width)])
            if more:
                line = Strip.join([line.crop(0, width - 1), Strip([Segment("→", style)], 1)])
        return line

    def _starts(self) -> list[int]:
        """Where each scrolled column (all but the first) starts, in cells after the first."""
        starts, x = [], 0
        for w in self._widths[1:]:
            starts.append(x)
            x += w
        return starts

    def _window(self, scroll_x: int, room: int) -> tuple[int, int, bool]:
        """The cells of the scrolled part drawn at `scroll_x`: from the first column starting
        there or after, whole columns while they fit in `room`; and whether columns to the
        right are left out."""
        start: int | None = None
        for x, w in zip(self._starts(), self._widths[1:], strict=True):
            if start is None and x >= scroll_x:
                start = x
            if start is not None and x + w - start > room:
                return start, x, True
        end = self._total - self._widths[0]
        return (end if start is None else start), end, False

    def _row_strip(self, index: int) -> Strip:
        key = self.keys[index]
        row = self.rows.get(key)
        cells, style = (row.cells, row.style) if row is not None else (self.placeholder(key), "")
        cache_key = (style + ("*" if index == self.cursor else ""), cells)
        cached = self._strips.get(key)
        if cached is not None and cached[0] == cache_key:
            return cached[1]
        base = ROW_STYLES.get(style, Style())
        if index == self.cursor:
            base = base + self.get_component_rich_style(self.CURSOR)
        segments = []
        for column, text in zip(self.columns, cells, strict=True):
            cell_style = base + NA_STYLE if text == NA else base
            segments.append(Segment(_pad(text, column.width, not column.align_left),
                                    cell_style))
        strip = Strip(segments, self._total)
        if row is not None:
            self._strips[key] = (cache_key, strip)
        return strip

    # ---- cursor and selection ------------------------------------------------------------

    def watch_scroll_y(self, old: float, new: float) -> None:
        """Rows that scrolled into view need their text: redraw soon."""
        super().watch_scroll_y(old, new)
        self.post_message(self.Scrolled())

    def watch_cursor(self, old: int, new: int) -> None:
        """Repaint, and bring the cursor row into view after the refresh: a scroll now would
        be clamped to the size laid out before (before the first layout, or right after new
        rows arrived, to the top), and nothing would scroll again."""
        self.refresh()
        self.call_after_refresh(self.scroll_to_cursor)

    def on_resize(self) -> None:
        """A new height may hide the cursor row."""
        self.call_after_refresh(self.scroll_to_cursor)

    def scroll_to_cursor(self) -> None:
        """Scroll the least that shows the cursor row below the heading."""
        visible = max(1, self.scrollable_content_region.height - len(self._head))
        top = self.scroll_offset.y
        if self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False)
        elif self.cursor >= top + visible:
            self.scroll_to(y=self.cursor - visible + 1, animate=False)

    def action_scroll_right(self) -> None:
        """The next column into view on the right (a whole column at a time)."""
        x = round(self.scroll_x)
        after = [s for s in self._starts() if s > x]
        if after and x < self.max_scroll_x:
            self.scroll_to(x=min(after[0], self.max_scroll_x), animate=False)

    def action_scroll_left(self) -> None:
        """The previous column into view on the left."""
        x = round(self.scroll_x)
        self.scroll_to(x=max((s for s in self._starts() if s < x), default=0), animate=False)

    def action_cursor(self, delta: int) -> None:
        """Move the cursor."""
        if self.keys:
            self.cursor = max(0, min(len(self.keys) - 1, self.cursor + delta))

    def action_page(self, direction: int) -> None:
        """Move the cursor by a screenful."""
        self.action_cursor(direction * max(1, self.scrollable_content_region.height
                                           - len(self._head) - 1))

    def action_cursor_to(self, index: int) -> None:
        """First (0) or last (-1) row."""
        if self.keys:
            self.cursor = index % len(self.keys)

    def action_select(self) -> None:
        """Select the highlighted row."""
        if 0 <= self.cursor < len(self.keys):
            self.selected(self.keys[self.cursor])

    def on_click(self, event: events.Click) -> None:
        """A click moves the cursor; on the highlighted row (or a double click) it selects."""
        if event.y < len(self._head):
            return
        index = event.y - len(self._head) + self.scroll_offset.y
        if not 0 <= index < len(self.keys):
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
