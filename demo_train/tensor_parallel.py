"""Megatron-style tensor parallelism of the demo GPT (`--tp N`, `--sequence-parallel`), with
`torch.distributed.tensor.parallel.parallelize_module` on the mesh's "tp" dimension.

In each block, attention's q, k and v projections are split by output columns (each rank holds
n_head / tp whole heads and attends over them alone) and its output projection by input rows,
whose partial sums one all-reduce adds up; the MLP's c_fc likewise by columns, its c_proj by
rows. So a block costs two all-reduces forward and two backward. The embeddings, the final norm
and the tied lm_head stay replicated (plain tensors, the same on every tp rank).

--sequence-parallel also splits the work between those all-reduces: the residual stream between
the blocks is cut along the sequence (each tp rank holds T / tp positions), the LayerNorms and
dropouts run on that slice (SequenceParallel), each all-reduce becomes an all-gather before a
column-parallel input and a reduce-scatter after a row-parallel output. The first block takes
the replicated embeddings' slice; the final norm's output is gathered again for the lm_head.
This follows torchtitan's parallelize of Llama.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn


def block_plan(sequence_parallel: bool) -> dict[str, Any]:
    """The ParallelStyle of each submodule of one Block."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {
        "attn.c_q": ColwiseParallel(),
        "attn.c_k": ColwiseParallel(),
        "attn.c_v": ColwiseParallel(),
        "mlp.c_fc": ColwiseParallel(),
    }
    if not sequence_parallel:
        plan["attn.c_proj"] = RowwiseParallel()
        plan["mlp.c_proj"] = RowwiseParallel()
        return plan
    # the residual stream is (B, T / tp, C) on each rank: Shard(1) of the sequence
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                use_local_output=True)
    plan.update({
        "ln_1": SequenceParallel(),
        "attn": gather,
        "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_2": SequenceParallel(),
        "mlp": gather,
        "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
    })
    return plan


def check_divisible(n_head: int, n_embd: int, tp: int) -> str | None:
    """Why a model of `n_head` heads and width `n_embd` cannot be split over `tp` ranks, or
    None."""
    if n_head % tp:
        return f"--tp {tp} must divide the model's {n_head} attention heads"
    if (4 * n_embd) % tp:
        return f"--tp {tp} must divide the MLP's width {4 * n_embd}"
    return None


def parallelize(model: nn.Module, tp_mesh: Any, sequence_parallel: bool,
                first_block: str | None, has_head: bool) -> None:
    """Apply tensor (and sequence) parallelism in place to `model`: the GPT, or a pipeline
    stage of it (pipeline.StageModule: the same names, only its own blocks).

    `first_block`: the name under `transformer.h` of the model's first block when the model
    also holds the embeddings (the sequence slice is cut at its input); `has_head`: the model
    holds ln_f and lm_head (the slice is gathered after ln_f)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        SequenceParallel,
        parallelize_module,
    )

    plan = block_plan(sequence_parallel)
    for block in model.transformer.h.values() if isinstance(model.transformer.h, nn.ModuleDict) \
            else model.transformer.h:
        parallelize_module(block, tp_mesh, plan)
    if not sequence_parallel:
        return
    top: dict[str, Any] = {}
    if first_block is not None:  # the embeddings are replicated: take this rank's slice
        top[f"transformer.h.{first_block}"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
            use_local_output=True)
    if has_head:  # the tied lm_head is replicated: gather the normed sequence
        top["transformer.ln_f"] = SequenceParallel(use_local_output=False)
        top["lm_head"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
            use_local_output=True)
    parallelize_module(model, tp_mesh, top)
