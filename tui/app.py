"""`DashboardApp`: the Textual app behind `scalemon attach` and `scalemon demo`.

Data flow: a thread worker runs the feed (`feed.HubFeed`: owns the ZeroMQ sockets, folds
records into `DashboardData` under its lock); one 0.1 s timer redraws the visible screen when
the data changed (and once a second for the ages), so redraws stay at or under 10/s whatever
the message rate. Plots are re-rasterised less often when they are expensive. The thread talks
to the app only through `post_message` (status changes).

When the job hangs (`reports.hangs.job_hang`) the app shows the hang screen by itself, once
per hang;
its `d` asks the hub for a Flight Recorder dump from a thread worker. The flags screen's changes
go to the hub the same way, through `send_toggle` (the hub's control socket by default).
The pacing of redraws is in tui/pacer.py, the requests the workers make in tui/requests.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.markup import escape
from textual.message import Message
from textual.screen import Screen
from textual.worker import get_current_worker

from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile

from .feed import Feed, HubFeed
from .gcpause import FreezeSurvivors
from .messages import DumpRequested, OpenNode, OpenRank, RedrawNeeded
from .model import DashboardData
from .pacer import TICK_S, RedrawPacer
from .requests import (
    NO_HUB,
    DumpAnswer,
    ToggleAnswer,
    ToggleSender,
    ask_dump,
    ask_toggle,
    toggle_on_hub,
)
from .safe_text import clean
from .screens.base import DataScreen
from .screens.collectives import CollectivesScreen
from .screens.flags import FlagsScreen, ToggleRequested
from .screens.hang import HangScreen
from .screens.help import HelpScreen
from .screens.log import LogScreen
from .screens.node import NodeScreen
from .screens.overview import OverviewScreen
from .screens.pick_job import PickJobScreen
from .screens.rank_detail import RankDetailScreen
from .views.hang import current_hang
from .views.overview import lines_per_rank

SIDE_SCREENS = (CollectivesScreen, HangScreen, RankDetailScreen, FlagsScreen, LogScreen)
"""Screens that `c`, `h`, `f` and `L` replace instead of stacking another one on."""


def run_app(app: DashboardApp) -> int:
    """Run the app in this terminal; returns its exit code (1 when it crashed). The receiver
    thread can hold the GIL for up to the interpreter's switch interval (5 ms) whenever the UI
    thread lets go of it, which adds up over a redraw; 1 ms keeps redraws prompt while
    thousands of messages a second arrive."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    try:
        app.run()
    finally:
        sys.setswitchinterval(previous)
    return app.return_code or 0


class FeedStatus(Message):
    """The receiver connected, lost or regained the hub (posted from its thread)."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__()
        self.status = status
        self.detail = detail


JOB_ACTIONS = frozenset({"help", "toggle_lines", "collectives", "hang", "flags", "log"})
"""The app's keys that show a job (none to show while the job picker is up)."""


class DashboardApp(App[None]):
    """The scalemon dashboard."""

    TITLE = "scalemon"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "quit_ctrl_c", "Quit", show=False),  # as q (Textual's only says how)
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("l", "toggle_lines", "Lines/band"),
        Binding("c", "collectives", "Collectives"),
        Binding("h", "hang", "Hang"),
        Binding("f", "flags", "Flags"),
        Binding("L", "log", "Log"),
    ]

    def __init__(self, feed: Feed | None = None, *, data: DashboardData | None = None,
                 jobs: list[JobFile] | None = None, home: Path | None = None,
                 clock: Callable[[], float] = time.time, stats_path: Path | None = None,
                 job_process: subprocess.Popen | None = None, job_log: Path | None = None,
                 hang_after_s: float | None = None) -> None:
        super().__init__()
        self.feed = feed
        self.data = data or DashboardData()
        if hang_after_s is not None:
            self.data.set_hang_after(hang_after_s)
        self.jobs = jobs or []
        self.home = home
        self.clock = clock
        self.stats_path = stats_path
        self.job_process = job_process
        self.job_log = job_log
        if job_process is not None:  # launched just now: the header tells its start-up
            self.data.launched_t = clock()
        self.pacer = RedrawPacer()
        self._job_exit_reported = False
        self._hang_shown = False  # the hang screen was shown for the hang going on
        self.dump_status: str | None = None  # what became of the last dump request
        self.toggle_status: tuple[str, bool] | None = None  # of the last flag change request
        self.send_toggle: ToggleSender = self._send_toggle_to_hub
        self._gc: FreezeSurvivors | None = None  # while mounted

    @property
    def redraws(self) -> int:
        """Redraws so far."""
        return self.pacer.redraws

    @property
    def plots_version(self) -> int:
        """The data version the plots were last drawn at (tui/screenshot.py waits for it)."""
        return self.pacer.plots_version

    # ---- start-up ------------------------------------------------------------------------

    def on_mount(self) -> None:
        """Pick a job if needed, show the overview, start the receiver and the redraw timer."""
        self._gc = FreezeSurvivors()
        self.set_interval(TICK_S, self._tick)
        if self.job_process is not None:
            self.set_interval(1.0, self._watch_job)
        if self.feed is None and self.jobs:
            self.push_screen(PickJobScreen(self.jobs), callback=self._picked)
            return
        self._start()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The job's keys (and its help) only once a job is shown: the job picker offers its
        own keys, in its footer too."""
        return not (isinstance(self.screen, PickJobScreen) and action in JOB_ACTIONS)

    def _picked(self, job: str | None) -> None:
        if job is None:
            self.exit()
            return
        self.feed = HubFeed(job=job, home=self.home)
        self._start()

    def _start(self) -> None:
        self.push_screen(OverviewScreen())
        if isinstance(self.feed, HubFeed) and self.feed.job is not None:
            with self.data.lock:
                self.data.expect_job(self.feed.job)
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
            self.notify(clean(event.detail), severity="error", timeout=30, markup=False)
        elif event.status == "disconnected":
            self.notify(f"hub disconnected ({clean(event.detail)}); retrying",
                        severity="warning", timeout=4, markup=False)
        elif event.status == "restarted":
            self.notify(clean(event.detail), severity="warning", timeout=15, markup=False)
        elif event.status == "connected" and getattr(self.feed, "attaches", 0) > 1:
            self.notify("hub reconnected", timeout=3)
        self.redraw_now()

    # ---- redrawing -----------------------------------------------------------------------

    def redraw_now(self, plots: bool = True) -> None:
        """Redraw at the next tick even if no data changed."""
        self.pacer.force(plots)

    def _tick(self) -> None:
        if self._gc is not None:
            self._gc.tick()  # between redraws: a freeze costs one walk of the young objects
        if not self.screen_stack:
            return  # the timer fired while the app shuts down
        screen = self.screen
        if not isinstance(screen, DataScreen) or not screen.is_mounted:
            return  # a modal on top (help, palette), or a screen still composing
        if self.data.busy:
            return  # the receiver holds the lock for a while (a big job's digest): next tick
        now = self.clock()
        start = time.perf_counter()
        version = self.data.version
        draw, plots_due = self.pacer.plan(version, now, start)
        if not draw:
            return
        if self._show_hang(now):
            return  # the hang screen draws at the next tick
        self.data.drawing(True)  # the receiver steps aside until the screen is drawn
        try:
            screen.refresh_view(self.data, now, plots=plots_due)
        except NoMatches:
            self.data.drawing(False)
            return  # the app is shutting down and the screen lost its widgets
        except BaseException:
            self.data.drawing(False)
            raise
        self.pacer.drew(version, now, start, plots_due)
        self.call_after_refresh(self._redrawn, start, plots_due)

    def _show_hang(self, now: float) -> bool:
        """Show the hang screen when a hang begins (once per hang); True when it did."""
        with self.data.lock:
            kept = self.data.totals if self.data.digest_followed else None
            hang = kept.hang if kept is not None else current_hang(self.data, now)
        if hang is None:
            self._hang_shown = False
            return False
        if self._hang_shown:
            return False
        self._hang_shown = True
        if isinstance(self.screen, HangScreen):
            return False
        self.push_screen(HangScreen(self.dump_status))
        return True

    def _redrawn(self, start: float, plots: bool) -> None:
        self.data.drawing(False)
        self.pacer.redrawn(time.perf_counter() - start, plots)

    def _watch_job(self) -> None:
        """The job this app started ended: a toast when it finished, else the end of its log
        on a screen of its own, which stays until dismissed."""
        if self.job_process is None or self._job_exit_reported:
            return
        code = self.job_process.poll()
        if code is None:
            return
        self._job_exit_reported = True
        where = f"; its output is in {self.job_log}" if self.job_log else ""
        if code == 0:
            self.notify(f"the job finished (exit code 0){where}", timeout=15, markup=False)
            return
        from scalemon.text.display import exit_text

        from .screens.job_exit import JobExitScreen

        self.push_screen(JobExitScreen(code, self.job_log), callback=lambda _: self.notify(
            f"the job ended: {exit_text(code)}{where}", severity="error", timeout=30,
            markup=False))

    # ---- actions -------------------------------------------------------------------------

    def open_rank(self, rank: int) -> None:
        """Show the detail screen of `rank` (it asks for its first draw when shown)."""
        self.push_screen(RankDetailScreen(rank))

    def on_open_rank(self, message: OpenRank) -> None:
        """A screen asked for a rank's detail."""
        self.open_rank(message.rank)

    def open_node(self, host: str | None) -> None:
        """Show the ranks of node `host` (it asks for its first draw when shown)."""
        self.push_screen(NodeScreen(host))

    def on_open_node(self, message: OpenNode) -> None:
        """A screen asked for a node's ranks."""
        self.open_node(message.host)

    def on_redraw_needed(self, message: RedrawNeeded) -> None:
        """A screen needs a redraw (rows scrolled into view, another rank shown)."""
        self.redraw_now(plots=message.plots)

    quit_key = "q"
    """The key that quit the dashboard, "q" or "Ctrl-C": how `scalemon demo` says its user
    stopped the job."""

    async def action_quit_ctrl_c(self) -> None:
        """Ctrl-C: quit as q does, remembered as Ctrl-C."""
        self.quit_key = "Ctrl-C"
        await self.action_quit()

    def action_help(self) -> None:
        """Keys and meanings."""
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def _show_side(self, screen: DataScreen) -> None:
        """Open a screen over the overview, in place of another one opened from it."""
        if isinstance(self.screen, SIDE_SCREENS):
            self.switch_screen(screen)
        else:
            self.push_screen(screen)

    def action_collectives(self) -> None:
        """Collectives: durations, bus bandwidth, arrival skew, the recorder's health."""
        if isinstance(self.screen, DataScreen) and not isinstance(self.screen,
                                                                  CollectivesScreen):
            self._show_side(CollectivesScreen())

    def action_hang(self) -> None:
        """The hang view: culprit, each rank's whereabouts and stack, Flight Recorder dumps."""
        if isinstance(self.screen, DataScreen) and not isinstance(self.screen, HangScreen):
            self._show_side(HangScreen(self.dump_status))

    def action_flags(self) -> None:
        """Flags: tiers, values on the ranks, mismatches, the toggle audit; changes them."""
        if isinstance(self.screen, DataScreen) and not isinstance(self.screen, FlagsScreen):
            self._show_side(FlagsScreen(self.toggle_status))

    def action_log(self) -> None:
        """NCCL's and torch's log lines streamed by the agents, filtered."""
        if isinstance(self.screen, DataScreen) and not isinstance(self.screen, LogScreen):
            self._show_side(LogScreen())

    def hub_address(self) -> HubAddress | None:
        """The live hub's address; None without one (a replayed history file, a test)."""
        if not isinstance(self.feed, HubFeed) or self.data.conn.status == "offline":
            return None
        return self.feed.address

    def on_dump_requested(self, message: DumpRequested) -> None:
        """The hang screen's `d`: ask the hub, off the UI thread."""
        address = self.hub_address()
        if address is None:
            self._dump_answered(NO_HUB, ok=False)
        else:
            self._request_dump(address)

    @work(thread=True, exclusive=True, group="dump", name="dump request")
    def _request_dump(self, address: HubAddress) -> None:
        self.post_message(ask_dump(address))

    def on_dump_answer(self, message: DumpAnswer) -> None:
        """Say what became of a dump request."""
        self._dump_answered(message.text, message.ok)

    def _dump_answered(self, text: str, ok: bool) -> None:
        self.dump_status = text
        self.notify(clean(text), severity="information" if ok else "warning", timeout=8,
                    markup=False)  # paths and errors, never markup
        for screen in self.screen_stack:
            if isinstance(screen, HangScreen):
                screen.show_status(text)
        self.redraw_now(plots=False)

    def on_toggle_requested(self, message: ToggleRequested) -> None:
        """The flags screen's change (already checked against the catalogue): send it off
        the UI thread."""
        self._request_toggle(message.name, message.value, message.restart)

    @work(thread=True, group="toggle", name="toggle request")
    def _request_toggle(self, name: str, value: str, restart: bool) -> None:
        self.post_message(ask_toggle(self.send_toggle, name, value, restart))

    def _send_toggle_to_hub(self, name: str, value: str, restart: bool) -> dict[str, Any]:
        """The default `send_toggle`: the live hub's control socket."""
        return toggle_on_hub(self.hub_address(), name, value, restart)

    def on_toggle_answer(self, message: ToggleAnswer) -> None:
        """Say what became of a flag change request."""
        self.toggle_status = (message.text, message.ok)
        self.notify(clean(message.text), severity="information" if message.ok else "error",
                    timeout=10, markup=False)
        for screen in self.screen_stack:
            if isinstance(screen, FlagsScreen):
                screen.show_status(message.text, message.ok)
        self.redraw_now(plots=False)

    def action_toggle_lines(self) -> None:
        """Loss and memory plots: one line per rank <-> mean with a min..max band."""
        with self.data.lock:
            per_rank = lines_per_rank(self.data)
            self.data.loss_mode = "band" if per_rank else "ranks"
        self.redraw_now()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """Palette entries: help, plot mode and one entry per rank (search 'rank 3')."""
        yield from super().get_system_commands(screen)
        yield SystemCommand("Help", "Keys, columns, plots and how stragglers are named",
                            self.action_help)
        yield SystemCommand("Toggle plot lines", "One line per rank, or mean with a band",
                            self.action_toggle_lines)
        yield SystemCommand("Collectives", "Durations and bus bandwidth by op and size, arrival "
                            "skew heat map, Flight Recorder health (c)", self.action_collectives)
        yield SystemCommand("Hang view", "Who holds up the job, every rank's stack, Flight "
                            "Recorder dumps (h)", self.action_hang)
        yield SystemCommand("Flags", "NCCL and torch flags: tiers, values on every rank, "
                            "mismatches, toggle audit; change them (f)", self.action_flags)
        yield SystemCommand("Log", "NCCL's and torch's log lines of every rank, filtered by "
                            "rank, source, level and text (L)", self.action_log)
        with self.data.lock:
            hosts = {r: v.host for r, v in self.data.state.ranks.items()}
        for rank in sorted(hosts):
            host = escape(clean(hosts[rank], one_line=True)) if hosts[rank] else "an unknown host"
            yield SystemCommand(f"rank {rank}", f"open the detail of rank {rank} on {host}",
                                lambda rank=rank: self.open_rank(rank), discover=False)
        for node in sorted({h for h in hosts.values() if h}):
            name = escape(clean(node, one_line=True))
            yield SystemCommand(f"node {name}", f"the ranks of node {name}",
                                lambda node=node: self.open_node(node), discover=False)

    # ---- shutting down -------------------------------------------------------------------

    def on_unmount(self) -> None:
        """Write the redraw statistics when asked to (benchmarks); thaw what froze."""
        if self._gc is not None:
            self._gc.close()
            self._gc = None
        if self.stats_path is not None:
            self.stats_path.write_text(json.dumps(self.stats(), indent=1))

    def stats(self) -> dict[str, Any]:
        """Redraw times and what was received."""
        with self.data.lock:
            return {"redraws": self.redraws, "redraw_ms": list(self.pacer.redraw_ms),
                    "plot_redraw_ms": list(self.pacer.plot_redraw_ms),
                    "records": self.data.records, "by_type": dict(self.data.by_type),
                    "next_seq": self.data.next_seq, "rejected": self.data.rejected,
                    "digest": self._digest_stats()}

    def _digest_stats(self) -> dict[str, Any]:
        """What a big job's dashboard received instead of every record (`digest_feed`)."""
        follower = getattr(self.feed, "follower", None)
        return {"followed": self.data.digest_followed, "digests": self.data.digests,
                "few_records": follower.few if follower else 0,
                "rank_fetches": follower.fetches if follower else 0}
