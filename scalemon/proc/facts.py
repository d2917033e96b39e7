"""What the kernel says of a process, read from outside it: does it exist, what state is it in
(running, sleeping, in an uninterruptible wait, a zombie, stopped), how much CPU time has it
used, how many threads has it. One read of /proc/PID/stat; two reads a moment apart tell
whether its CPU time is moving (`cpu_moving`): a rank frozen in a wait uses none, a rank
spinning in a busy loop uses a core.

Where there is no /proc (macOS), only existence is known (`os.kill(pid, 0)`); the rest is None.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PROC = Path("/proc")
"""Where the kernel's process table is read (a module attribute, for tests)."""

STATE_WORDS = {
    "R": "running",
    "S": "sleeping",
    "D": "in uninterruptible wait (disk/driver)",
    "Z": "zombie (ended, not reaped)",
    "T": "stopped",
    "t": "traced (stopped by a debugger)",
    "X": "dead",
    "x": "dead",
    "I": "idle (kernel thread)",
    "P": "parked",
    "K": "waking to be killed",
    "W": "waking",
}
"""The state letter of /proc/PID/stat (proc(5)) in words."""

# fields of /proc/PID/stat after "(comm) ", counted from 0 (proc(5) numbers them from 1, pid
# first): state is field 3, utime 14, stime 15, num_threads 20
_STATE, _UTIME, _STIME, _THREADS = 0, 11, 12, 17


@dataclass(frozen=True)
class ProcessFacts:
    """One reading of a process from outside. `exists` is None when it could not be told;
    the other fields are None where they could not be read (no /proc, or the process gone)."""

    pid: int
    exists: bool | None
    state: str | None = None
    """The state letter of /proc/PID/stat: R, S, D, Z, T, t, ..."""
    state_word: str | None = None
    """The state in words ("sleeping", "zombie (ended, not reaped)")."""
    cpu_s: float | None = None
    """CPU time used so far, user + system, in seconds (clock-tick resolution: 10 ms)."""
    threads: int | None = None
    """Threads in the process."""
    comm: str | None = None
    """The process's name as the kernel has it (15 characters at most: "pt_main_thread")."""
    t: float = 0.0
    """When it was read (time.time())."""

    def to_wire(self) -> dict[str, Any]:
        """The facts as a plain JSON-safe dict."""
        return asdict(self)

    @classmethod
    def from_wire(cls, wire: Any) -> ProcessFacts:
        """The facts a peer sent (`to_wire`'s form); a missing or ill-typed field reads as
        unknown (None; pid -1, t 0). Never raises."""
        if not isinstance(wire, dict):
            wire = {}
        pid = _int(wire.get("pid"))
        state = _text(wire.get("state"), 2)
        return cls(
            pid=-1 if pid is None else pid,
            exists=wire.get("exists") if isinstance(wire.get("exists"), bool) else None,
            state=state,
            state_word=_text(wire.get("state_word"), 80) or STATE_WORDS.get(state or ""),
            cpu_s=_number(wire.get("cpu_s")),
            threads=_int(wire.get("threads")),
            comm=_text(wire.get("comm"), 64),
            t=_number(wire.get("t")) or 0.0,
        )


def process_facts(pid: int) -> ProcessFacts:
    """What /proc/PID/stat says of process `pid` now. Never raises: a process that is gone
    reads `exists=False`; on a system without /proc only `exists` is filled in."""
    now = time.time()
    if not (PROC / "self" / "stat").exists():
        return ProcessFacts(pid, exists=pid_exists(pid), t=now)
    try:
        raw = (PROC / str(pid) / "stat").read_bytes()
    except FileNotFoundError:  # gone (or never was); a zombie still has its entry
        return ProcessFacts(pid, exists=False, t=now)
    except (OSError, ValueError):  # hidden (hidepid), or an odd pid
        return ProcessFacts(pid, exists=pid_exists(pid), t=now)
    return parse_stat(pid, raw, now)


def parse_stat(pid: int, raw: bytes, now: float) -> ProcessFacts:
    """The facts in the text of /proc/PID/stat. The name (comm, in parentheses) may hold
    spaces and parentheses itself: it runs to the last ')' of the line."""
    head, _, rest = raw.rpartition(b")")
    comm = head.partition(b"(")[2].decode("utf-8", "replace") if head else None
    fields = rest.split()
    if not head or len(fields) <= _THREADS:
        return ProcessFacts(pid, exists=True, comm=comm, t=now)
    state = fields[_STATE].decode("ascii", "replace")
    try:
        ticks = int(fields[_UTIME]) + int(fields[_STIME])
        threads: int | None = int(fields[_THREADS])
    except ValueError:
        ticks, threads = -1, None
    return ProcessFacts(
        pid, exists=True, state=state, state_word=STATE_WORDS.get(state, f"state {state}"),
        cpu_s=ticks / _clock_ticks() if ticks >= 0 else None, threads=threads, comm=comm,
        t=now)


def cpu_moving(before: ProcessFacts, after: ProcessFacts) -> bool | None:
    """True when the process used CPU time between the two readings, False when it used none
    (within the kernel's 10 ms tick), None when either reading lacks it or they are of two
    processes."""
    if before.pid != after.pid or before.cpu_s is None or after.cpu_s is None:
        return None
    return after.cpu_s > before.cpu_s


def pid_exists(pid: int) -> bool | None:
    """Whether process `pid` exists (a zombie does), by sending it signal 0 (nothing is
    delivered); None where that cannot tell."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    except (OSError, OverflowError):
        return None
    return True


def _clock_ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK") or 100
    except (ValueError, OSError, AttributeError):
        return 100


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        return None
    return number if math.isfinite(number) else None


def _text(value: Any, limit: int) -> str | None:
    return value[:limit] if isinstance(value, str) else None
