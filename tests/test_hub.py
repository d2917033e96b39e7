"""The hub as a real process: ingest, history, late attach, garbage, lost ranks, job files."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from conftest import FakeRank, wait_for
from scalemon import protocol
from scalemon.client import HubClient, HubStream
from scalemon.jobs import JobFile, jobs_dir


def hub_state(hub) -> dict:
    return HubClient(hub.address, timeout_s=5).state()


def collect(stream: HubStream, until, timeout: float = 10.0) -> list:
    got = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got.extend(stream.poll(0.05))
        if until(got):
            return got
    raise AssertionError(f"stream incomplete after {timeout} s: {len(got)} records")


def test_snapshot_shows_ranks_steps_and_losses(start_hub, zctx):
    hub = start_hub("jobA")
    ranks = [FakeRank(zctx, hub.address, "jobA", r) for r in range(2)]
    for r in ranks:
        r.hello()
    for step in range(1, 6):
        for r in ranks:
            r.step(step, loss=10.0 - step - r.rank / 10)
    state = wait_for(lambda: len((s := hub_state(hub))["state"]["ranks"]) == 2
                     and all(x["step"] == 5 for x in s["state"]["ranks"]) and s)
    ranks_json = state["state"]["ranks"]
    assert [x["rank"] for x in ranks_json] == [0, 1]
    assert [x["loss"] for x in ranks_json] == [5.0, pytest.approx(4.9)]
    assert state["state"]["world_size"] == 2 and state["state"]["state"] == "running"
    assert state["hub"]["rejected"] == 0 and state["head"] == 12


def test_late_client_gets_whole_history_then_live_exactly_once(start_hub, zctx):
    hub = start_hub("jobB")
    ranks = [FakeRank(zctx, hub.address, "jobB", r) for r in range(2)]
    for step in range(1, 11):
        for r in ranks:
            r.step(step)
    wait_for(lambda: hub_state(hub)["head"] == 20)
    stream = HubStream(hub.address)  # attaches after step 10
    for step in range(11, 21):
        for r in ranks:
            r.step(step)
        time.sleep(0.01)
    got = collect(stream, lambda g: len(g) >= 40)
    time.sleep(0.3)
    got.extend(stream.poll(0.2))
    stream.close()
    assert [seq for seq, _ in got] == list(range(40))
    for rank in range(2):
        steps = [m.body["step"] for _, m in got if m.rank == rank]
        assert steps == list(range(1, 21))


def test_stream_fills_a_gap_left_by_the_live_feed(start_hub, zctx):
    hub = start_hub("jobC")
    rank = FakeRank(zctx, hub.address, "jobC", 0)
    stream = HubStream(hub.address)
    rank.step(1)
    wait_for(lambda: hub_state(hub)["head"] == 1)
    stream.sub.setsockopt(zmq.UNSUBSCRIBE, protocol.FEED_TOPIC)  # miss the next records live
    time.sleep(0.2)
    for step in range(2, 6):
        rank.step(step)
    wait_for(lambda: hub_state(hub)["head"] == 5)
    stream.sub.setsockopt(zmq.SUBSCRIBE, protocol.FEED_TOPIC)
    time.sleep(0.3)
    rank.step(6)
    got = collect(stream, lambda g: len(g) >= 6)
    assert [m.body["step"] for _, m in got] == [1, 2, 3, 4, 5, 6]
    stream.close()


def garbage_frames(rng: random.Random) -> list[bytes]:
    valid = protocol.encode("step", "jobD", 0, 0, {"step": 1})
    wrong_major = msgpack.packb({"v": [99, 0], "type": "step", "job": "jobD", "rank": 0,
                                 "seq": 0, "t": 1.0, "body": {"step": 1}})
    return [
        bytes(rng.randrange(256) for _ in range(200)),
        valid[: len(valid) // 2],
        wrong_major,
        b"\x00" * (2 << 20),  # 2 MiB: over the 1 MiB message limit, under zmq's frame cap
        protocol.encode("step", "other-job", 0, 0, {"step": 1}),
        protocol.encode("step", "jobD", 0, 0, {"loss": 1.0}),
        protocol.encode("rank_state", "jobD", -1, 0, {"target": 0, "state": "lost"}),
        msgpack.packb({"v": [1, 0], "type": "rank_state", "job": "jobD", "rank": 0, "seq": 0,
                       "t": 1.0, "body": {"target": 0, "state": "lost"}}),
    ]


def test_garbage_is_counted_and_logged_and_loses_no_valid_message(start_hub, zctx):
    hub = start_hub("jobD")
    rng = random.Random(7)
    good = FakeRank(zctx, hub.address, "jobD", 0)
    bad = zctx.socket(zmq.PUSH)
    bad.connect(hub.address.ingest)
    rpc_bad = zctx.socket(zmq.DEALER)
    rpc_bad.connect(hub.address.rpc)
    sent_bad = 0
    cut_off = zctx.socket(zmq.PUSH)  # over zmq's 16 MiB frame cap: the hub drops the peer
    cut_off.connect(hub.address.ingest)
    cut_off.send(b"\x01" * (20 << 20))
    for step in range(1, 101):
        good.step(step)
        if step % 10 == 0:
            for frame in garbage_frames(rng):
                bad.send(frame)
                sent_bad += 1
            rpc_bad.send(b"\xc1garbage")
    state = wait_for(lambda: (s := hub_state(hub))["state"]["ranks"]
                     and s["state"]["ranks"][0]["step"] == 100 and s["hub"]["rejected"]
                     >= sent_bad + 10 and s)
    assert hub.proc.poll() is None
    assert state["state"]["ranks"][0]["steps_received"] == 100
    assert state["state"]["ranks"][0]["seq_gaps"] == 0
    assert state["hub"]["rejected"] == sent_bad + 10
    reasons = " ".join(state["hub"]["reject_reasons"])
    assert "not msgpack" in reasons and "protocol version 99.0" in reasons
    assert "exceeds" in reasons and "other-job" in reasons
    assert "reserved for the hub" in reasons and "rank_state message from rank 0" in reasons
    assert state["state"]["ranks"][0]["state"] == "running"  # the forged rank_state did nothing
    log = hub.log.read_text()
    assert "rejected frame #1" in log
    # garbage and wrong-major rpc requests get a clear refusal, not silence
    for _ in range(10):
        assert rpc_bad.poll(5000)
        assert b"not msgpack" in rpc_bad.recv_multipart()[-1]
    rpc_bad.send(msgpack.packb({"v": [1, 0], "op": {"not": "a name"}}))
    assert rpc_bad.poll(5000)
    assert b"unknown request op" in rpc_bad.recv_multipart()[-1]
    rpc_bad.send(msgpack.packb({"v": [9, 0], "op": "state"}))
    assert rpc_bad.poll(5000)
    with pytest.raises(protocol.ProtocolError, match="not compatible"):
        protocol.decode_reply(rpc_bad.recv_multipart()[-1])


def test_silent_rank_turns_lost_and_comes_back(start_hub, zctx):
    hub = start_hub("jobE", "--lost-after", "1.0")
    ranks = [FakeRank(zctx, hub.address, "jobE", r) for r in range(2)]
    for r in ranks:
        r.hello()
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:  # rank 1 falls silent, rank 0 keeps beating
        ranks[0].heartbeat()
        time.sleep(0.2)
    views = hub_state(hub)["state"]["ranks"]
    assert views[0]["state"] == "running"
    assert views[1]["state"] == "lost" and "no message" in views[1]["state_reason"]
    assert hub_state(hub)["state"]["state"] == "degraded"
    ranks[1].heartbeat()
    wait_for(lambda: hub_state(hub)["state"]["ranks"][1]["state"] == "running")


def test_dead_process_is_lost_before_the_heartbeat_timeout(start_hub, zctx):
    hub = start_hub("jobF", "--lost-after", "30")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    rank = FakeRank(zctx, hub.address, "jobF", 0)
    rank.hello(world_size=1, pid=victim.pid)
    wait_for(lambda: hub_state(hub)["state"]["ranks"])
    victim.kill()
    victim.wait()
    killed = time.monotonic()
    wait_for(lambda: hub_state(hub)["state"]["ranks"][0]["state"] == "lost", timeout=5)
    assert time.monotonic() - killed < 5
    assert "gone" in hub_state(hub)["state"]["ranks"][0]["state_reason"]


def test_exit_messages_set_finished_and_exited_and_the_hub_lingers_then_leaves(start_hub, zctx):
    hub = start_hub("jobG", "--linger", "1.5")
    ranks = [FakeRank(zctx, hub.address, "jobG", r) for r in range(2)]
    for r in ranks:
        r.hello()
    ranks[0].send("exit", {"reason": "finished", "exit_code": 0, "step": 3})
    ranks[1].send("exit", {"reason": "exception", "exit_code": 1, "error": "boom"})
    state = wait_for(lambda: (s := hub_state(hub)["state"])["state"] == "ended" and s)
    assert [r["state"] for r in state["ranks"]] == ["finished", "exited"]
    assert state["ranks"][1]["exit_code"] == 1 and state["ranks"][1]["error"] == "boom"
    hub.proc.wait(timeout=10)
    assert hub.proc.returncode == 0
    assert not (jobs_dir(hub.home) / "jobG.json").exists()


def test_restarted_hub_keeps_history_and_numbering(start_hub, zctx):
    hub = start_hub("jobH")
    rank = FakeRank(zctx, hub.address, "jobH", 0)
    for step in range(1, 4):
        rank.step(step)
    wait_for(lambda: hub_state(hub)["head"] == 3)
    time.sleep(0.5)  # the history is flushed every 0.25 s
    hub.kill(signal.SIGKILL)
    hub2 = start_hub("jobH")
    for step in range(4, 6):
        rank.step(step)
    state = wait_for(lambda: (s := hub_state(hub2))["head"] == 5 and s)
    assert state["state"]["ranks"][0]["step"] == 5
    records, head = HubClient(hub2.address).fetch(0)
    assert [protocol.decode(r).body["step"] for r in records] == [1, 2, 3, 4, 5]


def test_second_hub_for_the_same_job_is_refused(start_hub, home):
    start_hub("jobI")
    out = subprocess.run([sys.executable, "-m", "scalemon.hub", "--job", "jobI"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "already running" in out.stderr


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scalemon", *args], capture_output=True,
                          text=True, timeout=60, env=os.environ.copy())


def test_cli_picks_the_only_job_lists_several_and_cleans_stale_files(start_hub, home, zctx):
    hub = start_hub("jobJ")
    FakeRank(zctx, hub.address, "jobJ", 0).step(1)
    stale = JobFile("deadjob", "ipc:///nonexistent", os.uname().nodename, 2**22 + 12345,
                    0.0, 1, "/nonexistent", [1, 0])
    stale_path = stale.write(home)
    snap = run_cli("snapshot", "--json")
    assert snap.returncode == 0, snap.stderr
    assert json.loads(snap.stdout)["job"] == "jobJ"
    assert not stale_path.exists()
    start_hub("jobK")
    several = run_cli("snapshot")
    assert several.returncode == 2
    assert "several live jobs" in several.stderr and "jobJ" in several.stderr
    assert run_cli("snapshot", "jobK", "--json").returncode == 0
    missing = run_cli("snapshot", "nosuchjob")
    assert missing.returncode == 2 and "no live hub for job 'nosuchjob'" in missing.stderr


def test_snapshot_of_an_unreachable_address_says_so(home):
    out = run_cli("snapshot", f"ipc://{home}/nothing-here", "--timeout", "0.5")
    assert out.returncode == 2 and "no answer from the hub" in out.stderr


def test_snapshot_replays_history_after_the_hub_is_gone(start_hub, zctx):
    hub = start_hub("jobL")
    rank = FakeRank(zctx, hub.address, "jobL", 0)
    rank.step(1, loss=3.5)
    wait_for(lambda: hub_state(hub)["head"] == 1)
    hub.kill(signal.SIGTERM)
    out = run_cli("snapshot", "jobL", "--json")
    assert out.returncode == 0, out.stderr
    assert "replaying" in out.stderr
    assert json.loads(out.stdout)["ranks"][0]["loss"] == 3.5


def test_hub_of_a_job_whose_other_ranks_never_reported_exits_after_lingering(start_hub, zctx):
    hub = start_hub("jobM", "--linger", "1")
    rank = FakeRank(zctx, hub.address, "jobM", 0)
    rank.hello(world_size=4)  # ranks 1-3 run on nodes that cannot reach this hub
    rank.step(1)
    rank.send("exit", {"reason": "finished", "exit_code": 0, "step": 1})
    assert hub_state(hub)["state"]["state"] != "finished"  # 1 of 4 ranks is not the job
    assert hub.proc.wait(timeout=15) == 0
    assert "abandoned" in hub.log.read_text()


def test_stream_refuses_a_history_shorter_than_what_it_delivered(start_hub, zctx):
    from scalemon.client import HistoryReset

    hub = start_hub("jobN")
    rank = FakeRank(zctx, hub.address, "jobN", 0)
    for step in range(1, 4):
        rank.step(step)
    wait_for(lambda: hub_state(hub)["head"] == 3)
    stream = HubStream(hub.address, since=10)  # as if it had seen 10 records of another hub
    with pytest.raises(HistoryReset, match="holds 3 records but 10"):
        for _ in range(50):
            stream.poll(0.05, sync_every_s=0)
    stream.close()
