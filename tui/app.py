"""`DashboardApp`: the Textual app behind `scalemon attach` and `scalemon demo`.

Data flow: a thread worker runs the feed (`feed.HubFeed`: owns the ZeroMQ sockets, folds
records into `DashboardData` under its lock); one 0.1 s timer redraws the visible screen when
the data changed (and once a second for the ages), so redraws stay at or under 10/s whatever
the message rate. Plots are re-rasterised less often when they are expensive. The thread talks
to the app only through `post_message` (status changes).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.message import Message
from textual.screen import Screen
from textual.worker import get_current_worker

from scalemon.jobs import JobFile
from scalemon.tui import views
from scalemon.tui.feed import Feed, HubFeed
from scalemon.tui.messages import OpenRank, RedrawNeeded
from scalemon.tui.model import DashboardData
from scalemon.tui.screens.base import DataScreen
from scalemon.tui.screens.help import HelpScreen
from scalemon.tui.screens.overview import OverviewScreen
from scalemon.tui.screens.pick_job import PickJobScreen
from scalemon.tui.screens.rank_detail import RankDetailScreen

TICK_S = 0.1
AGES_EVERY_S = 1.0


def run_app(app: DashboardApp) -> None:
    """Run the app in this terminal. The receiver thread can hold the GIL for up to the
    interpreter's switch interval (5 ms) whenever the UI thread lets go of it, which adds up
    over a redraw; 1 ms keeps redraws prompt while thousands of messages a second arrive."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    try:
        app.run()
    finally:
        sys.setswitchinterval(previous)


class FeedStatus(Message):
    """The receiver connected, lost or regained the hub (posted from its thread)."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__()
        self.status = status
        self.detail = detail


class DashboardApp(App[None]):
    """The scalemon dashboard."""

    TITLE = "scalemon"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("l", "toggle_lines", "Lines/band"),
    ]

    def __init__(self, feed: Feed | None = None, *, data: DashboardData | None = None,
                 jobs: list[JobFile] | None = None, home: Path | None = None,
                 clock: Callable[[], float] = time.time, stats_path: Path | None = None,
                 job_process: subprocess.Popen | None = None, job_log: Path | None = None
                 ) -> None:
        super().__init__()
        self.feed = feed
        self.data = data or DashboardData()
        self.jobs = jobs or []
        self.home = home
        self.clock = clock
        self.stats_path = stats_path
        self.job_process = job_process
        self.job_log = job_log
        self._drawn_version = -1
        self._drawn_at = 0.0
        self._plots_version = -1
        self._plots_at = 0.0
        self._plot_interval = TICK_S
        self.redraw_ms: deque[float] = deque(maxlen=100_000)
        self.redraws = 0
        self._job_exit_reported = False

    # ---- start-up ------------------------------------------------------------------------

    def on_mount(self) -> None:
        """Pick a job if needed, show the overview, start the receiver and the redraw timer."""
        self.set_interval(TICK_S, self._tick)
        if self.job_process is not None:
            self.set_interval(1.0, self._watch_job)
        if self.feed is None and self.jobs:
            self.push_screen(PickJobScreen(self.jobs), callback=self._picked)
            return
        self._start()

    def _picked(self, job: str | None) -> None:
        if job is None:
            self.exit()
            return
        self.feed = HubFeed(job=job, home=self.home)
        self._start()

    def _start(self) -> None:
        self.push_screen(OverviewScreen())
        if self.feed is not None:
            self.sub_title = self.feed.label
            self._receive()

    @work(thread=True, exclusive=True, group="feed", name="receiver")
    def _receive(self) -> None:
        """The receiver thread: runs the feed until the app exits."""
        worker = get_current_worker()
        assert self.feed is not None
        self.feed.run(self.data, lambda: worker.is_cancelled,
                      lambda status, detail: self.post_message(FeedStatus(status, detail)))

    def on_feed_status(self, event: FeedStatus) -> None:
        """Tell the user when the hub goes away and comes back."""
        if event.status == "incompatible":
            self.notify(event.detail, severity="error", timeout=30)
        elif event.status == "disconnected":
            self.notify(f"hub disconnected ({event.detail}); retrying", severity="warning",
                        timeout=4)
        elif event.status == "connected" and getattr(self.feed, "attaches", 0) > 1:
            self.notify("hub reconnected", timeout=3)
        self.redraw_now()

    # ---- redrawing -----------------------------------------------------------------------

    def redraw_now(self, plots: bool = True) -> None:
        """Redraw at the next tick even if no data changed."""
        self._drawn_version = -1
        if plots:
            self._plots_version = -1
            self._plots_at = 0.0

    def _tick(self) -> None:
        screen = self.screen
        if not isinstance(screen, DataScreen) or not screen.is_mounted:
            return  # a modal on top (help, palette), or a screen still composing
        now = self.clock()
        start = time.perf_counter()
        version = self.data.version
        changed = version != self._drawn_version
        plots_due = (version != self._plots_version
                     and start - self._plots_at >= self._plot_interval)
        if not changed and not plots_due and now - self._drawn_at < AGES_EVERY_S:
            return
        try:
            screen.refresh_view(self.data, now, plots=plots_due)
        except NoMatches:
            return  # the app is shutting down and the screen lost its widgets
        self._drawn_version, self._drawn_at = version, now
        if plots_due:
            self._plots_version, self._plots_at = version, start
        self.redraws += 1
        self.call_after_refresh(self._redrawn, start, plots_due)

    def _redrawn(self, start: float, plots: bool) -> None:
        elapsed = time.perf_counter() - start
        self.redraw_ms.append(elapsed * 1000.0)
        if plots:
            # expensive plots (many ranks, big terminal) are redrawn less often: <= ~25% CPU
            self._plot_interval = min(1.0, max(TICK_S, 4 * elapsed))

    def _watch_job(self) -> None:
        if self.job_process is None or self._job_exit_reported:
            return
        code = self.job_process.poll()
        if code is not None:
            self._job_exit_reported = True
            where = f"; its output is in {self.job_log}" if self.job_log else ""
            self.notify(f"the job exited with code {code}{where}",
                        severity="error" if code else "information", timeout=15)

    # ---- actions -------------------------------------------------------------------------

    def open_rank(self, rank: int) -> None:
        """Show the detail screen of `rank` (it asks for its first draw when shown)."""
        self.push_screen(RankDetailScreen(rank))

    def on_open_rank(self, message: OpenRank) -> None:
        """A screen asked for a rank's detail."""
        self.open_rank(message.rank)

    def on_redraw_needed(self, message: RedrawNeeded) -> None:
        """A screen needs a redraw (rows scrolled into view, another rank shown)."""
        self.redraw_now(plots=message.plots)

    def action_help(self) -> None:
        """Keys and meanings."""
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_toggle_lines(self) -> None:
        """Loss and memory plots: one line per rank <-> mean with a min..max band."""
        with self.data.lock:
            per_rank = views.lines_per_rank(self.data)
            self.data.loss_mode = "band" if per_rank else "ranks"
        self.redraw_now()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """Palette entries: help, plot mode and one entry per rank (search 'rank 3')."""
        yield from super().get_system_commands(screen)
        yield SystemCommand("Help", "Keys, columns, plots and how stragglers are named",
                            self.action_help)
        yield SystemCommand("Toggle plot lines", "One line per rank, or mean with a band",
                            self.action_toggle_lines)
        with self.data.lock:
            hosts = {r: v.host for r, v in self.data.state.ranks.items()}
        for rank in sorted(hosts):
            yield SystemCommand(f"rank {rank}", f"open the detail of rank {rank} on "
                                f"{hosts[rank] or 'an unknown host'}",
                                lambda rank=rank: self.open_rank(rank), discover=False)

    # ---- shutting down -------------------------------------------------------------------

    def on_unmount(self) -> None:
        """Write the redraw statistics when asked to (benchmarks)."""
        if self.stats_path is not None:
            self.stats_path.write_text(json.dumps(self.stats(), indent=1))

    def stats(self) -> dict[str, Any]:
        """Redraw times and what was received."""
        with self.data.lock:
            return {"redraws": self.redraws, "redraw_ms": list(self.redraw_ms),
                    "records": self.data.records, "by_type": dict(self.data.by_type),
                    "next_seq": self.data.next_seq, "rejected": self.data.rejected}
