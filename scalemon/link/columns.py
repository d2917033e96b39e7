"""Columns of values as a big job's digest carries them (`hub/digest.py`, `tui/digest_feed.py`):
one list per field over the ranks instead of one row per rank, each packed the cheapest way
its values allow, so that 16,384 ranks' values cost a few C loops to pack and unpack, not a
msgpack object per value.

A column is `[kind, payload]`: `["c", value]` every row holds the same value; `["d", bytes]`
floats (float64, native byte order of the hub, little-endian on every platform scalemon runs
on: checked); `["q", bytes]` integers (int64); `["l", [values]]` anything else, as msgpack
values.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

from scalemon.protocol import ProtocolError

if sys.byteorder != "little":  # pragma: no cover - every supported platform is
    raise ImportError("scalemon's digest columns assume a little-endian machine")

_INT64 = (-(1 << 63), (1 << 63) - 1)


def encode_column(values: list[Any]) -> list[Any]:
    """`values` (one per row, at least one) as a column."""
    kinds = set(map(type, values))
    if len(kinds) == 1 and values.count(values[0]) == len(values):
        return ["c", values[0]]
    if kinds == {float}:
        return ["d", array("d", values).tobytes()]
    if kinds == {int} and _INT64[0] <= min(values) and max(values) <= _INT64[1]:
        return ["q", array("q", values).tobytes()]
    return ["l", values]


def decode_column(column: Any, rows: int) -> list[Any]:
    """The `rows` values of a column (`encode_column`); ProtocolError when it is not one of
    that many rows."""
    if not isinstance(column, (list, tuple)) or len(column) != 2:
        raise ProtocolError(f"a digest column is [kind, values], not {type(column).__name__}")
    kind, payload = column
    if kind == "c":
        if isinstance(payload, (dict, list)):  # each row a value of its own, as a list's
            return [payload.copy() for _ in range(rows)]
        return [payload] * rows
    if kind in ("d", "q") and isinstance(payload, bytes) and len(payload) == 8 * rows:
        values = array(kind)
        values.frombytes(payload)
        return values.tolist()
    if kind == "l" and isinstance(payload, list) and len(payload) == rows:
        return payload
    raise ProtocolError(f"a digest column of kind {kind!r} does not hold {rows} values")
