"""The demo GPT over a DeviceMesh of pipeline (pp), data (dp) and tensor (tp) parallel ranks
(layout.py says which rank is where; pipeline.py and tensor_parallel.py do each technique).

`place()` cuts the model into this rank's pipeline stages, applies tensor (and sequence)
parallelism to them, then data parallelism on the mesh's "dp" dimension:

    --zero 0   gradients averaged over the dp group after the backward, one all_reduce per
               dtype over a flat buffer (`DataParallelGrads`). Not DDP: DDP takes only plain
               tensors, and turning the tp-sharded DTensor parameters into local ones for it
               would save every tp shard under the same name in the checkpoint
    --zero 2/3 FSDP2 `fully_shard` of every block and stage on the dp sub-mesh (over the tp
               DTensors: 2-D), driven by the pipeline schedule where there is one
    --zero 1   refused (ZeroRedundancyOptimizer needs DDP and plain tensors)

The optimizer steps every parameter this rank holds (`Placed.parts`); that module also is what
the checkpoint saves, under the full model's parameter names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .layout import Mesh
from .model import GPT
from .pipeline import (
    Pipeline,
    RankParts,
    build_pipeline,
    local,
    split_stages,
    stage_indices,
    tied_embedding,
)
from .tensor_parallel import parallelize


class DataParallelGrads:
    """Averages the gradients of `module` over the data-parallel `group` (collective)."""

    def __init__(self, module: nn.Module, group: Any) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.group = group

    def all_reduce(self) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.params:
            if p.grad is not None:
                g = local(p.grad)
                by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


@dataclass
class Placed:
    """The model as this rank holds it."""

    parts: nn.Module  # every parameter of this rank, under the full model's names
    module: nn.Module  # what a step calls without a pipeline (the GPT); `parts` with one
    pipeline: Pipeline | None
    dp_grads: DataParallelGrads | None  # --zero 0 with dp > 1
    zero: int  # the ZeRO stage in effect (0 where dp is 1: nothing to shard)
    n_params: int  # parameters of this rank's stages and tp shards, before any ZeRO sharding

    def sync_grads(self) -> None:
        """What data parallelism does after the backward (FSDP2 did it already)."""
        if self.dp_grads is not None:
            self.dp_grads.all_reduce()


def pp_rank_lists(mesh: Mesh) -> list[list[int]]:
    """The global ranks of every pipeline (one per dp x tp coordinate), in stage order."""
    m = mesh.device_mesh.mesh  # ranks in a tensor of the mesh's shape, pp first
    return m.reshape(mesh.layout.pp, -1).t().tolist()


def place(model: GPT, mesh: Mesh, args: Any, device: torch.device) -> Placed:
    """Cut, shard and wrap `model` for this rank's place in `mesh` (a collective)."""
    layout = mesh.layout
    coords = layout.coords(dist.get_rank())
    if layout.pp > 1:
        stages: list[nn.Module] = split_stages(model, layout.pp, coords["pp"], args.pp_schedule)
        ids = stage_indices(layout.pp, coords["pp"], args.pp_schedule)
        parts: nn.Module = RankParts(stages)
    else:
        stages, ids, parts = [model], [0], model
    if layout.tp > 1:
        tp_mesh = mesh.device_mesh["tp"]
        for stage in stages:
            first = getattr(stage, "first", True)
            names = list(stage.transformer.h.keys()) if layout.pp > 1 else ["0"]
            parallelize(stage, tp_mesh, args.sequence_parallel,
                        first_block=names[0] if first else None,
                        has_head=getattr(stage, "last", True))
    n_params = local_numel(parts)
    zero = args.zero if layout.dp > 1 else 0
    dp_grads = None
    if zero >= 2:
        shard_data_parallel(stages, mesh.device_mesh["dp"], reshard=zero >= 3)
    elif layout.dp > 1:
        dp_grads = DataParallelGrads(parts, mesh.group("dp"))
    pipeline = None
    if layout.pp > 1:
        m = args.microbatches * args.grad_accum
        tied = tied_embedding(stages, pp_rank_lists(mesh))
        pipeline = build_pipeline(stages, ids, layout.pp, args.pp_schedule, m,
                                  mesh.group("pp"), device, tied)
    return Placed(parts, stages[0] if pipeline is None else parts, pipeline, dp_grads, zero,
                  n_params)


def shard_data_parallel(stages: list[nn.Module], dp_mesh: Any, reshard: bool) -> None:
    """FSDP2 over the dp sub-mesh: each block, then each stage (its root)."""
    from torch.distributed.fsdp import fully_shard

    for stage in stages:
        h = stage.transformer.h
        for block in h.values() if isinstance(h, nn.ModuleDict) else h:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
        fully_shard(stage, mesh=dp_mesh, reshard_after_forward=False)


def local_numel(module: nn.Module) -> int:
    """Parameters this rank holds (its shards of DTensors)."""
    return sum(local(p).numel() for p in module.parameters())
