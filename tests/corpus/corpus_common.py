"""What the corpus scripts share: a tiny model, deterministic batches, and the line each rank
prints at the end saying what it logged (`CORPUS {json}`), which tests/test_corpus.py compares
with `scalemon snapshot --json` of the job."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQ, BATCH = 32, 16, 8, 4
PREFIX = "CORPUS "


class TinyLM(nn.Module):
    """An embedding, `blocks` residual MLP blocks and a head: a 1-layer language model."""

    def __init__(self, blocks: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank, as a broadcast would give
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM), nn.GELU()) for _ in range(blocks))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        x = self.embed(idx)
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def batch(step: int, micro: int = 0, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, different per rank, step and micro-step."""
    g = torch.Generator().manual_seed(10_000 * rank() + 100 * step + micro)
    data = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


class Logged:
    """What a rank passed to `scalemon.agent.log()`: the count, the last step and loss."""

    def __init__(self) -> None:
        self.steps = 0
        self.step: int | None = None
        self.loss: float | None = None
        self.extra: dict[str, Any] = {}

    def note(self, step: Any, loss: Any, **extra: Any) -> None:
        """Record one `log()` call's step and loss (read here, after the call)."""
        self.steps += 1
        self.step = int(step)
        self.loss = None if loss is None else float(loss.detach().reshape(()) if
                                                    isinstance(loss, torch.Tensor) else loss)
        self.extra.update(extra)

    def report(self, state: str, ops: tuple[str, ...] = (), rank_: int | None = None,
               **facts: Any) -> None:
        """Print this rank's line for the test: what it logged, the state its rank should end
        in, the collective ops it issued (by the Flight Recorder's names) and other facts
        (the scaler's state and scale, tokens, the error). `rank_`: where RANK is not set."""
        print(PREFIX + json.dumps({"rank": rank() if rank_ is None else rank_,
                                   "steps": self.steps, "step": self.step,
                                   "loss": self.loss, "extra": self.extra, "state": state,
                                   "ops": list(ops), **facts}), flush=True)
