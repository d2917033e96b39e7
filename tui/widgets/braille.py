"""Rasterising lines into braille cells (2 x 4 dots per terminal cell) with numpy.

Each pixel column keeps the minimum and the maximum of the points that fall into it, so a plot
of a million steps shows the same spikes as one of a hundred; neighbouring columns are joined so
a line stays continuous. No textual import: the widget in `plot.py` turns the codes into strips.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# bit of the dot at (row dy 0..3, column dx 0..1) inside a braille cell (U+2800 + bits)
DOT_BITS = np.array([[0x01, 0x08], [0x02, 0x10], [0x04, 0x20], [0x40, 0x80]], dtype=np.uint16)
LOG_FLOOR = 1e-30


@dataclass
class Raster:
    """Braille codes and the palette index of the topmost layer per cell (-2 = empty)."""

    codes: np.ndarray  # (rows, cols) int, 0..255
    colors: np.ndarray  # (rows, cols) int


def data_range(values: list[np.ndarray], log: bool = False) -> tuple[float, float] | None:
    """(min, max) over finite values (positive ones on a log scale), padded when flat."""
    parts = [v[np.isfinite(v) & ((v > 0) if log else True)] for v in values if len(v)]
    parts = [p for p in parts if len(p)]
    if not parts:
        return None
    lo = float(min(p.min() for p in parts))
    hi = float(max(p.max() for p in parts))
    if log:
        lo, hi = math.log10(max(lo, LOG_FLOOR)), math.log10(max(hi, LOG_FLOOR))
    if hi == lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    return lo, hi


def column_envelope(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, x0: float, x1: float,
                    width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per pixel column, the min of `lo` and the max of `hi` of the points in it (NaN where
    none); `x` need not be sorted."""
    col_lo = np.full(width, np.inf)
    col_hi = np.full(width, -np.inf)
    if len(x):
        span = x1 - x0
        cols = (np.zeros(len(x), dtype=np.intp) + (width - 1) if span <= 0 else
                np.clip(((x - x0) / span * width).astype(np.intp), 0, width - 1))
        np.minimum.at(col_lo, cols, lo)
        np.maximum.at(col_hi, cols, hi)
    empty = col_lo > col_hi
    col_lo[empty] = np.nan
    col_hi[empty] = np.nan
    return col_lo, col_hi


def line_mask(col_lo: np.ndarray, col_hi: np.ndarray, y0: float, y1: float, height: int,
              log: bool = False, connect: bool = True) -> np.ndarray:
    """A (height, width) boolean pixel mask, row 0 at the top: each column lit from its min to
    its max; gaps between columns with data interpolated, and (when `connect`) neighbouring
    columns stretched to touch so the line has no holes."""
    width = len(col_lo)
    mask = np.zeros((height, width), dtype=bool)
    present = np.flatnonzero(np.isfinite(col_lo))
    if not len(present):
        return mask
    lo, hi = col_lo.copy(), col_hi.copy()
    if log:
        lo = np.log10(np.maximum(lo, LOG_FLOOR))
        hi = np.log10(np.maximum(hi, LOG_FLOOR))
    first, last = present[0], present[-1]
    span = np.arange(first, last + 1)
    missing = span[~np.isfinite(lo[span])]
    if len(missing):
        mid = (lo[present] + hi[present]) / 2
        lo[missing] = hi[missing] = np.interp(missing, present, mid)
    scale = (height - 1) / (y1 - y0) if y1 > y0 else 0.0
    top = np.rint((y1 - hi[span]) * scale).astype(np.intp)  # larger value = higher = row 0
    bot = np.rint((y1 - lo[span]) * scale).astype(np.intp)
    top, bot = np.clip(top, 0, height - 1), np.clip(bot, 0, height - 1)
    if connect and len(span) > 1:
        prev_top, prev_bot = top[:-1].copy(), bot[:-1].copy()
        top[1:] = np.minimum(top[1:], prev_bot)
        bot[1:] = np.maximum(bot[1:], prev_top)
    rows = np.arange(height)[:, None]
    mask[:, first:last + 1] = (rows >= top[None, :]) & (rows <= bot[None, :])
    return mask


def pack(mask: np.ndarray) -> np.ndarray:
    """(4*rows, 2*cols) pixels -> (rows, cols) braille bit codes."""
    h, w = mask.shape
    cells = mask.reshape(h // 4, 4, w // 2, 2)
    return (cells * DOT_BITS[None, :, None, :]).sum(axis=(1, 3)).astype(np.intp)


def rasterize(layers: list[tuple[np.ndarray, np.ndarray, np.ndarray, int, bool]],
              rows: int, cols: int, x_range: tuple[float, float],
              y_range: tuple[float, float], log: bool = False) -> Raster:
    """Draw layers (x, lo, hi, color, band) in order; later layers are on top."""
    codes = np.zeros((rows, cols), dtype=np.intp)
    colors = np.full((rows, cols), -2, dtype=np.intp)
    for x, lo, hi, color, band in layers:
        col_lo, col_hi = column_envelope(x, lo, hi, x_range[0], x_range[1], cols * 2)
        layer = pack(line_mask(col_lo, col_hi, y_range[0], y_range[1], rows * 4, log,
                               connect=not band))
        codes |= layer
        colors[layer > 0] = color
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
