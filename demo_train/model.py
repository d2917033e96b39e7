"""A small GPT for the demo trainer, in the manner of nanoGPT's model.py.

Reads top to bottom: config and presets, the pieces of a block, the model, then the
FLOP/s figures used to turn tokens/s into MFU. Byte-level by default (vocab 256), so it
needs no tokenizer and no downloads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .moe import MoE, moe_layers

# -----------------------------------------------------------------------------
# config


@dataclass
class GPTConfig:
    """Shape of the model. `vocab_size=256` means raw bytes are the tokens."""

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, like GPT-2
    # mixture of experts (moe.py): 0 is the dense MLP; else each block's MLP is `experts`
    # experts, each token routed to `moe_top_k` of them
    experts: int = 0
    moe_top_k: int = 2
    capacity_factor: float = 1.25  # expert capacity = ceil(factor * tokens * k / experts)
    moe_aux_coef: float = 0.01  # weight of the load-balancing loss added to the loss

    @classmethod
    def preset(cls, name: str, **overrides: object) -> GPTConfig:
        """A named preset from `PRESETS`, with any field overridden (e.g. vocab_size)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)


PRESETS: dict[str, GPTConfig] = {
    # trains in seconds on 2 CPU cores
    "tiny": GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64),
    # a bit bigger, for CPU benches
    "small": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),
    # GPT-2 124M shapes, but byte-level: vocab stays 256 (GPT-2's BPE vocab is 50257, padded
    # to 50304 in nanoGPT), so this is ~85M parameters; pass vocab_size= to change it.
    "gpt2-124m": GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768),
}

# -----------------------------------------------------------------------------
# the pieces of a transformer block


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through scaled_dot_product_attention.

    q, k and v are separate projections (not one `c_attn` of 3 x n_embd outputs) so that
    tensor parallelism (tensor_parallel.py) can shard each by output columns into whole heads:
    a rank then holds n_head / tp heads, and `forward` reads the local head count from the
    projected width."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be divisible by n_head"
        self.c_q = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_k = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_v = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.head_size = config.n_embd // config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        # (B, T, heads * hs) -> (B, heads, T, hs); heads is n_head / tp under tensor parallel
        q, k, v = (proj(x).view(B, T, -1, self.head_size).transpose(1, 2)
                   for proj in (self.c_q, self.c_k, self.c_v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # re-assemble this rank's heads
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: 4x expansion with GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config) if not config.experts else MoE(
            config.n_embd, config.experts, config.moe_top_k, config.capacity_factor,
            bias=config.bias, dropout=config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


# -----------------------------------------------------------------------------
# the model


class GPT(nn.Module):
    """Decoder-only transformer with tied input/output embeddings."""

    def __init__(self, config: GPTConfig, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.config = config
        # recompute each block's activations in backward instead of storing them
        self.activation_checkpointing = activation_checkpointing
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying

        self.apply(self._init_weights)
        # scaled init of the residual projections, per GPT-2
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count. As in nanoGPT, non_embedding drops only the position embeddings:
        the token embeddings are also the lm_head weights, so they stay counted."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) int64 -> (logits (B, T, vocab), mean cross-entropy or None)."""
        _, t = idx.size()
        assert t <= self.config.block_size, (
            f"sequence of length {t} exceeds block_size {self.config.block_size}"
        )
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        use_ckpt = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.transformer.h:
            x = checkpoint(block, x, use_reentrant=False) if use_ckpt else block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
            )
            aux = [m.aux_loss for m in moe_layers(self) if m.aux_loss is not None]
            if aux:  # the MoE load-balancing losses of this forward, summed over layers
                loss = loss + self.config.moe_aux_coef * torch.stack(aux).sum()
        return logits, loss

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward), PaLM appendix B / nanoGPT
        estimate_mfu: 6N for the weights plus 12*L*H*Q*T for attention."""
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        return 6 * self.active_params() + 12 * L * H * Q * T

    def active_params(self) -> int:
        """`num_params()` counting of each MoE layer's experts only the `moe_top_k` a token
        runs through (whichever are held here: under expert parallelism a rank holds some)."""
        n = self.num_params()
        for layer in moe_layers(self):
            per_expert = sum(p.numel() for p in next(iter(layer.experts.values())).parameters())
            n -= (len(layer.experts) - layer.top_k) * per_expert
        return n


# -----------------------------------------------------------------------------
# peak FLOP/s, for MFU

# dense bf16 tensor-core peak, keyed by a substring of torch.cuda.get_device_name()
PEAK_FLOPS: dict[str, float] = {
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM
    "H200": 989e12,  # same tensor cores as H100 SXM, more and faster memory
    "A100": 312e12,
}


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s for a device name, or None when it is not known.
    The longest matching key wins, so "H100 PCIe" beats "H100"."""
    matches = [k for k in PEAK_FLOPS if k.lower() in device_name.lower()]
    if not matches:
        return None
    return PEAK_FLOPS[max(matches, key=len)]
