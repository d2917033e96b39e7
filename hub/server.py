"""The hub: one process per job that ingests every rank's messages, keeps the history, serves
dashboards and notices ranks that stop.

Sockets (see `scalemon.home.address.HubAddress`):
- `ingest` PULL (bind): ranks PUSH protocol messages; invalid frames are counted and logged.
- `feed` PUB (bind): every accepted record, numbered, for live dashboards.
- `rpc` ROUTER (bind): ping / state / fetch requests (snapshot, history pages), agents' sync.
- `control` ROUTER (bind, always ipc in the private run directory): requests that steer the
  job (flag toggles, Flight Recorder dumps); the `rpc` socket refuses them.

`Hub` sets up, polls and keeps house; it is composed of its parts, beside it: the `Intake`
(`ingest.py`: frames in, records out) and the `Requests` (`rpc.py`: the requests' op table,
toggles, dumps), which share the job's records and books through one `HubCore` (`core.py`);
`sockets.py` makes and binds the sockets, `liveness.py` tells frozen, gone, unreachable and
silent ranks apart and finds abandoned jobs, `looks.py` reads silent ranks' stacks from outside.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import zmq

from scalemon import protocol
from scalemon.home.address import HubAddress
from scalemon.home.history import HISTORY_FILE, RETRY_S, History
from scalemon.home.jobfile import ENDED_STATES, JobFile
from scalemon.home.keys import Keypair, hub_keypair, load_authorized
from scalemon.home.paths import jobs_dir, run_dir
from scalemon.home.pidlock import take_lock
from scalemon.home.safefs import private_dir
from scalemon.protocol import ProtocolError
from scalemon.settings import node_name
from scalemon.state.fold import JobFold
from scalemon.state.jobstate import HANG_AFTER_S, JobState

from .access import PeerBook
from .alerts_out import AlertsOut
from .audit import Audit
from .auth import start_gate
from .checkpoints import Checkpoints
from .core import HubCore
from .ingest import Intake
from .limits import raise_open_files_limit, reason_class
from .liveness import Liveness
from .looks import Looks
from .openmetrics import Exporter
from .relay_book import RelayBook
from .rpc import Requests
from .sockets import FanOut, bind_tcp, make_sockets
from .statelog import RankStateLog
from .tcpguard import TcpGuard

log = logging.getLogger("scalemon.hub")

HOUSEKEEPING_S = 0.25
WAITING_S = 300.0
"""A hub whose ranks never came waits at least this long before it gives up."""


class HubAlreadyRunning(RuntimeError):
    """Another hub holds this job's run directory."""


class Hub:
    """Collects one job's messages. `serve_forever()` runs until the job ended and lingered.

    Composed of `core` (the job's history, fold and books), `intake` (what comes in) and
    `requests` (what is asked); `state`, `history`, `relays` and `peers` are the core's."""

    def __init__(
        self,
        job: str,
        home: Path | None = None,
        address: str | None = None,
        world_size: int | None = None,
        lost_after_s: float = 5.0,
        linger_s: float = 600.0,
        memory_limit: int = 1_000_000,
        hang_after_s: float = HANG_AFTER_S,
        listen: str | None = None,
    ) -> None:
        self.job = job
        self.home = home
        where = run_dir(job, home)
        self.run_dir = private_dir(where, top=where.parents[1])  # home, run/, run/<job>
        self.address = HubAddress.parse(address) if address else HubAddress.for_directory(
            self.run_dir
        )
        self.listen = HubAddress.parse(listen) if listen else None
        if self.listen is not None and not self.listen.ingest.startswith("tcp://"):
            raise ValueError(f"--listen {listen!r}: expected tcp://HOST:PORT (port 0: any free "
                             "ports)")
        self.tcp_endpoints: dict[str, str] | None = None  # bound, with a resolvable host
        self._keys: Keypair | None = None
        if self.address.ingest.startswith("tcp://") or self.listen is not None:
            self._keys = hub_keypair(home)  # fail now, with the keys' error, not once serving
            load_authorized(home)
        self.control_endpoint = HubAddress.for_directory(self.run_dir).control
        self.linger_s = linger_s
        self._lock_file = take_lock(self.run_dir / "hub.lock", self._already_running,
                                    self._pid_unwritten)
        history = History(self.run_dir / HISTORY_FILE, memory_limit)
        self.checkpoints = Checkpoints(history.path, job)  # `summary` of a long job: seconds
        history.on_sealed = self.checkpoints.sealed
        host = node_name()
        self.core = HubCore(
            job=job, run_dir=self.run_dir, host=host, history=history,
            fold=JobFold(job=job, world_size=world_size, hang_after_s=hang_after_s),
            liveness=Liveness(lost_after_s, linger_s, host), audit=Audit(self.run_dir),
            relays=(relays := RelayBook(lost_after_s=max(lost_after_s, 10.0))),
            looks=Looks(host, relays),
            topic=protocol.feed_topic(history.identity))
        self.intake = Intake(self.core)
        self.replay_skipped: Counter[str] = Counter()
        self._notes: list[tuple[str, str]] = []  # written into the history once serving
        self._state_log = RankStateLog()  # its log lines; every change is a record
        self._error_said: str | None = None
        self.guard: TcpGuard | None = None  # caps the tcp connections, while serving
        self.started = time.time()
        self._ended_since = 0.0
        self._ending_state: str | None = None
        self._stop = threading.Event()
        self._job_file: JobFile | None = None
        self.exporter: Exporter | None = None  # OpenMetrics (hub/openmetrics.py), when asked
        self._replay_history()
        self.requests = Requests(self.core, self.intake, self.stats)  # its toggles: replayed
        self.alerts_out = AlertsOut.from_env(os.environ, job, self.core.audit, self.state,
                                             self.run_dir)

    # --- the core's, by their old names ---------------------------------------------------
    @property
    def state(self) -> JobState:
        """The job's state, folded from the history."""
        return self.core.state

    @property
    def history(self) -> History:
        """The job's records."""
        return self.core.history

    @property
    def relays(self) -> RelayBook:
        """The other nodes' relays."""
        return self.core.relays

    @property
    def peers(self) -> PeerBook | None:
        """Which key each tcp connection is, while serving."""
        return self.core.peers

    # --- setup ---------------------------------------------------------------------------
    def _already_running(self, pid: str) -> HubAlreadyRunning:
        return HubAlreadyRunning(f"a hub for job {self.job!r} is already running (pid {pid}); "
                                 f"attach to it with `scalemon snapshot {self.job}`")

    def _pid_unwritten(self, exc: OSError) -> None:
        """The pid is for people; a full disk must not stop the hub."""
        log.error("could not write the hub's pid into %s: %s", self.run_dir / "hub.lock", exc)

    def _replay_history(self) -> None:
        """Rebuild the state from a history left by an earlier hub of this job, validating
        every record as live ingest does (schema, job id, bounds) and counting what it skips."""
        n = len(self.history)
        for seq, record in enumerate(self.history.get(0, n)):
            try:
                msg = self.intake.accept(record, hub_records=True)
            except ProtocolError as exc:
                self.replay_skipped[reason_class(exc)] += 1
                continue
            self.intake.apply(seq, msg)
        if n:
            log.info("resumed history of job %s: %d records", self.job, n)
        if self.history.earlier_loss:
            log.error("history of job %s: %s", self.job, self.history.earlier_loss)
            self._notes.append(("loss", self.history.earlier_loss))
        recovery = self.history.recovery
        if recovery:
            self._notes.append(("history", (
                f"history reopened damaged: {recovery['records']} intact records kept "
                f"({recovery['salvaged_after_damage']} of them after the damage), "
                f"{recovery['set_aside_bytes']} damaged bytes set aside in "
                f"{recovery['set_aside_in']}")))
        if self.replay_skipped:
            skipped = sum(self.replay_skipped.values())
            reasons = "; ".join(f"{k} ({v})" for k, v in self.replay_skipped.most_common(3))
            log.warning("history of job %s: skipped %d invalid records on replay: %s",
                        self.job, skipped, reasons)
            self._notes.append(("history", f"{skipped} records of the history were not "
                                           f"folded in (invalid: {reasons})"))
        now = time.monotonic()
        for rank in self.state.ranks:
            self.core.liveness.last_recv[rank] = now

    def _bind(self, ctx: zmq.Context) -> tuple[zmq.Socket, ...]:
        """Bind the main endpoints, the control socket and, with --listen, the tcp ones. Every
        tcp socket is a Curve server behind the ZAP handler: TCP is never open."""
        if self._keys is not None:
            self.auth, self.core.gate = start_gate(ctx, self.home)
        ingest, feed, rpc = make_sockets(ctx, tcp=self.address.ingest.startswith("tcp://"))
        control = ctx.socket(zmq.ROUTER)
        control.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        control.setsockopt(zmq.LINGER, 0)
        main = (ingest, feed, rpc)
        if self.address.ingest.startswith("tcp://"):
            self.tcp_endpoints = self._bind_tcp(main, self.address)
        else:
            ingest.bind(self.address.ingest)
            feed.bind(self.address.feed)
            rpc.bind(self.address.rpc)
        control.bind(self.control_endpoint)  # in the 0700 run directory: the owner only
        extra: tuple[zmq.Socket, ...] = ()
        if self.listen is not None:
            extra = make_sockets(ctx, tcp=True)
            self.tcp_endpoints = self._bind_tcp(extra, self.listen)
        return (ingest, feed, rpc, control, *extra)

    def _bind_tcp(self, sockets: tuple[zmq.Socket, ...], where: HubAddress) -> dict[str, str]:
        assert self._keys is not None
        return bind_tcp(sockets, where, self._keys, self.guard, self.core.tcp_ports)

    def _write_job_file(self, state: str = "running", ended: float | None = None) -> None:
        """(Re)write the job file: `state` "running" while the job runs, else the job's final
        state (from the moment it ended: a lingering hub serves an ended job, not a live one)."""
        self._job_file = JobFile(
            job=self.job,
            address=self.address.base,
            host=node_name(),
            pid=os.getpid(),
            started=self.started,
            world_size=self.state.world_size,
            run_dir=str(self.run_dir),
            protocol=list(protocol.PROTOCOL_VERSION),
            state=state,
            ended=ended,
            tcp=self.tcp_endpoints,
            server_key=self._keys.public.decode() if self._keys else None,
            metrics_url=self.exporter.url if self.exporter else None,
        )
        try:
            self._job_file.write(self.home)
        except OSError as exc:  # the hub serves on; retried when the world size changes
            log.error("could not write the job file of %s: %s (`scalemon jobs` will not list "
                      "this hub; attach by address: %s)", self.job, exc, self.address.base)

    def _mark_job_file(self) -> None:
        """On the way out: an ended job's file says so (readers tell it from a dead hub); a
        hub stopped while its job runs removes its file (a successor writes its own)."""
        path = jobs_dir(self.home) / f"{self.job}.json"
        if self._ending_state not in ENDED_STATES:
            path.unlink(missing_ok=True)
            return
        try:
            current = JobFile.read(path)
        except (ValueError, OSError):  # unreadable, or not trusted
            return
        if current.pid != os.getpid():
            return  # another hub took over
        try:
            dataclasses.replace(self._job_file, state=self._ending_state,
                                ended=self._job_file.ended or time.time(),
                                hub_stopped=time.time()).write(self.home)
        except OSError as exc:
            log.error("could not mark the job file of %s %s: %s", self.job,
                      self._ending_state, exc)

    # --- main loop -----------------------------------------------------------------------
    def stop(self) -> None:
        """Ask `serve_forever` to return (thread-safe)."""
        self._stop.set()

    def serve_forever(self) -> None:
        """Bind, write the job file, and serve until stopped or the job ended and lingered."""
        self.guard = TcpGuard(raise_open_files_limit())
        self.core.peers = PeerBook(self.guard)
        ctx = zmq.Context()
        self.auth = None
        try:
            sockets = self._bind(ctx)
        except BaseException:
            self._stop_auth()
            raise
        self.guard.set_caps()
        monitors = self.guard.monitors
        ingest, feed_main, rpc, control, *extra = sockets
        ingests = [ingest, *extra[:1]]
        rpcs = [rpc, *extra[2:3]]
        feed = self.core.feed = FanOut([feed_main, *extra[1:2]])
        subscribers = [sock for sock in feed.sockets if sock.type == zmq.XPUB]
        self._write_job_file()
        log.info("hub for job %s listening on %s%s", self.job, self.address.base,
                 f" and (CurveZMQ) {self.tcp_endpoints}" if self.tcp_endpoints else "")
        poller = zmq.Poller()
        for sock in (*ingests, *rpcs, control, *monitors, *subscribers):
            poller.register(sock, zmq.POLLIN)
        next_housekeeping = 0.0
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(timeout=100))
                for sock in monitors:  # first: shed connections over the cap at once
                    if sock in events:
                        self.guard.on_events(sock)
                for sock in subscribers:  # before anything is published this turn
                    if sock in events:
                        self.intake.note_subscribers(sock)
                for sock in ingests:
                    if sock in events:
                        self.intake.take(sock, feed)
                for sock in rpcs:
                    if sock in events:
                        self.requests.serve(sock)
                if control in events:
                    self.requests.serve(control)
                self.requests.send_ready()  # replies made off the loop, to those waiting
                now = time.monotonic()
                if now >= next_housekeeping:
                    next_housekeeping = now + HOUSEKEEPING_S
                    self._housekeeping(feed, now)
            self._end_stopped_ranks(feed)
        finally:
            self._shutdown(ctx, sockets)

    def _stop_auth(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None

    def _shutdown(self, ctx: zmq.Context, sockets: tuple[zmq.Socket, ...]) -> None:
        error = self.history.write_error
        self.core.looks.close()
        self.requests.close()
        if self.alerts_out is not None:
            self.alerts_out.close()
        lost = self.history.close()
        self.checkpoints.close()
        if self.guard is not None:
            self.guard.close()
        for sock in sockets:
            sock.close(linger=0)
        self._stop_auth()
        ctx.term()
        if self.exporter is not None:  # the file keeps the final state
            self.exporter.update(self.state, time.monotonic(), force=True)
            self.exporter.close()
        if self._job_file is not None:
            self._mark_job_file()
        self._lock_file.close()
        if lost:
            log.error("hub for job %s stopped: %d received, %d rejected; %d records could not "
                      "be written to the history (%s) and are lost", self.job, self.intake.received,
                      self.intake.rejected, lost, error)
        else:
            log.info("hub for job %s stopped: %d received, %d rejected; every record is in "
                     "the history", self.job, self.intake.received, self.intake.rejected)

    def _note_write_error(self) -> None:
        """Say in the history (and so in snapshot and dashboards) when records stop and start
        being written."""
        error = self.history.write_error
        if error == self._error_said:
            return
        if error is not None:
            since = time.strftime("%H:%M:%S", time.localtime(self.history.write_error_since))
            self._notes.append(("history", (
                f"history not being written: {error} since {since}; records are kept in "
                f"memory and served, and written when the disk has room (retrying every "
                f"{RETRY_S:.0f} s)")))
        else:
            self._notes.append(("history", f"history written again after "
                                           f"{self._error_said}: nothing was lost"))
        self._error_said = error

    # --- rank liveness and lifetime --------------------------------------------------------
    def _housekeeping(self, feed: FanOut, now: float) -> None:
        self._check_keys()
        self.history.flush()
        self._note_write_error()
        while self._notes:
            kind, text = self._notes.pop(0)
            if kind == "loss":  # once written, the loss marker no longer needs to say it
                self.history.earlier_loss_told(self.intake.record(
                    feed, "hub_note", {"kind": "history", "text": text}))
            else:
                self.intake.record(feed, "hub_note", {"kind": kind, "text": text})
        self.requests.advance(feed, now)  # a dump's progress, the toggles' states
        self.relays.advance(now)
        while self.relays.records:
            self.intake.record(feed, "relay", self.relays.records.pop(0))
        liveness = self.core.liveness
        for body in liveness.check(self.state, self.relays, self.core.looks, now):
            self._state_log.say(body, now)
            self.intake.record(feed, "rank_state", body)
        for look in self.core.looks.take(now):
            self._record_look(feed, look, now)
        self._state_log.tick(now)
        if self.alerts_out is not None:  # $SCALEMON_ALERT_CMD (hub/alerts_out.py)
            self.alerts_out.check(self.state, now)
        if self.exporter is not None:
            self.exporter.update(self.state, now)
        self.intake.digest.tick(feed, now)  # a big job's digest for dashboards
        job_state = self.core.liveness.lifecycle_state(self.state, now)
        if job_state != self._ending_state:  # each ending state counts its own linger
            self._ending_state, self._ended_since = job_state, now
            self._note_job_state(job_state)
        elif self._job_file and self._job_file.world_size != self.state.world_size:
            self._write_job_file(self._job_file.state, self._job_file.ended)
        if job_state in (*ENDED_STATES, "waiting"):
            # a hub whose ranks never came waits at least WAITING_S before giving up
            wait_s = max(self.linger_s, WAITING_S) if job_state == "waiting" else self.linger_s
            if now - self._ended_since >= wait_s:
                log.info("job %s is %s; waited %.0f s, exiting", self.job, job_state, wait_s)
                self._stop.set()

    def _record_look(self, feed: FanOut, look: dict[str, Any], now: float) -> None:
        """A look at a silent rank's process finished: its stacks, then what it tells of the
        rank (frozen and where, or gone); a reader that cannot read stacks is said once."""
        body = self.core.liveness.on_look(self.state, look)
        if body is None:
            return  # a rank that spoke again, or a look `scalemon stacks` asked for
        reading = look.get("reading")
        if isinstance(reading, dict):
            self.intake.record(feed, "rank_stacks", {
                "target": look["rank"], "reading": reading, "process": look.get("process"),
                "reader": look.get("reader")})
            error = reading.get("error")
            said = self.core.liveness.errors_said
            if isinstance(error, str) and error and error not in said and len(said) < 16:
                said.add(error)
                self.intake.record(feed, "hub_note", {
                    "kind": "stacks", "text": f"{look.get('reader')} cannot read the stacks "
                                              f"of rank {look['rank']}'s process: {error}"})
        self._state_log.say(body, now)
        self.intake.record(feed, "rank_state", body)

    def _check_keys(self) -> None:
        """Cut the live connections of keys removed from `authorized` (or given another
        role: they reconnect under it), and audit the handshakes the gate refused."""
        gate, peers, audit = self.core.gate, self.core.peers, self.core.audit
        if gate is None or peers is None:
            return
        for lost in gate.take_lost():
            cut = peers.cut({lost.key})
            log.warning("key %s (role %s) lost its access: %d live connection(s) cut",
                        lost.name, lost.role, cut)
            audit.write({"event": "access cut", "user": lost.name, "role": lost.role,
                              "connections": cut})
        while gate.events:
            event = gate.events.popleft()
            label = f"key {event['name'] or event['key'][:12] + '…'}"
            user = event["name"] or label
            source = f"{label} from {event['client_host']}"
            audit.refusal(source, f"handshake on {event['socket']}",
                               {"user": user, "via": source, **event})

    def _note_job_state(self, job_state: str) -> None:
        """Say in the job file, at once, that the job ended (its final state) or runs again:
        `scalemon jobs`, `attach` and `snapshot` then never take a lingering hub's ended job
        for a live one."""
        if self._job_file is None:
            return
        state = job_state if job_state in ENDED_STATES else "running"
        if state != self._job_file.state or self._job_file.world_size != self.state.world_size:
            self._write_job_file(state, time.time() if state != "running" else None)

    def _end_stopped_ranks(self, feed: FanOut) -> None:
        """On the way out after the user's stop request: the ranks that have not reported
        their end yet are written off (as `stopped`, by the reducer), so the history tells
        how the job ended, also when replayed after the hub has gone."""
        if self.state.stop is None:
            return
        for rank, view in sorted(self.state.ranks.items()):
            if view.state in ("running", "frozen"):
                self.intake.record(feed, "rank_state", {
                    "target": rank, "state": "silent",
                    "reason": "the hub stopped before the rank reported its end"})
        self._ending_state = self.core.liveness.lifecycle_state(self.state, time.monotonic())

    def stats(self) -> dict[str, Any]:
        """Hub counters, as reported in `state` replies."""
        intake, gate, peers = self.intake, self.core.gate, self.core.peers
        return {
            "pid": os.getpid(),
            "host": node_name(),
            "address": self.address.base,
            "uptime_s": time.time() - self.started,
            "received": intake.received,
            "rejected": intake.rejected,
            "reject_reasons": dict(intake.rejects.counts),
            "reject_recent": list(intake.rejects.recent),
            "history": len(self.history),
            "run_dir": str(self.run_dir),
            "history_identity": self.history.identity,
            "history_error": self.history.write_error,
            "history_unwritten": len(self.history) - self.history.durable,
            "history_recovery": self.history.recovery,
            "replay_skipped": dict(self.replay_skipped),
            "tcp": self.tcp_endpoints,
            "relays": len(self.relays.relays),
            "syncs_answered": self.requests.syncs_answered,
            "auth_refused": gate.counts()["refused"] if gate else 0,
            "auth_refused_keys": gate.counts()["refused_keys"] if gate else 0,
            "keys_admitted": len(gate.keys) if gate else 0,
            "access_cut": peers.cut_total if peers else 0,
            "audit_refused": self.core.audit.refused,
            "tcp_connections": self.guard.connections() if self.guard else 0,
            "tcp_cap": self.guard.cap if self.guard else 0,
            "tcp_shed": self.guard.shed if self.guard else 0,
            "tcp_source_cap": self.guard.source_cap if self.guard else 0,
            "tcp_shed_by_source": self.guard.shed_by_source if self.guard else 0,
        }


def install_signal_handlers(hub: Hub) -> None:
    """SIGTERM/SIGINT stop the hub cleanly (flushed history, job file removed)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: hub.stop())
