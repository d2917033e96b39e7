"""A node's relay: ranks send over ipc to it, it forwards in batches over CurveZMQ tcp to the
hub, passes the ranks' round trips through, reports its node's clock, and a replaced relay is
recorded with its gap (real hub and relay processes, loopback and ipc only)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import wait_for
from scalemon import protocol
from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir, relay_dir
from scalemon.link.client import HubClient
from scalemon.relay.syncs import SyncAnswers


@pytest.fixture
def node1(monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process stands for node1: its own node name and node-local runtime directory."""
    runtime = Path(tempfile.mkdtemp(prefix="smr", dir="/tmp"))
    monkeypatch.setenv("SCALEMON_NODE", "node1")
    monkeypatch.setenv("SCALEMON_RUNTIME_DIR", str(runtime))
    return runtime


def _start_relay(job: str, home: Path, linger: str = "30") -> subprocess.Popen:
    log = open(home / f"relay-{job}-{os.urandom(3).hex()}.log", "wb")  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "scalemon.relay", "--job", job, "--home", str(home),
         "--linger", linger], stdout=log, stderr=subprocess.STDOUT)


def _tcp_client(home: Path, job: str) -> HubClient:
    jf = JobFile.read(jobs_dir(home) / f"{job}.json")
    assert jf.tcp and jf.server_key
    return HubClient(HubAddress(jf.tcp["ingest"], jf.tcp["feed"], jf.tcp["rpc"],
                                server_key=jf.server_key), timeout_s=5.0)


def _relay_sender(job: str, rank: int):
    from scalemon.agent.transport import Sender

    local = HubAddress.for_directory(relay_dir(job))
    return Sender(local.ingest, job, rank, rpc_endpoint=local.rpc, close_timeout_s=1.0,
                  sync_every_s=0.2)


def test_a_relay_forwards_its_nodes_ranks_and_is_replaced_with_its_gap_counted(
        start_hub, home: Path, node1: Path) -> None:
    job = "relayjob"
    start_hub(job, "--listen", "tcp://127.0.0.1:0", "--world-size", "2")
    client = _tcp_client(home, job)
    relay = _start_relay(job, home)
    senders = [_relay_sender(job, rank) for rank in (0, 1)]
    try:
        for rank, sender in enumerate(senders):
            sender.submit("hello", {"host": "node1", "pid": os.getpid(), "world_size": 2,
                                    "local_rank": rank})
            for step in range(50):
                sender.submit("step", {"step": step, "loss": 1.0 + rank, "tokens": 1,
                                       "step_time_s": 0.01})

        def steps() -> int:
            records, _ = client.fetch(0)
            return sum(protocol.decode(r).type == "step" for r in records)

        wait_for(lambda: steps() == 100)
        # the ranks' round trips pass through the relay: the hub answered, clocks are known
        wait_for(lambda: all(s.hub_version and s.clock_offset_s is not None for s in senders))
        state = wait_for(lambda: (s := client.state()["state"])["relays"].get("node1", {})
                         .get("clock_offset_s") is not None and s)
        first = state["relays"]["node1"]
        assert first["pid"] == relay.pid and first["gaps"] == 0
        assert abs(first["clock_offset_s"]) < 0.05  # one machine, one clock
        assert {r["host"] for r in state["ranks"]} == {"node1"}
        assert client.state()["hub"]["relays"] == 1

        relay.kill()  # the node's relay dies; what the ranks send meanwhile is lost
        relay.wait(timeout=10)
        for step in range(50, 60):
            senders[0].submit("step", {"step": step, "loss": 1.0, "tokens": 1,
                                       "step_time_s": 0.01})
        relay = _start_relay(job, home)  # as the node's local rank 0 would
        for step in range(60, 70):
            senders[0].submit("step", {"step": step, "loss": 1.0, "tokens": 1,
                                       "step_time_s": 0.01})
        state = wait_for(lambda: (s := client.state()["state"])["relays"]["node1"]["pid"]
                         == relay.pid and s, timeout=15)
        replaced = state["relays"]["node1"]
        assert replaced["gaps"] == 1 and replaced["gap_s"] > 0
        assert "replaced" in replaced["text"]
        wait_for(lambda: any(r["rank"] == 0 and r["step"] == 69
                             for r in client.state()["state"]["ranks"]), timeout=15)
    finally:
        for sender in senders:
            sender.close()
        relay.kill()
        relay.wait(timeout=10)
        client.close()


def test_a_relay_without_a_hub_says_why_and_keeps_the_ranks_unblocked(
        home: Path, node1: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from scalemon.relay import upstream
    from scalemon.relay.forward import Relay

    monkeypatch.setattr(upstream, "LOOKUP_WARN_S", 0.0)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("SCALEMON_LISTEN", raising=False)
    relay = Relay("nohub", relay_dir("nohub"), home=home, linger_s=30)
    assert relay.find_hub() is None
    text = relay.finder.lookup_text(jobs_dir(home) / "nohub.json", None, 20.0, None)
    assert "is $SCALEMON_HOME" in text and "SCALEMON_LISTEN" in text
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("SCALEMON_LISTEN", "tcp://*:29731")
    assert relay.find_hub() == HubAddress.parse("tcp://127.0.0.1:29731")
    relay._lock_file.close()


def test_a_relay_finds_a_restarted_hub_on_its_new_ports(start_hub, home: Path,
                                                        node1: Path) -> None:
    job = "rehub"
    hub = start_hub(job, "--listen", "tcp://127.0.0.1:0", "--world-size", "1")
    old_ports = JobFile.read(jobs_dir(home) / f"{job}.json").tcp
    relay = _start_relay(job, home)
    sender = _relay_sender(job, 0)
    try:
        sender.submit("hello", {"host": "node1", "pid": os.getpid(), "world_size": 1,
                                "local_rank": 0})
        client = _tcp_client(home, job)
        wait_for(lambda: client.state()["state"]["ranks"])
        client.close()
        hub.kill()  # rank 0's node starts a new hub on the same history: new ports
        start_hub(job, "--listen", "tcp://127.0.0.1:0", "--world-size", "1")
        assert JobFile.read(jobs_dir(home) / f"{job}.json").tcp != old_ports
        client = _tcp_client(home, job)
        step = 0

        def arrived() -> bool:
            nonlocal step
            step += 1
            sender.submit("step", {"step": step, "loss": 2.0, "tokens": 1,
                                   "step_time_s": 0.01})
            ranks = client.state()["state"]["ranks"]
            return bool(ranks) and (ranks[0]["step"] or 0) > 0

        wait_for(arrived, timeout=30, interval=0.5)
        assert client.state()["state"]["relays"]["node1"]["pid"] == relay.pid
        client.close()
    finally:
        sender.close()
        relay.kill()
        relay.wait(timeout=10)


def test_a_relay_killed_before_it_ever_answered_is_still_replaced(home: Path,
                                                                  node1: Path) -> None:
    """A relay that dies before its ranks heard from it (killed while it looked for the hub:
    it drops their round trips until then) leaves ranks that never got an answer. They start
    a new one, once, as after a silence, instead of staying unmonitored for the whole job."""
    import time

    from scalemon.agent.transport import Sender

    job = "earlydeath"
    relay = _start_relay(job, home)  # no hub: it never answers a round trip
    lock = relay_dir(job) / "relay.lock"
    wait_for(lambda: lock.exists() and lock.read_text() == str(relay.pid), timeout=30)
    local = HubAddress.for_directory(relay_dir(job))
    sender = Sender(local.ingest, job, 2, rpc_endpoint=local.rpc, close_timeout_s=0.5,
                    sync_every_s=0.1, first_answer_warn_s=0.5)
    started = []
    sender.on_hub_silent, sender.replace_after_s = (lambda: started.append(1)), 0.3
    try:
        relay.kill()
        relay.wait(timeout=10)
        wait_for(lambda: started, timeout=10)
        time.sleep(1.0)  # still silent: no second start
        assert started == [1]
    finally:
        sender.close()
        relay.kill()


def test_a_relay_answers_its_ranks_syncs_and_hands_them_the_hubs_commands(
        start_hub, home: Path, node1: Path) -> None:
    """Once the relay knows the hub's clock, the hub answers the node's report, not each
    rank's sync; a command queued at the hub still reaches every rank behind the relay."""
    job = "relaysyncs"
    start_hub(job, "--listen", "tcp://127.0.0.1:0", "--world-size", "2")
    client = _tcp_client(home, job)
    relay = _start_relay(job, home)
    senders = [_relay_sender(job, rank) for rank in (0, 1)]
    got: dict[int, list[dict]] = {0: [], 1: []}
    try:
        for rank, sender in enumerate(senders):
            sender.on_command = got[rank].append
            sender.submit("hello", {"host": "node1", "pid": os.getpid(), "world_size": 2,
                                    "local_rank": rank})
        wait_for(lambda: all(s.clock_offset_s is not None for s in senders), timeout=20)
        # the relay takes the syncs over once it knows the clock: the hub's count stops
        wait_for(lambda: _stalled(lambda: client.state()["hub"]["syncs_answered"], 1.5),
                 timeout=30)
        offsets_before = [s.clock_offset_s for s in senders]
        answered = [s._answered for s in senders]
        wait_for(lambda: all(s._answered != a for s, a in zip(senders, answered, strict=True)))
        assert all(abs(o) < 0.05 for o in offsets_before)  # one machine, one clock
        assert all(s.heartbeat_stepping_s == 1.0 for s in senders)  # a small job: every second

        directory = client.request("command", name="dump_fr")["directory"]
        wait_for(lambda: all(got[r] for r in (0, 1)), timeout=15)
        for rank in (0, 1):
            assert got[rank] == [{"name": "dump_fr", "directory": directory}]
    finally:
        for sender in senders:
            sender.close()
        relay.kill()
        relay.wait(timeout=10)
        client.close()


def _stalled(read, seconds: float) -> bool:
    """True when `read()` gives the same value `seconds` apart."""

    before = read()
    time.sleep(seconds)
    return read() == before


def test_a_relay_answers_syncs_in_the_version_of_an_older_hub():
    """A relay of 1.14 in front of a 1.13 hub answers its ranks' syncs as 1.13: the agents then
    send every heartbeat value in full (a 1.13 hub would take a left-out one for null)."""
    answers = SyncAnswers()
    answers.take_reply({"v": [1, 13], "ok": True, "answers_syncs": True, "hang_after_s": 30.0})
    sync = protocol.encode_request("sync", rank=3, t=time.time())
    reply = protocol.decode_reply(answers.answer(sync, clock_offset_s=0.0))
    assert reply["v"] == [1, 13] and reply["via"] == "relay"
    answers.take_reply({"v": list(protocol.PROTOCOL_VERSION), "ok": True,
                        "answers_syncs": True, "hang_after_s": 30.0})
    reply = protocol.decode_reply(answers.answer(sync, clock_offset_s=0.0))
    assert reply["v"] == list(protocol.PROTOCOL_VERSION)
    newer = [protocol.PROTOCOL_VERSION[0], protocol.PROTOCOL_VERSION[1] + 1]
    answers.take_reply({"v": newer, "ok": True, "answers_syncs": True, "hang_after_s": 30.0})
    reply = protocol.decode_reply(answers.answer(sync, clock_offset_s=0.0))
    assert reply["v"] == list(protocol.PROTOCOL_VERSION)  # never more than the relay knows
