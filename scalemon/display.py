"""Turning values into table text. None means "cannot exist here" and always reads "n/a"."""

from __future__ import annotations

import math

NA = "n/a"
GIB = float(1 << 30)


def num(value: float | None, digits: int = 4) -> str:
    """A plain number with `digits` decimals; nan/inf spelled out."""
    if value is None:
        return NA
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}"


def ms(seconds: float | None, digits: int = 1) -> str:
    """Seconds shown as milliseconds."""
    return NA if seconds is None else num(seconds * 1000.0, digits)


def signed_ms(seconds: float | None) -> str:
    """A signed difference in milliseconds (+ when late)."""
    if seconds is None or not math.isfinite(seconds):
        return NA
    return f"{seconds * 1000.0:+.1f}"


def gib(nbytes: float | None, digits: int = 2) -> str:
    """Bytes shown as GiB."""
    return NA if nbytes is None else f"{nbytes / GIB:.{digits}f}"


def used_of(used: float | None, total: float | None) -> str:
    """'used/total' in GiB, n/a when either is unknown."""
    if used is None or total is None:
        return NA
    return f"{used / GIB:.1f}/{total / GIB:.0f}"


def pct(value: float | None) -> str:
    """A percentage without decimals."""
    return NA if value is None else f"{value:.0f}"


def scale(value: float | None) -> str:
    """An AMP loss scale: whole numbers up to a million, then scientific."""
    if value is None:
        return NA
    if not math.isfinite(value):
        return str(value)
    return f"{value:.0f}" if abs(value) < 1e6 else f"{value:.2g}"


def si(value: float | None, unit: str = "") -> str:
    """A rate with k/M/G prefixes: 12.3k."""
    if value is None or not math.isfinite(value):
        return NA
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.1f}{prefix}{unit}"
    return f"{value:.1f}{unit}"


def duration(seconds: float | None) -> str:
    """Elapsed time as h:mm:ss."""
    if seconds is None or not math.isfinite(seconds):
        return NA
    s = max(0, int(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def age(seconds: float | None) -> str:
    """Seconds since something, one decimal below a minute."""
    if seconds is None:
        return NA
    seconds = max(0.0, seconds)
    return f"{seconds:.1f}" if seconds < 60 else f"{seconds:.0f}"
