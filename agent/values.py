"""Every conversion of what a script hands to `init()`, `log()` and `info()`, or what torch gives
(tensors, DTensors, NumPy scalars, subclasses of str/int/float), into plain wire values: the one
place with these rules; the rest of the agent calls it.

Where each runs, and the promise it keeps:

- on the training thread (`host_int`, `host_float`, `stageable`; `json_like` at `init()`):
  never a device sync. A tensor on a GPU is never read here: `host_int` refuses it,
  `host_float` gives None, `stageable` hands it to the staging of steps.py, which copies it
  without a sync.
- on the sender thread (`plain_value` for `log()`'s extra values, `plain_values` for every
  message body): host values only, so a GPU tensor stays as it is and the protocol check
  refuses it.

A DTensor is read from its local tensor where that holds the whole value (`local_value`); a
sharded or partial one raises, since reading it takes a collective the agent never issues.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

PLAIN_TYPES = (bool, int, float, str, type(None))
"""What a message value may be once made plain."""
_SUBCLASSED = PLAIN_TYPES[:-1]  # bool first: a bool is an int too


def local_value(value: Any) -> Any:
    """A DTensor as its local tensor where that holds the whole value (replicated, as the
    grad norm `clip_grad_norm_` returns under FSDP2); anything else unchanged. Raises
    ValueError for a sharded or partial DTensor: reading one takes a collective, which the
    agent never issues (the ranks would have to issue it in the same order)."""
    if type(value).__name__ != "DTensor":
        return value
    if all(p.is_replicate() for p in value.placements):
        return value.to_local()
    raise ValueError(f"it is a DTensor placed {tuple(value.placements)}: reading it takes a "
                     "collective; pass .full_tensor()")


def on_device(value: Any) -> bool:
    """Whether `value` is a tensor on a GPU (reading it on the host would sync)."""
    return isinstance(value, torch.Tensor) and value.is_cuda


def plain_value(value: Any) -> Any:
    """A subclass of str/int/float/bool as its base type, a NumPy scalar or a one-element CPU
    tensor as a plain Python value, a replicated DTensor as its local value (`local_value`:
    a sharded or partial one raises ValueError); anything else, a GPU tensor included,
    unchanged."""
    if type(value) in PLAIN_TYPES:
        return value
    for kind in _SUBCLASSED:  # torch's version string, IntEnum, np.float64
        if isinstance(value, kind):
            return kind(value)
    value = local_value(value)
    if getattr(value, "is_cuda", False):
        return value  # never read off the device here
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()  # a NumPy scalar, a 0-d CPU tensor
    if hasattr(value, "is_cuda") and hasattr(value, "numel") and value.numel() == 1:
        return value.reshape(()).item()  # a one-element CPU tensor of any shape
    return value


def plain_values(body: dict[str, Any]) -> dict[str, Any]:
    """A message body with its values, and those of a dict one level down, made plain
    (`plain_value`); the body itself where they all are already."""
    if all(type(v) in PLAIN_TYPES for v in body.values()):
        return body
    return {k: {k2: plain_value(v2) for k2, v2 in v.items()} if isinstance(v, dict)
            else plain_value(v) for k, v in body.items()}


def json_like(value: Any, where: str, changed: list[str], depth: int = 0) -> Any:
    """`value` with string keys, lists for tuples and sets, plain values (`plain_value`), and
    the text of anything else (noting where in `changed`); cut at depth 16."""
    if type(value) in PLAIN_TYPES:
        return value
    with contextlib.suppress(Exception):  # NumPy scalars, 0-d tensors, str/int subclasses
        value = plain_value(value)
        if type(value) in PLAIN_TYPES:
            return value
    if isinstance(value, dict) and depth < 16:
        return {str(k): json_like(v, f"{where}.{k}" if where else str(k), changed, depth + 1)
                for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)) and depth < 16:
        return [json_like(v, where, changed, depth + 1) for v in value]
    changed.append(f"{where or 'config'}: {type(value).__name__}")
    return str(value)


def host_int(value: Any, name: str) -> int | None:
    """An int from a Python/NumPy integer or a CPU tensor (a replicated DTensor's local one);
    raises TypeError for a GPU tensor (reading it would sync), and for what is no integer."""
    if value is None or type(value) is int:
        return value
    value = local_value(value)
    if on_device(value):
        raise TypeError(f"{name} is a CUDA tensor: pass a Python int (reading it would sync)")
    return int(value)


def host_float(value: Any) -> float | None:
    """A float from a number or a one-element CPU tensor (a replicated DTensor's local one);
    None for None or a GPU tensor (never synced); raises for anything else."""
    if value is None:
        return None
    value = local_value(value)
    return None if on_device(value) else float(value)


def stageable(value: Any) -> torch.Tensor | float:
    """A loss or loss scale as steps.py stages it on a GPU: a one-element tensor as itself
    (a replicated DTensor's local one; not read here), anything else as a float; raises
    ValueError for a tensor of several elements, and for what is no number."""
    if isinstance(value, torch.Tensor):
        value = local_value(value)
        if value.numel() == 1:
            return value
        raise ValueError(f"a tensor of {value.numel()} elements")
    return float(value)


def why(exc: Exception) -> str:
    """How a warning says that a value could not be read."""
    return f"cannot be read ({type(exc).__name__}: {exc})"


class LoggedValues:
    """What `log()` was given, read on the host: each value that cannot be read (or not
    without a device sync) is left out or replaced, and said once per name."""

    def __init__(self, warnings: Any) -> None:
        self.warnings = warnings

    def step(self, step: Any, previous: int | None) -> int:
        """The step as an int (a NumPy integer, a CPU tensor); one that cannot be read without
        a sync or at all is counted on from the `previous` step instead, said once."""
        try:
            if step is None:
                raise TypeError("it is None")
            return host_int(step, "step")
        except (TypeError, ValueError, RuntimeError) as exc:
            self.warnings.once("log-step", "scalemon: log(step=...) %s; the monitor counts "
                               "steps on from the previous one instead", why(exc))
        return 0 if previous is None else previous + 1

    def int(self, value: Any, name: str) -> int | None:
        """`value` as an int, or None (said once) where it cannot be read without a sync."""
        try:
            return host_int(value, name)
        except (TypeError, ValueError, RuntimeError) as exc:
            self.warnings.once(f"log-{name}", "scalemon: log(%s=...) %s; it is left out",
                               name, why(exc))
            return None

    def float(self, value: Any, name: str) -> float | None:
        """`value` as a float, or None (said once) for one that is not a number or a
        one-element tensor (a loss of several elements, a string)."""
        try:
            return host_float(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            self.warnings.once(f"log-{name}", "scalemon: %s given to log() %s; it is left out",
                               name, why(exc))
            return None
