"""Issue #13: what a hub must refuse or keep, each scenario on real processes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from conftest import FakeRank, wait_for


def test_home_and_run_directories_are_created_for_this_user_only(tmp_path, monkeypatch):
    home = tmp_path / "fresh" / "home"
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
    from scalemon.client import HubClient, HubStream
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

    from scalemon.client import HistoryReset, HubStream
    from scalemon.jobs import run_dir

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
