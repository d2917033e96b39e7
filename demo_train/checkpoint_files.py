"""A checkpoint on disk, as every part of the trainer reads it: the names in a checkpoint's
directory and in --ckpt-dir (complete, set aside as corrupt), the check of its files against
meta.json, what it holds (`TrainState`, each rank's RNG states), and torch.distributed.checkpoint
(DCP), imported on first use. checkpoint.py says the format and saves; checkpoint_resume.py
chooses and loads the checkpoint to resume from."""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

FORMAT = 1
META = "meta.json"
ZERO1_OPTIM = "optimizer_zero1.pt"
_COMPLETE = re.compile(r"^step_(\d{6,})$")
_SET_ASIDE = re.compile(r"^step_(\d{6,})\.corrupt$")


def load_dcp() -> Any:
    """`torch.distributed.checkpoint` with its `state_dict` and `api` modules, imported on first
    use: the import costs about 0.6 s of CPU at every rank's start, which a run that never
    saves or resumes should not pay."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.api
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    return dcp


def dcp_exception() -> type[BaseException]:
    """DCP's `CheckpointException` (a BaseException: `except Exception` misses it)."""
    return load_dcp().api.CheckpointException


@dataclass
class TrainState:
    """What a checkpoint holds. `model` is the unwrapped model (an FSDP module for ZeRO-2/3)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    data: Any  # ByteBatches: state_dict() / load_state_dict()
    scaler: Any = None  # torch.amp.GradScaler or None
    config: dict[str, Any] = field(default_factory=dict)
    pipeline: bool = False  # `model` is this rank's pipeline stages: other ranks, other names

    @property
    def zero1(self) -> bool:
        return type(self.optimizer).__name__ == "ZeroRedundancyOptimizer"

    @property
    def optimizer_layout(self) -> str:
        if self.zero1:
            return "zero1-consolidated"
        return "dcp-flat" if self.pipeline else "dcp"

    def optimizer_options(self) -> Any:
        """DCP's options for the optimizer state. A pipeline's ranks hold different parameters,
        so their param_groups differ, and DCP would save one rank's for all: flattened, each
        parameter's hyperparameters are a key of their own (as torchtitan saves them)."""
        if not self.pipeline:
            return None
        return load_dcp().state_dict.StateDictOptions(flatten_optimizer_state_dict=True)


def barrier(group: dist.ProcessGroup | None) -> None:
    """All ranks of `group` meet here (nothing to wait for without a process group)."""
    if dist.is_initialized():
        dist.barrier(group=group)


@contextlib.contextmanager
def single_process_ok() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    """This rank's random number generator states."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state()` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete-looking checkpoint directories (no `.tmp`, `.corrupt`), newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and (m := _COMPLETE.match(p.name))]
    return sorted(found, reverse=True)


def set_aside_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Checkpoint directories set aside as `*.corrupt`, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and (m := _SET_ASIDE.match(p.name))]
    return sorted(found, reverse=True)


def verify(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(meta, None) when every file matches meta.json, else (None, what is wrong)."""
    try:
        meta = json.loads((path / META).read_text())
        files = meta["files"]
    except FileNotFoundError:
        return None, f"{META} is missing"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"{META} is unreadable ({type(exc).__name__}: {exc})"
    for name, want in sorted(files.items()):
        f = path / name
        if not f.is_file():
            return None, f"{name} is missing"
        if f.stat().st_size != want["bytes"]:
            return None, f"{name} has {f.stat().st_size} bytes, {want['bytes']} were written"
        if sha256_file(f) != want["sha256"]:
            return None, f"{name} does not match its sha256"
    return meta, None
