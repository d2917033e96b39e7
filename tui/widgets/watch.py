"""The panels above the node table of a big job: the slowest ranks, the ranks that failed or
stopped sending (frozen, gone, unreachable, silent), and a histogram of the straggler measure
over the ranks (bars in the lateness heat map's shades), each a `TextPanel` repainted only when
its text changes."""

from __future__ import annotations

import math

from rich.text import Text
from textual.widget import Widget

from ..safe_text import clean
from ..views.nodes import FAILED_SHOWN, Histogram, Watch, WatchedRank
from .heatmap import SHADES

HOST_WIDTH = 14
"""Columns of a host name in the rank lists (longer ones are cut)."""
COUNT_WIDTH = 6
"""Columns of a histogram bar's count."""
FAILED_TITLE = "failed or stopped sending"
"""The title of the list of ranks that exited with an error or stopped sending (frozen, gone,
unreachable, silent: the hub's words, each rank's on its line)."""


def _rank_line(w: WatchedRank, style: str) -> Text:
    host = clean(w.host, one_line=True)[:HOST_WIDTH]
    return Text.assemble((f"{w.rank:>6}  ", style or "bold"), (f"{host:<{HOST_WIDTH}} ", "dim"),
                         (w.text, style))


def slowest_text(watch: Watch) -> Text:
    """A title, then the slowest ranks (stragglers in bold yellow)."""
    if not watch.measure:
        return Text("slowest ranks: n/a (no collective or compute time yet)", style="dim")
    lines = [Text.assemble(("slowest ranks", "bold"), (f"  by {watch.measure}", "dim"))]
    lines.extend(_rank_line(w, "bold yellow" if w.flagged else "") for w in watch.slowest)
    return Text("\n", no_wrap=True, overflow="ellipsis").join(lines)


def failed_text(watch: Watch) -> Text:
    """A title, then the ranks that failed or stopped sending, "+N more" past
    `FAILED_SHOWN`."""
    if not watch.failed_total:
        return Text.assemble((FAILED_TITLE, "bold"), ("  none", "green"))
    lines = [Text.assemble((FAILED_TITLE, "bold"),
                           (f"  {watch.failed_total}", "bold red"))]
    lines.extend(_rank_line(w, "bold red" if w.flagged else "red") for w in watch.failed)
    if watch.failed_total > FAILED_SHOWN:
        lines.append(Text(f"{'':>6}  +{watch.failed_total - FAILED_SHOWN} more "
                          "(the node table has them all)", style="red"))
    return Text("\n", no_wrap=True, overflow="ellipsis").join(lines)


def histogram_text(hist: Histogram | None, width: int) -> Text:
    """A title with the straggler bar, then a bar per bin: its range, a bar as long as
    log(1 + count) allows in `width` (so one rank still shows next to thousands), the count;
    counts of bins past the straggler bar in bold yellow."""
    if hist is None:
        return Text("spread over the ranks: n/a (no straggler measure yet)", style="dim")
    lines = [Text.assemble((hist.title, "bold"),
                           (f"  straggler > {_num(hist.bar)}", "dim"))]
    edges = hist.edges()
    labels = [f"{_num(edges[i])}–{_num(edges[i + 1])}" for i in range(len(hist.counts))]
    label_width = max(len(label) for label in labels)
    room = max(4, width - label_width - COUNT_WIDTH - 3)
    top = math.log1p(max(hist.counts)) or 1.0
    for i, (label, count) in enumerate(zip(labels, hist.counts, strict=True)):
        bar = max(1, round(room * math.log1p(count) / top)) if count else 0
        past = edges[i] >= hist.bar
        shade = SHADES[min(len(SHADES) - 1, i * len(SHADES) // len(hist.counts))]
        lines.append(Text.assemble((label.rjust(label_width) + " ", "dim"),
                                   ("█" * bar, shade), " " * (room - bar + 1),
                                   (f"{count:>{COUNT_WIDTH}}",
                                    "bold yellow" if past and count else "")))
    return Text("\n", no_wrap=True, overflow="ellipsis").join(lines)


def _num(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


class TextPanel(Widget):
    """A block of text, repainted only when it changed."""

    DEFAULT_CSS = """
    TextPanel { height: 100%; width: 1fr; padding: 0 1; text-wrap: nowrap;
                text-overflow: ellipsis; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._text = Text()

    def render(self) -> Text:
        """The current text."""
        return self._text

    def show(self, text: Text) -> None:
        """Show `text` (a repaint only when it differs)."""
        if text.plain != self._text.plain or text.spans != self._text.spans:
            self._text = text
            self.refresh()

    def shown_text(self) -> str:
        """The text shown (tests)."""
        return self._text.plain


class HistogramPanel(TextPanel):
    """The histogram, drawn for the panel's width."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.histogram: Histogram | None = None

    def show_histogram(self, hist: Histogram | None) -> None:
        """Show a new histogram."""
        self.histogram = hist
        self.show(histogram_text(hist, self.content_region.width or 40))

    def on_resize(self) -> None:
        """Bars as long as the new width allows."""
        self.show(histogram_text(self.histogram, self.content_region.width or 40))
