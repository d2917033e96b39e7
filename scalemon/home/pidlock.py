"""One process per directory: an exclusive `flock` on a lock file, held for the process's life,
with the holder's pid written into it for people (`cat hub.lock`). The hub takes `hub.lock` in
its run directory, a node's relay `relay.lock` in its relay directory; the agent asks
`is_locked` before starting either.

The lock is the kernel's: it goes with the process, however it ends (no stale lock file to
clean up), and the pid in the file is only ever read to name the holder in an error.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path
from typing import TextIO


def take_lock(path: Path, already_running: Callable[[str], Exception],
              on_write_error: Callable[[OSError], None] | None = None) -> TextIO:
    """Lock `path` (created if missing) for this process; returns the open file, which holds
    the lock until it is closed. Raises `already_running(pid)` (the holder's pid as written in
    the file, "?" if none) when another process holds it. The pid is for people: a failure to
    write it (a full disk) goes to `on_write_error`, else is ignored, and never stops the
    taker."""
    f = open(path, "a+")  # noqa: SIM115 - held for the life of the process
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise already_running(holder) from None
    f.truncate(0)
    try:
        f.write(str(os.getpid()))
        f.flush()
    except OSError as exc:
        if on_write_error is not None:
            on_write_error(exc)
    return f


def is_locked(path: Path) -> bool:
    """True when a process holds the lock on `path` (False when the file does not exist)."""
    if not path.exists():
        return False
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False
