"""The real dashboard app (App.run_test + Pilot) against real hub processes fed by scripted
ranks: table values, ranks that stop sending, plots that follow the data, rank detail, help,
reconnects, the job picker."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable

import pytest
import zmq
from test_tui_snapshots import screen_text

from conftest import wait_for
from scalemon.home.address import HubAddress
from scalemon.home.history import history_path, read_records
from scalemon.protocol import PROTOCOL_VERSION, SILENT_RANK_STATES, version_text
from scalemon.text import display
from scalemon.tui.app import DashboardApp
from scalemon.tui.attach import make_app
from scalemon.tui.feed import HubFeed
from scalemon.tui.screens.help import HelpScreen
from scalemon.tui.screens.overview import OverviewScreen
from scalemon.tui.screens.pick_job import PickJobScreen
from scalemon.tui.screens.rank_detail import RankDetailScreen
from scalemon.tui.screenshot import simulated_app
from scalemon.tui.sim import SimJob
from scalemon.tui.views.rank_detail import rank_detail
from scalemon.tui.views.rows import COLUMNS
from scalemon.tui.widgets.header import JobHeader
from scalemon.tui.widgets.plot import LinePlot
from scalemon.tui.widgets.rank_table import RankTable

COL = {c.key: i for i, c in enumerate(COLUMNS)}


class SimSender:
    """Scripted ranks: one PUSH socket per rank, messages from a SimJob stamped with now."""

    def __init__(self, ctx: zmq.Context, address: HubAddress, sim: SimJob) -> None:
        self.sim = sim
        self.socks = {}
        for rank in range(sim.ranks):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(address.ingest)
            self.socks[rank] = sock
        self.sent: dict[int, dict] = {}  # rank -> last step body

    def send(self, rank: int, mtype: str, body: dict) -> None:
        self.socks[rank].send(self.sim.frame(rank, mtype, body, time.time()))

    def hello(self) -> None:
        for rank in self.socks:
            self.send(rank, "hello", self.sim.hello(rank))

    def step(self, step: int, ranks: list[int] | None = None) -> None:
        bodies = self.sim.step_bodies(step, time.time())
        for rank in ranks if ranks is not None else list(self.socks):
            self.send(rank, "step", bodies[rank])
            self.sent[rank] = bodies[rank]

    def heartbeat(self, step: int, ranks: list[int] | None = None) -> None:
        for rank in ranks if ranks is not None else list(self.socks):
            self.send(rank, "heartbeat", self.sim.heartbeat(rank, step))


async def until(pilot, predicate: Callable[[], object], timeout: float = 10.0,
                each: Callable[[], None] | None = None) -> None:
    """Let the app run until `predicate()` holds; fail after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"not reached within {timeout} s: {predicate.__doc__ or ''}")
        if each is not None:
            each()
        await pilot.pause(0.1)


def cells(app: DashboardApp) -> dict[int, list[str]]:
    """The rank table as text: rank -> cells."""
    table = app.screen.query_one(RankTable)
    return {rank: list(row)  # every column's place, "" for one not shown now (no pipeline)
            for rank, row in table.cells_by_rank([c.key for c in COLUMNS]).items()}


def header(app: DashboardApp) -> str:
    return str(app.screen.query_one(JobHeader).render())


def test_table_shows_every_rank_with_its_values_and_plots_follow_the_data(start_hub, zctx):
    hub = start_hub("tuiA")
    sim = SimJob(job="tuiA", ranks=3, gpu=False, amp=False)
    ranks = SimSender(zctx, hub.address, sim)

    async def scenario() -> None:
        app = DashboardApp(HubFeed(address=hub.address))
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause(0.5)  # the subscription needs a moment to reach the hub
            ranks.hello()
            for step in range(1, 6):
                ranks.step(step)
            ranks.heartbeat(5)
            await until(pilot, lambda: (c := cells(app)) and len(c) == 3
                        and all(row[COL["step"]] == "5" for row in c.values()))
            table = cells(app)
            assert sorted(table) == [0, 1, 2]
            for rank, row in table.items():
                body = ranks.sent[rank]
                assert row[COL["loss"]] == f"{body['loss']:.4f}"
                assert row[COL["step_time_s"]] == f"{body['step_time_s'] * 1000:.1f}"
                assert row[COL["allreduce_time_s"]] == f"{body['allreduce_time_s'] * 1000:.1f}"
                assert row[COL["optimizer_time_s"]] == f"{body['optimizer_time_s'] * 1000:.1f}"
                assert row[COL["state"]] == "running" and row[COL["host"]] == "node0"
                # no GPU, no AMP: "n/a", never a number that looks like zero
                for key in ("loss_scale", "mem_allocated_bytes", "mem_reserved_bytes",
                            "mem_peak_bytes", "gpu_mem_used_bytes", "gpu_util_pct", "mfu"):
                    assert row[COL[key]] == "n/a", key
                assert row[COL["cpu_pct"]] == f"{98 + rank % 4}"
            assert "job tuiA" in header(app) and "world 3" in header(app)
            assert "hub connected" in header(app)

            loss_plot = app.screen.query_one("#plot-loss", LinePlot)
            await until(pilot, lambda: "step 5" in "".join(loss_plot.text_rows()))
            before = loss_plot.text_rows()
            for step in range(6, 41):
                ranks.step(step)
            await until(pilot, lambda: "step 40" in "".join(loss_plot.text_rows()))
            after = loss_plot.text_rows()
            assert after != before
            dots = sum(ch != " " and 0x2800 < ord(ch) <= 0x28FF for row in after for ch in row)
            assert dots > 20  # a drawn line, not an empty box
            time_plot = app.screen.query_one("#plot-time", LinePlot)
            assert "compute" in time_plot.text_rows()[0]
            await pilot.press("q")
        assert app.return_code in (None, 0)

    asyncio.run(scenario())


def test_a_rank_that_stops_sending_gets_the_hubs_word(start_hub, zctx):
    hub = start_hub("tuiB", "--lost-after", "1.5")
    sim = SimJob(job="tuiB", ranks=3, gpu=False, amp=False)
    ranks = SimSender(zctx, hub.address, sim)
    step = [0]

    def keep_going() -> None:  # ranks 0 and 1 stay alive, rank 2 is silent
        step[0] += 1
        ranks.step(10 + step[0], ranks=[0, 1])

    async def scenario() -> None:
        app = DashboardApp(HubFeed(address=hub.address))
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause(0.5)
            ranks.hello()
            for s in range(1, 11):
                ranks.step(s)
            await until(pilot, lambda: len(cells(app)) == 3)
            states = lambda: [row[COL["state"]] for row in cells(app).values()]  # noqa: E731
            await until(pilot, lambda: states()[:2] == ["running", "running"]
                        and states()[2] in SILENT_RANK_STATES, timeout=15, each=keep_going)
            table = cells(app)
            # node0 is not the hub's host and has no relay: nothing can look at rank 2's
            # process, and the header says the rank table's word
            assert states()[2] == "silent"
            assert ", silent: 2" in header(app) and "lost" not in header(app)
            assert float(table[2][COL["heartbeat_age_s"]]) >= 1.0

    asyncio.run(scenario())


def test_enter_opens_the_rank_detail_and_help_and_palette_work(start_hub, zctx):
    hub = start_hub("tuiC")
    sim = SimJob(job="tuiC", ranks=2, gpu=True, amp=True)
    ranks = SimSender(zctx, hub.address, sim)

    async def scenario() -> None:
        app = DashboardApp(HubFeed(address=hub.address))
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause(0.5)
            ranks.hello()
            wall = {0: 0.0, 1: 0.0}  # each rank's steps' wall time (all within 10 s)
            for s in range(1, 31):
                ranks.step(s)
                for r in wall:
                    wall[r] += ranks.sent[r]["step_time_s"]
            ranks.heartbeat(30)
            await until(pilot, lambda: len(cells(app)) == 2
                        and cells(app)[1][COL["step"]] == "30")
            sent = ranks.sent[1]["extra"]  # step 30: the trainer's measured MFU
            # one tokens/s: each row its steps' tokens over their wall time, the header the
            # rows' sum, the rank detail the row's (sent within milliseconds: no clock's rate)
            rate = {r: 30 * 8192 / wall[r] for r in wall}
            assert [cells(app)[r][COL["tokens_per_s"]] for r in (0, 1)] == \
                [display.si(rate[0]), display.si(rate[1])]
            assert f"tokens/s {display.si(rate[0] + rate[1])} " in header(app)
            assert cells(app)[1][COL["mfu"]] == f"{100 * sent['mfu']:.1f}"
            await pilot.press("down", "enter")
            await until(pilot, lambda: isinstance(app.screen, RankDetailScreen))
            assert app.screen.rank == 1
            title = app.screen.query_one("#detail-title")
            await until(pilot, lambda: "rank 1" in str(title.render()))
            mem = app.screen.query_one("#detail-mem_allocated_bytes", LinePlot)
            await until(pilot, lambda: mem.spec.has_data)
            assert [line.label for line in mem.spec.lines] == ["alloc", "resv", "peak"]
            assert mem.spec.unit == "GiB" and max(mem.spec.lines[0].hi) == pytest.approx(
                ranks.sent[1]["mem_allocated_bytes"] / 2**30, rel=1e-3)
            assert app.screen.query_one("#detail-loss", LinePlot).spec.has_data
            lr = app.screen.query_one("#detail-extra-0", LinePlot)  # log(lr=...): plotted too
            await until(pilot, lambda: lr.spec.has_data)
            assert lr.spec.title == "lr (log extra)" and len(lr.spec.lines[0].x) == 30
            facts = dict(rank_detail(app.data, 1).facts)  # what the facts panel shows
            assert facts["steps/s  tokens/s"].endswith(f"  {display.si(rate[1])}")
            assert facts["scalemon / torch"] == "0.1.0 / 2.13.0"
            assert facts["info config"].startswith("preset=gpt2-124m")
            assert facts["log extra"].startswith("lr=")
            await pilot.press("right")
            await until(pilot, lambda: "rank 0" in str(title.render()))
            await pilot.press("escape")
            await until(pilot, lambda: isinstance(app.screen, OverviewScreen))
            await pilot.press("question_mark")
            await until(pilot, lambda: isinstance(app.screen, HelpScreen))
            await pilot.press("escape")
            await until(pilot, lambda: isinstance(app.screen, OverviewScreen))
            commands = [c.title for c in app.get_system_commands(app.screen)]
            assert "rank 1" in commands and "Help" in commands
            await pilot.press("q")

    asyncio.run(scenario())


def test_hub_that_goes_away_shows_disconnected_and_reconnects_without_gaps(home, start_hub,
                                                                          zctx):
    hub = start_hub("tuiD")
    sim = SimJob(job="tuiD", ranks=2, gpu=False, amp=False)
    ranks = SimSender(zctx, hub.address, sim)

    async def scenario() -> None:
        feed = HubFeed(job="tuiD", home=home, timeout_s=1.0, retry_s=0.3)
        app = DashboardApp(feed)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause(0.5)
            ranks.hello()
            for s in range(1, 6):
                ranks.step(s)
            await until(pilot, lambda: len(cells(app)) == 2
                        and cells(app)[0][COL["step"]] == "5")
            history = history_path("tuiD", home)
            # flushed to the file: 2 hellos and 5 steps of 2 ranks
            await until(pilot, lambda: len(list(read_records(history))) == 12)
            hub.kill(signal.SIGKILL)
            await until(pilot, lambda: "disconnected, retrying" in header(app), timeout=15)
            start_hub("tuiD")  # same job: reopens the history, same record numbers
            for s in range(6, 9):
                ranks.step(s)
            # every rank's step 8: each rank's socket reconnects to the new hub on its own, so
            # rank 1's steps can arrive after rank 0's (waiting for rank 0 alone raced)
            await until(pilot, lambda: {c[COL["step"]] for c in cells(app).values()} == {"8"},
                        timeout=20)
            assert "hub connected" in header(app) and feed.attaches == 2
            with app.data.lock:
                steps = app.data.by_type["step"]
                assert steps == 16 and app.data.records == app.data.next_seq

    asyncio.run(scenario())


def test_attach_without_a_job_offers_the_live_jobs(home, start_hub, zctx):
    assert "no live scalemon job" in make_app(None, home=home)
    start_hub("tuiE1")
    hub2 = start_hub("tuiE2")
    ranks = SimSender(zctx, hub2.address, SimJob(job="tuiE2", ranks=1, gpu=False, amp=False))
    ranks.hello()
    ranks.step(1)
    app = make_app(None, home=home)
    assert isinstance(app, DashboardApp)

    async def scenario() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: isinstance(app.screen, PickJobScreen))
            order = [j.job for j in app.screen.jobs]
            await pilot.press(*(["down"] * order.index("tuiE2")), "enter")
            await until(pilot, lambda: isinstance(app.screen, OverviewScreen))
            await until(pilot, lambda: "job tuiE2" in header(app) and len(cells(app)) == 1)

    asyncio.run(scenario())
    assert "no live hub and no history" in make_app("nosuchjob", home=home)


def test_a_hub_with_a_new_history_under_the_same_job_makes_the_dashboard_start_over(
        home, start_hub, zctx):
    hub = start_hub("tuiF")
    sim = SimJob(job="tuiF", ranks=2, gpu=False, amp=False)
    ranks = SimSender(zctx, hub.address, sim)

    async def scenario() -> None:
        app = DashboardApp(HubFeed(job="tuiF", home=home, timeout_s=1.0, retry_s=0.3))
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause(0.5)
            ranks.hello()
            for s in range(1, 11):
                ranks.step(s)
            await until(pilot, lambda: len(cells(app)) == 2
                        and cells(app)[1][COL["step"]] == "10")
            hub.kill(signal.SIGKILL)
            history_path("tuiF", home).unlink()
            await until(pilot, lambda: "disconnected, retrying" in header(app), timeout=15)
            start_hub("tuiF")  # numbering starts at 0 again
            one = SimSender(zctx, hub.address, SimJob(job="tuiF", ranks=1, gpu=False,
                                                      amp=False))
            one.hello()
            for s in range(500, 503):
                one.step(s)
            await until(pilot, lambda: list(cells(app)) == [0]
                        and cells(app)[0][COL["step"]] == "502", timeout=20)
            with app.data.lock:
                assert app.data.by_type == {"hello": 1, "step": 3}

    asyncio.run(scenario())


def test_many_ranks_scroll_and_mouse_selection():
    """40 ranks in 80x24: End scrolls to the last rank and its row gets its text; a click
    moves the cursor, a click on the highlighted row opens its detail."""
    app = simulated_app(ranks=40, gpu=True, steps=30, straggler=None)

    async def scenario() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: len(app.screen.query_one(RankTable).rank_ids) == 40)
            table = app.screen.query_one(RankTable)
            assert 39 not in table.rows  # off screen: not formatted
            await pilot.press("end")
            await until(pilot, lambda: 39 in table.rows and table.rank_at_cursor() == 39)
            assert table.rows[39].cells[COL["step"]] == "30"
            assert table.scroll_offset.y > 0
            await pilot.press("home")
            await until(pilot, lambda: table.scroll_offset.y == 0)
            await pilot.click(RankTable, offset=(10, 3))  # header is line 0: rank 2
            await until(pilot, lambda: table.rank_at_cursor() == 2)
            await pilot.click(RankTable, offset=(10, 3))
            await until(pilot, lambda: isinstance(app.screen, RankDetailScreen))
            assert app.screen.rank == 2
            assert app.data.loss_mode == "auto"  # 40 ranks: a band
            await pilot.press("l")  # from the detail the app's binding still works
            assert app.data.loss_mode == "ranks"
            await pilot.press("escape")
            await until(pilot, lambda: isinstance(app.screen, OverviewScreen))
            loss = app.screen.query_one("#plot-loss", LinePlot)
            await until(pilot, lambda: len(loss.spec.lines) == 40)  # a line per rank now
            assert [line.label for line in loss.spec.lines][:3] == ["r0", "r1", "r2"]
            await pilot.press("l")
            await until(pilot, lambda: [line.band for line in loss.spec.lines] == [True, False])

    asyncio.run(scenario())


def test_attach_to_a_job_whose_hub_is_gone_replays_its_history(home, start_hub, zctx):
    hub = start_hub("tuiG")
    ranks = SimSender(zctx, hub.address, SimJob(job="tuiG", ranks=2, gpu=False, amp=False))
    ranks.hello()
    for s in range(1, 8):
        ranks.step(s)
    # in the file: 2 hellos and 7 steps of 2 ranks
    wait_for(lambda: len(list(read_records(history_path("tuiG", home)))) == 16)
    hub.kill(signal.SIGTERM)  # removes its job file
    app = make_app("tuiG", home=home)
    assert isinstance(app, DashboardApp)

    async def scenario() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: len(cells(app)) == 2
                        and cells(app)[1][COL["step"]] == "7")
            assert "hub offline" in header(app)

    asyncio.run(scenario())


def test_the_cursor_row_comes_into_view_when_moved_before_the_new_rows_are_laid_out():
    """End pressed in the same tick as 50 new ranks arrive: the scroll must wait for the new
    size, or it is clamped to the old one (the top) and the last row is never shown."""
    from textual.app import App, ComposeResult

    from scalemon.tui.views.rows import Row

    class TableOnly(App[None]):
        def compose(self) -> ComposeResult:
            yield RankTable(id="ranks")

    async def scenario() -> None:
        app = TableOnly()
        async with app.run_test(size=(60, 16)) as pilot:
            await pilot.pause(0.1)
            table = app.query_one(RankTable)
            blank = ("",) * (len(COLUMNS) - 1)
            table.show_rows(list(range(50)), [Row(r, (str(r), *blank), "") for r in range(50)])
            table.action_cursor_to(-1)
            await until(pilot, lambda: table.scroll_offset.y > 0)
            rows_shown = table.scrollable_content_region.height - 1
            top = table.scroll_offset.y
            assert table.rank_at_cursor() == 49 and top <= 49 < top + rows_shown

    asyncio.run(scenario())


def test_a_hub_of_another_protocol_version_is_named_in_the_header(home, start_hub):
    hub = start_hub("tuiV", version="2.0")

    async def scenario() -> None:
        app = DashboardApp(HubFeed(address=hub.address, timeout_s=1.0, retry_s=0.3))
        async with app.run_test(size=(160, 30)) as pilot:
            await until(pilot, lambda: "hub incompatible" in header(app))
            ours = version_text(PROTOCOL_VERSION)
            assert f"speaks scalemon protocol 2.0, this dashboard {ours}" in header(app)
            assert "disconnected" not in header(app)

    asyncio.run(scenario())


def test_screens_ask_their_host_app_through_messages():
    """The overview works in any app that answers its messages (no reaching into the app)."""
    from textual.app import App
    from textual.css.query import NoMatches

    from scalemon.tui.messages import OpenRank, RedrawNeeded
    from scalemon.tui.model import DashboardData

    sim = SimJob(ranks=3, gpu=False, amp=False)
    data = DashboardData()
    data.apply_messages(sim.run(5))

    class Host(App[None]):
        def __init__(self) -> None:
            super().__init__()
            self.opened: list[int] = []
            self.redraws = 0

        def on_mount(self) -> None:
            self.push_screen(OverviewScreen())
            self.set_interval(0.05, self.draw)

        def draw(self) -> None:
            """As DashboardApp's tick: only a screen whose widgets are composed."""
            screen = self.screen
            if isinstance(screen, OverviewScreen) and screen.is_mounted:
                with contextlib.suppress(NoMatches):
                    screen.refresh_view(data, sim.end_t(5), True)

        def on_open_rank(self, message: OpenRank) -> None:
            self.opened.append(message.rank)

        def on_redraw_needed(self, message: RedrawNeeded) -> None:
            self.redraws += 1

    async def scenario() -> None:
        app = Host()
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: len(app.screen.query_one(RankTable).rows) == 3)
            await pilot.press("down", "enter")
            await until(pilot, lambda: app.opened == [1])

    asyncio.run(scenario())


def test_text_from_a_rank_is_shown_as_typed_never_read_as_markup():
    """An exit reason, an error and a log() extra holding Rich markup brackets: the rank's
    detail opens and shows them literally (a stray "[/x]" used to raise MarkupError)."""
    from scalemon.protocol import Message
    from scalemon.tui.model import DashboardData

    sim = SimJob(ranks=1, gpu=False, amp=False)
    messages = sim.run(3)
    messages.append(Message("step", "sim", 0, 998, sim.end_t(3),
                            {"step": 4, "extra": {"note": "[/] [bold]x"}}))
    messages.append(Message("exit", "sim", 0, 999, sim.end_t(3),
                            {"reason": "[red]boom[/red]", "exit_code": 1,
                             "error": "KeyError: '[/x]'"}))
    data = DashboardData()
    data.apply_messages(messages)

    async def scenario() -> None:
        app = DashboardApp(data=data, clock=lambda: sim.end_t(3) + 1)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: len(cells(app)) == 1)
            app.open_rank(0)
            await until(pilot, lambda: isinstance(app.screen, RankDetailScreen)
                        and app.screen.query("#detail-title"))
            title = app.screen.query_one("#detail-title")
            await until(pilot, lambda: "exited ([red]boom[/red])" in str(title.render()))
            # the facts were updated with the title; their new height is laid out at a refresh
            await until(pilot, lambda: "KeyError" in screen_text(app))
            text = screen_text(app)
            assert "KeyError: '[/x]'" in text and "note=[/] [bold]x" in text
            assert isinstance(app.screen, RankDetailScreen)  # still up, nothing raised

    asyncio.run(scenario())


def test_the_footer_is_composed_again_only_when_its_keys_change():
    """Textual recomposes the footer at each focus or screen change; the same keys keep their
    widgets (only the fit is redone), and another screen's keys replace them."""
    from textual.widgets._footer import FooterKey

    from scalemon.tui.screens.collectives import CollectivesScreen
    from scalemon.tui.widgets.fit import KeysFooter

    app = simulated_app(ranks=4, gpu=False, steps=5)

    def keys() -> dict[str, FooterKey]:
        footer = app.screen.query_one(KeysFooter)
        return {k.description: k for k in footer.query(FooterKey)}

    async def scenario() -> None:
        async with app.run_test(size=(160, 40)) as pilot:
            await until(pilot, lambda: "Rank detail" in keys())  # the rank table focused
            await pilot.pause(0.3)  # the overview's keys settled
            before = keys()
            footer, fitted = app.screen.query_one(KeysFooter), []
            fit = footer.fit_keys  # the last thing a recompose does, either way
            footer.fit_keys = lambda: (fit(), fitted.append(True))  # type: ignore[method-assign]
            # as the screen says it, from the footer's own queue: the same keys
            footer.call_later(footer.bindings_changed, app.screen)
            await until(pilot, lambda: fitted)
            assert keys() == before and all(keys()[d] is k for d, k in before.items())
            await pilot.press("c")
            await until(pilot, lambda: isinstance(app.screen, CollectivesScreen)
                        and "Back" in keys() and "Rank detail" not in keys())
            await pilot.press("escape")
            await until(pilot, lambda: "Rank detail" in keys() and "Back" not in keys())

    asyncio.run(scenario())
