"""Sending to the hub from a background thread, so the training thread never waits.

The training thread only appends to a bounded deque; it never signals the sender, because a
woken sender would compete for the GIL right when the training thread holds it. A daemon thread
wakes every `flush_interval_s`, owns the ZeroMQ PUSH socket, packs messages and sends them with
NOBLOCK. A full deque or a full socket queue (no hub,
slow hub) drops the message and counts it; the hub sees the drop as a gap in `seq` too.

The thread also keeps a round trip going with the hub's RPC socket (a `sync` request every
`sync_every_s`, answered whenever the hub is up). The first answer gives the hub's protocol
version: a hub of another major version would refuse every message, so the agent says so once,
naming both versions, and stops sending. Every answer gives the hub's clock, from which the
agent estimates the offset between the hub's clock and this host's (`clock_offset_s`, from the
fastest of the last 8 round trips, once there are 3,
as NTP does), and carries the commands the hub queued for this
rank (a Flight Recorder dump), handed to `on_command` on this thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

import scalemon
from scalemon import protocol
from scalemon.home.keys import secure_client

from .values import plain_values
from .warn import Warnings

log = logging.getLogger("scalemon.agent")


class Sender:
    """Bounded, drop-counting, non-blocking message sender for one rank."""

    def __init__(
        self,
        endpoint: str,
        job: str,
        rank: int,
        max_queue: int = 4096,
        socket_hwm: int = 10_000,
        close_timeout_s: float = 2.0,
        flush_interval_s: float = 0.05,
        rpc_endpoint: str | None = None,
        warnings: Warnings | None = None,
        sync_every_s: float = 1.0,
        silent_warn_s: float = 15.0,
        configured_by: str | None = None,
        first_answer_warn_s: float | None = None,
        hub_label: str | None = None,
        server_key: str | None = None,
        start_grace_s: float = 0.0,
    ) -> None:
        self.endpoint = endpoint
        self.start_grace_s = start_grace_s
        """At close, how long to wait for a hub that never answered (one being started)."""
        self.server_key = server_key  # the hub's Curve public key, for tcp endpoints
        self.rpc_endpoint = rpc_endpoint
        self.warnings = warnings or Warnings()
        self.hub_version: tuple[int, int] | None = None  # once the hub answered
        self.job = job
        self.rank = rank
        self.max_queue = max_queue
        self.socket_hwm = socket_hwm
        self.close_timeout_s = close_timeout_s
        self.flush_interval_s = flush_interval_s
        self.sync_every_s = sync_every_s
        self.silent_warn_s = silent_warn_s
        self.configured_by = configured_by  # "SCALEMON_HUB", ... when the user chose the hub
        self.hub_label = hub_label or rpc_endpoint  # the hub as the user knows its address
        self.first_answer_warn_s = (silent_warn_s if first_answer_warn_s is None
                                    else first_answer_warn_s)
        self._answered: float | None = None  # monotonic time of the hub's last answer
        self.on_hub_silent: Callable[[], None] | None = None  # e.g. start a new hub
        self.replace_after_s = 3.0
        self._replaced_for: float | None = None  # the silence already acted on
        self._started = time.monotonic()
        self.on_command: Callable[[dict[str, Any]], None] | None = None
        self._round_trips: deque[tuple[float, float]] = deque(maxlen=8)  # (rtt, offset)
        self._sync_sent: float | None = None  # monotonic time of the request in flight
        self._next_sync = 0.0
        self._sync_refused = False
        self.hang_after_s: float | None = None  # the hub's hang threshold, once it answered
        self.heartbeat_stepping_s: float | None = None  # the hub's, once it answered (1.13)
        self.dropped = 0  # changed under _drop_lock: several threads drop
        self.sent = 0
        self._drop_lock = threading.Lock()
        self._seq = itertools.count()
        self._queue: deque[tuple[str, int, float, dict[str, Any]]] = deque()
        # steps whose body a callable finishes on this thread once device values are ready;
        # kept apart so a stuck GPU cannot hold back heartbeats
        self._deferred: deque[tuple[str, int, float, Callable[[Any, float | None], dict | None],
                                    Any]] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="scalemon-sender", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Messages waiting for the sender thread."""
        return len(self._queue) + len(self._deferred)

    def _admit(self) -> int | None:
        seq = next(self._seq)
        if self._failed or self._stopping or self.queued >= self.max_queue:
            self._drop()
            return None
        return seq

    def _drop(self, why: str | None = None) -> None:
        with self._drop_lock:
            self.dropped += 1
        if why:  # each kind of problem is logged once
            self.warnings.once(f"drop: {why}", "scalemon: dropped a message: %s", why)

    def submit(self, mtype: str, body: dict[str, Any]) -> bool:
        """Queue a message (any thread); False when it was dropped."""
        seq = self._admit()
        if seq is None:
            return False
        self._queue.append((mtype, seq, time.time(), body))
        return True

    def submit_deferred(
        self, mtype: str, finish: Callable[[Any, float | None], dict | None], arg: Any = None,
    ) -> bool:
        """Queue a message whose body `finish(arg, deadline)` builds on the sender thread; it
        returns None while not ready (waiting until the monotonic deadline, if any). Deferred
        messages keep their order."""
        # `_admit` inline: on the training thread each step, where a call costs a frame
        seq = next(self._seq)
        deferred = self._deferred
        if (self._failed or self._stopping
                or len(self._queue) + len(deferred) >= self.max_queue):
            self._drop()
            return False
        deferred.append((mtype, seq, time.time(), finish, arg))
        return True

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        probe = None
        try:
            sock.setsockopt(zmq.SNDHWM, self.socket_hwm)
            sock.setsockopt(zmq.LINGER, int(self.close_timeout_s * 1000))
            sock.setsockopt(zmq.RECONNECT_IVL, 200)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            secure_client(sock, self.endpoint, self.server_key)  # tcp: Curve, or refuse
            sock.connect(self.endpoint)
            probe = self._probe(ctx)
            while True:
                self._wake.wait(self.flush_interval_s)
                stopping = self._stopping
                if probe is not None:
                    self._sync(probe)
                self._drain(sock)
                if stopping:  # wait a little for the device, then give up on what is stuck
                    self._drain_deferred(sock, time.monotonic() + self.close_timeout_s, True)
                    self._drain(sock)  # a last heartbeat queued while stopping
                    if probe is not None:
                        self._await_first_answer(probe)
                    break
                self._drain_deferred(sock, None, False)
        except Exception as exc:  # never let the monitor take the rank down
            self._failed = True
            log.warning("scalemon: sending to %s failed, monitoring is off: %s", self.endpoint, exc)
        finally:
            if probe is not None:
                probe.close(linger=0)
            sock.close()  # waits up to LINGER for queued frames to leave
            ctx.term()

    def _await_first_answer(self, probe: zmq.Socket) -> None:
        """At the end of a process whose hub never answered, wait up to `start_grace_s` for
        it: in a short job on a loaded machine the hub rank 0 started may still be starting,
        and closing now would lose every message of the run (they wait in the socket until
        the hub binds, and the socket keeps them only `close_timeout_s`)."""
        if self._answered is not None or self._failed or self.start_grace_s <= 0:
            return
        end = time.monotonic() + self.start_grace_s
        while self._answered is None and time.monotonic() < end:
            self._sync(probe)
            if self._answered is None:
                probe.poll(50, zmq.POLLIN)

    def _probe(self, ctx: zmq.Context) -> zmq.Socket | None:
        """The DEALER socket of the round trips with the hub's RPC socket."""
        if self.rpc_endpoint is None:
            return None
        probe = ctx.socket(zmq.DEALER)
        probe.setsockopt(zmq.LINGER, 0)
        probe.setsockopt(zmq.SNDHWM, 4)
        secure_client(probe, self.rpc_endpoint, self.server_key)
        probe.connect(self.rpc_endpoint)
        return probe

    @property
    def clock_offset_s(self) -> float | None:
        """The hub's clock minus this host's, from the fastest recent round trip."""
        trips = list(self._round_trips)
        return min(trips)[1] if len(trips) >= 3 else None

    def _sync(self, probe: zmq.Socket) -> None:
        """Read the answer to the request in flight; send the next one when due."""
        while probe.poll(0, zmq.POLLIN):
            self._read_sync(probe.recv_multipart(zmq.NOBLOCK)[-1])
        if self._sync_refused or self._failed and self.hub_version is not None:
            return  # no more round trips: their silence means nothing
        self._check_silence()
        now = time.monotonic()
        overdue = self._sync_sent is not None and now - self._sync_sent > 5.0
        if (self._sync_sent is None or overdue) and now >= self._next_sync:
            try:
                probe.send(protocol.encode_request("sync", rank=self.rank, t=time.time()),
                           zmq.NOBLOCK)
                self._sync_sent = now
            except zmq.Again:
                pass
            self._next_sync = now + self.sync_every_s
            # wait a little for the answer: read late, it would skew the clock estimate
            if self._sync_sent is not None and probe.poll(20, zmq.POLLIN):
                self._read_sync(probe.recv_multipart(zmq.NOBLOCK)[-1])

    def _check_silence(self) -> None:
        """When the hub never answered or stopped answering: say so once in the training
        output (the job is then not monitored, and nothing else would tell), and after
        `replace_after_s` of silence call `on_hub_silent` once per silence (a new hub); a hub
        that never answered counts as silent from `first_answer_warn_s` on."""
        now = time.monotonic()
        answered = self._answered
        if answered is None:
            waited = now - self._started
            if waited >= self.first_answer_warn_s:
                self._warn_never_answered(waited)
            # one that died before it ever answered (killed while it looked for the hub) is
            # replaced too, once, `replace_after_s` after the warning (not while it starts)
            if waited >= self.first_answer_warn_s + self.replace_after_s:
                self._replace(self._started)
            return
        silent = now - answered
        if silent >= self.replace_after_s:
            self._replace(answered)
        if silent >= self.silent_warn_s:
            self.warnings.once(
                "hub-gone", "scalemon: the job's hub at %s stopped answering %.0f s ago: it "
                "died or hangs (see hub.log in the job's run directory); this rank's "
                "metrics are dropped until a hub answers again", self.hub_label, silent)

    def _replace(self, silence: float) -> None:
        """Call `on_hub_silent` once per silence (`silence`: when it began)."""
        if self.on_hub_silent is not None and self._replaced_for != silence:
            self._replaced_for = silence
            try:
                self.on_hub_silent()
            except Exception as exc:
                self.warnings.once("hub-replace", "scalemon: starting a new hub failed: %s",
                                   exc)

    def _warn_never_answered(self, waited: float) -> None:
        """Say once that nothing this rank sends is received, and where to look."""
        if self.configured_by:
            self.warnings.once(
                "hub-never", "scalemon: nothing is being received: the hub at %s (set by %s) "
                "has not answered for %.0f s. Check the address (`scalemon jobs` on the hub's "
                "host lists live hubs)%s; this rank's metrics are dropped until a hub "
                "answers", self.hub_label, self.configured_by, waited,
                ", or unset SCALEMON_HUB so the job starts its own hub"
                if self.configured_by == "SCALEMON_HUB" else "")
        else:
            self.warnings.once(
                "hub-never", "scalemon: the job's hub at %s has not answered for %.0f s: "
                "it did not start or cannot be reached (see hub.log in the job's run "
                "directory, or `scalemon jobs`); this rank's metrics are dropped until it "
                "answers", self.hub_label, waited)

    def _read_sync(self, frame: bytes) -> None:
        """The hub's answer: its version (another major switches sending off), its clock, and
        the commands for this rank."""
        t1 = time.time()
        self._sync_sent = None
        self._answered = time.monotonic()
        try:
            reply = protocol.decode_reply(frame)
            self.hub_version = tuple(reply["v"])  # type: ignore[assignment]
        except protocol.VersionMismatch as exc:
            self.hub_version = exc.theirs
            self._failed = True
            self.warnings.once(
                "hub-version",
                "scalemon: the job's hub at %s speaks protocol %s, this rank's agent (scalemon "
                "%s) speaks %s, so the hub would refuse every message: monitoring is off on "
                "this rank. Install the same scalemon version in the training environment and "
                "where the hub runs.", self.rpc_endpoint, protocol.version_text(exc.theirs),
                scalemon.__version__, protocol.version_text(exc.ours))
            return
        except protocol.ProtocolError as exc:
            if "unknown request op" in str(exc):  # an older hub: no clock, no commands
                self._sync_refused = True
            self.warnings.once("hub-sync", "scalemon: the hub's answer to a sync was unusable: "
                               "%s", exc)
            return
        hang_after = reply.get("hang_after_s")  # the hub's threshold: the agent's too
        if isinstance(hang_after, (int, float)) and hang_after > 0:
            self.hang_after_s = float(hang_after)
        beat = reply.get("heartbeat_stepping_s")  # how often to beat while steps flow
        if isinstance(beat, (int, float)) and not isinstance(beat, bool) and 0 < beat <= 60:
            self.heartbeat_stepping_s = float(beat)
        t0, hub_t = reply.get("t0"), reply.get("t")
        if isinstance(t0, float) and isinstance(hub_t, (int, float)) and 0 <= t1 - t0 < 1.0:
            self._round_trips.append((t1 - t0, hub_t - (t0 + t1) / 2))
        for command in reply.get("commands") or ():
            if self.on_command is not None and isinstance(command, dict):
                try:
                    self.on_command(command)
                except Exception as exc:
                    self.warnings.once(f"command:{command.get('name')}", "scalemon: command "
                                       "%s failed: %s", command.get("name"), exc)

    def _drain(self, sock: zmq.Socket) -> None:
        while self._queue:
            mtype, seq, t, body = self._queue.popleft()
            self._send(sock, mtype, seq, t, body)

    def _drain_deferred(self, sock: zmq.Socket, deadline: float | None, final: bool) -> None:
        while self._deferred:
            mtype, seq, t, finish, arg = self._deferred[0]
            try:
                body = finish(arg, deadline)
            except Exception as exc:
                self._deferred.popleft()
                self._drop(f"building a {mtype} message failed: {type(exc).__name__}: {exc}")
                continue
            if body is None and not final:
                return  # not ready: later messages wait behind it, in order
            self._deferred.popleft()
            if body is None:
                self._drop(f"a {mtype} whose device values never became ready (GPU stuck?)")
            else:
                self._send(sock, mtype, seq, t, body)

    def _send(self, sock: zmq.Socket, mtype: str, seq: int, t: float, body: dict) -> None:
        """Check, pack and send one message; anything the hub would refuse is dropped here,
        with the reason logged once, rather than rejected silently over there."""
        try:
            body = plain_values(body)
            protocol.check_body(mtype, body)
            frame = protocol.encode(mtype, self.job, self.rank, seq, body, t)
        except Exception as exc:
            self._drop(f"invalid {mtype} message: {exc}")
            return
        try:
            sock.send(frame, zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            self._drop()

    def close(self) -> None:
        """Send what is queued (bounded by `close_timeout_s`) and stop the thread."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=self.close_timeout_s * 2 + 1 + self.start_grace_s)
