"""The relay's forwarding loop: the node's ipc sockets bound, the ranks' frames forwarded to the
hub in batches, their round trips passed through, and the relay's lock on its node (see the
package's text for the whole)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from pathlib import Path

import zmq

from scalemon.home.address import HubAddress
from scalemon.home.keys import NoServerKey, secure_client
from scalemon.home.pidlock import take_lock
from scalemon.settings import node_name

from .report import OWN_ID, REPORT_S, Report
from .upstream import HubFinder

log = logging.getLogger("scalemon.relay")

BATCH = 1000
"""Frames forwarded to the hub in one multipart message, at most."""
FLUSH_S = 0.02
SILENT_S = 6.0
"""Without an answer from the hub for this long, look for it again (a new hub, new ports)."""
MAX_PENDING = 200_000
"""Frames held while the hub is not known yet; beyond this they are dropped and counted."""


class RelayAlreadyRunning(RuntimeError):
    """Another relay serves this job on this node."""


class Relay:
    """Forwards one node's ranks to the job's hub. `serve_forever()` runs until stopped or the
    ranks went silent."""

    def __init__(self, job: str, directory: Path, home: Path | None = None,
                 hub: str | None = None, linger_s: float = 60.0,
                 report_s: float = REPORT_S, silent_s: float = SILENT_S,
                 node: str | None = None, source: str | None = None) -> None:
        self.job = job
        self.node = node or node_name()  # a simulator stands for many nodes in one process
        self.source = source
        """The local address the relay's tcp connections leave from (default: the system's
        choice); a simulator of many nodes on one machine gives each its own loopback one."""
        self.directory = directory
        self.home = home
        self.linger_s = linger_s
        self.silent_s = silent_s
        self.local = HubAddress.for_directory(directory)
        self._lock_file = take_lock(directory / "relay.lock", lambda _pid: RelayAlreadyRunning(
            f"a relay for job {job!r} already runs on this node"))
        self.received = 0
        self.forwarded = 0
        self.dropped = 0
        self.started = time.time()
        self.upstream: HubAddress | None = None
        self._pending: deque[bytes] = deque()
        self._last_forward = 0.0
        self._connected_at = 0.0
        self._next_lookup = 0.0
        self._warned: set[str] = set()
        self.finder = HubFinder(job, home, hub, self._warn_once)
        self.report = Report(self.node, report_s, self._warn_once)
        self._last_rank_frame: float | None = None
        self._stop = threading.Event()
        self._ctx: zmq.Context | None = None  # set by open()
        self._own_ctx = False
        self._ingest: zmq.Socket | None = None
        self._rpc: zmq.Socket | None = None
        self._push: zmq.Socket | None = None
        self._dealer: zmq.Socket | None = None
        self._opened = 0.0

    # --- finding the hub ------------------------------------------------------------------
    def find_hub(self) -> HubAddress | None:
        """The hub's tcp endpoints with its key, None while none is known (`upstream.py`)."""
        return self.finder.find()

    def _warn_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("relay of job %s on %s: %s", self.job, self.node, text)

    def _connect(self, ctx: zmq.Context, address: HubAddress) -> tuple[zmq.Socket, zmq.Socket]:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 1000)  # multipart batches: up to BATCH frames each
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.RECONNECT_IVL, 200)
        push.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, 10_000)
        try:
            secure_client(push, address.ingest, address.server_key, self.home)
            secure_client(dealer, address.rpc, address.server_key, self.home)
        except BaseException:
            push.close(linger=0)
            dealer.close(linger=0)
            raise
        push.connect(self._from_source(address.ingest))
        dealer.connect(self._from_source(address.rpc))
        log.info("relay of job %s on %s forwarding to %s", self.job, self.node, address.base)
        return push, dealer

    def _from_source(self, endpoint: str) -> str:
        """`endpoint`, connected from `source` when one is set (libzmq's `src;dest` form)."""
        if self.source is None or not endpoint.startswith("tcp://"):
            return endpoint
        return f"tcp://{self.source}:0;{endpoint[len('tcp://'):]}"

    # --- main loop ------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask `serve_forever` to return (thread-safe)."""
        self._stop.set()

    def serve_forever(self) -> None:
        """Bind the node's ipc sockets and forward until stopped or the ranks went silent."""
        self.open()
        try:
            while not self._stop.is_set():
                if not self.poll_once(int(FLUSH_S * 1000)):
                    log.info("relay of job %s on %s: no rank spoke for %.0f s, exiting",
                             self.job, self.node, self.linger_s)
                    break
        finally:
            self.close()

    # One process may drive many relays (the simulator of bench/scale.py): `open` each on a
    # shared context, then in turn `poll_sockets` of every relay, one poll over all of them,
    # and `handle` of every relay with what the poll found; `close` each at the end.
    def open(self, ctx: zmq.Context | None = None) -> None:
        """Bind the node's ipc sockets, on `ctx` when given (else on a context of its own,
        terminated by `close`)."""
        self._own_ctx = ctx is None
        self._ctx = zmq.Context() if ctx is None else ctx
        ingest = self._ctx.socket(zmq.PULL)
        ingest.setsockopt(zmq.RCVHWM, 100_000)
        ingest.setsockopt(zmq.MAXMSGSIZE, 16 << 20)
        rpc = self._ctx.socket(zmq.ROUTER)
        rpc.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        self._ingest, self._rpc = ingest, rpc
        self._push = self._dealer = None
        for sock in (ingest, rpc):
            sock.setsockopt(zmq.LINGER, 0)
        ingest.bind(self.local.ingest)
        rpc.bind(self.local.rpc)
        self._opened = time.monotonic()

    def poll_sockets(self, now: float) -> list[zmq.Socket]:
        """Look for the hub when due (`now`: time.monotonic()), then the sockets to wait on
        for input: the ranks' ingest and rpc, and the hub's replies once connected."""
        if self._dealer is None or self._hub_silent(now):
            self._push, self._dealer = self._reconnect(self._ctx, self._push, self._dealer, now)
        if self._dealer is None:  # the ranks' round trips wait in `rpc` until a hub is known
            return [self._ingest]
        return [self._ingest, self._rpc, self._dealer]

    def handle(self, events: dict[zmq.Socket, int], now: float) -> bool:
        """Take what the poll found (`events`: socket -> flags, of this relay or of many),
        forward, report; False once the ranks have been silent for `linger_s`."""
        ingest, rpc, push, dealer = self._ingest, self._rpc, self._push, self._dealer
        if ingest in events:
            self._take(ingest)
        if rpc in events and dealer is not None:
            self._pass_requests(rpc, dealer)
        if dealer is not None and dealer in events:
            self._pass_replies(dealer, rpc)
        moment = time.monotonic()
        if push is not None and (len(self._pending) >= BATCH
                                 or moment - self._last_forward >= FLUSH_S):
            self._forward(push)  # batches: what came within FLUSH_S goes as one message
            self._last_forward = moment
        if dealer is not None:
            self.report.send_if_due(dealer, now, self.stats)
        return not self._ranks_gone(now, self._opened)

    def poll_once(self, timeout_ms: int) -> bool:
        """One turn of the loop: wait up to `timeout_ms` for the ranks or the hub, forward,
        report; False once the ranks have been silent for `linger_s`."""
        now = time.monotonic()
        poller = zmq.Poller()
        for sock in self.poll_sockets(now):
            poller.register(sock, zmq.POLLIN)
        return self.handle(dict(poller.poll(timeout=timeout_ms)), now)

    def close(self) -> None:
        """Close the sockets (and the relay's own context), release the node's lock."""
        for sock in (self._ingest, self._rpc, self._push, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._ingest = self._rpc = self._push = self._dealer = None
        self.report.looks.close()
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()
        self._lock_file.close()
        log.info("relay of job %s on %s stopped: %d received, %d forwarded, %d dropped",
                 self.job, self.node, self.received, self.forwarded, self.dropped)

    def _hub_silent(self, now: float) -> bool:
        answered = self.report.answered
        last = answered if answered is not None else self._connected_at
        return now - last > self.silent_s and now >= self._next_lookup

    def _reconnect(self, ctx: zmq.Context, push: zmq.Socket | None, dealer: zmq.Socket | None,
                   now: float) -> tuple[zmq.Socket | None, zmq.Socket | None]:
        """Look the hub up again; reconnect when its address changed (or none was known)."""
        self._next_lookup = now + 1.0
        try:
            address = self.find_hub()
        except ValueError as exc:
            self._warn_once("address", str(exc))
            return push, dealer
        if address is None or (dealer is not None and address == self.upstream):
            if dealer is not None:
                self._connected_at = now  # same hub: keep waiting for it a while longer
            return push, dealer
        for sock in (push, dealer):
            if sock is not None:
                sock.close(linger=0)
        try:
            push, dealer = self._connect(ctx, address)
        except (NoServerKey, ValueError, zmq.ZMQError) as exc:
            self._warn_once(f"connect:{address.base}", f"cannot connect to the hub at "
                            f"{address.base}: {exc}")
            return None, None
        self.upstream = address
        self._connected_at = now
        self.report.reset()
        return push, dealer

    def _take(self, ingest: zmq.Socket) -> None:
        for _ in range(BATCH * 10):
            try:
                frame = ingest.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.received += 1
            self._last_rank_frame = time.monotonic()
            if len(self._pending) >= MAX_PENDING:
                self.dropped += 1
                continue
            self._pending.append(frame)

    def _forward(self, push: zmq.Socket) -> None:
        pending = self._pending
        while pending:
            n = min(len(pending), BATCH)
            batch = [pending.popleft() for _ in range(n)]
            try:
                push.send_multipart(batch, zmq.NOBLOCK)
                self.forwarded += n
            except zmq.Again:  # the hub cannot keep up, or is gone: drop and count
                self.dropped += n

    def _pass_requests(self, rpc: zmq.Socket, dealer: zmq.Socket) -> None:
        """The ranks' requests: syncs answered here once the relay can (`syncs.py`), the
        rest passed on to the hub."""
        syncs, offset = self.report.syncs, self.clock_offset_s
        for _ in range(1000):
            try:
                frames = rpc.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = syncs.answer(frames[-1], offset)
            if reply is not None:
                with contextlib.suppress(zmq.ZMQError):  # the rank went away
                    rpc.send_multipart([*frames[:-1], reply], zmq.NOBLOCK)
                continue
            with contextlib.suppress(zmq.Again):  # the rank asks again later
                dealer.send_multipart(frames, zmq.NOBLOCK)

    def _pass_replies(self, dealer: zmq.Socket, rpc: zmq.Socket) -> None:
        for _ in range(1000):
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if frames[0] == OWN_ID:
                self.report.read_reply(frames[-1])
                continue
            with contextlib.suppress(zmq.ZMQError):  # the rank went away
                rpc.send_multipart(frames, zmq.NOBLOCK)

    # --- the relay's own counts and clock ------------------------------------------------
    @property
    def clock_offset_s(self) -> float | None:
        """The hub's clock minus this node's, from the fastest recent round trip."""
        return self.report.clock_offset_s

    def stats(self) -> dict[str, int | float | None]:
        """Counts since the relay started, and the node's clock offset."""
        return {"received": self.received, "forwarded": self.forwarded,
                "dropped": self.dropped, "pending": len(self._pending),
                "syncs_answered": self.report.syncs.answered,
                "started": self.started, "clock_offset_s": self.clock_offset_s}

    def _ranks_gone(self, now: float, started: float) -> bool:
        last = self._last_rank_frame
        if last is None:  # ranks that never came: wait longer before giving up
            return now - started > max(self.linger_s, 300.0)
        return now - last > self.linger_s and not self._pending
