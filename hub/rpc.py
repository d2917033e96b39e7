"""The hub's requests: the rpc and control sockets' op table (ping, sync, relay, command,
stop, toggle, state, seed, rank_records, fetch), each op checked against the asker's role
(`Requests`, owned by `Hub` in hub/server.py beside the `Intake` whose `record` and `reject` it
uses; what they share is the `HubCore` of hub/core.py). The requests own what only they
steer: the toggles, the commands queued for the ranks and a Flight Recorder dump under way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from array import array
from collections.abc import Callable
from typing import Any

import zmq

from scalemon import protocol
from scalemon.messages import DIGEST_WANTED_S
from scalemon.policy import heartbeat_stepping_s
from scalemon.protocol import ProtocolError

from .access import Peer, ipc_peer, may, refusal
from .core import HubCore
from .frdump import FrDump
from .ingest import Intake
from .limits import check_name, clip
from .seeds import Seeds, States
from .sockets import FanOut
from .stacks import StacksRequests
from .toggles import ToggleRefused, Toggles

log = logging.getLogger("scalemon.hub")

FETCH_LIMIT = 20_000
FETCH_MAX_BYTES = 16 << 20  # a page stops growing here (replies may reach MAX_REPLY_BYTES)
MAX_TOGGLE_VALUE = 1024
MAX_RELAYED_RANKS = 4096
"""Ranks one relay may answer syncs for (a node's ranks)."""
"""A toggle's value or a stop's reason may be this long."""


class Requests:
    """Answers requests: `serve` reads a socket's requests and replies to each; `advance`
    writes what the toggles and a dump under way have to say. `stats()` is the hub's counters
    (the `state` reply)."""

    def __init__(self, core: HubCore, intake: Intake,
                 stats: Callable[[], dict[str, Any]]) -> None:
        self.core = core
        self.intake = intake
        self.stats = stats
        self.toggles = Toggles(core.run_dir, core.state, core.audit)
        self._commands: dict[int, list[dict[str, Any]]] = {}  # queued per rank, sent on sync
        self.syncs_answered = 0
        """Ranks' syncs the hub answered itself (not those their relays answered)."""
        self._dump: FrDump | None = None
        self._pending_dump_record = False
        self.seeds = Seeds(core, self._send_answer)
        self.states = States(core, self._send_answer, stats)
        self.stacks = StacksRequests(core)

    def serve(self, rpc: zmq.Socket) -> None:
        """Answer the requests waiting on `rpc` (at most 100 a turn)."""
        core = self.core
        port = core.tcp_ports.get(rpc)
        for _ in range(100):
            try:
                frames = rpc.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            envelope, last = [f.bytes for f in frames[:-1]], frames[-1]
            payload = last.bytes
            peer = core.tcp_peer(last) if port else ipc_peer(last, core.host)
            op = "?"
            try:
                if port and peer.role is not None:  # whatever it asks: cut if it loses access
                    core.peers.learn(peer, port)
                op, args = protocol.decode_request(payload)
                if not may(peer, op):
                    self._refuse_request(peer, op, args, port)
                answer = self._answer(op, args, peer, (rpc, envelope))
                if answer is None:
                    continue  # answered later (a seed being made)
                reply = protocol.encode_reply(**answer, history=core.history.identity)
            except ToggleRefused as exc:  # a reasoned refusal, not a bad frame
                log.warning("toggle %s", exc)
                reply = protocol.encode_reply(ok=False, error=str(exc))
            except ProtocolError as exc:
                self.intake.reject(exc, len(payload))
                reply = protocol.encode_reply(ok=False, error=str(exc))
            except Exception as exc:  # a request must never take the hub down
                log.exception("request failed")
                reply = protocol.encode_reply(ok=False, error=f"{type(exc).__name__}: {exc}")
            self._send(rpc, envelope, op, reply)

    def send_ready(self) -> None:
        """Send the replies made off the loop since the last turn (`seed`, a big `state`)."""
        head = len(self.core.history)
        self.seeds.send_ready(head)
        self.states.send_ready(head)

    def close(self) -> None:
        """End the children making replies (the hub stops)."""
        self.seeds.close()
        self.states.close()

    def _send_answer(self, rpc: zmq.Socket, envelope: list[bytes], op: str,
                     answer: dict[str, Any]) -> None:
        """Send a reply made later than its request (`Seeds`, `States`)."""
        self._send(rpc, envelope, op, protocol.encode_reply(
            **answer, history=self.core.history.identity))

    @staticmethod
    def _send(rpc: zmq.Socket, envelope: list[bytes], op: str, reply: bytes) -> None:
        if len(reply) > protocol.MAX_REPLY_BYTES:  # the client would refuse it
            log.error("a %s reply of %d bytes is over the %d reply limit", op, len(reply),
                      protocol.MAX_REPLY_BYTES)
            reply = protocol.encode_reply(ok=False, error=(
                f"the {op} reply is {len(reply):,} bytes, over the "
                f"{protocol.MAX_REPLY_BYTES:,}-byte reply limit"))
        with contextlib.suppress(zmq.ZMQError):  # the requester went away
            rpc.send_multipart([*envelope, reply], zmq.NOBLOCK)

    def _refuse_request(self, peer: Peer, op: str, args: dict[str, Any],
                        port: int | None) -> None:
        """Refuse request `op` that `peer`'s role does not allow: audited (a toggle also as a
        `refused` toggle record), the connection of a key no longer admitted cut; raises."""
        text = refusal(peer, op)
        log.warning("%s %s", op, text)
        if op == "toggle":
            self.toggles.refuse(args["name"], args["value"], peer.who(), text)
        else:
            self.core.refused(peer, op, text)
        if peer.role is None and port is not None:
            self.core.peers.cut_one(peer, port)
        raise ToggleRefused(text) if op == "toggle" else ProtocolError(text)

    def _answer(self, op: str, args: dict[str, Any], peer: Peer,
                origin: tuple[zmq.Socket, list[bytes]]) -> dict[str, Any] | None:
        """The reply to request `op` (None: `origin`, the socket and envelope it came from, is
        answered later)."""
        core = self.core
        if op == "ping":
            return {"job": core.job, "pid": os.getpid(), "head": len(core.history)}
        if op == "sync":
            rank = args["rank"]
            self.syncs_answered += 1
            return {"t0": args["t"], "t": time.time(), "hang_after_s": core.state.hang_after_s,
                    "heartbeat_stepping_s": heartbeat_stepping_s(core.state.world_size),
                    "commands": self._commands_for(rank)}
        if op == "relay":
            node = check_name("relay.node", args["node"])
            core.relays.report(node, args["pid"], args["stats"])
            core.looks.answered(node, args.get("probes") or [])
            return {"t0": args["t"], "t": time.time(), "probe": core.relays.take_asks(node),
                    "answers_syncs": True, "hang_after_s": core.state.hang_after_s,
                    "heartbeat_stepping_s": heartbeat_stepping_s(core.state.world_size),
                    "commands": self._relayed_commands(args.get("ranks") or [])}
        if op == "stacks":
            return self.stacks.answer(args, time.monotonic())
        if op == "command":
            core.audit.write({"event": "command", "name": clip(args["name"], 100),
                              **peer.who()})
            return self._command(args["name"])
        if op == "stop":
            check_name("stop.reason", args["reason"], MAX_TOGGLE_VALUE)
            core.audit.write({"event": "stop", "reason": args["reason"], **peer.who()})
            return self._user_stop(args["reason"], peer)
        if op == "toggle":
            return self._toggle(args, peer)
        if op == "state":
            return self.states.ask(origin, len(core.history))
        if op in ("seed", "digest"):  # a dashboard follows (or will follow) the digest
            core.digest_wanted_until = time.monotonic() + DIGEST_WANTED_S
            if op == "digest":
                return {}
            return self.seeds.ask(origin, len(core.history))
        if op == "rank_records":
            return self._records_of(args["rank"], args["before"], args["limit"])
        since = max(0, args["since"])
        limit = min(max(0, args["limit"]), FETCH_LIMIT)
        records, size = [], 0
        for record in core.history.get(since, limit):
            size += len(record)
            if records and size > FETCH_MAX_BYTES:
                break
            records.append(record)
        return {"records": records, "head": len(core.history)}

    def _commands_for(self, rank: int) -> list[dict[str, Any]]:
        """The commands queued for `rank`, handed over once (on its sync, or to its relay)."""
        return self._commands.pop(rank, []) + self.toggles.take_commands(rank)

    def _relayed_commands(self, ranks: list[Any]) -> list[list[Any]]:
        """The commands of the ranks whose syncs a relay answers, as [[rank, [command]]]: the
        relay holds them until each rank's next sync (protocol 1.13)."""
        if len(ranks) > MAX_RELAYED_RANKS:
            raise ProtocolError(f"relay.ranks lists {len(ranks)} ranks, over the "
                                f"{MAX_RELAYED_RANKS} one relay may answer for")
        out = []
        for rank in ranks:
            if type(rank) is not int or not 0 <= rank < protocol.MAX_WORLD_SIZE:
                raise ProtocolError(f"relay.ranks holds {rank!r}, expected ranks")
            if commands := self._commands_for(rank):
                out.append([rank, commands])
        return out

    def _records_of(self, rank: int, before: int, limit: int) -> dict[str, Any]:
        """Rank `rank`'s latest records numbered below `before` (at most `limit`, among the
        latest RANK_RECORDS_KEPT it sent), oldest first; `complete` when they reach back to
        its first record."""
        core = self.core
        seqs = core.rank_records.get(rank, array("q"))
        older = [seq for seq in seqs if seq < before]
        chosen = older[len(older) - min(max(0, limit), FETCH_LIMIT, len(older)):]
        return {"records": core.history.pick(chosen), "head": len(core.history),
                "complete": rank not in core.ranks_trimmed and len(chosen) == len(older)}

    def _toggle(self, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        """A toggle asked by `peer`: checked, planned and audited (refusals too)."""
        try:
            check_name("toggle.name", args["name"])
            check_name("toggle.value", args["value"], MAX_TOGGLE_VALUE)
        except ProtocolError as exc:
            self.toggles.refuse(clip(args["name"], 100), clip(args["value"], 200),
                                peer.who(), f"refused: {exc}")
            raise ToggleRefused(f"refused: {exc}") from None
        reply = self.toggles.request(args["name"], args["value"], args["restart"],
                                     peer.who())
        log.info("toggle #%d %s=%r (%s) by %s: step %d", reply["id"], args["name"],
                 args["value"], reply["tier"], peer.via, reply["at_step"])
        return reply

    def _user_stop(self, reason: str, peer: Peer) -> dict[str, Any]:
        """The job's user is stopping the job: record it (once) before the ranks are
        signalled, so that their end reads "stopped by user"."""
        core = self.core
        if core.state.stop is None and core.feed is not None:
            log.info("job %s: stop requested by %s (%s)", core.job, peer.via, reason)
            self.intake.record(core.feed, "job_stop", {
                "reason": reason or None, "user": peer.user, "host": peer.host, "via": peer.via})
        return {"state": core.state.state}

    def _command(self, name: str) -> dict[str, Any]:
        """A dashboard's command for every rank; raises ProtocolError for an unknown one."""
        if name != "dump_fr":
            raise ProtocolError(f"unknown command {name!r}; known: dump_fr")
        if self._dump is not None and not self._dump.finished:
            return {"directory": self._dump.directory, "note": "a dump is already under way"}
        ranks = sorted(r for r, v in self.core.state.ranks.items() if v.state != "finished")
        self._dump = FrDump(self.core.run_dir, ranks)
        for rank in ranks:
            self._commands.setdefault(rank, []).append(
                {"name": "dump_fr", "directory": self._dump.directory})
        self._pending_dump_record = True
        return {"directory": self._dump.directory, "ranks": ranks}

    # --- what the toggles and a dump have to say ------------------------------------------
    def advance(self, feed: FanOut, now: float) -> None:
        """Record a dump's progress and the toggles' new states (and refusals) in the history
        and the feed."""
        self._advance_dump(feed)
        self.toggles.advance(now)
        while self.toggles.records:
            self.intake.record(feed, "toggle", self.toggles.records.pop(0))

    def _advance_dump(self, feed: FanOut) -> None:
        """Record a dump's progress in the history: requested, then analysed."""
        dump = self._dump
        if dump is None:
            return
        if self._pending_dump_record:
            self._pending_dump_record = False
            self.intake.record(feed, "fr_dump", dump.body())
        if dump.advance(self.core.state) and not dump.recorded:
            dump.recorded = True
            self.intake.record(feed, "fr_dump", dump.body())
