"""What the dashboard shows when the job it started (`scalemon demo`) ends with an error: the
exit status and the last lines of the job's log, as plain text (never read as markup)."""

from __future__ import annotations

import re
from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from scalemon.text.display import exit_text

LAST_LINES = 15
_TAIL_BYTES = 64 * 1024
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def last_lines(path: Path | None, count: int = LAST_LINES) -> list[str]:
    """The last `count` non-empty lines of a log file, without terminal escapes and control
    characters; [] when it cannot be read."""
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - _TAIL_BYTES))
            data = f.read()
    except OSError:
        return []
    text = _ANSI.sub("", data.decode("utf-8", errors="replace"))
    lines = [_CONTROL.sub("", line.expandtabs(4)).rstrip() for line in text.splitlines()]
    return [line for line in lines if line][-count:]


class JobExitScreen(ModalScreen[None]):
    """The job ended with an error: its exit status and the end of its log, scrolled to its
    last line. Esc goes back to the dashboard (it stays usable: the history is still there),
    q quits."""

    BINDINGS = [
        Binding("escape,enter", "dismiss", "Back to the dashboard"),
        Binding("q", "app.quit", "Quit"),
    ]
    DEFAULT_CSS = """
    JobExitScreen { align: center middle; }
    JobExitScreen > Vertical { width: 95%; max-width: 140; height: auto; max-height: 90%;
                               border: round $error; background: $surface; padding: 0 1;
                               border-title-color: $error; border-title-style: bold; }
    JobExitScreen #job-exit-log { height: auto; margin-top: 1; }
    """

    def __init__(self, code: int, log: Path | None) -> None:
        super().__init__()
        self.code = code
        self.log_path = log
        self.lines = last_lines(log)

    def compose(self) -> ComposeResult:
        with Vertical() as box:
            box.border_title = f"The job ended: {exit_text(self.code)}"
            box.border_subtitle = "Esc: back to the dashboard  q: quit"
            yield Static(Text(f"The last {len(self.lines)} lines of its log, {self.log_path}:"
                              if self.lines else
                              f"Its log ({self.log_path or 'none'}) holds no output."))
            with VerticalScroll(id="job-exit-log"):
                yield Static(Text("\n".join(self.lines), overflow="fold"))

    def on_mount(self) -> None:
        """Fit the log into the terminal, its last line in view."""
        self._fit()
        self.query_one("#job-exit-log", VerticalScroll).anchor()

    def on_resize(self) -> None:
        """Fit again."""
        self._fit()

    def _fit(self) -> None:
        log = self.query_one("#job-exit-log", VerticalScroll)
        log.styles.max_height = max(2, int(self.app.size.height * 0.9) - 4)

    async def action_dismiss(self, result: None = None) -> None:
        """Back to the dashboard."""
        self.dismiss(result)
