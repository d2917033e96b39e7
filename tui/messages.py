"""Messages from the screens to the app: screens say what they need, and the app, which owns
the data and the redraw timer, does it ("attributes down, messages up")."""

from __future__ import annotations

from textual.message import Message


class OpenRank(Message):
    """Show the detail screen of `rank`."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank


class RedrawNeeded(Message):
    """Redraw at the next tick even if no data changed (new rows in view, another rank)."""

    def __init__(self, plots: bool = True) -> None:
        super().__init__()
        self.plots = plots


class DumpRequested(Message):
    """Ask the hub for a Flight Recorder dump of every rank."""


class OpenNode(Message):
    """Show the ranks of node `host` (None: the ranks whose host is not known yet)."""

    def __init__(self, host: str | None) -> None:
        super().__init__()
        self.host = host
