"""The collectives and hang screens of the real app (App.run_test + Pilot), on job states folded
from protocol messages (a simulated job's, each encoded and decoded as the hub passes it on),
and against a real hub process where the hub takes part (stragglers, Flight Recorder dumps)."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_tui_app import COL, SimSender, cells, header, until
from test_tui_snapshots import screen_text

from scalemon import protocol
from scalemon.protocol import Message
from scalemon.reports.hangs import job_hang
from scalemon.tui.app import NO_HUB, DashboardApp
from scalemon.tui.attach import make_app
from scalemon.tui.feed import HubFeed
from scalemon.tui.model import DashboardData
from scalemon.tui.screens.collectives import CollectivesScreen
from scalemon.tui.screens.hang import HangScreen
from scalemon.tui.screens.help import HELP
from scalemon.tui.screens.overview import OverviewScreen
from scalemon.tui.sim import GROUP, SimJob
from scalemon.tui.views.collectives import BUSBW_HELP, HEAT_RANKS, collectives
from scalemon.tui.widgets.heatmap import SHADES, HeatMap, head_text, levels


def encoded(messages: list[Message]) -> list[Message]:
    """Each message through the wire format (checks it is a valid one)."""
    return [protocol.decode(protocol.encode(m.type, m.job, m.rank, m.seq, m.body, t=m.t))
            for m in messages]


def folded(messages: list[Message]) -> DashboardData:
    data = DashboardData()
    data.apply_messages(encoded(messages))
    return data


def wire_row(messages: list[Message], op: str, bucket: int) -> dict[str, float]:
    """One (op, size bucket) of the default group summed from the `collectives` messages:
    one rank's count and bytes, every rank's durations."""
    count = {}
    nbytes = {}
    timed, time_sum = 0, 0.0
    for m in messages:
        if m.type != "collectives":
            continue
        for g, o, b, n, size, t_n, t_sum, _, _ in m.body["stats"]:
            if (g, o, b) == (GROUP, op, bucket):
                count[m.rank] = count.get(m.rank, 0) + n
                nbytes[m.rank] = nbytes.get(m.rank, 0) + size
                timed += t_n
                time_sum += t_sum
    return {"count": max(count.values()), "bytes": max(nbytes.values()),
            "mean": time_sum / timed}


def line_with(text: str, *needles: str) -> str:
    """The screen line that holds every needle."""
    lines = [line for line in text.splitlines() if all(n in line for n in needles)]
    assert lines, f"no line with {needles} in:\n{text}"
    return lines[0]


def test_collectives_screen_shows_ops_counts_busbw_heat_map_skew_and_recorder_health():
    sim = SimJob(ranks=4, gpu=True, straggler=2, wrapped=1, seed=3)
    messages = sim.run(60)
    data = folded(messages)
    now = sim.end_t(60) + 0.4
    grads = wire_row(messages, "all_reduce", 25)  # the 25 MiB gradient buckets
    per_op = grads["bytes"] / grads["count"]
    busbw = per_op / grads["mean"] * (2 * 3 / 4) / 1e9  # all_reduce over n = 4 ranks

    async def scenario() -> None:
        app = DashboardApp(data=data, clock=lambda: now)
        async with app.run_test(size=(140, 60)) as pilot:
            await until(pilot, lambda: len(cells(app)) == 4)
            await pilot.press("c")
            await until(pilot, lambda: isinstance(app.screen, CollectivesScreen)
                        and "all_reduce" in (t := screen_text(app)) and "ring wrapped" in t)
            text = screen_text(app)
            row = line_with(text, "≤ 32 MiB").split()
            assert str(grads["count"]) in row and f"{busbw:.3g}" in row
            assert line_with(text, "default_pg", "all_reduce", "all")  # the op's total
            assert line_with(text, "barrier").split()[-1] == "n/a"  # busbw
            assert line_with(text, "n/a: barrier moves no data")  # why: once, under the table
            assert BUSBW_HELP[:60] in text and "1 GB = 1e9 B" in text

            heat = app.screen.query_one(HeatMap)
            assert heat.heat is not None and heat.heat.ranks == [0, 1, 2, 3]
            shades = [levels(heat.heat.cells[i], heat.heat.top) for i in range(4)]
            hottest = len(SHADES) - 1
            # the first columns: start-up, on time (its collectives may straddle two of the
            # heat's 1 s cells); every step's after them: late
            shown = [s for s in shades[2] if s >= 0]
            hot = next(i for i, s in enumerate(shown) if s >= hottest - 1)
            assert 1 <= hot <= 2 and all(s <= 1 for s in shown[:hot])
            assert len(shown) >= 5 and all(s >= hottest - 1 for s in shown[hot:])
            assert all(s <= 1 for r in (0, 1, 3) for s in shades[r])
            assert any(line.startswith("    2 ") for line in heat.text_rows())

            late = data.state.ranks[2].value("arrival_lateness_s")
            ranking = text[text.index("arrival skew by rank"):]
            lines = ranking.splitlines()
            heading = next(i for i, line in enumerate(lines) if "late ms" in line)
            first = lines[heading + 1].split()
            assert first[:2] == ["2", f"{late * 1e3:.1f}"]
            lost = data.state.ranks[1].metrics["recorder_lost"]
            assert lost > 0 and f"ring wrapped between reads on rank 1 ({lost} entries)" in text
            rank1 = next(line.split() for line in lines[heading + 1:]
                         if line.split()[:1] == ["1"])
            assert rank1[-3] == str(lost)  # ... recorder entries, lost, read ms, read %

            await pilot.press("escape")
            await until(pilot, lambda: isinstance(app.screen, OverviewScreen))
            titles = [c.title for c in app.get_system_commands(app.screen)]
            assert "Collectives" in titles and "Hang view" in titles

    asyncio.run(scenario())
    assert "- `c`: collectives" in HELP and "- `h`: hang view" in HELP


def test_gloo_collectives_without_durations_say_why():
    sim = SimJob(ranks=2, gpu=False, amp=False)
    view = collectives(folded(sim.run(20)), heat_columns=40)
    rows = view.rows
    broadcast = next(r for r in rows if r.cells[1] == "broadcast")
    assert broadcast.cells[6:9] == ("n/a", "n/a", "n/a")  # p50, p99, busbw
    assert broadcast.note.startswith("n/a: gloo records no duration")
    assert [n for n in view.notes if "gloo" in n] == [broadcast.note]  # said once
    broadcast = broadcast.cells
    grads = next(r.cells for r in rows if r.cells[3] == "≤ 32 MiB")  # host-timed: all known
    assert "n/a" not in grads[6:9]


def test_the_header_names_the_rank_with_the_largest_arrival_lateness_first(start_hub, zctx):
    hub = start_hub("tuiS")
    sim = SimJob(job="tuiS", ranks=4, gpu=False, amp=False)
    ranks = SimSender(zctx, hub.address, sim)
    late = {0: 0.0, 1: 0.015, 2: 0.060, 3: 0.002}  # rank 2 is the latest, then rank 1

    def issue(first_seq: int) -> None:
        base = time.time() - 5.0
        groups = {GROUP: {"desc": "default_pg", "ranks": [0, 1, 2, 3]}}
        for rank in range(4):
            issues = [[GROUP, seq, base + 0.1 * seq + late[rank]]
                      for seq in range(first_seq, first_seq + 20)]
            ranks.send(rank, "collectives", {"groups": groups, "stats": [], "issues": issues,
                                             "step": 10})

    async def scenario() -> None:
        app = DashboardApp(HubFeed(address=hub.address))
        async with app.run_test(size=(160, 40)) as pilot:
            await pilot.pause(0.5)
            ranks.hello()
            for step in range(1, 11):
                ranks.step(step)
            issue(1)
            await until(pilot, lambda: "stragglers rank 2" in header(app))
            assert "stragglers rank 2 +60 ms, rank 1 +15 ms (arrival at collectives" in \
                header(app)
            table = cells(app)
            assert table[2][COL["arrival_lateness_s"]] == "60.0"
            assert table[1][COL["arrival_lateness_s"]] == "15.0"
            assert table[3][COL["arrival_lateness_s"]] == "2.0"  # under 10 ms: not named

    asyncio.run(scenario())


def hung_job(culprit: int = 1) -> tuple[SimJob, list[Message], float]:
    """Three ranks that ran 20 steps; then `culprit` never issues the next all-reduce and the
    others wait in it: heartbeats 15 s after the last step (with stacks). Returns the time."""
    sim = SimJob(ranks=3, gpu=True, amp=False)
    messages = sim.run(20)
    messages += sim.hang(culprit, 20, stuck_s=15.0)
    return sim, messages, sim.end_t(20) + 15.0


def test_a_hang_switches_to_the_hang_view_once_per_hang_naming_the_culprit_with_stacks():
    sim, messages, t = hung_job(culprit=1)
    seq = sim.coll_seq + 1  # the all-reduce rank 1 never issued
    report = "Collective operations: 3 ranks, [1] missing: 1 rank (node0)"
    messages.append(sim.message(0, "info", {"key": "nccl_ras", "value": {
        "t": t, "status": report, "error": None}}, t))
    data = folded(messages)
    clock = [t + 0.5]

    async def scenario() -> None:
        app = DashboardApp(data=data, clock=lambda: clock[0])
        async with app.run_test(size=(120, 50)) as pilot:
            await until(pilot, lambda: isinstance(app.screen, HangScreen)
                        and "run_backward(" in screen_text(app))
            text = screen_text(app)
            label = "default_pg [0,1,2]"
            assert (f"rank 1 never issued all_reduce #{seq} of {label} (in Python: data.py:41 "
                    f"in _load()); ranks 0,2 wait in all_reduce #{seq} of {label} for rank 1 "
                    "(15 s)") in " ".join(text.split())
            # the culprit with its cause and frame, the waiting ranks with what they wait in
            assert line_with(text, "rank 1: python, data.py:41 in _load(); never issued")
            assert line_with(text, f"ranks 0,2: waiting in all_reduce #{seq} of {label} for "
                             "rank 1 (15 s)")
            assert line_with(text, " 1 ", "culprit", "python", "data.py:41 in _load()",
                             f"{seq - 1}/{seq - 1}")
            assert line_with(text, " 0 ", "waiting", "collective", f"default_pg #{seq}")
            # a stack for every rank, shown as typed ("[0042]" is no markup)
            assert "rank 1  ·  culprit" in text and "shard-[0042].npy" in text
            assert "ranks 0,2  ·  waiting  ·  the same stack" in text
            assert "Variable._execution_engine.run_backward(" in text
            assert "NCCL RAS on node0 (via rank 0)" in text and report in text

            await pilot.press("d")  # no hub behind this app: it says so
            await until(pilot, lambda: NO_HUB in screen_text(app))

            await pilot.press("escape")
            await until(pilot, lambda: isinstance(app.screen, OverviewScreen))
            await until(pilot, lambda: "HUNG" in header(app))
            assert "rank 1 never issued" in header(app)
            await pilot.pause(0.5)
            assert isinstance(app.screen, OverviewScreen)  # once per hang, not again

            # the job goes on, then hangs again: a new hang, shown by itself again
            resumed = t + 1.0
            data.apply_messages(encoded([sim.message(r, "step", body, resumed)
                                         for r, body in enumerate(sim.step_bodies(21, t))]))
            clock[0] = resumed + 0.5
            await until(pilot, lambda: "HUNG" not in header(app))
            again = [sim.message(m.rank, "heartbeat", m.body, resumed + 12.0)
                     for m in sim.hang(1, 21)]
            data.apply_messages(encoded(again))
            clock[0] = resumed + 12.5
            await until(pilot, lambda: isinstance(app.screen, HangScreen))

    asyncio.run(scenario())


def test_h_opens_the_hang_view_and_d_asks_the_live_hub_for_a_dump(start_hub, zctx):
    hub = start_hub("tuiH")
    sim = SimJob(job="tuiH", ranks=2, gpu=False, amp=False)
    ranks = SimSender(zctx, hub.address, sim)

    async def scenario() -> None:
        app = DashboardApp(HubFeed(address=hub.address))
        async with app.run_test(size=(140, 40)) as pilot:
            await pilot.pause(0.5)
            ranks.hello()
            for step in range(1, 4):
                ranks.step(step)
            await until(pilot, lambda: len(cells(app)) == 2)
            await pilot.press("h")
            await until(pilot, lambda: isinstance(app.screen, HangScreen)
                        and "no hang: the last step completed" in screen_text(app))
            await pilot.press("d")
            await until(pilot, lambda: "dump requested: 2 ranks -> " in screen_text(app))
            directory = app.dump_status.split(" -> ")[1]
            assert directory.endswith(tuple("0123456789")) and "/fr/" in directory
            # the hub records the request in the history: it reaches the view
            await until(pilot, lambda: f"Flight Recorder dump {directory} (requested)"
                        in screen_text(app))

    asyncio.run(scenario())


def test_attach_passes_the_hang_threshold_to_the_dashboard(home):
    app = make_app("ipc:///tmp/scalemon-nohub", home=home, hang_after_s=3.0)
    assert isinstance(app, DashboardApp)
    assert app.data.state.hang_after_s == 3.0
    app.data.reset()  # a hub with a new history: the threshold stays
    assert app.data.state.hang_after_s == 3.0


def test_without_a_threshold_of_its_own_the_dashboard_takes_the_hubs(start_hub, zctx):
    """One hang threshold: the hub's `--hang-after` comes with its seed; one given to `attach`
    stands."""
    hub = start_hub("tuiHT", "--hang-after", "2.5")
    sim = SimJob(job="tuiHT", ranks=1, gpu=False, amp=False)
    ranks = SimSender(zctx, hub.address, sim)
    ranks.hello()

    async def scenario(given: float | None, expected: float) -> None:
        app = make_app(hub.address.base, hang_after_s=given)
        assert isinstance(app, DashboardApp)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.data.seeded_at is not None)
            assert app.data.state.hang_after_s == expected

    asyncio.run(scenario(None, 2.5))
    asyncio.run(scenario(4.0, 4.0))


@pytest.mark.parametrize("ranks", [2, 5])
def test_simulated_hang_names_its_culprit(ranks):
    sim = SimJob(ranks=ranks, gpu=False, amp=False)
    data = folded(sim.run(10) + sim.hang(ranks - 1, 10))
    hang = job_hang(data.state, sim.end_t(10) + 15.5)
    assert hang is not None and hang["culprits"] == [ranks - 1]
    assert hang["waiting"] == list(range(ranks - 1)) and hang["op"] == "all_reduce"


def test_a_big_jobs_heat_map_shows_its_latest_ranks_and_says_how_many_it_leaves_out():
    sim = SimJob(ranks=HEAT_RANKS + 44, gpu=True, straggler=123, seed=3)
    data = folded(sim.run(12))  # the recorder's first reads come by then
    view = collectives(data, 80)
    heat = view.heat
    assert heat is not None and heat.of_ranks == HEAT_RANKS + 44
    assert len(heat.ranks) == HEAT_RANKS and 123 in heat.ranks  # the straggler is among them
    assert heat.ranks == sorted(heat.ranks)
    latest = {h.rank for h in view.health[:HEAT_RANKS]}  # the health list: latest first
    assert set(heat.ranks) == latest
    title = head_text(heat)[0].plain
    assert f"the {HEAT_RANKS} latest of {HEAT_RANKS + 44} ranks" in title
