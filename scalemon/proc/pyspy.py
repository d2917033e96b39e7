"""py-spy, run once on a process: `py-spy dump --pid PID --json [--native]`, its JSON turned
into a `StackReading`, its failures into one plain sentence.

py-spy 0.4's JSON is a list of threads, each {"pid", "thread_id", "thread_name" (null for a
main thread whose process never imported threading), "os_thread_id", "active", "owns_gil",
"frames", "process_info"}; a frame is {"name", "filename", "module", "short_filename", "line",
"locals", "is_entry", "is_shim_entry"}, innermost first. A native frame (with --native) has
"module": the shared library's path, and "line" 0 unless the library has line information
(CPython's own: "_ctypes_callproc" at callproc.c:1262); an unresolved one is named by its
address ("0x7f8da74a3f16"); a Python frame has "module": null. With --native the native frames
of the interpreter and of ctypes/libffi stand between Python frames, and the C code a Python
frame called stands above it (clock_nanosleep <- nanosleep <- sleep <- ... <- freeze()).

py-spy stops the process for the moment it reads it (ptrace), then lets it go. It prints its
error to stderr ("Error: ..." with "Caused by:" lines) and exits 1. `--native` is refused where
py-spy cannot unwind native stacks (macOS: "not supported on your platform"), and fails on a
process it cannot merge native and Python frames of ("Failed to merge native and python
frames"): both are what `read_stacks` falls back to Python frames for.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .frames import Frame, ThreadStack

EXE = "py-spy.exe" if sys.platform == "win32" else "py-spy"
INSTALL_HINT = "py-spy is not installed where scalemon runs: `pip install py-spy` there"
PERMISSION_MARKS = ("Permission Denied", "Operation not permitted", "os error 1)",
                    "os error 13)", "requires root")
GONE_MARKS = ("Check that the process is running", "No such process", "os error 3)")


@dataclass(frozen=True)
class Dump:
    """One run of py-spy: the threads it read, or how it failed."""

    threads: tuple[ThreadStack, ...] | None
    error: str | None = None
    """py-spy's own error, its first line and first cause, when it failed."""
    permission: bool = False
    """It failed because the process may not be read (ptrace refused)."""
    gone: bool = False
    """It failed because the process is not there."""
    timed_out: bool = False


def find_py_spy() -> str | None:
    """py-spy's executable: the one installed beside this interpreter (its venv's bin/, or
    Scripts\\ on Windows), else the first on PATH; None where there is none."""
    beside = Path(sys.executable).parent / EXE
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


@functools.lru_cache(maxsize=8)
def tool_name(exe: str) -> str:
    """"py-spy 0.4.3", from `py-spy --version` (asked once per executable)."""
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=5,
                             check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out if out.startswith("py-spy") else "py-spy"


def dump(exe: str, pid: int, native: bool, timeout_s: float) -> Dump:
    """Run `exe dump --pid PID --json [--native]` once, killed after `timeout_s`. Never
    raises."""
    command = [exe, "dump", "--pid", str(pid), "--json"] + (["--native"] if native else [])
    env = {**os.environ, "RUST_BACKTRACE": "0", "RUST_LOG": "off", "NO_COLOR": "1"}
    try:
        done = subprocess.run(command, capture_output=True, timeout=max(timeout_s, 0.1),
                              env=env, check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:  # run() killed and reaped it
        return Dump(None, f"py-spy did not finish within {timeout_s:.3g} s", timed_out=True)
    except OSError as exc:
        return Dump(None, f"py-spy could not be started ({exe}: {exc.strerror or exc})")
    stderr = done.stderr.decode("utf-8", "replace")
    if done.returncode != 0:
        return _failure(stderr, done.returncode)
    try:
        return Dump(parse_threads(json.loads(done.stdout)))
    except (ValueError, TypeError, KeyError) as exc:
        return Dump(None, f"py-spy's output could not be read ({exc})")


def parse_threads(data: Any) -> tuple[ThreadStack, ...]:
    """py-spy's JSON (a list of threads) as ThreadStacks; raises ValueError where it is not
    that list."""
    if not isinstance(data, list):
        raise ValueError(f"a list of threads was expected, not {type(data).__name__}")
    return tuple(_thread(entry) for entry in data)


def error_text(stderr: str) -> str:
    """py-spy's error in one line: its "Error: ..." line and the first cause under
    "Caused by:", without the backtrace."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    first = next((line for line in lines if line.startswith("Error:")), None)
    if first is None:
        return lines[0] if lines else "no message"
    text = first.removeprefix("Error:").strip()
    if "Caused by:" in lines:
        cause = lines[lines.index("Caused by:") + 1:][:1]
        if cause:
            text += f" ({cause[0].split(':', 1)[-1].strip()})"
    return text


def _failure(stderr: str, code: int) -> Dump:
    text = error_text(stderr) if stderr.strip() else f"py-spy exited with code {code}"
    return Dump(None, text, permission=any(mark in stderr for mark in PERMISSION_MARKS),
                gone=any(mark in stderr for mark in GONE_MARKS))


def _thread(entry: Any) -> ThreadStack:
    if not isinstance(entry, dict):
        raise ValueError("a thread is not a map")
    name = entry.get("thread_name")
    os_id = entry.get("os_thread_id")
    return ThreadStack(
        thread_id=int(entry["thread_id"]), name=name if isinstance(name, str) else None,
        os_thread_id=os_id if isinstance(os_id, int) else None,
        active=bool(entry.get("active")), owns_gil=bool(entry.get("owns_gil")),
        frames=tuple(_frame(f) for f in entry.get("frames") or ()))


def _frame(entry: Any) -> Frame:
    if not isinstance(entry, dict):
        raise ValueError("a frame is not a map")
    library = entry.get("module")
    line = entry.get("line")
    return Frame(name=str(entry.get("name", "?")), file=str(entry.get("filename", "?")),
                 line=line if isinstance(line, int) and line > 0 else 0,
                 native=isinstance(library, str),
                 library=library if isinstance(library, str) else None)
