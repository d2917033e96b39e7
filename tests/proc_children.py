"""Real child processes for the tests of `scalemon.proc`: a Python script started, waited for
until it prints "ready", and killed and reaped at the end, every wait bounded."""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
READY_S = 30.0
"""How long a child may take to print "ready" (torch's import on a loaded machine)."""

FROZEN = '''"""A rank frozen in native code holding the GIL: libc's sleep called through
ctypes.PyDLL, which keeps the GIL (as a C extension's deadlock does); its helper thread
cannot run."""
import ctypes
import threading
import time


def helper():
    while True:
        time.sleep(0.05)


def freeze_holding_the_gil():
    print("ready", flush=True)
    ctypes.PyDLL(None).sleep(60)


threading.Thread(target=helper, name="helper", daemon=True).start()
time.sleep(0.1)
freeze_holding_the_gil()
'''

SLEEPER = '''"""A rank waiting in time.sleep: the GIL released."""
import time


def wait_in_sleep():
    print("ready", flush=True)
    time.sleep(60)


wait_in_sleep()
'''

BUSY = 'print("ready", flush=True)\nwhile True:\n    pass\n'


@contextlib.contextmanager
def child(source: str, tmp: Path, name: str = "child.py",
          ready: bool = True) -> Iterator[subprocess.Popen[bytes]]:
    """`source` run as the script `tmp/name` by this interpreter; yields once it printed
    "ready" (when `ready`); killed and reaped on the way out."""
    script = tmp / name
    script.write_text(source)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=tmp)
    try:
        if ready:
            wait_ready(proc)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def wait_ready(proc: subprocess.Popen[bytes], timeout_s: float = READY_S) -> None:
    """Until `proc` printed its "ready" line; fails (with its stderr) when it ends first or
    `timeout_s` passes."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen = b""
    while b"ready" not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            ended = proc.poll() is not None and proc.stderr is not None
            err = proc.stderr.read() if ended and proc.stderr is not None else b""
            raise AssertionError(f"child {proc.pid} not ready: {seen!r} {err[-2000:]!r}")
        readable, _, _ = select.select([proc.stdout], [], [], min(left, 0.5))
        if readable:
            chunk = os.read(proc.stdout.fileno(), 4096)
            seen += chunk
            if not chunk:
                proc.wait(timeout=5)


def until(check: Callable[[], T], timeout_s: float = 10.0, every_s: float = 0.05) -> T:
    """The first true result of `check()` within `timeout_s`, else its last result."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result or time.monotonic() >= deadline:
            return result
        time.sleep(every_s)
