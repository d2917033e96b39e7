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

from conftest import FakeRank, hub_messages, wait_for
from scalemon import protocol
from scalemon.home.history import history_path, read_records
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir
from scalemon.hub.limits import REASON_CLASSES
from scalemon.link.client import HubClient, HubStream


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
    """Four records never reach the stream live (their feed batches are taken away): the next
    live record shows the gap, and the stream fetches exactly it over RPC (the periodic
    catch-up is off here, so nothing else can bring them) and delivers every record in order."""
    hub = start_hub("jobC")
    rank = FakeRank(zctx, hub.address, "jobC", 0)
    stream = HubStream(hub.address)
    fetches: list[tuple[int, int]] = []
    fetch = stream.client.fetch

    def recording_fetch(since: int, limit: int = 10_000) -> tuple[list[bytes], int]:
        fetches.append((since, limit))
        return fetch(since, limit)

    stream.client.fetch = recording_fetch
    live_only = float("inf")  # never the periodic catch-up
    got: list = []
    sent = 0

    def feed_is_live() -> bool:  # a step at a time until the feed delivers them
        nonlocal sent
        sent += 1
        rank.step(sent)
        got.extend(stream.poll(0.2, sync_every_s=live_only))
        return len(got) == sent

    wait_for(feed_is_live)
    fetched_before = len(fetches)
    missed = 0
    for step in range(sent + 1, sent + 5):
        rank.step(step)
    while missed < 4:  # take the four records' live batches away from the stream
        assert stream.sub.poll(5000), "no live batch"
        missed += len(stream.sub.recv_multipart()) - 2
    rank.step(sent + 5)
    wait_for(lambda: got.extend(stream.poll(0.1, sync_every_s=live_only)) or
             len(got) == sent + 5)
    assert [m.body["step"] for _, m in got] == list(range(1, sent + 6))
    assert [seq for seq, _ in got] == list(range(sent + 5))
    assert fetches[fetched_before:] == [(sent, 4)]  # exactly the gap
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
        # out of bounds (issue #13): each was once accepted
        hello_frame(world_size=-5), hello_frame(world_size=10**12), hello_frame(rank=99),
        protocol.encode("step", "jobD", 0, 2**63, {"step": 1}),
        msgpack.packb({**msgpack.unpackb(valid), "v": [1.0, protocol.PROTOCOL_VERSION[1]]}),
        msgpack.packb({**msgpack.unpackb(valid), "v": [True, protocol.PROTOCOL_VERSION[1]]}),
    ]


def hello_frame(world_size: int = 2, rank: int = 0) -> bytes:
    return protocol.encode("hello", "jobD", rank, 0, {"host": "h", "pid": 1, "local_rank": 0,
                                                      "world_size": world_size})


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
    reasons = state["hub"]["reject_reasons"]  # the hub's own classes, never the sender's text
    for reason in ("not msgpack", "other protocol major version", "frame too big", "wrong job",
                   "rank reserved for the hub", "hub-only message type", "bad hello"):
        assert reasons.get(reason), (reason, reasons)
    assert set(reasons) <= set(REASON_CLASSES) and "other" not in reasons
    assert sum(reasons.values()) == state["hub"]["rejected"]
    recent = state["hub"]["reject_recent"]
    assert 0 < len(recent) <= 16 and all(r["reason"] in REASON_CLASSES for r in recent)
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


def test_a_silent_rank_whose_process_exists_turns_frozen_and_comes_back(start_hub, zctx):
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
    # its process (this test's own) exists: frozen, not ended, the job runs on (and hangs)
    assert views[1]["state"] == "frozen" and "no message" in views[1]["state_reason"]
    assert views[1]["process"]["pid"] == os.getpid() and views[1]["process"]["exists"]
    assert hub_state(hub)["state"]["state"] == "running"
    ranks[1].heartbeat()
    wait_for(lambda: hub_state(hub)["state"]["ranks"][1]["state"] == "running")


def test_a_dead_process_is_gone_before_the_heartbeat_timeout(start_hub, zctx):
    hub = start_hub("jobF", "--lost-after", "30")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    rank = FakeRank(zctx, hub.address, "jobF", 0)
    rank.hello(world_size=1, pid=victim.pid)
    wait_for(lambda: hub_state(hub)["state"]["ranks"])
    victim.kill()
    victim.wait()
    killed = time.monotonic()
    wait_for(lambda: hub_state(hub)["state"]["ranks"][0]["state"] == "gone", timeout=5)
    assert time.monotonic() - killed < 5
    assert f"process {victim.pid} ended" in hub_state(hub)["state"]["ranks"][0]["state_reason"]


def test_exit_messages_set_finished_and_exited_and_the_hub_lingers_then_leaves(start_hub, zctx):
    hub = start_hub("jobG", "--linger", "1.5")
    ranks = [FakeRank(zctx, hub.address, "jobG", r) for r in range(2)]
    for r in ranks:
        r.hello()
    ranks[0].send("exit", {"reason": "finished", "exit_code": 0, "step": 3})
    ranks[1].send("exit", {"reason": "exception", "exit_code": 1, "error": "boom"})
    state = wait_for(lambda: (s := hub_state(hub)["state"])["state"] == "crashed" and s)
    assert [r["state"] for r in state["ranks"]] == ["finished", "exited"]
    assert state["ranks"][1]["exit_code"] == 1 and state["ranks"][1]["error"] == "boom"
    hub.proc.wait(timeout=10)
    assert hub.proc.returncode == 0
    ended = JobFile.read(jobs_dir(hub.home) / "jobG.json")  # kept, saying the job ended
    assert ended.state == "crashed" and ended.ended is not None and not ended.is_alive()
    assert ended.hub_stopped is not None and not ended.serving()


def test_restarted_hub_keeps_history_and_numbering(start_hub, zctx):
    hub = start_hub("jobH")
    rank = FakeRank(zctx, hub.address, "jobH", 0)
    for step in range(1, 4):
        rank.step(step)
    wait_for(lambda: hub_state(hub)["head"] == 3)
    history = history_path("jobH", hub.home)
    wait_for(lambda: len(list(read_records(history))) == 3)  # flushed to the file
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
    # its one rank must not be called lost while the test runs (5 s without a message by
    # default, seen under load): a job whose ranks are all lost has ended, and is no live job
    hub = start_hub("jobJ", "--lost-after", "600")
    FakeRank(zctx, hub.address, "jobJ", 0).step(1)
    stale = JobFile("deadjob", "ipc:///nonexistent", os.uname().nodename, 2**22 + 12345,
                    0.0, 1, "/nonexistent", [1, 0])
    stale_path = stale.write(home)
    snap = run_cli("snapshot", "--json")
    assert snap.returncode == 0, snap.stderr
    assert json.loads(snap.stdout)["job"] == "jobJ"
    # a dead hub's file is not a live job, and is kept (a week) so readers can tell a hub
    # that died from a job that ended
    assert stale_path.exists() and "deadjob" not in run_cli("jobs").stdout
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
    # the reason whole (it was cut at its first ':' into "(live jobs)")
    assert "scalemon snapshot: no live hub for job 'jobL' (live jobs: none); replaying " \
        in out.stderr
    assert json.loads(out.stdout)["ranks"][0]["loss"] == 3.5


def test_hub_of_a_job_whose_other_ranks_never_reported_exits_after_lingering(start_hub, zctx):
    hub = start_hub("jobM", "--linger", "1")
    rank = FakeRank(zctx, hub.address, "jobM", 0)
    rank.hello(world_size=4)  # ranks 1-3 run on nodes that cannot reach this hub
    rank.step(1)
    rank.send("exit", {"reason": "finished", "exit_code": 0, "step": 1})
    state = wait_for(lambda: (s := hub_state(hub)["state"])["ranks"]
                     and s["ranks"][0]["state"] == "finished" and s)
    assert state["world_size"] == 4 and state["state"] == "running"  # 1 of 4 is not the job
    assert hub.proc.wait(timeout=15) == 0
    assert "abandoned" in hub.log.read_text()


def test_stream_refuses_a_history_shorter_than_what_it_delivered(start_hub, zctx):
    from scalemon.link.client import HistoryReset

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


def free_ports(count: int) -> int:
    """The first of `count` consecutive free loopback ports (a tcp hub binds port..port+2)."""
    import socket

    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            held = []
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise AssertionError("no free run of loopback ports")


def test_tcp_endpoints_carry_an_agent_a_snapshot_and_a_stream(start_hub):
    from scalemon.agent.run import Run
    from scalemon.home.address import HubAddress

    port = free_ports(3)
    address = f"tcp://127.0.0.1:{port}"
    hub = start_hub("jobT", "--address", address)
    assert (hub.address.ingest, hub.address.rpc) == (address, f"tcp://127.0.0.1:{port + 2}")
    run = Run(job="jobT", hub=address, heartbeat_s=0.2)
    for step in range(1, 6):
        run.log(step, loss=10.0 - step, tokens=32)
    # the agent's version check went over tcp too: the hub answered its ping
    assert wait_for(lambda: run.sender.hub_version) == protocol.PROTOCOL_VERSION
    run.finish()
    messages = hub_messages(hub)
    assert [m.body["step"] for m in messages if m.type == "step"] == [1, 2, 3, 4, 5]
    snap = run_cli("snapshot", address, "--json")
    assert snap.returncode == 0, snap.stderr
    rank = json.loads(snap.stdout)["ranks"][0]
    assert rank["step"] == 5 and rank["loss"] == 5.0 and rank["state"] == "finished"
    stream = HubStream(HubAddress.parse(address))
    got = collect(stream, lambda g: len(g) == len(messages))
    stream.close()
    assert [m.seq for _, m in got] == [m.seq for m in messages]


def test_a_history_beyond_the_memory_bound_is_served_from_the_file(start_hub, zctx):
    hub = start_hub("jobMem", "--memory-limit", "10")
    rank = FakeRank(zctx, hub.address, "jobMem", 0)
    for step in range(1, 51):
        rank.step(step, loss=float(step))
    wait_for(lambda: hub_state(hub)["head"] == 50)
    records, head = HubClient(hub.address).fetch(0, 1000)
    assert head == 50
    assert [protocol.decode(r).body["step"] for r in records] == list(range(1, 51))
    stream = HubStream(hub.address)  # a late dashboard: the whole history, mostly from disk
    got = collect(stream, lambda g: len(g) >= 50)
    stream.close()
    assert [m.body["step"] for _, m in got] == list(range(1, 51))
    wait_for(lambda: len(list(read_records(history_path("jobMem", hub.home)))) == 50)
    hub.kill(signal.SIGKILL)
    again = start_hub("jobMem", "--memory-limit", "10")  # rebuilds the state from the file
    view = hub_state(again)["state"]["ranks"][0]
    assert view["steps_received"] == 50 and view["step"] == 50 and view["loss"] == 50.0


def test_another_protocol_version_gets_one_clear_message_on_every_side(start_hub, zctx,
                                                                        caplog):
    """A hub of protocol 2.0 and everything else of 1.0: the hub says once that it refuses
    1.0 frames, the agent says once that the hub speaks 2.0 and stops sending, and
    `scalemon snapshot` says which versions clash instead of replaying or guessing."""
    import logging

    from scalemon.agent.run import Run

    hub = start_hub("jobV", version="2.0")
    rank = FakeRank(zctx, hub.address, "jobV", 0)
    for step in range(1, 31):
        rank.step(step)
    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        run = Run(job="jobV", hub=hub.address.base, heartbeat_s=0.2)
        wait_for(lambda: run.sender.hub_version is not None)
        run.log(1, loss=1.0)
        run.finish()
    said = [r.getMessage() for r in caplog.records if "speaks protocol" in r.getMessage()]
    ours = protocol.version_text(protocol.PROTOCOL_VERSION)
    assert len(said) == 1 and "speaks protocol 2.0" in said[0] and f"speaks {ours}" in said[0]
    assert "monitoring is off on this rank" in said[0]
    assert run.sender.dropped >= 3 and run.sender.hub_version == (2, 0)

    snap = run_cli("snapshot", "jobV")
    assert snap.returncode == 2 and snap.stdout == ""
    assert snap.stderr.count("\n") == 1 and "replaying" not in snap.stderr
    assert f"speaks scalemon protocol 2.0, this scalemon (0.1.0) speaks {ours}" in snap.stderr

    log = wait_for(lambda: "refusing" in (text := hub.log.read_text()) and text)
    refusals = [line for line in log.splitlines() if "refusing every frame" in line]
    assert len(refusals) == 1  # 30 frames and a ping, one line
    assert f"protocol version {ours}" in refusals[0] and "speaks 2.0" in refusals[0]


@pytest.mark.parametrize("world, every", [(2, 1.0), (512, 5.0)])
def test_the_sync_reply_asks_a_big_jobs_stepping_ranks_for_fewer_heartbeats(
        start_hub, world: int, every: float) -> None:
    hub = start_hub(f"beat{world}", "--world-size", str(world))
    client = HubClient(hub.address)
    try:
        reply = client.request("sync", rank=0, t=time.time())
        assert reply["heartbeat_stepping_s"] == every
        # a relay's report gets the same, and may answer its ranks' syncs
        relay = client.request("relay", node="n1", pid=os.getpid(), t=time.time(),
                               stats={}, ranks=[1])
        assert relay["answers_syncs"] is True and relay["heartbeat_stepping_s"] == every
        assert relay["commands"] == []
        with pytest.raises(protocol.ProtocolError, match="relay.ranks holds"):
            client.request("relay", node="n1", pid=os.getpid(), t=time.time(), stats={},
                           ranks=["x"])
    finally:
        client.close()


def test_a_hub_keeps_the_summary_checkpoint_of_its_sealed_history_fresh(start_hub, home) -> None:
    """Once the history's tail is sealed into a compressed chunk, the hub has a process of
    its own fold it into the checkpoint beside the history, which `summary` then reads."""
    from scalemon.home.history import history_path
    from scalemon.link.checkpoint import last_checkpoint

    hub = start_hub("sealed", "--world-size", "1")
    ctx = zmq.Context()
    rank = FakeRank(ctx, hub.address, "sealed", 0)
    try:
        rank.hello(world_size=1)
        pad = "x" * 3000  # some 3 KB a record: the 8 MiB tail seals after ~2,900 of them
        for step in range(1, 3501):
            rank.send("step", {"step": step, "loss": 1.0, "step_time_s": 0.01,
                               "extra": {"pad": pad}})
        path = history_path("sealed", home)
        checkpoint = wait_for(lambda: (c := last_checkpoint(path, "sealed")[0]).next_seq and c,
                              timeout=60)
        assert checkpoint.next_seq > 2000  # the sealed records, folded
        assert checkpoint.fold.state.ranks[0].step >= 2000
    finally:
        rank.sock.close(linger=0)
        ctx.term()
