"""`LinePlot`: a braille line plot that redraws only when its data or size changed.

Layout inside the widget: a title row with the legend, plot rows with y labels in a left
gutter, and an x-axis row (first and last step, skipped-step marks). The rendered rows are
cached, so a repaint without new data costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

from ..plotdata import PlotSpec
from ..safe_text import clean
from .braille import data_range, pixel_columns, rasterize, tick

PALETTE = ("#4fc3f7", "#ffb74d", "#81c784", "#e57373", "#ba68c8", "#fff176", "#90a4ae",
           "#f06292")
BAND = "#3d5a80"
GUTTER = 7
MARK = "▲"


def color_of(index: int) -> str:
    """Palette colour for a line (-1 is the min..max band)."""
    return BAND if index < 0 else PALETTE[index % len(PALETTE)]


class LinePlot(Widget):
    """A titled braille plot of a `PlotSpec`."""

    DEFAULT_CSS = """
    LinePlot { height: 1fr; min-height: 4; padding: 0 1 0 0; }
    """

    def __init__(self, spec: PlotSpec | None = None, *, name: str | None = None,
                 id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.spec = spec or PlotSpec("")
        self._cache: list[Strip] | None = None
        self._cache_key: tuple[int, int] | None = None

    def update_spec(self, spec: PlotSpec) -> None:
        """Show new data (the rows are rebuilt on the next paint)."""
        self.spec = spec
        self._cache = None
        self.refresh()

    def text_rows(self) -> list[str]:
        """The plot as plain text rows (for tests)."""
        return [strip.text for strip in self._rows(self.size.width, self.size.height)]

    def render_line(self, y: int) -> Strip:
        """One row of the cached rendering."""
        rows = self._rows(self.size.width, self.size.height)
        return rows[y] if y < len(rows) else Strip.blank(self.size.width)

    def _rows(self, width: int, height: int) -> list[Strip]:
        key = (width, height)
        if self._cache is None or self._cache_key != key:
            self._cache = self._build(width, height)
            self._cache_key = key
        return self._cache

    def _build(self, width: int, height: int) -> list[Strip]:
        spec = self.spec
        axis = Style(color="grey50")
        rows: list[Strip] = [self._title_row(width)]
        plot_rows = height - 2
        plot_cols = width - GUTTER
        if plot_rows < 1 or plot_cols < 4:
            return rows + [Strip.blank(width)] * max(0, height - 1)
        xs = [line.x for line in spec.lines if len(line.x)]
        y_range = data_range([v for line in spec.lines for v in (line.lo, line.hi)], spec.log)
        if not xs or y_range is None:
            message = clean(spec.empty, one_line=True)[: plot_cols].center(plot_cols)
            blank = Strip([Segment(" " * width)], width)
            middle = plot_rows // 2
            for r in range(plot_rows):
                rows.append(Strip([Segment(" " * GUTTER), Segment(message, axis)], width)
                            .crop(0, width) if r == middle else blank)
            rows.append(blank)
            return [row.adjust_cell_length(width) for row in rows]
        x0 = float(min(min(x) for x in xs))
        x1 = float(max(max(x) for x in xs))
        raster = rasterize([(line.x, line.lo, line.hi, line.color, line.band)
                            for line in spec.lines], plot_rows, plot_cols, (x0, x1), y_range,
                           spec.log)
        labels = {0: tick(y_range[1], spec.log), plot_rows - 1: tick(y_range[0], spec.log)}
        if plot_rows >= 5:
            labels[plot_rows // 2] = tick((y_range[0] + y_range[1]) / 2, spec.log)
        for r in range(plot_rows):
            segments = [Segment(labels.get(r, "")[: GUTTER - 1].rjust(GUTTER - 1) + "│", axis)]
            segments.extend(_cells(raster.codes[r], raster.colors[r]))
            rows.append(Strip(segments, width))
        rows.append(self._axis_row(width, plot_cols, x0, x1, axis))
        return [row.adjust_cell_length(width) for row in rows]

    def _title_row(self, width: int) -> Strip:
        """Title, legend and marks; names may be a rank's (`log(**extra)`): segments go to the
        terminal as they are, so control characters are made harmless."""
        spec = self.spec
        title = clean(spec.title + (f" ({spec.unit})" if spec.unit else ""), one_line=True)
        segments = [Segment(title, Style(bold=True))]
        if len(spec.lines) > 1 or (spec.lines and spec.lines[0].band):
            for line in spec.lines:
                segments.append(Segment(" "))
                segments.append(Segment("█" if line.band else "━", Style(color=color_of(
                    line.color))))
                segments.append(Segment(clean(line.label, one_line=True)))
        if spec.marks is not None and len(spec.marks):
            segments.append(Segment(" "))
            segments.append(Segment(MARK, Style(color="red")))
            segments.append(Segment(clean(spec.marks_label, one_line=True)))
        return Strip(segments).crop(0, width).adjust_cell_length(width)

    def _axis_row(self, width: int, plot_cols: int, x0: float, x1: float, axis: Style) -> Strip:
        chars = ["─"] * plot_cols
        marks = self.spec.marks
        if marks is not None and len(marks):
            span = x1 - x0
            cols = [0] * len(marks) if span <= 0 else pixel_columns(marks, x0, x1, plot_cols)
            for c in set(cols):
                chars[c] = MARK
        left, right = f" {x0:.0f}", f"step {x1:.0f}"
        for i, ch in enumerate(left[: plot_cols]):
            chars[i] = ch
        for i, ch in enumerate(right[-plot_cols:]):
            chars[plot_cols - len(right[-plot_cols:]) + i] = ch
        segments = [Segment(" " * (GUTTER - 1) + "└", axis)]
        for ch in chars:
            style = Style(color="red") if ch == MARK else axis
            if segments and segments[-1].style == style:
                segments[-1] = Segment(segments[-1].text + ch, style)
            else:
                segments.append(Segment(ch, style))
        return Strip(segments, width)


def _cells(codes: Sequence[int], colors: Sequence[int]) -> list[Segment]:
    """Runs of same-coloured braille cells as segments."""
    out: list[Segment] = []
    text: list[str] = []
    current = None
    for code, color in zip(codes, colors, strict=True):
        if color != current and text:
            out.append(Segment("".join(text), _style(current)))
            text = []
        current = color
        text.append(chr(0x2800 + code) if code else " ")
    if text:
        out.append(Segment("".join(text), _style(current)))
    return out


def _style(color: int | None) -> Style | None:
    if color is None or color == -2:
        return None
    return Style(color=color_of(color))
