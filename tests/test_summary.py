"""`scalemon summary` and `scalemon compare`, on real hubs and real torchrun jobs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import FakeRank, kill_tree, torchrun_cmd, wait_for
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir
from scalemon.link.client import HubClient
from scalemon.reports.summary import common_steps, quantile
from scalemon.state.runfigures import StepClock


def strict_json(text: str) -> dict:
    """Parse `text`, refusing the non-standard NaN/Infinity literals."""
    def refuse(name: str) -> None:
        raise AssertionError(f"invalid JSON literal {name}")
    return json.loads(text, parse_constant=refuse)


def job_env(home: Path, job: str = "unused") -> dict[str, str]:
    env = os.environ.copy()
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    env.update(SCALEMON_HOME=str(home), SCALEMON_JOB_ID=job, OMP_NUM_THREADS="1",
               SCALEMON_HUB_ARGS="--linger 120")
    return env


def scalemon(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scalemon", *args], env=job_env(home),
                          capture_output=True, text=True, timeout=120)


def run_demo(home: Path, job: str, *args: str) -> str:
    """Run the 2-rank demo to its end (its hub lingers); return what it printed."""
    proc = subprocess.Popen(
        torchrun_cmd("--preset", "tiny", "--batch-size", "2", "--max-steps", "20", "--monitor",
                     *args),
        env=job_env(home, job), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, out[-3000:]
    return out


def stop_hub(home: Path, job: str) -> None:
    """SIGTERM the job's (lingering) hub and wait until it is gone."""
    pid = JobFile.read(jobs_dir(home) / f"{job}.json").pid
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not psutil.pid_exists(pid) or
             psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, timeout=30)


@pytest.mark.integration
def test_summary_last_loss_is_the_trainers_last_printed_one_live_and_replayed(home):
    printed = re.findall(r"^step (\d+) loss (\S+)$", run_demo(home, "sumA"), re.M)
    assert [int(s) for s, _ in printed] == list(range(1, 21))
    live = scalemon(home, "summary", "sumA", "--json")
    assert live.returncode == 0 and "replaying" not in live.stderr, live.stderr
    s = strict_json(live.stdout)
    assert s["source"]["kind"] == "hub" and s["state"] == "finished"
    assert s["loss"]["rank"] == 0 and s["loss"]["last"]["step"] == 20
    assert f"{s['loss']['last']['value']:.4f}" == printed[-1][1]
    assert f"{s['loss']['first']['value']:.4f}" == printed[0][1]
    least = min(printed, key=lambda p: float(p[1]))
    assert f"{s['loss']['min']['value']:.4f}" == least[1]
    assert s["steps"] == {"first": 1, "last": 20, "last_on_every_rank": 20, "count": 20,
                          "last_per_rank": {"0": 20, "1": 20}}
    assert s["tokens_per_s"]["job"]["samples"] == 19  # every step with a time, from the history
    assert s["tokens_per_s"]["job"]["median"] > s["tokens_per_s"]["per_rank"]["median"] > 0
    assert s["mfu"] == {"median": None, "p10": None, "samples": 0}  # no CPU peak: null
    for rank in ("0", "1"):
        assert s["step_time"]["per_rank"][rank]["samples"] == 19  # the first has no time
        assert 0 < s["step_time"]["per_rank"][rank]["median"] <= \
            s["step_time"]["per_rank"][rank]["p90"]
        assert s["memory"]["per_rank"][rank]["rss_bytes"] > 0
        assert s["memory"]["per_rank"][rank]["peak_bytes"] is None  # CPU: no torch reading
    assert s["config"]["optimizer"] and s["config"]["max_steps"] == 20
    assert s["first_failure"] is None and s["hangs"]["now"] is None
    ops = {(c["group"], c["op"]) for c in s["collectives"]}
    assert ("default_pg", "all_reduce") in ops
    assert s["wall_time"]["seconds"] >= s["wall_time"]["steps_seconds"] > 0
    text = scalemon(home, "summary", "sumA")
    assert text.returncode == 0
    assert f"last {printed[-1][1]} (step 20)" in text.stdout

    stop_hub(home, "sumA")  # the job is over and so is its hub: the history is replayed
    replayed = scalemon(home, "summary", "sumA", "--json")
    assert replayed.returncode == 0, replayed.stderr
    assert "replaying" in replayed.stderr and replayed.stderr.count("\n") == 1
    r = strict_json(replayed.stdout)
    assert r["source"]["kind"] == "history"
    for key in ("steps", "loss", "tokens_per_s", "step_time", "memory", "config", "versions",
                "collectives", "wall_time"):
        assert r[key] == s[key], key


@pytest.mark.integration
def test_compare_of_two_optimizers_shows_both_their_ratio_and_the_config_difference(home):
    run_demo(home, "optA", "--optimizer", "torch")
    run_demo(home, "optB", "--optimizer", "torch-fused")
    done = scalemon(home, "compare", "optA", "optB", "--json")
    assert done.returncode == 0, done.stderr
    c = strict_json(done.stdout)
    assert c["a"]["job"] == "optA" and c["b"]["job"] == "optB"
    tps = c["figures"]["tokens_per_s"]
    assert tps["a"] > 0 and tps["b"] > 0 and tps["ratio"] == tps["b"] / tps["a"]
    for name in ("step_time_s", "wall_time_s", "rss_bytes"):
        row = c["figures"][name]
        assert row["ratio"] == row["b"] / row["a"], name
    assert c["figures"]["mfu"] == {"a": None, "b": None, "ratio": None}
    assert c["figures"]["steps"] == {"a": 20, "b": 20, "ratio": 1.0}
    assert {"key": "optimizer", "a": "torch", "b": "torch-fused"} in c["config"]
    assert all(d["key"] != "preset" for d in c["config"])  # only what differs
    assert c["versions"] == []
    steps = [row["step"] for row in c["loss"]["at_steps"]]
    assert steps == [3, 10, 20]  # 10%, 50%, 100% of steps 1..20 (the last common one too)
    for row in c["loss"]["at_steps"]:
        assert row["a"] is not None and row["b"] is not None
    assert c["summaries"]["a"]["loss"] == c["loss"]["a"]

    text = scalemon(home, "compare", "optA", "optB")
    assert text.returncode == 0, text.stderr
    assert "optimizer: A torch  B torch-fused" in text.stdout
    line = next(x for x in text.stdout.splitlines() if x.startswith("tokens/s "))
    assert line.split()[-1] == f"{tps['ratio']:.3f}"


@pytest.mark.integration
def test_summary_of_a_crashed_job_names_its_first_failure_and_its_straggler(home):
    proc = subprocess.run(
        torchrun_cmd("--preset", "tiny", "--batch-size", "2", "--max-steps", "20", "--monitor",
                     "--inject-crash", "1:12", "--slow-rank", "1:0.05"),
        env=job_env(home, "crashed"), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    done = scalemon(home, "summary", "crashed", "--json")
    assert done.returncode == 0, done.stderr
    s = strict_json(done.stdout)
    assert s["state"] == "crashed" and s["steps"]["last_per_rank"] == {"0": 11, "1": 11}
    failure = s["first_failure"]
    assert failure["rank"] == 1 and "InjectedCrash" in failure["error"]
    assert failure["peer_loss"] == [0]
    assert s["stragglers"]["now"] == []  # no rank runs any more
    over = s["stragglers"]["over_run"]  # but over the run rank 1 came late to the all-reduces
    assert [row["rank"] for row in over] == [1] and over[0]["measure"] == "arrival_lateness_s"
    text = scalemon(home, "summary", "crashed").stdout
    assert "first failure: rank 1 failed first (step 11)" in text
    assert "stragglers over the run by arrival at collectives, vs the first rank: rank 1" in text


def test_summary_reads_every_page_of_a_long_history(start_hub, home, zctx):
    from scalemon.link.client import PAGE

    hub = start_hub("long")
    rank = FakeRank(zctx, hub.address, "long", 0)
    rank.hello(world_size=1)
    steps = PAGE + 500  # more records than one fetch returns
    for step in range(1, steps + 1):
        rank.step(step, loss=1.0 + 1.0 / step)
    client = HubClient(hub.address)
    wait_for(lambda: client.state()["head"] >= steps + 1, timeout=60)
    client.close()
    s = strict_json(scalemon(home, "summary", "long", "--json").stdout)
    assert s["source"]["kind"] == "hub" and s["steps"]["count"] == steps
    assert s["loss"]["first"] == {"step": 1, "value": 2.0}
    assert s["loss"]["min"]["step"] == steps == s["loss"]["last"]["step"]
    assert s["step_time"]["per_rank"]["0"]["samples"] == steps


@pytest.mark.integration
def test_summary_of_a_running_job_then_its_toggle_and_flag_after_it_ended(home):
    proc = subprocess.Popen(
        torchrun_cmd("--preset", "tiny", "--batch-size", "2", "--max-steps", "200",
                     "--step-delay", "0.05", "--monitor"),
        env=job_env(home, "toggled"), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        def running() -> dict | None:
            done = scalemon(home, "summary", "toggled", "--json")
            s = strict_json(done.stdout) if done.returncode == 0 else None
            return s if s and s["state"] == "running" and \
                (s["steps"]["last_on_every_rank"] or 0) >= 3 else None

        live = wait_for(running, timeout=120, interval=0.5)
        assert live["source"]["kind"] == "hub" and live["flags"]["TORCH_DISTRIBUTED_DEBUG"] == "OFF"
        done = scalemon(home, "toggle", "toggled", "TORCH_DISTRIBUTED_DEBUG=DETAIL")
        assert done.returncode == 0, done.stdout + done.stderr
        assert proc.wait(timeout=240) == 0
    finally:
        kill_tree(proc)
    s = strict_json(scalemon(home, "summary", "toggled", "--json").stdout)
    assert s["state"] == "finished" and s["steps"]["last"] == 200
    [toggle] = s["toggles"]
    assert toggle["name"] == "TORCH_DISTRIBUTED_DEBUG" and toggle["value"] == "DETAIL"
    assert toggle["state"] == "applied"
    assert s["flags"]["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    text = scalemon(home, "summary", "toggled").stdout
    assert re.search(r"^toggle #\d+ .* TORCH_DISTRIBUTED_DEBUG=DETAIL .*applied", text, re.M), text


def test_unknown_job_is_one_line_and_exit_2(home):
    for args in (("summary", "nosuchjob"), ("compare", "nosuchjob", "other"),
                 ("summary", "--json", "nosuchjob")):
        done = scalemon(home, *args)
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith(f"scalemon {args[0]}: no live hub for job 'nosuchjob'")
        assert "no history file" in done.stderr and "Traceback" not in done.stderr
    bad = scalemon(home, "summary", "../x")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "job id" in bad.stderr


def _step(rank: FakeRank, step: int, loss: float, step_time: float, mem: int) -> None:
    rank.send("step", {"step": step, "loss": loss, "tokens": 128, "step_time_s": step_time,
                       "mem_allocated_bytes": mem, "mem_peak_bytes": mem + 1000,
                       "extra": {"tokens_per_s": 1000.0 * (rank.rank + 1), "mfu": 0.25}})


def test_summary_of_a_hub_fed_job_nan_stragglers_stalls_memory(start_hub, home, zctx):
    hub = start_hub("fed", "--hang-after", "0.5")
    ranks = [FakeRank(zctx, hub.address, "fed", r) for r in (0, 1)]
    for r in ranks:
        r.hello(world_size=2)
    for step in range(1, 7):
        if step == 4:
            time.sleep(1.3)  # no step for longer than the hang threshold (and a second): a stall
        _step(ranks[0], step, float("nan") if step == 2 else 5.0 - step * 0.5, 0.01,
              1000 * step)
        _step(ranks[1], step, 6.0 - step * 0.5, 0.05, 2000)  # 40 ms slower: a straggler

    client = HubClient(hub.address)
    wait_for(lambda: client.state()["head"] >= 14)
    client.close()
    done = scalemon(home, "summary", "fed", "--json")
    assert done.returncode == 0, done.stderr
    s = strict_json(done.stdout)  # the NaN loss is null, not a NaN literal
    loss = s["loss"]
    assert loss["first"] == {"step": 1, "value": 4.5}
    assert loss["last"] == {"step": 6, "value": 2.0} and loss["min"] == {"step": 6, "value": 2.0}
    assert loss["nonfinite"] == 1
    assert s["tokens_per_s"]["job"]["median"] == 3000.0  # the ranks' rates summed per step
    assert s["mfu"]["median"] == 0.25 and s["mfu"]["samples"] == 6
    assert s["step_time"]["per_rank"]["1"]["median"] == 0.05
    assert s["step_time"]["slowest"] == [{"rank": 1, "median": 0.05}]
    over = s["stragglers"]["over_run"]
    assert [row["rank"] for row in over] == [1]
    assert over[0]["measure"] == "compute_over_median_s" and over[0]["value_s"] > over[0]["bar_s"]
    # the threshold is 0.5 s, but the history's clock finds stalls from a second on, and says so
    assert s["hangs"]["stall_after_s"] == 1.0 and s["hangs"]["hang_after_s"] == 0.5
    assert s["hangs"]["stall_count"] == 1
    assert s["hangs"]["stalls"][0]["after_step"] == 3 and s["hangs"]["stalls"][0]["seconds"] >= 1.0
    assert s["memory"]["per_rank"]["0"]["mem_allocated_bytes"] == 6000
    assert s["memory"]["per_rank"]["0"]["peak_bytes"] == 7000
    assert s["memory"]["peak_bytes"] == 7000

    text = scalemon(home, "summary", "fed")
    assert text.returncode == 0
    assert "(1 NaN/inf)" in text.stdout and "slowest: rank 1 (50.0 ms)" in text.stdout
    assert "stragglers over the run by compute time, vs the median rank: rank 1" in text.stdout


def test_the_step_clock_finds_every_stall_from_a_second_on_and_none_shorter():
    clock = StepClock()
    for t, step in [(100.10, 3), (100.95, 4), (101.2, 5), (102.9, 6), (103.0, 7), (107.5, 8)]:
        clock.add(t, step)
    clock.add(103.9, 7)  # a late record of an earlier step, out of order: still a record at t
    # 0.85 s inside second 100 is under the clock's resolution: asked for 0.5 s, it counts
    # from a second, as it says, and finds the 1.7 s and 3.6 s gaps exactly
    assert StepClock.stall_floor(0.5) == 1.0 and StepClock.stall_floor(30.0) == 30.0
    assert [(t0, s0, round(sec, 6)) for t0, s0, sec in clock.stalls(0.5)] == [
        (101.2, 5, 1.7), (103.9, 7, 3.6)]
    assert [s0 for _, s0, _ in clock.stalls(2.0)] == [7]
    assert clock.stalls(None) == []


def test_quantile_and_common_steps():
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert quantile([1.0, float("nan"), 2.0], 0.0) == 1.0
    assert quantile([], 0.5) is None
    assert common_steps(range(1, 101), range(50, 201)) == [55, 75, 100]
    assert common_steps([1, 2], [3, 4]) == []


def test_text_of_many_ranks_shows_the_slowest_and_says_so():
    from scalemon.reports.summary import RANK_LINES_MAX, RunRecords, summarize
    from scalemon.reports.summary_text import summary_text

    ranks = range(3 * RANK_LINES_MAX)
    records = RunRecords(steps={r: {s: {"step_time_s": 0.01 + r * 1e-4, "loss": 1.0}
                                    for s in range(1, 5)} for r in ranks})
    state = {"job": "many", "state": "finished", "world_size": len(ranks),
             "ranks": [{"rank": r, "state": "finished"} for r in ranks]}
    text = summary_text(summarize(state, records, {"kind": "history", "where": "f"}))
    shown = re.findall(r"^  rank (\d+): median", text, re.M)
    assert [int(r) for r in shown] == list(ranks)[::-1][:RANK_LINES_MAX // 2]
    assert f"({RANK_LINES_MAX // 2} of {len(ranks)} ranks shown, the slowest;" in text


def test_summary_and_compare_into_a_closed_pipe_stop_quietly(start_hub, home, zctx):
    from test_cli_pipe import run_into_closed_pipe

    from scalemon.cli.main import STDOUT_CLOSED

    hub = start_hub("piped")
    rank = FakeRank(zctx, hub.address, "piped", 0)
    rank.hello(world_size=1)
    for step in range(1, 30):
        rank.step(step, loss=3.0 - step * 0.01)
    client = HubClient(hub.address)
    wait_for(lambda: client.state()["head"] >= 30)
    client.close()
    for args in (["summary", "piped"], ["summary", "piped", "--json"],
                 ["compare", "piped", "piped"], ["compare", "piped", "piped", "--json"]):
        out = run_into_closed_pipe(*args, home=home)
        assert out.stderr == "" and out.returncode == STDOUT_CLOSED, args
