"""Hang root cause across process groups, end to end: real torchrun jobs of 3-4 gloo ranks on
the CPU (tests/jobs/hang_scenarios.py), the agent on, the hub they start, and `scalemon
snapshot --json` as users run it. Each scenario's culprit is named, with its cause, within the
hang threshold + 5 s of the hang starting; the hub and the agents share that threshold."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_collectives_jobs import hub_client, job_env, snapshot

from conftest import REPO, free_port, kill_tree, wait_for
from scalemon.home.paths import jobs_dir
from scalemon.reports.snapshot_text import format_snapshot

pytestmark = pytest.mark.integration

HANG_AFTER_S = 5.0
JOB = REPO / "tests" / "jobs" / "hang_scenarios.py"
NPROC = {"disjoint": 4, "mesh_tp": 4}


def start(scenario: str, home: Path, out: Path) -> tuple[subprocess.Popen, Path]:
    env = job_env(home)
    env["SCALEMON_HANG_AFTER"] = str(HANG_AFTER_S)  # the hub and the agents read the same
    log = out / "job.out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
           str(NPROC.get(scenario, 3)), "--master-port", str(free_port()), "--", str(JOB),
           scenario, str(out)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, log


def named(home: Path, log: Path, scenario: str, ready) -> dict:
    """`scalemon snapshot --json` once the hub's hang satisfies `ready(hang)`, which must come
    within the threshold + 5 s of the first rank reaching the fault (the hub is asked
    directly: a CLI process takes seconds to start on a loaded machine)."""
    try:
        wait_for(lambda: f": {scenario} at step" in log.read_text(), timeout=150, interval=0.2)
    except AssertionError:
        raise AssertionError(f"{scenario}: no rank reached the fault within 150 s; the job's "
                             f"output ends:\n{log.read_text()[-4000:]}") from None
    hung_at = time.monotonic()
    wait_for(lambda: (jobs_dir(home) / f"{home.name}.json").exists(), timeout=30)
    client = hub_client(home)
    seen: list[dict] = []

    def found() -> bool:
        state = client.state()["state"]
        seen[:] = [state]
        return bool(state["hang"]) and ready(state["hang"])

    try:
        wait_for(found, timeout=HANG_AFTER_S + 25, interval=0.2)
    except AssertionError:
        last = seen[0] if seen else {}
        raise AssertionError(f"{scenario}: not named; ranks "
                             f"{[(r['state'], r['state_reason']) for r in last.get('ranks', [])]}"
                             f", hang {last.get('hang')}") from None
    finally:
        client.close()
    took = time.monotonic() - hung_at
    print(f"{scenario}: named {took:.1f} s after the fault")
    assert took <= HANG_AFTER_S + 5.0, f"named after {took:.1f} s"
    state = snapshot(home)
    assert state is not None and state["hang"] and ready(state["hang"])
    assert state["hang_after_s"] == HANG_AFTER_S
    return state


def causes(hang: dict) -> dict[int, str]:
    return {c["rank"]: c["cause"] for c in hang["causes"]}


def waits(hang: dict) -> dict[int, dict]:
    return {w["rank"]: w for w in hang["waits"]}


def framed(hang: dict, rank: int) -> bool:
    return "stall_in_python()" in (hang["ranks"][str(rank)]["frame"] or "")


@pytest.fixture
def job(home, tmp_path):
    started: list[subprocess.Popen] = []

    def run(scenario: str) -> Path:
        proc, log = start(scenario, home, tmp_path)
        started.append(proc)
        return log

    yield run
    for proc in started:
        kill_tree(proc)
    child = tmp_path / "child.pid"  # the dead rank's socket keeper, reparented away
    if child.exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(child.read_text()), signal.SIGKILL)


def test_default_group_hang_names_the_rank_in_python(home, job):
    log = job("default")
    state = named(home, log, "default", lambda h: h["culprits"] == [1] and framed(h, 1))
    hang = state["hang"]
    assert hang["waiting"] == [0, 2] and causes(hang) == {1: "python"}
    assert hang["group"] == "default_pg [0,1,2]" and hang["op"] == "all_reduce"
    assert re.match(r"rank 1 never issued all_reduce #\d+ of default_pg \[0,1,2\] \(in Python: "
                    r"hang_scenarios\.py:\d+ in stall_in_python\(\)\); ranks 0,2 wait in "
                    r"all_reduce #\d+ of default_pg \[0,1,2\] for rank 1", hang["text"]), \
        hang["text"]
    phases = {r: hang["ranks"][str(r)]["phase"] for r in range(3)}
    assert phases == {0: "collective", 1: "python", 2: "collective"}


def test_subgroup_chain_names_the_rank_at_its_end_alone(home, job):
    """The case of issue #24: rank 1 stops in Python before the subgroup {0,1}'s all_gather;
    rank 0 waits for it there, rank 2 waits for both in the default group. Rank 1 alone is
    the culprit, rank 0 waits on it, the groups are named by their ranks."""
    log = job("chain")
    state = named(home, log, "chain", lambda h: h["culprits"] == [1] and framed(h, 1)
                  and all(w["op"] for w in h["waits"]))
    hang = state["hang"]
    assert hang["waiting"] == [0, 2] and causes(hang) == {1: "python"}
    by = waits(hang)
    assert (by[0]["group"], by[0]["op"], by[0]["for"]) == ("user_pg [0,1]", "all_gather", [1])
    assert (by[2]["group"], by[2]["op"]) == ("default_pg [0,1,2]", "all_reduce")
    assert by[2]["for"] == [0, 1]
    assert re.fullmatch(r"rank 0: waiting in all_gather #\d+ of user_pg \[0,1\] for rank 1 "
                        r"\(\d+ s\)", by[0]["text"]), by[0]["text"]
    assert hang["causes"][0]["text"].startswith("rank 1: python, hang_scenarios.py:")
    assert hang["chains"] == [[2, 0, 1]] and hang["wait_for"] == {"0": [1], "2": [0, 1]}
    assert "pg 1" not in hang["text"] and "user_pg [0,1]" in hang["text"]
    assert {r: hang["ranks"][str(r)]["phase"] for r in range(3)} == {
        0: "collective", 1: "python", 2: "collective"}
    assert state["groups"]["user_pg"]["label"] == "user_pg [0,1]"
    text = format_snapshot(state)  # `scalemon snapshot` for people
    assert "HUNG: rank 1 never issued all_gather" in text
    assert re.search(r"culprit  rank 1: python, hang_scenarios\.py:\d+ in stall_in_python\(\)",
                     text)
    assert "waiting  rank 0: waiting in all_gather #" in text
    check_dashboard(home, ("rank 1: python, hang_scenarios.py:",
                           "rank 0: waiting in all_gather #", "of user_pg [0,1] for rank 1",
                           "rank 2: waiting in all_reduce #", "culprit"))


def test_two_disjoint_subgroups_each_have_their_culprit(home, job):
    log = job("disjoint")
    state = named(home, log, "disjoint", lambda h: h["culprits"] == [1, 3]
                  and framed(h, 1) and framed(h, 3))
    hang = state["hang"]
    assert hang["waiting"] == [0, 2] and causes(hang) == {1: "python", 3: "python"}
    by = waits(hang)
    assert (by[0]["group"], by[0]["for"]) == ("pair_a [0,1]", [1])
    assert (by[2]["group"], by[2]["for"]) == ("pair_b [2,3]", [3])


def test_a_dead_rank_is_named_gone(home, job):
    log = job("dead")
    state = named(home, log, "dead", lambda h: causes(h).get(1) == "gone")
    hang = state["hang"]
    assert hang["culprits"] == [1] and hang["waiting"] == [0, 2] and hang["gone"] == [1]
    assert re.search(r"rank 1: gone: process \d+ ended without reporting an exit",
                     hang["text"]), hang["text"]
    assert "no stack: the rank is gone" in hang["stacks"]["1"]


def test_a_desync_is_named_as_such(home, job):
    log = job("desync")
    state = named(home, log, "desync", lambda h: h["culprits"] == [2] and h["desync"])
    hang = state["hang"]
    assert causes(hang) == {2: "desync"} and hang["waiting"] == [0, 1]
    assert re.search(r"rank 2 issued all_gather #(\d+) of default_pg \[0,1,2\] while ranks 0,1 "
                     r"issued all_reduce #\1", hang["text"]), hang["text"]


def test_a_rank_stuck_in_teardown_after_the_others_finished(home, job):
    log = job("teardown")
    state = named(home, log, "teardown", lambda h: causes(h).get(2) == "teardown")
    hang = state["hang"]
    assert hang["culprits"] == [2] and hang["waiting"] == []
    assert re.search(r"rank 2: stuck in teardown: waiting in barrier #\d+ of default_pg "
                     r"\[0,1,2\] for ranks 0,1 \(\d+ s\), which have finished", hang["text"]), \
        hang["text"]
    assert [r["state"] for r in state["ranks"]] == ["finished", "finished", "running"]


def check_dashboard(home: Path, needles: tuple[str, ...]) -> None:
    """A dashboard attached to the live hub switches to the hang view by itself and shows
    the culprit and the waiting ranks in the same words."""
    import asyncio

    from test_tui_app import until
    from test_tui_snapshots import screen_text

    from scalemon.home.address import HubAddress
    from scalemon.home.jobfile import JobFile
    from scalemon.tui.app import DashboardApp
    from scalemon.tui.feed import HubFeed
    from scalemon.tui.screens.hang import HangScreen

    job_file = JobFile.read(jobs_dir(home) / f"{home.name}.json")

    async def scenario() -> None:
        app = DashboardApp(HubFeed(address=HubAddress.parse(job_file.address)),
                           hang_after_s=HANG_AFTER_S)
        async with app.run_test(size=(160, 60)) as pilot:
            def shown() -> bool:
                if not isinstance(app.screen, HangScreen):
                    return False
                text = screen_text(app)
                return all(words in text for words in needles)

            await until(pilot, shown, timeout=30)

    asyncio.run(scenario())


def test_a_pipeline_stage_stopped_before_its_send_is_named_alone(home, job):
    """Issue #36: stage 0 of a 3-stage send/recv pipeline stays in Python before its send;
    stage 1 waits in recv from 0, stage 2 in recv from 1. gloo's Flight Recorder records no
    send/recv: the agent's own P2P record names the peers. Stage 0 alone is the culprit, with
    its stack, at the end of the chain 2 -> 1 -> 0."""
    log = job("pipeline")
    state = named(home, log, "pipeline", lambda h: h["culprits"] == [0] and framed(h, 0)
                  and len(h["waits"]) == 2)
    hang = state["hang"]
    assert causes(hang) == {0: "python"} and hang["waiting"] == [1, 2]
    by = waits(hang)
    assert (by[1]["op"], by[1]["for"]) == ("recv", [0]), by[1]
    assert (by[2]["op"], by[2]["for"]) == ("recv", [1]), by[2]
    assert hang["chains"] == [[2, 1, 0]]
    assert re.search(r"recv from rank 0", by[1]["text"]), by[1]["text"]
    assert hang["causes"][0]["text"].startswith("rank 0: python, hang_scenarios.py:")
    text = format_snapshot(state)
    assert re.search(r"culprit  rank 0: python, hang_scenarios\.py:\d+ in stall_in_python\(\)",
                     text), text
    check_dashboard(home, ("rank 0: python, hang_scenarios.py:", "recv from rank 0",
                           "2 -recv-> 1 -recv-> 0",
                           "recv from rank 1", "culprit"))


def test_a_tp_rank_stopped_in_a_mesh_is_named_with_its_mesh_groups(home, job):
    """A 2x2 (dp, tp) DeviceMesh; rank 3 stays in Python before its tp all_reduce: rank 2
    waits for it in tp [2,3], rank 0 for rank 2 in dp [0,2], rank 1 for rank 3 in dp [1,3].
    Groups are named by their mesh dimension, and each rank has its mesh coordinates."""
    log = job("mesh_tp")
    state = named(home, log, "mesh_tp", lambda h: h["culprits"] == [3] and framed(h, 3)
                  and len(h["waits"]) == 3)
    hang = state["hang"]
    assert causes(hang) == {3: "python"} and hang["waiting"] == [0, 1, 2]
    by = waits(hang)
    assert (by[2]["group"], by[2]["for"]) == ("tp [2,3]", [3]), by[2]
    assert (by[0]["group"], by[0]["for"]) == ("dp [0,2]", [2]), by[0]
    assert (by[1]["group"], by[1]["for"]) == ("dp [1,3]", [3]), by[1]
    assert sorted(hang["chains"]) == [[0, 2, 3], [1, 3]]
    meshes = {r["rank"]: r["mesh"] for r in state["ranks"]}
    assert meshes == {0: {"dp": 0, "tp": 0}, 1: {"dp": 0, "tp": 1}, 2: {"dp": 1, "tp": 0},
                      3: {"dp": 1, "tp": 1}}, meshes
