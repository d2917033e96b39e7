"""A long history's summary kept up as it grows: `RunDigest`.

`RunDigest` takes a job's messages in history order once, keeping what `summarize` needs in a
size bounded by ranks x buckets + steps + seconds (not by records): per rank its last step,
tokens window, step-time and compute-time `Quantiles` and memory maxima; per step the sums of
the ranks' tokens/s and MFU; per second the step records' times (stalls). `figures` gives the
`RunFigures` a summary is made of.

A digest is checkpointed with the `JobFold` of the same records beside the history
(`scalemon.link.checkpoint`), so a summary of a 100M-record history folds only the records
after the last checkpoint.

Exact like `run_records` (for the same records), except where `figures().exact` is False:
quantiles over more than `runfigures.EXACT_MAX` values of a rank (relative error
`runfigures.ALPHA`), a step a rank logged again (a restarted rank: both records count, where
`run_records` keeps the later), and a mesh that changed while ranks logged steps (the job's
tokens/s counts the ranks `throughput.counted` chose as each step came in).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from typing import Any

from scalemon import throughput
from scalemon.metrics import derived_values
from scalemon.protocol import Message
from scalemon.state.fold import step_values
from scalemon.state.runfigures import Quantiles, RunFigures, StepClock, finite, quantiles_of

HEARTBEAT_MEMORY = ("rss_bytes", "gpu_mem_used_bytes")
MEMORY = ("mem_allocated_bytes", "mem_peak_bytes")



class RankDigest:
    """One rank's part of a `RunDigest`."""

    __slots__ = ("last_step", "window", "step_time", "compute", "memory")

    def __init__(self) -> None:
        self.last_step: int | None = None
        self.window = throughput.TokenWindow()
        self.step_time = Quantiles()
        self.compute = Quantiles()
        self.memory: dict[str, float] = {}


class RunDigest:
    """What a summary needs of a job's messages, taken in one by one (`add`)."""

    group_best: dict[Any, tuple[tuple[int, ...], int]] | None = None
    """(A checkpoint of an earlier scalemon has none: made again at its next new rank.)"""

    def __init__(self) -> None:
        self.ranks: dict[int, RankDigest] = {}
        self.steps: set[int] = set()
        self.clock = StepClock()
        self.loss_rank: int | None = None
        self.loss: dict[int, float] = {}
        self.own_rate: set[int] = set()
        self.tokens_per_rank = Quantiles()
        self.tokens_ranks: list[int] = []
        self.counted: set[int] = set()
        self.job_steps: dict[int, list] = {}  # step -> [sum of counted tokens/s, ranks, bad]
        self.mfu_steps: dict[int, list] = {}  # step -> [sum of MFU, ranks, bad]
        self.mfu_ranks: set[int] = set()
        self.step_time_all = Quantiles()
        self.bubbles = Quantiles()
        self.heartbeat_max: dict[int, dict[str, float]] = {}
        self.coords: dict[int, Any] = {}
        self.repeated = 0
        self.recounted = False
        self.group_best = {}
        """Per token group, its member's (place, rank) that counts (`_count_in`)."""
        self.mesh_seen: Any = None
        """What the ranks' coordinates were last read from (`link.checkpoint`)."""

    def add(self, msg: Message, coords: Callable[[int], Any]) -> None:
        """Take one message in; `coords(rank)`: its mesh coordinates now (`JobState.mesh`)."""
        if msg.type == "step":
            self._step(msg, coords)
        elif msg.type == "heartbeat":
            seen = self.heartbeat_max.setdefault(msg.rank, {})
            for name in HEARTBEAT_MEMORY:
                value = msg.body.get(name)
                if type(value) in (int, float) and value > seen.get(name, -1):
                    seen[name] = float(value)


    def mesh_changed(self, coords: Callable[[int], Any]) -> None:
        """The job's mesh (the ranks' coordinates) may have changed: ask `coords` again."""
        self.coords.clear()
        self._recount(coords)

    def _recount(self, coords: Callable[[int], Any]) -> None:
        """Every token rank's coordinates asked again, `counted` made anew from them."""
        for rank in self.tokens_ranks:
            if rank not in self.coords:
                self.coords[rank] = coords(rank)
        self.group_best = {}
        counted: set[int] = set()
        for rank in self.tokens_ranks:
            self._count_in(rank, counted)
        if self.counted and not self.counted <= counted:
            self.recounted = True
        self.counted = counted

    def _count_in(self, rank: int, counted: set[int]) -> bool:
        """Rank `rank` (its coordinates in `coords`) into `counted` as `throughput.counted`
        has it (the ranks in rank order): every rank without a mesh, of each token group the
        member of the least place, the lower rank on a tie. True when it displaced a counted
        member of its group (that one leaves `counted`)."""
        coords = self.coords[rank]
        if coords is None:
            counted.add(rank)
            return False
        group, place = throughput.token_group(coords), (throughput.token_place(coords), rank)
        best = self.group_best
        assert best is not None
        held = best.get(group)
        if held is not None and held <= place:
            return False
        best[group] = place
        counted.add(rank)
        if held is None:
            return False
        counted.discard(held[1])
        return True

    def _step(self, msg: Message, coords: Callable[[int], Any]) -> None:
        body, rank = msg.body, msg.rank
        step = body["step"]
        rd = self.ranks.get(rank)
        if rd is None:
            rd = self.ranks[rank] = RankDigest()
        if rd.last_step is not None and step <= rd.last_step:
            self.repeated += 1
        else:
            rd.last_step = step
        extra = body.get("extra")
        if extra and "tokens_per_s" in extra:
            self.own_rate.add(rank)
        rd.window.add(body.get("tokens"), body.get("step_time_s"))
        rate = None if rank in self.own_rate else rd.window.rate()
        values = step_values(body, derived_values(body, rate))
        self.steps.add(step)
        self.clock.add(msg.t, step)
        if "loss" in values:
            if self.loss_rank is None or rank < self.loss_rank:
                self.loss_rank, self.loss = rank, {}
            if rank == self.loss_rank:
                self.loss[step] = values["loss"]
        if "step_time_s" in values:
            rd.step_time.add(values["step_time_s"])
            self.step_time_all.add(values["step_time_s"])
        if "compute_s" in values:
            rd.compute.add(values["compute_s"])
        if "tokens_per_s" in values:
            self._tokens(rank, step, values["tokens_per_s"], coords)
        if "mfu" in values:
            self.mfu_ranks.add(rank)
            _add_to(self.mfu_steps, step, values["mfu"])
        self.bubbles.add(body.get("pipeline_bubble"))
        for name in MEMORY:
            value = finite(values.get(name))
            if value is not None and value > rd.memory.get(name, -math.inf):
                rd.memory[name] = value

    def _tokens(self, rank: int, step: int, value: float, coords: Callable[[int], Any]
                ) -> None:
        self.tokens_per_rank.add(value)
        if rank not in self.coords:  # its first figure: `coords` holds every token rank's
            self.coords[rank] = coords(rank)
            bisect.insort(self.tokens_ranks, rank)
            if self.group_best is None:
                self._recount(coords)  # a checkpoint of an earlier scalemon: once
            elif self._count_in(rank, self.counted):  # as a pass over every rank would count
                self.recounted = True  # (that pass: 0.8 s at 2,048 ranks, 57 s at 16,384)
        if rank in self.counted:
            _add_to(self.job_steps, step, value)

    def figures(self) -> RunFigures:
        """The figures of the messages taken in so far."""
        ranks = self.ranks
        counted = [r for r in self.tokens_ranks if r in self.counted]
        out = RunFigures(
            last_step={r: d.last_step for r, d in ranks.items() if d.last_step is not None},
            step_count=len(self.steps), first_step=min(self.steps) if self.steps else None,
            clock=self.clock, loss_rank=self.loss_rank, loss=self.loss,
            tokens_job=quantiles_of(_complete(self.job_steps, len(counted), "sum")),
            tokens_per_rank=self.tokens_per_rank, tokens_ranks=counted,
            own_rate=set(self.own_rate),
            mfu=quantiles_of(_complete(self.mfu_steps, len(self.mfu_ranks), "mean")),
            step_time={r: d.step_time for r, d in sorted(ranks.items())},
            step_time_all=self.step_time_all,
            compute_median={r: d.compute.quantile(0.5) for r, d in ranks.items()},
            bubbles=self.bubbles,
            memory={r: {name: d.memory.get(name) for name in MEMORY} for r, d in ranks.items()},
            heartbeat_max=self.heartbeat_max, ranks=set(ranks))
        sketches = [self.tokens_per_rank, self.step_time_all, self.bubbles,
                    *(q for d in ranks.values() for q in (d.step_time, d.compute))]
        out.exact = (all(q.exact for q in sketches) and not self.repeated
                     and not self.recounted)
        return out


def _add_to(steps: dict[int, list], step: int, value: float) -> None:
    slot = steps.get(step)
    if slot is None:
        slot = steps[step] = [0.0, 0, False]
    slot[1] += 1
    number = finite(value)
    if number is None:
        slot[2] = True
    else:
        slot[0] += number


def _complete(steps: dict[int, list], ranks: int, combine: str) -> Iterable[float]:
    """Per step in order, the sum (or mean) of the steps every rank gave a finite value for."""
    for step in sorted(steps):
        total, n, bad = steps[step]
        if n == ranks and not bad:
            yield total if combine == "sum" else total / n


DIGEST_CLASSES = (RunDigest, RankDigest, Quantiles, StepClock)
"""The classes a pickled digest is made of (besides `throughput.TokenWindow` and containers)."""
