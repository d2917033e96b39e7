"""The hub's feed publishes a topic only where someone follows it (hub/sockets.py `FanOut`,
over real XPUB and SUB sockets on ipc): nothing is sent while no subscriber follows a
prefix of the topic, everything once one does, and nothing again once the last one left."""

from __future__ import annotations

import time
from pathlib import Path

import zmq

from scalemon.hub.sockets import FanOut, make_sockets


class CountingSocket(zmq.Socket):
    """A socket that counts its frames sent."""

    sent = 0

    def send(self, data, flags=0, copy=True, track=False, **kwargs):  # type: ignore[override]
        type(self).sent += 1
        return super().send(data, flags, copy=copy, track=track, **kwargs)


def read_subscriptions(fan: FanOut, xpub: zmq.Socket, until, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not until() and time.monotonic() < end:
        if xpub.poll(50, zmq.POLLIN):
            fan.subscription(xpub, xpub.recv())
    assert until()


def test_a_topic_is_sent_only_while_someone_follows_it(tmp_path: Path) -> None:
    ctx = zmq.Context()
    ctx._socket_class = CountingSocket  # pyzmq's hook for the class ctx.socket() makes
    try:
        ingest, xpub, rpc = make_sockets(ctx)
        ingest.close(0)
        rpc.close(0)
        endpoint = f"ipc://{tmp_path}/feed"
        xpub.bind(endpoint)
        fan = FanOut([xpub])
        fan.send_multipart([b"rec job", b"0"])
        assert CountingSocket.sent == 0  # nobody listens: not a frame

        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"rec")
        sub.connect(endpoint)
        read_subscriptions(fan, xpub, lambda: b"rec" in fan.topics[xpub])
        fan.send_multipart([b"dig job", b"digest"])  # another topic: still nothing
        assert CountingSocket.sent == 0
        fan.send_multipart([b"rec job", b"1", b"2"])
        assert CountingSocket.sent == 3
        assert sub.poll(5000, zmq.POLLIN)
        assert sub.recv_multipart() == [b"rec job", b"1", b"2"]

        sub.close(0)  # the last follower leaves: its unsubscription comes up
        read_subscriptions(fan, xpub, lambda: not fan.topics[xpub])
        fan.send_multipart([b"rec job", b"3"])
        assert CountingSocket.sent == 3
        xpub.close(0)
    finally:
        ctx.term()
