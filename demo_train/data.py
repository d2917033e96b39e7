"""Byte-level text data for the demo trainer.

Tokens are raw bytes (0..255). The default corpus is the Python standard library's own
source, which is on every machine without a download. Batches are a pure function of
(seed, batch index, rank), so ranks see different data and a run resumed from
`ByteBatches.state_dict()` sees exactly the batches it would have seen.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

DEFAULT_CORPUS_BYTES = 4_000_000
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def default_corpus_files(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[Path]:
    """Sorted .py files of the stdlib (no site-packages, no test dirs), up to max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    files: list[Path] = []
    total = 0
    for path in found:
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        files.append(path)
        total += size
    return files


def load_corpus(path: str | None = None, block_size: int = 1) -> torch.Tensor:
    """The bytes of a text file (or the default stdlib corpus) as a uint8 tensor.

    Raises FileNotFoundError for a missing file and ValueError when there are fewer than
    block_size + 1 bytes (one training example needs block_size inputs plus one target).
    """
    if path is None:
        files = default_corpus_files()
        raw = b"\n".join(f.read_bytes() for f in files)
        source = f"the default corpus ({len(files)} stdlib .py files)"
    else:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(
                f"corpus file {path!r} not found; pass an existing text file, "
                "or no path to use the Python standard library sources"
            )
        raw = p.read_bytes()
        source = f"corpus file {path!r}"
    if len(raw) < block_size + 1:
        raise ValueError(
            f"{source} has {len(raw)} bytes, fewer than block_size + 1 = {block_size + 1}; "
            "use a longer text file or a smaller block_size"
        )
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def train_val_split(
    data: torch.Tensor, val_fraction: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a corpus into (train, val): the last val_fraction of the bytes is validation."""
    n = int(len(data) * (1.0 - val_fraction))
    return data[:n], data[n:]


def _batch_seed(seed: int, step: int, rank: int) -> int:
    """A stable 63-bit seed for one batch (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class ByteBatches:
    """Random (x, y) windows of a byte corpus, deterministic per (seed, batch index, rank).

    x and y are int64 of shape (batch_size, block_size); y is x shifted by one byte.
    """

    def __init__(
        self,
        data: torch.Tensor,
        block_size: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise ValueError("data must be a 1-D uint8 tensor (see load_corpus)")
        if len(data) < block_size + 1:
            raise ValueError(
                f"data has {len(data)} bytes, fewer than block_size + 1 = {block_size + 1}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.data = data
        self.block_size = block_size
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.batches_served = 0
        self._window = torch.arange(block_size + 1)

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number `step` for this rank, without moving the position."""
        g = torch.Generator().manual_seed(_batch_seed(self.seed, step, self.rank))
        starts = torch.randint(len(self.data) - self.block_size, (self.batch_size,), generator=g)
        chunk = self.data[starts[:, None] + self._window].long()
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch; advances the position saved by state_dict()."""
        batch = self.batch_at(self.batches_served)
        self.batches_served += 1
        return batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """The position to save in a checkpoint."""
        return {
            "batches_served": self.batches_served,
            "seed": self.seed,
            "block_size": self.block_size,
            "batch_size": self.batch_size,
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from state_dict(). Rank is not checked, so every rank may load the state
        saved by rank 0 (ranks advance in lockstep); seed and shapes must match."""
        for key in ("seed", "block_size", "batch_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"checkpoint data {key}={state[key]} differs from this run's "
                    f"{getattr(self, key)}; resume with the same settings"
                )
        self.batches_served = int(state["batches_served"])
