"""Text from outside the dashboard (ranks, hosts, paths, errors, job ids, log lines) made safe to
show: never read as markup, and no control character reaching the terminal.

Rich and Textual read a plain `str` as markup in most places (`Static`, `Label`, `DataTable`
cells, `OptionList` prompts, `rich.table.Table` cells, the command palette), so a gloo error
holding "[/__w/pytorch/.../pair.cc:553]" raises `MarkupError` there: such text goes in as
`rich.text.Text`, made by `literal_text`. Both only drop BEL, BS, VT, FF and CR from text and
pass the other control characters on to the terminal as they are (an ESC starts an escape
sequence there): `clean` (the one of `scalemon.text.safe`, which the CLI uses too) shows them
as their escapes (ESC as the four characters `\\x1b`), drops CR and turns tabs into spaces; in
a line that must stay one line (a table cell, a title) newlines become spaces.
"""

from __future__ import annotations

from rich.style import Style
from rich.text import Text

from scalemon.text.safe import TAB, clean

__all__ = ["TAB", "clean", "literal_text"]


def literal_text(text: object, style: str | Style = "", one_line: bool = False) -> Text:
    """`text` (str() of it) as Rich Text in `style`: shown as typed, never parsed as markup."""
    return Text(clean(str(text), one_line), style=style)
