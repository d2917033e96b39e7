"""Pipeline parallelism of the demo GPT (`--pp N`, `--pp-schedule`, `--microbatches M`) with
`torch.distributed.pipelining`.

Every rank builds the whole GPT from the same seed, then keeps only its stages' parts
(`split_stages`): the layers are cut into pp x v consecutive stages (v = 2 virtual stages per
rank for the interleaved schedule, 1 otherwise), stage s on pipeline rank s % pp; the first stage
also holds the embeddings, the last the final norm and the lm_head. Parameter names stay the
full model's ("transformer.h.3.attn.c_q.weight"), so checkpoints (DCP) read the same in every
layout.

A step runs the whole batch as M microbatches through the schedule (GPipe: every forward, then
every backward; 1F1B: one forward, one backward in the steady state; interleaved 1F1B: the
same over v stages per rank, a bubble v times smaller). --grad-accum G multiplies the
microbatches (G x M of them in one schedule step): accumulation is what the microbatches do.

The lm_head shares its weight with the token embedding. With pp > 1 the two live on the first
and the last stage: each keeps a copy, equal at the start (same seed), and their gradients are
summed over a group of those two ranks after each backward (`TiedEmbedding`, as Megatron does),
so both take the same optimizer step and stay equal, and the losses match one rank's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .model import GPT

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def virtual_stages(schedule: str) -> int:
    """Stages per pipeline rank: 2 for the interleaved schedule, else 1."""
    return 2 if schedule == "interleaved" else 1


def pipeline_problem(pp: int, schedule: str, microbatches: int, batch_size: int,
                     grad_accum: int, n_layer: int) -> str | None:
    """Why these pipeline settings cannot run, or None (checked before torch.distributed)."""
    v = virtual_stages(schedule)
    if n_layer < pp * v:
        what = f"{pp} x {v} virtual stages" if v > 1 else f"{pp} stages"
        return (f"--pp {pp} --pp-schedule {schedule} cuts the model into {what}, and it has "
                f"{n_layer} layers: use fewer stages or a larger --preset")
    if batch_size % microbatches:
        return (f"--microbatches {microbatches} must divide --batch-size {batch_size} "
                "(each microbatch is an equal slice of the batch)")
    m = microbatches * grad_accum
    if schedule == "1f1b" and m < pp:
        return (f"--pp-schedule 1f1b needs at least as many microbatches as stages: "
                f"{m} (--microbatches x --grad-accum) < --pp {pp}")
    rounds = max(1, m // pp)
    if schedule == "interleaved" and m % rounds:
        return (f"--pp-schedule interleaved runs microbatches in rounds of --pp {pp}: "
                f"{m} (--microbatches x --grad-accum) is not a multiple of {rounds}")
    return None


def stage_layers(n_layer: int, n_stages: int) -> list[range]:
    """The layers of each stage: consecutive, as equal as can be (earlier stages one more)."""
    base, extra = divmod(n_layer, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


class StageModule(nn.Module):
    """The part of a GPT one pipeline stage runs, under the full model's parameter names:
    the embeddings (first stage), some blocks, the final norm and lm_head (last stage).
    Takes token ids (first stage) or hidden states; returns hidden states or logits."""

    def __init__(self, model: GPT, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.activation_checkpointing = model.activation_checkpointing
        parts: dict[str, nn.Module] = {}
        if first:
            parts.update(wte=model.transformer.wte, wpe=model.transformer.wpe,
                         drop=model.transformer.drop)
        parts["h"] = nn.ModuleDict({str(i): model.transformer.h[i] for i in layers})
        if last:
            parts["ln_f"] = model.transformer.ln_f
        self.transformer = nn.ModuleDict(parts)
        if last:
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(0, x.size(1), dtype=torch.long, device=x.device)
            x = self.transformer.drop(self.transformer.wte(x) + self.transformer.wpe(pos))
        use_ckpt = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.transformer.h.values():
            x = checkpoint(block, x, use_reentrant=False) if use_ckpt else block(x)
        if self.last:
            x = self.lm_head(self.transformer.ln_f(x))
        return x


class RankParts(nn.Module):
    """All the stages one rank holds, as one module under the full model's names: what the
    optimizer steps and the checkpoint saves (the stages share its submodules)."""

    def __init__(self, stages: list[StageModule]) -> None:
        super().__init__()
        parts: dict[str, nn.Module] = {}
        blocks: dict[str, nn.Module] = {}
        for stage in stages:
            for name, module in stage.transformer.items():
                if name == "h":
                    blocks.update(module.items())
                else:
                    parts[name] = module
        self.transformer = nn.ModuleDict({**parts, "h": nn.ModuleDict(blocks)})
        head = [s.lm_head for s in stages if s.last]
        if head:
            self.lm_head = head[0]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of one microbatch (the schedule averages the microbatches)."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


def split_stages(model: GPT, pp: int, pp_rank: int, schedule: str) -> list[StageModule]:
    """This pipeline rank's stages of `model` (stage s on rank s % pp), in stage order."""
    v = virtual_stages(schedule)
    n = pp * v
    layers = stage_layers(model.config.n_layer, n)
    return [StageModule(model, layers[s], first=s == 0, last=s == n - 1)
            for s in range(pp_rank, n, pp)]


def stage_indices(pp: int, pp_rank: int, schedule: str) -> list[int]:
    """The stage numbers on this pipeline rank, as `split_stages` orders them."""
    return list(range(pp_rank, pp * virtual_stages(schedule), pp))


@dataclass
class TiedEmbedding:
    """Sums the tied embedding's gradient over the first and the last stage (Megatron's
    embedding group); `group` is None where this rank holds neither."""

    group: Any
    weights: list[nn.Parameter] = field(default_factory=list)

    def all_reduce_grads(self) -> None:
        """After the backward of a step, before the optimizer step (a collective of the
        group's two ranks)."""
        for w in self.weights:
            if w.grad is not None:
                dist.all_reduce(local(w.grad), group=self.group)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def tied_embedding(stages: list[StageModule], pp_groups: list[list[int]]) -> TiedEmbedding:
    """Make the groups of first and last stage ranks (a collective of every rank: each
    pipeline's group is made everywhere, in the same order) and this rank's part."""
    rank = dist.get_rank()
    mine: Any = None
    for ranks in pp_groups:
        pair = [ranks[0], ranks[-1]]
        group = dist.new_group(pair, group_desc="tied_embedding")
        if rank in pair:
            mine = group
    weights = [s.transformer.wte.weight for s in stages if s.first]
    weights += [s.lm_head.weight for s in stages if s.last]
    return TiedEmbedding(mine, weights)


@dataclass
class Pipeline:
    """The pipeline of this rank: its schedule, whether it feeds inputs (it holds the first
    stage) and reads the loss (the last), the tied-embedding sync, the group to share the
    loss over."""

    schedule: Any
    has_first: bool
    has_last: bool
    tied: TiedEmbedding
    group: Any
    last_rank: int  # global rank holding the last stage (of this pipeline)
    name: str
    stages: int
    microbatches: int
    virtual: int

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of the whole batch as microbatches; returns the mean loss
        (detached) on the rank holding the last stage, None elsewhere."""
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        kwargs: dict[str, Any] = {}
        if self.has_last:
            kwargs.update(target=y, losses=losses)
        args = (x,) if self.has_first else ()
        self.schedule.step(*args, **kwargs)
        self.tied.all_reduce_grads()
        if losses is None:
            return None
        return torch.stack([loss.detach().float() for loss in losses]).mean()

    def share_loss(self, loss: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """The last stage's loss on every rank of the pipeline (a collective of the pp
        group: called on logged steps only)."""
        t = loss.clone() if loss is not None else torch.zeros((), device=device)
        dist.broadcast(t, src=self.last_rank, group=self.group)
        return t


def build_pipeline(stages: list[nn.Module], stage_ids: list[int], pp: int, schedule: str,
                   microbatches: int, group: Any, device: torch.device, tied: TiedEmbedding,
                   ) -> Pipeline:
    """PipelineStages of this rank's (wrapped) stage modules and the schedule over them."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    v = virtual_stages(schedule)
    n = pp * v
    pipe_stages = [PipelineStage(m, s, n, device, group=group)
                   for m, s in zip(stages, stage_ids, strict=True)]
    if schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(pipe_stages, microbatches, loss_fn=loss_fn)
    else:
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = cls(pipe_stages[0], microbatches, loss_fn=loss_fn)
    ranks = dist.get_process_group_ranks(group)
    return Pipeline(sched, has_first=0 in stage_ids, has_last=n - 1 in stage_ids, tied=tied,
                    group=group, last_rank=ranks[-1], name=schedule, stages=pp,
                    microbatches=microbatches, virtual=v)
