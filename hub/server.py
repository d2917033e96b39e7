"""The hub: one process per job that ingests every rank's messages, keeps the history, serves
dashboards and notices ranks that stop.

Sockets (see `scalemon.jobs.HubAddress`):
- `ingest` PULL (bind): ranks PUSH protocol messages; invalid frames are counted and logged.
- `feed` PUB (bind): every accepted record, numbered, for live dashboards.
- `rpc` ROUTER (bind): ping / state / fetch requests (snapshot, history pages), agents' sync.
- `control` ROUTER (bind, always ipc in the private run directory): requests that steer the
  job (flag toggles, Flight Recorder dumps); the `rpc` socket refuses them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import signal
import socket
import threading
import time
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

import zmq

import scalemon
from scalemon import protocol, seed
from scalemon.fold import JobFold
from scalemon.history import HISTORY_FILE, RETRY_S, History
from scalemon.jobs import (
    ENDED_STATES,
    HubAddress,
    JobFile,
    jobs_dir,
    node_name,
    pid_alive,
    private_dir,
    run_dir,
)
from scalemon.jobstate import HANG_AFTER_S, RankView
from scalemon.keys import Keypair, hub_keypair, load_authorized, secure_server
from scalemon.protocol import (
    HUB_RANK,
    RANK_RECORDS_KEPT,
    SOCKET_ROLES,
    ProtocolError,
    VersionMismatch,
    version_text,
)

from .access import Peer, PeerBook, ipc_peer, may, refusal, tcp_peer
from .alerts_out import AlertsOut
from .audit import Audit
from .auth import DOMAINS, KeyGate, start_gate
from .frdump import FrDump
from .limits import RejectBook, check_name, clip, raise_open_files_limit, reason_class
from .openmetrics import Exporter
from .relays import RelayBook
from .tcpguard import TcpGuard
from .toggles import ToggleRefused, Toggles

log = logging.getLogger("scalemon.hub")

INGEST_BATCH = 1000  # frames per turn, so requests (syncs, pings) wait at most ~30 ms
SEED_REUSE_S = 1.0
"""A seed made this recently serves the next dashboard too, while no record came since."""
FETCH_LIMIT = 20_000
FETCH_MAX_BYTES = 16 << 20  # a page stops growing here (replies may reach MAX_REPLY_BYTES)
MAX_FRAME_BYTES = 16 << 20  # zmq drops a peer sending more than this; decode rejects > 1 MiB
HOUSEKEEPING_S = 0.25
MAX_RECORD_STRING = 4096
"""A hub record over the message limit has its strings cut to this many characters."""
MAX_TOGGLE_VALUE = 1024
HELLO_NAMES = ("host", "agent_version", "torch_version", "device", "backend")
"""A rank's hello strings, each at most MAX_NAME_CHARS long (the state lists them per rank)."""
"""A toggle's value or a stop's reason may be this long."""
WAITING_S = 300.0
OWNER_IPC = b""
"""The 'key' of a rank whose hello came over the owner's ipc socket."""
MAX_RANK_KEYS = 1 << 20
"""Ranks whose key the hub remembers (a rank's messages must come with its hello's key)."""


class HubAlreadyRunning(RuntimeError):
    """Another hub holds this job's run directory."""


class Hub:
    """Collects one job's messages. `serve_forever()` runs until the job ended and lingered."""

    def __init__(
        self,
        job: str,
        home: Path | None = None,
        address: str | None = None,
        world_size: int | None = None,
        lost_after_s: float = 5.0,
        linger_s: float = 600.0,
        memory_limit: int = 1_000_000,
        hang_after_s: float = HANG_AFTER_S,
        listen: str | None = None,
    ) -> None:
        self.job = job
        self.home = home
        where = run_dir(job, home)
        self.run_dir = private_dir(where, top=where.parents[1])  # home, run/, run/<job>
        self.address = HubAddress.parse(address) if address else HubAddress.for_directory(
            self.run_dir
        )
        self.listen = HubAddress.parse(listen) if listen else None
        if self.listen is not None and not self.listen.ingest.startswith("tcp://"):
            raise ValueError(f"--listen {listen!r}: expected tcp://HOST:PORT (port 0: any free "
                             "ports)")
        self.tcp_endpoints: dict[str, str] | None = None  # bound, with a resolvable host
        self._keys: Keypair | None = None
        self._gate: KeyGate | None = None
        if self.address.ingest.startswith("tcp://") or self.listen is not None:
            self._keys = hub_keypair(home)  # fail now, with the keys' error, not once serving
            load_authorized(home)
        self.control_endpoint = HubAddress.for_directory(self.run_dir).control
        self.lost_after_s = lost_after_s
        self.linger_s = linger_s
        self._lock_file = self._take_lock()
        self.history = History(self.run_dir / HISTORY_FILE, memory_limit)
        self._topic = protocol.feed_topic(self.history.identity)
        # the dashboards' fold of the history, kept as records come: a late dashboard starts
        # from it (`seed`) instead of replaying the history; its JobState is the hub's state
        self.fold = JobFold(job=job, world_size=world_size, hang_after_s=hang_after_s)
        self.state = self.fold.state
        self._rank_records: dict[int, array] = {}  # each rank's latest record numbers
        self._ranks_trimmed: set[int] = set()  # ranks whose first records left that list
        self._seed_cache: tuple[int, float, dict[str, Any]] | None = None
        self._commands: dict[int, list[dict[str, Any]]] = {}  # queued per rank, sent on sync
        self._dump: FrDump | None = None
        self._pending_dump_record = False
        self.replay_skipped: Counter[str] = Counter()
        self._notes: list[tuple[str, str]] = []  # written into the history once serving
        self._error_said: str | None = None
        self.received = 0
        self.rejected = 0
        self.rejects = RejectBook()  # counted by our reason classes, never the sender's text
        self.guard: TcpGuard | None = None  # caps the tcp connections, while serving
        self._versions_refused: set[tuple[int, int]] = set()
        self.started = time.time()
        self._own_seq = 0
        self._last_recv: dict[int, float] = {}
        self._seen_alive: set[int] = set()
        self._host = node_name()
        self._last_any_recv = time.monotonic()
        self._ended_since = 0.0
        self._ending_state: str | None = None
        self._stop = threading.Event()
        self._job_file: JobFile | None = None
        self._feed: _FanOut | None = None  # while serving: where `stop` records go
        self.exporter: Exporter | None = None  # OpenMetrics (hub/openmetrics.py), when asked
        self._replay_history()
        self.audit = Audit(self.run_dir)
        self.toggles = Toggles(self.run_dir, self.state, self.audit)
        self.alerts_out = AlertsOut.from_env(os.environ, job, self.audit, self.state, self.run_dir)
        self._tcp_ports: dict[zmq.Socket, int] = {}  # tcp socket -> the port it is bound at
        self.peers: PeerBook | None = None  # which key each tcp connection is, while serving
        self._rank_keys: dict[int, bytes] = {}  # the key each rank's hello came with
        self.relays = RelayBook(lost_after_s=max(lost_after_s, 10.0))

    # --- setup ---------------------------------------------------------------------------
    def _take_lock(self):  # noqa: ANN202 - file object
        path = self.run_dir / "hub.lock"
        f = open(path, "a+")  # noqa: SIM115 - held for the life of the hub
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            other = f.read().strip() or "?"
            f.close()
            raise HubAlreadyRunning(
                f"a hub for job {self.job!r} is already running (pid {other}); "
                f"attach to it with `scalemon snapshot {self.job}`"
            ) from None
        f.truncate(0)
        try:  # the pid is for people; a full disk must not stop the hub
            f.write(str(os.getpid()))
            f.flush()
        except OSError as exc:
            log.error("could not write the hub's pid into %s: %s", path, exc)
        return f

    def _replay_history(self) -> None:
        """Rebuild the state from a history left by an earlier hub of this job, validating
        every record as live ingest does (schema, job id, bounds) and counting what it skips."""
        n = len(self.history)
        for seq, record in enumerate(self.history.get(0, n)):
            try:
                msg = self._accept(record, hub_records=True)
            except ProtocolError as exc:
                self.replay_skipped[reason_class(exc)] += 1
                continue
            self._apply(seq, msg)
        if n:
            log.info("resumed history of job %s: %d records", self.job, n)
        if self.history.earlier_loss:
            log.error("history of job %s: %s", self.job, self.history.earlier_loss)
            self._notes.append(("loss", self.history.earlier_loss))
        recovery = self.history.recovery
        if recovery:
            self._notes.append(("history", (
                f"history reopened damaged: {recovery['records']} intact records kept "
                f"({recovery['salvaged_after_damage']} of them after the damage), "
                f"{recovery['set_aside_bytes']} damaged bytes set aside in "
                f"{recovery['set_aside_in']}")))
        if self.replay_skipped:
            skipped = sum(self.replay_skipped.values())
            reasons = "; ".join(f"{k} ({v})" for k, v in self.replay_skipped.most_common(3))
            log.warning("history of job %s: skipped %d invalid records on replay: %s",
                        self.job, skipped, reasons)
            self._notes.append(("history", f"{skipped} records of the history were not "
                                           f"folded in (invalid: {reasons})"))
        now = time.monotonic()
        for rank in self.state.ranks:
            self._last_recv[rank] = now

    def _sockets(self, ctx: zmq.Context,
                 tcp: bool = False) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket]:
        """An unbound ingest PULL, feed PUB and rpc ROUTER with the hub's options. A tcp feed
        is an XPUB that hands up every subscription: it tells which key each subscriber is."""
        ingest = ctx.socket(zmq.PULL)
        ingest.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        ingest.setsockopt(zmq.RCVHWM, 100_000)
        feed = ctx.socket(zmq.XPUB if tcp else zmq.PUB)
        if tcp:
            feed.setsockopt(zmq.XPUB_VERBOSE, 1)
            feed.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
        feed.setsockopt(zmq.SNDHWM, 100_000)
        rpc = ctx.socket(zmq.ROUTER)
        rpc.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        for sock in (ingest, feed, rpc):
            sock.setsockopt(zmq.LINGER, 0)
        return ingest, feed, rpc

    def _bind(self, ctx: zmq.Context) -> tuple[zmq.Socket, ...]:
        """Bind the main endpoints, the control socket and, with --listen, the tcp ones. Every
        tcp socket is a Curve server behind the ZAP handler: TCP is never open."""
        if self._keys is not None:
            self.auth, self._gate = start_gate(ctx, self.home)
        ingest, feed, rpc = self._sockets(ctx, tcp=self.address.ingest.startswith("tcp://"))
        control = ctx.socket(zmq.ROUTER)
        control.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        control.setsockopt(zmq.LINGER, 0)
        main = (ingest, feed, rpc)
        if self.address.ingest.startswith("tcp://"):
            self.tcp_endpoints = self._bind_tcp(main, self.address)
        else:
            ingest.bind(self.address.ingest)
            feed.bind(self.address.feed)
            rpc.bind(self.address.rpc)
        control.bind(self.control_endpoint)  # in the 0700 run directory: the owner only
        extra: tuple[zmq.Socket, ...] = ()
        if self.listen is not None:
            extra = self._sockets(ctx, tcp=True)
            self.tcp_endpoints = self._bind_tcp(extra, self.listen)
        return (ingest, feed, rpc, control, *extra)

    def _bind_tcp(self, sockets: tuple[zmq.Socket, ...], where: HubAddress) -> dict[str, str]:
        """Bind ingest/feed/rpc as Curve servers at `where` (port 0: each a free port);
        returns the endpoints with a host name other nodes resolve."""
        assert self._keys is not None
        host = where.ingest[len("tcp://"):].rpartition(":")[0]
        public = host in ("*", "0.0.0.0", "[::]", "::") or not host
        name = _resolvable_host() if public else host.strip("[]")
        bound = {}
        for label, sock, endpoint in zip(("ingest", "feed", "rpc"), sockets,
                                         (where.ingest, where.feed, where.rpc), strict=True):
            secure_server(sock, self._keys, DOMAINS[label])
            if self.guard is not None:
                self.guard.prepare(sock)
            if endpoint.endswith(":0"):
                port = sock.bind_to_random_port(endpoint[:-2])
            else:
                sock.bind(endpoint)
                port = int(endpoint.rpartition(":")[2])
            if self.guard is not None:
                self.guard.watch(sock, port)
            self._tcp_ports[sock] = port
            bound[label] = f"tcp://{name}:{port}"
        return bound

    def _write_job_file(self, state: str = "running", ended: float | None = None) -> None:
        """(Re)write the job file: `state` "running" while the job runs, else the job's final
        state (from the moment it ended: a lingering hub serves an ended job, not a live one)."""
        self._job_file = JobFile(
            job=self.job,
            address=self.address.base,
            host=node_name(),
            pid=os.getpid(),
            started=self.started,
            world_size=self.state.world_size,
            run_dir=str(self.run_dir),
            protocol=list(protocol.PROTOCOL_VERSION),
            state=state,
            ended=ended,
            tcp=self.tcp_endpoints,
            server_key=self._keys.public.decode() if self._keys else None,
            metrics_url=self.exporter.url if self.exporter else None,
        )
        try:
            self._job_file.write(self.home)
        except OSError as exc:  # the hub serves on; retried when the world size changes
            log.error("could not write the job file of %s: %s (`scalemon jobs` will not list "
                      "this hub; attach by address: %s)", self.job, exc, self.address.base)

    def _mark_job_file(self) -> None:
        """On the way out: an ended job's file says so (readers tell it from a dead hub); a
        hub stopped while its job runs removes its file (a successor writes its own)."""
        path = jobs_dir(self.home) / f"{self.job}.json"
        if self._ending_state not in ENDED_STATES:
            path.unlink(missing_ok=True)
            return
        try:
            current = JobFile.read(path)
        except (ValueError, OSError):  # unreadable, or not trusted
            return
        if current.pid != os.getpid():
            return  # another hub took over
        try:
            dataclasses.replace(self._job_file, state=self._ending_state,
                                ended=self._job_file.ended or time.time(),
                                hub_stopped=time.time()).write(self.home)
        except OSError as exc:
            log.error("could not mark the job file of %s %s: %s", self.job,
                      self._ending_state, exc)

    # --- main loop -----------------------------------------------------------------------
    def stop(self) -> None:
        """Ask `serve_forever` to return (thread-safe)."""
        self._stop.set()

    def serve_forever(self) -> None:
        """Bind, write the job file, and serve until stopped or the job ended and lingered."""
        self.guard = TcpGuard(raise_open_files_limit())
        self.peers = PeerBook(self.guard)
        ctx = zmq.Context()
        self.auth = None
        try:
            sockets = self._bind(ctx)
        except BaseException:
            self._stop_auth()
            raise
        self.guard.set_caps()
        monitors = self.guard.monitors
        ingest, feed_main, rpc, control, *extra = sockets
        ingests = [ingest, *extra[:1]]
        rpcs = [rpc, *extra[2:3]]
        feed = self._feed = _FanOut([feed_main, *extra[1:2]])
        subscribers = [sock for sock in feed.sockets if sock.type == zmq.XPUB]
        self._write_job_file()
        log.info("hub for job %s listening on %s%s", self.job, self.address.base,
                 f" and (CurveZMQ) {self.tcp_endpoints}" if self.tcp_endpoints else "")
        poller = zmq.Poller()
        for sock in (*ingests, *rpcs, control, *monitors, *subscribers):
            poller.register(sock, zmq.POLLIN)
        next_housekeeping = 0.0
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(timeout=100))
                for sock in monitors:  # first: shed connections over the cap at once
                    if sock in events:
                        self.guard.on_events(sock)
                for sock in ingests:
                    if sock in events:
                        self._ingest(sock, feed)
                for sock in rpcs:
                    if sock in events:
                        self._serve_rpc(sock)
                if control in events:
                    self._serve_rpc(control)
                for sock in subscribers:
                    if sock in events:
                        self._note_subscribers(sock)
                now = time.monotonic()
                if now >= next_housekeeping:
                    next_housekeeping = now + HOUSEKEEPING_S
                    self._housekeeping(feed, now)
            self._end_stopped_ranks(feed)
        finally:
            self._shutdown(ctx, sockets)

    def _stop_auth(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None

    def _shutdown(self, ctx: zmq.Context, sockets: tuple[zmq.Socket, ...]) -> None:
        error = self.history.write_error
        lost = self.history.close()
        if self.guard is not None:
            self.guard.close()
        for sock in sockets:
            sock.close(linger=0)
        self._stop_auth()
        ctx.term()
        if self.exporter is not None:  # the file keeps the final state
            self.exporter.update(self.state, time.monotonic(), force=True)
            self.exporter.close()
        if self._job_file is not None:
            self._mark_job_file()
        self._lock_file.close()
        if lost:
            log.error("hub for job %s stopped: %d received, %d rejected; %d records could not "
                      "be written to the history (%s) and are lost", self.job, self.received,
                      self.rejected, lost, error)
        else:
            log.info("hub for job %s stopped: %d received, %d rejected; every record is in "
                     "the history", self.job, self.received, self.rejected)

    def _ingest(self, ingest: zmq.Socket, feed: _FanOut) -> None:
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
                self._last_recv[msg.rank] = self._last_any_recv = now
                self._apply(seq, msg)
                if msg.type == "hello":
                    self._note_pid(msg.rank)
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

    def _record(self, feed: _FanOut, mtype: str, body: dict[str, Any]) -> int | None:
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

    def _note_write_error(self) -> None:
        """Say in the history (and so in snapshot and dashboards) when records stop and start
        being written."""
        error = self.history.write_error
        if error == self._error_said:
            return
        if error is not None:
            since = time.strftime("%H:%M:%S", time.localtime(self.history.write_error_since))
            self._notes.append(("history", (
                f"history not being written: {error} since {since}; records are kept in "
                f"memory and served, and written when the disk has room (retrying every "
                f"{RETRY_S:.0f} s)")))
        else:
            self._notes.append(("history", f"history written again after "
                                           f"{self._error_said}: nothing was lost"))
        self._error_said = error

    # --- rank liveness and lifetime --------------------------------------------------------
    def _housekeeping(self, feed: _FanOut, now: float) -> None:
        self._check_keys()
        self.history.flush()
        self._note_write_error()
        while self._notes:
            kind, text = self._notes.pop(0)
            if kind == "loss":  # once written, the loss marker no longer needs to say it
                self.history.earlier_loss_told(self._record(
                    feed, "hub_note", {"kind": "history", "text": text}))
            else:
                self._record(feed, "hub_note", {"kind": kind, "text": text})
        self._advance_dump(feed)
        self.toggles.advance(now)
        self._write_toggle_records(feed)
        self.relays.advance(now)
        while self.relays.records:
            self._record(feed, "relay", self.relays.records.pop(0))
        self._detect_lost(feed, now)
        if self.alerts_out is not None:  # $SCALEMON_ALERT_CMD (hub/alerts_out.py)
            self.alerts_out.check(self.state, now)
        if self.exporter is not None:
            self.exporter.update(self.state, now)
        job_state = self._lifecycle_state(now)
        if job_state != self._ending_state:  # each ending state counts its own linger
            self._ending_state, self._ended_since = job_state, now
            self._note_job_state(job_state)
        elif self._job_file and self._job_file.world_size != self.state.world_size:
            self._write_job_file(self._job_file.state, self._job_file.ended)
        if job_state in (*ENDED_STATES, "waiting"):
            # a hub whose ranks never came waits at least WAITING_S before giving up
            wait_s = max(self.linger_s, WAITING_S) if job_state == "waiting" else self.linger_s
            if now - self._ended_since >= wait_s:
                log.info("job %s is %s; waited %.0f s, exiting", self.job, job_state, wait_s)
                self._stop.set()

    def _check_keys(self) -> None:
        """Cut the live connections of keys removed from `authorized` (or given another
        role: they reconnect under it), and audit the handshakes the gate refused."""
        if self._gate is None or self.peers is None:
            return
        for lost in self._gate.take_lost():
            cut = self.peers.cut({lost.key})
            log.warning("key %s (role %s) lost its access: %d live connection(s) cut",
                        lost.name, lost.role, cut)
            self.audit.write({"event": "access cut", "user": lost.name, "role": lost.role,
                              "connections": cut})
        while self._gate.events:
            event = self._gate.events.popleft()
            label = f"key {event['name'] or event['key'][:12] + '…'}"
            user = event["name"] or label
            source = f"{label} from {event['client_host']}"
            self.audit.refusal(source, f"handshake on {event['socket']}",
                               {"user": user, "via": source, **event})

    def _note_job_state(self, job_state: str) -> None:
        """Say in the job file, at once, that the job ended (its final state) or runs again:
        `scalemon jobs`, `attach` and `snapshot` then never take a lingering hub's ended job
        for a live one."""
        if self._job_file is None:
            return
        state = job_state if job_state in ENDED_STATES else "running"
        if state != self._job_file.state or self._job_file.world_size != self.state.world_size:
            self._write_job_file(state, time.time() if state != "running" else None)

    def _end_stopped_ranks(self, feed: _FanOut) -> None:
        """On the way out after the user's stop request: the ranks that have not reported
        their end yet are written off (as `stopped`, by the reducer), so the history tells
        how the job ended, also when replayed after the hub has gone."""
        if self.state.stop is None:
            return
        for rank, view in sorted(self.state.ranks.items()):
            if view.state == "running":
                self._record(feed, "rank_state", {
                    "target": rank, "state": "lost",
                    "reason": "the hub stopped before the rank reported its end"})
        self._ending_state = self._lifecycle_state(time.monotonic())

    def _lifecycle_state(self, now: float) -> str:
        """The job state, plus `abandoned`: every rank seen has stopped or is lost and none
        spoke for `linger_s`, though fewer than world_size ever reported (ranks elsewhere)."""
        job_state = self.state.state
        views = self.state.ranks.values()
        if (job_state in ("running", "degraded", "stopping") and views
                and all(v.state != "running" for v in views)
                and now - self._last_any_recv >= self.linger_s):
            return "abandoned"
        return job_state

    def _note_pid(self, rank: int) -> None:
        """Look at a rank's pid as its hello arrives, so a rank killed before the next
        housekeeping round is still known to have been alive here."""
        view = self.state.ranks.get(rank)
        if view is not None and (pid := self._local_pid(view)):
            self._process_gone(pid)

    def _local_pid(self, view: RankView) -> int | None:
        """The rank's pid when it runs on this hub's host, else None."""
        return view.pid if view.host == self._host and view.pid else None

    def _detect_lost(self, feed: _FanOut, now: float) -> None:
        for rank, view in list(self.state.ranks.items()):
            if view.state != "running":
                continue
            silent = now - self._last_recv.get(rank, now)
            if silent > self.lost_after_s:
                reason = f"no message for {silent:.1f} s"
                relay_silent = self.relays.silent_for(view.host, now)
                if relay_silent is not None and relay_silent > 3.0:
                    reason += (f" (its node's relay has not reported for {relay_silent:.1f} s: "
                               "see relay.log on that node)")
            elif (pid := self._local_pid(view)) and self._process_gone(pid):
                reason = f"process {pid} is gone without reporting an exit (killed?)"
            else:
                continue
            log.warning("rank %d lost: %s", rank, reason)
            self._record(feed, "rank_state", {"target": rank, "state": "lost", "reason": reason})

    def _process_gone(self, pid: int) -> bool:
        """True when a rank's process, once seen alive here, is gone. A pid never seen alive
        proves nothing: the rank may run in another PID namespace under the same host name."""
        if pid_alive(pid):
            self._seen_alive.add(pid)
            return False
        return pid in self._seen_alive

    # --- requests from dashboards and the CLI -------------------------------------------
    def _serve_rpc(self, rpc: zmq.Socket) -> None:
        port = self._tcp_ports.get(rpc)
        for _ in range(100):
            try:
                frames = rpc.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            envelope, last = [f.bytes for f in frames[:-1]], frames[-1]
            payload = last.bytes
            peer = self._tcp_peer(last) if port else ipc_peer(last, self._host)
            op = "?"
            try:
                if port and peer.role is not None:  # whatever it asks: cut if it loses access
                    self.peers.learn(peer, port)
                op, args = protocol.decode_request(payload)
                if not may(peer, op):
                    self._refuse_request(peer, op, args, port)
                reply = protocol.encode_reply(**self._answer(op, args, peer),
                                              history=self.history.identity)
            except ToggleRefused as exc:  # a reasoned refusal, not a bad frame
                log.warning("toggle %s", exc)
                reply = protocol.encode_reply(ok=False, error=str(exc))
            except ProtocolError as exc:
                self._reject(exc, len(payload))
                reply = protocol.encode_reply(ok=False, error=str(exc))
            except Exception as exc:  # a request must never take the hub down
                log.exception("request failed")
                reply = protocol.encode_reply(ok=False, error=f"{type(exc).__name__}: {exc}")
            if len(reply) > protocol.MAX_REPLY_BYTES:  # the client would refuse it
                log.error("a %s reply of %d bytes is over the %d reply limit", op, len(reply),
                          protocol.MAX_REPLY_BYTES)
                reply = protocol.encode_reply(ok=False, error=(
                    f"the {op} reply is {len(reply):,} bytes, over the "
                    f"{protocol.MAX_REPLY_BYTES:,}-byte reply limit"))
            with contextlib.suppress(zmq.ZMQError):  # the requester went away
                rpc.send_multipart([*envelope, reply], zmq.NOBLOCK)

    def _refuse_request(self, peer: Peer, op: str, args: dict[str, Any],
                        port: int | None) -> None:
        """Refuse request `op` that `peer`'s role does not allow: audited (a toggle also as a
        `refused` toggle record), the connection of a key no longer admitted cut; raises."""
        text = refusal(peer, op)
        log.warning("%s %s", op, text)
        if op == "toggle":
            self.toggles.refuse(args["name"], args["value"], self._who(peer), text)
        else:
            self._refused(peer, op, text)
        if peer.role is None and port is not None:
            self.peers.cut_one(peer, port)
        raise ToggleRefused(text) if op == "toggle" else ProtocolError(text)

    def _answer(self, op: str, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        if op == "ping":
            return {"job": self.job, "pid": os.getpid(), "head": len(self.history)}
        if op == "sync":
            rank = args["rank"]
            return {"t0": args["t"], "t": time.time(), "hang_after_s": self.state.hang_after_s,
                    "commands": self._commands.pop(rank, []) + self.toggles.take_commands(rank)}
        if op == "relay":
            self.relays.report(check_name("relay.node", args["node"]), args["pid"],
                               args["stats"])
            return {"t0": args["t"], "t": time.time()}
        if op == "command":
            self.audit.write({"event": "command", "name": clip(args["name"], 100),
                              **self._who(peer)})
            return self._command(args["name"])
        if op == "stop":
            check_name("stop.reason", args["reason"], MAX_TOGGLE_VALUE)
            self.audit.write({"event": "stop", "reason": args["reason"], **self._who(peer)})
            return self._user_stop(args["reason"], peer)
        if op == "toggle":
            return self._toggle(args, peer)
        if op == "state":
            return {"state": self.state.to_json(), "hub": self.stats(), "head": len(self.history)}
        if op == "seed":
            return self._seed()
        if op == "rank_records":
            return self._records_of(args["rank"], args["before"], args["limit"])
        since = max(0, args["since"])
        limit = min(max(0, args["limit"]), FETCH_LIMIT)
        records, size = [], 0
        for record in self.history.get(since, limit):
            size += len(record)
            if records and size > FETCH_MAX_BYTES:
                break
            records.append(record)
        return {"records": records, "head": len(self.history)}

    def _seed(self) -> dict[str, Any]:
        """The fold of the whole history so far, for a dashboard that attaches (`seed`):
        {"seed": bytes, "seq": the record it continues from}, or {"seed": None, "why": ...}."""
        head = len(self.history)
        cached = self._seed_cache
        if cached is not None and cached[0] == head and time.monotonic() - cached[1] < SEED_REUSE_S:
            return cached[2]
        started = time.perf_counter()
        self.fold.next_seq = head  # every record below was folded, or skipped as invalid
        blob = seed.dump(self.fold)
        took = time.perf_counter() - started
        if len(blob) > seed.MAX_SEED_BYTES:
            reply: dict[str, Any] = {"seed": None, "seq": head, "why": (
                f"the fold holds {len(blob) >> 20} MiB, over {seed.MAX_SEED_BYTES >> 20} MiB: "
                "replay the history")}
        else:
            reply = {"seed": blob, "seq": head, "format": seed.FORMAT}
        reply["hang_after_s"] = self.state.hang_after_s  # the dashboard's threshold too
        log.info("seed at record %d: %d bytes in %.3f s", head, len(blob), took)
        self._seed_cache = (head, time.monotonic(), reply)
        return reply

    def _records_of(self, rank: int, before: int, limit: int) -> dict[str, Any]:
        """Rank `rank`'s latest records numbered below `before` (at most `limit`, among the
        latest RANK_RECORDS_KEPT it sent), oldest first; `complete` when they reach back to
        its first record."""
        seqs = self._rank_records.get(rank, array("q"))
        older = [seq for seq in seqs if seq < before]
        chosen = older[len(older) - min(max(0, limit), FETCH_LIMIT, len(older)):]
        return {"records": self.history.pick(chosen), "head": len(self.history),
                "complete": rank not in self._ranks_trimmed and len(chosen) == len(older)}

    def _toggle(self, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        """A toggle asked by `peer`: checked, planned and audited (refusals too)."""
        try:
            check_name("toggle.name", args["name"])
            check_name("toggle.value", args["value"], MAX_TOGGLE_VALUE)
        except ProtocolError as exc:
            self.toggles.refuse(clip(args["name"], 100), clip(args["value"], 200),
                                self._who(peer), f"refused: {exc}")
            raise ToggleRefused(f"refused: {exc}") from None
        reply = self.toggles.request(args["name"], args["value"], args["restart"],
                                     self._who(peer))
        log.info("toggle #%d %s=%r (%s) by %s: step %d", reply["id"], args["name"],
                 args["value"], reply["tier"], peer.via, reply["at_step"])
        return reply

    def _user_stop(self, reason: str, peer: Peer) -> dict[str, Any]:
        """The job's user is stopping the job: record it (once) before the ranks are
        signalled, so that their end reads "stopped by user"."""
        if self.state.stop is None and self._feed is not None:
            log.info("job %s: stop requested by %s (%s)", self.job, peer.via, reason)
            self._record(self._feed, "job_stop", {"reason": reason or None, "user": peer.user,
                                                  "host": peer.host, "via": peer.via})
        return {"state": self.state.state}

    # --- commands to the ranks -------------------------------------------------------------
    def _command(self, name: str) -> dict[str, Any]:
        """A dashboard's command for every rank; raises ProtocolError for an unknown one."""
        if name != "dump_fr":
            raise ProtocolError(f"unknown command {name!r}; known: dump_fr")
        if self._dump is not None and not self._dump.finished:
            return {"directory": self._dump.directory, "note": "a dump is already under way"}
        ranks = sorted(r for r, v in self.state.ranks.items() if v.state != "finished")
        self._dump = FrDump(self.run_dir, ranks)
        for rank in ranks:
            self._commands.setdefault(rank, []).append(
                {"name": "dump_fr", "directory": self._dump.directory})
        self._pending_dump_record = True
        return {"directory": self._dump.directory, "ranks": ranks}

    def _write_toggle_records(self, feed: _FanOut) -> None:
        """Write the toggles' new states (and refusals) into the history and the feed."""
        while self.toggles.records:
            self._record(feed, "toggle", self.toggles.records.pop(0))

    def _advance_dump(self, feed: _FanOut) -> None:
        """Record a dump's progress in the history: requested, then analysed."""
        dump = self._dump
        if dump is None:
            return
        if self._pending_dump_record:
            self._pending_dump_record = False
            self._record(feed, "fr_dump", dump.body())
        if dump.advance(self.state) and not dump.recorded:
            dump.recorded = True
            self._record(feed, "fr_dump", dump.body())

    def stats(self) -> dict[str, Any]:
        """Hub counters, as reported in `state` replies."""
        return {
            "pid": os.getpid(),
            "host": node_name(),
            "address": self.address.base,
            "uptime_s": time.time() - self.started,
            "received": self.received,
            "rejected": self.rejected,
            "reject_reasons": dict(self.rejects.counts),
            "reject_recent": list(self.rejects.recent),
            "history": len(self.history),
            "run_dir": str(self.run_dir),
            "history_identity": self.history.identity,
            "history_error": self.history.write_error,
            "history_unwritten": len(self.history) - self.history.durable,
            "history_recovery": self.history.recovery,
            "replay_skipped": dict(self.replay_skipped),
            "tcp": self.tcp_endpoints,
            "relays": len(self.relays.relays),
            "auth_refused": self._gate.counts()["refused"] if self._gate else 0,
            "auth_refused_keys": self._gate.counts()["refused_keys"] if self._gate else 0,
            "keys_admitted": len(self._gate.keys) if self._gate else 0,
            "access_cut": self.peers.cut_total if self.peers else 0,
            "audit_refused": self.audit.refused,
            "tcp_connections": self.guard.connections() if self.guard else 0,
            "tcp_cap": self.guard.cap if self.guard else 0,
            "tcp_shed": self.guard.shed if self.guard else 0,
            "tcp_source_cap": self.guard.source_cap if self.guard else 0,
            "tcp_shed_by_source": self.guard.shed_by_source if self.guard else 0,
        }


class _FanOut:
    """The feed: every record goes to each PUB socket (ipc and, with --listen, tcp)."""

    def __init__(self, sockets: list[zmq.Socket]) -> None:
        self.sockets = sockets

    def send_multipart(self, frames: list[bytes]) -> None:
        """Publish `frames` on every feed socket."""
        for sock in self.sockets:
            sock.send_multipart(frames)


def _resolvable_host() -> str:
    """This host's name as other nodes resolve it: the FQDN where it has one."""
    fqdn = socket.getfqdn()
    return fqdn if fqdn and fqdn != "localhost" else socket.gethostname()


def _cut_strings(value: Any, limit: int) -> Any:
    """`value` with every string longer than `limit` characters cut to it."""
    if isinstance(value, str):
        return clip(value, limit)
    if isinstance(value, dict):
        return {k: _cut_strings(v, limit) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cut_strings(v, limit) for v in value]
    return value


def install_signal_handlers(hub: Hub) -> None:
    """SIGTERM/SIGINT stop the hub cleanly (flushed history, job file removed)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: hub.stop())
