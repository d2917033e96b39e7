"""NCCL's debug log on a machine without NCCL: the subsystems a live NCCL_DEBUG toggle asks for,
NCCL_DEBUG_FILE pointed at the run directory at start (lines to the hub and still on stdout),
the count of lines a toggle reports, and a libnccl without ncclResetDebugInit.

The process tests run `tests/jobs/fake_nccl_log.py`: a real monitored process, its real hub and
the real `scalemon` CLI, with a stand-in for libnccl's debug output (see that file)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_collectives_jobs import job_env, snapshot

from conftest import REPO, kill_tree, wait_for
from scalemon.agent import flags
from scalemon.agent.env import read_rank_env
from scalemon.agent.flags import FlagControl
from scalemon.agent.logtail import LogFollower
from scalemon.agent.nccllog import (
    LIVE_SUBSYS,
    expand_debug_file,
    prints_when_running,
    probe_text,
    short_hostname,
)
from scalemon.agent.warn import Warnings
from scalemon.state.flagstate import log_count_text, log_counts_due

FAKE_JOB = REPO / "tests" / "jobs" / "fake_nccl_log.py"
NCCL_ENV = ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")


@pytest.fixture
def clean_nccl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No NCCL_DEBUG* variable; whatever a test's code sets is undone afterwards."""
    for name in NCCL_ENV:
        monkeypatch.delenv(name, raising=False)


def test_subsystems_that_print_for_a_running_communicator() -> None:
    assert not prints_when_running(None)  # NCCL's default: INIT,BOOTSTRAP,ENV
    assert not prints_when_running("INIT,NET")
    assert prints_when_running(LIVE_SUBSYS) and prints_when_running("p2p")
    assert prints_when_running("ALL") and prints_when_running("^INIT")
    assert not prints_when_running("^COLL,P2P") and not prints_when_running("^ALL")


def test_debug_file_names_expand_as_nccl_does() -> None:
    assert expand_debug_file("/x/nccl.%h.%p.log", pid=42, host="n1") == Path("/x/nccl.n1.42.log")
    assert expand_debug_file("a%%b%q%", pid=1, host="h") == Path("a%b%q%")
    # NCCL's %h: gethostname() cut at the first dot (no "unknown" for an empty name)
    assert short_hostname() == socket.gethostname().split(".")[0].replace("%", "-").replace(
        "/", "-")


def test_a_count_of_zero_never_reads_as_lines() -> None:
    common: dict[str, Any] = {"steps": 3, "level": "INFO", "subsys": LIVE_SUBSYS,
                              "nccl_loaded": True, "path": Path("/r/nccl.log")}
    assert probe_text(7, 3, **common).startswith("7 NCCL log line(s) in the 3 s")
    cases = [({}, "although 3 step(s) ran"), ({"steps": 0}, "no step finished since"),
             ({"subsys": "INIT"}, "prints nothing for a communicator that is already running"),
             ({"nccl_loaded": False}, "NCCL is not loaded"), ({"path": None}, "cannot follow"),
             ({"level": "WARN"}, "prints no INFO lines")]
    for change, why in cases:
        text = probe_text(0, 3, **{**common, **change})
        assert text.startswith("no NCCL log line in the 3 s") and why in text, (change, text)


def test_the_count_summary_waits_for_every_promised_rank_and_sums_truthfully() -> None:
    toggle = {"id": 1, "results": {
        "0": {"outcome": "applied", "log_window_s": 3.0},
        "1": {"outcome": "applied", "log_window_s": 3.0},
        "2": {"outcome": "applied"}}}  # a rank that promised nothing (no NCCL_DEBUG here)
    assert log_counts_due(toggle) == [0, 1]
    assert "no count yet" in log_count_text(toggle)
    toggle["results"]["0"].update(log_lines=0, log_text="no NCCL log line in the 3 s after it "
                                  "was applied: no step finished since")
    text = log_count_text(toggle)
    assert "no line" in text and "no step finished since" in text and "rank(s) [1]" in text
    assert not any(ch.isdigit() and ch != "0" for ch in text.split("(")[0].replace("3 s", ""))
    toggle["results"]["1"].update(log_lines=12, log_text="12 NCCL log line(s)")
    assert log_counts_due(toggle) == []
    text = log_count_text(toggle)
    assert text.startswith("NCCL log: 12 line(s) in the 3 s") and "none on rank(s) [0]" in text
    assert log_count_text({"id": 2, "results": {"0": {"outcome": "applied"}}}) is None


class Calls:
    """Fake NCCL: what the toggles did to it."""

    def __init__(self) -> None:
        self.resets: list[dict[str, str | None]] = []

    def reset(self) -> None:
        self.resets.append({n: os.environ.get(n) for n in NCCL_ENV})


def control(tmp_path: Path, messages: list, reset: Any, followed: list) -> FlagControl:
    flags_env = read_rank_env({})
    return FlagControl(flags_env, lambda mtype, body: messages.append((mtype, body)) or True,
                       Warnings(), nccl=True, log_dir=tmp_path,
                       on_log_file=lambda path, source, tee: followed.append((path, tee)) or True)


def set_flag(fc: FlagControl, toggle_id: int, name: str, value: str) -> None:
    fc.queue({"name": "set_flag", "id": toggle_id, "flag": name, "value": value,
              "tier": "live", "at_step": 1})
    fc.apply_due(0, lambda code: None)


def results(messages: list) -> list[dict]:
    return [body for mtype, body in messages if mtype == "toggle_result"]


def test_nccl_debug_on_asks_for_coll_when_subsys_is_unset_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_nccl_env: None) -> None:
    nccl, messages, followed = Calls(), [], []
    monkeypatch.setattr(flags, "nccl_library", lambda: "/fake/libnccl.so.2")
    monkeypatch.setattr(flags, "reset_debug_symbol", lambda path: nccl.reset)
    fc = control(tmp_path, messages, nccl.reset, followed)
    set_flag(fc, 1, "NCCL_DEBUG", "INFO")
    done = results(messages)[-1]
    assert done["outcome"] == "applied", done
    assert f"NCCL_DEBUG_SUBSYS was unset, so scalemon set it to {LIVE_SUBSYS}" in done["text"]
    # NCCL re-read its settings with COLL and the file in the run directory already set
    template = str(tmp_path / f"nccl.{fc.env.host}.%p.log")  # NCCL puts its pid for %p
    assert nccl.resets == [{"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": LIVE_SUBSYS,
                            "NCCL_DEBUG_FILE": template}]
    nccl_file = tmp_path / f"nccl.{fc.env.host}.{os.getpid()}.log"
    assert followed == [(nccl_file, None)]  # followed, not copied to stdout
    assert fc.values()["NCCL_DEBUG_SUBSYS"] == LIVE_SUBSYS  # the panel shows what is in effect
    # off again: the subsystems scalemon chose go too
    set_flag(fc, 2, "NCCL_DEBUG", "WARN")
    assert "NCCL_DEBUG_SUBSYS unset again" in results(messages)[-1]["text"]
    assert "NCCL_DEBUG_SUBSYS" not in os.environ
    # the user's own subsystems are kept, with a word where they print nothing when running
    set_flag(fc, 3, "NCCL_DEBUG_SUBSYS", "INIT,NET")
    set_flag(fc, 4, "NCCL_DEBUG", "TRACE")
    assert os.environ["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    text = results(messages)[-1]["text"]
    assert "has no COLL or P2P, so a running communicator may print nothing" in text
    assert "was unset" not in text
    set_flag(fc, 5, "NCCL_DEBUG", "")
    assert os.environ["NCCL_DEBUG_SUBSYS"] == "INIT,NET"  # the user's: left alone


def test_a_toggle_says_nccl_empties_the_users_debug_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_nccl_env: None) -> None:
    """NCCL opens NCCL_DEBUG_FILE with mode "w" each time it reads its settings again: a live
    toggle empties the user's file, and its reply says so (not for the agent's own file)."""
    nccl, messages, followed = Calls(), [], []
    monkeypatch.setattr(flags, "nccl_library", lambda: "/fake/libnccl.so.2")
    monkeypatch.setattr(flags, "reset_debug_symbol", lambda path: nccl.reset)
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_DEBUG_FILE", str(tmp_path / "mine.%p.log"))
    fc = control(tmp_path, messages, nccl.reset, followed)
    set_flag(fc, 1, "NCCL_DEBUG_SUBSYS", "INIT,COLL")
    text = results(messages)[-1]["text"]
    assert f'with mode "w" at its next line, which empties {tmp_path}/mine.{os.getpid()}.log' \
        in text, text
    set_flag(fc, 2, "NCCL_DEBUG", "VERSION")  # NCCL opens no file at VERSION
    assert "empties" not in results(messages)[-1]["text"]
    monkeypatch.delenv("NCCL_DEBUG_FILE")
    set_flag(fc, 3, "NCCL_DEBUG", "INFO")  # the agent's own file: no word about it
    assert "empties" not in results(messages)[-1]["text"]
    assert os.environ["NCCL_DEBUG_FILE"] == str(tmp_path / f"nccl.{fc.env.host}.%p.log")


def test_without_reset_symbol_nccl_debug_needs_a_restart_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_nccl_env: None) -> None:
    messages: list = []
    monkeypatch.setattr(flags, "nccl_library", lambda: "/fake/libnccl.so.3")
    monkeypatch.setattr(flags, "reset_debug_symbol", lambda path: None)
    fc = control(tmp_path, messages, None, [])
    notes = fc.notes()
    for name in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS"):
        tier, why = notes[name]
        assert tier == "restart" and "a new communicator does not read it again" in why
    set_flag(fc, 1, "NCCL_DEBUG", "INFO")  # a live command anyway (an older hub): refused
    done = results(messages)[-1]
    assert done["outcome"] == "failed" and "exports no ncclResetDebugInit()" in done["text"]


FAKE_LIB = """
void ncclResetDebugInitInternal(void) {}
"""


def test_reset_symbol_lookup_in_real_libraries(tmp_path: Path) -> None:
    """A libnccl exporting only ncclResetDebugInitInternal (what a later NCCL may keep), and
    one exporting neither."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libraries")
    libs = {}
    for name, source in (("internal", FAKE_LIB), ("none", "int unrelated(void) { return 0; }")):
        (tmp_path / f"{name}.c").write_text(source)
        libs[name] = tmp_path / f"libnccl_{name}.so"
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(libs[name]),
                        str(tmp_path / f"{name}.c")], check=True, timeout=60)
    found = flags.reset_debug_symbol(str(libs["internal"]))
    assert found is not None and found.__name__ == "ncclResetDebugInitInternal"
    found()  # callable
    assert flags.reset_debug_symbol(str(libs["none"])) is None
    assert flags.reset_debug_symbol(str(tmp_path / "absent.so")) is None


PICK_LIBRARY = """
import ctypes, sys
from scalemon.agent import flags
from scalemon.agent.libs import mapped_libraries
for path in sys.argv[1:]:
    ctypes.CDLL(path)
lib, reset = flags.loaded_reset()
print(mapped_libraries("libnccl"))
print(lib, getattr(reset, "__name__", None))
"""


def test_the_reset_is_looked_up_in_libnccl_not_in_a_nccl_plugin(tmp_path: Path) -> None:
    """NCCL loads its plugins (libnccl-net.so, ...) after itself; /proc/self/maps lists them
    by address, usually before it. The reset is looked up in libnccl.so.2 all the same."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libraries")
    built = []
    for name, source in (("libnccl.so.2", "void ncclResetDebugInit(void) {}"),
                         ("libnccl-net.so", "int ncclNetPlugin_v9 = 0;")):
        (tmp_path / "src.c").write_text(source)
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / name),
                        str(tmp_path / "src.c")], check=True, timeout=60)
        built.append(str(tmp_path / name))
    done = subprocess.run([sys.executable, "-c", PICK_LIBRARY, *built], capture_output=True,
                          text=True, timeout=60, check=True)
    mapped, picked = done.stdout.splitlines()[-2:]
    assert picked == f"{tmp_path / 'libnccl.so.2'} ncclResetDebugInit", done.stdout


def test_libnccl_is_told_from_its_plugins_whatever_the_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flags, "mapped_libraries", lambda fragment: [
        "/opt/plugins/libnccl-net.so", "/opt/plugins/libnccl-tuner.so",
        "/venv/site-packages/nvidia/nccl/lib/libnccl.so.2"])
    assert flags.nccl_library() == "/venv/site-packages/nvidia/nccl/lib/libnccl.so.2"
    monkeypatch.setattr(flags, "mapped_libraries", lambda fragment: ["/p/libnccl-net.so"])
    assert flags.nccl_library() is None


def test_a_probe_counts_only_the_lines_after_it(tmp_path: Path) -> None:
    sent: list = []
    follower = LogFollower(lambda mtype, body: sent.append(body) or True, Warnings(),
                           interval_s=0.02)
    path = tmp_path / "nccl.log"
    path.write_text("old 1\nold 2\n")
    counts: list[int] = []
    try:
        follower.follow(path, "nccl")
        assert follower.probe("nccl", 0.3, counts.append)
        with open(path, "a") as f:
            f.write("new 1\nnew 2\nnew 3\n")
        wait_for(lambda: counts, timeout=5)
        assert counts == [3]
        assert follower.probe("nccl", 0.1, counts.append)
        wait_for(lambda: len(counts) == 2, timeout=5)
        assert counts[1] == 0
    finally:
        follower.stop()
    assert [line for body in sent for line in body["lines"]] == [
        "old 1", "old 2", "new 1", "new 2", "new 3"]


# ---- real processes: the fake job, its hub, the CLI ----------------------------------------

def start_fake(home: Path, out: Path, *args: str, **env: str) -> subprocess.Popen:
    full = {**job_env(home), **env}
    for name in NCCL_ENV:
        if name not in env:
            full.pop(name, None)
    full.pop("PYTHONUNBUFFERED", None)  # it would make C's stdout unbuffered too, as it rarely is
    with open(out, "w") as log:
        return subprocess.Popen([sys.executable, str(FAKE_JOB), *args], env=full, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scalemon.cli", *args], env=job_env(home),
                          capture_output=True, text=True, timeout=120)


def nccl_lines(home: Path) -> list[str]:
    state = snapshot(home)
    return [line["text"] for line in (state or {}).get("log", {}).get("last", [])
            if line["source"] == "nccl"]


def test_launched_with_nccl_debug_lines_reach_the_hub_and_stay_on_stdout(home: Path,
                                                                         tmp_path: Path) -> None:
    """NCCL_DEBUG=INFO at launch; the communicator logs before `sm.init` (to stdout, as NCCL
    does), then the agent points NCCL at a file: later lines reach the hub and are copied to
    stdout; after `finish` NCCL writes to stdout again."""
    out = tmp_path / "job.out"
    proc = start_fake(home, out, "8", "0.1", "early", NCCL_DEBUG="INFO",
                      NCCL_DEBUG_SUBSYS="INIT,COLL")
    try:
        assert proc.wait(timeout=60) == 0, out.read_text()
    finally:
        kill_tree(proc)
    printed = out.read_text()
    for i in range(8):  # every collective's line is on stdout, once
        assert printed.count(f"AllReduce: opCount {i:x} ") == 1, printed
    assert printed.count("Init COMPLETE") == 1 and "Destroy COMPLETE" in printed
    # what NCCL had in C's stdout buffer comes out before the copies of its later lines
    assert printed.index("Init COMPLETE") < printed.index("AllReduce"), printed
    lines = wait_for(lambda: len(got := nccl_lines(home)) >= 8 and got, timeout=30)
    assert [line.split("FAKE-NCCL ")[1] for line in lines] == [
        f"AllReduce: opCount {i:x} count 1 comm 0x1" for i in range(8)]  # from the first on
    files = list((home / "run" / home.name).glob("nccl.*.log"))
    assert len(files) == 1 and files[0].read_text().count("AllReduce") == 8


@pytest.mark.integration
def test_toggle_reports_the_lines_of_its_first_seconds_or_why_none(home: Path,
                                                                  tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    proc = start_fake(home, out, "100000", "0.1")
    try:
        wait_for(lambda: (s := snapshot(home)) and s["ranks"] and (s["ranks"][0]["step"] or 0)
                 >= 3, timeout=60, interval=0.5)
        started = time.monotonic()
        done = cli(home, "toggle", home.name, "NCCL_DEBUG=INFO")
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"so scalemon set it to {LIVE_SUBSYS}" in done.stdout
        counted = [line for line in done.stdout.splitlines() if "NCCL log:" in line]
        assert len(counted) == 1 and "line(s) in the 3 s after it was applied" in counted[0]
        count = int(counted[0].split("NCCL log: ")[1].split()[0])
        assert count > 5, done.stdout  # a step every 0.1 s, a COLL line each
        assert time.monotonic() - started < 60
        assert any("AllReduce" in line for line in nccl_lines(home))
        # subsystems that print nothing for a running communicator: none, and why
        done = cli(home, "toggle", home.name, "NCCL_DEBUG_SUBSYS=INIT")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "NCCL log: no line in the 3 s after it was applied on any rank" in done.stdout
        assert "prints nothing for a communicator that is already running" in done.stdout
        assert "line(s) in the" not in done.stdout.split("toggle #2: NCCL_DEBUG_SUBSYS=INIT")[1]
        shown = cli(home, "flags", home.name).stdout
        assert "NCCL log: no line" in shown and f"NCCL log: {count} line(s)" in shown
        assert proc.poll() is None, out.read_text()[-2000:]
        assert "AllReduce" not in out.read_text()  # toggled on: to the hub, not the job's stdout
    finally:
        kill_tree(proc)


@pytest.mark.integration
def test_a_subsys_toggle_on_a_job_launched_with_nccl_debug_loses_no_line(
        home: Path, tmp_path: Path) -> None:
    """NCCL_DEBUG=INFO at launch (the agent's file, copied to stdout), then a toggle of
    NCCL_DEBUG_SUBSYS: NCCL truncates and rewrites the same file, a COLL line every 20 ms soon
    outgrows its INIT lines. Every COLL line reaches stdout, whole, from the first."""
    out = tmp_path / "job.out"
    proc = start_fake(home, out, "100000", "0.02", NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT")
    try:
        wait_for(lambda: (s := snapshot(home)) and s["ranks"] and (s["ranks"][0]["step"] or 0)
                 >= 3, timeout=60, interval=0.5)
        done = cli(home, "toggle", home.name, "NCCL_DEBUG_SUBSYS=INIT,COLL")
        assert done.returncode == 0, done.stdout + done.stderr
        counted = [line for line in done.stdout.splitlines() if "NCCL log:" in line]
        assert counted and int(counted[0].split("NCCL log: ")[1].split()[0]) > 20, done.stdout
        assert proc.poll() is None, out.read_text()[-2000:]
    finally:
        kill_tree(proc)
    printed = [line for line in out.read_text().splitlines() if "comm 0x1" in line]
    coll = [line for line in printed if "AllReduce" in line]
    assert len(coll) > 20, out.read_text()[-2000:]
    whole = f"{short_hostname()}:{proc.pid}:{proc.pid} [0] NCCL INFO FAKE-NCCL "
    assert all(line.startswith(whole) for line in printed), printed  # none came cut
    # NCCL's file holds its lines since it opened it again; stdout got them all (but for
    # those of the last moment before the kill)
    files = list((home / "run" / home.name).glob("nccl.*.log"))
    in_file = [line for line in files[0].read_text().splitlines() if "AllReduce" in line]
    assert coll == in_file[:len(coll)], (coll[:3], in_file[:3])


@pytest.mark.integration
@pytest.mark.parametrize("nccl", ["2.28", "2.26"])
def test_the_lines_before_a_reset_reach_stdout_too(home: Path, tmp_path: Path,
                                                  nccl: str) -> None:
    """NCCL_DEBUG=INFO with COLL at launch, then NCCL_DEBUG=WARN toggled (no count, NCCL still
    opens its file): the lines NCCL wrote since the follower's last read are read before NCCL
    empties the file, whether it does so at its next line (2.27 on) or in the reset itself
    (2.24 to 2.26). Every collective's line is on stdout, in order."""
    out = tmp_path / "job.out"
    args = ["100000", "0.02"] + (["reopen-at-reset"] if nccl == "2.26" else [])
    proc = start_fake(home, out, *args, NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,COLL")
    try:
        wait_for(lambda: (s := snapshot(home)) and s["ranks"] and (s["ranks"][0]["step"] or 0)
                 >= 20, timeout=60, interval=0.5)
        done = cli(home, "toggle", home.name, "NCCL_DEBUG=WARN")
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        kill_tree(proc)
    # the all_reduce of each step comes before its log(): those of steps 0 .. N-1 printed
    at = int(done.stdout.split("in effect on every rank from step ")[1].split(";")[0])
    coll = [line for line in out.read_text().splitlines() if "AllReduce" in line]
    assert [int(line.split("opCount ")[1].split()[0], 16) for line in coll] == list(
        range(at)), (at, coll[-3:])


def test_a_libnccl_without_the_reset_makes_nccl_debug_restart_tier(home: Path,
                                                                   tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    proc = start_fake(home, out, "100000", "0.1", "no-reset")
    try:
        wait_for(lambda: (s := snapshot(home)) and s["ranks"] and s["ranks"][0]["flags"],
                 timeout=60, interval=0.5)
        shown = cli(home, "flags", home.name).stdout
        lines = shown.splitlines()
        at = next(i for i, line in enumerate(lines) if line.split()[:1] == ["NCCL_DEBUG"])
        assert lines[at].split()[1] == "restart", shown
        assert "a new communicator does not read it again" in lines[at + 1], shown
        done = cli(home, "toggle", home.name, "NCCL_DEBUG=INFO")
        assert done.returncode == 3 and "needs a restart of the job" in done.stderr, done
        assert proc.poll() is None
    finally:
        kill_tree(proc)


def test_a_debug_file_of_the_users_is_followed_but_not_copied_to_stdout(home: Path,
                                                                       tmp_path: Path) -> None:
    """NCCL_DEBUG_FILE set by the user (%h expanded as NCCL does): its lines reach the hub and
    the job's stdout stays as the user made it."""
    out = tmp_path / "job.out"
    proc = start_fake(home, out, "6", "0.2", NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,COLL",
                      NCCL_DEBUG_FILE=str(tmp_path / "user.%h.log"))
    try:
        assert proc.wait(timeout=60) == 0, out.read_text()
    finally:
        kill_tree(proc)
    assert "NCCL INFO" not in out.read_text()
    lines = wait_for(lambda: len(got := nccl_lines(home)) >= 8 and got, timeout=30)
    assert sum("AllReduce" in line for line in lines) == 6 and "Init COMPLETE" in lines[1]


def test_a_file_older_than_the_process_is_followed_from_its_end(tmp_path: Path) -> None:
    """A NCCL_DEBUG_FILE an earlier run left (NCCL truncates it at its first line) is not sent
    from its start; a fresh or absent one is."""
    from scalemon.agent.ranklogs import written_since_start as _written_since_start

    old, fresh = tmp_path / "old.log", tmp_path / "fresh.log"
    old.write_text("an earlier run\n")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    fresh.write_text("this run\n")
    assert not _written_since_start(old)
    assert _written_since_start(fresh) and _written_since_start(tmp_path / "absent.log")


def test_a_file_rewritten_in_place_past_its_old_end_is_read_from_its_start(
        tmp_path: Path) -> None:
    """NCCL opens NCCL_DEBUG_FILE with fopen(path, "w") at its first line after every
    ncclResetDebugInit(): the same inode, truncated, and by the follower's next read the new
    lines may be longer than the old file was. Every new line is read, whole, from the first."""
    sent: list = []
    follower = LogFollower(lambda mtype, body: sent.append(body) or True, Warnings(),
                           interval_s=3600)  # reads only when the test says so
    path = tmp_path / "nccl.log"
    path.write_text("h:1:1 [0] NCCL INFO Init START\nh:1:1 [0] NCCL INFO Init COMPLETE\n")
    try:
        follower.follow(path, "nccl")
        assert follower.read_now(path)
        inode = path.stat().st_ino
        with open(path, "w") as f:  # what NCCL does after a reset
            f.writelines(f"h:1:1 [0] NCCL INFO AllReduce: opCount {i:x}\n" for i in range(20))
        assert path.stat().st_ino == inode and path.stat().st_size > 100
        assert follower.read_now(path)
        with open(path, "a") as f:  # and then it only appends
            f.write("h:1:1 [0] NCCL INFO AllReduce: opCount 14\n")
        assert follower.read_now(path)
    finally:
        follower.stop()
    got = [line for body in sent for line in body["lines"]]
    assert got[:2] == ["h:1:1 [0] NCCL INFO Init START", "h:1:1 [0] NCCL INFO Init COMPLETE"]
    assert got[2:] == [f"h:1:1 [0] NCCL INFO AllReduce: opCount {i:x}" for i in range(21)]


def test_a_file_followed_from_its_end_and_rewritten_is_read_from_its_start(
        tmp_path: Path) -> None:
    """The same for a file followed from its end (one an earlier run left): its last bytes are
    known from the start, so a rewrite past its old end is seen too."""
    sent: list = []
    follower = LogFollower(lambda mtype, body: sent.append(body) or True, Warnings(),
                           interval_s=3600)
    path = tmp_path / "nccl.log"
    path.write_text("an earlier run, line 1\nan earlier run, line 2\n")
    try:
        follower.follow(path, "nccl", from_start=False)
        with open(path, "w") as f:
            f.writelines(f"this run, line {i}\n" for i in range(10))
        assert follower.read_now(path)
    finally:
        follower.stop()
    assert [line for body in sent for line in body["lines"]] == [
        f"this run, line {i}" for i in range(10)]


def test_a_debug_file_that_is_a_stream_of_the_process_or_a_fifo_is_not_followed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_nccl_env: None) -> None:
    """NCCL_DEBUG_FILE=/dev/stderr (a common way to move NCCL's lines) names the job's own
    output: following it would send all of it as NCCL lines, or read the terminal. A FIFO is
    never opened: it would block until a writer came."""
    nccl, messages, followed = Calls(), [], []
    monkeypatch.setattr(flags, "nccl_library", lambda: "/fake/libnccl.so.2")
    monkeypatch.setattr(flags, "reset_debug_symbol", lambda path: nccl.reset)
    fifo = tmp_path / "nccl.fifo"
    os.mkfifo(fifo)
    for target in ("/dev/stderr", "/proc/self/fd/1", str(fifo)):
        monkeypatch.setenv("NCCL_DEBUG_FILE", target)
        fc = control(tmp_path, messages, nccl.reset, followed)
        set_flag(fc, 1, "NCCL_DEBUG", "INFO")
        assert results(messages)[-1]["outcome"] == "applied"
        assert followed == [] and fc.nccl_path is None, target
    sent: list = []
    follower = LogFollower(lambda mtype, body: sent.append(body) or True, Warnings(),
                           interval_s=3600)
    done: list = []

    def follow_and_read() -> None:
        follower.follow(fifo, "nccl", from_start=False)
        done.append(follower.read_now(fifo, timeout_s=1.0))

    import threading

    thread = threading.Thread(target=follow_and_read, daemon=True)
    thread.start()
    thread.join(10)
    try:
        assert done == [True] and sent == []  # neither call blocked on the FIFO
    finally:
        if thread.is_alive():  # unblock the open so the thread ends
            with open(fifo, "w"):
                pass
        follower.stop()
