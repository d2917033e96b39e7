"""Two per-record costs of the hub's loop, side by side (no hub process, no torch):

- publishing a batch of records on the feed (`hub/sockets.py` `FanOut`, two XPUB sockets as
  with `--listen`) while nobody subscribed to the records' topic, as a big job's dashboards
  follow the digest: every frame sent (the earlier `FanOut`) against nothing sent;
- reading a relay's batch from a socket: every frame as a `zmq.Frame` then its bytes (the
  earlier read, `recv_multipart(copy=False)`) against the first frame as a `Frame` (its
  metadata tell the sender) and the rest as bytes (`hub/ingest.py` `_admitted_frames`).

CPU microseconds per record (process time: libzmq's I/O thread included), the median of
`--repeat` alternated runs. Saves bench/results/feed_recv_cost-cpu.json.

    python bench/feed_recv_cost.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq
from machine import cpu_name

from scalemon.hub.sockets import FanOut, make_sockets

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 1000
"""Records in one feed batch (the hub's INGEST_BATCH)."""
RELAY_FRAMES = 10
"""Frames in one relay message (a node of 8 ranks at a step a second, with heartbeats)."""


class EverySocket(FanOut):
    """The earlier fan-out: every frame sent on every socket, followed or not."""

    def wanted(self, sock: zmq.Socket, topic: bytes) -> bool:
        return True


def feed_cost(ctx: zmq.Context, where: Path, repeat: int) -> dict[str, float]:
    sockets = []
    for i in range(2):
        ingest, feed, rpc = make_sockets(ctx)
        ingest.close(0)
        rpc.close(0)
        feed.bind(f"ipc://{where}/feed{i}")
        sockets.append(feed)
    frames = [b"rec job", b"\x00" * 8, *([b"y" * 200] * BATCH)]
    runs: dict[str, list[float]] = {"every_frame_sent": [], "unfollowed_not_sent": []}
    for _ in range(repeat):
        for name, fan in (("every_frame_sent", EverySocket(sockets)),
                          ("unfollowed_not_sent", FanOut(sockets))):
            start = time.process_time()
            for _ in range(50):
                fan.send_multipart(frames)
            runs[name].append((time.process_time() - start) / (50 * BATCH) * 1e6)
    for sock in sockets:
        sock.close(0)
    return {name: round(statistics.median(v), 3) for name, v in runs.items()}


def recv_cost(ctx: zmq.Context, where: Path, repeat: int) -> dict[str, float]:
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.bind(f"ipc://{where}/ingest")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(f"ipc://{where}/ingest")
    message = [b"x" * 120] * RELAY_FRAMES
    count = 2000

    def fill() -> None:
        for _ in range(count):
            push.send_multipart(message)
        end = time.monotonic() + 10
        while not pull.poll(0) and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.2)  # the rest arrived

    def as_frames() -> None:
        for _ in range(count):
            _ = [f.bytes for f in pull.recv_multipart(copy=False)]

    def first_as_frame() -> None:
        for _ in range(count):
            first = pull.recv(copy=False)
            out = [first.bytes]
            while pull.getsockopt(zmq.RCVMORE):
                out.append(pull.recv())

    runs: dict[str, list[float]] = {"every_frame_a_Frame": [], "first_a_Frame_rest_bytes": []}
    for _ in range(repeat):
        for name, read in (("every_frame_a_Frame", as_frames),
                           ("first_a_Frame_rest_bytes", first_as_frame)):
            fill()
            start = time.process_time()
            read()
            runs[name].append((time.process_time() - start) / (count * RELAY_FRAMES) * 1e6)
    push.close(0)
    pull.close(0)
    return {name: round(statistics.median(v), 3) for name, v in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS / "feed_recv_cost-cpu.json")
    args = parser.parse_args(argv)
    ctx = zmq.Context()
    try:
        with tempfile.TemporaryDirectory(prefix="smfr") as where:
            feed = feed_cost(ctx, Path(where), args.repeat)
            recv = recv_cost(ctx, Path(where), args.repeat)
    finally:
        ctx.term()
    result: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": cpu_name(),
        "repeat": args.repeat, "unit": "CPU us per record (median)",
        "feed_two_sockets_nobody_follows": feed, "relay_batch_read": recv}
    print(f"{'what':<44} {'before':>8} {'after':>8}")
    print(f"{'feed, 2 sockets, topic not followed':<44} {feed['every_frame_sent']:>8.3f} "
          f"{feed['unfollowed_not_sent']:>8.3f}")
    print(f"{'a relay batch of 10 frames read, per frame':<44} "
          f"{recv['every_frame_a_Frame']:>8.3f} {recv['first_a_Frame_rest_bytes']:>8.3f}")
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
