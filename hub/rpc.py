"""The hub's requests: the rpc and control sockets' op table (ping, sync, relay, command,
stop, toggle, state, seed, rank_records, fetch), each op checked against the asker's role; a
mixin of `Hub` (hub/server.py), beside `HubIngest` whose `_record` and `_reject` it uses."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from array import array
from pathlib import Path
from typing import Any

import zmq

from scalemon import protocol
from scalemon.home.history import History
from scalemon.link import seed
from scalemon.protocol import ProtocolError
from scalemon.reports.snapshot import snapshot_json
from scalemon.state.fold import JobFold
from scalemon.state.jobstate import JobState

from .access import Peer, PeerBook, ipc_peer, may, refusal
from .audit import Audit
from .frdump import FrDump
from .limits import check_name, clip
from .relays import RelayBook
from .sockets import FanOut
from .toggles import ToggleRefused, Toggles

log = logging.getLogger("scalemon.hub")

SEED_REUSE_S = 1.0
"""A seed made this recently serves the next dashboard too, while no record came since."""
FETCH_LIMIT = 20_000
FETCH_MAX_BYTES = 16 << 20  # a page stops growing here (replies may reach MAX_REPLY_BYTES)
MAX_TOGGLE_VALUE = 1024
"""A toggle's value or a stop's reason may be this long."""


class HubRpc:
    """Answers requests: `_serve_rpc` reads a socket's requests and replies to each."""

    job: str
    run_dir: Path
    history: History
    fold: JobFold
    state: JobState
    audit: Audit
    toggles: Toggles
    relays: RelayBook
    peers: PeerBook | None
    _host: str
    _tcp_ports: dict[zmq.Socket, int]
    _feed: FanOut | None
    _commands: dict[int, list[dict[str, Any]]]
    _dump: FrDump | None
    _pending_dump_record: bool
    _seed_cache: tuple[int, float, dict[str, Any]] | None
    _rank_records: dict[int, array]
    _ranks_trimmed: set[int]

    def _serve_rpc(self, rpc: zmq.Socket) -> None:
        port = self._tcp_ports.get(rpc)
        for _ in range(100):
            try:
                frames = rpc.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            envelope, last = [f.bytes for f in frames[:-1]], frames[-1]
            payload = last.bytes
            peer = self._tcp_peer(last) if port else ipc_peer(last, self._host)
            op = "?"
            try:
                if port and peer.role is not None:  # whatever it asks: cut if it loses access
                    self.peers.learn(peer, port)
                op, args = protocol.decode_request(payload)
                if not may(peer, op):
                    self._refuse_request(peer, op, args, port)
                reply = protocol.encode_reply(**self._answer(op, args, peer),
                                              history=self.history.identity)
            except ToggleRefused as exc:  # a reasoned refusal, not a bad frame
                log.warning("toggle %s", exc)
                reply = protocol.encode_reply(ok=False, error=str(exc))
            except ProtocolError as exc:
                self._reject(exc, len(payload))
                reply = protocol.encode_reply(ok=False, error=str(exc))
            except Exception as exc:  # a request must never take the hub down
                log.exception("request failed")
                reply = protocol.encode_reply(ok=False, error=f"{type(exc).__name__}: {exc}")
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
            self.toggles.refuse(args["name"], args["value"], self._who(peer), text)
        else:
            self._refused(peer, op, text)
        if peer.role is None and port is not None:
            self.peers.cut_one(peer, port)
        raise ToggleRefused(text) if op == "toggle" else ProtocolError(text)

    def _answer(self, op: str, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        if op == "ping":
            return {"job": self.job, "pid": os.getpid(), "head": len(self.history)}
        if op == "sync":
            rank = args["rank"]
            return {"t0": args["t"], "t": time.time(), "hang_after_s": self.state.hang_after_s,
                    "commands": self._commands.pop(rank, []) + self.toggles.take_commands(rank)}
        if op == "relay":
            self.relays.report(check_name("relay.node", args["node"]), args["pid"],
                               args["stats"])
            return {"t0": args["t"], "t": time.time()}
        if op == "command":
            self.audit.write({"event": "command", "name": clip(args["name"], 100),
                              **self._who(peer)})
            return self._command(args["name"])
        if op == "stop":
            check_name("stop.reason", args["reason"], MAX_TOGGLE_VALUE)
            self.audit.write({"event": "stop", "reason": args["reason"], **self._who(peer)})
            return self._user_stop(args["reason"], peer)
        if op == "toggle":
            return self._toggle(args, peer)
        if op == "state":
            return {"state": snapshot_json(self.state), "hub": self.stats(),
                    "head": len(self.history)}
        if op == "seed":
            return self._seed()
        if op == "rank_records":
            return self._records_of(args["rank"], args["before"], args["limit"])
        since = max(0, args["since"])
        limit = min(max(0, args["limit"]), FETCH_LIMIT)
        records, size = [], 0
        for record in self.history.get(since, limit):
            size += len(record)
            if records and size > FETCH_MAX_BYTES:
                break
            records.append(record)
        return {"records": records, "head": len(self.history)}

    def _seed(self) -> dict[str, Any]:
        """The fold of the whole history so far, for a dashboard that attaches (`seed`):
        {"seed": bytes, "seq": the record it continues from}, or {"seed": None, "why": ...}."""
        head = len(self.history)
        cached = self._seed_cache
        if cached is not None and cached[0] == head and time.monotonic() - cached[1] < SEED_REUSE_S:
            return cached[2]
        started = time.perf_counter()
        self.fold.next_seq = head  # every record below was folded, or skipped as invalid
        blob = seed.dump(self.fold)
        took = time.perf_counter() - started
        if len(blob) > seed.MAX_SEED_BYTES:
            reply: dict[str, Any] = {"seed": None, "seq": head, "why": (
                f"the fold holds {len(blob) >> 20} MiB, over {seed.MAX_SEED_BYTES >> 20} MiB: "
                "replay the history")}
        else:
            reply = {"seed": blob, "seq": head, "format": seed.FORMAT}
        reply["hang_after_s"] = self.state.hang_after_s  # the dashboard's threshold too
        log.info("seed at record %d: %d bytes in %.3f s", head, len(blob), took)
        self._seed_cache = (head, time.monotonic(), reply)
        return reply

    def _records_of(self, rank: int, before: int, limit: int) -> dict[str, Any]:
        """Rank `rank`'s latest records numbered below `before` (at most `limit`, among the
        latest RANK_RECORDS_KEPT it sent), oldest first; `complete` when they reach back to
        its first record."""
        seqs = self._rank_records.get(rank, array("q"))
        older = [seq for seq in seqs if seq < before]
        chosen = older[len(older) - min(max(0, limit), FETCH_LIMIT, len(older)):]
        return {"records": self.history.pick(chosen), "head": len(self.history),
                "complete": rank not in self._ranks_trimmed and len(chosen) == len(older)}

    def _toggle(self, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        """A toggle asked by `peer`: checked, planned and audited (refusals too)."""
        try:
            check_name("toggle.name", args["name"])
            check_name("toggle.value", args["value"], MAX_TOGGLE_VALUE)
        except ProtocolError as exc:
            self.toggles.refuse(clip(args["name"], 100), clip(args["value"], 200),
                                self._who(peer), f"refused: {exc}")
            raise ToggleRefused(f"refused: {exc}") from None
        reply = self.toggles.request(args["name"], args["value"], args["restart"],
                                     self._who(peer))
        log.info("toggle #%d %s=%r (%s) by %s: step %d", reply["id"], args["name"],
                 args["value"], reply["tier"], peer.via, reply["at_step"])
        return reply

    def _user_stop(self, reason: str, peer: Peer) -> dict[str, Any]:
        """The job's user is stopping the job: record it (once) before the ranks are
        signalled, so that their end reads "stopped by user"."""
        if self.state.stop is None and self._feed is not None:
            log.info("job %s: stop requested by %s (%s)", self.job, peer.via, reason)
            self._record(self._feed, "job_stop", {"reason": reason or None, "user": peer.user,
                                                  "host": peer.host, "via": peer.via})
        return {"state": self.state.state}

    def _command(self, name: str) -> dict[str, Any]:
        """A dashboard's command for every rank; raises ProtocolError for an unknown one."""
        if name != "dump_fr":
            raise ProtocolError(f"unknown command {name!r}; known: dump_fr")
        if self._dump is not None and not self._dump.finished:
            return {"directory": self._dump.directory, "note": "a dump is already under way"}
        ranks = sorted(r for r, v in self.state.ranks.items() if v.state != "finished")
        self._dump = FrDump(self.run_dir, ranks)
        for rank in ranks:
            self._commands.setdefault(rank, []).append(
                {"name": "dump_fr", "directory": self._dump.directory})
        self._pending_dump_record = True
        return {"directory": self._dump.directory, "ranks": ranks}

