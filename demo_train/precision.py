"""Mixed precision: autocast for the forward pass and, for fp16, a loss scaler.

    --amp off    fp32 everywhere
    --amp bf16   autocast to bfloat16 (same exponent range as fp32: no loss scaling)
    --amp fp16   autocast to float16 with GradScaler: the loss is multiplied by the scale
                 before backward; a step whose gradients hold inf/NaN is skipped and the
                 scale halved (the monitor shows both through the loss scale)

Parameters, gradients and optimizer state stay fp32 (the fp32 "master" weights); autocast casts
the weights for each matmul.
"""

from __future__ import annotations

import contextlib

import torch

AMP_MODES = ("off", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(amp: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward-pass context for --amp."""
    if amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_DTYPES[amp])


def make_scaler(amp: str, device: torch.device, sharded: bool) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16 (None otherwise). With FSDP2 each rank holds only a shard of the
    gradients, so the sharded scaler all-reduces `found_inf` to skip the step on every rank."""
    if amp != "fp16":
        return None
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type)
    return torch.amp.GradScaler(device.type)
