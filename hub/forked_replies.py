"""Replies made off the hub's loop: a request whose answer is seconds of Python at 16,384 ranks
(a `seed`, a big job's `state`) is answered when a forked child (`ForkedCall`) has made it from
its copy of the state; the loop pays only for the fork and sends the reply when the child is
done (`send_ready`, each turn of the loop). Requests that come meanwhile share the child's
reply where it answers them (`joins`), else wait for the next child.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import zmq

from .forked import ForkedCall

log = logging.getLogger("scalemon.hub")

MAX_WAITING = 256
"""Requests waiting for one kind of reply; more are refused with a reason."""

Send = Callable[[zmq.Socket, list[bytes], str, dict[str, Any]], None]
"""How a reply goes out: (socket, envelope, op, reply)."""
Origin = tuple[zmq.Socket, list[bytes]]
"""Where a request came from: its socket and envelope."""


class ForkedReplies:
    """The replies to request `op`, made in forked children one at a time. Subclasses say
    what the child runs (`work`), what the reply is (`reply`), and whether a reply made from
    the state at record `made` answers a request at `head` (`joins`)."""

    op = "?"

    def __init__(self, send: Send) -> None:
        self._send = send
        self._making: ForkedCall | None = None
        self._making_head = 0
        self._making_context: Any = None
        self._joined: list[Origin] = []  # answered by the child now running
        self._queued: list[Origin] = []  # answered by the next one
        self.made = 0
        self.fork_s: list[float] = []
        """How long each fork stood the hub's loop still (the last 100)."""

    # --- what a kind of reply is --------------------------------------------------------------
    def work(self, head: int) -> tuple[Callable[[], Any], Any]:
        """What the child runs for the state at record `head`, and what the loop keeps for
        `reply` (taken now, in the parent)."""
        raise NotImplementedError

    def reply(self, head: int, result: Any, context: Any) -> dict[str, Any]:
        """The reply from the child's `result`."""
        raise NotImplementedError

    def failed(self, head: int) -> dict[str, Any]:
        """The reply when the child failed."""
        return {"ok": False, "error": f"the hub could not make its {self.op} reply"}

    def joins(self, made: int, head: int) -> bool:
        """True when a reply made at record `made` answers a request at record `head`."""
        return made == head

    # --- the loop's side --------------------------------------------------------------------
    def ask(self, origin: Origin, head: int) -> dict[str, Any] | None:
        """Take a request from `origin` at record `head`: None, it is answered later; or a
        reply at once (too many waiting; or no fork here: made on the loop, as a thread
        would read the state while the loop changes it)."""
        if not hasattr(os, "fork"):
            return self._made(head, *self.work(head))
        waiting = len(self._joined) + len(self._queued)
        if waiting >= MAX_WAITING:
            return self.too_many(head, waiting)
        if self._making is None:
            self._joined.append(origin)
            self._start(head)
        elif self.joins(self._making_head, head):
            self._joined.append(origin)
        else:
            self._queued.append(origin)
        return None

    def too_many(self, head: int, waiting: int) -> dict[str, Any]:
        """The reply when `waiting` requests already wait."""
        return {"ok": False, "error": f"{waiting} {self.op} requests already wait: ask again"}

    def _start(self, head: int) -> None:
        work, context = self.work(head)
        try:
            self._making = ForkedCall(work, _nothing, f"{self.op}-reply")
        except OSError as exc:  # no fork (out of memory, process limit): made here
            log.warning("could not fork to make a %s reply (%s): making it on the loop",
                        self.op, exc)
            self._answer(self._joined, self._made(head, work, context))
            self._joined = []
            return
        self._making_head, self._making_context = head, context
        self.fork_s = [*self.fork_s[-99:], self._making.fork_s]

    def _made(self, head: int, work: Callable[[], Any], context: Any) -> dict[str, Any]:
        try:
            return self.reply(head, work(), context)
        except Exception:  # a bug here must not take the hub down
            log.exception("could not make a %s reply", self.op)
            return self.failed(head)

    def send_ready(self, head: int) -> None:
        """From the hub's loop (at record `head`): answer the requests of a child that is
        done, and start the next child for those queued."""
        making = self._making
        if making is None or not making.done.is_set():
            return
        self._making = None
        if making.result is None:
            log.error("could not make a %s reply: %s", self.op, making.error)
            reply = self.failed(self._making_head)
        else:
            reply = self.reply(self._making_head, making.result, self._making_context)
        self.made += 1
        joined, self._joined = self._joined, []
        self._answer(joined, reply)
        if self._queued:
            self._joined, self._queued = self._queued, []
            self._start(head)

    def _answer(self, origins: list[Origin], reply: dict[str, Any]) -> None:
        for sock, envelope in origins:
            with contextlib.suppress(zmq.ZMQError):  # a socket closed meanwhile
                self._send(sock, envelope, self.op, reply)

    def close(self) -> None:
        """End a child at work (the hub stops)."""
        if self._making is not None:
            self._making.kill()
            self._making = None


def _nothing(_call: ForkedCall) -> None:
    """The loop looks at `done` itself (`send_ready`): a socket is the loop's alone."""
