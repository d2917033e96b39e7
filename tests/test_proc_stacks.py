"""A process's stacks read from outside by py-spy (`scalemon.proc.stacks`), against real
processes: one frozen in native code holding the GIL (libc's sleep through ctypes.PyDLL), one
waiting in time.sleep (GIL released); the native reading, the Python-only one and the fallback
from one to the other, the words for a hang report, a pid that is not there, py-spy missing,
refused or hanging; and the wire form, bounded, read back from garbage without raising."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proc_children import FROZEN, SLEEPER, child, until

from scalemon.proc import stacks
from scalemon.proc.frames import (
    MAX_FRAMES,
    MAX_TEXT,
    MAX_THREADS,
    MAX_WIRE_BYTES,
    Frame,
    ThreadStack,
)
from scalemon.proc.pyspy import error_text, find_py_spy
from scalemon.proc.stacks import (
    StackReading,
    format_stacks,
    gil_holder,
    main_thread,
    read_stacks,
    where_text,
)

pytestmark = pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")

SLEEP_NAMES = {"sleep", "__sleep", "nanosleep", "__nanosleep", "clock_nanosleep",
               "__clock_nanosleep"}
"""What libc's sleep shows as in a native stack (glibc: sleep <- nanosleep <- clock_nanosleep;
the leading underscores vary with the build)."""


def _settled(pid: int, native: bool = True) -> StackReading:
    """A reading of the frozen child once its main thread is in libc's sleep (it prints
    "ready" just before it calls it)."""
    def frozen() -> StackReading | None:
        reading = read_stacks(pid, native=native, timeout_s=20)
        holder = gil_holder(reading)
        names = {f.name for f in holder.frames} if holder else set()
        inside = bool(names & SLEEP_NAMES) if native else holder is not None
        return reading if inside else None

    reading = until(frozen, timeout_s=15, every_s=0.2)
    assert reading is not None, "the frozen child never showed its GIL holder in sleep"
    return reading


@pytest.fixture(scope="module")
def frozen(tmp_path_factory: pytest.TempPathFactory):
    with child(FROZEN, tmp_path_factory.mktemp("frozen"), name="faults.py") as proc:
        yield proc


def test_a_rank_frozen_in_native_code_is_read_with_its_gil_holder(frozen):
    reading = _settled(frozen.pid)
    assert reading.error is None and reading.note is None and reading.native
    assert reading.tool.startswith("py-spy 0.")
    assert {t.name for t in reading.threads} >= {"MainThread", "helper"}
    holder = gil_holder(reading)
    assert holder is not None and holder is main_thread(reading)
    assert holder.os_thread_id == frozen.pid
    assert [t for t in reading.threads if t.owns_gil] == [holder]
    names = [f.name for f in holder.frames]
    python = names.index("freeze_holding_the_gil")
    # the C call above the Python frame that made it, innermost first
    assert SLEEP_NAMES & set(names[:python]), names
    assert all(f.native for f in holder.frames[:python])
    assert not holder.frames[python].native
    assert holder.frames[python].file.endswith("faults.py") and holder.frames[python].line > 0

    where = where_text(reading)
    assert where.startswith("in native code holding the GIL: "), where
    assert "sleep <- freeze_holding_the_gil() at faults.py:" in where
    assert "ffi_call" not in where and "0x" not in where  # the ctypes glue is left out

    text = format_stacks(reading, native=True)
    assert "MainThread" in text and "holds the GIL" in text and "helper" in text
    assert "[native] sleep (libc" in text or "[native] __sleep" in text
    assert text.index("MainThread") < text.index("helper")


def test_python_frames_only(frozen):
    _settled(frozen.pid)
    reading = read_stacks(frozen.pid, native=False, timeout_s=20)
    assert reading.error is None and not reading.native
    holder = gil_holder(reading)
    assert holder is not None and not any(f.native for t in reading.threads for f in t.frames)
    assert holder.frames[0].name == "freeze_holding_the_gil"
    where = where_text(reading)
    assert where.startswith("holding the GIL in freeze_holding_the_gil() at faults.py:"), where
    assert where.endswith("(native frames not read)")
    text = format_stacks(reading, native=False)
    assert "[native]" not in text and "Python frames only" in text and "holds the GIL" in text


def test_a_native_reading_shown_without_its_native_frames(frozen):
    reading = _settled(frozen.pid)
    assert "[native]" in format_stacks(reading, native=True)
    assert "[native]" not in format_stacks(reading, native=False)


def test_the_wire_form_of_a_real_reading_reads_back_the_same(frozen):
    reading = _settled(frozen.pid)
    wire = json.loads(json.dumps(reading.to_wire()))
    assert StackReading.from_wire(wire) == reading


def test_a_rank_in_time_sleep_is_not_said_to_hold_the_gil(tmp_path):
    with child(SLEEPER, tmp_path, name="sleeper.py") as proc:
        reading = until(lambda: _in_sleep(read_stacks(proc.pid, timeout_s=20)), timeout_s=15)
        assert reading, "the sleeper never showed in time.sleep"
        assert gil_holder(reading) is None
        where = where_text(reading)
        assert "holding the GIL" not in where and "GIL released" in where, where
        assert "wait_in_sleep() at sleeper.py:" in where
        python_only = read_stacks(proc.pid, native=False, timeout_s=20)
        assert where_text(python_only).startswith("GIL released in wait_in_sleep() at sleeper.py:")


def _in_sleep(reading: StackReading) -> StackReading | None:
    main = main_thread(reading)
    names = {f.name for f in main.frames} if main else set()
    return reading if "wait_in_sleep" in names and names & (SLEEP_NAMES | {"time_sleep"}) \
        else None


def test_a_pid_that_is_not_there():
    pid = _dead_pid()
    reading = read_stacks(pid)
    assert reading.error == f"process {pid} is not running" and reading.threads == ()
    assert where_text(reading).startswith("stacks not read: process")


def test_a_process_that_is_not_python():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        reading = read_stacks(sleeper.pid, timeout_s=20)
        assert reading.error is not None and "not look like a Python process" in reading.error
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)


def test_py_spy_missing_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(stacks, "find_py_spy", lambda: None)
    reading = read_stacks(os.getpid())
    assert reading.error is not None and "pip install py-spy" in reading.error
    assert where_text(reading).startswith("stacks not read:")


def _fake_py_spy(tmp: Path, body: str) -> str:
    """An executable that stands in for py-spy: `body` in sh, "--version" answered."""
    path = tmp / "py-spy"
    path.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "py-spy 0.0.0-fake"; '
                    f'exit 0; }}\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_failed_native_reading_falls_back_to_python_frames(frozen, tmp_path, monkeypatch):
    real = find_py_spy()
    fake = _fake_py_spy(tmp_path, (
        'for a in "$@"; do [ "$a" = --native ] && { echo "Error: Failed to merge native and '
        'python frames (Have 3 native and 8 python)" >&2; exit 1; }; done\n'
        f'exec "{real}" "$@"'))
    monkeypatch.setattr(stacks, "find_py_spy", lambda: fake)
    _settled(frozen.pid, native=False)
    reading = read_stacks(frozen.pid, native=True, timeout_s=20)
    assert reading.error is None and not reading.native
    assert reading.note == ("native frames could not be read (Failed to merge native and "
                            "python frames (Have 3 native and 8 python)); Python frames only")
    assert gil_holder(reading) is not None
    assert where_text(reading).endswith("(native frames not read)")
    assert "note: native frames could not be read" in format_stacks(reading)


def test_py_spy_that_hangs_is_killed_at_the_timeout(tmp_path, monkeypatch):
    pidfile = tmp_path / "pid"
    fake = _fake_py_spy(tmp_path, f'echo $$ > "{pidfile}"\nexec sleep 60')
    monkeypatch.setattr(stacks, "find_py_spy", lambda: fake)
    start = time.monotonic()
    reading = read_stacks(os.getpid(), timeout_s=1.0)
    assert time.monotonic() - start < 10
    assert reading.error == (f"py-spy did not read process {os.getpid()} within 1 s and was "
                             "killed")
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(int(pidfile.read_text()), 0)


def test_a_refusal_is_said_in_one_sentence(tmp_path, monkeypatch):
    fake = _fake_py_spy(tmp_path, 'echo "Permission Denied: Try running again with elevated '
                                  'permissions" >&2\nexit 1')
    monkeypatch.setattr(stacks, "find_py_spy", lambda: fake)
    monkeypatch.setattr(stacks, "ptrace_obstacle", lambda pid, named=False: None)
    reading = read_stacks(os.getpid())
    assert reading.error is not None and "CAP_SYS_PTRACE" in reading.error
    assert "may not be read by this one" in reading.error and "\n" not in reading.error
    said = "kernel.yama.ptrace_scope is 2: only a process with CAP_SYS_PTRACE may read another"
    monkeypatch.setattr(stacks, "ptrace_obstacle", lambda pid, named=False: said)
    assert read_stacks(os.getpid()).error == said


def test_py_spy_errors_read_as_one_line():
    stderr = ("Error: Failed to get process executable name. Check that the process is "
              "running.\n\nCaused by:\n    0: No such file or directory (os error 2)\n    1: x\n"
              "\nStack backtrace:\n   0: anyhow::error\n")
    assert error_text(stderr) == ("Failed to get process executable name. Check that the "
                                  "process is running. (No such file or directory (os error 2))")
    assert error_text("Collecting stack traces from native extensions (`--native`) is not "
                      "supported on your platform.\n").startswith("Collecting stack traces")


def _dead_pid() -> int:
    pid = os.spawnlp(os.P_NOWAIT, "true", "true")
    os.waitpid(pid, 0)
    return pid


# -- the wire form, bounded -------------------------------------------------------------------


def _thread(i: int, frames: int, holder: bool = False, name_len: int = 10) -> ThreadStack:
    return ThreadStack(
        thread_id=1000 + i, name=f"t{i}" + "x" * name_len, os_thread_id=2000 + i, active=False,
        owns_gil=holder,
        frames=tuple(Frame(f"f{j}" + "y" * 1000, f"/a/b{j}.py", j + 1, native=False)
                     for j in range(frames)))


def test_the_wire_form_is_bounded_and_keeps_the_gil_holder():
    threads = tuple(_thread(i, 200, holder=(i == 99)) for i in range(100))
    reading = StackReading(pid=7, tool="py-spy 0.4.3", native=True, threads=threads,
                           error=None, took_s=0.1, t=1.0)
    wire = reading.to_wire()
    assert len(json.dumps(wire)) <= MAX_WIRE_BYTES  # 100 x 200 frames of 1000 characters
    kept = len(wire["threads"])
    assert 1 <= kept < MAX_THREADS and wire["threads_cut"] == 100 - kept
    assert wire["threads"][-1]["owns_gil"]  # the holder kept first, shown in the order read
    assert wire["threads"][0]["thread_id"] == 1000
    for thread in wire["threads"]:
        assert len(thread["frames"]) == MAX_FRAMES and thread["frames_cut"] == 200 - MAX_FRAMES
        assert thread["frames"][0]["name"].startswith("f0")  # innermost kept
        assert thread["frames"][-1]["name"].startswith("f199")  # and the outermost
        assert all(len(f["name"]) <= MAX_TEXT for f in thread["frames"])
    back = StackReading.from_wire(wire)
    assert back.error is None and len(back.threads) == kept and back.threads_cut == 100 - kept
    assert gil_holder(back) is not None and gil_holder(back).thread_id == 1099
    assert "(120 frames in the middle not kept)" in format_stacks(back)
    assert f"({100 - kept} more threads not kept)" in format_stacks(back)


def test_small_threads_are_kept_up_to_max_threads():
    threads = tuple(_thread(i, 2, holder=(i == 70)) for i in range(100))
    wire = StackReading(pid=7, tool="py-spy", native=False, threads=threads).to_wire()
    assert len(wire["threads"]) == MAX_THREADS and wire["threads_cut"] == 100 - MAX_THREADS
    assert any(t["owns_gil"] for t in wire["threads"])


def test_a_peer_sending_more_than_the_bounds_is_cut_on_reading():
    wire = StackReading(pid=7, tool="t", native=False,
                        threads=tuple(_thread(i, 3) for i in range(3))).to_wire()
    wire["threads"] = wire["threads"] * 50
    wire["threads"][0]["frames"] = wire["threads"][0]["frames"] * 100
    wire["tool"] = "z" * 10_000
    back = StackReading.from_wire(wire)
    assert back.error is None and len(back.threads) == MAX_THREADS
    assert back.threads_cut == 150 - MAX_THREADS
    assert len(back.threads[0].frames) == MAX_FRAMES and back.threads[0].frames_cut == 220
    assert len(back.tool) == MAX_TEXT


@pytest.mark.parametrize("wire, says", [
    (None, "it is NoneType, not a map"),
    ([], "it is list, not a map"),
    ({}, "threads is missing"),
    ({"pid": 1, "tool": "x", "native": True, "threads": {}}, "threads is dict"),
    ({"pid": True, "tool": "x", "native": True, "threads": []}, "pid is True"),
    ({"pid": 1, "tool": "x", "native": 1, "threads": []}, "native is int"),
    ({"pid": 1, "tool": "x", "native": True, "threads": [3]}, "thread 0: is not a map"),
    ({"pid": 1, "tool": "x", "native": True, "threads": [], "took_s": float("nan")},
     "took_s is nan"),
    ({"pid": 1, "tool": "x", "native": True, "threads": [], "t": 10 ** 400}, "t is out of range"),
    ({"pid": 1, "tool": "x", "native": True, "threads": [], "threads_cut": -1},
     "threads_cut is -1"),
    ({"pid": 1, "tool": "x", "native": True, "threads": [
        {"thread_id": 1, "active": True, "owns_gil": False,
         "frames": [{"name": "f", "file": "a.py", "line": "3", "native": False}]}]},
     "thread 0: frame 0: line is str"),
])
def test_a_malformed_reading_reads_as_an_error(wire, says):
    reading = StackReading.from_wire(wire)
    assert reading.error == f"a malformed stack reading arrived: {says}"
    assert reading.threads == ()
    sent = wire.get("pid") if isinstance(wire, dict) else None
    assert reading.pid == (sent if type(sent) is int else -1)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                 max_size=6),
    max_leaves=30)
_KEYS = ["pid", "tool", "native", "error", "note", "took_s", "t", "threads_cut", "threads",
         "thread_id", "name", "os_thread_id", "active", "owns_gil", "frames", "frames_cut",
         "file", "line", "library"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_json, st.dictionaries(st.sampled_from(_KEYS), _json, max_size=12)))
def test_garbage_never_raises(wire):
    reading = StackReading.from_wire(wire)
    assert isinstance(reading, StackReading)
    assert reading.error is None or reading.error.startswith("a malformed stack reading")
    json.dumps(reading.to_wire())
    where_text(reading)
    format_stacks(reading)


_VALID = StackReading(pid=5, tool="py-spy 0.4.3", native=True, threads=(
    ThreadStack(1, "MainThread", 5, False, True, (
        Frame("sleep", "/lib/libc.so.6", 0, True, "/lib/libc.so.6"),
        Frame("f", "/x/a.py", 3, False))),)).to_wire()


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["pid", "tool", "native", "threads", "took_s", "t", "error"]), _json,
       st.integers(0, 1), st.sampled_from(["thread_id", "name", "active", "owns_gil",
                                           "frames", "os_thread_id"]))
def test_a_valid_reading_with_one_field_spoiled_never_raises(key, value, depth, inner_key):
    wire = json.loads(json.dumps(_VALID))
    if depth == 0:
        wire[key] = value
    else:
        wire["threads"][0][inner_key] = value
    reading = StackReading.from_wire(wire)
    assert isinstance(reading, StackReading)
    where_text(reading)


def test_where_text_names_a_few_native_frames_and_the_python_caller():
    natives = [Frame(f"c{i}", "/lib/libx.so", 0, True, "/lib/libx.so") for i in range(6)]
    glue = [Frame("_PyEval_EvalFrameDefault", "/lib/libpython3.11.so", 0, True, "/lib/p.so"),
            Frame("0x7f00", "/lib/libc.so.6", 0, True, "/lib/libc.so.6")]
    thread = ThreadStack(1, "MainThread", 5, True, True, (
        *natives, *glue, Frame("step", "/j/train.py", 42, False),
        Frame("<module>", "/j/train.py", 90, False)))
    reading = StackReading(pid=5, tool="py-spy", native=True, threads=(thread,))
    assert where_text(reading) == ("in native code holding the GIL: c0 <- c1 <- ... <- c5 <- "
                                   "step() at train.py:42")
    python_only = StackReading(pid=5, tool="py-spy", native=True, threads=(
        ThreadStack(1, None, 5, True, True, (Frame("step", "/j/train.py", 42, False),)),))
    assert where_text(python_only) == "in Python holding the GIL: step() at train.py:42"
    assert where_text(StackReading(pid=5, tool="py-spy", native=True)) == \
        "no Python thread found in the process"


def test_text_from_the_process_cannot_drive_the_terminal():
    evil = Frame("f\x1b[2J", "/x/\x1b]52;c;AAAA\x07a.py", 3, False)
    reading = StackReading(pid=5, tool="py-spy", native=False, threads=(
        ThreadStack(1, "Main\x1b[31m", 5, False, True, (evil,)),))
    for text in (where_text(reading), format_stacks(reading)):
        assert "\x1b" not in text and "\x07" not in text and "\\x1b" in text
