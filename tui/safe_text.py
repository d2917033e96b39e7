"""Text from outside the dashboard (ranks, hosts, paths, errors, job ids, log lines) made safe to
show: never read as markup, and no control character reaching the terminal.

Rich and Textual read a plain `str` as markup in most places (`Static`, `Label`, `DataTable`
cells, `OptionList` prompts, `rich.table.Table` cells, the command palette), so a gloo error
holding "[/__w/pytorch/.../pair.cc:553]" raises `MarkupError` there: such text goes in as
`rich.text.Text`. Both only drop BEL, BS, VT, FF and CR from text and pass the other control
characters on to the terminal as they are (an ESC starts an escape sequence there): `clean`
shows them as their Unicode control pictures (ESC as "␛"), drops CR and turns tabs into
spaces; in a line that must stay one line (a table cell, a title) newlines become spaces.
"""

from __future__ import annotations

from rich.style import Style
from rich.text import Text

TAB = 4
"""Columns between tab stops."""

_SHOWN: dict[int, str | None] = {c: chr(0x2400 + c) for c in range(0x20)}  # ␀ .. ␟
_SHOWN.update({0x0D: None, 0x7F: "␡", 0x2028: " ", 0x2029: " "})
_SHOWN.update({c: "\ufffd" for c in range(0x80, 0xA0)})  # C1 controls: CSI is one of them
_MULTILINE = {**_SHOWN, 0x0A: "\n"}
_ONE_LINE = {**_SHOWN, 0x0A: " "}


def clean(text: str, one_line: bool = False) -> str:
    """`text` with every control character made harmless (newlines kept unless `one_line`)."""
    if text.isprintable():  # the usual case, at C speed
        return text
    if "\t" in text:
        text = text.expandtabs(TAB)
    return text.translate(_ONE_LINE if one_line else _MULTILINE)


def plain(text: object, style: str | Style = "", one_line: bool = False) -> Text:
    """`text` (str() of it) as Rich Text in `style`: shown as typed, never parsed as markup."""
    return Text(clean(str(text), one_line), style=style)
