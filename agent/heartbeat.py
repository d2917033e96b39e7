"""Once a second, from a daemon thread: what the training thread is doing, and host/GPU load.

While the rank completes steps, a big job's hub asks for fewer heartbeats (`stepping_s`, from
the answer to the rank's sync: `scalemon.policy.heartbeat_stepping_s`); the steps tell it the
rank lives. A rank that stops stepping beats every second again once the stepping interval
since its last reading has passed; one found stuck beats at once.

A stuck rank's stack and collectives in flight (`scalemon.metrics.SENT_WHEN_CHANGED`) go out in
its first heartbeat after it becomes stuck and again when they change; the heartbeats between
name them in `same` (protocol 1.14, to a hub that keeps them), so a hung job of thousands of
ranks does not send the hub every stack every second."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import psutil

from scalemon.metrics import SENT_WHEN_CHANGED

from .nvml import GpuReader
from .warn import Warnings

RESEND_S = 60.0
"""The values sent when they change go whole at least this often (a heartbeat lost on the way,
by a relay or a hub that restarted, is made good within this)."""
SAME_SINCE = (1, 14)
"""The hub's protocol version from which it keeps the values a heartbeat names in `same`."""


class HubAnswer(Protocol):
    """What the hub said in its answer to the rank's sync (`transport.Sender`)."""

    hub_version: tuple[int, int] | None


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
        hub: HubAnswer | None = None,
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
        self.hub = hub
        """What the hub answered (the sender): its protocol version, None before."""
        self._values_sent: dict[str, Any] = {}  # SENT_WHEN_CHANGED, as the hub holds them
        self._whole_at = float("-inf")  # when they last went whole
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
        now = time.monotonic()
        values = {n: body[n] for n in SENT_WHEN_CHANGED if body.get(n) is not None}
        whole = not self._leave_out_same(body, values, now)
        if self.submit("heartbeat", body):
            self._values_sent = values
            if whole:
                self._whole_at = now
        else:  # lost: the next one goes whole
            self._values_sent, self._whole_at = {}, float("-inf")
        self._sent_step, self._sent_at = body["step"], now
        return body

    def _leave_out_same(self, body: dict[str, Any], values: dict[str, Any], now: float) -> bool:
        """Take the values that the hub already holds out of `body`, naming them in `same`
        (a hub of 1.14 or later; whole at least every `RESEND_S`); True when any was."""
        version = self.hub.hub_version if self.hub is not None else None
        if version is None or tuple(version) < SAME_SINCE or now - self._whole_at >= RESEND_S:
            return False
        sent = self._values_sent
        same = [n for n, value in values.items() if n in sent and sent[n] == value]
        for name in same:
            del body[name]
        if same:
            body["same"] = same
        return bool(same)

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
