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
"""

from __future__ import annotations

import contextlib
import copy
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
import torch.nn as nn

FORMAT = 1
META = "meta.json"
ZERO1_OPTIM = "optimizer_zero1.pt"
_COMPLETE = re.compile(r"^step_(\d{6,})$")
_SET_ASIDE = re.compile(r"^step_(\d{6,})\.corrupt$")




def _dcp() -> Any:
    """`torch.distributed.checkpoint` with its `state_dict` and `api` modules, imported on first
    use: the import costs about 0.6 s of CPU at every rank's start, which a run that never
    saves or resumes should not pay."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.api
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    return dcp


def _checkpoint_exception() -> type[BaseException]:
    """DCP's `CheckpointException` (a BaseException: `except Exception` misses it)."""
    return _dcp().api.CheckpointException

class CheckpointError(RuntimeError):
    """No checkpoint could be used."""


class NoCheckpoint(CheckpointError):
    """Nothing to resume from: no checkpoint, or only ones set aside as corrupt."""


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
        dcp = _dcp()
        sharded: dict[str, Any] = {"model": dcp.state_dict.get_model_state_dict(state.model)}
        if not state.zero1:
            sharded["optim"] = dcp.state_dict.get_optimizer_state_dict(state.model,
                                                                       state.optimizer)
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

        Every rank reads a candidate into objects of its own and `state` is left as it is
        until every rank has read it; then all copy it in together. A candidate that fails
        anywhere is set aside (`*.corrupt`) and the one before it tried, so a failure never
        leaves part of a checkpoint loaded. Raises NoCheckpoint when none is usable,
        IncompatibleCheckpoint, or CheckpointError when copying in failed on some rank."""
        while True:
            kind, arg = _broadcast(self._choose(state) if self.rank == 0 else None, self.group)
            if kind == "none":
                raise NoCheckpoint(arg)
            if kind == "incompatible":
                raise IncompatibleCheckpoint(arg)
            path = Path(arg)
            # every rank checks its own files against meta.json before anything is read, and
            # all learn the result: a rank file of another step would load "fine" and leave
            # the ranks at different steps (a hang at their next collective)
            failures = self._failures(self._try_match(path, state))
            what = "it does not match its meta.json on "
            if not failures:
                loaded, error = self._try_read(path, state)
                failures = self._failures(error)
                what = "it failed to load on "
            if not failures:
                self._commit_everywhere(path, loaded, state)
                self.log(f"checkpoint: resumed from {path} (step {loaded.step})"
                         f"{self._newer_set_aside(loaded.step)}")
                return loaded.step
            if self.rank == 0:
                self._set_aside(path, what + "; ".join(
                    f"rank {r}: {e}" for r, e in failures.items()))
            _barrier(self.group)

    def _choose(self, state: TrainState) -> tuple[str, str]:
        """Rank 0: ("load", path) of the newest checkpoint that verifies, setting corrupt ones
        aside; ("incompatible", why) or ("none", why)."""
        for _, path in list_checkpoints(self.root):
            meta, problem = verify(path)
            if meta is None:
                self._set_aside(path, problem)
                continue
            mismatch = self._incompatible(meta, state)
            if mismatch:
                return "incompatible", f"cannot resume from {path}: {mismatch}"
            return "load", str(path)
        return "none", self._nothing_usable()

    def _nothing_usable(self) -> str:
        """Why there is nothing to resume from, naming the checkpoints set aside as corrupt
        (by this run or an earlier one)."""
        aside = [p.name for _, p in set_aside_checkpoints(self.root)]
        if not aside:
            return f"no checkpoint in {self.root}"
        return (f"no usable checkpoint in {self.root}: {len(aside)} set aside as corrupt "
                f"({', '.join(aside)})")

    def _newer_set_aside(self, step: int) -> str:
        """Rank 0: a note naming the checkpoints newer than `step` set aside as corrupt."""
        if self.rank != 0:
            return ""
        newer = [p.name for s, p in set_aside_checkpoints(self.root) if s > step]
        return f"; newer ones set aside as corrupt: {', '.join(newer)}" if newer else ""

    def _incompatible(self, meta: dict[str, Any], state: TrainState) -> str | None:
        """Why this run cannot resume from a checkpoint with `meta` (nothing corrupt), or None."""
        if meta.get("format") != FORMAT:
            return f"format {meta.get('format')}, this trainer reads format {FORMAT}"
        if meta["world_size"] != self.world_size:
            return (f"it was written by {meta['world_size']} rank(s) and this run has "
                    f"{self.world_size}; resume with the same number of ranks")
        if meta["optimizer_layout"] != state.optimizer_layout:
            return (f"its optimizer state is {meta['optimizer_layout']!r} and this run needs "
                    f"{state.optimizer_layout!r}: resume with the same --zero stage family "
                    "(ZeRO-1 vs the others)")
        return _settings_mismatch(meta.get("config") or {}, state.config)

    def _set_aside(self, path: Path, problem: str | None) -> None:
        """Rank 0: rename a bad checkpoint to `*.corrupt` and say why."""
        target = path.with_name(path.name + ".corrupt")
        shutil.rmtree(target, ignore_errors=True)
        os.rename(path, target)
        self.log(f"checkpoint: {path} is corrupt ({problem}); moved to {target.name}")

    def _failures(self, error: str | None) -> dict[int, str]:
        """Every rank's error in the same attempt, by rank (collective): {} when none failed."""
        errors: list[str | None] = [error]
        if dist.is_initialized():
            errors = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(errors, error, group=self.group)
        return {r: e for r, e in enumerate(errors) if e is not None}

    def _try_match(self, path: Path, state: TrainState) -> str | None:
        """None when this rank's files of checkpoint `path` agree with its meta.json, else what
        differs in one line (never raises: every rank must reach the agreement after it)."""
        try:
            return self._mismatch(path, state)
        except (Exception, _checkpoint_exception()) as exc:
            return _one_line(exc)

    def _mismatch(self, path: Path, state: TrainState) -> str | None:
        """What in this rank's view of `path` contradicts meta.json: the step and world size
        in its rank file, and the model's tensor shapes in DCP's metadata against this run's."""
        meta = json.loads((path / META).read_text())
        if meta["world_size"] != self.world_size:
            return (f"{META} says {meta['world_size']} rank(s), this run has "
                    f"{self.world_size}")
        name = f"rank{self.rank}.pt"
        mine = torch.load(path / name, weights_only=True)
        if int(mine["step"]) != meta["step"]:
            return f"{name} is of step {mine['step']}, {META} says step {meta['step']}"
        for key in ("rank", "world_size"):  # absent in files of older trainers
            want = self.rank if key == "rank" else meta["world_size"]
            if key in mine and mine[key] != want:
                return f"{name} was written with {key} {mine[key]}, {META} says {want}"
        return _shape_mismatch(path, state)

    def _try_read(self, path: Path, state: TrainState) -> tuple[Loaded | None, str | None]:
        """(what `_read` read, None), or (None, the error in one line)."""
        try:
            return self._read(path, state), None
        except (Exception, _checkpoint_exception()) as exc:  # any failure: use an older one
            return None, _one_line(exc)

    def _read(self, path: Path, state: TrainState) -> Loaded:
        """Read checkpoint `path` into new objects shaped like `state`'s (this rank's part),
        checking that it would load; `state` is not changed. DCP's part is collective."""
        model = _dcp().state_dict.get_model_state_dict(state.model)
        sharded: dict[str, Any] = {"model": _detached_copy(model)}
        if not state.zero1:  # DCP loads in place into the tensors of these copies
            sharded["optim"] = _optimizer_template(state)
        with _single_process_ok():
            _dcp().load(sharded, checkpoint_id=path, no_dist=not dist.is_initialized())
        if state.zero1:
            optim = torch.load(path / ZERO1_OPTIM, weights_only=True)
            _check_param_groups(optim, state.optimizer)
        else:
            optim = sharded["optim"]
        mine = torch.load(path / f"rank{self.rank}.pt", weights_only=True)
        _check_rank_state(mine, state)
        return Loaded(int(mine["step"]), sharded["model"], optim, mine)

    def _commit_everywhere(self, path: Path, loaded: Loaded, state: TrainState) -> None:
        """Copy what every rank read into the live `state` (collective). Raises
        CheckpointError when that failed on some rank: the ranks' states then differ."""
        error: str | None = None
        try:
            _commit(loaded, state)
        except Exception as exc:
            error = _one_line(exc)
        failures = self._failures(error)
        if failures:
            where = "; ".join(f"rank {r}: {e}" for r, e in failures.items())
            raise CheckpointError(f"{path} was read on every rank, but loading it into the "
                                  f"model failed on {where}; the ranks' states may differ "
                                  "now, so this run stops")


@dataclass
class Loaded:
    """A checkpoint as one rank read it, in objects of its own (not yet in the live state)."""

    step: int
    model: dict[str, Any]  # get_model_state_dict's layout
    optim: dict[str, Any]  # get_optimizer_state_dict's, or ZeRO-1's consolidated state_dict
    rank_state: dict[str, Any]  # rank<r>.pt: step, data position, RNG states, loss scaler


def set_aside_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Checkpoint directories set aside as `*.corrupt`, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and (m := _SET_ASIDE.match(p.name))]
    return sorted(found, reverse=True)


def _settings_mismatch(saved: dict[str, Any], ours: dict[str, Any]) -> str | None:
    """What differs between a checkpoint's run settings and this run's that makes it
    impossible to resume (the model's shapes, the data order), or None. Settings the
    checkpoint does not record are not compared."""
    shapes = [{k: v for k, v in (c.get("model") or {}).items() if k != "dropout"}
              for c in (saved, ours)]
    if "model" in saved and shapes[0] != shapes[1]:
        return (f"its model is {shapes[0]} and this run's is {shapes[1]}: resume with the "
                "same --preset and --block-size")
    if "seed" in saved and saved["seed"] != ours.get("seed"):
        return (f"it was trained with --seed {saved['seed']} and this run has "
                f"{ours.get('seed')}: the data order would differ")
    per_step = [c.get("batch_size", 0) * c.get("grad_accum", 1) for c in (saved, ours)]
    if "batch_size" in saved and per_step[0] != per_step[1]:
        return (f"it took {per_step[0]} sequences per rank per step (--batch-size x "
                f"--grad-accum) and this run takes {per_step[1]}")
    return None


def _shape_mismatch(path: Path, state: TrainState) -> str | None:
    """The first model tensor whose shape in the checkpoint's DCP metadata differs from this
    run's model (global shapes, so the same on every rank), or None."""
    saved = _dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for fqn, tensor in _dcp().state_dict.get_model_state_dict(state.model).items():
        entry = saved.get(f"model.{fqn}")
        size = getattr(entry, "size", None)
        if entry is None:
            return f"the checkpoint has no model tensor {fqn}"
        if size is not None and tuple(size) != tuple(tensor.shape):
            return (f"model tensor {fqn} has shape {tuple(size)} in the checkpoint, "
                    f"{tuple(tensor.shape)} in this run")
    return None


def _one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for a one-line report of a rank's failure."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _detached_copy(obj: Any) -> Any:
    """`obj` (nested dicts, lists, tuples) with every tensor replaced by a copy of its own."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _detached_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detached_copy(v) for v in obj)
    return obj


def _optimizer_template(state: TrainState) -> dict[str, Any]:
    """A copy of the optimizer's DCP state dict, for DCP to load into. Taking it makes torch
    create the state of an optimizer that has none (a step with lr 0): that state is dropped
    again, so that a run that does not resume after all starts like a new one."""
    optimizer = state.optimizer
    had_state = bool(optimizer.state)
    template = _detached_copy(_dcp().state_dict.get_optimizer_state_dict(state.model, optimizer))
    if not had_state:
        optimizer.state.clear()
        if hasattr(optimizer, "invalidate_tables"):
            optimizer.invalidate_tables()
    return template


def _check_param_groups(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Raise unless `saved` (an optimizer state_dict) has `optimizer`'s parameter groups."""
    got = [len(g["params"]) for g in saved["param_groups"]]
    want = [len(g["params"]) for g in optimizer.param_groups]
    if got != want:
        raise ValueError(f"optimizer parameter groups of sizes {got}, this run has {want}")


def _check_rank_state(saved: dict[str, Any], state: TrainState) -> None:
    """Raise unless a rank file would load into `state`: the data position is tried on a
    copy of the loader, the RNG states set and this rank's own put back."""
    int(saved["step"])
    copy.copy(state.data).load_state_dict(saved["data"])
    if state.scaler is not None and saved["scaler"] is not None:
        missing = sorted(set(state.scaler.state_dict()) - set(saved["scaler"]))
        if missing:
            raise ValueError(f"loss scaler state without {', '.join(missing)}")
    own = rng_state()
    try:
        set_rng_state(saved["rng"])
    finally:
        set_rng_state(own)


def _commit(loaded: Loaded, state: TrainState) -> None:
    """Copy what `_read` read into the live model, optimizer, data loader, loss scaler and
    random number generators."""
    _dcp().state_dict.set_model_state_dict(state.model, loaded.model)
    if state.zero1:
        state.optimizer.load_state_dict(loaded.optim)
        inner = state.optimizer.optim  # it wrote the local state by hand
        if hasattr(inner, "invalidate_tables"):
            inner.invalidate_tables()
    else:
        _dcp().state_dict.set_optimizer_state_dict(state.model, state.optimizer, loaded.optim)
    mine = loaded.rank_state
    state.data.load_state_dict(mine["data"])
    if state.scaler is not None and mine["scaler"] is not None:
        state.scaler.load_state_dict(mine["scaler"])
    set_rng_state(mine["rng"])


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
