"""How a rank's end is reported when no `finish()` says it: at interpreter exit (`atexit`), and
when the process is ended by SIGTERM (torchrun's stop, a scheduler's, `kill`).

SIGTERM: the handler is installed at init, in the main thread, and only where SIGTERM's handler
is the default one (a script's or a framework's own handler is never replaced). It puts the
default handler back first (a second SIGTERM kills at once), sends the rank's `exit` (reason
"signal", exit code 128 + the signal's number) behind the steps queued, waits for it to leave
`FLUSH_S` at most and sends itself the signal again: the process still dies by SIGTERM (status
-15, 143 in a shell), as it would without the agent. It skips what `finish()` does first (the
recorder's last read, the last heartbeat, the log reader's end: seconds in a hung job); where
`finish()` runs already (an exception on its way out, `atexit`), it lets that one's `exit`
leave instead. Whatever fails on the way (no thread can start at interpreter shutdown), the
process still dies by the signal.

Called by someone else's handler (Lightning's, or any `prev = signal.getsignal(SIGTERM)` that
chains to the handler it replaced), it does nothing: that handler ends the process its own way
(a graceful stop, a checkpoint), and `finish()` or `atexit` reports the end as usual.

Python runs a handler in the main thread between bytecodes, so a rank stuck in a collective
(native code) would not run it until the collective returns. The handler's C part also writes
the signal's number to a wakeup pipe (`signal.set_wakeup_fd`, only where nothing else uses
one), which a thread of ours reads: whichever of the two comes first sends the `exit`; the
other waits for it and dies too. So for up to `FLUSH_S` after SIGTERM (torchrun's stop signals
the whole process group) a main thread in native code keeps running it, and nothing else: when
it comes back to Python the pending SIGTERM handler runs first (before SIGCHLD's, whose
DataLoader handler would raise "worker killed by signal") and waits there until the process
dies. Both ways need the GIL: a main thread that holds it in native code and never lets go
defers the end until it does; held forever, the process dies only by the launcher's SIGKILL
after its grace period, where without the agent SIGTERM would kill it at once. No Python code
can run without the GIL, so that is a limit of this design.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import threading
from typing import Any, Protocol

FLUSH_S = 0.2
"""The most a signalled rank waits for its `exit` to leave before it dies: the send over ipc
took 2 ms (45 ms with 200 steps queued on two busy cores) when measured."""
SIGNALS = (signal.SIGTERM,)
EXIT_REASON = "signal"
"""The `exit` message's reason of a rank ended by a signal (its exit code: 128 + the number)."""


class Ending(Protocol):
    """What the hooks need of the agent's `Run`."""

    sender: Any
    phase: Any
    _finished: bool

    def _atexit(self) -> None: ...


def install_end_hooks(run: Ending) -> SignalExit:
    """Report the rank's end at interpreter exit, and on SIGTERM where it would kill the
    process outright (the default handler); returns the SIGTERM part."""
    global _current
    atexit.register(run._atexit)
    if _current is not None and _current.installed and os.getpid() == _current.pid:
        _current.follow(run)  # a second run in this process (init after finish)
        return _current
    _current = SignalExit(run)
    _current.install()
    return _current


class SignalExit:
    """The SIGTERM handler of one rank process (`install`); see the module's docstring."""

    def __init__(self, run: Ending) -> None:
        self.run = run
        self.installed: list[int] = []
        self.pid = os.getpid()
        self._once = threading.Lock()
        self._sent = threading.Event()
        self._pipe: tuple[int, int] | None = None

    def follow(self, run: Ending) -> None:
        """Report the end of `run` from now on (the handler stays where it is)."""
        self.run = run
        self._once = threading.Lock()
        self._sent = threading.Event()

    def install(self) -> bool:
        """Take SIGTERM where its handler is the default one, from the main thread only;
        True when installed."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, self._on_signal)
                self.installed.append(signum)
        if self.installed:
            self._watch_pipe()
            os.register_at_fork(after_in_child=self._in_child)
        return bool(self.installed)

    def _watch_pipe(self) -> None:
        """The wakeup pipe and its reader thread, where no one else has a wakeup fd."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):
            previous = None
        if previous != -1:  # someone's own (an event loop's): theirs stays
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return
        self._pipe = (read_fd, write_fd)
        threading.Thread(target=self._read_pipe, args=(read_fd,), name="scalemon-signals",
                         daemon=True).start()

    def _read_pipe(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except InterruptedError:
                continue
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in self.installed and signal.getsignal(signum) == self._on_signal:
                    self.end(signum, main_thread=False)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if signal.getsignal(signum) != self._on_signal:
            return  # chained to by the handler that replaced ours: that one decides
        self.end(signum, main_thread=True)

    def end(self, signum: int, main_thread: bool) -> None:
        """Put the default handler back, send the exit (once, `FLUSH_S` at most), then die
        by `signum`, whatever fails on the way."""
        kill_by = signal.SIGKILL  # where the handler could not be reset: end all the same
        try:
            if main_thread:
                signal.signal(signum, signal.SIG_DFL)
                kill_by = signum
            elif _default_handler(signum):
                kill_by = signum
            if os.getpid() == self.pid:
                self._flush(signum)
        finally:
            os.kill(os.getpid(), kill_by)

    def _flush(self, signum: int) -> None:
        """Send the exit, `FLUSH_S` at most; where the other way in sends it, wait for that."""
        if not self._once.acquire(blocking=False):
            self._sent.wait(2 * FLUSH_S)  # then die too: no user code runs meanwhile
            return
        try:
            run = self.run
            if getattr(run, "_finished", False):  # finish() runs (atexit): its exit leaves
                with contextlib.suppress(Exception):
                    run.sender.close_timeout_s = min(run.sender.close_timeout_s, FLUSH_S / 2)
                    run.sender._thread.join(FLUSH_S)
                return
            sending = threading.Thread(target=self._send_exit, args=(signum,), daemon=True)
            try:
                sending.start()
            except RuntimeError:  # at interpreter shutdown (3.12+), or at a thread limit
                return  # die unreported: the hub reads the process gone
            sending.join(FLUSH_S)
        finally:
            self._sent.set()

    def _send_exit(self, signum: int) -> None:
        """The `exit`, sent (unless the rank's end is being reported already)."""
        run = self.run
        with contextlib.suppress(Exception):
            sender = run.sender
            sender.close_timeout_s = min(sender.close_timeout_s, FLUSH_S / 2)
            if run._finished:
                return
            run._finished = True  # no other exit after this one (atexit)
            body = {"reason": EXIT_REASON, "exit_code": 128 + signum, "step": run.phase.step}
            sender.submit_deferred(
                "exit", lambda _arg, _deadline: {**body, "dropped": sender.dropped})
            sender.close()

    def _in_child(self) -> None:
        """A forked child (a data loader's worker) dies by SIGTERM as before, and never
        writes to its parent's wakeup pipe."""
        with contextlib.suppress(ValueError, OSError):
            if self._pipe is not None:
                signal.set_wakeup_fd(-1)
                for fd in self._pipe:
                    os.close(fd)
                self._pipe = None
            for signum in self.installed:
                if signal.getsignal(signum) == self._on_signal:
                    signal.signal(signum, signal.SIG_DFL)
        self.installed = []


_current: SignalExit | None = None
"""This process's handler, once installed."""


def _default_handler(signum: int) -> bool:
    """Put back the default handler of `signum` from a thread other than the main one (the
    `signal` module refuses): libc's `signal()`. False where that failed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal.restype = ctypes.c_void_p
        return libc.signal(signum, None) != ctypes.c_void_p(-1).value
    except (OSError, AttributeError):
        return False
