"""The rank names the process that may read its stacks from outside (its node's hub or relay),
for kernels whose Yama module allows that only to a named reader.

Under kernel.yama.ptrace_scope 1 (Ubuntu's default) a process may be read (ptrace) only by its
ancestors, by a process with CAP_SYS_PTRACE, or by the process it named with
prctl(PR_SET_PTRACER, pid), and that process's descendants (py-spy, started by the named hub or
relay, is one). The hub and the relay are not the ranks' ancestors, so without this a rank
frozen with the GIL held could not be read by them (`scalemon.proc.ptrace` says so when it
happens). The naming holds for the whole process (Yama keeps it per thread group), until the
process names another or ends; a new hub or relay must be named again.

One prctl call: no allocation worth the name, no thread, never raises, never blocks. libc is
`ctypes.CDLL(None)` (the symbols the interpreter already has), not `ctypes.util.find_library`,
which runs ldconfig or a compiler (tens of milliseconds).

`name_reader` tells apart:
- "named": Yama took the name;
- "not needed": the kernel has no Yama (prctl answers EINVAL and
  /proc/sys/kernel/yama/ptrace_scope is absent): readers of the same user, or with
  CAP_SYS_PTRACE, may read without it;
- "refused: ...": Yama is there and refused (no such process, or a kernel that forbids it);
- "unsupported": not Linux, or no prctl in its C library.
`allow_reader` is True for the first two.

Exercised on this project's CI machine (Linux without Yama, as root): the prctl call and the
"not needed" answer, and the mapping of each errno to its answer (tests/test_proc_ptrace.py).
Not exercised there: Yama present ("named", and a named hub then reading a rank under scope 1).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("scalemon.agent")

PR_SET_PTRACER = 0x59616D61
"""prctl option "Yama" (linux/prctl.h)."""
YAMA_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")
NAMED = "named"
NOT_NEEDED = "not needed"
UNSUPPORTED = "unsupported"
LINUX = sys.platform.startswith("linux")
"""prctl and Yama are Linux's."""

_prctl: Any = None


def name_reader(pid: int) -> str:
    """Name process `pid` as the one that may read this process (prctl PR_SET_PTRACER); the
    outcome as `NAMED`, `NOT_NEEDED`, `UNSUPPORTED` or "refused: <why>". Never raises."""
    try:
        prctl = _load_prctl()
        if prctl is None:
            return UNSUPPORTED
        ctypes.set_errno(0)
        result = prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)
        return outcome(result, ctypes.get_errno(), YAMA_SCOPE.exists(), pid)
    except Exception as exc:  # the rank comes first: nothing here may stop it
        log.debug("scalemon: naming the stack reader %s failed: %s", pid, exc)
        return f"refused: {exc}"


def allow_reader(pid: int) -> bool:
    """True when process `pid` (the node's hub or relay) may now read this process as far as
    Yama goes: it was named, or the kernel has no Yama. False where naming it was refused or
    is not possible (not Linux). Never raises."""
    return name_reader(pid) in (NAMED, NOT_NEEDED)


def outcome(result: int, err: int, yama: bool, pid: int) -> str:
    """What prctl's `result` and `err` (errno) mean, `yama` being whether the kernel has
    Yama."""
    if result == 0:
        return NAMED
    if err == errno.EINVAL and not yama:
        return NOT_NEEDED
    if err == errno.EINVAL:
        return f"refused: no process {pid} to name"
    return f"refused: {os.strerror(err) if err else f'prctl returned {result}'}"


def _load_prctl() -> Any:
    """libc's prctl with errno kept (loaded once), or None where there is none."""
    global _prctl
    if _prctl is None and LINUX:
        try:
            func = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            return None
        func.restype = ctypes.c_int
        func.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                         ctypes.c_ulong]
        _prctl = func
    return _prctl


CHECK_S = 5.0
"""How often the agent looks whether its node's hub or relay is a new process to name."""
LOCKS = ("hub.lock", "relay.lock")


class ReaderNaming:
    """Keeps this rank's node's hub or relay named as its reader: the process holding the lock
    beside the ipc endpoint the rank sends to (`hub.lock` or `relay.lock`; its pid is written
    in it). Checked every `CHECK_S` from the agent's background thread, so a hub or relay
    started after the rank, or replaced, is named too. Never raises."""

    def __init__(self, ingest_endpoint: str) -> None:
        path = ingest_endpoint.removeprefix("ipc://")
        self.directory = Path(path).parent if path != ingest_endpoint else None
        self.named_pid: int | None = None
        self.outcome: str | None = None
        self._next = 0.0

    def check(self, now: float) -> None:
        """Name the lock holder when it changed (`now`: time.monotonic())."""
        if self.directory is None or now < self._next:
            return
        self._next = now + CHECK_S
        pid = self._holder()
        if pid is None or pid == self.named_pid:
            return
        self.named_pid, self.outcome = pid, name_reader(pid)
        if self.outcome.startswith("refused"):
            log.info("scalemon: could not let process %d read this rank's stacks: %s",
                     pid, self.outcome)

    def _holder(self) -> int | None:
        for name in LOCKS:
            try:
                text = (self.directory / name).read_text().strip()  # type: ignore[operator]
            except OSError:
                continue
            if text.isdigit() and int(text) > 0:
                return int(text)
        return None
