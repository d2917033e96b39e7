"""Talking to a hub from the CLI or a dashboard: requests, and a gapless history-then-live stream.

`HubStream.poll()` returns every record of the job's history exactly once and in order: it
subscribes to the live feed first, pages the history in over RPC, drops feed records it already
has and fetches any range the feed skipped (slow subscriber, late connect).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import zmq

from scalemon import protocol, settings
from scalemon.home.address import HubAddress
from scalemon.home.keys import HUB_KEY_ENV, NoServerKey, secure_client, server_key_for
from scalemon.protocol import Message, ProtocolError

PAGE = 10_000


class HubUnreachable(ConnectionError):
    """The hub did not answer in time."""


class HistoryReset(ProtocolError):
    """The records this stream delivered are no longer the hub's: another history under the
    same name (another id), a shorter one, or a hub restarted on the same file that lost
    records this stream had delivered. Start over from record 0; the text says which."""


def _where(address: HubAddress) -> str:
    """The hub as the user gave it: `tcp://h:5555 (requests go to its port 5557; a tcp hub
    listens on ports 5555-5557)`, `tcp://h:4100,4000,3900 (requests go to its port 3900)`,
    `ipc:///dir (socket rpc.sock)`."""
    base = address.base
    if address.rpc.startswith("tcp://"):
        first, rpc = address.ingest.rpartition(":")[2], address.rpc.rpartition(":")[2]
        if "," in base or not first.isdigit() or not rpc.isdigit() or int(rpc) < int(first):
            return f"{base} (requests go to its port {rpc})"  # each port said in `base`
        return (f"{base} (requests go to its port {rpc}; a tcp hub listens on ports "
                f"{first}-{rpc})")
    return f"{base} (socket {address.rpc.rpartition('/')[2]})"


def _what_to_check(address: HubAddress) -> str:
    """What to check when a hub does not answer, for its kind of address."""
    if not address.rpc.startswith("tcp://"):
        return "is the job's hub running? (`scalemon jobs` lists live hubs)"
    host = address.rpc[len("tcp://"):].rpartition(":")[0]
    return (f"check that the hub still runs on {host} (its job ended? `scalemon jobs` there), "
            f"that this machine reaches {host} on that port (a firewall?), and that your key "
            "is in the hub's $SCALEMON_HOME/keys/authorized (a refused key gets no answer; "
            "the hub's log names it)")


def hub_key_problem(address: HubAddress) -> str | None:
    """None when talking to `address` needs no hub key (ipc) or one is known
    (`keys.server_key_for`); else what is missing and how to get it, for a command to say
    before it connects or draws anything."""
    if not address.rpc.startswith("tcp://"):
        return None
    try:
        server_key_for(address.rpc, address.server_key)
    except NoServerKey as exc:
        if address.server_key or settings.raw(HUB_KEY_ENV):
            return str(exc)  # a key was given and is none: the text says which
        return (f"the hub's public key is missing for {address.base}: scalemon talks TCP only "
                f"with CurveZMQ and must know it. Print it on the hub's host with `scalemon "
                f"keys show --hub` (as the hub's user, with its SCALEMON_HOME) and pass it here "
                f"as {HUB_KEY_ENV}=KEY (`scalemon jobs --connect JOB` there prints the whole "
                "command), or use the hub's SCALEMON_HOME")
    return None


class HubClient:
    """Request/reply with one hub. Not thread-safe: use one per thread."""

    def __init__(
        self, address: HubAddress, timeout_s: float = 5.0, ctx: zmq.Context | None = None
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.ctx = ctx or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self.history: dict[str, Any] | None = None  # the identity in the last reply

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = self.ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            try:  # tcp: a Curve client, or no connection at all
                secure_client(self._sock, self.address.rpc, self.address.server_key)
            except BaseException:
                self.close()
                raise
            self._sock.connect(self.address.rpc)
        return self._sock

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; raises HubUnreachable or ProtocolError."""
        sock = self._socket()
        sock.send(protocol.encode_request(op, **args))
        if not sock.poll(int(self.timeout_s * 1000), zmq.POLLIN):
            self.close()  # a late reply must not be taken for the next request's
            raise HubUnreachable(
                f"no answer from the hub at {_where(self.address)} within "
                f"{self.timeout_s:g} s: {_what_to_check(self.address)}")
        reply = protocol.decode_reply(sock.recv_multipart()[-1])
        if isinstance(reply.get("history"), dict):
            self.history = reply["history"]
        return reply

    def state(self) -> dict[str, Any]:
        """The hub's `state` reply: {"state": job state JSON, "hub": counters, "head": n}."""
        return self.request("state")

    def fetch(self, since: int, limit: int = PAGE) -> tuple[list[bytes], int]:
        """History records from `since`; returns (records, head)."""
        reply = self.request("fetch", since=since, limit=limit)
        return reply["records"], reply["head"]

    def close(self) -> None:
        """Close the socket (a new one is made on the next request)."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


def feed_subscriber(ctx: zmq.Context, address: HubAddress, *topics: bytes) -> zmq.Socket:
    """A SUB socket on the hub's feed, subscribed to `topics` and connected (no limit on what
    it queues: the reader decides what to drop)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 0)
    for topic in topics:
        sub.setsockopt(zmq.SUBSCRIBE, topic)
    try:
        secure_client(sub, address.feed, address.server_key)
    except BaseException:
        sub.close(linger=0)
        raise
    sub.connect(address.feed)
    return sub


def received(sub: zmq.Socket, timeout_ms: int) -> Iterator[list[bytes]]:
    """The messages queued on `sub`, one at a time, after waiting up to `timeout_ms` for the
    first; what a caller stops before (an error) stays queued."""
    if sub.poll(timeout_ms, zmq.POLLIN):
        while True:
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            yield frames


class HubStream:
    """Every history record of a hub, exactly once, then live ones as they come."""

    def __init__(self, address: HubAddress, since: int = 0, timeout_s: float = 5.0,
                 identity: dict[str, Any] | None = None) -> None:
        self.client = HubClient(address, timeout_s)
        self.identity = identity  # of the history the delivered records came from
        try:
            self.sub = feed_subscriber(self.client.ctx, address, protocol.FEED_TOPIC)
        except BaseException:
            self.client.close()
            raise
        self.next_seq = since
        self.rejected = 0
        self._last_sync = 0.0
        self._undelivered: list[tuple[int, Message]] = []  # kept if a call fails half-way

    def poll(self, timeout_s: float = 0.1, sync_every_s: float = 1.0) -> list[tuple[int, Message]]:
        """Records that arrived since the last call (waits up to `timeout_s` for the first).

        Raises HubUnreachable or HistoryReset; records taken before the error are returned by
        the next call, so none is lost or repeated."""
        out = self._undelivered
        for frames in received(self.sub, 0 if out else int(timeout_s * 1000)):
            self._take_batch(frames, out)
        now = time.monotonic()
        if not out and now - self._last_sync >= sync_every_s:
            self._last_sync = now
            self.catch_up(out)
        self._undelivered = []
        return out

    def catch_up(self, out: list[tuple[int, Message]]) -> None:
        """Fetch everything from `next_seq` to the hub's head over RPC."""
        self._fetch(None, out)

    def _fetch(self, stop: int | None, out: list[tuple[int, Message]]) -> None:
        """Fetch records from `next_seq` up to `stop` (None: the hub's head) in pages."""
        while stop is None or self.next_seq < stop:
            limit = PAGE if stop is None else min(PAGE, stop - self.next_seq)
            records, head = self.client.fetch(self.next_seq, limit)
            self.check_identity(self.client.history)
            if head < self.next_seq:
                raise HistoryReset(
                    f"the hub holds {head} records but {self.next_seq} were already delivered"
                )
            self._take(self.next_seq, records, out)
            if not records or (stop is None and self.next_seq >= head):
                return

    def check_identity(self, identity: dict[str, Any] | None) -> None:
        """Raise HistoryReset when `identity` (from a reply or the feed) says the records
        delivered so far are not this history's; else remember it."""
        if identity is None:
            return
        known = self.identity
        if known is not None and self.next_seq > 0:
            if identity["id"] != known["id"]:
                raise HistoryReset(
                    f"the hub now serves another history (id {identity['id']}, was "
                    f"{known['id']}): its run directory was recreated; starting over")
            if identity["base"] != known["base"] and identity["base"] < self.next_seq:
                raise HistoryReset(
                    f"the hub restarted and kept {identity['base']} records of this history, "
                    f"but {self.next_seq} were delivered: records from {identity['base']} on "
                    "were lost with the old hub and may be numbered anew; starting over")
        self.identity = identity

    def _take_batch(self, frames: list[bytes], out: list[tuple[int, Message]]) -> None:
        try:
            first = protocol.unpack_seq(frames[1])
        except (IndexError, ProtocolError):
            self.rejected += 1
            return
        self.check_identity(protocol.parse_feed_topic(frames[0]))
        records = frames[2:]
        if first > self.next_seq:
            self._fetch(first, out)
        self._take(first, records, out)

    def _take(self, first: int, records: list[bytes], out: list[tuple[int, Message]]) -> None:
        for i in range(max(0, self.next_seq - first), len(records)):
            seq = first + i
            if seq != self.next_seq:
                return  # a gap: the caller fetches it
            self.next_seq += 1
            try:  # the hub's records: it checked every field when it took them in
                out.append((seq, protocol.decode_stored(records[i])))
            except ProtocolError:
                self.rejected += 1

    def close(self) -> None:
        """Close both sockets."""
        self.sub.close(linger=0)
        self.client.close()
