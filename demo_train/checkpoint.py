"""Checkpoints: sharded model/optimizer state through torch.distributed.checkpoint, atomically.

One checkpoint is a directory `step_000012/` under --ckpt-dir:

    .metadata, __<rank>_0.distcp   DCP: {"model": ..., "optim": ...} (DTensor shards for FSDP2)
    optimizer_zero1.pt             ZeRO-1 only: the optimizer state consolidated on rank 0
    rank<r>.pt                     per rank: step, rank, world size, data position, RNG
                                   states, loss scaler
    meta.json                      written last: step, world size, run config, size and
                                   sha256 of every other file

Every rank writes into `step_000012.tmp/`; after a barrier rank 0 writes meta.json and renames
the directory, so a directory without `.tmp` is complete, and a crash mid-save leaves only a
`.tmp` that is ignored (and removed by the next save).

Resuming takes the newest complete checkpoint whose files match their checksums, whose files
agree with its meta.json on every rank and that loads on every rank. Before anything is read,
each rank checks its own rank file (step, rank, world size) and the model's shapes in DCP's
metadata against meta.json, and the ranks gather the results: a checkpoint that mixes files
of two steps (checksums resealed, or written over by hand) is refused by every rank together,
like one that fails to load, instead of ranks resuming at different steps and hanging at
their next collective. Each rank reads it into copies of its own; only when every rank read it
do all copy it into the live model, optimizer, loss scaler, data position and RNGs, so a checkpoint
that fails on one rank changes nothing anywhere. One that fails is renamed `*.corrupt` with a
message saying why, and the one before it is tried; when none is left, NoCheckpoint names the
ones set aside (by this run or an earlier one). A checkpoint of other settings (ranks,
optimizer layout, model shape, data order) is not corrupt: IncompatibleCheckpoint, nothing
renamed.

--ckpt-dir must be one directory for all ranks (one node, or a shared filesystem): rank 0
checksums and renames what every rank wrote. Resuming needs the same number of ranks (the
per-rank files), and ZeRO-1's consolidated optimizer state only resumes a ZeRO-1 run; the DCP
state of --zero 0, 2 and 3 is interchangeable between them.

Here: `Checkpointer` (saving, and the entry to resuming) and `TermSignal`. The files and their
checks are in checkpoint_files.py; choosing and loading what to resume in checkpoint_resume.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint_files import (
    FORMAT,
    META,
    ZERO1_OPTIM,
    TrainState,
    barrier,
    list_checkpoints,
    load_dcp,
    rng_state,
    sha256_file,
    single_process_ok,
)
from .checkpoint_resume import CheckpointError, IncompatibleCheckpoint, NoCheckpoint, Resumer

__all__ = [  # what the trainer and its tests use; defined here or in the two modules above
    "CheckpointError",
    "Checkpointer",
    "IncompatibleCheckpoint",
    "NoCheckpoint",
    "TermSignal",
    "TrainState",
    "list_checkpoints",
]


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
        barrier(self.group)
        dcp = load_dcp()
        sharded: dict[str, Any] = {"model": dcp.state_dict.get_model_state_dict(state.model)}
        if not state.zero1:
            sharded["optim"] = dcp.state_dict.get_optimizer_state_dict(
                state.model, state.optimizer, options=state.optimizer_options())
        with single_process_ok():
            dcp.save(sharded, checkpoint_id=tmp, no_dist=not dist.is_initialized())
        if state.zero1:
            state.optimizer.consolidate_state_dict(to=0)
            if self.rank == 0:
                _torch_save(state.optimizer.state_dict(), tmp / ZERO1_OPTIM)
        _torch_save(self._rank_state(step, state), tmp / f"rank{self.rank}.pt")
        barrier(self.group)
        if self.rank == 0:
            self._publish(tmp, final, step, state, reason)
        barrier(self.group)  # nobody goes on (and maybe crashes) before it is complete
        self.last_saved = step
        self.log(f"checkpoint: saved {final} ({reason}, {time.perf_counter() - t0:.2f} s)")
        return final

    def _rank_state(self, step: int, state: TrainState) -> dict[str, Any]:
        return {
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
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
    def load_latest(self, state: TrainState) -> int:
        """Resume `state` from the newest usable checkpoint (collective); returns its step.
        Nothing is loaded anywhere unless every rank read it; see Resumer.load_latest
        (checkpoint_resume.py) for what is set aside and what is raised."""
        return Resumer(self.root, self.group, self.rank, self.world_size,
                       self.log).load_latest(state)


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
