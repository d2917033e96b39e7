"""The flags and log screens of the real app (App.run_test + Pilot), on job states folded from
protocol messages (each encoded and decoded as the hub passes it on): tiers, values and
mismatches, the toggle audit, changing a flag through an injected sender, the header's note,
and the log's filters."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from test_tui_app import SimSender, cells, header, until
from test_tui_collectives import line_with
from test_tui_snapshots import screen_text

from scalemon import protocol
from scalemon.protocol import HUB_RANK, Message, ProtocolError
from scalemon.tui.app import DashboardApp
from scalemon.tui.feed import HubFeed
from scalemon.tui.model import DashboardData
from scalemon.tui.requests import NO_HUB_FLAGS
from scalemon.tui.screens.flags import FlagsScreen, ToggleDialog
from scalemon.tui.screens.help import HELP
from scalemon.tui.screens.log import LogScreen
from scalemon.tui.screens.overview import OverviewScreen
from scalemon.tui.sim import SimJob
from scalemon.tui.views.log import GLOO_HELP, parse_filter

RANKS = 3


def encoded(messages: list[Message]) -> list[Message]:
    """Each message through the wire format (checks it is a valid one)."""
    return [protocol.decode(protocol.encode(m.type, m.job, m.rank, m.seq, m.body, t=m.t))
            for m in messages]


def flags_body(**values: str | None) -> dict[str, Any]:
    return {"values": values, "notes": {}, "restart": {"ok": True, "reason": ""},
            "rebuild": True}


def job(algo_on_rank_2: str = "Ring") -> tuple[SimJob, DashboardData, float]:
    """Three ranks that ran 5 steps and reported their flags (rank 2's NCCL_ALGO differs),
    then a toggle of NCCL_DEBUG the hub planned; returns the job, the data and the time
    after."""
    sim = SimJob(job="flagjob", ranks=RANKS, gpu=False, amp=False)
    messages = sim.run(5)
    t = sim.end_t(5)
    for rank in range(RANKS):
        algo = algo_on_rank_2 if rank == 2 else "Ring"
        messages.append(sim.message(rank, "flags", flags_body(
            NCCL_DEBUG="WARN", NCCL_ALGO=algo, TORCH_DISTRIBUTED_DEBUG=None), t))
    messages.append(sim.message(HUB_RANK, "toggle", {
        "id": 1, "name": "NCCL_DEBUG", "value": "INFO", "state": "requested", "tier": "live",
        "user": "alice", "client_host": "login1", "at_step": 9, "step": None,
        "text": "NCCL_DEBUG=INFO (live) planned for step 9 on 3 rank(s)"}, t + 0.1))
    data = DashboardData()
    data.apply_messages(encoded(messages))
    return sim, data, t + 0.5


class Sender:
    """A `send_toggle` that records its calls and answers like the hub."""

    def __init__(self, refuse: str | None = None) -> None:
        self.calls: list[tuple[str, str, bool]] = []
        self.refuse = refuse

    def __call__(self, name: str, value: str, restart: bool) -> dict[str, Any]:
        self.calls.append((name, value, restart))
        if self.refuse:
            raise ProtocolError(self.refuse)
        return {"id": 7, "tier": "live", "at_step": 12, "ranks": [0, 1, 2],
                "text": f"{name}={value} (live) planned for step 12 on 3 rank(s)"}


async def open_flags(pilot, app: DashboardApp) -> None:
    await until(pilot, lambda: isinstance(app.screen, OverviewScreen) and app.redraws)
    await pilot.press("f")
    await until(pilot, lambda: isinstance(app.screen, FlagsScreen)
                and "NCCL_ALGO" in (t := screen_text(app)) and "alice@login1" in t)


def test_flags_screen_shows_tiers_values_a_mismatch_and_the_audit():
    sim, data, now = job(algo_on_rank_2="Tree")

    async def scenario() -> None:
        app = DashboardApp(data=data, clock=lambda: now)
        async with app.run_test(size=(140, 50)) as pilot:
            await until(pilot, lambda: "toggle NCCL_DEBUG=INFO: requested" in header(app))
            await open_flags(pilot, app)
            # the table's columns take their widths at a later layout pass than its first rows
            await until(pilot, lambda: "MISMATCH 0,1: Ring · 2: Tree" in screen_text(app))
            text = screen_text(app)
            assert line_with(text, "NCCL_DEBUG ", "live", "WARN")
            assert line_with(text, "TORCH_DISTRIBUTED_DEBUG", "live", "unset")
            assert line_with(text, "NCCL_P2P_DISABLE", "restart", "unset")
            assert line_with(text, "NCCL_PROTO", "new comm", "unset")
            assert line_with(text, "NCCL_ALGO", "new comm", "MISMATCH 0,1: Ring · 2: Tree")
            assert "differ across ranks: NCCL_ALGO" in text
            assert line_with(text, "alice@login1", "NCCL_DEBUG=INFO", "live", "9", "requested",
                             "planned for step 9")
            assert "3 of 3 ranks reported their flags" in text
            # the why of the row under the cursor (the first: NCCL_DEBUG)
            assert "ncclResetDebugInit()" in text and "VERSION, WARN, INFO, TRACE" in text
            await pilot.press("down")
            await until(pilot, lambda: "re-read with NCCL_DEBUG" in screen_text(app))

            # the toggle applied at step 9: the audit says so, the header's note goes
            data.apply_messages(encoded([sim.message(HUB_RANK, "toggle", {
                "id": 1, "name": "NCCL_DEBUG", "value": "INFO", "state": "applied",
                "step": 9, "text": "applied on 3 rank(s) from step 9"}, now + 1)]))
            await until(pilot, lambda: "applied on 3 rank(s)" in screen_text(app))
            row = line_with(screen_text(app), "alice@login1", "NCCL_DEBUG=INFO").split()
            assert "applied" in row and row[row.index("applied") - 1] == "9"
            await pilot.press("escape")
            await until(pilot, lambda: isinstance(app.screen, OverviewScreen))
            await until(pilot, lambda: "flags differ across ranks: NCCL_ALGO (f)"
                        in header(app))
            titles = [c.title for c in app.get_system_commands(app.screen)]
            assert "Flags" in titles and "Log" in titles

    asyncio.run(scenario())
    assert "- `f`: flags" in HELP and "- `L`: log" in HELP


def test_submitting_a_value_calls_the_sender_and_shows_its_reply():
    sim, data, now = job()
    sender = Sender()

    async def scenario() -> None:
        app = DashboardApp(data=data, clock=lambda: now)
        app.send_toggle = sender
        async with app.run_test(size=(140, 50)) as pilot:
            await open_flags(pilot, app)
            assert "MISMATCH" not in screen_text(app)
            await pilot.press("enter")  # the first row: NCCL_DEBUG
            await until(pilot, lambda: isinstance(app.screen, ToggleDialog))
            assert app.screen.query_one("#toggle-input").value == "NCCL_DEBUG=WARN"
            await pilot.press(*["backspace"] * 4, *"INFO", "enter")
            await until(pilot, lambda: isinstance(app.screen, FlagsScreen)
                        and "toggle #7: NCCL_DEBUG=INFO (live) planned for step 12"
                        in screen_text(app))
            assert sender.calls == [("NCCL_DEBUG", "INFO", False)]

            # R: the same with a restart; the hub's refusal is shown
            sender.refuse = "refused: no rank of the job is running"
            await pilot.press("R")
            await until(pilot, lambda: isinstance(app.screen, ToggleDialog))
            assert "restart the job" in screen_text(app)
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, FlagsScreen)
                        and "the hub refused NCCL_DEBUG=WARN: refused: no rank" in
                        screen_text(app))
            assert sender.calls[-1] == ("NCCL_DEBUG", "WARN", True)

    asyncio.run(scenario())


def test_a_value_the_catalogue_refuses_never_reaches_the_sender():
    sim, data, now = job()
    sender = Sender()

    async def scenario() -> None:
        app = DashboardApp(data=data, clock=lambda: now)
        app.send_toggle = sender
        async with app.run_test(size=(140, 50)) as pilot:
            await open_flags(pilot, app)
            await pilot.press("t")
            await until(pilot, lambda: isinstance(app.screen, ToggleDialog))
            await pilot.press("ctrl+u", *"LD_PRELOAD=x", "enter")
            await until(pilot, lambda: "LD_PRELOAD is not a flag scalemon changes"
                        in screen_text(app))
            assert isinstance(app.screen, ToggleDialog)  # stays open to be corrected
            await pilot.press("ctrl+u", *"NCCL_DEBUG=LOUD", "enter")
            await until(pilot, lambda: "expected one of VERSION, WARN" in screen_text(app))
            await pilot.press("escape")
            await until(pilot, lambda: isinstance(app.screen, FlagsScreen))
            assert "refused: NCCL_DEBUG='LOUD'" in screen_text(app)  # the status line
            assert sender.calls == []

    asyncio.run(scenario())


def test_without_a_hub_the_default_sender_says_flags_need_a_live_job():
    sim, data, now = job()

    async def scenario() -> None:
        app = DashboardApp(data=data, clock=lambda: now)
        async with app.run_test(size=(160, 50)) as pilot:
            await open_flags(pilot, app)
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, ToggleDialog))
            await pilot.press("enter")
            await until(pilot, lambda: NO_HUB_FLAGS[:40] in screen_text(app))
            assert app.toggle_status is not None and not app.toggle_status[1]

    asyncio.run(scenario())


def test_a_change_goes_to_the_live_hubs_control_socket_and_its_audit_record_comes_back(
        start_hub, zctx):
    hub = start_hub("tuiF")
    sim = SimJob(job="tuiF", ranks=2, gpu=False, amp=False)
    ranks = SimSender(zctx, hub.address, sim)

    async def scenario() -> None:
        app = DashboardApp(HubFeed(address=hub.address))
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.pause(0.5)
            ranks.hello()
            for step in range(1, 4):
                ranks.step(step)
            for rank in range(2):
                ranks.send(rank, "flags", flags_body(NCCL_DEBUG="WARN"))
            await until(pilot, lambda: len(cells(app)) == 2)
            await pilot.press("f")
            await until(pilot, lambda: isinstance(app.screen, FlagsScreen)
                        and "2 of 2 ranks reported" in screen_text(app))
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, ToggleDialog))
            await pilot.press(*["backspace"] * 4, *"INFO", "enter")
            await until(pilot, lambda: "planned for step" in screen_text(app))
            assert app.toggle_status is not None and app.toggle_status[1], app.toggle_status
            assert app.toggle_status[0].startswith("toggle #1: NCCL_DEBUG=INFO (live)")
            # the hub's `toggle` record reaches the audit through the feed
            await until(pilot, lambda: any(
                "NCCL_DEBUG=INFO" in line and "@" in line and "requested" in line
                for line in screen_text(app).splitlines()))

    asyncio.run(scenario())


NCCL_LINES = [
    "node0:100:110 [{r}] NCCL INFO Channel 00/02 : 0 1 2",
    "node0:100:110 [{r}] NCCL INFO AllReduce: opCount 0 sendbuff 0x7f count 1024",
    "node0:100:110 [{r}] NCCL WARN Call to ibv_open_device failed",
]


def test_log_screen_filters_by_rank_source_level_and_text():
    sim, data, now = job()
    lines = []
    for rank in range(RANKS):
        lines.append(sim.message(rank, "log_lines", {
            "source": "nccl", "lines": [x.format(r=rank) for x in NCCL_LINES],
            "dropped": 4 if rank == 1 else 0}, now))
        lines.append(sim.message(rank, "log_lines", {
            "source": "stderr", "lines": [f"[W rank{rank}] ProcessGroupNCCL.cpp: a warning"]},
            now))

    async def scenario() -> None:
        app = DashboardApp(data=data, clock=lambda: now)
        async with app.run_test(size=(140, 50)) as pilot:
            await until(pilot, lambda: app.redraws)
            await pilot.press("L")
            await until(pilot, lambda: isinstance(app.screen, LogScreen)
                        and GLOO_HELP in " ".join(screen_text(app).split()))  # gloo ranks
            data.apply_messages(encoded(lines))

            def rows_drawn(text: str) -> bool:
                """As many rows on the screen as its count says (they can land in a later
                frame than the count on a loaded machine); True for an error instead."""
                shown = re.search(r"(\d+) shown", text)
                rows = [line for line in text.splitlines()
                        if re.match(r"\s+\d+ (nccl|stderr)\s", line)]
                return shown is None or len(rows) == int(shown.group(1))

            # the count and the rows can land in different frames (a loaded machine): wait for
            # every row the count names (a predicate that returns False, never one that raises)
            await until(pilot, lambda: "12 shown" in screen_text(app)
                        and rows_drawn(screen_text(app)))
            text = screen_text(app)
            assert "12 kept  ·  12 received" in text and "dropped by the agents: rank 1: 4" in text
            assert line_with(text, "   2 nccl", "NCCL WARN Call to ibv_open_device")
            assert line_with(text, "   0 stderr", "[W rank0] ProcessGroupNCCL.cpp")

            async def query(q: str) -> str:
                await pilot.press("slash", "ctrl+u", *q)
                await until(pilot, lambda: app.screen._drawn is not None
                            and app.screen._drawn[2] == q and rows_drawn(screen_text(app)))
                return screen_text(app)

            text = await query("rank:1")
            assert "4 shown" in text and " 1 nccl" in text
            assert "   0 " not in text and "   2 " not in text
            text = await query("rank:0,2 src:nccl sub:warn")
            assert "2 shown" in text
            assert line_with(text, "   0 nccl", "WARN") and line_with(text, "   2 nccl", "WARN")
            text = await query("sub:allreduce")
            assert "3 shown" in text and "opCount 0" in text
            text = await query("rank:2 OPCOUNT 0")
            assert "1 shown" in text and line_with(text, "   2 nccl", "AllReduce: opCount 0")
            text = await query("rank:x")
            assert "rank:x is not a list of ranks" in text
            text = await query("src:stderr warning")
            assert "3 shown" in text and "NCCL INFO" not in text
            await pilot.press("enter", "escape")  # filter bar -> lines -> back
            await until(pilot, lambda: isinstance(app.screen, OverviewScreen))

    asyncio.run(scenario())


def test_parse_filter():
    f = parse_filter("rank:0,2-3 src:NCCL sub:INFO Ring  tree")
    assert (f.ranks, f.source, f.sub, f.text, f.error) == ({0, 2, 3}, "nccl", "INFO",
                                                           "ring tree", "")
    assert parse_filter("src:all").source is None
    assert parse_filter("src:gpu").error.startswith("src:gpu")


def test_the_audit_row_shows_the_nccl_line_counts_once_they_came():
    """An applied NCCL_DEBUG toggle: each rank promised a count (`log_window_s`), then sent it
    (a second `toggle_result`, merged); the audit row says how many came, never more."""
    from scalemon.tui.views.flags import flags_view

    sim, data, t = job()
    result = {"id": 1, "name": "NCCL_DEBUG", "value": "INFO", "outcome": "applied", "step": 9,
              "text": "NCCL re-read its debug settings", "log_window_s": 3.0}
    data.apply_messages(encoded(
        [sim.message(r, "toggle_result", result, t + r * 0.01) for r in range(RANKS)]
        + [sim.message(HUB_RANK, "toggle", {"id": 1, "name": "NCCL_DEBUG", "value": "INFO",
                                            "state": "applied", "step": 9,
                                            "text": "NCCL_DEBUG=INFO in effect"}, t + 0.1)]))
    assert "NCCL log: no count yet" in flags_view(data).audit[0].cells[-1]
    counts = {0: 40, 1: 0, 2: 2}
    data.apply_messages(encoded([sim.message(r, "toggle_result", {
        **result, "log_lines": n, "text": f"{n} NCCL log line(s)" if n else
        "no NCCL log line in the 3 s after it was applied: no step finished since"},
        t + 3.2) for r, n in counts.items()]))
    text = flags_view(data).audit[0].cells[-1]
    assert "NCCL_DEBUG=INFO in effect" in text
    assert "NCCL log: 42 line(s) in the 3 s after it was applied (rank 0: 40, rank 1: 0, " \
           "rank 2: 2); none on rank(s) [1] (rank 1: no step finished since)" in text, text
    with data.lock:  # the first answers' outcome and text stay
        results = data.state.flags.toggles[1]["results"]
    assert {r["outcome"] for r in results.values()} == {"applied"}
    assert results["1"]["text"] == "NCCL re-read its debug settings"
