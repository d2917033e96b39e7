"""Resuming from a checkpoint: rank 0 chooses the newest one that verifies and that this run can
resume from, every rank checks its own files against meta.json and reads the checkpoint into
copies of its own, and only when every rank read it do all copy it into the live state; one that
fails anywhere is set aside as corrupt and the one before it tried (checkpoint.py tells the
whole story). `Resumer` does this for `Checkpointer.load_latest`."""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
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
    dcp_exception,
    list_checkpoints,
    load_dcp,
    rng_state,
    set_aside_checkpoints,
    set_rng_state,
    single_process_ok,
    verify,
)


class CheckpointError(RuntimeError):
    """No checkpoint could be used."""


class NoCheckpoint(CheckpointError):
    """Nothing to resume from: no checkpoint, or only ones set aside as corrupt."""


class IncompatibleCheckpoint(ValueError):
    """A readable checkpoint that this run cannot resume from (other world size, layout)."""


class Resumer:
    """Finds the checkpoint under `root` to resume from and loads it on every rank together;
    every method is collective. `log` says what happened (rank 0 only, as Checkpointer's)."""

    def __init__(
        self,
        root: Path,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        log: Callable[[str], None],
    ) -> None:
        self.root = root
        self.group = group  # a CPU (gloo) group for the small agreements
        self.rank = rank
        self.world_size = world_size
        self.log = log

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
            barrier(self.group)

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
                    "(ZeRO-1 vs the others), with --pp (dcp-flat) or without it")
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
        except (Exception, dcp_exception()) as exc:
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
        except (Exception, dcp_exception()) as exc:  # any failure: use an older one
            return None, _one_line(exc)

    def _read(self, path: Path, state: TrainState) -> Loaded:
        """Read checkpoint `path` into new objects shaped like `state`'s (this rank's part),
        checking that it would load; `state` is not changed. DCP's part is collective."""
        model = load_dcp().state_dict.get_model_state_dict(state.model)
        sharded: dict[str, Any] = {"model": _detached_copy(model)}
        if not state.zero1:  # DCP loads in place into the tensors of these copies
            sharded["optim"] = _optimizer_template(state)
        with single_process_ok():
            load_dcp().load(sharded, checkpoint_id=path, no_dist=not dist.is_initialized())
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


def _broadcast(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """`obj` from rank 0 on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


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
    saved = load_dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for fqn, tensor in load_dcp().state_dict.get_model_state_dict(state.model).items():
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
    optim_state = load_dcp().state_dict.get_optimizer_state_dict(
        state.model, optimizer, options=state.optimizer_options())
    template = _detached_copy(optim_state)
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
    load_dcp().state_dict.set_model_state_dict(state.model, loaded.model)
    if state.zero1:
        state.optimizer.load_state_dict(loaded.optim)
        inner = state.optimizer.optim  # it wrote the local state by hand
        if hasattr(inner, "invalidate_tables"):
            inner.invalidate_tables()
    else:
        load_dcp().state_dict.set_optimizer_state_dict(state.model, state.optimizer, loaded.optim,
                                                       options=state.optimizer_options())
    mine = loaded.rank_state
    state.data.load_state_dict(mine["data"])
    if state.scaler is not None and mine["scaler"] is not None:
        state.scaler.load_state_dict(mine["scaler"])
    set_rng_state(mine["rng"])
