"""Liveness told truthfully, with real processes: a real hub, ranks that are real processes
sending over real ZeroMQ sockets, one of them frozen in native code holding the GIL (libc
`sleep` through `ctypes.PyDLL`, which keeps the GIL): the hub calls it `frozen` with where it
is stuck, read from outside by py-spy (its own threads cannot answer); `gone` once it is
killed; `silent` where nothing on its node can look at it; through a node's relay for a rank
on another node, and `unreachable` once that relay is silent too. `scalemon stacks` prints a
frozen rank's stacks, live ranks' too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import FakeRank, wait_for
from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir, relay_dir
from scalemon.link.client import HubClient

pytestmark = pytest.mark.integration

# A rank of our own: hello with its pid (and the host given), a heartbeat every 0.1 s from a
# thread, then, told by a line on stdin, it freezes in native code holding the GIL.
RANK = r"""
import ctypes, os, sys, threading, time
import zmq
from scalemon import protocol
endpoint, job, rank, host = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
sock = zmq.Context().socket(zmq.PUSH)
sock.setsockopt(zmq.LINGER, 1000)
sock.connect(endpoint)
seq = [0]
lock = threading.Lock()
def send(mtype, body):
    with lock:
        sock.send(protocol.encode(mtype, job, rank, seq[0], body))
        seq[0] += 1
send("hello", {"host": host, "pid": os.getpid(), "world_size": 3, "local_rank": rank})
send("step", {"step": 1, "loss": 1.0, "tokens": 8, "step_time_s": 0.01})
def beat():
    while True:
        send("heartbeat", {"phase": "forward", "dropped": 0})
        time.sleep(0.1)
threading.Thread(target=beat, daemon=True).start()
def freeze_holding_the_gil():
    ctypes.PyDLL(None).sleep(600)
print("ready", flush=True)
sys.stdin.readline()
freeze_holding_the_gil()
"""


def start_rank(endpoint: str, job: str, rank: int, host: str | None = None,
               env: dict[str, str] | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK, endpoint, job, str(rank), host or os.uname().nodename],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def freeze(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.write("now\n")
    proc.stdin.flush()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def rank_of(client: HubClient, rank: int) -> dict:
    """The rank's entry in the hub's state ({"state": None} before its first message)."""
    ranks = client.state()["state"]["ranks"]
    return next((r for r in ranks if r["rank"] == rank), {"state": None})


def scalemon(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scalemon.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_a_rank_frozen_holding_the_gil_is_frozen_with_its_native_stack_then_gone(
        start_hub, zctx, home: Path) -> None:
    job = "frozen1"
    hub = start_hub(job, "--world-size", "3", "--lost-after", "1", "--hang-after", "3")
    client = HubClient(hub.address)
    live = FakeRank(zctx, hub.address, job, 0)
    live.hello()
    live.step(1)
    frozen = start_rank(hub.address.ingest, job, 1)
    try:
        wait_for(lambda: rank_of(client, 1)["state"] == "running", timeout=10)
        freeze(frozen)
        frozen_at = time.monotonic()

        def said() -> dict | None:
            live.heartbeat()  # rank 0 speaks on
            rank = rank_of(client, 1)
            return rank if rank["state"] == "frozen" and rank["where"] else None

        rank = wait_for(said, timeout=20, interval=0.2)
        took = time.monotonic() - frozen_at
        print(f"frozen and where after {took:.1f} s")
        assert "holding the GIL" in rank["where"], rank["where"]
        assert "freeze_holding_the_gil" in rank["where"], rank["where"]
        assert rank["process"]["exists"] and rank["process"]["pid"] == frozen.pid
        assert rank["process"]["cpu_moving"] in (True, False)  # a thread waits for the GIL
        outside = rank["outside_stacks"]
        assert outside["reader"].startswith("hub on ")
        names = [f["name"] for t in outside["reading"]["threads"] for f in t["frames"]]
        assert "freeze_holding_the_gil" in names
        assert rank_of(client, 0)["state"] == "running"

        # `scalemon stacks` reads every rank, the live one too; --native shows libc's frames
        out = scalemon("stacks", job, "--native")
        assert out.returncode == 0, out.stderr
        assert "rank 0" in out.stdout and "rank 1" in out.stdout
        assert "freeze_holding_the_gil" in out.stdout
        assert "holds the GIL" in out.stdout or "holding the GIL" in out.stdout
        as_json = json.loads(scalemon("stacks", job, "--rank", "1", "--json").stdout)
        assert set(as_json["ranks"]) == {"1"}

        frozen.kill()  # a frozen rank whose process ends is gone
        frozen.wait(timeout=10)
        rank = wait_for(lambda: (r := rank_of(client, 1))["state"] == "gone" and r,
                        timeout=10, interval=0.2)
        assert f"process {frozen.pid} ended" in rank["state_reason"]
        assert scalemon("stacks", job, "--rank", "1").returncode == 1  # nothing to read
    finally:
        stop(frozen)
        client.close()


def test_a_silent_rank_on_a_node_nothing_looks_at_is_silent_not_frozen(
        start_hub, zctx, home: Path) -> None:
    job = "silent1"
    hub = start_hub(job, "--world-size", "2", "--lost-after", "1")
    client = HubClient(hub.address)
    try:
        elsewhere = FakeRank(zctx, hub.address, job, 1)
        elsewhere.send("hello", {"host": "node9", "pid": 4242, "world_size": 3,
                                 "local_rank": 0})
        rank = wait_for(lambda: (r := rank_of(client, 1))["state"] not in (None, "running")
                        and r, timeout=15, interval=0.2)
        assert rank["state"] == "silent"
        assert "no scalemon relay reports from its node node9" in rank["state_reason"]
    finally:
        client.close()


def test_a_relay_looks_at_its_nodes_frozen_rank_and_its_silence_makes_ranks_unreachable(
        start_hub, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = "relayfrozen"
    monkeypatch.setenv("SCALEMON_NODE", "hubnode")  # the hub's node
    start_hub(job, "--listen", "tcp://127.0.0.1:0", "--world-size", "3", "--lost-after", "1")
    monkeypatch.setenv("SCALEMON_NODE", "node1")  # the relay's and its ranks' node
    monkeypatch.setenv("SCALEMON_RUNTIME_DIR", tempfile.mkdtemp(prefix="smr", dir="/tmp"))
    jf = JobFile.read(jobs_dir(home) / f"{job}.json")
    client = HubClient(HubAddress(jf.tcp["ingest"], jf.tcp["feed"], jf.tcp["rpc"],
                                  server_key=jf.server_key), timeout_s=5.0)
    relay = subprocess.Popen([sys.executable, "-m", "scalemon.relay", "--job", job, "--home",
                              str(home), "--linger", "60"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    local = HubAddress.for_directory(relay_dir(job))
    wait_for(lambda: Path(local.ingest.removeprefix("ipc://")).exists(), timeout=20)
    ranks = [start_rank(local.ingest, job, r, host="node1") for r in (1, 2)]
    try:
        wait_for(lambda: len(client.state()["state"]["ranks"]) == 2, timeout=20)
        freeze(ranks[0])
        rank = wait_for(lambda: (r := rank_of(client, 1))["state"] == "frozen"
                        and r["where"] and r, timeout=30, interval=0.3)
        assert "freeze_holding_the_gil" in rank["where"]
        assert rank["outside_stacks"]["reader"] == "relay of node1"
        assert rank_of(client, 2)["state"] == "running"

        relay.send_signal(signal.SIGKILL)  # the node's relay dies: rank 2 cannot be heard
        relay.wait(timeout=10)
        rank = wait_for(lambda: (r := rank_of(client, 2))["state"] != "running" and r,
                        timeout=30, interval=0.3)
        assert rank["state"] == "unreachable", rank["state_reason"]
        assert "relay" in rank["state_reason"]
        # the frozen rank's node cannot be looked at any more either
        wait_for(lambda: rank_of(client, 1)["state"] == "unreachable", timeout=15,
                 interval=0.3)
    finally:
        for proc in ranks:
            stop(proc)
        stop(relay)
        client.close()


def test_the_demos_injected_freeze_is_named_frozen_with_its_stack_read_from_outside(
        home: Path, tmp_path: Path) -> None:
    """The issue's check: `--inject-freeze 1:10` on the demo; within the hang threshold + 10 s
    rank 1 alone is the culprit, frozen (not lost), with a stack read from outside that
    reaches the demo's freezing function, and `scalemon stacks JOB` prints it."""
    from test_collectives_jobs import job_env, snapshot

    from conftest import REPO, kill_tree, torchrun_cmd

    hang_after = 5.0
    env = {**job_env(home), "SCALEMON_HANG_AFTER": str(hang_after)}
    out = tmp_path / "job.out"
    with open(out, "w") as log:
        proc = subprocess.Popen(
            torchrun_cmd("--preset", "tiny", "--batch-size", "2", "--max-steps", "200",
                          "--monitor", "--inject-freeze", "1:10"),
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    try:
        wait_for(lambda: "rank 1: injected freeze before step 10" in out.read_text(),
                 timeout=150, interval=0.2)
        frozen_at = time.monotonic()
        state = wait_for(lambda: (s := snapshot(home)) and s["hang"]
                         and s["ranks"][1]["where"] and s, timeout=hang_after + 25,
                         interval=0.5)
        took = time.monotonic() - frozen_at
        print(f"named frozen with its stack {took:.1f} s after the freeze")
        assert took <= hang_after + 10.0, f"named after {took:.1f} s"
        hang, rank1 = state["hang"], state["ranks"][1]
        assert hang["culprits"] == [1], hang["text"]
        assert rank1["state"] == "frozen" and state["ranks"][0]["state"] == "running"
        assert "freeze_holding_the_gil" in rank1["where"] and "GIL" in rank1["where"]
        assert hang["causes"][0]["cause"] == "frozen"
        assert hang["text"].startswith(f"rank 1: {rank1['where']}"), hang["text"]
        assert "read from outside the process" in hang["stacks"]["1"]
        assert "freeze_holding_the_gil" in hang["stacks"]["1"]
        shown = subprocess.run([sys.executable, "-m", "scalemon.cli", "stacks", home.name],
                               env=env, capture_output=True, text=True, timeout=90)
        assert shown.returncode == 0, shown.stderr
        assert "freeze_holding_the_gil" in shown.stdout and "rank 0" in shown.stdout
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- the job's output ends:\n{out.read_text()[-3000:]}"
                             ) from exc
    finally:
        kill_tree(proc)
