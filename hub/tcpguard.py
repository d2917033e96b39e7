"""A cap on the hub's TCP connections, so that connections held open by anyone who reaches a
port (no key needed: the Curve handshake comes after the connection) cannot use up the hub's
file descriptors. libzmq has no per-socket connection limit, and running out is fatal: its ipc
listener aborts the process when accept() fails with EMFILE.

Each tcp socket has a monitor; the guard counts the connections it accepted. Over the socket's
cap, it shuts down (shutdown(2), libzmq then closes them) its oldest connections that are
younger than the handshake deadline: only those can still be mid-handshake (unauthenticated),
since libzmq drops a connection whose handshake took longer (ZMQ_HANDSHAKE_IVL). Connections
older than that passed the handshake and are left alone. A new client's request, answered in
milliseconds, gets through while idle ones are shed oldest first.

One source address may hold at most `source_cap` connections of a socket (a quarter of its cap):
past it, that source's connections are shed, those that may be mid-handshake first, then its
newest. So a peer that holds connections open, even authenticated ones (an admitted key), uses
up its own share only, and others still get in.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("scalemon.hub")

HANDSHAKE_IVL_MS = 5000
"""A tcp peer must finish its Curve handshake this fast, or libzmq drops it."""
FD_RESERVE = 128
"""File descriptors kept out of the tcp connections' share (ipc peers, files, libzmq)."""
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


@dataclass
class _Watched:
    sock: zmq.Socket
    monitor: zmq.Socket
    port: int
    conns: dict[int, float] = field(default_factory=dict)  # fd -> monotonic accept time
    sources: dict[int, str] = field(default_factory=dict)  # fd -> the peer's address
    per_source: Counter[str] = field(default_factory=Counter)

    def forget(self, fd: int) -> None:
        """Stop counting connection `fd`."""
        self.conns.pop(fd, None)
        source = self.sources.pop(fd, None)
        if source is not None:
            self.per_source[source] -= 1
            if self.per_source[source] <= 0:
                del self.per_source[source]


class TcpGuard:
    """Counts and caps the accepted connections of the hub's tcp sockets."""

    def __init__(self, fd_limit: int, handshake_s: float = HANDSHAKE_IVL_MS / 1000) -> None:
        self.fd_limit = fd_limit
        self.handshake_s = handshake_s
        self.watched: list[_Watched] = []
        self.shed = 0
        self.shed_by_source = 0
        self.cap = 0
        self.source_cap = 0
        self._rounds = 0  # times connections were shed

    def prepare(self, sock: zmq.Socket) -> None:
        """Set the handshake deadline of `sock` (before it binds: a listener copies it)."""
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(self.handshake_s * 1000))

    def watch(self, sock: zmq.Socket, port: int) -> zmq.Socket:
        """Monitor `sock` (bound at tcp `port`); returns the monitor socket to poll."""
        monitor = sock.get_monitor_socket(_EVENTS)
        self.watched.append(_Watched(sock, monitor, port))
        return monitor

    def set_caps(self) -> None:
        """Share the descriptors left after FD_RESERVE (and those open now): half of them
        among the tcp sockets, the other half a margin for bursts the monitors report late."""
        if not self.watched:
            return
        spare = self.fd_limit - _open_fds() - FD_RESERVE
        self.cap = max(8, spare // 2 // len(self.watched))
        self.source_cap = max(4, self.cap // 4)
        log.info("tcp connections capped at %d per socket, %d per source address (open-files "
                 "limit %d)", self.cap, self.source_cap, self.fd_limit)

    @property
    def monitors(self) -> list[zmq.Socket]:
        """The sockets to poll for events."""
        return [w.monitor for w in self.watched]

    def connections(self) -> int:
        """Accepted tcp connections open now (as the monitors told)."""
        return sum(len(w.conns) for w in self.watched)

    def on_events(self, monitor: zmq.Socket, now: float | None = None) -> None:
        """Take `monitor`'s events, then shed connections over the cap."""
        now = time.monotonic() if now is None else now
        watched = next(w for w in self.watched if w.monitor is monitor)
        for _ in range(10_000):
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                watched.forget(fd)  # a number reused before its close was told
                watched.conns[fd] = now
                source = _peer_host(fd)
                if source is not None:
                    watched.sources[fd] = source
                    watched.per_source[source] += 1
            elif event["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                watched.forget(fd)
        self._shed_sources(watched, now)
        self._shed(watched, now)

    def _shed_sources(self, watched: _Watched, now: float) -> None:
        """Shed the connections of each source address over `source_cap`: those that may be
        mid-handshake first (oldest first), then its newest."""
        if not self.source_cap:
            return
        for source, count in list(watched.per_source.items()):
            excess = count - self.source_cap
            if excess <= 0:
                continue
            mine = [(t, fd) for fd, t in watched.conns.items()
                    if watched.sources.get(fd) == source]
            young = sorted(e for e in mine if now - e[0] < self.handshake_s + 1.0)
            old = sorted((e for e in mine if now - e[0] >= self.handshake_s + 1.0),
                         reverse=True)
            for _, fd in (young + old)[:excess]:
                if shutdown_connection(fd, watched.port):
                    self.shed += 1
                    self.shed_by_source += 1
                watched.forget(fd)
            self._rounds += 1
            if self._rounds <= 20 or self._rounds % 1000 == 0:
                log.warning("tcp port %d: %s holds %d connections, over the %d one source may "
                            "hold: shed %d", watched.port, source, count, self.source_cap,
                            excess)

    def _shed(self, watched: _Watched, now: float) -> None:
        excess = len(watched.conns) - self.cap
        if excess <= 0:
            return
        young = sorted((t, fd) for fd, t in watched.conns.items()
                       if now - t < self.handshake_s + 1.0)
        excess += max(1, self.cap // 10)  # some room, so each burst is shed at once
        for _, fd in young[:excess]:
            if shutdown_connection(fd, watched.port):
                self.shed += 1
            watched.forget(fd)  # its DISCONNECTED event may still come
        self._rounds += 1
        if self._rounds <= 20 or self._rounds % 1000 == 0:  # the first 20, then every 1000th
            log.warning("tcp port %d over its cap of %d connections: shed %d that may not be "
                        "authenticated yet (%d shed so far)", watched.port, self.cap,
                        min(excess, len(young)), self.shed)

    def accepted_at(self, port: int, fd: int) -> float | None:
        """When the guard saw connection `fd` of the socket at `port` accepted (None: not
        among the connections it counts)."""
        for w in self.watched:
            if w.port == port:
                return w.conns.get(fd)
        return None

    def close(self) -> None:
        """Stop monitoring (before the sockets close)."""
        for w in self.watched:
            with contextlib.suppress(zmq.ZMQError):
                w.sock.disable_monitor()
            w.monitor.close(linger=0)


def shutdown_connection(fd: int, port: int) -> bool:
    """Shut down connection `fd` if it is still a tcp connection to our `port` (the number may
    have been reused since); libzmq sees the end and closes the descriptor itself."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or \
                sock.getsockname()[1] != port:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()  # the descriptor stays libzmq's


def _peer_host(fd: int) -> str | None:
    """The address of the peer of connection `fd` (None when it is already gone)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        return str(sock.getpeername()[0])
    except (OSError, IndexError):
        return None
    finally:
        sock.detach()


def _open_fds() -> int:
    """Descriptors open in this process now."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64
