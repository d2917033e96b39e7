"""Mixed precision: autocast for the forward pass and, for fp16, a loss scaler.

    --amp off    fp32 everywhere
    --amp bf16   autocast to bfloat16 (same exponent range as fp32: no loss scaling)
    --amp fp16   autocast to float16 with GradScaler: the loss is multiplied by the scale
                 before backward; a step whose gradients hold inf/NaN is skipped and the
                 scale halved (the monitor shows both through the loss scale)

Parameters, gradients and optimizer state stay fp32 (the fp32 "master" weights); autocast casts
the weights for each matmul.

    --tf32 on    (CUDA) fp32 matmuls and convolutions on TF32 tensor cores, as nanoGPT does:
                 about 8x the fp32 throughput of an H100 for a 10-bit mantissa in the products
    --tf32 off   IEEE fp32 matmuls
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


def set_tf32(enabled: bool, device: torch.device) -> str:
    """Let fp32 matmuls use TF32 on CUDA (--tf32); returns what is in effect: "on", "off", or
    "n/a" off CUDA (where nothing is changed)."""
    if device.type != "cuda":
        return "n/a"
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return "on" if enabled else "off"


def make_scaler(amp: str, device: torch.device, sharded: bool) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16 (None otherwise). With FSDP2 each rank holds only a shard of the
    gradients, so the sharded scaler all-reduces `found_inf` to skip the step on every rank."""
    if amp != "fp16":
        return None
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type)
    return torch.amp.GradScaler(device.type)
