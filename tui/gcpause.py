"""Keep the garbage collector's full collections out of the redraws of big jobs.

The dashboard of a 4096-rank job holds about half a million long-lived objects the collector
tracks (a `Series` and its arrays per rank and metric). A full (generation 2) collection walks
them all, about 130 ms on a slow machine, and it runs in whichever thread allocates at the
time, often the UI thread in the middle of a redraw. Once a full collection took longer than
`SLOW_S`, what survived it is long-lived: `FreezeSurvivors.tick` moves it to the permanent
generation (`gc.freeze`), so later collections walk only what is newer. It is thawed every
`THAW_S` (one full collection then: garbage cycles among frozen objects, such as a state
replaced after a hub restart, are freed) and when the app stops. A big job's seed is frozen
as soon as it is loaded (`freeze_loaded`). Small jobs never freeze.
No textual import.
"""

from __future__ import annotations

import gc
import time
from typing import Any

SLOW_S = 0.020
"""A full collection this long makes the survivors worth freezing."""
THAW_S = 300.0
"""Frozen objects go back to the collector this often."""


def freeze_loaded() -> None:
    """Freeze what a big seed just made (call right after loading it, on the thread that
    loaded it): it was made with the collector off (`scalemon.link.seed`), so it all sits in
    the youngest generation, and the next collections of each generation would walk it
    (100-150 ms each at 16,384 ranks), in whichever thread allocates then, often the UI's in
    the middle of a redraw. `FreezeSurvivors.tick` thaws it with its own freezes."""
    gc.freeze()


class FreezeSurvivors:
    """Watches full collections (`gc.callbacks`) and freezes their survivors when they were
    slow; call `tick` between redraws, `close` when done."""

    def __init__(self) -> None:
        self.slow = False  # a slow full collection ended since the last tick
        self.frozen_at: float | None = None
        self.freezes = 0
        self._started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """Time full collections (runs in the thread that triggered the collection)."""
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif time.perf_counter() - self._started > SLOW_S:
            self.slow = True

    def tick(self, now: float | None = None) -> None:
        """Freeze after a slow full collection; thaw what froze `THAW_S` ago."""
        now = time.monotonic() if now is None else now
        if self.slow:
            self.slow = False
            gc.freeze()
            self.frozen_at = now
            self.freezes += 1
        elif self.frozen_at is None and gc.get_freeze_count():
            self.frozen_at = now  # frozen by `freeze_loaded`: thawed in turn
        elif self.frozen_at is not None and now - self.frozen_at > THAW_S:
            gc.unfreeze()
            self.frozen_at = None

    def close(self) -> None:
        """Stop watching and give the frozen objects back to the collector."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self.frozen_at is not None:
            gc.unfreeze()
            self.frozen_at = None
