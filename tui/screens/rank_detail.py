"""The rank detail screen: identity, state and every series of one rank over the steps; for a
rank that stopped sending, what the hub read of its process and its stacks read from outside."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, VerticalScroll
from textual.events import Resize
from textual.widgets import Static

from ..messages import RedrawNeeded
from ..model import DashboardData
from ..plotdata import PlotSpec
from ..safe_text import literal_text
from ..views.rank_detail import DETAIL_PANELS, rank_detail
from ..widgets.fit import Fit, KeysFooter, cells_width, longest_word, widest
from ..widgets.plot import LinePlot
from .base import DataScreen

GAP = 2
"""Blank cells between the facts' columns."""
KEYS = "Esc back, ←/→ prev/next rank"
"""The title's keys: those the footer shows for BINDINGS (`,` and `.` also step)."""


def facts_table(facts: list[tuple[str, str]]) -> Fit:
    """The facts in two pairs of (name, value) columns where the values fit without a word
    cut; else in one pair (the values wrap at spaces, a word longer than the line folds)."""
    half = (len(facts) + 1) // 2
    columns = [facts[:half], facts[half:]]
    names = [widest(name for name, _ in column) for column in columns]
    word = longest_word(value for _, value in facts)
    two = Table.grid(padding=(0, GAP), expand=True)
    for _ in range(2):
        two.add_column(style="dim", no_wrap=True)
        two.add_column(overflow="fold")
    for i in range(half):
        right = facts[half + i] if half + i < len(facts) else ("", "")
        two.add_row(*(literal_text(cell) for cell in (*facts[i], *right)))
    one = Table.grid(padding=(0, GAP))
    one.add_column(style="dim", no_wrap=True)
    one.add_column(overflow="fold")
    for name, value in facts:
        one.add_row(literal_text(name), literal_text(value))
    return Fit((cells_width([names[0], word, names[1], word], GAP), two), (0, one))


class RankDetailScreen(DataScreen):
    """All of one rank. Escape goes back; left/right step through the ranks."""

    # the footer shows one key per action: the arrows, which the title names too (without
    # key_display it shows "," and ".": the focused scroll view claims left and right first)
    BINDINGS = [
        Binding("escape,backspace", "back", "Back"),
        Binding("left,comma", "step_rank(-1)", "Prev rank", key_display="←"),
        Binding("right,full_stop", "step_rank(1)", "Next rank", key_display="→"),
    ]
    DEFAULT_CSS = """
    RankDetailScreen #detail-title { height: auto; padding: 0 1; background: $boost;
                                     text-style: bold; }
    RankDetailScreen #facts { height: auto; padding: 0 1; }
    RankDetailScreen #outside-stacks { height: auto; padding: 0 1; margin: 1 0 0 0; }
    RankDetailScreen #detail-plots { grid-size: 2; grid-gutter: 0 1; height: auto;
                                     grid-rows: 9; }
    """

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.rank_ids: list[int] = [rank]  # every known rank, from the last redraw
        self.extra_plots: dict[str, LinePlot] = {}  # a plot per numeric log(**extra) name

    def compose(self) -> ComposeResult:
        yield Static(id="detail-title")
        with VerticalScroll(id="detail-body"):
            yield Static(id="facts")
            yield Static(id="outside-stacks")
            with Grid(id="detail-plots"):
                for _, group in DETAIL_PANELS:
                    yield LinePlot(id=f"detail-{group[0].name}")
        yield KeysFooter()

    def on_mount(self) -> None:
        self.query_one("#detail-body").focus()

    def on_unmount(self) -> None:
        """Left: a big job's rank is no longer fetched (its node's screen asks again)."""
        self.app_data().hide_ranks([self.rank])

    def on_resize(self, event: Resize) -> None:
        """Three plot columns on wide terminals, two otherwise."""
        columns = 3 if event.size.width >= 150 else 2
        self.query_one("#detail-plots", Grid).styles.grid_size_columns = columns

    def refresh_view(self, data: DashboardData, now: float, plots: bool) -> None:
        """Redraw from the data (plots only when `plots`)."""
        self.rank_ids = data.rank_ids() or [self.rank]
        data.show_rank(self.rank)  # a big job's rank: its series are fetched, then kept
        detail = rank_detail(data, self.rank, now)
        title = self.query_one("#detail-title", Static)
        if detail is None:
            title.update(Text(f"rank {self.rank}: not seen (yet)  ·  {KEYS}"))
            return
        # Text, never markup: facts hold what ranks sent (errors, log() extras, config), and a
        # "[/x]" in them must show as typed, not stop the dashboard with a MarkupError
        facts = detail.facts
        title.update(literal_text(f"rank {self.rank}  ·  {facts[0][1]}  ·  {KEYS}", one_line=True))
        self.query_one("#facts", Static).update(facts_table(facts))
        stacks = self.query_one("#outside-stacks", Static)
        stacks.display = detail.stacks is not None
        if detail.stacks is not None:  # what a peer read: Text, never markup
            stacks.update(literal_text(detail.stacks))
        if plots:
            for (_, group), spec in zip(DETAIL_PANELS, detail.plots, strict=True):
                plot = self.query_one(f"#detail-{group[0].name}", LinePlot)
                plot.display = not spec.hidden
                plot.update_spec(spec)
            self._show_extra_plots(detail.extra_plots)

    def _show_extra_plots(self, specs: dict[str, PlotSpec]) -> None:
        """A plot per numeric extra value, added as names appear (another rank's names stay,
        saying this rank does not log them)."""
        grid = self.query_one("#detail-plots", Grid)
        for name in specs:
            if name not in self.extra_plots:
                plot = LinePlot(id=f"detail-extra-{len(self.extra_plots)}")
                self.extra_plots[name] = plot
                grid.mount(plot)
        for name, plot in self.extra_plots.items():
            plot.update_spec(specs.get(name) or PlotSpec(
                f"{name} (log extra)", empty=f"n/a: rank {self.rank} does not log({name}=...)"))

    def action_back(self) -> None:
        """Back to the overview."""
        self.dismiss()

    def action_step_rank(self, delta: int) -> None:
        """Show the previous or next known rank."""
        ranks = self.rank_ids
        i = ranks.index(self.rank) if self.rank in ranks else 0
        self.app_data().hide_ranks([self.rank])  # a big job's: no longer fetched
        self.rank = ranks[(i + delta) % len(ranks)]
        self.post_message(RedrawNeeded())
