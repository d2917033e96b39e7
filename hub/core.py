"""What the hub's intake (`ingest.py`) and its request handling (`rpc.py`) share: the job's
history and its fold, each rank's record numbers, the books of relays and live connections,
the audit, and the feed. `Hub` (hub/server.py) makes one and hands it to both."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from scalemon.home.history import History
from scalemon.state.fold import JobFold
from scalemon.state.jobstate import JobState

from .access import Peer, PeerBook, tcp_peer
from .audit import Audit
from .auth import KeyGate
from .limits import clip
from .liveness import Liveness
from .looks import Looks
from .relay_book import RelayBook
from .sockets import FanOut


@dataclass(eq=False)
class HubCore:
    """One job's records and the books about them, shared by the intake and the requests."""

    job: str
    run_dir: Path
    host: str
    """This hub's host (an ipc peer's host)."""
    history: History
    fold: JobFold
    """The fold of the history, kept as records come: its `state` is the hub's state, and a
    late dashboard starts from it (`seed`) instead of replaying the history."""
    liveness: Liveness
    audit: Audit
    relays: RelayBook
    looks: Looks
    """Looks at ranks' processes from outside (stacks), under way and done."""
    topic: bytes
    """The feed's topic: the history's identity."""
    rank_records: dict[int, array] = field(default_factory=dict)
    """Each rank's latest record numbers (`rank_records` requests)."""
    ranks_trimmed: set[int] = field(default_factory=set)
    """Ranks whose first records left `rank_records`."""
    tcp_ports: dict[zmq.Socket, int] = field(default_factory=dict)
    """Each tcp socket -> the port it is bound at (an ipc socket is not in it)."""
    gate: KeyGate | None = None
    """The Curve keys admitted, while serving tcp."""
    peers: PeerBook | None = None
    """Which key each tcp connection is, while serving."""
    feed: FanOut | None = None
    """Where records are published, while serving."""
    digest_wanted_until: float = 0.0
    """Until when (monotonic) a dashboard follows a big job's digest (a `seed` or `digest`
    request: DIGEST_WANTED_S from it): no digest is built for nobody."""

    @property
    def state(self) -> JobState:
        """The job's state: the fold's."""
        return self.fold.state

    def tcp_peer(self, frame: zmq.Frame) -> Peer:
        """Who sent `frame` over a tcp socket, with the key's role as admitted now."""
        return tcp_peer(frame, self.gate.keys if self.gate else {})

    def refused(self, peer: Peer, kind: str, text: str, **extra: Any) -> None:
        """Put a refusal of `peer` into the audit (limited per asker and kind)."""
        self.audit.refusal(peer.asker, kind, {**peer.who(), "text": clip(text, 1000), **extra})
