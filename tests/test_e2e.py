"""End to end with real processes: torchrun with two gloo ranks, the auto-started hub, the CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import scalemon
from conftest import kill_tree, torchrun_cmd, wait_for
from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir
from scalemon.link.client import HubClient, HubStream

pytestmark = pytest.mark.integration


def job_env(home: Path, job: str, linger: float = 60) -> dict[str, str]:
    env = os.environ.copy()
    env.update(SCALEMON_HOME=str(home), SCALEMON_JOB_ID=job, OMP_NUM_THREADS="1",
               SCALEMON_HUB_ARGS=f"--linger {linger}")
    return env


def start_job(home: Path, job: str, *train_args: str, linger: float = 60) -> subprocess.Popen:
    log = open(home / f"{job}.out", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(torchrun_cmd("--monitor", *train_args), env=job_env(home, job, linger),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def snapshot(home: Path, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "scalemon", "snapshot", "--json", *args],
                         env=job_env(home, "unused"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def hub_address(home: Path, job: str) -> HubAddress:
    path = jobs_dir(home) / f"{job}.json"
    return HubAddress.parse(wait_for(lambda: path.exists() and JobFile.read(path)).address)


def rank_steps(home: Path, job: str) -> list:
    """Each rank's last step ([] before the job's hub wrote its job file). An unreachable hub
    or a bad reply raises: a real error, not a reason to wait."""
    path = jobs_dir(home) / f"{job}.json"
    if not path.exists():
        return []
    address = HubAddress.parse(JobFile.read(path).address)
    client = HubClient(address, timeout_s=10)
    try:
        state = client.state()["state"]
    finally:
        client.close()
    return [r["step"] or 0 for r in state["ranks"]]


def test_torchrun_job_then_snapshot_shows_both_ranks_finished(home):
    job = start_job(home, "e2e1", "--max-steps", "20")
    try:
        assert job.wait(timeout=240) == 0, (home / "e2e1.out").read_text()
    finally:
        kill_tree(job)
    printed = re.findall(r"^step (\d+) loss (\S+)$", (home / "e2e1.out").read_text(), re.M)
    assert [int(s) for s, _ in printed] == list(range(1, 21))
    state = snapshot(home)  # no argument: the only live job
    assert state["job"] == "e2e1" and state["world_size"] == 2 and state["state"] == "finished"
    ranks = state["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["step"] == 20 and r["state"] == "finished" for r in ranks)
    assert f"{ranks[0]['loss']:.4f}" == printed[-1][1]
    assert ranks[0]["loss"] != ranks[1]["loss"]  # each rank reports its own loss
    for r in ranks:
        assert r["host"] and r["pid"] and r["backend"] == "gloo" and r["device"] == "cpu"
        assert r["step_time_s"] > 0 and r["optimizer_time_s"] > 0
        assert r["allreduce_time_s"] > 0 and r["allreduce_count"] >= 1
        assert r["allreduce_bytes"] > 0
        assert r["mem_allocated_bytes"] is None and r["gpu_util_pct"] is None  # n/a on CPU
        assert r["rss_bytes"] > 0 and r["dropped"] == 0 and r["seq_gaps"] == 0
        # tokens/s from the steps' tokens and times, the agent's identity reach the snapshot too
        assert r["last_tokens_per_s"] > 0 and r["tokens_per_s_source"] == "steps"
        assert r["tokens_per_s"] is None  # finished: no live rate
        assert "tokens_per_s" not in r["extra"] and "mfu" not in r["extra"]  # no CPU peak
        assert r["agent_version"] == scalemon.__version__ and r["torch_version"]
    config = state["info"]["config"]
    assert sorted(config) == ["0", "1"] and config["0"]["preset"] == "tiny"
    assert config["1"]["device"] == "cpu" and config["1"]["max_steps"] == 20


def test_client_attaching_after_step_10_gets_steps_1_to_20_once(home):
    job = start_job(home, "e2e2", "--max-steps", "20", "--step-delay", "0.15")
    try:
        wait_for(lambda: (s := rank_steps(home, "e2e2")) and len(s) == 2 and min(s) >= 10,
                 timeout=120)
        stream = HubStream(hub_address(home, "e2e2"))
        got = []
        exits = set()
        end = time.monotonic() + 120
        while len(exits) < 2 and time.monotonic() < end:
            for _, msg in stream.poll(0.1):
                got.append(msg)
                if msg.type == "exit":
                    exits.add(msg.rank)
        stream.close()
        assert job.wait(timeout=60) == 0
    finally:
        kill_tree(job)
    for rank in (0, 1):
        steps = [m.body["step"] for m in got if m.type == "step" and m.rank == rank]
        assert steps == list(range(1, 21)), f"rank {rank}: {steps}"


def test_hub_killed_mid_run_training_finishes_and_a_new_hub_gets_later_steps(home):
    job = start_job(home, "e2e3", "--max-steps", "60", "--step-delay", "0.1")
    try:
        wait_for(lambda: (s := rank_steps(home, "e2e3")) and min(s, default=0) >= 10,
                 timeout=120)
        old = JobFile.read(jobs_dir(home) / "e2e3.json")
        os.kill(old.pid, signal.SIGKILL)
        time.sleep(1.0)
        assert job.poll() is None, "training died with its hub"
        new_hub = subprocess.Popen(
            [sys.executable, "-m", "scalemon.hub", "--job", "e2e3", "--home", str(home)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        assert job.wait(timeout=180) == 0, (home / "e2e3.out").read_text()
        state = wait_for(lambda: (s := snapshot(home, "e2e3"))["state"] == "finished" and s)
        assert [r["step"] for r in state["ranks"]] == [60, 60]
        assert state["hub"]["pid"] == new_hub.pid
    finally:
        kill_tree(job)
        if "new_hub" in locals():
            kill_tree(new_hub)


@pytest.mark.parametrize("victim", [1])
def test_sigkill_of_a_rank_shows_lost_within_5_s(home, victim):
    job = start_job(home, "e2e4", "--max-steps", "2000", "--step-delay", "0.05")
    try:
        wait_for(lambda: (s := rank_steps(home, "e2e4")) and len(s) == 2 and min(s) >= 5,
                 timeout=120)
        pid = snapshot(home, "e2e4")["ranks"][victim]["pid"]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        view = wait_for(
            lambda: (r := snapshot(home, "e2e4")["ranks"][victim])["state"] in ("gone", "exited")
            and r, timeout=5)
        assert time.monotonic() - killed <= 5.0
        assert view["state_reason"]
    finally:
        kill_tree(job)
