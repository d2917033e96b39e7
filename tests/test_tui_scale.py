"""Thousands of ranks on one screen: from `AGGREGATE_AT` ranks on the overview has a row per
node, the slowest ranks and those that failed or stopped sending always in view, a histogram
of how late the ranks are, and Enter on a node shows its ranks; `scalemon snapshot` text does
the same.

The big job: 1024 simulated GPU ranks on 128 hosts (8 each), rank 517 (node64) reaching the
collectives 30 ms late, rank 100 (node12) gone (killed), rank 1001 (node125) frozen in native
code holding the GIL.
"""

from __future__ import annotations

import asyncio
import gc
import re
import statistics
import subprocess
import sys
from collections import deque

import pytest
from test_tui_app import until
from test_tui_snapshots import compare, screen_text

from scalemon.protocol import HUB_RANK, Message
from scalemon.reports import snapshot_text
from scalemon.reports.snapshot import snapshot_json
from scalemon.reports.snapshot_text import format_snapshot
from scalemon.state.jobstate import JobState
from scalemon.text import display
from scalemon.text.display import AGGREGATE_AT, NO_HOST
from scalemon.tui.app import DashboardApp
from scalemon.tui.gcpause import SLOW_S, THAW_S, FreezeSurvivors, freeze_loaded
from scalemon.tui.model import DashboardData, LatenessMedians
from scalemon.tui.screens.node import NodeScreen
from scalemon.tui.screens.overview import OverviewScreen
from scalemon.tui.screens.rank_detail import RankDetailScreen
from scalemon.tui.screenshot import settle, simulated_app
from scalemon.tui.sim import SimJob
from scalemon.tui.views.nodes import NODE_COLUMNS
from scalemon.tui.views.overview import overview
from scalemon.tui.views.rows import COLUMNS
from scalemon.tui.widgets.node_table import NodeTable
from scalemon.tui.widgets.rank_table import RankTable
from scalemon.tui.widgets.watch import HistogramPanel, TextPanel

RANKS, STEPS = 1024, 10
STRAGGLER, GONE, FROZEN = 517, 100, 1001
STOPPED = (GONE, FROZEN)
"""The ranks that stopped sending."""
GONE_REASON = "process 4242 ended without reporting an exit (killed?)"
WHERE = "frozen in native code holding the GIL: sleep <- freeze_holding_the_gil() at faults.py:11"
PROCESS = {"pid": 5001, "exists": True, "state": "S", "state_word": "sleeping", "cpu_s": 12.5,
           "cpu_moving": False, "threads": 5}
NODE = {c.key: i for i, c in enumerate(NODE_COLUMNS)}
COL = {c.key: i for i, c in enumerate(COLUMNS)}


def big_job_messages(sim: SimJob, steps: int = STEPS) -> list[Message]:
    """`steps` steps of every rank (a collectives round at step 10), then a rank gone and one
    frozen, as the hub says them."""
    messages = sim.run(steps)
    t = sim.end_t(steps) + 0.1
    messages += [
        Message("rank_state", sim.job, HUB_RANK, 0, t,
                {"target": GONE, "state": "gone", "reason": GONE_REASON}),
        Message("rank_state", sim.job, HUB_RANK, 1, t,
                {"target": FROZEN, "state": "frozen", "process": PROCESS, "where": WHERE,
                 "reason": "no message for 30.0 s; process 5001 is alive (sleeping, CPU time "
                           "not moving)"})]
    return messages


@pytest.fixture(scope="module")
def big() -> tuple[SimJob, DashboardData, float]:
    """The big job folded once (the tests only read it)."""
    sim = SimJob(job="big", ranks=RANKS, straggler=STRAGGLER, seed=7)
    data = DashboardData()
    data.apply_messages(big_job_messages(sim))
    data.set_conn("connected", "ipc:///simulated")
    return sim, data, sim.end_t(STEPS) + 0.4


def big_app(big: tuple[SimJob, DashboardData, float]) -> DashboardApp:
    _, data, now = big
    return DashboardApp(data=data, clock=lambda: now)


# ---- the aggregation, without textual --------------------------------------------------------

def test_a_big_job_gets_a_row_per_node_trouble_first(big):
    sim, data, now = big
    assert RANKS >= AGGREGATE_AT
    view = overview(data, now, plots=False, nodes=None)
    assert view.rows == [] and view.nodes is not None  # no row per rank was formatted
    nodes = view.nodes
    assert len(nodes.hosts) == len(set(nodes.hosts)) == RANKS // 8
    # a rank that stopped sending first (in rank order), then the straggler's node, then the
    # others in order
    assert nodes.hosts[:4] == ["node12", "node125", "node64", "node0"]
    assert nodes.hosts[3:] == [f"node{i}" for i in range(128) if i not in (12, 125, 64)]
    rows = {row.host: row for row in nodes.rows}
    gone, frozen = rows["node12"].cells, rows["node125"].cells
    assert gone[NODE["worst"]] == "gone" and rows["node12"].style == "gone"
    assert frozen[NODE["worst"]] == "frozen" and rows["node125"].style == "frozen"
    count = ("ranks", "running", "frozen", "gone", "failed")
    assert [gone[NODE[c]] for c in count] == ["8", "7", "0", "1", "0"]
    assert [frozen[NODE[c]] for c in count] == ["8", "7", "1", "0", "0"]
    slow = rows["node64"].cells
    assert slow[NODE["worst"]] == "straggler" and rows["node64"].style == "straggler"
    assert float(slow[NODE["arrival_lateness_s.max"]]) > 20  # rank 517: ~24 ms late
    assert float(slow[NODE["arrival_lateness_s.med"]]) < 1
    calm = rows["node0"].cells
    assert calm[NODE["worst"]] == "running" and calm[NODE["step"]] == str(STEPS)
    # min / med / max of node0's loss, as its ranks have it
    losses = sorted(data.state.ranks[r].metrics["loss"] for r in range(8))
    assert [calm[NODE[f"loss.{p}"]] for p in ("min", "med", "max")] == [
        f"{losses[0]:.4f}", f"{statistics.median(losses):.4f}", f"{losses[-1]:.4f}"]
    assert calm[NODE["mem_allocated_bytes.max"]] == "20.70"  # (20.5 + 0.1 * (rank % 3)) GiB
    assert calm[NODE["gpu_util_pct.min"]] == "97"  # one value, the worst: the lowest
    assert slow[NODE["gpu_util_pct.min"]] == "77"  # the straggler's GPU idles


def test_the_slowest_ranks_those_that_stopped_sending_and_the_histogram(big):
    _, data, now = big
    nodes = overview(data, now, plots=False, nodes=True).nodes
    watch = nodes.watch
    assert watch.measure == "late ms"
    assert watch.slowest[0].rank == STRAGGLER and watch.slowest[0].flagged
    assert watch.slowest[0].host == "node64" and watch.slowest[0].text.startswith("+2")
    assert len(watch.slowest) == 8 and not any(w.flagged for w in watch.slowest[1:])
    # the frozen rank first (the job hangs on it), then those that failed
    assert [w.rank for w in watch.failed] == [FROZEN, GONE] and watch.failed_total == 2
    assert watch.failed[0].text == f"frozen (sleeping, CPU not moving): {WHERE}"
    assert watch.failed[1].text == f"gone ({GONE_REASON})"
    hist = nodes.histogram
    assert sum(hist.counts) == RANKS - len(STOPPED)  # the running ranks
    assert hist.counts[-1] == 1 and hist.counts[0] == RANKS - len(STOPPED) - 1
    assert hist.hi == pytest.approx(float(watch.slowest[0].text.split()[0]), abs=0.05)
    assert hist.edges()[-2] > hist.bar  # the straggler's bin is past the straggler bar


def test_only_the_node_rows_asked_for_are_formatted(big):
    _, data, now = big
    view = overview(data, now, plots=False, visible=(2, 12), nodes=True)
    assert len(view.nodes.hosts) == 128 and len(view.nodes.rows) == 10
    assert [row.host for row in view.nodes.rows] == view.nodes.hosts[2:12]


def test_a_small_job_keeps_a_row_per_rank_and_can_have_one_per_node():
    sim = SimJob(ranks=16, straggler=3)
    data = DashboardData()
    data.apply_messages(sim.run(10))
    now = sim.end_t(10)
    view = overview(data, now, nodes=None)
    assert view.nodes is None and [row.rank for row in view.rows] == list(range(16))
    nodes = overview(data, now, nodes=True).nodes  # `n` asks for it by hand
    assert nodes.hosts == ["node0", "node1"] and view.rank_ids == list(range(16))


def test_ranks_without_a_host_are_on_the_unknown_node():
    sim = SimJob(ranks=8)
    messages = sim.run(3)
    messages.append(Message("rank_state", "sim", HUB_RANK, 0, sim.end_t(3),
                            {"target": 8, "state": "unreachable",
                             "reason": "never said hello"}))
    data = DashboardData()
    data.apply_messages(messages)
    nodes = overview(data, sim.end_t(3), nodes=True).nodes
    assert nodes.hosts == [None, "node0"]
    row = nodes.rows[0]
    assert row.cells[NODE["node"]] == NO_HOST and row.cells[NODE["worst"]] == "unreachable"
    assert row.cells[NODE["gone"]] == "1" and row.style == "unreachable"
    assert row.cells[NODE["step"]] == "n/a" and row.cells[NODE["loss.med"]] == "n/a"
    assert nodes.watch.failed[0].host == NO_HOST


def test_node_order_keeps_healthy_nodes_in_place():
    key = display.node_order_key
    ordered = sorted([
        ("calm1", key("running", 0.100, False, 0.0, 8)),
        ("slow", key("running", 0.200, True, 0.0, 16)),
        ("calm0", key("finished", 0.300, False, 0.0, 0)),  # noise in step time: no move
        ("gone", key("gone", 0.100, False, 0.0, 24)),
        ("failed", key("failed", 0.100, False, 0.0, 32)),
        ("late", key("straggler", 0.150, False, 0.030, 40)),
        ("frozen", key("frozen", 0.100, False, 0.0, 48)),
        ("silent", key("silent", 0.100, False, 0.0, 56)),
        ("stuck", key("stuck", 0.100, False, 0.0, 64)),
    ], key=lambda item: item[1])
    assert [name for name, _ in ordered] == ["gone", "failed", "frozen", "silent", "slow",
                                             "late", "stuck", "calm0", "calm1"]


def test_lateness_medians_are_redone_a_slice_of_ranks_per_call():
    """Thousands of ranks: a redraw recomputes at most `per_call` medians (of up to 100
    samples each), every rank in turn, and each once a collective settled since."""
    sim = SimJob(ranks=12, straggler=5)
    data = DashboardData()
    data.apply_messages(sim.run(10))
    state = data.state
    cache = LatenessMedians(per_call=5)
    exact = {r: statistics.median(v.lateness) for r, v in state.ranks.items()}
    assert cache.get(state) == exact  # new ranks: at once
    cache.get(state), cache.get(state)  # the pass the job's collectives started: done
    for rank, view in state.ranks.items():  # collectives settle: new samples everywhere
        view.lateness.extend([1.0 + rank] * (view.lateness.maxlen or 100))
    state.arrival.complete += 1
    new = {r: statistics.median(v.lateness) for r, v in state.ranks.items()}
    redone = []
    for _ in range(4):
        values = cache.get(state)
        redone.append(sum(values[r] == new[r] for r in new))
    assert redone == [5, 10, 12, 12]  # 5 ranks a call, each once
    replaced = state.ranks[3].lateness = deque([0.5])  # a deque of its own: at once
    assert cache.get(state)[3] == 0.5 and replaced


def test_a_slow_full_collection_freezes_its_survivors_until_closed():
    survivors = FreezeSurvivors()
    try:
        survivors._on_gc("start", {"generation": 1})
        survivors._on_gc("stop", {"generation": 1})
        survivors.tick(now=0.0)
        assert survivors.freezes == 0  # young collections are cheap
        survivors._started = -1.0  # a full collection that took a second
        survivors._on_gc("stop", {"generation": 2})
        assert SLOW_S < 1.0 and survivors.slow
        survivors.tick(now=1.0)
        assert survivors.freezes == 1 and gc.get_freeze_count() > 0
    finally:
        survivors.close()
    assert gc.get_freeze_count() == 0 and survivors._on_gc not in gc.callbacks


def test_a_big_seed_frozen_as_loaded_is_thawed_by_the_survivors_in_turn():
    survivors = FreezeSurvivors()
    try:
        survivors.tick(now=0.0)
        assert survivors.frozen_at is None
        freeze_loaded()  # the receiver, right after loading a big job's seed
        frozen = gc.get_freeze_count()
        assert frozen > 0
        survivors.tick(now=10.0)  # adopted: thawed THAW_S later, as its own freezes are
        assert survivors.frozen_at == 10.0 and survivors.freezes == 0
        survivors.tick(now=10.0 + THAW_S / 2)
        assert gc.get_freeze_count() == frozen
        survivors.tick(now=11.0 + THAW_S)
        assert gc.get_freeze_count() == 0 and survivors.frozen_at is None
    finally:
        survivors.close()
        gc.unfreeze()


# ---- the text snapshot ------------------------------------------------------------------------

def big_snapshot_state() -> dict:
    sim = SimJob(job="big", ranks=RANKS, straggler=STRAGGLER, seed=7)
    state = JobState()
    for msg in big_job_messages(sim):
        state.apply(msg)
    return snapshot_json(state, now=sim.end_t(STEPS) + 0.4)


def test_snapshot_text_of_a_big_job_has_a_line_per_node():
    ranks = big_snapshot_state()["ranks"]
    lines = snapshot_text.node_snapshot_lines(ranks)
    node_lines = [line for line in lines if re.match(r"node\d+ ", line)]
    assert len(node_lines) == 128 and len(lines) < 128 + 40  # not a line per rank
    assert [line.split()[0] for line in node_lines[:3]] == ["node12", "node125", "node64"]
    # ranks, worst, run, frz, gone, fail, fin
    assert node_lines[0].split()[1:8] == ["8", "gone", "7", "0", "1", "0", "0"]
    assert node_lines[1].split()[1:8] == ["8", "frozen", "7", "1", "0", "0", "0"]
    text = "\n".join(lines)
    assert re.search(rf"rank {STRAGGLER} +node64 +\+2\d\.\d ms  straggler", text)
    assert re.search(rf"rank {GONE} +node12 +gone \({re.escape(GONE_REASON)}\)", text), text
    assert re.search(rf"rank {FROZEN} +node125 +frozen ", text), text
    assert any(line.startswith("extra lr (1024 ranks): ") for line in lines)
    heading = lines[lines.index(node_lines[0]) - 1]
    assert heading.split()[:3] == ["node", "ranks", "worst"] and "med" in heading


def test_scalemon_snapshot_text_aggregates_big_jobs():
    text = format_snapshot(big_snapshot_state())
    assert len(text.splitlines()) < 200 and "node64" in text


# ---- the dashboard ----------------------------------------------------------------------------

def node_table(app: DashboardApp) -> NodeTable:
    return app.screen.query_one(NodeTable)


def test_the_overview_of_a_big_job_shows_nodes_and_drills_down_to_a_rank(big):
    sim, _, _ = big
    app = big_app(big)

    async def scenario() -> None:
        async with app.run_test(size=(160, 50)) as pilot:
            await until(pilot, lambda: len(node_table(app).keys) == 128
                        and "node12" in node_table(app).rows)
            screen = app.screen
            assert isinstance(screen, OverviewScreen) and screen.showing_nodes
            assert node_table(app).display and not screen.query_one(RankTable).display
            assert screen.query_one(RankTable).rows == {}  # no rank row built
            await until(pilot, lambda: node_table(app).has_focus)  # focus follows a paint
            slowest = screen.query_one("#slowest", TextPanel).shown_text()
            assert re.search(rf"{STRAGGLER} +node64 +\+2\d\.\d ms", slowest)
            failed = screen.query_one("#failed", TextPanel).shown_text()
            assert "failed or stopped sending  2" in failed
            assert re.search(rf"{FROZEN} +node125 +frozen \(sleeping, CPU not moving\): "
                             "frozen in native code holding the GIL", failed)
            assert re.search(rf"{GONE} +node12 +gone \(process 4242 ended", failed)
            assert "late ms, 1022 ranks" in screen.query_one(HistogramPanel).shown_text()
            await until(pilot, lambda: "node125" in screen_text(app))  # painted
            assert not re.search(r"^ +517 +running", screen_text(app), re.M)

            await pilot.press("down", "enter")  # the second node: node125, rank 1001 frozen
            await until(pilot, lambda: isinstance(app.screen, NodeScreen)
                        and len(app.screen.query_one(RankTable).rows) == 8)
            table = app.screen.query_one(RankTable)
            assert app.screen.host == "node125" and table.rank_ids == list(range(1000, 1008))
            cells = table.cells_by_rank(list(COL))
            assert cells[FROZEN][COL["state"]] == "frozen"
            assert cells[1000][COL["state"]] == "running"
            assert {c[COL["host"]] for c in cells.values()} == {"node125"}
            assert "node node125  ·  8 ranks" in screen_text(app)

            await pilot.press("down", "enter")
            await until(pilot, lambda: isinstance(app.screen, RankDetailScreen))
            assert app.screen.rank == 1001
            await pilot.press("escape")
            await until(pilot, lambda: isinstance(app.screen, NodeScreen))
            await pilot.press("escape")
            await until(pilot, lambda: isinstance(app.screen, OverviewScreen))
            assert node_table(app).key_at_cursor() == "node125"  # where it was

            await pilot.press("n")  # a row per rank, by hand
            await until(pilot, lambda: app.screen.query_one(RankTable).display
                        and 0 in app.screen.query_one(RankTable).rows)
            assert len(app.screen.query_one(RankTable).rank_ids) == RANKS
            assert not node_table(app).display
            await pilot.press("n")
            await until(pilot, lambda: node_table(app).display and node_table(app).has_focus)

    asyncio.run(scenario())


def test_a_small_job_shows_a_row_per_rank_and_n_a_row_per_node():
    app = simulated_app(ranks=8, gpu=True, steps=30, straggler=5)

    async def scenario() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: len(app.screen.query_one(RankTable).rows) == 8)
            assert not node_table(app).display and not app.screen.showing_nodes
            await pilot.press("n")
            await until(pilot, lambda: node_table(app).display
                        and list(node_table(app).rows) == ["node0"])
            row = node_table(app).rows["node0"].cells
            assert row[NODE["ranks"]] == "8" and row[NODE["worst"]] == "straggler"
            await pilot.press("n")
            await until(pilot, lambda: app.screen.query_one(RankTable).display)

    asyncio.run(scenario())


class MarkupHosts(SimJob):
    """Host names with Rich markup and a control character in them."""

    def host(self, rank: int) -> str:
        return f"[b]n{rank // self.ranks_per_host}[/b]\x1b"


def test_host_names_are_shown_as_typed():
    sim = MarkupHosts(ranks=16, straggler=3)
    messages = sim.run(10)
    messages.append(Message("rank_state", "sim", HUB_RANK, 0, sim.end_t(10),
                            {"target": 9, "state": "gone", "reason": "[/red] gone"}))
    data = DashboardData()
    data.apply_messages(messages)
    app = DashboardApp(data=data, clock=lambda: sim.end_t(10))

    async def scenario() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("n")
            await until(pilot, lambda: len(node_table(app).rows) == 2)
            text = screen_text(app)
            assert "[b]n1[/b]\\x1b" in text and "[b]n0[/b]\\x1b" in text  # in the table and panels
            assert "gone ([/red] gone)" in app.screen.query_one("#failed", TextPanel).shown_text()
            await pilot.press("enter")  # node1 first: its rank 9 is gone
            await until(pilot, lambda: isinstance(app.screen, NodeScreen)
                        and len(app.screen.query_one(RankTable).rows) == 8)
            assert "node [b]n1[/b]\\x1b  ·  8 ranks" in screen_text(app)

    asyncio.run(scenario())


def test_node_overview_snapshot_120x40(big):
    app = big_app(big)

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot, app)
            await until(pilot, lambda: "node12" in node_table(app).rows)
            await settle(pilot, app)
            compare("overview_nodes_120x40", screen_text(app), app.export_screenshot())

    asyncio.run(run())


def test_the_node_aggregation_does_not_import_textual():
    code = ("import sys; import scalemon.tui.views.nodes, scalemon.tui.gcpause, "
            "scalemon.text.display; "
            "assert 'textual' not in sys.modules, 'textual imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
