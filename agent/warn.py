"""The agent's warnings: each kind of problem is said once per run, at WARNING, with its
reason, and then kept quiet, so a monitor problem is seen without flooding the training log."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("scalemon.agent")


class Warnings:
    """The warnings of one run; shared by its sender, hooks, heartbeat and NVML reader."""

    def __init__(self) -> None:
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def once(self, key: str, message: str, *args: object) -> bool:
        """Log `message % args` as a warning the first time `key` comes; True when it was
        logged. Safe from any thread."""
        with self._lock:
            if key in self._said:
                return False
            self._said.add(key)
        log.warning(message, *args)
        return True

    def said(self, key: str) -> bool:
        """True when `key` was warned about."""
        with self._lock:
            return key in self._said
