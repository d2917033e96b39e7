"""Work on a copy of the hub's state, off its loop: `ForkedCall` forks, the child runs one
function on the state as it stood at that instant (nothing changes it there) and sends the
outcome back through a pipe, which a thread of the hub reads (the GIL free while it waits).
The loop pays only for the fork. Where `os.fork` does not exist, the function runs in a
thread instead (holding the GIL meanwhile).

The child runs only the calling thread's code: it disables the garbage collector (nothing of
the hub's, a ZeroMQ socket say, is finalized in it), logs nothing, touches no socket, and ends
with `os._exit`; an alarm ends a child that runs too long. It may run niced: on a node short of
cores the hub's loop is served first.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

CHILD_LIMIT_S = 300
"""A child still running after this long is ended by its alarm."""


def timed(work: Callable[[], T]) -> tuple[T, float]:
    """What `work()` returns, and the seconds it took."""
    started = time.perf_counter()
    result = work()
    return result, time.perf_counter() - started


class ForkedCall:
    """`work()` in a forked child of the hub; `on_done(self)` is called from the reading
    thread once `result` (what `work` returned, pickled back) or `error` (in words) is set.
    `fork_s` is how long the caller stood still for it."""

    def __init__(self, work: Callable[[], Any], on_done: Callable[[Any], None], name: str,
                 nice: int = 0) -> None:
        self.result: Any = None
        self.error: str | None = None
        self.done = threading.Event()
        self.killed = False
        self.pid: int | None = None
        self._on_done = on_done
        started = time.perf_counter()
        if not hasattr(os, "fork"):  # no fork here: a thread (it holds the GIL meanwhile)
            self.fork_s = 0.0
            threading.Thread(target=self._in_thread, args=(work,), name=name,
                             daemon=True).start()
            return
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(read)
            _child(write, work, nice)
        os.close(write)
        self.pid = pid
        self.fork_s = time.perf_counter() - started
        threading.Thread(target=self._read, args=(read,), name=name, daemon=True).start()

    def _in_thread(self, work: Callable[[], Any]) -> None:
        try:
            self.result = work()
        except Exception as exc:  # a bug here must not take the hub down
            self.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        self._finish()

    def _read(self, fd: int) -> None:
        chunks = []
        try:
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(fd)
        assert self.pid is not None
        _, status = os.waitpid(self.pid, 0)
        try:
            outcome = pickle.loads(b"".join(chunks)) if chunks else None
        except Exception as exc:  # a child killed mid-write
            outcome = ("error", f"unreadable reply ({type(exc).__name__})")
        if outcome is None:
            self.error = f"the child process ended without a reply ({_status_text(status)})"
        elif outcome[0] == "ok":
            self.result = outcome[1]
        else:
            self.error = str(outcome[1])
        self._finish()

    def _finish(self) -> None:
        self.done.set()
        self._on_done(self)

    def kill(self) -> None:
        """End the child (the reading thread still reaps it)."""
        self.killed = True
        if self.pid is not None and not self.done.is_set():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _child(fd: int, work: Callable[[], Any], nice: int) -> None:
    """The forked child: run `work`, send the outcome, exit without running anything of the
    hub's (atexit, finalizers)."""
    code = 0
    try:
        gc.disable()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
            signal.signal(sig, signal.SIG_DFL)
        signal.alarm(CHILD_LIMIT_S)
        if nice:
            with contextlib.suppress(OSError):
                os.nice(nice)
        try:
            reply: object = ("ok", work())
        except Exception as exc:
            reply = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        data = memoryview(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        while data:
            data = data[os.write(fd, data):]
    except BaseException:  # the hub gone (a broken pipe): nothing to tell
        code = 1
    finally:
        os._exit(code)


def _status_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"
