"""The dashboard of a 3-D parallel job (App.run_test + Pilot), on job states folded from
protocol messages as the hub passes them on: a simulated job's, with what the agent sends about
the device mesh, the pipeline, P2P and MoE (docs/protocol.md): the mesh column, the rank table
grouped by a mesh axis, the P2P rows and the pipeline's bubble on the collectives screen, and a
pipeline hang's chain through P2P waits on the hang screen."""

from __future__ import annotations

import asyncio
from typing import Any

from test_tui_app import until
from test_tui_collectives import encoded, line_with
from test_tui_snapshots import screen_text

from scalemon.protocol import Message
from scalemon.tui.app import DashboardApp
from scalemon.tui.model import DashboardData
from scalemon.tui.screens.overview import OverviewScreen
from scalemon.tui.sim import SimJob
from scalemon.tui.views.rows import MESH_AT
from scalemon.tui.widgets.rank_table import RankTable

SHAPE = {"pp": 2, "dp": 1, "tp": 2}


def coords(rank: int) -> dict[str, int]:
    """Rank -> (pp, dp, tp) of a pp2 x tp2 mesh of 4 ranks, tp innermost."""
    return {"pp": rank // 2, "dp": 0, "tp": rank % 2}


def mesh_messages(sim: SimJob, t: float) -> list[Message]:
    """Every rank's info "mesh", as the agent sends it once it found the mesh."""
    return [sim.message(r, "info", {"key": "mesh", "value": {
        "coords": coords(r), "shape": SHAPE, "source": "init"}}, t) for r in range(sim.ranks)]


def folded(messages: list[Message]) -> DashboardData:
    data = DashboardData()
    data.apply_messages(encoded(messages))
    return data


def table_keys(app: DashboardApp) -> list[int]:
    return list(app.screen.query_one(RankTable).keys)


def test_the_rank_table_has_a_mesh_column_and_g_groups_it_by_each_axis_in_turn():
    sim = SimJob(ranks=4, gpu=False, amp=False)
    messages = sim.run(10)
    messages += mesh_messages(sim, sim.end_t(10))
    data = folded(messages)
    now = sim.end_t(10) + 0.5

    async def scenario() -> None:
        app = DashboardApp(data=data, clock=lambda: now)
        async with app.run_test(size=(160, 40)) as pilot:
            table = app.screen.query_one(RankTable)
            await until(pilot, lambda: len(table.rows) == 4 and
                        table.columns[MESH_AT].key == "mesh")
            assert [table.rows[r].cells[MESH_AT] for r in range(4)] == [
                "pp0 dp0 tp0", "pp0 dp0 tp1", "pp1 dp0 tp0", "pp1 dp0 tp1"]
            assert "mesh" in screen_text(app).splitlines()[table.region.y]
            await until(pilot, lambda: "g Group by mesh axis" in screen_text(app))  # footer

            await pilot.press("g")  # pp
            await until(pilot, lambda: table_keys(app) == [-1, 0, 1, -2, 2, 3])
            assert table.rows[-1].cells[MESH_AT:MESH_AT + 2] == ("pp 0", "2 ranks")
            await pilot.press("g")  # dp: one value
            await until(pilot, lambda: table_keys(app) == [-1, 0, 1, 2, 3])
            await pilot.press("g")  # tp
            await until(pilot, lambda: table_keys(app) == [-1, 0, 2, -2, 1, 3])
            text = screen_text(app)
            assert line_with(text, "tp 1", "2 ranks")
            heading = next(i for i, line in enumerate(text.splitlines()) if "tp 1" in line)
            assert text.splitlines()[heading + 1].split()[:2] == ["1", "pp0"]
            table.action_cursor_to(0)  # a heading: Enter opens nothing
            await pilot.press("enter")
            await pilot.pause(0.2)
            assert isinstance(app.screen, OverviewScreen) and table.rank_at_cursor() is None
            await pilot.press("g")  # off: rank order again
            await until(pilot, lambda: table_keys(app) == [0, 1, 2, 3])

    asyncio.run(scenario())


def test_a_job_without_a_mesh_has_no_mesh_column_and_offers_no_g():
    sim = SimJob(ranks=2, gpu=False, amp=False)
    data = folded(sim.run(5))
    now = sim.end_t(5) + 0.5

    async def scenario() -> None:
        app = DashboardApp(data=data, clock=lambda: now)
        async with app.run_test(size=(160, 40)) as pilot:
            table = app.screen.query_one(RankTable)
            await until(pilot, lambda: len(table.rows) == 2)
            assert "mesh" not in [c.key for c in table.columns]
            await until(pilot, lambda: "Collectives" in screen_text(app))  # the footer
            assert "Group by" not in screen_text(app)
            await pilot.press("g")
            await pilot.pause(0.2)
            assert table_keys(app) == [0, 1]

    asyncio.run(scenario())


PP_GROUPS = {"5": {"desc": "mesh_pp", "ranks": [0, 2]}, "6": {"desc": "mesh_pp", "ranks": [1, 3]}}
"""The pipeline's groups of a pp2 x tp2 mesh: stage 0 (ranks 0, 1) sends to stage 1 (2, 3)."""


def p2p_messages(sim: SimJob, t: float, steps: int = 10) -> list[Message]:
    """What a 2-stage pipeline's ranks send: their collectives messages' `p2p` rows (each stage-0
    rank sends its activations to its stage-1 peer and receives the gradients back, 4
    microbatches a step), the pipeline the script described and the MoE extras."""
    out = []
    for rank in range(4):
        peer, group = (rank + 2) % 4, "5" if rank % 2 == 0 else "6"
        rows: list[list[Any]] = []
        for op in ("send", "recv"):
            src, dst = (rank, peer) if op == "send" else (peer, rank)
            rows.append([group, op, src, dst, 4 * steps, 4 * steps * (1 << 20),
                         4 * steps * 0.002, 4 * steps])
        out.append(sim.message(rank, "collectives", {
            "groups": PP_GROUPS, "stats": [], "issues": [], "p2p": rows}, t))
    out += [sim.message(r, "info", {"key": "pipeline", "value": {
        "schedule": "1f1b", "stages": 2, "microbatches": 4}}, t) for r in range(4)]
    return out


def with_bubbles(messages: list[Message]) -> list[Message]:
    """The step messages of a pipeline's ranks: rank r's bubble 0.2 + 0.05 r (its P2P waits
    over its step time), its all_to_all bytes received (rank 3 twice the others') and the MoE
    extras the script logs (imbalance 1.3, 2 tokens dropped per rank)."""
    for m in messages:
        if m.type == "step":
            m.body["pipeline_bubble"] = 0.2 + 0.05 * m.rank
            m.body["p2p_wait_s"] = m.body["pipeline_bubble"] * m.body["step_time_s"]
            m.body["a2a_recv_bytes"] = m.body["a2a_send_bytes"] = (2 if m.rank == 3 else 1) << 20
            m.body["extra"].update(moe_imbalance=1.3, moe_dropped_tokens=2)
    return messages


def test_the_collectives_screen_shows_p2p_rows_the_bubble_and_the_moe_balance():
    sim = SimJob(ranks=4, gpu=False, amp=False)
    messages = with_bubbles(sim.run(10))
    t = sim.end_t(10)
    messages += mesh_messages(sim, t) + p2p_messages(sim, t)
    data = folded(messages)
    now = t + 0.5

    async def scenario() -> None:
        app = DashboardApp(data=data, clock=lambda: now)
        async with app.run_test(size=(160, 60)) as pilot:
            await until(pilot, lambda: len(app.screen.query_one(RankTable).rows) == 4)
            await pilot.press("c")
            await until(pilot, lambda: "send 0 -> 2" in screen_text(app))
            text = screen_text(app)
            row = line_with(text, "send 0 -> 2").split()
            assert row[:5] == ["send", "0", "->", "2", "pp"]  # the group: "pp [0,2]"
            assert "40" in row and "40.0" in row and "MiB" in row  # 40 ops of 1 MiB
            assert "80" in row  # 40 x 2 ms
            assert line_with(text, "recv 2 -> 0")
            assert line_with(text, "send 1 -> 3")
            assert ("pipeline 1f1b, 2 stages x 4 microbatches: bubble measured 28% (median), "
                    "theory 20%") in text  # the median of 20, 25, 30 and 35%
            # max/mean of 1, 1, 1 and 2 MiB: 1.6x
            assert ("all_to_all recv imbalance 1.60x, router imbalance 1.30x, dropped 8 tokens "
                    "in the latest step") in text

            await pilot.press("escape")
            await until(pilot, lambda: isinstance(app.screen, OverviewScreen))
            table = app.screen.query_one(RankTable)
            bubble = [c.key for c in table.columns].index("pipeline_bubble")
            await until(pilot, lambda: [table.rows[r].cells[bubble] for r in range(4)] == [
                "20.0", "25.0", "30.0", "35.0"])

    asyncio.run(scenario())


STACK_STEP = """\
  File "/workspace/train.py", line 80, in <module>
    main()
  File "/workspace/train.py", line 40, in step
    time.sleep(3600)
"""


def pipeline_hang(stuck_s: float = 15.0) -> tuple[list[Message], float]:
    """A 3-stage send/recv pipeline that ran 10 steps; then stage 0 stops in Python before its
    send (train.py:40 in step()), stage 1 waits in recv from 0 and stage 2 in recv from 1:
    heartbeats `stuck_s` after the last step, with their P2P ops in flight. Returns the
    messages and the time of the heartbeats."""
    sim = SimJob(ranks=3, gpu=False, amp=False)
    messages = sim.run(10)
    t = sim.end_t(10) + stuck_s
    groups = {"7": {"desc": "stage_0_1", "ranks": [0, 1]},
              "8": {"desc": "stage_1_2", "ranks": [1, 2]}}
    messages += [sim.message(r, "collectives", {"groups": groups, "stats": [], "issues": []},
                             t - stuck_s) for r in range(3)]
    for rank in range(3):
        body = sim.heartbeat(rank, 10)
        body.update(phase="python" if rank == 0 else "p2p", phase_since_s=stuck_s - 0.5,
                    stack=STACK_STEP if rank == 0 else None)
        if rank > 0:
            body["p2p_inflight"] = [["7" if rank == 1 else "8", "recv", rank - 1,
                                     t - stuck_s + 0.05, 1 << 20]]
            body["blocked"] = True
        messages.append(sim.message(rank, "heartbeat", body, t))
    return messages, t


def test_the_hang_view_draws_a_pipeline_hang_chain_through_p2p_waits_with_op_and_peer():
    messages, t = pipeline_hang()
    data = folded(messages)

    async def scenario() -> None:
        app = DashboardApp(data=data, clock=lambda: t + 0.5)
        async with app.run_test(size=(140, 50)) as pilot:
            await pilot.press("h")
            await until(pilot, lambda: "2 -recv-> 1 -recv-> 0" in screen_text(app))
            text = " ".join(screen_text(app).split())
            assert "waits for: 2 -recv-> 1 -recv-> 0 (in Python: train.py:40 in step())" \
                in text
            assert "rank 0: python, train.py:40 in step(); never issued send to rank 1" in text
            lines = screen_text(app).splitlines()  # each rank's P2P op in flight in the table
            assert line_with("\n".join(lines), " 2 ", "waiting", "recv from 1 of stage_1_2 15 s")

    asyncio.run(scenario())
