"""The history's summary checkpoint kept fresh while the hub runs, so that `scalemon summary`
(or `snapshot`) of a long job reads a checkpoint and the tail instead of folding every record
(`scalemon.link.checkpoint`).

After a seal of the history's tail, at most every `EVERY_S`, the hub starts
`python -m scalemon.link.checkpoint HISTORY JOB` as a process of its own, niced: it folds only
the records sealed since the last checkpoint. One runs at a time; the hub's loop never waits.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import time
from pathlib import Path

from .limits import niced

log = logging.getLogger("scalemon.hub")

EVERY_S = 60.0
"""A new checkpoint at most this often (a 512-rank job at a step a second seals about a
chunk a minute; its fold since costs the checkpoint process some 3 s of CPU)."""
NICE = 10


class Checkpoints:
    """Starts the checkpoint process of `history` (job `job`) when the history sealed."""

    def __init__(self, history: Path, job: str, every_s: float = EVERY_S) -> None:
        self.history = history
        self.job = job
        self.every_s = every_s
        self.started = 0
        self._proc: subprocess.Popen | None = None
        self._next = 0.0
        self._started_at = 0.0

    def sealed(self, _upto: int) -> None:
        """The history sealed records below `_upto`: catch the checkpoint up, when due (at
        most half the time: a job whose records come faster than the process folds them,
        some 11,000 a second, gets a checkpoint less often, never a process always busy)."""
        now = time.monotonic()
        if self._proc is not None:
            if self._proc.poll() is None:
                return
            self._next = max(self._next, self._started_at + 2 * (now - self._started_at))
            self._proc = None
        if now < self._next:
            return
        self._next = now + self.every_s
        self._started_at = now
        cmd = niced([sys.executable, "-m", "scalemon.link.checkpoint", str(self.history),
                     self.job], NICE)
        try:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.started += 1
        except OSError as exc:
            log.warning("cannot start the history's checkpoint process: %s", exc)

    def close(self) -> None:
        """End a checkpoint process still running (the next hub or summary catches up)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
