"""`?`: keys, what each column and plot means, and how stragglers are named."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

from scalemon.tui.views import COLUMNS

HELP_TEMPLATE = """\
# scalemon dashboard

- `↑` `↓` `PgUp` `PgDn` `Home` `End`, mouse: move in the rank table; `←` `→` scroll it sideways
- `Enter`, or a click on the highlighted row: that rank's detail, every series over the steps;
  there `←` `→` go to the previous / next rank and `Esc` comes back
- `l`: loss and memory plots as one line per rank, or mean with a min..max band
- `Ctrl+P`: command palette (type `rank 3` to open rank 3; theme; screenshot)
- `?`: this help, `q`: quit (the job keeps running; only `scalemon demo` stops its own job)

**Columns.** *rank*, *state* (see below), *step*: the last step the rank logged, *host*.

{columns}
**n/a** means the value cannot exist there (no GPU, no AMP scaler, not timed): never zero.

**Stragglers** are running ranks that reach the all-reduce at least 10 ms and 10% of a step
later than the median rank (without all-reduce timing: whose compute time is that much
longer). They are named in the header and drawn in yellow.

**States.** *lost*: the hub heard nothing for a while, or the process is gone. *exited N*: it
ended with exit code N. A rank shown as `<phase> Ns` has been in one phase (for example
`allreduce`) that long: a hang candidate. The job is *stalled* when no rank finished a step for
10 s and 10 steps.

**Plots.** x is the step. *Step time* shows compute (step - all-reduce - optimizer, at least 0:
a lower bound, since the all-reduce overlaps backward), all-reduce and optimizer, as means
over ranks. *AMP loss scale* is on a log scale; ▲ marks skipped steps (inf/NaN gradients).
Each pixel column keeps the minimum and maximum of its steps, so no spike is averaged away.
A rank's detail also plots every number the script passes to `log(name=value)`.

**Hub.** "disconnected, retrying" means the job's hub does not answer; the dashboard attaches
again by itself and resumes where it stopped, without gaps. "incompatible" means the hub runs
another scalemon protocol version: attach with the scalemon version the job runs.
"""


def columns_help() -> str:
    """One line per metric column of the rank table: its heading and what it means, from the
    table of metrics."""
    return "".join(f"- *{c.heading}*: {c.metric.description}\n"
                   for c in COLUMNS if c.metric is not None)


HELP = HELP_TEMPLATE.format(columns=columns_help())


class HelpScreen(ModalScreen[None]):
    """Keys and meanings."""

    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90%; max-width: 110; height: 90%;
                                  border: round $accent; background: $surface; }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Markdown(HELP)

    async def action_dismiss(self, result: None = None) -> None:
        """Close the help."""
        self.dismiss(result)
