"""Whether this process talks to a terminal: a dashboard needs one on stdin (keys) and stdout
(the screen); drawn into a file or a pipe, it only spins (issue #38)."""

from __future__ import annotations

import os
import sys


def not_a_terminal() -> str | None:
    """Which of stdin and stdout is not a terminal ("stdin", "stdout", "stdin and stdout"),
    None when both are (a closed stream counts as none)."""
    missing = []
    for name, stream in (("stdin", sys.stdin), ("stdout", sys.stdout)):
        try:
            ok = stream is not None and os.isatty(stream.fileno())
        except (OSError, ValueError):  # closed, or no file descriptor (a test's StringIO)
            ok = False
        if not ok:
            missing.append(name)
    return " and ".join(missing) or None
