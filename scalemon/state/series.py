"""Bounded time series that keep the envelope of the data: every point is a bucket with the
minimum, maximum and mean of the raw values it stands for.

When a series reaches its capacity, neighbouring buckets merge pairwise and each new bucket
covers twice as many raw points, so memory stays fixed while the whole run stays visible at
even density, and a spike is never averaged away (a plot draws each pixel column from its
minimum to its maximum).
"""

from __future__ import annotations

import math
from array import array

DEFAULT_CAP = 512


class Series:
    """Points (x, lo, hi, mean) in arrival order; at most `cap` buckets plus one filling.
    A bucket's x is the mean x of its raw points."""

    __slots__ = ("cap", "stride", "xs", "lo", "hi", "mean", "_px", "_plo", "_phi", "_psum", "_pn")

    def __init__(self, cap: int = DEFAULT_CAP) -> None:
        if cap < 2 or cap % 2:
            raise ValueError(f"cap must be an even number >= 2, not {cap}")
        self.cap = cap
        self.stride = 1  # raw points per bucket
        self.xs = array("d")
        self.lo = array("f")
        self.hi = array("f")
        self.mean = array("f")
        self._px = 0.0
        self._plo = self._phi = self._psum = 0.0
        self._pn = 0

    def __len__(self) -> int:
        """Number of buckets, the one still filling included."""
        return len(self.xs) + (1 if self._pn else 0)

    def add(self, x: float, value: float, hi: float | None = None, mean: float | None = None
            ) -> None:
        """Add a raw point (or an already aggregated one: `value` = min, `hi`, `mean`).
        Non-finite values are ignored: they cannot be drawn."""
        lo = value
        hi = value if hi is None else hi
        mean = value if mean is None else mean
        if not (math.isfinite(lo) and math.isfinite(hi) and math.isfinite(mean)):
            return
        if self._pn == 0:
            self._px, self._plo, self._phi, self._psum, self._pn = x, lo, hi, mean, 1
        else:
            self._px += x
            self._plo = min(self._plo, lo)
            self._phi = max(self._phi, hi)
            self._psum += mean
            self._pn += 1
        if self._pn >= self.stride:
            self._commit()

    def _commit(self) -> None:
        self.xs.append(self._px / self._pn)
        self.lo.append(self._plo)
        self.hi.append(self._phi)
        self.mean.append(self._psum / self._pn)
        self._pn = 0
        if len(self.xs) >= self.cap:
            self._halve()

    def _halve(self) -> None:
        n = len(self.xs) // 2 * 2
        xs = zip(self.xs[0:n:2], self.xs[1:n:2], strict=True)
        self.xs = array("d", ((a + b) / 2 for a, b in xs))
        self.lo = array("f", map(min, self.lo[0:n:2], self.lo[1:n:2]))
        self.hi = array("f", map(max, self.hi[0:n:2], self.hi[1:n:2]))
        pairs = zip(self.mean[0:n:2], self.mean[1:n:2], strict=True)
        self.mean = array("f", ((a + b) / 2 for a, b in pairs))
        self.stride *= 2

    def arrays(self) -> tuple[array, array, array, array]:
        """Copies (x, lo, hi, mean) as float64 arrays (`array('d')`), the bucket still filling
        included."""
        x, lo, hi, mean = (array("d", a) for a in (self.xs, self.lo, self.hi, self.mean))
        if self._pn:
            x.append(self._px / self._pn)
            lo.append(self._plo)
            hi.append(self._phi)
            mean.append(self._psum / self._pn)
        return x, lo, hi, mean


class Marks:
    """A bounded set of x positions (for example skipped steps); thins out by half when full."""

    __slots__ = ("cap", "xs")

    def __init__(self, cap: int = 1024) -> None:
        self.cap = cap
        self.xs = array("d")

    def add(self, x: float) -> None:
        """Remember `x`; when full, every other mark is dropped."""
        if self.xs and self.xs[-1] == x:
            return
        self.xs.append(x)
        if len(self.xs) > self.cap:
            self.xs = self.xs[::2]

    def array(self) -> array:
        """A copy as a float64 array (`array('d')`)."""
        return array("d", self.xs)
