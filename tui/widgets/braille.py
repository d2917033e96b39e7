"""Rasterising lines into braille cells (2 x 4 dots per terminal cell), in plain Python.

Each pixel column keeps the minimum and the maximum of the points that fall into it, so a plot
of a million steps shows the same spikes as one of a hundred; neighbouring columns are joined so
a line stays continuous. A lit pixel column is one run of rows (top..bottom), so a layer is
drawn by OR-ing precomputed runs of dots into the cells, never pixel by pixel. No textual
import: the widget in `plot.py` turns the codes into strips.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DOT_BITS = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))
"""Bit of the dot at (row dy 0..3, column dx 0..1) inside a braille cell (U+2800 + bits)."""
RUN_BITS = tuple(tuple(tuple(sum(DOT_BITS[dy][dx] for dy in range(a, b + 1)) for b in range(4))
                       for a in range(4)) for dx in range(2))
"""`RUN_BITS[dx][a][b]`: the bits of the dots of rows a..b (a <= b) in dot column dx."""
LOG_FLOOR = 1e-30
_INT_LIMIT = 2.0 ** 63
"""Beyond this a float has no machine-integer pixel (numpy's cast gives the minimum: row 0)."""


@dataclass
class Raster:
    """Braille codes and the palette index of the topmost layer per cell (-2 = empty), as
    rows of cells: `codes[row][col]`."""

    codes: list[list[int]]  # 0..255
    colors: list[list[int]]


def data_range(values: Iterable[Sequence[float]], log: bool = False
               ) -> tuple[float, float] | None:
    """(min, max) over finite values (positive ones on a log scale), padded when flat."""
    lo, hi = math.inf, -math.inf
    found = False
    for v in values:
        if not len(v):
            continue
        if math.isfinite(sum(v)):  # no NaN, no infinity: every value counts...
            v_lo, v_hi = min(v), max(v)
            if log and v_lo <= 0:  # ...but those <= 0 on a log scale
                kept = [a for a in v if a > 0]
                if not kept:
                    continue
                v_lo, v_hi = min(kept), max(kept)
        else:  # a - a == 0 only for a finite float (inf - inf and NaN are NaN)
            kept = [a for a in v if a - a == 0 and (a > 0 or not log)]
            if not kept:
                continue
            v_lo, v_hi = min(kept), max(kept)
        found = True
        lo, hi = min(lo, v_lo), max(hi, v_hi)
    if not found:
        return None
    if log:
        lo, hi = math.log10(max(lo, LOG_FLOOR)), math.log10(max(hi, LOG_FLOOR))
    if hi == lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    return lo, hi


def pixel_columns(x: Iterable[float], x0: float, x1: float, width: int) -> list[int]:
    """The pixel column (0..width-1) of each x on an axis from `x0` to `x1` (x1 > x0): its
    fraction of the width, truncated and clipped to the plot."""
    span = x1 - x0
    last = width - 1
    return [last if (f := (v - x0) / span * width) >= last else int(f) if f >= 1.0 else 0
            for v in x]


def column_envelope(x: Sequence[float], lo: Sequence[float], hi: Sequence[float], x0: float,
                    x1: float, width: int) -> tuple[list[float], list[float]]:
    """Per pixel column, the min of `lo` and the max of `hi` of the points in it (NaN where
    none, and where a value is NaN); `x` need not be sorted."""
    col_lo = [math.inf] * width
    col_hi = [-math.inf] * width
    if len(x):
        cols = [width - 1] * len(x) if x1 - x0 <= 0 else pixel_columns(x, x0, x1, width)
        if math.isfinite(sum(lo) + sum(hi)):  # no NaN to carry
            for c, a, b in zip(cols, lo, hi, strict=True):
                if a < col_lo[c]:
                    col_lo[c] = a
                if b > col_hi[c]:
                    col_hi[c] = b
        else:
            for c, a, b in zip(cols, lo, hi, strict=True):
                if a < col_lo[c] or a != a:  # NaN wins, as in numpy.minimum
                    col_lo[c] = a
                if b > col_hi[c] or b != b:
                    col_hi[c] = b
    for c in range(width):
        if col_lo[c] > col_hi[c]:
            col_lo[c] = col_hi[c] = math.nan
    return col_lo, col_hi


def interp(xs: Sequence[float], xp: Sequence[float], fp: Sequence[float]) -> list[float]:
    """Linear interpolation of the points (xp, fp) at `xs`, all sorted and inside
    xp[0]..xp[-1], computed as `numpy.interp` does."""
    out = []
    j = 0
    for x in xs:
        while xp[j + 1] < x:
            j += 1
        if x == xp[j + 1]:
            out.append(fp[j + 1])
            continue
        if x == xp[j]:
            out.append(fp[j])
            continue
        slope = (fp[j + 1] - fp[j]) / (xp[j + 1] - xp[j])
        y = slope * (x - xp[j]) + fp[j]
        if y != y:  # NaN one way: try the other
            y = slope * (x - xp[j + 1]) + fp[j + 1]
            if y != y and fp[j] == fp[j + 1]:
                y = fp[j]
        out.append(y)
    return out


def line_spans(col_lo: Sequence[float], col_hi: Sequence[float], y0: float, y1: float,
               height: int, log: bool = False, connect: bool = True
               ) -> tuple[list[int], list[int]]:
    """Per pixel column, the rows (top, bottom) lit, row 0 at the top; top > bottom where
    nothing is: each column lit from its max to its min; gaps between columns with data
    interpolated, and (when `connect`) neighbouring columns stretched to touch so the line
    has no holes."""
    width = len(col_lo)
    tops, bots = [1] * width, [0] * width
    present = [c for c, v in enumerate(col_lo) if math.isfinite(v)]
    if not present:
        return tops, bots
    lo, hi = list(col_lo), list(col_hi)
    if log:  # NaN stays NaN, as in numpy.maximum
        lo = [math.log10(LOG_FLOOR if v < LOG_FLOOR else v) for v in lo]
        hi = [math.log10(LOG_FLOOR if v < LOG_FLOOR else v) for v in hi]
    first, last = present[0], present[-1]
    missing = [c for c in range(first, last + 1) if not math.isfinite(lo[c])]
    if missing:
        mid = [(lo[c] + hi[c]) / 2 for c in present]
        filled = interp([float(c) for c in missing], [float(c) for c in present], mid)
        for c, v in zip(missing, filled, strict=True):
            lo[c] = hi[c] = v
    scale = (height - 1) / (y1 - y0) if y1 > y0 else 0.0
    bottom = height - 1
    limit = _INT_LIMIT
    prev_top = prev_bot = 0
    for c in range(first, last + 1):
        # a value's row: larger = higher = row 0; rounded half to even; clipped to the plot
        # (row 0 where the float has no integer, as numpy's cast gives)
        top = round(f) if -limit < (f := (y1 - hi[c]) * scale) < limit else 0
        top = 0 if top < 0 else bottom if top > bottom else top
        bot = round(f) if -limit < (f := (y1 - lo[c]) * scale) < limit else 0
        bot = 0 if bot < 0 else bottom if bot > bottom else bot
        tops[c], bots[c] = top, bot
        if connect and c > first:
            tops[c], bots[c] = min(top, prev_bot), max(bot, prev_top)
        prev_top, prev_bot = top, bot
    return tops, bots


def draw(codes: list[list[int]], colors: list[list[int]], tops: Sequence[int],
         bots: Sequence[int], color: int) -> None:
    """OR the lit pixel columns (rows tops[c]..bots[c] of pixel column c) into the braille
    cells, and give the cells touched the palette index `color`."""
    full = (RUN_BITS[0][0][3], RUN_BITS[1][0][3])
    for c, (top, bot) in enumerate(zip(tops, bots, strict=True)):
        if top > bot:
            continue
        cc, dx = c >> 1, c & 1
        runs = RUN_BITS[dx]
        r0, r1 = top >> 2, bot >> 2
        if r0 == r1:
            codes[r0][cc] |= runs[top & 3][bot & 3]
            colors[r0][cc] = color
            continue
        codes[r0][cc] |= runs[top & 3][3]
        colors[r0][cc] = color
        for r in range(r0 + 1, r1):
            codes[r][cc] |= full[dx]
            colors[r][cc] = color
        codes[r1][cc] |= runs[0][bot & 3]
        colors[r1][cc] = color


def pack(tops: Sequence[int], bots: Sequence[int], rows: int) -> list[list[int]]:
    """Lit pixel columns (4*rows pixels high, see `line_spans`) -> rows of braille codes."""
    codes = [[0] * ((len(tops) + 1) // 2) for _ in range(rows)]
    draw(codes, [row[:] for row in codes], tops, bots, 0)
    return codes


def rasterize(layers: Iterable[tuple[Sequence[float], Sequence[float], Sequence[float], int,
                                     bool]],
              rows: int, cols: int, x_range: tuple[float, float],
              y_range: tuple[float, float], log: bool = False) -> Raster:
    """Draw layers (x, lo, hi, color, band) in order; later layers are on top."""
    codes = [[0] * cols for _ in range(rows)]
    colors = [[-2] * cols for _ in range(rows)]
    for x, lo, hi, color, band in layers:
        col_lo, col_hi = column_envelope(x, lo, hi, x_range[0], x_range[1], cols * 2)
        tops, bots = line_spans(col_lo, col_hi, y_range[0], y_range[1], rows * 4, log,
                                connect=not band)
        draw(codes, colors, tops, bots, color)
    return Raster(codes, colors)


def tick(value: float, log: bool = False) -> str:
    """A short axis label: 3 significant digits, k/M/G for big values."""
    if log:
        value = 10.0 ** value
    a = abs(value)
    if a >= 1e9:
        return f"{value / 1e9:.3g}G"
    if a >= 1e6:
        return f"{value / 1e6:.3g}M"
    if a >= 1e4:
        return f"{value / 1e3:.3g}k"
    if a >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"
