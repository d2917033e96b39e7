"""What the kernel says of a process (`scalemon.proc.facts`), against real processes: a
sleeping one uses no CPU, a busy one does, a stopped one, a zombie (killed, not yet reaped), a
pid that is gone, a name with spaces and parentheses; a system without /proc; and the wire
form read back from garbage without raising."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from proc_children import BUSY, SLEEPER, child, until

from scalemon.proc import facts
from scalemon.proc.facts import ProcessFacts, cpu_moving, parse_stat, process_facts

linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="no /proc here")


@linux_only
def test_a_sleeping_process_uses_no_cpu(tmp_path):
    with child(SLEEPER, tmp_path) as proc:
        before = until(lambda: (f := process_facts(proc.pid)).state == "S" and f)
        assert before and before.exists and before.state_word == "sleeping"
        assert before.threads == 1 and before.comm is not None
        assert before.comm.startswith("python") and before.cpu_s is not None
        time.sleep(0.3)
        after = process_facts(proc.pid)
        assert after.state == "S" and after.t > before.t
        assert cpu_moving(before, after) is False


@linux_only
def test_a_busy_process_uses_cpu(tmp_path):
    with child(BUSY, tmp_path) as proc:
        before = process_facts(proc.pid)
        time.sleep(0.3)
        moving = until(lambda: cpu_moving(before, process_facts(proc.pid)), timeout_s=5)
        assert moving is True
        assert process_facts(proc.pid).state == "R"  # running or waiting for a core


@linux_only
def test_a_stopped_process(tmp_path):
    with child(SLEEPER, tmp_path) as proc:
        proc.send_signal(signal.SIGSTOP)
        stopped = until(lambda: process_facts(proc.pid).state == "T")
        assert stopped and process_facts(proc.pid).state_word == "stopped"
        proc.send_signal(signal.SIGCONT)


@linux_only
def test_a_zombie_is_there_until_reaped(tmp_path):
    with child(SLEEPER, tmp_path) as proc:
        proc.kill()  # not waited for: a zombie until then
        zombie = until(lambda: (f := process_facts(proc.pid)).state == "Z" and f)
        assert zombie and zombie.exists is True
        assert zombie.state_word == "zombie (ended, not reaped)"
        proc.wait(timeout=10)
        assert process_facts(proc.pid).exists is False


def test_a_pid_that_is_gone():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    gone = process_facts(proc.pid)
    assert gone.exists is False and gone.state is None and gone.cpu_s is None
    assert gone.pid == proc.pid
    assert cpu_moving(gone, gone) is None


@linux_only
def test_a_name_with_spaces_and_parentheses(tmp_path):
    name = "a) b (c) R 1"  # what a naive split of /proc/PID/stat would misread
    source = (
        "import ctypes, time\n"
        f"ctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)\n"  # PR_SET_NAME
        "print('ready', flush=True)\ntime.sleep(60)\n")
    with child(source, tmp_path) as proc:
        read = until(lambda: (f := process_facts(proc.pid)).state == "S" and f)
        assert read and read.comm == name and read.threads == 1
        assert read.cpu_s is not None and read.cpu_s < 60


def test_the_stat_line_is_parsed_from_its_last_parenthesis():
    tail = " ".join(["S", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "250", "50",
                     "0", "0", "20", "0", "7", "0", "99"])
    read = parse_stat(42, f"42 (x) y (z) {tail}\n".encode(), 5.0)
    assert (read.state, read.comm, read.threads, read.t) == ("S", "x) y (z", 7, 5.0)
    assert read.cpu_s == pytest.approx(300 / os.sysconf("SC_CLK_TCK"))
    cut = parse_stat(42, b"42 (x) S 1 2", 5.0)  # too short: exists, nothing more known
    assert cut.exists and cut.state is None and cut.comm == "x"
    odd = parse_stat(42, f"42 (x) {tail.replace('250', 'NaN')}".encode(), 5.0)
    assert odd.state == "S" and odd.cpu_s is None


def test_without_proc_only_existence_is_known(tmp_path, monkeypatch):
    monkeypatch.setattr(facts, "PROC", tmp_path)  # no /proc/self/stat there
    me = process_facts(os.getpid())
    assert me.exists is True and me.state is None and me.cpu_s is None and me.threads is None
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    assert process_facts(proc.pid).exists is False
    assert process_facts(0).exists is False


@linux_only
def test_the_wire_form_reads_back_the_same():
    me = process_facts(os.getpid())
    wire = json.loads(json.dumps(me.to_wire()))
    assert ProcessFacts.from_wire(wire) == me


def test_a_peer_s_garbage_reads_as_unknown():
    assert ProcessFacts.from_wire(None) == ProcessFacts(pid=-1, exists=None)
    read = ProcessFacts.from_wire({"pid": True, "exists": "yes", "state": 3, "cpu_s": "1.5",
                                   "threads": 2.5, "t": float("inf")})
    assert read == ProcessFacts(pid=-1, exists=None)
    read = ProcessFacts.from_wire({"pid": 9, "exists": True, "state": "D", "cpu_s": 10 ** 400})
    assert (read.pid, read.exists, read.state, read.cpu_s) == (9, True, "D", None)
    assert read.state_word == "in uninterruptible wait (disk/driver)"


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.one_of(_json, st.dictionaries(
    st.sampled_from(["pid", "exists", "state", "state_word", "cpu_s", "threads", "comm", "t"]),
    _json, max_size=8)))
def test_garbage_never_raises(wire):
    read = ProcessFacts.from_wire(wire)
    assert isinstance(read, ProcessFacts)
    json.dumps(read.to_wire(), allow_nan=False)
    cpu_moving(read, read)

