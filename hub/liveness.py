"""Rank liveness: which running ranks went silent or lost their process, and when a job whose
ranks all stopped counts as abandoned. The hub records what this finds (hub/server.py)."""

from __future__ import annotations

import time

from scalemon.home.jobfile import pid_alive
from scalemon.state.jobstate import JobState, RankView

from .relay_book import RelayBook

RELAY_SILENT_S = 3.0
"""A lost rank's reason names its node's relay once that has not reported for this long."""


class Liveness:
    """When each rank last spoke, and which of this host's rank processes were seen alive."""

    def __init__(self, lost_after_s: float, linger_s: float, host: str) -> None:
        self.lost_after_s = lost_after_s
        self.linger_s = linger_s
        self.host = host
        self.last_recv: dict[int, float] = {}
        self.last_any_recv = time.monotonic()
        self._seen_alive: set[int] = set()

    def heard(self, rank: int, now: float) -> None:
        """Rank `rank` sent a message at `now` (monotonic)."""
        self.last_recv[rank] = self.last_any_recv = now

    def note_pid(self, view: RankView | None) -> None:
        """Look at a rank's pid as its hello arrives, so a rank killed before the next
        housekeeping round is still known to have been alive here."""
        if view is not None and (pid := self.local_pid(view)):
            self.process_gone(pid)

    def local_pid(self, view: RankView) -> int | None:
        """The rank's pid when it runs on this hub's host, else None."""
        return view.pid if view.host == self.host and view.pid else None

    def process_gone(self, pid: int) -> bool:
        """True when a rank's process, once seen alive here, is gone. A pid never seen alive
        proves nothing: the rank may run in another PID namespace under the same host name."""
        if pid_alive(pid):
            self._seen_alive.add(pid)
            return False
        return pid in self._seen_alive

    def lost(self, state: JobState, relays: RelayBook, now: float) -> list[tuple[int, str]]:
        """The running ranks to mark lost now, each with the reason."""
        found = []
        for rank, view in list(state.ranks.items()):
            if view.state != "running":
                continue
            silent = now - self.last_recv.get(rank, now)
            if silent > self.lost_after_s:
                reason = f"no message for {silent:.1f} s"
                relay_silent = relays.silent_for(view.host, now)
                if relay_silent is not None and relay_silent > RELAY_SILENT_S:
                    reason += (f" (its node's relay has not reported for {relay_silent:.1f} s: "
                               "see relay.log on that node)")
            elif (pid := self.local_pid(view)) and self.process_gone(pid):
                reason = f"process {pid} is gone without reporting an exit (killed?)"
            else:
                continue
            found.append((rank, reason))
        return found

    def lifecycle_state(self, state: JobState, now: float) -> str:
        """The job state, plus `abandoned`: every rank seen has stopped or is lost and none
        spoke for `linger_s`, though fewer than world_size ever reported (ranks elsewhere)."""
        job_state = state.state
        views = state.ranks.values()
        if (job_state in ("running", "degraded", "stopping") and views
                and all(v.state != "running" for v in views)
                and now - self.last_any_recv >= self.linger_s):
            return "abandoned"
        return job_state
