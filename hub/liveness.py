"""Rank liveness told truthfully: a running rank that stopped sending is `frozen` (its process
exists; its stacks, read from outside, say where), `gone` (its process ended without reporting
an exit), `unreachable` (its node's relay is silent too) or `silent` (nothing on its node can
look at its process); never one word for all four. Also when a job whose ranks all stopped
counts as abandoned. The hub records what this finds (hub/server.py)."""

from __future__ import annotations

import math
import time
from typing import Any

from scalemon.home.jobfile import pid_alive
from scalemon.proc.facts import process_facts
from scalemon.state.jobstate import JobState, RankView

from .looks import Looks
from .relay_book import RelayBook

RELAY_SILENT_S = 6.0
"""A silent rank is `unreachable` once its node's relay has not reported for this long (a
relay reports every 2 s and sends an unanswered report again after 5 s)."""
SCAN_RANKS_PER_S = 4096
"""A look at every rank (liveness, the job's lifecycle, the alerts) costs microseconds a rank:
a job of more ranks than this is looked at less often than every housekeeping turn, once per
`scan_every_s(ranks)` (4 s at 16,384 ranks; a rank is named silent after `lost_after_s`, 10 s
or more)."""


def scan_every_s(ranks: int) -> float:
    """How often a look at every one of `ranks` ranks is due, at most (0: every turn)."""
    return ranks / SCAN_RANKS_PER_S
LOOK_AGAIN_S = 15.0
"""A rank on another node that is frozen, unreachable or silent is looked at again this
often while its node's relay reports: it may have ended, or its relay be back."""


class Liveness:
    """When each rank last spoke, which of this host's rank processes were seen alive, and
    which silent ranks' processes are being looked at."""

    def __init__(self, lost_after_s: float, linger_s: float, host: str) -> None:
        self.lost_after_s = lost_after_s
        self.linger_s = linger_s
        self.host = host
        self.last_recv: dict[int, float] = {}
        self.last_any_recv = time.monotonic()
        self._seen_alive: set[int] = set()
        self._looking: dict[int, float] = {}  # silent ranks whose look is under way -> silent s
        self._looked: dict[int, float] = {}  # remote ranks -> when a look was last asked
        self.errors_said: set[str] = set()
        self._next_scan = 0.0
        self._lifecycle: tuple[float, str] | None = None  # (until, the job's state)

    def heard(self, rank: int, now: float) -> None:
        """Rank `rank` sent a message at `now` (monotonic)."""
        self.last_recv[rank] = self.last_any_recv = now
        self._looking.pop(rank, None)
        self._looked.pop(rank, None)

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

    def check(self, state: JobState, relays: RelayBook, looks: Looks,
              now: float) -> list[dict[str, Any]]:
        """The `rank_state` bodies to record now: running ranks silent for `lost_after_s`
        (their looks asked for), frozen ranks whose process ended since. A big job's ranks
        are scanned at most every `scan_every_s(len(ranks))` seconds."""
        if now < self._next_scan:
            return []
        self._next_scan = now + scan_every_s(len(state.ranks))
        found = []
        for rank, view in list(state.ranks.items()):
            silent = now - self.last_recv.get(rank, now)
            pid = self.local_pid(view)
            if view.state == "frozen" and pid:
                if self.process_gone(pid):
                    found.append(_gone(rank, pid, "after it froze"))
                continue
            if view.state in ("frozen", "unreachable", "silent") and not pid:
                if body := self._review(rank, view, silent, relays, looks, now):
                    found.append(body)
                continue
            if view.state != "running":
                continue
            if rank in self._looking:  # its node's relay looks; unless it fell silent too
                if not pid and (body := self._unreachable(rank, view, silent, relays, now)):
                    del self._looking[rank]
                    found.append(body)
                continue
            if silent <= self.lost_after_s:
                if pid and self.process_gone(pid):  # killed between two messages
                    found.append(_gone(rank, pid))
                continue
            body = self._silent(rank, view, silent, relays, looks, now)
            if body is not None:
                found.append(body)
        return found

    def _silent(self, rank: int, view: RankView, silent: float, relays: RelayBook,
                looks: Looks, now: float) -> dict[str, Any] | None:
        """What to say of a running rank silent for `silent` s: gone or frozen at once on
        this host, unreachable or silent for a node that cannot look; None while a relay
        looks (the look's answer decides: `on_look`)."""
        quiet = f"no message for {silent:.1f} s"
        pid = self.local_pid(view)
        if pid:
            if self.process_gone(pid):
                return _gone(rank, pid)
            if pid not in self._seen_alive:
                return {"target": rank, "state": "silent",
                        "reason": f"{quiet}; process {pid} is not visible from the hub on "
                                  f"{self.host} (a container's own process ids?)"}
            facts = process_facts(pid)
            self._looking[rank] = silent
            looks.ask(rank, pid, view.host, now)
            return {"target": rank, "state": "frozen", "process": facts.to_wire(),
                    "reason": f"{quiet}; process {pid} is alive ({facts.state_word}): "
                              "reading its stacks"}
        if body := self._unreachable(rank, view, silent, relays, now):
            return body
        why = looks.ask(rank, view.pid, view.host, now)
        if why is not None:
            return {"target": rank, "state": "silent",
                    "reason": f"{quiet}; its process cannot be looked at: {why}"}
        self._looking[rank] = silent
        self._looked[rank] = now
        return None

    def _review(self, rank: int, view: RankView, silent: float, relays: RelayBook,
                looks: Looks, now: float) -> dict[str, Any] | None:
        """A remote rank already said frozen, unreachable or silent: `unreachable` once its
        relay falls silent; while the relay reports, looked at again every `LOOK_AGAIN_S`
        (the look's answer decides: `on_look`)."""
        if rank in self._looking:
            if view.state != "unreachable" and (
                    body := self._unreachable(rank, view, silent, relays, now)):
                del self._looking[rank]
                return body
            return None
        relay_silent = relays.silent_for(view.host, now)
        if relay_silent is None:
            return None
        if relay_silent > RELAY_SILENT_S:
            if view.state != "unreachable":
                return self._unreachable(rank, view, silent, relays, now)
            return None
        if now - self._looked.get(rank, -math.inf) >= LOOK_AGAIN_S:
            self._looked[rank] = now
            if looks.ask(rank, view.pid, view.host, now) is None:
                self._looking[rank] = silent
        return None

    @staticmethod
    def _unreachable(rank: int, view: RankView, silent: float, relays: RelayBook,
                     now: float) -> dict[str, Any] | None:
        """`unreachable` when the rank's node's relay has been silent for `RELAY_SILENT_S`."""
        relay_silent = relays.silent_for(view.host, now)
        if relay_silent is None or relay_silent <= RELAY_SILENT_S:
            return None
        return {"target": rank, "state": "unreachable",
                "reason": f"no message for {silent:.1f} s, and its node's relay ({view.host}) "
                          f"has not reported for {relay_silent:.1f} s: see relay.log on that "
                          "node"}

    def on_look(self, state: JobState, look: dict[str, Any]) -> dict[str, Any] | None:
        """The `rank_state` body a finished look at a silent rank calls for (frozen with
        where it is stuck, or gone), None for a look at a rank that spoke again (or that
        `scalemon stacks` asked for)."""
        rank = look["rank"]
        silent = self._looking.pop(rank, None)
        view = state.ranks.get(rank)
        if silent is None or view is None or view.state not in (
                "running", "frozen", "unreachable", "silent"):
            return None
        silent = max(silent, time.monotonic() - self.last_recv.get(rank, time.monotonic()))
        process, pid = look.get("process"), look.get("pid") or view.pid
        if look.get("error"):
            if view.state in ("frozen", "silent"):
                return None  # what was said stands; looked at again later
            return {"target": rank, "state": "silent",
                    "reason": f"no message for {silent:.1f} s; {look['error']}"}
        if isinstance(process, dict) and (process.get("exists") is False
                                          or process.get("state") == "Z"):
            return {**_gone(rank, pid or 0), "process": process}
        if view.state == "frozen" and view.where and not look.get("where"):
            return None  # still there; the stacks read before say where
        where = f"frozen {look['where']}" if look.get("where") else None
        stacks = look.get("reading") or {}
        how = (process or {}).get("state_word") or "alive"
        cpu = {True: ", CPU time moving", False: ", CPU time not moving"}.get(
            (process or {}).get("cpu_moving"), "")
        reason = f"no message for {silent:.1f} s; process {pid} is alive ({how}{cpu})"
        if not where:
            error = stacks.get("error") if isinstance(stacks, dict) else None
            reason += f"; its stacks could not be read: {error}" if error else ""
        return {"target": rank, "state": "frozen", "reason": reason, "process": process,
                "where": where}

    def lifecycle_state(self, state: JobState, now: float) -> str:
        """The job state, plus `abandoned`: no rank runs (each ended, or is frozen) and none
        spoke for `linger_s`: ranks that never reported (elsewhere), a launcher's restart
        that never came, ranks frozen for good (their stacks are in the history). A big
        job's state is looked at once per `scan_every_s(len(ranks))` seconds."""
        cached = self._lifecycle
        if cached is not None and now < cached[0]:
            return cached[1]
        job_state = self._lifecycle_now(state, now)
        self._lifecycle = (now + scan_every_s(len(state.ranks)), job_state)
        return job_state

    def _lifecycle_now(self, state: JobState, now: float) -> str:
        job_state = state.state
        views = state.ranks.values()
        if (job_state in ("running", "degraded", "stopping", "restarting") and views
                and all(v.state != "running" for v in views)
                and now - self.last_any_recv >= self.linger_s):
            return "abandoned"  # frozen ranks too: nothing moved for linger_s
        return job_state


def _gone(rank: int, pid: int, when: str = "") -> dict[str, Any]:
    after = f" {when}" if when else ""
    return {"target": rank, "state": "gone",
            "reason": f"process {pid} ended{after} without reporting an exit (killed?)"}
