"""A one-process monitored job with a stand-in for libnccl's debug log, for the NCCL_DEBUG tests
on a machine without NCCL.

    python tests/jobs/fake_nccl_log.py STEPS STEP_S [early] [no-reset] [reopen-at-reset]

`FakeNccl` does with the environment what NCCL's src/debug.cc does: it reads NCCL_DEBUG,
NCCL_DEBUG_SUBSYS and NCCL_DEBUG_FILE at its first log line and again only after
ncclResetDebugInit(), writes to that file (opened "w", line-buffered, %h/%p expanded) or else
to C's stdout (fputs: block-buffered on a file or pipe and never flushed, as NCCL's fwrite),
prints INIT lines when a communicator is created and a COLL line per all_reduce (INFO). The
agent is pointed at it: `nccl_library()` names a library and `reset_debug_symbol()` returns
its reset (None with `no-reset`: a libnccl without the symbol).
early: the communicator is created (and logs) before `sm.init`, as with eager init.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

import scalemon.agent as sm
from scalemon.agent import flags
from scalemon.agent.nccllog import expand_debug_file, short_hostname

SUBSYS = {"INIT", "COLL", "P2P", "BOOTSTRAP", "ENV", "ALL"}
LIBC = ctypes.CDLL(None)
LIBC.fputs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]


class FakeNccl:
    """NCCL's debug output, as far as the tests need it."""

    def __init__(self) -> None:
        self.level: str | None = None  # None: read the environment at the next line
        self.mask: set[str] = set()
        self.out = None
        self.op_count = 0

    def reset(self) -> None:
        """ncclResetDebugInit(): read the settings again at the next line (NCCL 2.27 on), or at
        once with `reopen-at-reset` (NCCL 2.24 to 2.26: src/debug.cc closes the file and runs
        ncclDebugInit in the reset)."""
        self.level = None
        if "reopen-at-reset" in sys.argv:
            self._init()

    def _init(self) -> None:
        if self.out is not None:
            self.out.close()
            self.out = None
        self.level = os.environ.get("NCCL_DEBUG", "").upper()
        words = os.environ.get("NCCL_DEBUG_SUBSYS", "INIT,BOOTSTRAP,ENV").upper().split(",")
        self.mask = SUBSYS if "ALL" in words else set(words)
        target = os.environ.get("NCCL_DEBUG_FILE")
        if self.level in ("WARN", "INFO", "ABORT", "TRACE") and target:  # above VERSION
            self.out = open(expand_debug_file(target), "w", buffering=1)  # noqa: SIM115

    def info(self, subsys: str, text: str) -> None:
        if self.level is None:
            self._init()
        if self.level not in ("INFO", "TRACE") or subsys not in self.mask:
            return
        line = f"{short_hostname()}:{os.getpid()}:{os.getpid()} [0] NCCL INFO {text}\n"
        if self.out is not None:
            self.out.write(line)
        else:  # C's stdout, as NCCL: block-buffered on a file or pipe, never flushed
            LIBC.fputs(line.encode(), ctypes.c_void_p.in_dll(LIBC, "stdout"))

    def comm_init(self) -> None:
        self.info("INIT", "FAKE-NCCL ncclCommInitRank comm 0x1 rank 0 nranks 1 - Init START")
        self.info("INIT", "FAKE-NCCL ncclCommInitRank comm 0x1 rank 0 nranks 1 - Init COMPLETE")

    def all_reduce(self) -> None:
        self.info("COLL", f"FAKE-NCCL AllReduce: opCount {self.op_count:x} count 1 comm 0x1")
        self.op_count += 1


def main() -> int:
    steps, step_s = int(sys.argv[1]), float(sys.argv[2])
    nccl = FakeNccl()
    flags.nccl_library = lambda: "/fake/libnccl.so.2"
    flags.reset_debug_symbol = lambda path: None if "no-reset" in sys.argv else nccl.reset
    if "early" in sys.argv:
        nccl.comm_init()
    sm.init(config={"job": "fake_nccl_log"})
    if "early" not in sys.argv:
        nccl.comm_init()
    for step in range(steps):
        nccl.all_reduce()
        time.sleep(step_s)
        sm.log(step=step, loss=1.0 / (step + 1))
    sm.finish()
    nccl.info("INIT", "FAKE-NCCL comm 0x1 rank 0 - Destroy COMPLETE")
    print("fake job done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
