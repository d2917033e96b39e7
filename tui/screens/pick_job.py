"""Choosing one of several jobs when `scalemon attach` was given none."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from scalemon.home.jobfile import JobFile

from ..safe_text import literal_text
from ..widgets.fit import KeysFooter


class PickJobScreen(Screen[str]):
    """A list of jobs (live ones, else ended ones whose hubs linger), each with its state;
    Enter attaches to the highlighted one."""

    BINDINGS = [Binding("q,escape", "app.quit", "Quit")]
    DEFAULT_CSS = """
    PickJobScreen #pick-title { padding: 1 2; }
    PickJobScreen OptionList { margin: 0 2; height: auto; max-height: 80%; }
    PickJobScreen OptionList, PickJobScreen OptionList:focus { border: none; }
    """

    def __init__(self, jobs: list[JobFile]) -> None:
        super().__init__()
        self.jobs = jobs

    def compose(self) -> ComposeResult:
        yield Static(f"{pick_title(self.jobs)}: pick one (↑/↓, Enter)", id="pick-title")
        # Text: a str prompt is read as markup, and a host name is none
        yield OptionList(*(Option(literal_text(label, one_line=True), id=j.job)
                           for j, label in zip(self.jobs, labels(self.jobs), strict=True)))
        yield KeysFooter()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        """Attach to the chosen job."""
        if event.option.id is not None:
            self.dismiss(event.option.id)


def pick_title(jobs: list[JobFile]) -> str:
    """"2 live jobs", or for ended jobs whose hubs linger "no live job; 2 ended jobs whose
    hubs still serve them" (an ended job is never called live)."""
    live = sum(j.state == "running" for j in jobs)
    if live == len(jobs):
        return f"{live} live jobs"
    if not live:
        return f"no live job; {len(jobs)} ended jobs whose hubs still serve them"
    return f"{live} live and {len(jobs) - live} ended jobs"


def labels(jobs: list[JobFile]) -> list[str]:
    """Each job's line, in columns: id, state (running, or how it ended), world size, start
    and hub (last: on a narrow terminal it wraps onto a line of its own)."""
    if not jobs:
        return []
    ids, states = (max(len(f(j)) for j in jobs) for f in (lambda j: j.job, lambda j: j.state))
    worlds = ["?" if j.world_size is None else str(j.world_size) for j in jobs]
    wide = max(map(len, worlds))
    return [f"{j.job:<{ids}}  {j.state:<{states}}  world size {world:>{wide}}  since "
            f"{time.strftime('%m-%d %H:%M', time.localtime(j.started))}  "
            f"hub pid {j.pid} on {j.host}" for j, world in zip(jobs, worlds, strict=True)]
