"""What a plot shows, as plain data: built by the model under its lock, drawn by the widget."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from scalemon.state.series import Series


@dataclass
class Line:
    """One series: a line through (x, lo..hi), or a filled min..max band when `band`; the
    coordinates are float sequences of one length (`array('d')` from a series)."""

    label: str
    x: Sequence[float]
    lo: Sequence[float]
    hi: Sequence[float]
    color: int = 0  # index into the widget's palette
    band: bool = False

    @classmethod
    def from_series(cls, label: str, series: Series | None, color: int = 0, *,
                    band: bool = False, mean: bool = False, scale: float = 1.0) -> Line | None:
        """A line from a series' buckets: their envelope, or their means when `mean`; values
        times `scale` (a metric's display scale: seconds to ms, bytes to GiB)."""
        if series is None or len(series) == 0:
            return None
        x, lo, hi, avg = series.arrays()
        if mean:
            lo = hi = avg
        if scale != 1.0:
            lo, hi = scaled(lo, scale), scaled(hi, scale)
        return cls(label, x, lo, hi, color, band)


@dataclass
class PlotSpec:
    """Everything one plot panel draws. `empty` is the text shown when there is no data."""

    title: str
    unit: str = ""
    lines: list[Line] = field(default_factory=list)
    log: bool = False
    marks: Sequence[float] | None = None  # x positions to flag (skipped steps)
    marks_label: str = ""
    empty: str = "no data yet"
    hidden: bool = False  # not drawn at all (a metric shown only when seen, not seen)

    @property
    def has_data(self) -> bool:
        """True when at least one line has a point."""
        return any(len(line.x) for line in self.lines)


def scaled(values: Sequence[float], scale: float) -> array:
    """`values` times `scale`, as a new float64 array."""
    return array("d", [v * scale for v in values])
