"""Issue #26 items 3-4: nothing trusted from the file system, and a loss told truthfully; each
scenario on real hub (and CLI) processes."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FakeRank, HubProcess, fill_disk, wait_for
from scalemon.link.client import HubClient


def cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scalemon.cli", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "SCALEMON_HOME": str(home)})


def hub_run(home: Path, job: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scalemon.hub", "--job", job, "--home",
                           str(home), "--linger", "0"], capture_output=True, text=True,
                          timeout=30)


def tree(path: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry under `path` (itself included): mode and, for files, the bytes."""
    out = {}
    for p in [path, *sorted(path.rglob("*"))]:
        info = p.lstat()
        out[str(p)] = (info.st_mode, p.read_bytes() if p.is_file() else None)
    return out


def test_a_symlinked_run_directory_is_refused_and_what_it_points_to_untouched(home, tmp_path):
    """Another user made run/<job> a link into a directory of someone else: the hub must
    neither chmod it nor bind or write anything there."""
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    (victim / "data.txt").write_text("theirs")
    os.chmod(victim, 0o755)
    before = tree(victim)
    (home / "run").mkdir(mode=0o700)
    link = home / "run" / "jobL"
    link.symlink_to(victim)
    out = hub_run(home, "jobL")
    assert out.returncode == 2
    assert f"{link} is a symbolic link (to {victim})" in out.stderr
    assert "SCALEMON_HOME" in out.stderr
    assert tree(victim) == before  # mode and contents unchanged: no chmod, no socket, no log
    assert not (home / "jobs" / "jobL.json").exists()


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777])
def test_a_run_directory_others_can_write_is_refused_and_left_as_it_is(home, mode):
    run = home / "run"
    run.mkdir()
    os.chmod(run, mode)
    out = hub_run(home, "jobW")
    assert out.returncode == 2
    assert f"{run} is writable by" in out.stderr and f"mode {mode & 0o7777:o}" in out.stderr
    assert stat.S_IMODE(run.stat().st_mode) == mode  # refused, not chmod-ed
    assert list(run.iterdir()) == []
    agent = subprocess.run(
        [sys.executable, "-c", "import scalemon.agent as sm; print(sm.init() is None)"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "SCALEMON_HOME": str(home), "SCALEMON_JOB_ID": "jobW"})
    assert agent.stdout.strip() == "True"  # the monitor is off, training goes on
    assert "monitor not started" in agent.stderr and "is writable by" in agent.stderr
    assert list(run.iterdir()) == []


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory of another user")
def test_a_run_directory_of_another_user_is_refused_by_hub_and_agent(home):
    """Whoever owns run/ can swap run/<job> (ours or not) for a directory of sockets of
    theirs after the hub checked it: run/ itself must be ours."""
    run = home / "run"
    run.mkdir(mode=0o755)
    os.chown(run, 65534, 65534)
    out = hub_run(home, "jobO")
    assert out.returncode == 2
    assert f"{run} belongs to" in out.stderr and "uid 65534" in out.stderr
    assert list(run.iterdir()) == []
    agent = subprocess.run(
        [sys.executable, "-c", "import scalemon.agent as sm; print(sm.init() is None)"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "SCALEMON_HOME": str(home), "SCALEMON_JOB_ID": "jobO"})
    assert agent.stdout.strip() == "True" and f"{run} belongs to" in agent.stderr
    assert list(run.iterdir()) == []


def test_a_symlinked_job_file_is_not_trusted_by_jobs_snapshot_or_attach(start_hub, home,
                                                                        tmp_path):
    """A job file that is a link (here to a hub's real job file elsewhere) is said and not
    used: `scalemon jobs` does not list it, snapshot and attach do not connect to it."""
    hub = start_hub("jobR", "--lost-after", "600")
    real = home / "jobs" / "jobR.json"
    elsewhere = tmp_path / "jobT.json"
    data = json.loads(real.read_text())
    elsewhere.write_text(json.dumps({**data, "job": "jobT"}))
    (home / "jobs" / "jobT.json").symlink_to(elsewhere)
    listed = cli(home, "jobs")
    assert listed.returncode == 0
    assert re.search(r"^jobR ", listed.stdout, re.M) and "jobT" not in listed.stdout
    assert f"{home / 'jobs' / 'jobT.json'} is a symbolic link" in listed.stderr
    snap = cli(home, "snapshot", "jobT")
    assert snap.returncode == 2 and "no live hub for job 'jobT'" in snap.stderr
    attach = cli(home, "attach", "jobT", "--wait", "0")
    assert attach.returncode == 2 and "no live hub and no history for job 'jobT'" in \
        attach.stderr
    assert (home / "jobs" / "jobT.json").is_symlink()  # said, never removed or written
    assert hub.proc.poll() is None


def test_a_job_file_pointing_at_sockets_of_a_directory_others_can_write_is_not_trusted(
        start_hub, home, tmp_path):
    """A job file of ours whose ipc address is in a directory others can write (where anyone
    could put sockets that impersonate the hub) is not used."""
    start_hub("jobR", "--lost-after", "600")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    data = json.loads((home / "jobs" / "jobR.json").read_text())
    fake = {**data, "job": "jobU", "address": f"ipc://{shared}", "run_dir": str(shared)}
    path = home / "jobs" / "jobU.json"
    path.write_text(json.dumps(fake))
    os.chmod(path, 0o600)
    listed = cli(home, "jobs")
    assert "jobU" not in listed.stdout and f"{shared} is writable by" in listed.stderr
    assert cli(home, "snapshot", "jobU").returncode == 2


def test_a_jobs_directory_others_can_write_stops_the_lookup_with_what_to_do(start_hub, home):
    start_hub("jobR", "--lost-after", "600")
    os.chmod(home / "jobs", 0o777)
    listed = cli(home, "jobs")
    assert listed.returncode == 2
    assert f"{home / 'jobs'} is writable by its group and others" in listed.stderr
    assert "SCALEMON_HOME" in listed.stderr


# --- a loss told truthfully ---------------------------------------------------------------


class LoggedHub(HubProcess):
    """A hub whose log is off the (full) disk."""

    def __init__(self, home: Path, job: str, log: Path) -> None:
        self.home, self.job, self.log = home, job, log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "scalemon.hub", "--job", job, "--home", str(home),
                 "--lost-after", "600"], stdout=out, stderr=subprocess.STDOUT)
        self.address = self.wait_ready()


def run_out_of_room(small_disk: Path, zctx, tmp_path: Path) -> tuple[LoggedHub, int]:
    """A hub whose disk filled up under 1000 steps: returns it and how many records it
    holds unwritten (once every step arrived)."""
    home = small_disk / "home"
    home.mkdir(mode=0o700)
    hub = LoggedHub(home, "jobF", tmp_path / "hub1.log")
    fill_disk(small_disk, leave=16 << 10)
    rank = FakeRank(zctx, hub.address, "jobF", 0)
    rank.hello(world_size=1)
    for step in range(1, 1001):
        rank.send("step", {"step": step, "loss": 1.0, "extra": {"note": "x" * 200}})
    client = HubClient(hub.address)
    state = wait_for(lambda: (s := client.state())["head"] >= 1001 and s["hub"]["history_error"]
                     and s["state"]["hub_notes"] and s, timeout=30)
    client.close()
    assert state["hub"]["history_unwritten"] > 0
    return hub, state["hub"]["history_unwritten"]


def on_disk(home: Path) -> int:
    from scalemon.home.history import HISTORY_FILE, read_records
    from scalemon.home.paths import run_dir

    return len(list(read_records(run_dir("jobF", home) / HISTORY_FILE)))


def marker(home: Path) -> dict:
    from scalemon.home.history import HISTORY_FILE, read_loss_marker
    from scalemon.home.paths import run_dir

    return read_loss_marker(run_dir("jobF", home) / HISTORY_FILE)


def test_a_hub_ending_on_a_full_disk_counts_what_it_lost_and_never_says_nothing_was_lost(
        small_disk, zctx, tmp_path):
    hub, unwritten = run_out_of_room(small_disk, zctx, tmp_path)
    home = hub.home
    live = cli(home, "snapshot", "jobF").stdout
    assert re.search(r"hub: \d+ records not yet written to the history \(disk full", live)
    hub.kill(signal.SIGTERM)  # the job's end: the same way out as after the linger
    log = hub.log.read_text()
    said = re.search(r"(\d+) records could not be written to the history \(disk full "
                     r"\(ENOSPC\)\) and are lost", log)
    assert said, log[-3000:]
    lost = int(said.group(1))
    assert lost >= unwritten
    assert lost == marker(home)["records"] - on_disk(home)  # exactly what is missing
    assert "nothing was lost" not in log and "every record is in the history" not in log
    offline = cli(home, "snapshot", "jobF")
    text = offline.stdout + offline.stderr
    assert f"hub: {lost} records were never written to the history (its hub, pid " \
        f"{hub.proc.pid}, exited while it could not write: disk full (ENOSPC)" in text
    assert "nothing was lost" not in text

    (small_disk / "filler").unlink()  # room again: the next hub tells it in the history
    second = LoggedHub(home, "jobF", tmp_path / "hub2.log")
    note = f"{lost} records were never written to the history"
    wait_for(lambda: note in cli(home, "snapshot", "jobF").stdout, timeout=20)
    wait_for(lambda: marker(home)["earlier_lost"] == 0, timeout=10)  # told: the marker forgets
    second.kill(signal.SIGTERM)
    assert "every record is in the history" in second.log.read_text()
    assert cli(home, "snapshot", "jobF").stdout.count(note) == 1


def test_a_hub_killed_on_a_full_disk_leaves_the_count_for_the_next_opening(
        small_disk, zctx, tmp_path):
    """SIGKILL: the hub cannot say anything itself; its loss marker, rewritten in place as
    records stay unwritten, tells the snapshot and the next hub."""
    hub, unwritten = run_out_of_room(small_disk, zctx, tmp_path)
    home = hub.home
    wait_for(lambda: marker(home)["unwritten"] >= unwritten, timeout=10)
    hub.kill(signal.SIGKILL)
    mark = marker(home)
    assert not mark["closed"] and mark["unwritten"] == mark["records"] - on_disk(home)
    text = cli(home, "snapshot", "jobF").stdout
    lost = mark["unwritten"]
    assert f"hub: {lost} records were never written to the history (its hub, pid " \
        f"{hub.proc.pid}, stopped without closing it (killed?)" in text
    (small_disk / "filler").unlink()
    second = LoggedHub(home, "jobF", tmp_path / "hub2.log")
    client = HubClient(second.address)
    notes = wait_for(lambda: [n["text"] for n in client.state()["state"]["hub_notes"]
                              if "never written" in n["text"]], timeout=20)
    client.close()
    assert notes[0].startswith(f"{lost} records were never written to the history")
    assert "nothing was lost" not in " ".join(notes)
    second.kill(signal.SIGTERM)
