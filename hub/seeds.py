"""Seeds for dashboards that attach (`seed` requests), made off the hub's loop.

A seed is the hub's fold pickled (scalemon/link/seed.py): at 16,384 ranks some 20 MB and a
second or more of Python. The loop forks (`ForkedCall`); the child pickles its copy of the
fold as it stood at the fork, and the request is answered when the child is done, with every
other `seed` request that came meanwhile (`send_ready`, each turn of the loop). The loop pays
only for the fork. Where fork does not exist, the seed is made at once, on the loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import zmq

from scalemon.link import seed

from .core import HubCore
from .forked import ForkedCall

log = logging.getLogger("scalemon.hub")

SEED_REUSE_S = 1.0
"""A seed made this recently serves the next dashboard too, while no record came since."""
MAX_WAITING = 256
"""Requests waiting for the seed being made; more are told to replay the history."""

Send = Callable[[zmq.Socket, list[bytes], str, dict[str, Any]], None]
"""How a reply goes out: (socket, envelope, op, reply)."""


class Seeds:
    """Answers `seed` requests: at once from a fresh seed, else when the one being made is
    done (`ask` returns None then; `send_ready` sends it)."""

    def __init__(self, core: HubCore, send: Send) -> None:
        self.core = core
        self._send = send
        self._cache: tuple[int, float, dict[str, Any]] | None = None
        self._making: ForkedCall | None = None
        self._making_head = 0
        self._waiting: list[tuple[zmq.Socket, list[bytes]]] = []
        self.made = 0
        self.fork_s: list[float] = []
        """How long each seed's fork stood the hub's loop still (the last 100)."""

    def ask(self, sock: zmq.Socket, envelope: list[bytes]) -> dict[str, Any] | None:
        """The reply to a `seed` request from `envelope` on `sock`, or None: it is answered
        when the seed being made is done."""
        head = len(self.core.history)
        cached = self._cache
        if cached is not None and cached[0] == head and time.monotonic() - cached[1] < SEED_REUSE_S:
            return cached[2]
        if not hasattr(os, "fork"):
            return self._reply(head, self._dump(head), 0.0)
        if len(self._waiting) >= MAX_WAITING:
            return {"seed": None, "seq": head, "why": (
                f"{len(self._waiting)} dashboards already wait for the hub's fold: replay "
                "the history")}
        self._waiting.append((sock, envelope))
        if self._making is None:
            self._start(head)
        return None

    def _dump(self, head: int) -> bytes:
        fold = self.core.fold
        fold.next_seq = head  # every record below was folded, or skipped as invalid
        return seed.dump(fold)

    def _start(self, head: int) -> None:
        try:
            self._making = ForkedCall(lambda: _timed(lambda: self._dump(head)), _nothing,
                                      "seed")
        except OSError as exc:  # no fork (out of memory, process limit): made here
            log.warning("could not fork to make a seed (%s): making it on the loop", exc)
            reply = self._reply(head, self._dump(head), 0.0)
            self._answer_waiting(reply)
            return
        self._making_head = head
        self.fork_s = [*self.fork_s[-99:], self._making.fork_s]

    def send_ready(self) -> None:
        """From the hub's loop: answer the waiting requests once the seed is made."""
        making = self._making
        if making is None or not making.done.is_set():
            return
        self._making = None
        if making.result is None:
            log.error("could not make a seed: %s", making.error)
            reply: dict[str, Any] = {"seed": None, "seq": self._making_head, "why": (
                "the hub could not make its fold: replay the history")}
        else:
            blob, took = making.result
            reply = self._reply(self._making_head, blob, took)
        self._answer_waiting(reply)

    def _answer_waiting(self, reply: dict[str, Any]) -> None:
        waiting, self._waiting = self._waiting, []
        for sock, envelope in waiting:
            with contextlib.suppress(zmq.ZMQError):  # a socket closed meanwhile
                self._send(sock, envelope, "seed", reply)

    def _reply(self, head: int, blob: bytes, took: float) -> dict[str, Any]:
        if len(blob) > seed.MAX_SEED_BYTES:
            reply: dict[str, Any] = {"seed": None, "seq": head, "why": (
                f"the fold holds {len(blob) >> 20} MiB, over {seed.MAX_SEED_BYTES >> 20} MiB: "
                "replay the history")}
        else:
            reply = {"seed": blob, "seq": head, "format": seed.FORMAT}
        reply["hang_after_s"] = self.core.fold.state.hang_after_s  # the dashboard's threshold
        reply["digest"] = True  # a big job's digest on the feed (hub/digest.py)
        log.info("seed at record %d: %d bytes in %.3f s", head, len(blob), took)
        self.made += 1
        self._cache = (head, time.monotonic(), reply)
        return reply

    def close(self) -> None:
        """End a seed being made (the hub stops)."""
        if self._making is not None:
            self._making.kill()
            self._making = None


def _timed(work: Callable[[], bytes]) -> tuple[bytes, float]:
    started = time.perf_counter()
    blob = work()
    return blob, time.perf_counter() - started


def _nothing(_call: ForkedCall) -> None:
    """The loop looks at `done` itself (`send_ready`): a socket is the loop's alone."""
