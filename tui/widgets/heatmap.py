"""`HeatMap`: arrival lateness as a rank x time grid of shaded cells, with its scale.

Drawn with the Line API: only the rows on screen are built, each from runs of equal shades, so
512 ranks cost about what 8 do.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

from rich.console import Console
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.events import Resize
from textual.geometry import Size
from textual.strip import Strip
from textual.widget import Widget

from scalemon.text.display import LATE, shown, unit

from ..messages import RedrawNeeded
from ..views.collectives import Heat

SHADES = ("#264653", "#2a6f73", "#2a9d8f", "#8ab17d", "#e9c46a", "#f4a261", "#e76f51",
          "#d62828")
"""From on time (the first rank, or within 1/8 of the scale) to the latest."""
LABEL = 6
"""Columns of the rank labels at the left."""
CELL = "█"
NONE = "·"
HEAD = 2
"""Lines above the grid: the title, the scale."""
_SHADE_STYLES = [Style(color=c) for c in SHADES]
_NONE_STYLE = Style(color="grey30")
_DIM = Style(dim=True)
_CONSOLE = Console(width=1 << 16, color_system=None, file=io.StringIO())
"""Only measures and wraps text (the head): never prints."""


def levels(row: Sequence[float], top: float) -> list[int]:
    """The shade index of each cell of a row (-1: no collective there)."""
    out = []
    for value in row:
        if not math.isfinite(value):
            out.append(-1)
        else:
            out.append(min(len(SHADES) - 1, max(0, int(value / top * len(SHADES)))))
    return out


def head_text(heat: Heat | None, width: int = 1 << 16) -> list[Text]:
    """The title and the scale, wrapped to `width` (one line saying why when there is
    nothing); the scale breaks between its entries, never inside one."""
    if heat is None:
        return list(Text("no collective issued by every rank of a group yet: nothing to shade",
                         style="dim").wrap(_CONSOLE, max(1, width)))
    columns = heat.columns
    span = heat.t1 - heat.t0
    title = Text.assemble(("arrival lateness by rank", "bold"),
                          (" (after the first rank to issue each collective)", "dim"))
    if heat.of_ranks > len(heat.ranks):
        title.append(f"; the {len(heat.ranks)} latest of {heat.of_ranks:,} ranks", "bold")
    step = heat.top / len(SHADES)
    entries = [Text.assemble((CELL * 2, shade), (f" {shown(LATE, i * step):.3g}", "dim"))
               for i, shade in enumerate(SHADES)]
    entries += [Text(f"to {shown(LATE, heat.top):.3g};", style="dim"),
                Text(f"{NONE} none;", style="dim"),
                Text(f"column = {span / columns:.2g} s", style="dim")]
    lines = [Text(unit(LATE).rjust(LABEL - 1), style="dim")]
    for entry in entries:
        if lines[-1].cell_len + 2 + entry.cell_len > width and lines[-1].cell_len > LABEL:
            lines.append(Text(" " * LABEL))
        else:
            lines[-1].append("  " if lines[-1].cell_len >= LABEL else " ")
        lines[-1].append_text(entry)
    return [*title.wrap(_CONSOLE, max(1, width)), *lines]


def axis_text(heat: Heat) -> str:
    """The time axis under the grid."""
    span = heat.t1 - heat.t0
    columns = heat.columns
    axis = f"-{span:.0f} s" if span >= 1 else f"-{span:.2f} s"
    return " " * LABEL + axis.ljust(max(len(axis), columns * heat.repeat - 6)) + "latest"


class HeatMap(Widget):
    """The heat map of the collectives screen; as wide as its container, one row per rank."""

    DEFAULT_CSS = """
    HeatMap { height: auto; padding: 0 1; }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.heat: Heat | None = None
        self._head: list[Text] = head_text(None)
        self._head_width = 0  # the width `_head` is wrapped to
        self._rows: dict[int, Strip] = {}  # built on demand, per shown heat map
        self._columns = 0  # the width last asked for

    def columns(self) -> int:
        """How many time columns fit (the screen bins the samples into that many)."""
        width = self.content_region.width or self.app.size.width - 2
        self._columns = max(4, width - LABEL)
        return self._columns

    def on_resize(self, event: Resize) -> None:
        """Another width: ask for a heat map binned to it."""
        if self._columns and max(4, self.content_region.width - LABEL) != self._columns:
            self.post_message(RedrawNeeded())

    def show(self, heat: Heat | None) -> None:
        """Draw a new heat map."""
        self.heat = heat
        self._head_width = self.content_region.width or self.app.size.width - 2
        self._head = head_text(heat, self._head_width)
        self._rows = {}
        self.refresh(layout=True)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        """Title, scale, a row per rank, the axis."""
        if width and width != self._head_width:
            self._head_width = width
            self._head = head_text(self.heat, width)
        return len(self._head) + (len(self.heat.ranks) + 1 if self.heat is not None else 0)

    def text_rows(self) -> list[str]:
        """The whole map as plain text (tests)."""
        return [self._line(y).text for y in range(self.get_content_height(
            Size(0, 0), Size(0, 0), 0))]

    def render_line(self, y: int) -> Strip:
        """One line: the head, a rank's row or the axis, over the widget's background."""
        base = self.rich_style
        return self._line(y).apply_style(base).adjust_cell_length(
            self.content_region.width or 0, base)

    def _line(self, y: int) -> Strip:
        heat = self.heat
        if y < len(self._head):
            return Strip(self._head[y].render(self.app.console))
        if heat is None:
            return Strip([])
        row = y - len(self._head)
        if row >= len(heat.ranks):
            return Strip([Segment(axis_text(heat), _DIM)])
        strip = self._rows.get(row)
        if strip is None:
            strip = self._rows[row] = self._row_strip(heat, row)
        return strip

    @staticmethod
    def _row_strip(heat: Heat, row: int) -> Strip:
        segments = [Segment(f"{heat.ranks[row]:>{LABEL - 1}} ", _DIM)]
        shades = levels(heat.cells[row], heat.top)
        start = 0
        for i in range(1, len(shades) + 1):  # runs of one shade: one segment each
            if i == len(shades) or shades[i] != shades[start]:
                level = shades[start]
                text = (CELL if level >= 0 else NONE) * ((i - start) * heat.repeat)
                segments.append(Segment(text, _SHADE_STYLES[level] if level >= 0
                                        else _NONE_STYLE))
                start = i
        return Strip(segments)
