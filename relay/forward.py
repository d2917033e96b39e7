"""The relay: one per node that is not the hub's, started by that node's local rank 0.

The node's ranks send over ipc, in a 0700 directory on the node's own disk
(`scalemon.home.paths.relay_dir`), to the relay, which forwards to the hub over one CurveZMQ tcp
connection:

- ingest: the ranks' frames go on in batches, one multipart message of up to `BATCH` frames
  every `FLUSH_S` (the hub takes each part as one message), so a node of eight ranks costs the
  hub one receive instead of eight;
- rpc: the ranks' `sync` round trips pass through unchanged (ROUTER to DEALER), so the hub's
  clock and the commands it queued for a rank reach the rank as before (until the hub is
  known they wait, so a rank's first answer comes as soon as the relay reaches the hub);
- report: every `REPORT_S` the relay sends the hub a `relay` request with its counts; the
  replies give the hub's clock, from which the relay estimates its node's clock offset (the
  fastest of the recent round trips, as the agents do).

The relay finds the hub in the job file on the shared `$SCALEMON_HOME` and reads it again
when the hub stops answering (a restarted hub binds new ports); or it is given an address
(`--hub`, `$SCALEMON_HUB`); where neither works and `$SCALEMON_LISTEN` names a fixed port it
tries `$MASTER_ADDR` at that port. It never slows the ranks: what the hub cannot take is dropped
and counted (the hub also sees it as gaps in each rank's `seq`). It exits once its ranks have
been silent for `linger_s`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import threading
import time
from collections import deque
from pathlib import Path

import zmq

from scalemon import protocol, settings
from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.home.keys import NoServerKey, secure_client
from scalemon.home.paths import jobs_dir
from scalemon.settings import node_name
from scalemon.text.safe import CleanStream

log = logging.getLogger("scalemon.relay")

BATCH = 1000
"""Frames forwarded to the hub in one multipart message, at most."""
FLUSH_S = 0.02
REPORT_S = 2.0
SILENT_S = 6.0
"""Without an answer from the hub for this long, look for it again (a new hub, new ports)."""
LOOKUP_WARN_S = 20.0
MAX_PENDING = 200_000
"""Frames held while the hub is not known yet; beyond this they are dropped and counted."""
OWN_ID = b"relay"
"""The routing frame of the relay's own requests on its DEALER (ranks' ids start with 0)."""


class RelayAlreadyRunning(RuntimeError):
    """Another relay serves this job on this node."""


class Relay:
    """Forwards one node's ranks to the job's hub. `serve_forever()` runs until stopped or the
    ranks went silent."""

    def __init__(self, job: str, directory: Path, home: Path | None = None,
                 hub: str | None = None, linger_s: float = 60.0,
                 report_s: float = REPORT_S, silent_s: float = SILENT_S,
                 node: str | None = None) -> None:
        self.job = job
        self.node = node or node_name()  # a simulator stands for many nodes in one process
        self.directory = directory
        self.home = home
        self.fixed_hub = hub
        self.linger_s = linger_s
        self.report_s = report_s
        self.silent_s = silent_s
        self.local = HubAddress.for_directory(directory)
        self._lock_file = _take_lock(directory / "relay.lock", job)
        self.received = 0
        self.forwarded = 0
        self.dropped = 0
        self.started = time.time()
        self.upstream: HubAddress | None = None
        self._pending: deque[bytes] = deque()
        self._last_forward = 0.0
        self._round_trips: deque[tuple[float, float]] = deque(maxlen=8)
        self._report_sent: float | None = None
        self._next_report = 0.0
        self._answered: float | None = None
        self._connected_at = 0.0
        self._next_lookup = 0.0
        self._looking_since = time.monotonic()
        self._warned: set[str] = set()
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
        """The hub's tcp endpoints with its key: the given address, else the job file, else
        $MASTER_ADDR at the fixed port of $SCALEMON_LISTEN; None while none is known."""
        if self.fixed_hub:
            return HubAddress.parse(self.fixed_hub)
        path = jobs_dir(self.home) / f"{self.job}.json"
        try:
            jf = JobFile.read(path)
        except (ValueError, OSError):  # unreadable, or not trusted (another user's, a link)
            jf = None
        if jf is not None and jf.serving() and jf.tcp:
            return HubAddress(jf.tcp["ingest"], jf.tcp["feed"], jf.tcp["rpc"],
                              server_key=jf.server_key)
        waited = time.monotonic() - self._looking_since
        fallback = _master_addr_hub()
        if waited >= LOOKUP_WARN_S:
            self._warn_once("lookup", self._lookup_text(path, jf, waited, fallback))
            if fallback is not None:
                return fallback
        return None

    def _lookup_text(self, path: Path, jf: JobFile | None, waited: float,
                     fallback: HubAddress | None) -> str:
        if jf is None:
            why = (f"no job file {path} after {waited:.0f} s: is $SCALEMON_HOME "
                   f"({path.parent.parent}) shared between this node and rank 0's? ")
        elif not jf.tcp:
            why = (f"the hub of job {self.job} (on {jf.host}) does not listen on tcp: start "
                   "it with --listen tcp://*:0 (SCALEMON_LISTEN). ")
        else:
            why = f"the job file {path} says the job {jf.state}. "
        if fallback is not None:
            return why + f"Trying the hub at {fallback.base} ($MASTER_ADDR, $SCALEMON_LISTEN)"
        return why + ("Set SCALEMON_HOME to a directory every node shares, or SCALEMON_LISTEN "
                      "to a fixed port (tcp://*:PORT) on every node so relays find the hub at "
                      "$MASTER_ADDR; until then this node's metrics are held, then dropped")

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
        push.connect(address.ingest)
        dealer.connect(address.rpc)
        log.info("relay of job %s on %s forwarding to %s", self.job, self.node, address.base)
        return push, dealer

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
            self._report(dealer, now)
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
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()
        self._lock_file.close()
        log.info("relay of job %s on %s stopped: %d received, %d forwarded, %d dropped",
                 self.job, self.node, self.received, self.forwarded, self.dropped)

    def _hub_silent(self, now: float) -> bool:
        last = self._answered if self._answered is not None else self._connected_at
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
        self._answered = None
        self._round_trips.clear()
        self._report_sent = None
        self._next_report = 0.0
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
        for _ in range(1000):
            try:
                frames = rpc.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            with contextlib.suppress(zmq.Again):  # the rank asks again later
                dealer.send_multipart(frames, zmq.NOBLOCK)

    def _pass_replies(self, dealer: zmq.Socket, rpc: zmq.Socket) -> None:
        for _ in range(1000):
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if frames[0] == OWN_ID:
                self._read_report_reply(frames[-1])
                continue
            with contextlib.suppress(zmq.ZMQError):  # the rank went away
                rpc.send_multipart(frames, zmq.NOBLOCK)

    # --- the relay's own report and clock -------------------------------------------------
    @property
    def clock_offset_s(self) -> float | None:
        """The hub's clock minus this node's, from the fastest recent round trip."""
        trips = list(self._round_trips)
        return min(trips)[1] if len(trips) >= 3 else None

    def stats(self) -> dict[str, int | float | None]:
        """Counts since the relay started, and the node's clock offset."""
        return {"received": self.received, "forwarded": self.forwarded,
                "dropped": self.dropped, "pending": len(self._pending),
                "started": self.started, "clock_offset_s": self.clock_offset_s}

    def _report(self, dealer: zmq.Socket, now: float) -> None:
        overdue = self._report_sent is not None and now - self._report_sent > 5.0
        if (self._report_sent is None or overdue) and now >= self._next_report:
            request = protocol.encode_request("relay", node=self.node, pid=os.getpid(),
                                              t=time.time(), stats=self.stats())
            with contextlib.suppress(zmq.Again):
                dealer.send_multipart([OWN_ID, request], zmq.NOBLOCK)
                self._report_sent = now
            # round trips are quick at first (3 in a second) so the clock is known early
            self._next_report = now + (self.report_s if len(self._round_trips) >= 3 else 0.3)

    def _read_report_reply(self, frame: bytes) -> None:
        t1 = time.time()
        self._report_sent = None
        self._answered = time.monotonic()
        try:
            reply = protocol.decode_reply(frame)
        except protocol.ProtocolError as exc:
            self._warn_once("reply", f"the hub's answer was unusable: {exc}")
            return
        if not reply.get("ok", True):
            self._warn_once("refused", f"the hub refused the relay's report: {reply.get('error')}")
            return
        t0, hub_t = reply.get("t0"), reply.get("t")
        if isinstance(t0, float) and isinstance(hub_t, (int, float)) and 0 <= t1 - t0 < 1.0:
            self._round_trips.append((t1 - t0, hub_t - (t0 + t1) / 2))

    def _ranks_gone(self, now: float, started: float) -> bool:
        last = self._last_rank_frame
        if last is None:  # ranks that never came: wait longer before giving up
            return now - started > max(self.linger_s, 300.0)
        return now - last > self.linger_s and not self._pending


def _master_addr_hub() -> HubAddress | None:
    """tcp://$MASTER_ADDR:PORT where $SCALEMON_LISTEN names a fixed PORT, else None."""
    listen, master = settings.raw("SCALEMON_LISTEN") or "", os.environ.get("MASTER_ADDR")
    port = listen.rpartition(":")[2]
    if not master or not listen.startswith("tcp://") or not port.isdigit() or port == "0":
        return None
    try:
        return HubAddress.parse(f"tcp://{master}:{port}")
    except ValueError:  # a port past 65533: the hub could not bind it either
        return None


def _take_lock(path: Path, job: str):  # noqa: ANN202 - file object held for the relay's life
    f = open(path, "a+")  # noqa: SIM115
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RelayAlreadyRunning(f"a relay for job {job!r} already runs on this node") from None
    f.truncate(0)
    with contextlib.suppress(OSError):
        f.write(str(os.getpid()))
        f.flush()
    return f


def install_signal_handlers(relay: Relay) -> None:
    """SIGTERM/SIGINT stop the relay cleanly."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: relay.stop())


def main(argv: list[str] | None = None) -> int:
    """`python -m scalemon.hub.relay --job ID`: run this node's relay in the foreground."""
    import sys

    from scalemon.home.paths import relay_dir
    from scalemon.options import Parser, job_id, seconds

    parser = Parser(prog="scalemon relay", description=__doc__)
    parser.add_argument("--job", required=True, type=job_id, metavar="ID", help="job id")
    parser.add_argument("--home", type=Path, metavar="DIR",
                        help="scalemon home holding jobs/ and keys/ (default: $SCALEMON_HOME)")
    parser.add_argument("--hub", default=settings.raw("SCALEMON_HUB"),
                        metavar="tcp://HOST:PORT",
                        help="the hub's address (default: $SCALEMON_HUB, else the job file)")
    parser.add_argument("--linger", type=seconds(0.0, above=True), default=60.0, metavar="S",
                        help="exit once no rank of this node spoke for S seconds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,  # control characters of ranks' text shown
                        format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=CleanStream(sys.stderr))
    try:
        relay = Relay(args.job, relay_dir(args.job), home=args.home, hub=args.hub,
                      linger_s=args.linger)
    except (RelayAlreadyRunning, ValueError, OSError) as exc:
        print(f"scalemon relay: {exc}", file=sys.stderr)
        return 2
    install_signal_handlers(relay)
    relay.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
