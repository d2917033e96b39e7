"""Issue #13: what a hub must refuse or keep, each scenario on real processes."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FakeRank, fill_disk, wait_for
from scalemon import protocol
from scalemon.link.client import HubClient
from scalemon.reports.snapshot import snapshot_json


def test_home_and_run_directories_are_created_for_this_user_only(short_tmp, monkeypatch):
    home = short_tmp / "fresh" / "home"
    monkeypatch.setenv("SCALEMON_HOME", str(home))
    proc = subprocess.Popen([sys.executable, "-m", "scalemon.hub", "--job", "jobP", "--home",
                             str(home), "--linger", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (home / "jobs" / "jobP.json").exists(), timeout=15)
        for path in (home, home / "run", home / "run" / "jobP", home / "jobs"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory of another user")
def test_a_run_directory_of_another_user_is_refused_with_whose_it_is(home):
    """Another user made run/<job> first (in a shared, writable SCALEMON_HOME): the hub must
    not bind its sockets there, and the agent must not send there."""
    theirs = home / "run" / "jobQ"
    theirs.mkdir(parents=True)
    os.chown(theirs, 65534, 65534)
    out = subprocess.run([sys.executable, "-m", "scalemon.hub", "--job", "jobQ", "--home",
                          str(home)], capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert f"{theirs} belongs to" in out.stderr and "uid 65534" in out.stderr
    assert "SCALEMON_HOME" in out.stderr
    assert not (theirs / "ingest.sock").exists()
    assert not (home / "jobs" / "jobQ.json").exists()

    agent = subprocess.run(
        [sys.executable, "-c", "import scalemon.agent as sm; print(sm.init() is None)"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "SCALEMON_HOME": str(home), "SCALEMON_JOB_ID": "jobQ"})
    assert agent.stdout.strip() == "True"  # the monitor is off, training goes on
    assert "monitor not started" in agent.stderr and "belongs to" in agent.stderr


def key(msg) -> tuple:
    return (msg.rank, msg.seq, msg.type, msg.t)


def test_a_hub_killed_and_restarted_under_a_paused_reader_loses_and_renumbers_nothing(
        start_hub, zctx, home):
    """Scenarios 1 and 2: what a reader saw (live, right before the kill) is on disk, and the
    next hub numbers on from it, so the reader's records stay the hub's, number for number."""
    from scalemon.link.client import HubClient, HubStream
    from scalemon.protocol import decode

    hub = start_hub("jobK", "--lost-after", "60")
    rank = FakeRank(zctx, hub.address, "jobK", 0)
    stream = HubStream(hub.address)
    got: list = []
    rank.hello(world_size=1)
    for step in range(1, 401):
        rank.step(step)
    wait_for(lambda: got.extend(stream.poll(0.05)) or len(got) >= 401, timeout=20)
    for step in range(401, 421):  # a burst, and the kill as soon as the reader saw it
        rank.step(step)
    wait_for(lambda: got.extend(stream.poll(0.002)) or len(got) >= 421, timeout=20,
             interval=0.0)
    hub.kill()  # -9 within milliseconds: the hub's periodic flush did not run in between
    hub = start_hub("jobK", "--lost-after", "60")
    for step in range(421, 431):
        rank.step(step)
    wait_for(lambda: got.extend(stream.poll(0.05)) or len(got) >= 431, timeout=20)
    client = HubClient(hub.address)
    records, head = client.fetch(0, 10_000)
    client.close()
    stream.close()
    assert head == 431 and [seq for seq, _ in got] == list(range(431))
    assert [key(m) for _, m in got] == [key(decode(r)) for r in records]


def test_a_recreated_history_under_the_same_name_makes_readers_start_over(start_hub, zctx,
                                                                        home):
    """Another history under the same job name (its run directory removed and made anew):
    the reader is told and starts over, instead of mixing two histories."""
    import shutil

    from scalemon.home.paths import run_dir
    from scalemon.link.client import HistoryReset, HubStream

    hub = start_hub("jobR")
    rank = FakeRank(zctx, hub.address, "jobR", 0)
    rank.hello(world_size=1)
    for step in range(1, 51):
        rank.step(step)
    stream = HubStream(hub.address)
    got: list = []
    wait_for(lambda: got.extend(stream.poll(0.05)) or len(got) >= 51)
    hub.kill()
    shutil.rmtree(run_dir("jobR", home))
    hub = start_hub("jobR")
    rank = FakeRank(zctx, hub.address, "jobR", 0)
    rank.hello(world_size=1)
    for step in range(1, 81):  # more than the reader has: `head < next` cannot see it
        rank.step(step)
    with pytest.raises(HistoryReset, match="another history"):
        wait_for(lambda: stream.poll(0.05) and False, timeout=10)
    stream.close()


def snapshot_text(home: Path, job: str) -> str:
    out = subprocess.run([sys.executable, "-m", "scalemon.cli", "snapshot", job],
                         capture_output=True, text=True, timeout=30,
                         env={**os.environ, "SCALEMON_HOME": str(home)})
    return out.stdout + out.stderr


def fill(start_hub, zctx, job: str, steps: int):
    """A hub holding a hello and `steps` steps of rank 0, stopped cleanly (history flushed)."""
    hub = start_hub(job, "--lost-after", "600")
    rank = FakeRank(zctx, hub.address, job, 0)
    rank.hello(world_size=1)
    for step in range(1, steps + 1):
        rank.step(step)
    client = HubClient(hub.address)
    wait_for(lambda: client.state()["head"] == steps + 1, timeout=20)
    client.close()
    hub.kill(signal.SIGTERM)
    return rank


def test_reopening_a_damaged_history_keeps_every_intact_record_and_says_so(start_hub, zctx,
                                                                         home):
    """Scenario 3: one length prefix in the middle changed by 7. The records before and after
    it are kept (the damaged one is set aside), and hub.log, the snapshot and the history's
    readers are told."""
    from scalemon.home.history import HISTORY_FILE, read_records
    from scalemon.home.paths import run_dir

    fill(start_hub, zctx, "jobC", 1211)  # 1212 records
    path = run_dir("jobC", home) / HISTORY_FILE
    data = bytearray(path.read_bytes())
    offset = 0
    for _ in range(606):  # to record 606
        offset += 4 + int.from_bytes(data[offset:offset + 4], "big")
    n = int.from_bytes(data[offset:offset + 4], "big")
    data[offset:offset + 4] = (n + 7).to_bytes(4, "big")
    path.write_bytes(bytes(data))

    hub = start_hub("jobC", "--lost-after", "600")
    client = HubClient(hub.address)
    state = wait_for(lambda: (s := client.state()) and s["state"]["hub_notes"] and s)
    client.close()
    recovery = state["hub"]["history_recovery"]
    assert recovery["records"] == 1211 and recovery["salvaged_after_damage"] == 605
    assert recovery["set_aside_bytes"] == 4 + n
    assert (path.parent / (HISTORY_FILE + ".damaged")).stat().st_size == 4 + n
    assert len(list(read_records(path))) == 1211 + 1  # + the hub's note
    steps = state["state"]["ranks"][0]
    assert steps["step"] == 1211 and steps["steps_received"] == 1210  # only step 606 is gone
    text = snapshot_text(home, "jobC")
    assert "hub: history reopened damaged: 1211 intact records kept (605 of them after the " \
           "damage)" in text
    assert "damaged bytes in 1 stretch(es) moved to" in hub.log.read_text()  # its hub.log
    from scalemon.home.history import read_messages
    from scalemon.tui.model import DashboardData
    from scalemon.tui.views import overview as views

    data = DashboardData()  # the dashboard's header, folding what the hub serves
    data.apply_batch(read_messages(path, "jobC")[0])
    summary = views.overview(data, plots=False).summary
    assert summary.hub_note.startswith("history reopened damaged: 1211 intact records kept")
    from scalemon.tui.widgets.header import header_text

    hub_line = header_text(summary).plain.splitlines()[2]  # the hub's own line
    assert "hub note: history reopened damaged: 1211 intact records kept" in hub_line


def test_replay_validates_every_record_and_counts_what_it_skips(start_hub, zctx, home):
    """Scenario 4: a record of another job and one of a wrong schema in the history are not
    folded in when a hub (or `snapshot` without a hub) replays it; both say how many."""
    from scalemon.home.history import HISTORY_FILE
    from scalemon.home.paths import run_dir

    fill(start_hub, zctx, "jobV", 10)
    path = run_dir("jobV", home) / HISTORY_FILE
    intruders = [
        protocol.encode("step", "otherjob", 0, 99, {"step": 5000, "loss": 9.0}),
        protocol.encode("hello", "jobV", 0, 0, {"host": "h", "pid": 1, "world_size": 1,
                                                "local_rank": 0})[:-1] + b"\xc0",  # bad schema
    ]
    with open(path, "ab") as f:
        for frame in intruders:
            f.write(len(frame).to_bytes(4, "big") + frame)
    text = snapshot_text(home, "jobV")  # no hub: replays the file
    assert "step" in text and "5000" not in text
    assert "2 damaged stretch(es) or invalid records skipped" in text

    hub = start_hub("jobV", "--lost-after", "600")
    client = HubClient(hub.address)
    state = wait_for(lambda: (s := client.state()) and s["state"]["hub_notes"] and s)
    client.close()
    assert state["state"]["ranks"][0]["step"] == 10  # not 5000: the other job's is out
    notes = " ".join(n["text"] for n in state["state"]["hub_notes"])
    assert "were not folded in" in notes or "damaged" in notes
    assert sum(state["hub"]["replay_skipped"].values()) + (
        state["hub"]["history_recovery"] or {}).get("damaged_stretches", 0) == 2


def test_the_dashboard_benchmarks_senders_reach_a_hub_from_more_than_1023_ranks(start_hub):
    """Scenario 9: bench/dashboard_load.py's simulated ranks, one socket each, hit ZeroMQ's
    1023-socket limit at 1024 ranks; sharing sockets, 1,100 ranks deliver everything."""
    import importlib.util
    import multiprocessing as mp

    from conftest import REPO

    spec = importlib.util.spec_from_file_location(
        "dashboard_load", REPO / "bench" / "dashboard_load.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    hub = start_hub("load1100", "--lost-after", "60")
    ready, go, sent, late = mp.Event(), mp.Event(), mp.Value("q", 0), mp.Value("d", 0.0)
    go.set()
    bench.send_ranks(hub.address.base, "load1100", 1100, 1.0, 2.0, ready, go, sent, late)
    assert ready.is_set()
    assert sent.value >= 1100 * 3  # hellos, 2 steps and a heartbeat each
    client = HubClient(hub.address)
    state = wait_for(lambda: (s := client.state())["head"] == sent.value and s, timeout=30)
    client.close()
    assert len(state["state"]["ranks"]) == 1100 and state["hub"]["rejected"] == 0


def test_the_agent_says_once_when_its_hub_never_answers_or_goes_away(start_hub, caplog):
    """Scenarios 5 and 6, the rank's side: without this, training printed nothing at all."""
    import logging

    from scalemon.agent.transport import Sender
    from scalemon.home.address import HubAddress

    nowhere = HubAddress.parse(f"ipc:///tmp/smt-nohub-{os.getpid()}")
    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        sender = Sender(nowhere.ingest, "jobN", 0, rpc_endpoint=nowhere.rpc, silent_warn_s=0.5)
        wait_for(lambda: "has not answered for" in caplog.text, timeout=10)
        sender.close()
        hub = start_hub("jobG")
        sender = Sender(hub.address.ingest, "jobG", 0, rpc_endpoint=hub.address.rpc,
                        silent_warn_s=1.0)
        wait_for(lambda: sender.hub_version is not None)
        assert "stopped answering" not in caplog.text
        hub.kill()
        wait_for(lambda: "stopped answering" in caplog.text, timeout=10)
        sender.close()
    assert caplog.text.count("stopped answering") == 1


def test_a_full_disk_keeps_the_hub_up_says_so_and_loses_nothing_once_there_is_room(
        small_disk, zctx, monkeypatch):
    """Scenario 5: the history cannot be written; the hub stays up, serves from memory, says
    "history not being written: disk full" (snapshot and dashboards), retries, and writes
    every record once there is room."""
    from conftest import HubProcess
    from scalemon.home.history import HISTORY_FILE, read_records
    from scalemon.home.paths import run_dir

    home = small_disk / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("SCALEMON_HOME", str(home))
    hub = HubProcess(home, "jobF", "--lost-after", "600")
    try:
        filler = fill_disk(small_disk, leave=16 << 10)
        rank = FakeRank(zctx, hub.address, "jobF", 0)
        rank.hello(world_size=1)
        client = HubClient(hub.address)
        for step in range(1, 1001):
            rank.send("step", {"step": step, "loss": 1.0, "extra": {"note": "x" * 200}})
        state = wait_for(lambda: (s := client.state())["head"] >= 1001 and
                         s["hub"]["history_error"] and s["state"]["hub_notes"] and s,
                         timeout=30)
        assert hub.proc.poll() is None and state["hub"]["history_error"] == "disk full (ENOSPC)"
        assert state["state"]["ranks"][0]["step"] == 1000  # served from memory
        text = snapshot_text(home, "jobF")
        assert "hub: history not being written: disk full (ENOSPC) since" in text
        filler.unlink()  # room again
        state = wait_for(lambda: (s := client.state())["hub"]["history_error"] is None and
                         len(s["state"]["hub_notes"]) == 2 and s, timeout=15)
        client.close()
        records = list(read_records(run_dir("jobF", home) / HISTORY_FILE))
        assert len(records) == state["head"]  # every record, notes included, on disk
        assert "history written again after disk full (ENOSPC): nothing was lost" in \
            snapshot_text(home, "jobF")
    finally:
        hub.kill()


def test_a_hub_started_on_a_full_disk_comes_up_and_says_so(small_disk, zctx):
    from scalemon.home.address import HubAddress
    from scalemon.home.paths import run_dir

    home = small_disk / "home"
    (home / "run").mkdir(parents=True)
    fill_disk(small_disk, leave=0)
    proc = subprocess.Popen([sys.executable, "-m", "scalemon.hub", "--job", "jobE", "--home",
                             str(home), "--lost-after", "600"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        address = HubAddress.for_directory(run_dir("jobE", home))
        wait_for(lambda: (address.rpc[len("ipc://"):] and
                          Path(address.rpc[len("ipc://"):]).exists()), timeout=15)
        rank = FakeRank(zctx, address, "jobE", 0)
        rank.hello(world_size=1)
        rank.step(1)
        client = HubClient(address)
        state = wait_for(lambda: (s := client.state())["hub"]["history_error"] and
                         s["state"]["hub_notes"] and s, timeout=15)
        client.close()
        assert proc.poll() is None and state["state"]["ranks"][0]["step"] == 1
        notes = [n["text"] for n in state["state"]["hub_notes"]]
        assert any(n.startswith("history not being written: disk full") for n in notes)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.integration
def test_a_dead_hub_is_replaced_on_the_same_history_and_an_ended_job_says_so(home, tmp_path):
    """Scenario 6: the hub is killed mid-job; a local rank starts a new one within seconds on
    the same history, which then holds the whole run; once the job ended and the hub left,
    its job file says "finished", and snapshot tells that from a hub that died."""
    from conftest import kill_tree, torchrun_cmd
    from scalemon.home.jobfile import JobFile
    from scalemon.home.paths import jobs_dir

    env = {**os.environ, "OMP_NUM_THREADS": "1", "SCALEMON_HOME": str(home),
           "SCALEMON_JOB_ID": "jobH", "SCALEMON_HUB_ARGS": "--linger 2"}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    job_file = jobs_dir(home) / "jobH.json"
    out = tmp_path / "job.out"
    with open(out, "w") as log:
        proc = subprocess.Popen(torchrun_cmd("--preset", "tiny", "--batch-size", "2",
                                             "--max-steps", "120", "--step-delay", "0.05",
                                             "--monitor"),
                                env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        first = wait_for(lambda: job_file.exists() and "step 10 " in out.read_text()
                         and JobFile.read(job_file), timeout=90)
        # mid-job: the ranks were answered by this hub (they replace only a hub that went
        # silent, not one that never answered); they sync every second
        from scalemon.home.history import history_path
        wait_for(lambda: history_path("jobH", home).stat().st_size > 0, timeout=20)
        time.sleep(1.5)
        os.kill(first.pid, signal.SIGKILL)
        killed = time.monotonic()
        second = wait_for(lambda: (j := JobFile.read(job_file)).pid != first.pid and j,
                          timeout=20, interval=0.2)
        assert time.monotonic() - killed < 10.0
        assert proc.wait(timeout=120) == 0, out.read_text()[-2000:]
    finally:
        kill_tree(proc)
    assert "started a new one" in out.read_text()
    final = wait_for(lambda: (j := JobFile.read(job_file)).state != "running" and j,
                     timeout=30, interval=0.5)
    assert final.pid == second.pid and final.state == "finished"
    from scalemon.home.jobfile import pid_alive

    # "finished" is written when the job ends; the hub then lingers (2 s here) and exits:
    # snapshot tells a gone hub only after that (before, it asks the lingering hub)
    wait_for(lambda: not pid_alive(final.pid), timeout=30, interval=0.2)
    text = snapshot_text(home, "jobH")
    assert "the job finished (its hub exited at" in text
    assert "state finished" in text and " 120 " in text  # every step, after the kill too


def test_words_are_whole_and_settings_named(monkeypatch):
    """Issue #14 items 5-7 (a first part): reasons are not cut at their first ':', a finished
    rank is not 'finished (finished)', a bad SCALEMON_HUB names the variable, and a job that
    would train nothing is refused."""
    from scalemon.agent.autostart import hub_address
    from scalemon.agent.env import read_rank_env
    from scalemon.demo_train.train import parse_args
    from scalemon.link.client import HubUnreachable
    from scalemon.reports.snapshot_text import format_snapshot
    from scalemon.state.jobstate import JobState
    from scalemon.tui.feed import _short

    exc = HubUnreachable("no answer from the hub at tcp://node7:5555 within 2 s: is the job's "
                         "hub running?")
    assert _short(exc) == "no answer from the hub at tcp://node7:5555"

    st = JobState()
    for mtype, body in (("hello", {"host": "h", "pid": 1, "world_size": 1, "local_rank": 0}),
                        ("exit", {"reason": "finished", "exit_code": 0})):
        st.apply(protocol.decode(protocol.encode(mtype, "j", 0, 0, body, 1.0)))
    row = format_snapshot(snapshot_json(st, now=2.0)).splitlines()[2]
    assert row.endswith("finished") and "(finished)" not in row

    monkeypatch.setenv("SCALEMON_HUB", "garbage")
    with pytest.raises(ValueError, match="SCALEMON_HUB='garbage' is not a hub address"):
        hub_address(read_rank_env({}))

    for bad in ("-5", "0", "x"):
        with pytest.raises(SystemExit):
            parse_args(["--max-steps", bad])


def test_a_hub_that_refused_this_agent_is_not_then_called_silent(start_hub, caplog):
    """After a hub of another major version answered (and sending stopped), no more round
    trips go out: their absence must not read as a dead hub (no warning, no new hub)."""
    import logging

    from scalemon.agent.transport import Sender

    hub = start_hub("jobW", version="2.0")
    replaced = []
    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        sender = Sender(hub.address.ingest, "jobW", 0, rpc_endpoint=hub.address.rpc,
                        silent_warn_s=0.5)
        sender.on_hub_silent, sender.replace_after_s = (lambda: replaced.append(1)), 0.3
        wait_for(lambda: sender.hub_version is not None)
        time.sleep(1.5)
        sender.close()
    assert "speaks protocol 2.0" in caplog.text
    assert "stopped answering" not in caplog.text and not replaced
