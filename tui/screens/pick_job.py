"""Choosing one of several live jobs when `scalemon attach` was given none."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, OptionList, Static
from textual.widgets.option_list import Option

from scalemon.home.jobfile import JobFile

from ..safe_text import literal_text


class PickJobScreen(Screen[str]):
    """A list of live jobs; Enter attaches to the highlighted one."""

    BINDINGS = [Binding("q,escape", "app.quit", "Quit")]
    DEFAULT_CSS = """
    PickJobScreen #pick-title { padding: 1 2; }
    PickJobScreen OptionList { margin: 0 2; height: auto; max-height: 80%; }
    """

    def __init__(self, jobs: list[JobFile]) -> None:
        super().__init__()
        self.jobs = jobs

    def compose(self) -> ComposeResult:
        yield Static(f"{len(self.jobs)} live jobs: pick one (↑/↓, Enter)", id="pick-title")
        # Text: a str prompt is read as markup, and a host name is none
        yield OptionList(*(Option(literal_text(_label(j), one_line=True), id=j.job)
                           for j in self.jobs))
        yield Footer()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        """Attach to the chosen job."""
        if event.option.id is not None:
            self.dismiss(event.option.id)


def _label(j: JobFile) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.started))
    world = "?" if j.world_size is None else str(j.world_size)
    return f"{j.job}   world size {world}   since {started}   hub pid {j.pid} on {j.host}"
