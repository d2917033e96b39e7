"""The hub's log lines for ranks' state changes (silent, unreachable, gone, frozen): each one
while few come, and a count per state once many do (a node lost, a network blip, a hub behind
at 16,384 ranks: one line per rank wrote 165,000 lines in a minute). Every change is still a
`rank_state` record in the job's history; the log only says less of them."""

from __future__ import annotations

import logging
from typing import Any

from scalemon.text.ranks import ranks_text

log = logging.getLogger("scalemon.hub")

EACH_PER_WINDOW = 16
"""Changes logged one line each per window; the rest are counted."""
WINDOW_S = 10.0
"""How long a window lasts: its counted changes are logged when it ends."""
RANKS_LISTED = 8
"""Parts of a counted line's rank list ("0-7,9" is two) before "(+N more)"."""


class RankStateLog:
    """`say` each state change as it is recorded; `tick` at each housekeeping pass writes the
    counts of a window that ended."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._said = 0
        self._held: dict[str, list[int]] = {}

    def say(self, body: dict[str, Any], now: float) -> None:
        """A rank's `rank_state` record body ({"target", "state", "reason"})."""
        self.tick(now)
        if self._start is None:
            self._start, self._said = now, 0
        if self._said < EACH_PER_WINDOW:
            self._said += 1
            log.warning("rank %d %s: %s", body["target"], body["state"], body["reason"])
        else:
            self._held.setdefault(str(body["state"]), []).append(int(body["target"]))

    def tick(self, now: float) -> None:
        """End the window if it is over: one line per state counted in it."""
        if self._start is None or now - self._start < WINDOW_S:
            return
        for state, ranks in sorted(self._held.items()):
            log.warning("%d more ranks %s in %.0f s (%s); each is a rank_state record in the "
                        "job's history, and `scalemon snapshot` lists every rank's state",
                        len(ranks), state, now - self._start, ranks_text(ranks, RANKS_LISTED))
        self._start, self._said, self._held = None, 0, {}
