"""Sending to the hub from a background thread, so the training thread never waits.

The training thread only appends to a bounded deque; it never signals the sender, because a
woken sender would compete for the GIL right when the training thread holds it. A daemon thread
wakes every `flush_interval_s`, owns the ZeroMQ PUSH socket, packs messages and sends them with
NOBLOCK. A full deque or a full socket queue (no hub,
slow hub) drops the message and counts it; the hub sees the drop as a gap in `seq` too.

The thread also asks the hub for its protocol version once (a `ping` on the hub's RPC socket,
answered whenever the hub is up): a hub of another major version would refuse every message,
so the agent says so once, naming both versions, and stops sending.
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
    ) -> None:
        self.endpoint = endpoint
        self.rpc_endpoint = rpc_endpoint
        self.warnings = warnings or Warnings()
        self.hub_version: tuple[int, int] | None = None  # once the hub answered
        self.job = job
        self.rank = rank
        self.max_queue = max_queue
        self.socket_hwm = socket_hwm
        self.close_timeout_s = close_timeout_s
        self.flush_interval_s = flush_interval_s
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
        seq = self._admit()
        if seq is None:
            return False
        self._deferred.append((mtype, seq, time.time(), finish, arg))
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
            sock.connect(self.endpoint)
            probe = self._ask_version(ctx)
            while True:
                self._wake.wait(self.flush_interval_s)
                stopping = self._stopping
                if probe is not None and probe.poll(0, zmq.POLLIN):
                    self._read_version(probe)
                    probe.close(linger=0)
                    probe = None
                self._drain(sock)
                if stopping:  # wait a little for the device, then give up on what is stuck
                    self._drain_deferred(sock, time.monotonic() + self.close_timeout_s, True)
                    self._drain(sock)  # a last heartbeat queued while stopping
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

    def _ask_version(self, ctx: zmq.Context) -> zmq.Socket | None:
        """Send one `ping` to the hub's RPC socket; it queues until the hub is up."""
        if self.rpc_endpoint is None:
            return None
        probe = ctx.socket(zmq.DEALER)
        probe.setsockopt(zmq.LINGER, 0)
        probe.connect(self.rpc_endpoint)
        try:
            probe.send(protocol.encode_request("ping"), zmq.NOBLOCK)
        except zmq.Again:
            probe.close(linger=0)
            return None
        return probe

    def _read_version(self, probe: zmq.Socket) -> None:
        """The hub's answer to the ping: another major version switches sending off."""
        try:
            reply = protocol.decode_reply(probe.recv_multipart(zmq.NOBLOCK)[-1])
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
        except (protocol.ProtocolError, zmq.ZMQError) as exc:
            self.warnings.once("hub-ping", "scalemon: the hub's answer to a ping was unusable: "
                               "%s", exc)

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
        self._thread.join(timeout=self.close_timeout_s * 2 + 1)


def plain_values(body: dict[str, Any]) -> dict[str, Any]:
    """NumPy scalars, 0-d CPU tensors and subclasses of str/int/float in a body (and one level
    down) become plain Python values."""
    if all(type(v) in _PLAIN for v in body.values()):
        return body
    return {k: _plain(v, nested=True) for k, v in body.items()}


_PLAIN = (bool, int, float, str, type(None))
PLAIN_TYPES = _PLAIN  # what a message value may be once made plain


def plain_value(value: Any) -> Any:
    """A NumPy scalar, one-element CPU tensor or str/int/float subclass as a plain Python value;
    anything else unchanged."""
    value = _plain(value)
    one_element_host_tensor = (
        type(value) not in _PLAIN and hasattr(value, "numel") and not getattr(value, "is_cuda", 1)
        and value.numel() == 1
    )
    return value.reshape(()).item() if one_element_host_tensor else value


def _plain(value: Any, nested: bool = False) -> Any:
    if type(value) in _PLAIN:
        return value
    for kind in _PLAIN[:-1]:  # subclasses (torch's version string, IntEnum, np.float64)
        if isinstance(value, kind):
            return kind(value)
    if nested and isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    is_cuda = getattr(value, "is_cuda", False)
    if hasattr(value, "item") and not is_cuda and getattr(value, "ndim", 0) == 0:
        return value.item()  # numpy scalar, 0-d CPU tensor; a CUDA one stays and is refused
    return value
