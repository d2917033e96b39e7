"""A process's stacks read from outside it, the entry point: `read_stacks(pid)` runs py-spy
and never raises; the reading (`StackReading`: threads, frames, the GIL holder), its wire form
and its words (`where_text`, `format_stacks`) come from the modules beside this one and are
named here too, so a caller imports them from one place.

Why from outside: a rank frozen in native code that holds the GIL (a C extension's deadlock)
runs none of its own threads, the agent's included, so it cannot say where it is. Another
process can read its memory: py-spy does, in a moment, stopping it only while it reads.
py-spy was chosen over pystack: it is one static executable in its wheel (nothing to load at
run time), it reads Python stacks on Linux, macOS and Windows (native frames on Linux and
Windows), and `dump --json` gives every thread's `owns_gil` and `active`; pystack is
Linux-only and prints text (its structured form is a Python API, in the reader's process).
"""

from __future__ import annotations

import time
from dataclasses import replace

from .facts import pid_exists
from .frames import (
    MAX_FRAMES,
    MAX_TEXT,
    MAX_THREADS,
    Frame,
    StackReading,
    ThreadStack,
    gil_holder,
    main_thread,
    ordered_threads,
)
from .ptrace import ptrace_obstacle
from .pyspy import INSTALL_HINT, Dump, dump, find_py_spy, tool_name
from .stacktext import format_stacks, where_text

__all__ = ["MAX_FRAMES", "MAX_TEXT", "MAX_THREADS", "Frame", "StackReading", "ThreadStack",
           "format_stacks", "gil_holder", "main_thread", "ordered_threads", "read_stacks",
           "where_text"]

PYTHON_ONLY_MIN_S = 1.0
"""Time left below which a failed native reading is not retried with Python frames only."""


def read_stacks(pid: int, native: bool = True, timeout_s: float = 10.0,
                named: bool = False) -> StackReading:
    """Every thread's stack of process `pid`, read by py-spy (the one beside this
    interpreter, else on PATH), with native frames when `native`. Where the native reading
    fails (unsupported on this platform, frames py-spy cannot merge), the Python frames are
    read instead and the reading's `note` says so. Never raises: a missing py-spy, a process
    that is gone, a refusal (said as `ptrace_obstacle` puts it; `named`: the process named
    this one as its reader) or a py-spy that runs past `timeout_s` (killed) give a reading
    with `error`."""
    start, t = time.monotonic(), time.time()
    exe = find_py_spy()
    tool = "py-spy" if exe is None else tool_name(exe)
    base = StackReading(pid=pid, tool=tool, native=native, t=t)
    if exe is None:
        return _took(replace(base, error=INSTALL_HINT), start)
    if pid_exists(pid) is False:
        return _took(replace(base, error=f"process {pid} is not running"), start)
    result = dump(exe, pid, native, timeout_s)
    left = timeout_s - (time.monotonic() - start)
    if native and _native_only_failure(result) and left >= PYTHON_ONLY_MIN_S:
        python_only = dump(exe, pid, False, left)
        if python_only.threads is not None:
            return _took(replace(
                base, native=False, threads=python_only.threads,
                note=f"native frames could not be read ({result.error}); Python frames only"),
                start)
    if result.threads is None:
        return _took(replace(base, error=_error(pid, result, named, timeout_s)), start)
    return _took(replace(base, threads=result.threads), start)


def _took(reading: StackReading, start: float) -> StackReading:
    return replace(reading, took_s=round(time.monotonic() - start, 4))


def _native_only_failure(result: Dump) -> bool:
    """A failure that reading Python frames only may not meet: not a refusal, not a process
    gone, not a timeout."""
    return result.threads is None and not (result.permission or result.gone
                                           or result.timed_out)


def _error(pid: int, result: Dump, named: bool, timeout_s: float) -> str:
    if result.permission:
        why = ptrace_obstacle(pid, named=named)
        return why or (f"process {pid} may not be read by this one ({result.error}): run the "
                       "hub or relay as the rank's user, or with CAP_SYS_PTRACE")
    if result.gone or pid_exists(pid) is False:
        return f"process {pid} ended before its stacks were read"
    if result.timed_out:
        return f"py-spy did not read process {pid} within {timeout_s:.3g} s and was killed"
    if result.error and "python version" in result.error.lower():
        return f"process {pid} does not look like a Python process (py-spy: {result.error})"
    return f"py-spy could not read process {pid}: {result.error}"
