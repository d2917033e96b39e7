"""Text from outside (ranks, peers, hosts, paths, errors, job ids, log lines) made safe to show
on a terminal: every control character is made visible, so none reaches the terminal.

A rank's strings (a host name, a config value, an error, a log line, a group name) can hold
ESC sequences: colours, cursor moves, a screen clear, OSC 52 (write the user's clipboard),
OSC 8 links, or the one-byte C1 CSI (U+009B). `clean` shows each such character as the text
of its escape, ESC as the four characters `\\x1b`, CSI as `\\x9b`, so the text still says what
was sent. Used by the `scalemon` CLI (for all its human-readable output) and the dashboard
(`scalemon.tui.safe_text` adds Rich's no-markup wrapper); no Rich or Textual here, so the
agent, the hub and the CLI can use it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TextIO

TAB = 4
"""Columns between tab stops."""


def _escape(code: int) -> str:
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


_CONTROLS = [*range(0x20), 0x7F, *range(0x80, 0xA0)]  # C0, DEL, C1 (CSI, OSC, ST, ...)
# Unicode bidi overrides and isolates reorder what follows ("Trojan source"): shown too
_BIDI = [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_SHOWN: dict[int, str | None] = {c: _escape(c) for c in _CONTROLS + _BIDI}
_SHOWN.update({0x0D: None, 0x2028: " ", 0x2029: " "})  # CR dropped: "\r\n" line ends, bars
_MULTILINE = {**_SHOWN, 0x0A: "\n"}
_ONE_LINE = {**_SHOWN, 0x0A: " "}


def clean(text: str, one_line: bool = False) -> str:
    """`text` with every control character made visible (`\\x1b`), CR dropped and tabs
    expanded; newlines kept, or spaces when `one_line` (a table cell, a title)."""
    if text.isprintable():  # the usual case, at C speed
        return text
    if "\t" in text:
        text = text.expandtabs(TAB)
    return text.translate(_ONE_LINE if one_line else _MULTILINE)


class CleanStream:
    """A text stream that writes `clean(text)` to the stream it wraps: what a command prints
    (a rank's host, an error a hub passed on) cannot drive the terminal."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        """Write `text` with its control characters made visible."""
        self._stream.write(clean(text))
        return len(text)

    def __getattr__(self, name: str) -> object:  # flush, fileno, isatty, encoding, ...
        return getattr(self._stream, name)


@contextlib.contextmanager
def clean_output() -> Iterator[None]:
    """Within: sys.stdout and sys.stderr show control characters instead of sending them."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = CleanStream(out), CleanStream(err)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err
