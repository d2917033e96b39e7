"""The values a script hands to `init()` and `log()`, read on the host without a device sync
(agent/run.py): steps, token counts and losses as numbers, a configuration as JSON-like data."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .transport import local_value, plain_value


def json_like(value: Any, where: str, changed: list[str], depth: int = 0) -> Any:
    """`value` with string keys, lists for tuples and sets, and the text of anything else that
    is not a str, int, float, bool or None (noting where in `changed`); cut at depth 16."""
    if type(value) in (str, int, float, bool, type(None)):
        return value
    with contextlib.suppress(Exception):  # NumPy scalars, 0-d tensors, str/int subclasses
        value = plain_value(value)
        if type(value) in (str, int, float, bool):
            return value
    if isinstance(value, dict) and depth < 16:
        return {str(k): json_like(v, f"{where}.{k}" if where else str(k), changed, depth + 1)
                for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)) and depth < 16:
        return [json_like(v, where, changed, depth + 1) for v in value]
    changed.append(f"{where or 'config'}: {type(value).__name__}")
    return str(value)

def host_int(value: Any, name: str) -> int | None:
    """An int from a Python/NumPy integer or a CPU tensor; never reads a GPU tensor (a sync)."""
    if value is None or type(value) is int:
        return value
    if isinstance(value, torch.Tensor) and value.is_cuda:
        raise TypeError(f"{name} is a CUDA tensor: pass a Python int (reading it would sync)")
    return int(value)


def host_float(value: Any) -> float | None:
    """A float from a number or a one-element CPU tensor; None for None or a device tensor
    (never synced); raises for anything else."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = local_value(value)
        if value.is_cuda:
            return None  # never sync a device tensor on the training thread
        return float(value)
    return float(value)


def why(exc: Exception) -> str:
    """How a warning says that a value could not be read."""
    return f"cannot be read ({type(exc).__name__}: {exc})"
