"""When the dashboard redraws (tui/app.py): at most every TICK_S when the data changed, once a
second for the ages, and no more than DRAW_SHARE of the time when a redraw takes long; plots,
when expensive, less often still."""

from __future__ import annotations

from collections import deque

TICK_S = 0.1
AGES_EVERY_S = 1.0
DRAW_SHARE = 0.25
"""Redraws that follow the data take at most this share of the time (a redraw of thousands of
ranks that takes 60 ms comes every 240 ms); keys and scrolling redraw at the next tick."""


class RedrawPacer:
    """What was drawn when, how long redraws took, and so whether the next tick draws."""

    def __init__(self) -> None:
        self.drawn_version = -1
        self.drawn_at = 0.0
        self.plots_version = -1
        self.plots_at = 0.0
        self.plot_interval = TICK_S
        self.draw_interval = TICK_S
        self.drawn_perf = 0.0  # perf_counter() of the last redraw's start
        self.urgent = True  # a redraw asked for (keys, scrolling): not held back
        self.redraw_ms: deque[float] = deque(maxlen=100_000)
        self.plot_redraw_ms: deque[float] = deque(maxlen=100_000)  # those that drew the plots
        self.redraws = 0

    def force(self, plots: bool = True) -> None:
        """Redraw at the next tick even if no data changed."""
        self.drawn_version = -1
        self.urgent = True
        if plots:
            self.plots_version = -1
            self.plots_at = 0.0

    def plan(self, version: int, now: float, start: float) -> tuple[bool, bool]:
        """(draw now, with the plots) for data `version` at clock `now`, perf_counter `start`."""
        changed = version != self.drawn_version
        plots_due = version != self.plots_version and start - self.plots_at >= self.plot_interval
        if not changed and not plots_due and now - self.drawn_at < AGES_EVERY_S:
            return False, False
        if not self.urgent and start - self.drawn_perf < self.draw_interval:
            return False, False  # redrawing takes long (thousands of ranks): <= DRAW_SHARE
        return True, plots_due

    def drew(self, version: int, now: float, start: float, plots: bool) -> None:
        """A redraw of data `version` started (at `now`, perf_counter `start`)."""
        self.drawn_version, self.drawn_at = version, now
        self.drawn_perf, self.urgent = start, False
        if plots:
            self.plots_version, self.plots_at = version, start
        self.redraws += 1

    def redrawn(self, elapsed: float, plots: bool) -> None:
        """A redraw took `elapsed` seconds, until the screen was refreshed."""
        self.redraw_ms.append(elapsed * 1000.0)
        if plots:
            self.plot_redraw_ms.append(elapsed * 1000.0)
        self.draw_interval = min(1.0, max(TICK_S, elapsed / DRAW_SHARE))
        if plots:
            # expensive plots (many ranks, big terminal) are redrawn less often: <= ~25% CPU
            self.plot_interval = min(1.0, max(TICK_S, 4 * elapsed))
