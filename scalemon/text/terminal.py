"""Whether this process talks to a terminal: a dashboard needs one on stdin (keys) and stderr
(the screen: Textual's LinuxDriver reads ``sys.__stdin__`` and draws to ``sys.__stderr__``, so
stdout may go to a file or a pipe); drawn into a file or a pipe, it only spins (issue #38)."""

from __future__ import annotations

import os
import sys


def not_a_terminal() -> str | None:
    """Which of the streams the dashboard uses is not a terminal ("stdin", "stderr", "stdin and
    stderr"), None when both are (a closed or missing stream counts as none). The process's
    own streams are looked at, as the driver does, not what `sys.stdin` is replaced by."""
    missing = []
    for name, stream in (("stdin", sys.__stdin__), ("stderr", sys.__stderr__)):
        try:
            ok = stream is not None and os.isatty(stream.fileno())
        except (OSError, ValueError):  # closed, or no file descriptor (a test's StringIO)
            ok = False
        if not ok:
            missing.append(name)
    return " and ".join(missing) or None


def in_background() -> bool:
    """Whether this process runs in the background of its terminal: stdin is its controlling
    terminal, whose foreground process group is another (`timeout` without `--foreground`,
    `cmd &`). A dashboard there is stopped (SIGTTOU, SIGTTIN) as soon as it sets the terminal
    up, and stays stopped, its screen blank. False where stdin is no terminal, or not this
    process's controlling one."""
    try:
        fd = sys.__stdin__.fileno()  # type: ignore[union-attr]
        return os.isatty(fd) and os.tcgetpgrp(fd) != os.getpgrp()
    except (AttributeError, OSError, ValueError):  # none, closed, not the controlling tty
        return False
