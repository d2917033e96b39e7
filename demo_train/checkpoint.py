"""Checkpoints: sharded model/optimizer state through torch.distributed.checkpoint, atomically.

One checkpoint is a directory `step_000012/` under --ckpt-dir:

    .metadata, __<rank>_0.distcp   DCP: {"model": ..., "optim": ...} (DTensor shards for FSDP2)
    optimizer_zero1.pt             ZeRO-1 only: the optimizer state consolidated on rank 0
    rank<r>.pt                     per rank: step, data position, RNG states, loss scaler
    meta.json                      written last: step, world size, run config, size and
                                   sha256 of every other file

Every rank writes into `step_000012.tmp/`; after a barrier rank 0 writes meta.json and renames
the directory, so a directory without `.tmp` is complete, and a crash mid-save leaves only a
`.tmp` that is ignored (and removed by the next save). Resuming takes the newest complete
checkpoint whose files match their checksums and that loads on every rank; one that does not
is renamed `*.corrupt` with a message saying why, and the one before it is used.

--ckpt-dir must be one directory for all ranks (one node, or a shared filesystem): rank 0
checksums and renames what every rank wrote. Resuming needs the same number of ranks (the
per-rank files), and ZeRO-1's consolidated optimizer state only resumes a ZeRO-1 run; the DCP
state of --zero 0, 2 and 3 is interchangeable between them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .parallel import any_rank

FORMAT = 1
META = "meta.json"
ZERO1_OPTIM = "optimizer_zero1.pt"
_COMPLETE = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    """No checkpoint could be used."""


class IncompatibleCheckpoint(ValueError):
    """A readable checkpoint that this run cannot resume from (other world size, layout)."""


@dataclass
class TrainState:
    """What a checkpoint holds. `model` is the unwrapped model (an FSDP module for ZeRO-2/3)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    data: Any  # ByteBatches: state_dict() / load_state_dict()
    scaler: Any = None  # torch.amp.GradScaler or None
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def zero1(self) -> bool:
        return type(self.optimizer).__name__ == "ZeroRedundancyOptimizer"

    @property
    def optimizer_layout(self) -> str:
        return "zero1-consolidated" if self.zero1 else "dcp"


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _broadcast(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """`obj` from rank 0 on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


class Checkpointer:
    """Saves and finds checkpoints under `root`; every method is collective."""

    def __init__(
        self,
        root: str | Path,
        keep: int = 3,
        group: dist.ProcessGroup | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.root = Path(root)
        self.keep = keep
        self.group = group  # a CPU (gloo) group for the small agreements
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.log = log if self.rank == 0 else (lambda _msg: None)
        self.last_saved: int | None = None

    # --- saving --------------------------------------------------------------------------
    def save(self, step: int, state: TrainState, reason: str = "periodic") -> Path:
        """Write checkpoint `step` (collective); returns its directory."""
        final = self.root / f"step_{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        t0 = time.perf_counter()
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier(self.group)
        sharded: dict[str, Any] = {"model": get_model_state_dict(state.model)}
        if not state.zero1:
            sharded["optim"] = get_optimizer_state_dict(state.model, state.optimizer)
        with _single_process_ok():
            dcp.save(sharded, checkpoint_id=tmp, no_dist=not dist.is_initialized())
        if state.zero1:
            state.optimizer.consolidate_state_dict(to=0)
            if self.rank == 0:
                _torch_save(state.optimizer.state_dict(), tmp / ZERO1_OPTIM)
        _torch_save(self._rank_state(step, state), tmp / f"rank{self.rank}.pt")
        _barrier(self.group)
        if self.rank == 0:
            self._publish(tmp, final, step, state, reason)
        _barrier(self.group)  # nobody goes on (and maybe crashes) before it is complete
        self.last_saved = step
        self.log(f"checkpoint: saved {final} ({reason}, {time.perf_counter() - t0:.2f} s)")
        return final

    def _rank_state(self, step: int, state: TrainState) -> dict[str, Any]:
        return {
            "step": step,
            "data": state.data.state_dict(),
            "rng": rng_state(),
            "scaler": state.scaler.state_dict() if state.scaler is not None else None,
        }

    def _publish(self, tmp: Path, final: Path, step: int, state: TrainState, reason: str) -> None:
        """Rank 0: checksums and meta.json, then the rename that makes it complete."""
        files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
                 for f in sorted(tmp.iterdir()) if f.is_file()}
        meta = {
            "format": FORMAT,
            "step": step,
            "world_size": self.world_size,
            "optimizer_layout": state.optimizer_layout,
            "reason": reason,
            "saved_at": time.time(),
            "config": state.config,
            "files": files,
        }
        _fsync_write(tmp / META, json.dumps(meta, indent=1, default=str).encode())
        _fsync_dir(tmp)
        old = final.with_name(final.name + ".old")
        if final.exists():  # the same step saved again: replace it
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        shutil.rmtree(old, ignore_errors=True)
        self._prune()

    def _prune(self) -> None:
        """Keep the newest `keep` checkpoints (all when keep <= 0) and no stale `.tmp`."""
        for p in self.root.glob("step_*.tmp"):
            shutil.rmtree(p, ignore_errors=True)
        if self.keep > 0:
            for _, p in list_checkpoints(self.root)[self.keep:]:
                shutil.rmtree(p, ignore_errors=True)

    # --- resuming ------------------------------------------------------------------------
    def load_latest(self, state: TrainState) -> int | None:
        """Load the newest usable checkpoint into `state` (collective); returns its step, or
        None when there is none. Raises IncompatibleCheckpoint or CheckpointError."""
        while True:
            decision = _broadcast(self._choose(state) if self.rank == 0 else None, self.group)
            kind, arg = decision
            if kind == "none":
                return None
            if kind == "incompatible":
                raise IncompatibleCheckpoint(arg)
            if kind == "unusable":
                raise CheckpointError(arg)
            path = Path(arg)
            error: str | None = None
            try:
                step = self._load(path, state)
            except Exception as exc:  # any failure means: use an older one
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                step = -1
            if not any_rank(error is not None, self.group):
                self.log(f"checkpoint: resumed from {path} (step {step})")
                return step
            if error is not None:
                print(f"rank {self.rank}: checkpoint {path} failed to load: {error}", flush=True)
            if self.rank == 0:
                self._set_aside(path, "it failed to load on some rank")
            _barrier(self.group)

    def _choose(self, state: TrainState) -> tuple[str, str | None]:
        """Rank 0: the newest checkpoint that verifies, setting corrupt ones aside."""
        candidates = list_checkpoints(self.root)
        if not candidates:
            self.log(f"checkpoint: none in {self.root}, starting from step 0")
            return "none", None
        for _, path in candidates:
            meta, problem = verify(path)
            if meta is None:
                self._set_aside(path, problem)
                continue
            mismatch = self._incompatible(meta, state)
            if mismatch:
                return "incompatible", f"cannot resume from {path}: {mismatch}"
            return "load", str(path)
        return "unusable", (f"no usable checkpoint in {self.root}: every one was corrupt (set "
                            "aside as *.corrupt); move them away to start from step 0")

    def _incompatible(self, meta: dict[str, Any], state: TrainState) -> str | None:
        if meta.get("format") != FORMAT:
            return f"format {meta.get('format')}, this trainer reads format {FORMAT}"
        if meta["world_size"] != self.world_size:
            return (f"it was written by {meta['world_size']} rank(s) and this run has "
                    f"{self.world_size}; resume with the same number of ranks")
        if meta["optimizer_layout"] != state.optimizer_layout:
            return (f"its optimizer state is {meta['optimizer_layout']!r} and this run needs "
                    f"{state.optimizer_layout!r}: resume with the same --zero stage family "
                    "(ZeRO-1 vs the others)")
        return None

    def _set_aside(self, path: Path, problem: str | None) -> None:
        """Rank 0: rename a bad checkpoint to `*.corrupt` and say why."""
        target = path.with_name(path.name + ".corrupt")
        shutil.rmtree(target, ignore_errors=True)
        os.rename(path, target)
        self.log(f"checkpoint: {path} is corrupt ({problem}); moved to {target.name}, "
                 "using the previous checkpoint")

    def _load(self, path: Path, state: TrainState) -> int:
        """Read checkpoint `path` into `state`; returns its step."""
        sharded: dict[str, Any] = {"model": get_model_state_dict(state.model)}
        if not state.zero1:  # a template: DCP loads in place into these tensors
            sharded["optim"] = get_optimizer_state_dict(state.model, state.optimizer)
        with _single_process_ok():
            dcp.load(sharded, checkpoint_id=path, no_dist=not dist.is_initialized())
        set_model_state_dict(state.model, sharded["model"])
        if state.zero1:
            full = torch.load(path / ZERO1_OPTIM, weights_only=True)
            state.optimizer.load_state_dict(full)
            inner = state.optimizer.optim  # it wrote the local state by hand
            if hasattr(inner, "invalidate_tables"):
                inner.invalidate_tables()
        else:
            set_optimizer_state_dict(state.model, state.optimizer, sharded["optim"])
        mine = torch.load(path / f"rank{self.rank}.pt", weights_only=True)
        state.data.load_state_dict(mine["data"])
        if state.scaler is not None and mine["scaler"] is not None:
            state.scaler.load_state_dict(mine["scaler"])
        set_rng_state(mine["rng"])
        return int(mine["step"])


class TermSignal:
    """Remembers a SIGTERM (torchrun sends it before stopping or restarting workers) so that
    the training loop can save a checkpoint at the next step boundary and exit."""

    EXIT_CODE = 128 + signal.SIGTERM

    def __init__(self) -> None:
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.received = True

    def restore(self) -> None:
        """Put the previous handler back."""
        signal.signal(signal.SIGTERM, self._previous)
