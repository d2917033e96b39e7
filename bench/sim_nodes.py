"""Simulated nodes for bench/scale.py: one worker process hosts many nodes, each a real `Relay`
(its own ipc directory, its own CurveZMQ connection to the hub, found through the job file)
and its ranks, which speak the real protocol over real sockets to that relay.

A simulated rank does what the agent's sender does, on a schedule instead of a training loop:
a PUSH socket (SNDHWM 10,000, NOBLOCK sends; a full socket drops the message and counts it,
which leaves a gap in the rank's `seq`) and a DEALER for the `sync` round trip once a second.
It sends `hello`, then `step` messages at `rate` per second (the bodies of `tui/sim.py`, the
fields of a GPU run with AMP) and a `heartbeat` every second carrying its drop count, and at
the end a last `heartbeat` and `exit`. All ranks of the job step together, as ranks bound by
collectives do: every worker ticks on the same wall-clock schedule.

Nothing here waits on the hub: a worker that cannot keep up sends late, and says how late
(`lag_*`), and how much it sent against the plan.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import zmq

from scalemon import protocol
from scalemon.metrics import SENT_WHEN_CHANGED
from scalemon.tui.sim import SimJob

COLLECTIVES_PER_STEP = 4
"""Gradient all-reduces a step (DDP's buckets) when the ranks send `collectives`."""
SOCKET_HWM = 10_000
"""The agent's PUSH high-water mark (`agent.transport.Sender`)."""
ROUND_S = 0.02
"""The longest a worker sleeps between two looks at its relays (the relay's FLUSH_S)."""
FULL_S = 0.1
"""Every relay's timers (reports, looking for the hub) run this often; in between, only the
relays whose sockets have input are served."""


@dataclass
class Plan:
    """What one worker simulates."""

    job: str
    home: str
    runtime_dir: str
    world_size: int
    nodes: list[tuple[str, int]]
    """(node name, its first global rank)."""
    ranks_per_node: int
    rate: float
    """Steps per second of every rank."""
    seconds: float
    sync_s: float = 1.0
    """A `sync` round trip per rank this often (the agent's default); 0: none."""
    drain_s: float = 3.0
    """After the last message: keep the relays forwarding and reporting this long."""
    hang_s: float = 0.0
    """After the last step: the job hangs this long before its ranks exit (0: no hang). Rank
    `hang_culprit` is stuck in its data loader; the others wait in the next all-reduce; every
    rank beats every second, as the agent's stuck ranks do."""
    hang_culprit: int = 0
    hang_whole_beats: bool = False
    """Every hang heartbeat carries its stack and collectives in flight (agents before 1.14)."""
    collectives_every_s: float = 0.0
    """A `collectives` message per rank this often (the agent's recorder reads), with the issue
    times and figures of its `COLLECTIVES_PER_STEP` gradient all-reduces a step since its last
    one; 0: none (the Flight Recorder's messages left out)."""


@dataclass
class _Rank:
    rank: int
    local: int
    push: zmq.Socket
    dealer: zmq.Socket
    seq: int = 0
    dropped: int = 0
    sync_sent: float | None = None
    rtts: list[float] = field(default_factory=list)
    beat_every_s: float = 1.0
    """The heartbeat interval while stepping, as the answers to its syncs say (the agent's
    `Heartbeat.due`)."""
    last_beat_tick: int = 0
    heartbeats: int = 0
    relay_answered: int = 0
    stuck_sent: bool = False
    """Its stuck values (stack, groups, collectives in flight) went out whole: its later hang
    heartbeats name them in `same`, as the agent's do (protocol 1.14)."""
    issues: list[list[Any]] = field(default_factory=list)
    """[group, seq, issue time] of its collectives not sent yet."""
    last_read_tick: int = 0
    collectives_sent: int = 0


class NodeSim(SimJob):
    """`SimJob`'s step and heartbeat bodies for one node's ranks, without its Flight Recorder
    bookkeeping (which simulates every collective of every rank and grows without a
    `collectives` message to take it). The same seed on every node gives every node the same
    AMP loss-scale history, as in a real job."""

    def _startup_collectives(self, t: float) -> None:
        pass

    def _step_collectives(self, step: int, start: float, compute: float, end: float) -> None:
        pass


class Node:
    """One simulated node: its relay and its ranks' sockets."""

    def __init__(self, ctx: zmq.Context, plan: Plan, name: str, first_rank: int) -> None:
        from scalemon.home.address import HubAddress
        from scalemon.home.paths import relay_dir
        from scalemon.relay.forward import Relay

        self.name = name
        index = first_rank // plan.ranks_per_node  # each node its own loopback address, as
        source = f"127.{1 + index // 62500}.{index // 250 % 250}.{index % 250 + 1}"  # hosts
        self.relay = Relay(plan.job, relay_dir(plan.job, name), home=Path(plan.home),
                           linger_s=3600.0, node=name,  # one process stands for many nodes
                           source=source)
        self.relay.open(ctx)
        local = HubAddress.for_directory(self.relay.directory)
        self.sim = NodeSim(job=plan.job, ranks=plan.ranks_per_node)
        self.ranks: list[_Rank] = []
        for i in range(plan.ranks_per_node):
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, SOCKET_HWM)
            push.setsockopt(zmq.LINGER, 2000)
            push.connect(local.ingest)
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDHWM, 4)
            dealer.connect(local.rpc)
            self.ranks.append(_Rank(first_rank + i, i, push, dealer))

    def send(self, r: _Rank, mtype: str, body: dict[str, Any], t: float) -> None:
        """Encode and send one message of rank `r`, as the agent does: NOBLOCK, a full
        socket drops it (its seq is spent all the same)."""
        frame = protocol.encode(mtype, self.sim.job, r.rank, r.seq, body, t)
        r.seq += 1
        try:
            r.push.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            r.dropped += 1

    def hello(self, world_size: int, t: float) -> None:
        """Each rank's `hello` and, as the agent, its first heartbeat right after."""
        for r in self.ranks:
            body = self.sim.hello(r.local)
            body.update(host=self.name, pid=100_000 + r.rank, world_size=world_size)
            self.send(r, "hello", body, t)
            self.send(r, "heartbeat", self._heartbeat(r, None), t)
            if r.rank == 0:  # the job's process group, said once (its members for the hang)
                from scalemon.tui.sim import GROUP

                self.send(r, "collectives", {"groups": {GROUP: {
                    "desc": "default_pg", "ranks": list(range(world_size))}},
                    "stats": [], "issues": []}, t)

    def step(self, step: int, t: float, bodies: list[dict[str, Any]], rate: float,
             collectives_every_s: float = 0.0) -> None:
        """Each rank's `step` (`bodies` by local rank), and its heartbeat when due: every
        second, or every `beat_every_s` while it steps, as the agent; with
        `collectives_every_s`, its step's collectives, sent in a `collectives` message when
        that many seconds of steps went by."""
        for r, body in zip(self.ranks, bodies, strict=True):
            self.send(r, "step", body, t)
            every = max(1, int(round(rate * max(1.0, r.beat_every_s))))
            if step - r.last_beat_tick >= every:
                r.last_beat_tick = step
                self.send(r, "heartbeat", self._heartbeat(r, step), t)
            if collectives_every_s:
                self._issue(r, step, t)
                if step - r.last_read_tick >= max(1, int(round(rate * collectives_every_s))):
                    r.last_read_tick = step
                    self._send_collectives(r, step, t)

    def _issue(self, r: _Rank, step: int, t: float) -> None:
        """Rank `r` issued its step's gradient all-reduces (numbered as every rank numbers
        them: the job's collectives are the same on every rank), a little apart from the
        other ranks."""
        from scalemon.tui.sim import GROUP

        spread = (r.rank % 97) * 1e-5  # each rank its own lateness, the same every step
        for k in range(COLLECTIVES_PER_STEP):
            seq = (step - 1) * COLLECTIVES_PER_STEP + k + 1
            r.issues.append([GROUP, seq, t - 0.05 + 0.01 * k + spread])

    def _send_collectives(self, r: _Rank, step: int, t: float) -> None:
        """What the agent's recorder read sends: the collectives issued since its last one."""
        from scalemon.collectives import CollectiveStats, size_bucket
        from scalemon.tui.sim import BUCKET_BYTES, GROUP

        stats = CollectiveStats()
        row = stats.row(GROUP, "all_reduce", size_bucket(BUCKET_BYTES))
        for _ in r.issues:
            row.count += 1
            row.bytes += BUCKET_BYTES
            row.add_time(0.012)
        self.send(r, "collectives", {"groups": {}, "stats": stats.to_wire(),
                                     "issues": r.issues, "step": step}, t)
        r.collectives_sent += 1
        r.issues = []

    def hang_beat(self, step: int, t: float, stuck_s: float, culprit: int,
                  whole: bool = False) -> None:
        """Each rank's heartbeat while the job hangs after `step` (`SimJob.hang`'s bodies);
        `whole`: each one with its stack and collectives in flight (agents before 1.14)."""
        from scalemon.tui.sim import _STACK_BACKWARD, _STACK_DATA, GROUP

        for r in self.ranks:
            late = r.rank == culprit
            body = self._heartbeat(r, step)
            seq = body["collectives_issued"]
            body.update(phase="python" if late else "collective",
                        phase_since_s=max(0.0, stuck_s),
                        groups={GROUP: [seq if late else seq + 1, seq]},
                        collectives_issued=seq + (not late), collectives_completed=seq,
                        inflight=None if late else [[GROUP, seq + 1, "all_reduce",
                                                     t - stuck_s]],
                        stack=_STACK_DATA if late else _STACK_BACKWARD)
            if r.stuck_sent and not whole:  # unchanged since its first stuck heartbeat
                same = [n for n in SENT_WHEN_CHANGED if body.pop(n, None) is not None]
                body["same"] = same
            r.stuck_sent = True
            self.send(r, "heartbeat", body, t)

    def finish(self, step: int, t: float) -> None:
        """The agent's `finish()`: a last heartbeat, then `exit`."""
        for r in self.ranks:
            self.send(r, "heartbeat", self._heartbeat(r, step), t)
            self.send(r, "exit", {"reason": "finished", "exit_code": 0, "step": step,
                                  "dropped": r.dropped}, t)

    def _heartbeat(self, r: _Rank, step: int | None) -> dict[str, Any]:
        r.heartbeats += 1
        body = self.sim.heartbeat(r.local, step)
        body["dropped"] = r.dropped
        return body

    def sync(self, r: _Rank, now: float) -> bool:
        """Start rank `r`'s round trip with the hub (through the relay); True when sent."""
        if r.sync_sent is not None and now - r.sync_sent < 5.0:
            return False  # one in flight, as the agent
        try:
            r.dealer.send(protocol.encode_request("sync", rank=r.rank, t=time.time()),
                          zmq.NOBLOCK)
        except zmq.Again:
            return False
        r.sync_sent = now
        return True

    def read_sync(self, r: _Rank, now: float) -> bool:
        """Take rank `r`'s answer if it came; True when it did."""
        try:
            frame = r.dealer.recv(zmq.NOBLOCK)
        except zmq.Again:
            return False
        if r.sync_sent is not None:
            r.rtts.append(now - r.sync_sent)
        r.sync_sent = None
        reply = protocol.decode_reply(frame)
        beat = reply.get("heartbeat_stepping_s")
        if isinstance(beat, (int, float)) and beat > 0:
            r.beat_every_s = float(beat)
        r.relay_answered += reply.get("via") == "relay"
        return True

    def close(self) -> None:
        for r in self.ranks:
            r.push.close(linger=0)
            r.dealer.close(linger=0)
        self.relay.close()


class Worker:
    """Many nodes in one process, driven by one loop: ticks on schedule, sync round trips,
    one poll over every relay's sockets."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 65_536)
        self.nodes = [Node(self.ctx, plan, name, first) for name, first in plan.nodes]
        self.ranks = [(node, r) for node in self.nodes for r in node.ranks]
        # every node's ranks send the same bodies (the same seed gives every node the same
        # numbers anyway): made once a step for the whole worker
        self.sim = NodeSim(job=plan.job, ranks=plan.ranks_per_node, step_s=1.0 / plan.rate)
        self.relay_cpu_s = 0.0  # this thread's CPU in the relays' code
        self.rank_cpu_s = 0.0  # in the ranks' (bodies, encoding, sends, round trips)
        self._poller = zmq.Poller()
        self._polled: list[zmq.Socket] = []
        self._owner: dict[zmq.Socket, Node] = {}
        self._next_full = 0.0

    def service_relays(self, timeout_s: float) -> None:
        """One poll over every relay's sockets (up to `timeout_s`), then the relays with
        input handle it; every FULL_S all of them (their timers: reports, the hub's
        whereabouts)."""
        c0 = time.thread_time()
        now = time.monotonic()
        full = now >= self._next_full
        if full:
            self._next_full = now + FULL_S
            pairs = [(s, node) for node in self.nodes for s in node.relay.poll_sockets(now)]
            socks = [s for s, _ in pairs]
            if socks != self._polled:  # a relay (re)connected to the hub
                self._poller = zmq.Poller()
                for s in socks:
                    self._poller.register(s, zmq.POLLIN)
                self._owner = dict(pairs)
                self._polled = socks
        events = dict(self._poller.poll(max(0, int(timeout_s * 1000))))
        if full:
            for node in self.nodes:
                node.relay.handle(events, now)
        else:
            for node in {self._owner[s] for s in events}:
                node.relay.handle(events, now)
        self.relay_cpu_s += time.thread_time() - c0  # the poll's own CPU included

    def connected(self) -> bool:
        """True once every relay knows the hub's clock (three round trips with it)."""
        return all(node.relay.clock_offset_s is not None for node in self.nodes)

    def run(self, start_t: float) -> dict[str, Any]:
        """The whole simulation from wall time `start_t`; returns its counts."""
        plan = self.plan
        ticks = max(1, int(round(plan.seconds * plan.rate)))
        while time.time() < start_t:
            self.service_relays(min(ROUND_S, max(0.0, start_t - time.time())))
        self.relay_cpu_s = self.rank_cpu_s = 0.0  # the run's only
        c0 = time.thread_time()
        t0 = time.monotonic()  # monotonic at start_t
        cpu0 = os.times()
        for node in self.nodes:
            node.hello(plan.world_size, time.time())
        self.rank_cpu_s += time.thread_time() - c0
        n = len(self.ranks)
        sync_every = plan.sync_s
        next_sync = [t0 + (i / max(1, n)) * sync_every for i in range(n)] if sync_every else []
        sync_i = 0
        in_flight: set[int] = set()
        lags: list[float] = []
        tick = 0
        answered = 0
        give_up = t0 + plan.seconds * 3 + 30  # bounded, whatever the machine does
        while tick < ticks and time.monotonic() < give_up:
            now = time.monotonic()
            c0 = time.thread_time()
            due = t0 + (tick + 1) / plan.rate
            if now >= due:
                tick += 1
                lags.append(now - due)
                wall = time.time()
                bodies = self.sim.step_bodies(tick, wall)
                for node in self.nodes:
                    node.step(tick, wall, bodies, plan.rate, plan.collectives_every_s)
                now = time.monotonic()
            if sync_every:
                for _ in range(n):  # the round trips due by now, in turn
                    if next_sync[sync_i] > now:
                        break
                    node, r = self.ranks[sync_i]
                    if node.sync(r, now):
                        in_flight.add(sync_i)
                    next_sync[sync_i] += sync_every
                    sync_i = (sync_i + 1) % n
            self.rank_cpu_s += time.thread_time() - c0
            wait = min(ROUND_S, max(0.0, t0 + (tick + 1) / plan.rate - time.monotonic()))
            self.service_relays(wait)
            if in_flight:
                c0 = time.thread_time()
                now = time.monotonic()
                for i in list(in_flight):
                    node, r = self.ranks[i]
                    if node.read_sync(r, now):
                        answered += 1
                        in_flight.discard(i)
                self.rank_cpu_s += time.thread_time() - c0
        t_last = time.monotonic()
        cpu1 = os.times()
        t_last_wall = time.time()
        load_heartbeats = sum(r.heartbeats for _, r in self.ranks)
        if plan.hang_s > 0:
            self.hang(tick, t_last_wall)
        c0 = time.thread_time()
        for node in self.nodes:
            node.finish(tick, time.time())
        self.rank_cpu_s += time.thread_time() - c0
        t_end = time.monotonic()  # the last message sent (after the hang, if any)
        end = time.monotonic() + plan.drain_s
        while time.monotonic() < end:  # the relays forward the rest and report their counts
            self.service_relays(ROUND_S)
        lags.sort()
        stats = [node.relay.stats() for node in self.nodes]
        rtts = sorted(x for _, r in self.ranks for x in r.rtts)
        return {
            "t0_monotonic": t0, "t_last_monotonic": t_last, "t_last_step_wall": t_last_wall,
            "t_end_monotonic": t_end,
            "ticks_planned": ticks, "ticks_sent": tick,
            "seconds_planned": plan.seconds, "seconds_taken": t_last - t0,
            "lag_p50_s": _pct(lags, 0.5), "lag_p99_s": _pct(lags, 0.99),
            "lag_max_s": lags[-1] if lags else None,
            "ranks": {r.rank: [r.seq, r.dropped] for _, r in self.ranks},
            "relays": {node.name: stats[i] for i, node in enumerate(self.nodes)},
            "syncs_answered": answered,
            "syncs_answered_by_relays": sum(r.relay_answered for _, r in self.ranks),
            "heartbeats_sent": sum(r.heartbeats for _, r in self.ranks),
            "heartbeats_in_load": load_heartbeats,
            "collectives_sent": sum(r.collectives_sent for _, r in self.ranks),
            "sync_rtt_p50_s": _pct(rtts, 0.5), "sync_rtt_p99_s": _pct(rtts, 0.99),
            "rank_cpu_s": self.rank_cpu_s, "relay_cpu_s": self.relay_cpu_s,
            "process_cpu_s": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system),
        }

    def hang(self, step: int, t_last: float) -> None:
        """The job hangs after `step` for `plan.hang_s`: no rank steps; every rank beats
        every second; the relays go on forwarding."""
        plan = self.plan
        end = time.monotonic() + plan.hang_s
        next_beat = time.monotonic() + 1.0
        while time.monotonic() < end:
            if time.monotonic() >= next_beat:
                next_beat += 1.0
                wall = time.time()
                for node in self.nodes:
                    node.hang_beat(step, wall, wall - t_last, plan.hang_culprit,
                                   plan.hang_whole_beats)
            self.service_relays(ROUND_S)

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        self.ctx.term()


def _pct(ordered: list[float], q: float) -> float | None:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def run_worker(plan: Plan, conn: Connection, nice: int = 0) -> None:
    """The worker process: build the nodes, say "ready" once every relay reached the hub,
    run from the start time it is given, send back its counts. `nice`: a lower CPU priority
    than the hub's and the dashboard's, whose machine the nodes stand outside of."""
    if nice:
        os.nice(nice)
    os.environ["SCALEMON_HOME"] = plan.home
    os.environ["SCALEMON_RUNTIME_DIR"] = plan.runtime_dir
    worker = None
    try:
        worker = Worker(plan)
        deadline = time.monotonic() + 120 + 0.5 * len(plan.nodes)
        while not worker.connected() and time.monotonic() < deadline:
            worker.service_relays(ROUND_S)
        conn.send(("ready", worker.connected()))
        while not conn.poll(0):  # keep the relays reporting while the others get ready
            worker.service_relays(ROUND_S)
        message = conn.recv()
        if message[0] != "go":
            return
        result = worker.run(message[1])
        conn.send(("done", result))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        if worker is not None:
            worker.close()
        conn.close()
