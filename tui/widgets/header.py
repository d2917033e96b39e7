"""`JobHeader`: job id, world size, state, progress, rates, drops, stragglers and the hub link."""

from __future__ import annotations

import re

from rich.text import Text
from textual.geometry import Size
from textual.widget import Widget

from scalemon.text import display

from ..views.header import Summary

STATE_STYLES = {
    "running": "bold green",
    "finished": "bold green",
    "waiting": "bold yellow",
    "restarting": "bold yellow",
    "stalled": "bold magenta",
    "hub down": "bold magenta",
    "hung": "bold white on red",
    "degraded": "bold red",
    "ended": "bold red",
    "stopping": "bold yellow",
    "stopped": "bold cyan",
    "crashed": "bold red",
    "lost": "bold red",  # the job lost a rank: its first failure is a rank that vanished
}
ALERT_STYLE = "bold white on red"
CONN_STYLES = {
    "connected": "green",
    "offline": "grey50",
    "connecting": "yellow",
    "waiting": "yellow",
    "disconnected": "bold red",
    "incompatible": "bold red",
}


Item = list[Text]
"""A header item: its chunks, each kept whole on a line (unless wider than the line), one
blank apart; items are two blanks apart."""

INDENT = 2
"""Cells a wrapped line of the header is indented by."""
MAX_LINES = 8
"""The header's lines at most (`pack`)."""
SPARE = (2, 1)
"""The header's lines that lose their wrapped lines first where the terminal is short: the
hub's and stragglers', then the rates'; the job's state (a hang's culprit) stays."""


WORD_BREAK = re.compile(r"(?<!\brank)(?<!\branks)(?<!\bstep) (?!(?:s|ms|min)\b)")
"""Where a header text may wrap: at a blank, but not inside "20 s", "rank 3", "step 40"."""


def _pair(label: str, value: str, style: str = "") -> Item:
    """A label and its value, kept together."""
    return [Text(f"{label} ", style="dim").append(value, style=style)]


def _words(text: str, style: str = "", label: str = "") -> Item:
    """A text that may wrap between its words (`label`, dim, stays with the first)."""
    words = WORD_BREAK.split(text)
    first = Text(f"{label} ", style="dim") if label else Text()
    chunks = [first.append(words[0], style=style)]
    return chunks + [Text(w, style=style) for w in words[1:] if w]


def header_lines(s: Summary) -> list[list[Item]]:
    """The header's lines as items: identity and state; progress, rates, drops and a flag
    note; hub link and stragglers. Then, once a rank failed: which one failed first, and why;
    while a rank's training is unhealthy (NaN loss, loss scale collapsed, steps skipped): the
    alerts."""
    world = display.NA if s.world_size is None else str(s.world_size)
    if s.world_size is not None and s.ranks_seen != s.world_size:
        world_item = _pair("world", world)
        world_item[0].append(f" ({s.ranks_seen} seen)", style="yellow")
    else:
        world_item = _pair("world", world)
    first: list[Item] = [_pair("job", s.job or "?", "bold"), world_item,
                         _pair("elapsed", display.duration(s.elapsed_s)),
                         _words(s.state_text, STATE_STYLES.get(s.state, "bold"))]
    if s.step_min is None:
        step = _pair("step", display.NA)
    elif s.step_min == s.step_max:
        step = _pair("step", str(s.step_max), "bold")
    else:
        step = _pair("step min/max", f"{s.step_min}/{s.step_max}", "bold")
    second = [step, _pair("steps/s", display.num(s.steps_per_s, 2)),
              _pair(s.tokens_label, display.si(s.tokens_per_s)),
              _pair("dropped", str(s.dropped), "bold red" if s.dropped else ""),
              _pair("seq gaps", str(s.gaps), "bold red" if s.gaps else "")]
    if s.rejected:
        second.append(_pair("undecodable", str(s.rejected), "bold red"))
    if s.flag_note:
        second.append(_words(s.flag_note, s.flag_style))
    conn = s.conn
    label = "disconnected, retrying" if conn.status == "disconnected" else conn.status
    hub = _words(label, CONN_STYLES.get(conn.status, ""), label="hub")
    if conn.status not in ("connected", "disconnected") and conn.detail:
        hub += _words(f"({conn.detail})", "dim")
    if s.stragglers:
        parts = [f"rank {r} {v * 1000:+.0f} ms" for r, v in s.stragglers[:3]]
        parts = [f"{p}," for p in parts[:-1]] + parts[-1:]
        if len(s.stragglers) > 3:
            parts[-1] += f" (+{len(s.stragglers) - 3})"
        straggling = [Text("stragglers ", style="dim").append(parts[0], style="bold yellow")]
        straggling += [Text(p, style="bold yellow") for p in parts[1:]]
        straggling += _words(f"({s.straggler_basis})", "dim")
    else:
        straggling = _pair("stragglers", "none" if s.straggler_basis else display.NA)
    third = [hub, straggling]
    if s.hub_note:  # on the hub's own line: a long hang text on the first cannot hide it
        third.append(_words(s.hub_note, "yellow", label="hub note:"))
    lines = [first, second, third]
    if s.failure:
        lines.append([_words(s.failure, "bold red")])
    if s.alert:
        lines.append([_words(f"ALERT: {s.alert}", ALERT_STYLE)])
    return lines


def wrap(items: list[Item], width: int | None) -> list[Text]:
    """One header line's items at `width` cells, two blanks apart, wrapped between chunks
    onto lines indented by `INDENT` (a chunk wider than a line is cut into pieces). `width`
    None: one line."""
    out: list[Text] = []
    row = Text()
    for item in items:
        for k, chunk in enumerate(item):
            if row.plain.strip():
                gap = " " if k else "  "
                if width is None or row.cell_len + len(gap) + chunk.cell_len <= width:
                    row.append(gap).append_text(chunk)
                    continue
                out.append(row)
                row = Text(" " * INDENT)
            while width is not None and row.cell_len + chunk.cell_len > width > INDENT:
                room = width - row.cell_len  # a chunk wider than a line: in pieces
                out.append(row.append_text(chunk[:room]))
                chunk, row = chunk[room:], Text(" " * INDENT)
            row.append_text(chunk)
    return [*out, row]


def pack(lines: list[list[Item]], width: int | None, max_lines: int = MAX_LINES,
         spare: tuple[int, ...] = ()) -> list[Text]:
    """`lines` wrapped at `width` cells (`wrap`), in `max_lines` lines at most: the lines
    `spare` names, in that order, then the one that wraps onto the most lose their last
    wrapped lines, and end in " …" after a whole word; every line keeps its first."""
    rows = [wrap(items, width) for items in lines]
    cut: set[int] = set()
    while sum(map(len, rows)) > max(max_lines, len(rows)):
        first = [i for i in spare if i < len(rows) and len(rows[i]) > 1]
        longest = first[0] if first else max(range(len(rows)), key=lambda i: len(rows[i]))
        rows[longest].pop()
        cut.add(longest)
    for i in cut:
        last = rows[i][-1]
        while width is not None and last.cell_len + 2 > width and " " in last.plain.strip():
            last = last[:last.plain.rstrip().rindex(" ")]
            last.rstrip()
        rows[i][-1] = last.append(" …")
    return [row for wrapped in rows for row in wrapped]


def header_text(s: Summary, width: int | None = None) -> Text:
    """The header (`header_lines`) as text, wrapped at `width` cells (`pack`)."""
    return Text("\n", no_wrap=True, overflow="ellipsis").join(pack(header_lines(s), width))


class JobHeader(Widget):
    """The overview's header (`header_lines`): three lines (and a failure line, an alert
    line), each wrapped between words onto more lines where the terminal is narrow, never
    cut mid-word; repainted only when its text changes, re-laid out only when its number of
    lines does."""

    DEFAULT_CSS = """
    JobHeader { height: auto; padding: 0 1; background: $boost; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._lines: list[list[Item]] = [[[Text("connecting...")]]]

    def render(self) -> Text:
        """The current header text, wrapped at the widget's width."""
        return self._text(self.content_size.width)

    def _rows(self, width: int) -> list[Text]:
        """The lines at `width` cells, a quarter of the terminal's height at most (3 at
        least): the rank table and the plots keep their room."""
        return pack(self._lines, width if width > 0 else None,
                    max(3, self.app.size.height // 4), spare=SPARE)

    def _text(self, width: int) -> Text:
        return Text("\n", no_wrap=True, overflow="ellipsis").join(self._rows(width))

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        """As many lines as the header wraps onto at `width`."""
        return len(self._rows(width))

    def show(self, summary: Summary) -> None:
        """Redraw from a summary (only when the text changed)."""
        width = self.content_size.width
        old, self._lines = self._text(width), header_lines(summary)
        new = self._text(width)
        if new.plain != old.plain or new.spans != old.spans:
            self.refresh(layout=new.plain.count("\n") != old.plain.count("\n"))
