"""Once a second, from a daemon thread: what the training thread is doing, and host/GPU load.

While the rank completes steps, a big job's hub asks for fewer heartbeats (`stepping_s`, from
the answer to the rank's sync: `scalemon.policy.heartbeat_stepping_s`); the steps tell it the
rank lives. A rank that stops stepping, or is found stuck, beats every second again at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from .nvml import GpuReader
from .warn import Warnings


class Phase:
    """What the training thread is doing now; set from hooks, read by the heartbeat."""

    __slots__ = ("name", "since", "step", "cost_s")

    def __init__(self) -> None:
        self.name = "init"
        self.since = time.perf_counter()  # hooks reuse their own perf_counter reading
        self.step: int | None = None
        self.cost_s = 0.0  # time the agent's hooks spent on the training thread, not yet reported

    def set(self, name: str) -> None:
        """Enter phase `name` (cheap: two attribute writes)."""
        if name != self.name:
            self.name, self.since = name, time.perf_counter()


class Heartbeat:
    """Calls `submit("heartbeat", body)` every `interval_s` until stopped."""

    def __init__(
        self,
        phase: Phase,
        gpu: GpuReader,
        submit: Callable[[str, dict[str, Any]], bool],
        counters: Callable[[], dict[str, int]],
        interval_s: float = 1.0,
        warnings: Warnings | None = None,
        chore: Callable[[float], None] | None = None,
        stepping_s: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.phase = phase
        self.warnings = warnings or Warnings()
        self.gpu = gpu
        self.submit = submit
        self.counters = counters
        self.interval_s = interval_s
        self.chore = chore
        """Called after each beat with time.monotonic() (the stack reader kept named)."""
        self.stepping_s = stepping_s
        """The interval while steps flow (None: every `interval_s`)."""
        self._sent_step: int | None = None
        self._sent_at = float("-inf")
        self._forced = False
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # prime: the next call measures from here
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scalemon-heartbeat", daemon=True)
        self._thread.start()

    def beat(self) -> dict[str, Any]:
        """Take one reading and send it."""
        mem = self._proc.memory_info()
        body: dict[str, Any] = {
            "phase": self.phase.name,
            "phase_since_s": time.perf_counter() - self.phase.since,
            "step": self.phase.step,
            "cpu_pct": self._proc.cpu_percent(None),
            "rss_bytes": int(mem.rss),
            **self.gpu.read(),
            **self.counters(),
        }
        self.submit("heartbeat", body)
        self._sent_step, self._sent_at = body["step"], time.monotonic()
        return body

    def due(self, now: float) -> bool:
        """True when a reading should go now: always, unless the rank completed a step since
        the last one and that one is younger than the stepping interval."""
        step = self.phase.step
        every = self.stepping_s()
        if every is None or every <= self.interval_s or step is None or step == self._sent_step:
            return True
        return now - self._sent_at >= every - 0.5 * self.interval_s

    def _beat_safely(self) -> None:
        forced, self._forced = self._forced, False
        try:
            if forced or self._stop.is_set() or self.due(time.monotonic()):
                self.beat()
            if self.chore is not None:
                self.chore(time.monotonic())
        except Exception as exc:  # keep beating; a heartbeat is never worth a crash
            self.warnings.once("heartbeat", "scalemon: a heartbeat failed (%s: %s); the hub "
                               "takes this rank for silent if it goes on", type(exc).__name__,
                               exc)

    def _run(self) -> None:
        while True:
            self._beat_safely()
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return

    def wake(self) -> None:
        """Send a reading now (from any thread), not at the next interval."""
        self._forced = True
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread (returns within one interval), sending a last reading."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=self.interval_s + 1)
        self._beat_safely()
