"""What the hub takes in: ranks' and relays' frames checked, numbered, written into the history
and the feed, and its own records (`Intake`, owned by `Hub` in hub/server.py; what it shares
with the requests is the `HubCore` of hub/core.py)."""

from __future__ import annotations

import logging
import time
from array import array
from typing import Any

import zmq

import scalemon
from scalemon import protocol
from scalemon.messages import DIGESTED_TYPES
from scalemon.protocol import (
    HUB_RANK,
    RANK_RECORDS_KEPT,
    SOCKET_ROLES,
    ProtocolError,
    VersionMismatch,
    version_text,
)

from .access import Peer, refusal
from .core import HubCore
from .digest import RankDigest
from .limits import RejectBook, check_name, clip
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


class Intake:
    """The hub's intake: `take` a socket's frames, `record` the hub's own messages; counts what
    it received and rejected (the requests' bad frames too, through `reject`)."""

    def __init__(self, core: HubCore) -> None:
        self.core = core
        self.received = 0
        self.rejected = 0
        self.rejects = RejectBook()  # counted by our reason classes, never the sender's text
        self._rank_keys: dict[int, bytes] = {}  # the key each rank's hello came with
        self._versions_refused: set[tuple[int, int]] = set()
        self._own_seq = 0
        self.digest = RankDigest(core)  # a big job's feed for dashboards (hub/digest.py)

    def take(self, ingest: zmq.Socket, feed: FanOut) -> None:
        """Take what arrived: ranks send one frame per message, a node's relay a batch of them
        as one multipart message."""
        core = self.core
        accepted: list[bytes] = []
        first_seq = len(core.history)
        now = time.monotonic()
        taken = 0
        port = core.tcp_ports.get(ingest)
        few: list[tuple[int, bytes]] = []  # neither steps nor heartbeats (a big job's)
        while taken < INGEST_BATCH:
            sender = None
            try:
                if port is None:  # ipc: the owner's ranks (0700 directory)
                    frames = ingest.recv_multipart(zmq.NOBLOCK, copy=True)
                else:
                    frames, sender = self._admitted_frames(ingest, port)
            except zmq.Again:
                break
            taken += max(1, len(frames))
            for frame in frames:
                self.received += 1
                try:
                    msg = self.accept(frame)
                    if sender is not None:
                        self._check_sender(msg, sender)
                    elif msg.type == "hello" and len(self._rank_keys) < MAX_RANK_KEYS:
                        self._rank_keys[msg.rank] = OWNER_IPC
                except ProtocolError as exc:
                    self.reject(exc, len(frame))
                    continue
                seq = core.history.append(frame, _cover(msg))
                accepted.append(frame)
                core.liveness.heard(msg.rank, now)
                self.apply(seq, msg)
                if msg.type == "hello":
                    core.liveness.note_pid(core.state.ranks.get(msg.rank))
                if msg.type not in DIGESTED_TYPES:
                    few.append((seq, frame))
        if accepted:
            core.history.flush()  # published only once written: a hub crash cannot unsay it
            feed.send_multipart([core.topic, protocol.pack_seq(first_seq), *accepted])
            if few and self.digest.active():
                self.digest.send_few(feed, few)

    def _admitted_frames(self, ingest: zmq.Socket, port: int) -> tuple[list[bytes], Peer | None]:
        """The frames of one message from a tcp rank or relay, and who sent it, if its key may
        still send (else none: it is refused, audited, and its connection cut). Raises
        zmq.Again when none waits. The first frame is read as a `Frame` (its metadata tell
        the sender), the others as bytes: a `Frame` per frame costs more than the copy."""
        first = ingest.recv(zmq.NOBLOCK, copy=False)
        frames = [first.bytes]
        recv, more = ingest.recv, ingest.getsockopt
        while more(zmq.RCVMORE):
            frames.append(recv())
        peer = self.core.tcp_peer(first)
        peers = self.core.peers
        assert peers is not None  # tcp: while serving
        if peer.role in SOCKET_ROLES["ingest"]:
            peers.learn(peer, port)
            return frames, peer
        self.received += len(frames)
        self.rejected += len(frames)
        self.rejects.add(ProtocolError(refusal(peer, "ingest")), sum(len(f) for f in frames))
        self.core.refused(peer, "ingest", f"{len(frames)} message(s) refused: the key may not "
                                          "send (removed or another role)")
        peers.cut_one(peer, port)
        return [], None

    def _check_sender(self, msg: protocol.Message, sender: Peer) -> None:
        """A rank speaks with the key its hello came with (over tcp): another admitted key
        cannot answer toggles or send steps in its name. A new hello takes the rank over only
        once it is not running (a restart) or from the same key. Raises ProtocolError."""
        bound = self._rank_keys.get(msg.rank)
        if bound == sender.key:
            return
        view = self.core.state.ranks.get(msg.rank)
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
        gate = self.core.gate
        owner = "the owner's ipc socket" if bound == OWNER_IPC else next(
            (k.name for k in (gate.keys.values() if gate else ()) if k.key == bound),
            "a key no longer admitted")
        raise ProtocolError(f"{msg.type} for rank {msg.rank} from key {sender.user}, not from "
                            f"{owner} that its hello came with")

    def note_subscribers(self, feed: zmq.Socket) -> None:
        """Read a feed's (un)subscriptions into the fan-out (what it publishes there); a tcp
        one's also tell which key each subscriber is."""
        core = self.core
        fan_out = core.feed
        port = core.tcp_ports.get(feed)
        peers = core.peers
        for _ in range(1000):
            try:
                frame = feed.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if port is not None:
                assert peers is not None  # tcp: while serving
                peer = core.tcp_peer(frame)
                if peer.role not in SOCKET_ROLES["feed"]:
                    core.refused(peer, "feed", "follows the feed without a key that may")
                    peers.cut_one(peer, port)
                    if frame.bytes[:1] != b"\x00":  # its unsubscriptions still count
                        continue
                else:
                    peers.learn(peer, port)
            if fan_out is not None:
                fan_out.subscription(feed, frame.bytes)

    def accept(self, frame: bytes, hub_records: bool = False) -> protocol.Message:
        """Decode a rank's frame (or, replaying the history, any record) and check it
        belongs here; raises ProtocolError."""
        try:
            msg = protocol.decode(frame)
        except ProtocolError:
            raise
        except Exception as exc:  # decode should raise nothing else; never crash on input
            raise ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from None
        job = self.core.job
        if msg.job != job:
            raise ProtocolError(f"message for job {msg.job!r} sent to hub of {job!r}")
        if msg.rank == HUB_RANK:
            if hub_records:
                return msg
            raise ProtocolError(f"rank {HUB_RANK} is reserved for the hub's own records")
        if msg.type == "hello":
            for name in HELLO_NAMES:
                if type(value := msg.body.get(name)) is str:
                    check_name(f"hello.{name}", value)
        world = self.core.state.world_size
        if world is not None and msg.rank >= world and msg.type != "hello":
            raise ProtocolError(f"rank {msg.rank} is outside world size {world}")
        return msg

    def apply(self, seq: int, msg: protocol.Message) -> None:
        """Fold record `seq` into the state, and note it among its rank's records."""
        core = self.core
        if msg.rank >= 0:
            seqs = core.rank_records.get(msg.rank)
            if seqs is None:
                seqs = core.rank_records[msg.rank] = array("q")
            seqs.append(seq)
            if len(seqs) >= 2 * RANK_RECORDS_KEPT:
                del seqs[:len(seqs) - RANK_RECORDS_KEPT]
                core.ranks_trimmed.add(msg.rank)
        try:
            core.fold.apply(seq, msg)
        except Exception:  # a bug in the reducer must not take the hub down
            log.exception("could not fold %s message of rank %d into the state", msg.type,
                          msg.rank)

    def reject(self, exc: ProtocolError, size: int) -> None:
        """Count (and log, within limits) a frame or request refused as invalid."""
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

    def record(self, feed: FanOut, mtype: str, body: dict[str, Any]) -> int | None:
        """Write a hub-originated message into the history and the feed; returns its record
        number. A record over the message limit has its long strings cut; one still over it is
        logged, not written (None): the hub never writes what it would refuse, and never stops
        over it."""
        core = self.core
        self._own_seq += 1
        frame = protocol.encode(mtype, core.job, HUB_RANK, self._own_seq, body)
        if len(frame) > protocol.MAX_MESSAGE_BYTES:
            frame = protocol.encode(mtype, core.job, HUB_RANK, self._own_seq,
                                    _cut_strings(body, MAX_RECORD_STRING))
        if len(frame) > protocol.MAX_MESSAGE_BYTES:
            log.error("not writing a %s record of %d bytes (over the %d limit)", mtype,
                      len(frame), protocol.MAX_MESSAGE_BYTES)
            return None
        msg = protocol.decode(frame)
        seq = core.history.append(frame, _cover(msg))
        self.apply(seq, msg)
        core.history.flush()
        feed.send_multipart([core.topic, protocol.pack_seq(seq), frame])
        if self.digest.active():
            self.digest.send_few(feed, [(seq, frame)])
        return seq


def _cover(msg: protocol.Message) -> tuple[str, int, int | None, float]:
    """What record `msg` covers, for the history's index (`chunks.record_cover`'s rule)."""
    step = msg.body.get("step") if msg.type == "step" else None
    return msg.type, msg.rank, step if type(step) is int else None, msg.t


def _cut_strings(value: Any, limit: int) -> Any:
    """`value` with every string longer than `limit` characters cut to it."""
    if isinstance(value, str):
        return clip(value, limit)
    if isinstance(value, dict):
        return {k: _cut_strings(v, limit) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cut_strings(v, limit) for v in value]
    return value
