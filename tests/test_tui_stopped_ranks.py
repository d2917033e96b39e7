"""Ranks that stopped sending on the real dashboard (App.run_test + Pilot, fed the records a hub
writes): each with the hub's word (frozen, gone, unreachable, silent) in its row, the header and
the node view, and a frozen rank's where-text, process facts and stacks read from outside in
its detail."""

from __future__ import annotations

import asyncio

from rich.text import Text
from test_tui_app import cells, header, until
from test_tui_snapshots import screen_text

from scalemon.protocol import HUB_RANK, Message
from scalemon.tui.app import DashboardApp
from scalemon.tui.model import DashboardData
from scalemon.tui.screens.rank_detail import RankDetailScreen
from scalemon.tui.sim import SimJob
from scalemon.tui.views.rank_detail import outside_stacks_text, rank_detail
from scalemon.tui.views.rows import COLUMNS
from scalemon.tui.widgets.line_table import ROW_STYLES
from scalemon.tui.widgets.node_table import NodeTable
from scalemon.tui.widgets.rank_table import RankTable
from scalemon.tui.widgets.watch import TextPanel

COL = {c.key: i for i, c in enumerate(COLUMNS)}
STEPS = 10
FROZEN, GONE, UNREACHABLE = 1, 2, 3
WHERE = "frozen in native code holding the GIL: sleep <- freeze_holding_the_gil() at faults.py:11"
PROCESS = {"pid": 10_001, "exists": True, "state": "S", "state_word": "sleeping",
           "cpu_s": 12.5, "cpu_moving": False, "threads": 5, "comm": "python"}
READING = {
    "pid": 10_001, "tool": "py-spy 0.4.3", "native": True, "error": None, "note": None,
    "took_s": 0.41, "t": 1_700_000_100.0, "threads_cut": 0,
    "threads": [
        {"thread_id": 2, "name": "scalemon-sender", "os_thread_id": 10_005, "active": False,
         "owns_gil": False, "frames_cut": 0,
         "frames": [{"name": "wait", "file": "/usr/lib/python3.11/threading.py", "line": 327,
                     "native": False, "library": None}]},
        {"thread_id": 1, "name": "MainThread", "os_thread_id": 10_001, "active": False,
         "owns_gil": True, "frames_cut": 0,
         "frames": [
             {"name": "clock_nanosleep", "file": "/lib/x86_64-linux-gnu/libc.so.6", "line": 0,
              "native": True, "library": "/lib/x86_64-linux-gnu/libc.so.6"},
             {"name": "sleep", "file": "/lib/x86_64-linux-gnu/libc.so.6", "line": 0,
              "native": True, "library": "/lib/x86_64-linux-gnu/libc.so.6"},
             {"name": "freeze_holding_the_gil", "file": "/w/demo_train/faults.py",
              "line": 11, "native": False, "library": None},
             {"name": "<module>", "file": "/w/demo_train/train.py", "line": 40,
              "native": False, "library": None}]}]}


def stopped_job() -> tuple[DashboardData, float]:
    """8 ranks on one node: rank 1 frozen (its stacks read from outside by the hub), rank 2
    gone, rank 3 unreachable, the others running."""
    sim = SimJob(job="stop", ranks=8, gpu=False, amp=False)
    messages = sim.run(STEPS)
    t = sim.end_t(STEPS) + 6
    hub = [
        {"target": FROZEN, "state": "frozen", "process": PROCESS,
         "reason": "no message for 5.1 s; process 10001 is alive (sleeping, CPU time not "
                   "moving)", "where": WHERE},
        {"target": GONE, "state": "gone",
         "reason": "process 10002 ended without reporting an exit (killed?)"},
        {"target": UNREACHABLE, "state": "unreachable",
         "reason": "no message for 5.0 s, and its node's relay (node0) has not reported for "
                   "4.0 s: see relay.log on that node"},
    ]
    messages += [Message("rank_state", sim.job, HUB_RANK, i, t, body)
                 for i, body in enumerate(hub)]
    messages.append(Message("rank_stacks", sim.job, HUB_RANK, len(hub), t + 0.5,
                            {"target": FROZEN, "reading": READING, "process": PROCESS,
                             "reader": "hub on login1 (pid 4242)"}))
    data = DashboardData()
    data.apply_messages(messages)
    data.set_conn("connected", "ipc:///simulated")
    return data, t + 1


def test_a_frozen_rank_has_its_word_its_row_style_and_its_where_text_on_the_dashboard():
    data, now = stopped_job()
    app = DashboardApp(data=data, clock=lambda: now)

    async def scenario() -> None:
        async with app.run_test(size=(140, 44)) as pilot:
            await until(pilot, lambda: len(cells(app)) == 8)
            table = app.screen.query_one(RankTable)
            states = {r: row[COL["state"]] for r, row in cells(app).items()}
            assert states == {0: "running", FROZEN: "frozen", GONE: "gone",
                              UNREACHABLE: "unreachable", 4: "running", 5: "running",
                              6: "running", 7: "running"}
            styles = {r: row.style for r, row in table.rows.items()}
            assert (styles[FROZEN], styles[GONE], styles[UNREACHABLE]) == (
                "frozen", "gone", "unreachable")
            # a frozen rank stands out from a stuck one and from those taken for ended
            assert len({ROW_STYLES[s] for s in ("frozen", "stuck", "gone", "exited")}) == 4
            assert "degraded, frozen: 1; gone: 2; unreachable: 3" in header(app)
            assert "lost" not in screen_text(app)

            # the node view: the frozen rank first in the list, with where it is stuck
            await pilot.press("n")
            nodes = app.screen.query_one(NodeTable)
            await until(pilot, lambda: nodes.display and "node0" in nodes.rows)
            failed = app.screen.query_one("#failed", TextPanel).shown_text()
            lines = failed.splitlines()
            assert lines[0] == "failed or stopped sending  3"
            assert lines[1].split()[:2] == [str(FROZEN), "node0"]
            assert f"frozen (sleeping, CPU not moving): {WHERE}" in lines[1]
            assert "gone (process 10002 ended without reporting an exit (killed?))" in failed
            assert "unreachable (no message for 5.0 s" in failed
            assert nodes.rows["node0"].style == "gone"  # its worst: a rank gone
            await pilot.press("n")
            await until(pilot, lambda: table.display and table.has_focus)

            # the frozen rank's detail: where, its process, its stacks read from outside
            await pilot.press("down", "enter")
            await until(pilot, lambda: isinstance(app.screen, RankDetailScreen))
            assert app.screen.rank == FROZEN
            text = screen_text(app)
            assert f"rank {FROZEN}  ·  frozen (no message for 5.1 s" in text
            facts = dict(rank_detail(app.data, FROZEN).facts)
            assert facts["where"] == WHERE
            assert facts["process"] == ("pid 10001 (python): sleeping, CPU not moving; "
                                        "12.50 s CPU, 5 threads")
            shown = app.screen.query_one("#outside-stacks")
            assert shown.display
            stacks = shown.render()
            stacks = stacks.plain if isinstance(stacks, Text) else str(stacks)
            assert stacks.startswith("read from outside the process by the hub on login1 "
                                     "(pid 4242) at ")
            assert "MainThread (os id 10001), python id 0x1, idle, holds the GIL" in stacks
            assert "    [native] sleep (libc.so.6)" in stacks
            assert "    freeze_holding_the_gil (/w/demo_train/faults.py:11)" in stacks
            await pilot.press("right")  # rank 2, gone: no stacks read, none shown
            await until(pilot, lambda: app.screen.rank == GONE
                        and not app.screen.query_one("#outside-stacks").display)
            gone = dict(rank_detail(app.data, GONE).facts)
            assert gone["state"].startswith("gone (process 10002 ended") and "where" not in gone

    asyncio.run(scenario())


def test_the_stacks_text_is_scalemon_stacks_words_and_says_why_none_were_read():
    text = outside_stacks_text({"reading": READING, "reader": "relay of node7", "t": None})
    lines = [line for line in text.splitlines() if line]
    assert lines[:2] == ["read from outside the process by the relay of node7",
                         "process 10001: stacks read by py-spy 0.4.3 in 0.41 s"]
    # the GIL holder first, its frames innermost first, native ones marked
    assert lines[2] == "MainThread (os id 10001), python id 0x1, idle, holds the GIL"
    assert lines[3:7] == ["    [native] clock_nanosleep (libc.so.6)",
                          "    [native] sleep (libc.so.6)",
                          "    freeze_holding_the_gil (/w/demo_train/faults.py:11)",
                          "    <module> (/w/demo_train/train.py:40)"]
    assert lines[7] == "scalemon-sender (os id 10005), python id 0x2, idle"
    refused = dict(READING, threads=[], error="kernel.yama.ptrace_scope is 3: no process may "
                                              "read another's memory on this machine")
    assert outside_stacks_text({"reading": refused}).splitlines() == [
        "read from outside the process",
        "process 10001: stacks read by py-spy 0.4.3: not read: kernel.yama.ptrace_scope is 3: "
        "no process may read another's memory on this machine"]
    # garbage from a peer: no exception, nothing made up
    garbage = outside_stacks_text({"reading": {"threads": [1, "x"]}, "t": "soon"})
    assert garbage.splitlines()[0] == "read from outside the process"
    assert "not read: a malformed stack reading arrived" in garbage
