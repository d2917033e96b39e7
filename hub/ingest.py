"""What the hub takes in: ranks' and relays' frames checked, numbered, written into the history
and the feed, and its own records; a mixin of `Hub` (hub/server.py), which owns the state."""

from __future__ import annotations

import logging
import time
from array import array
from typing import Any

import zmq

import scalemon
from scalemon import protocol
from scalemon.home.history import History
from scalemon.protocol import (
    HUB_RANK,
    RANK_RECORDS_KEPT,
    SOCKET_ROLES,
    ProtocolError,
    VersionMismatch,
    version_text,
)
from scalemon.state.fold import JobFold
from scalemon.state.jobstate import JobState

from .access import Peer, PeerBook, refusal, tcp_peer
from .audit import Audit
from .auth import KeyGate
from .limits import RejectBook, check_name, clip
from .liveness import Liveness
from .sockets import FanOut

log = logging.getLogger("scalemon.hub")

INGEST_BATCH = 1000  # frames per turn, so requests (syncs, pings) wait at most ~30 ms
MAX_RECORD_STRING = 4096
"""A hub record over the message limit has its strings cut to this many characters."""
HELLO_NAMES = ("host", "agent_version", "torch_version", "device", "backend")
"""A rank's hello strings, each at most MAX_NAME_CHARS long (the state lists them per rank)."""
OWNER_IPC = b""
"""The 'key' of a rank whose hello came over the owner's ipc socket."""
MAX_RANK_KEYS = 1 << 20
"""Ranks whose key the hub remembers (a rank's messages must come with its hello's key)."""


class HubIngest:
    """The hub's intake: `_ingest` a socket's frames, `_record` the hub's own messages."""

    job: str
    history: History
    fold: JobFold
    state: JobState
    liveness: Liveness
    audit: Audit
    peers: PeerBook | None
    rejects: RejectBook
    received: int
    rejected: int
    _topic: bytes
    _gate: KeyGate | None
    _tcp_ports: dict[zmq.Socket, int]
    _rank_keys: dict[int, bytes]
    _rank_records: dict[int, array]
    _ranks_trimmed: set[int]
    _versions_refused: set[tuple[int, int]]
    _own_seq: int

    def _ingest(self, ingest: zmq.Socket, feed: FanOut) -> None:
        """Take what arrived: ranks send one frame per message, a node's relay a batch of them
        as one multipart message."""
        accepted: list[bytes] = []
        first_seq = len(self.history)
        now = time.monotonic()
        taken = 0
        port = self._tcp_ports.get(ingest)
        while taken < INGEST_BATCH:
            sender = None
            try:
                if port is None:  # ipc: the owner's ranks (0700 directory)
                    frames = ingest.recv_multipart(zmq.NOBLOCK, copy=True)
                else:
                    frames, sender = self._admitted_frames(
                        ingest.recv_multipart(zmq.NOBLOCK, copy=False), port)
            except zmq.Again:
                break
            taken += max(1, len(frames))
            for frame in frames:
                self.received += 1
                try:
                    msg = self._accept(frame)
                    if sender is not None:
                        self._check_sender(msg, sender)
                    elif msg.type == "hello" and len(self._rank_keys) < MAX_RANK_KEYS:
                        self._rank_keys[msg.rank] = OWNER_IPC
                except ProtocolError as exc:
                    self._reject(exc, len(frame))
                    continue
                seq = self.history.append(frame)
                accepted.append(frame)
                self.liveness.heard(msg.rank, now)
                self._apply(seq, msg)
                if msg.type == "hello":
                    self.liveness.note_pid(self.state.ranks.get(msg.rank))
        if accepted:
            self.history.flush()  # published only once written: a hub crash cannot unsay it
            feed.send_multipart([self._topic, protocol.pack_seq(first_seq), *accepted])

    def _admitted_frames(self, frames: list[zmq.Frame],
                         port: int) -> tuple[list[bytes], Peer | None]:
        """The frames of one message from a tcp rank or relay, and who sent it, if its key may
        still send (else none: it is refused, audited, and its connection cut)."""
        peer = self._tcp_peer(frames[0])
        if peer.role in SOCKET_ROLES["ingest"]:
            self.peers.learn(peer, port)
            return [f.bytes for f in frames], peer
        self.received += len(frames)
        self.rejected += len(frames)
        self.rejects.add(ProtocolError(refusal(peer, "ingest")), sum(len(f) for f in frames))
        self._refused(peer, "ingest", f"{len(frames)} message(s) refused: the key may not "
                                      "send (removed or another role)")
        self.peers.cut_one(peer, port)
        return [], None

    def _check_sender(self, msg: protocol.Message, sender: Peer) -> None:
        """A rank speaks with the key its hello came with (over tcp): another admitted key
        cannot answer toggles or send steps in its name. A new hello takes the rank over only
        once it is not running (a restart) or from the same key. Raises ProtocolError."""
        bound = self._rank_keys.get(msg.rank)
        if bound == sender.key:
            return
        view = self.state.ranks.get(msg.rank)
        if msg.type == "hello" and (bound is None or view is None or view.state != "running"):
            if len(self._rank_keys) >= MAX_RANK_KEYS and msg.rank not in self._rank_keys:
                raise ProtocolError(f"hello for rank {msg.rank} from key {sender.user}: over "
                                    f"the hub's limit of {MAX_RANK_KEYS} ranks")
            self._rank_keys[msg.rank] = sender.key
            return
        if bound is None:  # its hello came before this hub started: the first key holds it
            if len(self._rank_keys) < MAX_RANK_KEYS:
                self._rank_keys[msg.rank] = sender.key
            return
        owner = "the owner's ipc socket" if bound == OWNER_IPC else next(
            (k.name for k in (self._gate.keys.values() if self._gate else ()) if k.key == bound),
            "a key no longer admitted")
        raise ProtocolError(f"{msg.type} for rank {msg.rank} from key {sender.user}, not from "
                            f"{owner} that its hello came with")

    def _refused(self, peer: Peer, kind: str, text: str, **extra: Any) -> None:
        """Put a refusal of `peer` into the audit (limited per asker and kind)."""
        self.audit.refusal(peer.asker, kind, {
            **self._who(peer), "text": clip(text, 1000), **extra})

    def _tcp_peer(self, frame: zmq.Frame) -> Peer:
        """Who sent `frame` over a tcp socket, with the key's role as admitted now."""
        return tcp_peer(frame, self._gate.keys if self._gate else {})

    @staticmethod
    def _who(peer: Peer) -> dict[str, Any]:
        """The audit's fields naming `peer`."""
        return {"user": peer.user, "client_host": peer.host, "role": peer.role,
                "via": peer.via}

    def _note_subscribers(self, feed: zmq.Socket) -> None:
        """Read a tcp feed's (un)subscriptions: each tells which key the subscriber is."""
        port = self._tcp_ports[feed]
        for _ in range(1000):
            try:
                frame = feed.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            peer = self._tcp_peer(frame)
            if peer.role in SOCKET_ROLES["feed"]:
                self.peers.learn(peer, port)
            else:
                self._refused(peer, "feed", "follows the feed without a key that may")
                self.peers.cut_one(peer, port)

    def _accept(self, frame: bytes, hub_records: bool = False) -> protocol.Message:
        """Decode a rank's frame (or, replaying the history, any record) and check it
        belongs here; raises ProtocolError."""
        try:
            msg = protocol.decode(frame)
        except ProtocolError:
            raise
        except Exception as exc:  # decode should raise nothing else; never crash on input
            raise ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from None
        if msg.job != self.job:
            raise ProtocolError(f"message for job {msg.job!r} sent to hub of {self.job!r}")
        if msg.rank == HUB_RANK:
            if hub_records:
                return msg
            raise ProtocolError(f"rank {HUB_RANK} is reserved for the hub's own records")
        if msg.type == "hello":
            for name in HELLO_NAMES:
                if type(value := msg.body.get(name)) is str:
                    check_name(f"hello.{name}", value)
        world = self.state.world_size
        if world is not None and msg.rank >= world and msg.type != "hello":
            raise ProtocolError(f"rank {msg.rank} is outside world size {world}")
        return msg

    def _apply(self, seq: int, msg: protocol.Message) -> None:
        """Fold record `seq` into the state, and note it among its rank's records."""
        if msg.rank >= 0:
            seqs = self._rank_records.get(msg.rank)
            if seqs is None:
                seqs = self._rank_records[msg.rank] = array("q")
            seqs.append(seq)
            if len(seqs) >= 2 * RANK_RECORDS_KEPT:
                del seqs[:len(seqs) - RANK_RECORDS_KEPT]
                self._ranks_trimmed.add(msg.rank)
        try:
            self.fold.apply(seq, msg)
        except Exception:  # a bug in the reducer must not take the hub down
            log.exception("could not fold %s message of rank %d into the state", msg.type,
                          msg.rank)

    def _reject(self, exc: ProtocolError, size: int) -> None:
        self.rejected += 1
        self.rejects.add(exc, size)
        if isinstance(exc, VersionMismatch):  # said once per version, not once per frame
            if exc.theirs not in self._versions_refused:
                self._versions_refused.add(exc.theirs)
                log.warning(
                    "refusing every frame of protocol version %s: this hub (scalemon %s) speaks "
                    "%s. A rank or a dashboard runs another scalemon major version; install "
                    "the same one everywhere", version_text(exc.theirs), scalemon.__version__,
                    version_text(exc.ours))
            return
        if self.rejected <= 20 or self.rejected % 1000 == 0:
            log.warning("rejected frame #%d (%d bytes): %s", self.rejected, size,
                        clip(str(exc), 500))

    def _record(self, feed: FanOut, mtype: str, body: dict[str, Any]) -> int | None:
        """Write a hub-originated message into the history and the feed; returns its record
        number. A record over the message limit has its long strings cut; one still over it is
        logged, not written (None): the hub never writes what it would refuse, and never stops
        over it."""
        self._own_seq += 1
        frame = protocol.encode(mtype, self.job, HUB_RANK, self._own_seq, body)
        if len(frame) > protocol.MAX_MESSAGE_BYTES:
            frame = protocol.encode(mtype, self.job, HUB_RANK, self._own_seq,
                                    _cut_strings(body, MAX_RECORD_STRING))
        if len(frame) > protocol.MAX_MESSAGE_BYTES:
            log.error("not writing a %s record of %d bytes (over the %d limit)", mtype,
                      len(frame), protocol.MAX_MESSAGE_BYTES)
            return None
        seq = self.history.append(frame)
        self._apply(seq, protocol.decode(frame))
        self.history.flush()
        feed.send_multipart([self._topic, protocol.pack_seq(seq), frame])
        return seq


def _cut_strings(value: Any, limit: int) -> Any:
    """`value` with every string longer than `limit` characters cut to it."""
    if isinstance(value, str):
        return clip(value, limit)
    if isinstance(value, dict):
        return {k: _cut_strings(v, limit) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cut_strings(v, limit) for v in value]
    return value

