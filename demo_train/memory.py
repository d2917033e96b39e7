"""Training memory per rank, estimated with the seed formula (EleutherAI "Transformer Math 101").

    bytes/param   fp32 training          mixed precision (bf16/fp16) + AdamW
    params        4                      2
    gradients     4                      2
    optimizer     8 (Adam m, v)          4 fp32 master + 8 Adam m, v + 4 copy (as the seed counts)

    activations   s*b*h*L*(10 + 24/t + 5*a*s/(h*t)) bytes, stored in fp16 (t = tensor parallel)

ZeRO-1 divides the optimizer state by the data-parallel degree, ZeRO-2 also the gradients,
ZeRO-3 also the parameters. What this configuration changes in the activation term:

* fp32 training stores activations in 4 bytes, so the fp16 formula is doubled;
* `fused_attention`: `scaled_dot_product_attention`'s flash / memory-efficient kernels never
  store the a*s*s attention scores, softmax and dropout mask, so the `5*a*s/(h*t)` term goes;
* activation checkpointing per block keeps only each block's fp16 input (2*s*b*h bytes per
  layer, the "full recomputation" case) plus one block's activations while it is recomputed.

It is an estimate: allocator fragmentation, the logits, temporary buffers and the CUDA context
are not counted (the seed suggests up to 20% on top).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .model import GPTConfig

MIB = 1 << 20


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by what they hold; `notes` says which assumptions applied."""

    params: int
    gradients: int
    optimizer: int
    activations: int
    notes: str

    @property
    def total(self) -> int:
        return self.params + self.gradients + self.optimizer + self.activations

    def as_dict(self) -> dict[str, int | str]:
        """JSON-ready, with the total (what the monitor is sent)."""
        return {**asdict(self), "total": self.total}

    def describe(self) -> str:
        """One line for the log."""
        parts = (
            f"params {self.params / MIB:.2f}",
            f"gradients {self.gradients / MIB:.2f}",
            f"optimizer {self.optimizer / MIB:.2f}",
            f"activations {self.activations / MIB:.2f}",
        )
        return (f"memory estimate per rank: {' + '.join(parts)} = {self.total / MIB:.2f} MiB "
                f"({self.total} bytes; {self.notes})")


def bytes_per_param(mixed_precision: bool) -> tuple[int, int, int]:
    """(params, gradients, optimizer state) bytes per parameter for AdamW, per the seed."""
    if mixed_precision:
        return 2, 2, 4 + 8 + 4
    return 4, 4, 8


def activation_bytes(
    config: GPTConfig,
    micro_batch: int,
    *,
    mixed_precision: bool,
    activation_checkpointing: bool,
    fused_attention: bool,
    tensor_parallel: int = 1,
) -> int:
    """Stored activations of one micro-batch: `s*b*h*L*(10 + 24/t + 5*a*s/(h*t))` and the
    adjustments in the module docstring."""
    s, b, h = config.block_size, micro_batch, config.n_embd
    L, a, t = config.n_layer, config.n_head, tensor_parallel
    per_layer_per_sbh = 10 + 24 / t + (0 if fused_attention else 5 * a * s / (h * t))
    one_layer = s * b * h * per_layer_per_sbh
    # checkpointing keeps each block's fp16 input, plus one block while it is recomputed
    total = 2 * s * b * h * L + one_layer if activation_checkpointing else one_layer * L
    scale = 1 if mixed_precision else 2  # the formula counts fp16 bytes
    return round(total * scale)


def estimate_memory(
    config: GPTConfig,
    n_params: int,
    micro_batch: int,
    *,
    amp: str = "off",
    zero: int = 0,
    world_size: int = 1,
    activation_checkpointing: bool = False,
    fused_attention: bool = True,
    tensor_parallel: int = 1,
    pipeline: tuple[int, str, int] = (1, "1f1b", 1),
) -> MemoryEstimate:
    """The seed formula for one rank of this configuration (see the module docstring).

    `n_params`: the parameters this rank holds (its tp shards and pipeline stages);
    `world_size`: the data-parallel ranks ZeRO shards over. `pipeline` (stages, schedule,
    microbatches): a rank stores the activations of its layers (n_layer / stages) for the
    microbatches in flight: all of them with GPipe, up to `stages` with 1F1B."""
    mixed = amp != "off"
    p_b, g_b, o_b = bytes_per_param(mixed)
    n = max(1, world_size)
    params = n_params * p_b / (n if zero >= 3 else 1)
    grads = n_params * g_b / (n if zero >= 2 else 1)
    optim = n_params * o_b / (n if zero >= 1 else 1)
    stages, schedule, microbatches = pipeline
    if stages > 1:
        in_flight = microbatches if schedule == "gpipe" else min(stages, microbatches)
        micro_batch = micro_batch // microbatches * in_flight
        config = replace(config, n_layer=max(1, config.n_layer // stages))
    acts = activation_bytes(config, micro_batch, mixed_precision=mixed,
                            activation_checkpointing=activation_checkpointing,
                            fused_attention=fused_attention, tensor_parallel=tensor_parallel)
    notes = (f"{'mixed precision ' + amp if mixed else 'fp32'}, ZeRO-{zero} over {n} rank(s), "
             f"{'activation checkpointing' if activation_checkpointing else 'all activations'}, "
             f"attention scores {'not stored (fused SDPA)' if fused_attention else 'stored'}"
             + (f", tensor parallel {tensor_parallel}" if tensor_parallel > 1 else "")
             + (f", pipeline {stages} stages {schedule}" if stages > 1 else ""))
    return MemoryEstimate(round(params), round(grads), round(optim), acts, notes)
