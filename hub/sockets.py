"""The hub's sockets: made with its options, bound over tcp as Curve servers, and the feed that
publishes on each of them (hub/server.py binds and polls them)."""

from __future__ import annotations

import socket

import zmq

from scalemon.home.address import HubAddress
from scalemon.home.keys import Keypair, secure_server

from .auth import DOMAINS
from .tcpguard import TcpGuard

_MORE = int(zmq.SNDMORE)
MAX_FRAME_BYTES = 16 << 20  # zmq drops a peer sending more than this; decode rejects > 1 MiB


def make_sockets(ctx: zmq.Context,
                 tcp: bool = False) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket]:
    """An unbound ingest PULL, feed XPUB and rpc ROUTER with the hub's options. The feed
    hands up subscriptions (`FanOut` publishes only what someone subscribed to); a tcp one
    every subscription, which tells which key each subscriber is."""
    ingest = ctx.socket(zmq.PULL)
    ingest.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    ingest.setsockopt(zmq.RCVHWM, 100_000)
    feed = ctx.socket(zmq.XPUB)
    feed.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
    if tcp:
        feed.setsockopt(zmq.XPUB_VERBOSE, 1)
    feed.setsockopt(zmq.SNDHWM, 100_000)
    rpc = ctx.socket(zmq.ROUTER)
    rpc.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
    for sock in (ingest, feed, rpc):
        sock.setsockopt(zmq.LINGER, 0)
    return ingest, feed, rpc


def bind_tcp(sockets: tuple[zmq.Socket, ...], where: HubAddress, keys: Keypair,
             guard: TcpGuard | None, ports: dict[zmq.Socket, int]) -> dict[str, str]:
    """Bind ingest/feed/rpc as Curve servers at `where` (port 0: each a free port), noting
    each socket's port in `ports`; returns the endpoints with a host name other nodes
    resolve."""
    host = where.ingest[len("tcp://"):].rpartition(":")[0]
    public = host in ("*", "0.0.0.0", "[::]", "::") or not host
    name = resolvable_host() if public else host.strip("[]")
    bound = {}
    for label, sock, endpoint in zip(("ingest", "feed", "rpc"), sockets,
                                     (where.ingest, where.feed, where.rpc), strict=True):
        secure_server(sock, keys, DOMAINS[label])
        if guard is not None:
            guard.prepare(sock)
        if endpoint.endswith(":0"):
            port = sock.bind_to_random_port(endpoint[:-2])
        else:
            sock.bind(endpoint)
            port = int(endpoint.rpartition(":")[2])
        if guard is not None:
            guard.watch(sock, port)
        ports[sock] = port
        bound[label] = f"tcp://{name}:{port}"
    return bound


class FanOut:
    """The feed: every record goes to each XPUB socket (ipc and, with --listen, tcp) on which
    someone subscribed to a prefix of its topic (`subscription` reads what they asked: a big
    job's dashboards follow the digest, not the records, and the records' frames are then
    not sent at all)."""

    def __init__(self, sockets: list[zmq.Socket]) -> None:
        self.sockets = sockets
        self.topics: dict[zmq.Socket, set[bytes]] = {
            sock: set() for sock in sockets if sock.type == zmq.XPUB}
        """Per XPUB socket, the topic prefixes some subscriber follows (an unsubscription
        comes once the last of them left: libzmq's rule, verbose or not)."""

    def subscription(self, sock: zmq.Socket, message: bytes) -> None:
        """An XPUB socket's (un)subscription message: 1 or 0, then the topic prefix."""
        topics = self.topics.get(sock)
        if topics is None or not message or message[0] not in (0, 1):
            return
        if message[0] == 1:
            topics.add(message[1:])
        else:
            topics.discard(message[1:])

    def wanted(self, sock: zmq.Socket, topic: bytes) -> bool:
        """True when someone on `sock` follows `topic` (a plain PUB socket: always). Asked once
        per batch of records, of a few prefixes."""
        topics = self.topics.get(sock)
        return topics is None or any(topic.startswith(t) for t in topics)

    def send_multipart(self, frames: list[bytes]) -> None:
        """Publish `frames` on every feed socket where its topic is followed (frame by frame
        with a plain int flag: pyzmq's `send_multipart` costs 4x as much per frame, in its
        flag enums)."""
        last = len(frames) - 1
        topic = frames[0]
        for sock in self.sockets:
            if not self.wanted(sock, topic):
                continue
            send = sock.send
            for i, frame in enumerate(frames):
                send(frame, _MORE if i < last else 0)


def resolvable_host() -> str:
    """This host's name as other nodes resolve it: the FQDN where it has one."""
    fqdn = socket.getfqdn()
    return fqdn if fqdn and fqdn != "localhost" else socket.gethostname()
