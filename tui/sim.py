"""A scripted job: the messages N ranks would send, without torch (tests, bench, screenshot).

The numbers are made up but shaped like a real mixed-precision DDP run on GPUs: a falling loss,
an AMP loss scale that grows and backs off on overflow (skipping that step on every rank),
compute / all-reduce / optimizer times, the learning rate as a `log` extra, the tokens of every
step (tokens/s comes from them) and MFU every 10th step (as a trainer that syncs every 10 steps
sends it), and optionally one
straggler that reaches the all-reduce late (so everyone else waits in it).

What the Flight Recorder would see comes as `collectives` messages (one per rank with each
heartbeat): DDP's start-up broadcasts and barrier, four 25 MiB gradient all-reduces per step
issued during backward (each lasting until the last rank issued it, plus the transfer at about
180 GB/s bus bandwidth on GPUs) and the trainer's small loss all-reduce every 10 steps. On
CPU (gloo) only the gradient all-reduces are timed (the agent's host timer), as on a real
gloo job. Heartbeats carry the group's last issued/completed sequence numbers and the
recorder's health (`wrapped`: a rank whose recorder ring wraps). Everything is deterministic
for a given seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from scalemon import protocol
from scalemon.collectives import CollectiveStats, bus_factor, size_bucket
from scalemon.protocol import Message

GIB = 1 << 30
GROUP = "0"
"""The default process group's name, as the Flight Recorder names it."""
BUCKET_BYTES = 25 << 20
"""DDP's gradient bucket size."""
BUSBW_GBPS = 180.0
"""Bus bandwidth of a collective once every rank issued it (GPUs, NVLink)."""


@dataclass
class SimJob:
    """Messages of a simulated job; `seq` is counted per rank as an agent would."""

    job: str = "sim"
    ranks: int = 4
    gpu: bool = True
    amp: bool = True
    straggler: int | None = None
    straggler_s: float = 0.03
    step_s: float = 0.1
    ranks_per_host: int = 8
    seed: int = 0
    wrapped: int | None = None
    start_t: float = 1_700_000_000.0
    seq: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.scale = 65536.0
        self.skipped_steps = 0
        self.good_steps = 0
        self.crng = random.Random(self.seed + 1)  # collectives: the other numbers stay as before
        self.coll_seq = 0  # last sequence number of the default group (the same on every rank)
        self.coll: dict[int, CollectiveStats] = {}  # per rank, since its last message
        self.issues: dict[int, list[list[Any]]] = {}
        self.groups_sent: set[int] = set()
        self.reads = 0

    def host(self, rank: int) -> str:
        """Host name of a rank."""
        return f"node{rank // self.ranks_per_host}"

    def hello(self, rank: int) -> dict[str, Any]:
        """Body of a rank's hello."""
        return {"host": self.host(rank), "pid": 10_000 + rank, "world_size": self.ranks,
                "local_rank": rank % self.ranks_per_host, "restart_count": 0,
                "device": "NVIDIA H100 80GB HBM3" if self.gpu else "cpu",
                "backend": "nccl" if self.gpu else "gloo", "agent_version": "0.1.0",
                "torch_version": "2.13.0", "config": {"preset": "gpt2-124m", "batch_size": 8,
                                                      "amp": "bf16" if self.amp else "off"}}

    def step_bodies(self, step: int, t: float) -> list[dict[str, Any]]:
        """The step message bodies of all ranks for one step that ended at time `t`."""
        rng = self.rng
        skipped = False
        if self.amp:
            # overflows get likelier as the scale grows: the usual AMP sawtooth
            if step > 20 and rng.random() < 0.003 * self.scale / 65536:
                skipped, self.scale = True, self.scale / 2
                self.skipped_steps += 1
                self.good_steps = 0
            else:
                self.good_steps += 1
                if self.good_steps % 100 == 0:
                    self.scale *= 2
        late = self.straggler_s if self.straggler is not None else 0.0
        base_compute = self.step_s * 0.6
        step_time = self.step_s + late + rng.gauss(0, self.step_s * 0.01)
        start = t - step_time
        if self.coll_seq == 0:
            self._startup_collectives(start - 1.0)
        self._step_collectives(step, start, base_compute, t)
        bodies = []
        for rank in range(self.ranks):
            compute = base_compute * (1 + rng.gauss(0, 0.02))
            if rank == self.straggler:
                compute += late
            optimizer = self.step_s * 0.08 * (1 + rng.gauss(0, 0.02))
            allreduce = max(0.001, step_time - compute - optimizer)
            body: dict[str, Any] = {
                "step": step,
                "loss": 2.0 + 3.0 * math.exp(-step / 150) + rng.gauss(0, 0.04) + rank * 0.005,
                "tokens": 8192,
                "step_time_s": step_time,
                "optimizer_time_s": optimizer,
                "allreduce_time_s": allreduce,
                "allreduce_count": 4,
                "allreduce_bytes": 4 * 25 << 20,
                "allreduce_issue_t": start + compute * 0.7,
                "agent_time_s": 0.0002,
                "extra": {"lr": 6e-4 * min(1.0, step / 100)},
            }
            if step % 10 == 0:  # measured between syncs, on logged steps (as the demo trainer)
                body["extra"].update(mfu=8192 / step_time * 6 * 124e6 / 989e12 if self.gpu
                                     else None)
            if self.amp:
                body.update(loss_scale=self.scale, skipped=skipped,
                            skipped_steps=self.skipped_steps)
            if self.gpu:
                body.update(mem_allocated_bytes=int((20.5 + 0.1 * (rank % 3)) * GIB),
                            mem_reserved_bytes=int(24 * GIB),
                            mem_peak_bytes=int((27.8 + 0.1 * (rank % 3)) * GIB))
            bodies.append(body)
        return bodies

    # ---- collectives ---------------------------------------------------------------------

    def _collective(self, op: str, nbytes: int, issued: dict[int, float], timed: bool) -> None:
        """Every rank issued collective #next of the default group at `issued[rank]`; each
        lasts until the last rank issued it plus the transfer."""
        self.coll_seq += 1
        factor = bus_factor(op, self.ranks) or 0.0
        done = max(issued.values()) + nbytes * factor / (BUSBW_GBPS * 1e9) + 20e-6
        bucket = size_bucket(nbytes)
        for rank, t in issued.items():
            row = self.coll.setdefault(rank, CollectiveStats()).row(GROUP, op, bucket)
            row.count += 1
            row.bytes += nbytes
            if timed:
                row.add_time(done - t)
            self.issues.setdefault(rank, []).append([GROUP, self.coll_seq, t])

    def _startup_collectives(self, t: float) -> None:
        """DDP's construction: parameters broadcast in two buffers, then a barrier."""
        jitter = self.crng.gauss
        for i in range(2):
            self._collective("broadcast", 250 << 20,
                             {r: t + 0.01 * i + abs(jitter(0, 2e-4)) for r in range(self.ranks)},
                             self.gpu)
        self._collective("barrier", 4, {r: t + 0.05 + abs(jitter(0, 2e-4))
                                        for r in range(self.ranks)}, self.gpu)

    def _step_collectives(self, step: int, start: float, compute: float, end: float) -> None:
        """Four gradient buckets issued during backward (the straggler later by its extra
        compute), and every 10th step the trainer's loss all-reduce."""
        jitter = self.crng.gauss
        for k in range(4):
            share = 0.7 + 0.1 * k
            self._collective("all_reduce", BUCKET_BYTES, {
                r: start + share * (compute + (self.straggler_s if r == self.straggler else 0))
                + abs(jitter(0, 1e-4)) for r in range(self.ranks)}, True)
        if step % 10 == 0:
            self._collective("all_reduce", 4, {r: end - 0.002 + abs(jitter(0, 5e-5))
                                               for r in range(self.ranks)}, self.gpu)

    def collectives(self, rank: int, step: int) -> dict[str, Any]:
        """Body of a rank's `collectives` message: what happened since its previous one."""
        groups = {}
        if rank not in self.groups_sent:
            self.groups_sent.add(rank)
            groups = {GROUP: {"desc": "default_pg", "ranks": list(range(self.ranks))}}
        stats = self.coll.pop(rank, CollectiveStats())
        return {"groups": groups, "stats": stats.to_wire(),
                "issues": self.issues.pop(rank, []), "step": step}

    def heartbeat(self, rank: int, step: int | None) -> dict[str, Any]:
        """Body of a heartbeat."""
        self.reads += rank == 0
        seq = self.coll_seq
        body: dict[str, Any] = {
            "phase": "forward", "phase_since_s": 0.01, "step": step, "dropped": 0,
            "collectives_issued": seq, "collectives_completed": seq, "groups": {GROUP: [seq, seq]},
            "clock_offset_s": 0.0, "recorder_read_s": 0.0031 * self.reads,
            "recorder_entries": seq,
            "recorder_lost": 37 * (self.reads // 3) if rank == self.wrapped else 0,
            "cpu_pct": 98.0 + rank % 4, "rss_bytes": int(6.2 * GIB), "queued": 0,
        }
        if self.gpu:
            body.update(gpu_util_pct=97.0 - (rank == self.straggler) * 20,
                        gpu_mem_used_bytes=int(30.1 * GIB), gpu_mem_total_bytes=80 * GIB,
                        gpu_power_w=610.0, gpu_temp_c=66.0)
        return body

    def hang(self, culprit: int, step: int, stuck_s: float = 15.0) -> list[Message]:
        """Heartbeats `stuck_s` after the last step of `run(step)` of a job that hangs there:
        rank `culprit` is stuck in its data loader and never issues the next gradient
        all-reduce; the others issued it and wait in it. Each carries the rank's stack."""
        t = self.end_t(step) + stuck_s
        seq = self.coll_seq
        out = []
        for rank in range(self.ranks):
            late = rank == culprit
            body = self.heartbeat(rank, step)
            body.update(phase="python" if late else "collective", phase_since_s=stuck_s - 0.5,
                        groups={GROUP: [seq if late else seq + 1, seq]},
                        collectives_issued=seq + (not late), collectives_completed=seq,
                        inflight=None if late else [[GROUP, seq + 1, "all_reduce",
                                                     t - stuck_s + 0.06]],
                        stack=_STACK_DATA if late else _STACK_BACKWARD)
            out.append(self.message(rank, "heartbeat", body, t))
        return out

    def message(self, rank: int, mtype: str, body: dict[str, Any], t: float) -> Message:
        """A message with the rank's next seq."""
        seq = self.seq.get(rank, 0)
        self.seq[rank] = seq + 1
        return Message(mtype, self.job, rank, seq, t, body)

    def frame(self, rank: int, mtype: str, body: dict[str, Any], t: float) -> bytes:
        """The same as an encoded frame, for sending to a hub."""
        m = self.message(rank, mtype, body, t)
        return protocol.encode(m.type, m.job, m.rank, m.seq, m.body, t=m.t)

    def run(self, steps: int, heartbeat_every: int = 10, finish: bool = False) -> list[Message]:
        """A whole run: hellos, `steps` steps of every rank, heartbeats, optional exits."""
        out = [self.message(r, "hello", self.hello(r), self.start_t) for r in range(self.ranks)]
        for step in range(1, steps + 1):
            t = self.start_t + step * self.step_s
            for rank, body in enumerate(self.step_bodies(step, t)):
                out.append(self.message(rank, "step", body, t + rank * 1e-4))
            if step % heartbeat_every == 0:
                out.extend(self.message(r, "collectives", self.collectives(r, step), t)
                           for r in range(self.ranks))
                out.extend(self.message(r, "heartbeat", self.heartbeat(r, step), t)
                           for r in range(self.ranks))
        if finish:
            t = self.start_t + steps * self.step_s + 0.01
            out.extend(self.message(r, "exit", {"reason": "finished", "exit_code": 0,
                                                "step": steps, "dropped": 0}, t)
                       for r in range(self.ranks))
        return out

    def end_t(self, steps: int) -> float:
        """Envelope time of the last step of `run(steps)`."""
        return self.start_t + steps * self.step_s


_STACK_TOP = """\
  File "/workspace/train.py", line 214, in <module>
    main()
  File "/workspace/train.py", line 171, in main
"""
_STACK_DATA = _STACK_TOP + """\
    x, y = next(batches)
  File "/workspace/data.py", line 58, in __next__
    shard = self._load(self.shards[self.i])
  File "/workspace/data.py", line 41, in _load
    return np.load(path, mmap_mode="r")  # /mnt/shared/shard-[0042].npy
"""
_STACK_BACKWARD = _STACK_TOP + """\
    scaler.scale(loss).backward()
  File "/usr/lib/python3/site-packages/torch/_tensor.py", line 648, in backward
    torch.autograd.backward(
  File "/usr/lib/python3/site-packages/torch/autograd/graph.py", line 829, in _engine_run_backward
    return Variable._execution_engine.run_backward(
"""
