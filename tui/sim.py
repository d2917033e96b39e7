"""A scripted job: the messages N ranks would send, without torch (tests, bench, screenshot).

The numbers are made up but shaped like a real mixed-precision DDP run on GPUs: a falling loss,
an AMP loss scale that grows and backs off on overflow (skipping that step on every rank),
compute / all-reduce / optimizer times, the learning rate as a `log` extra, tokens/s and MFU
every 10th step (as a trainer that syncs every 10 steps sends them), and optionally one
straggler that reaches the all-reduce late (so everyone else waits in it). Everything is
deterministic for a given seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from scalemon import protocol
from scalemon.protocol import Message

GIB = 1 << 30


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
    start_t: float = 1_700_000_000.0
    seq: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.scale = 65536.0
        self.skipped_steps = 0
        self.good_steps = 0

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
                tokens_per_s = 8192 / step_time
                body["extra"].update(tokens_per_s=tokens_per_s,
                                     mfu=tokens_per_s * 6 * 124e6 / 989e12 if self.gpu else None)
            if self.amp:
                body.update(loss_scale=self.scale, skipped=skipped,
                            skipped_steps=self.skipped_steps)
            if self.gpu:
                body.update(mem_allocated_bytes=int((20.5 + 0.1 * (rank % 3)) * GIB),
                            mem_reserved_bytes=int(24 * GIB),
                            mem_peak_bytes=int((27.8 + 0.1 * (rank % 3)) * GIB))
            bodies.append(body)
        return bodies

    def heartbeat(self, rank: int, step: int | None) -> dict[str, Any]:
        """Body of a heartbeat."""
        body: dict[str, Any] = {
            "phase": "forward", "phase_since_s": 0.01, "step": step, "dropped": 0,
            "collectives_issued": 4 * (step or 0), "collectives_completed": 4 * (step or 0),
            "cpu_pct": 98.0 + rank % 4, "rss_bytes": int(6.2 * GIB), "queued": 0,
        }
        if self.gpu:
            body.update(gpu_util_pct=97.0 - (rank == self.straggler) * 20,
                        gpu_mem_used_bytes=int(30.1 * GIB), gpu_mem_total_bytes=80 * GIB,
                        gpu_power_w=610.0, gpu_temp_c=66.0)
        return body

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
