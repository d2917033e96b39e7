"""Collective durations on gloo, where the Flight Recorder records none.

The recorder gives gloo collectives their counts, sizes, sequence numbers and issue times, but no
duration (torch 2.13: `state` stays "scheduled", no `duration_ms`; gloo has no completion hook
and no `Work._get_duration`). On gloo only, the agent therefore wraps the `torch.distributed`
collective functions: a synchronous call is timed around the call, an `async_op=True` one from
the call to its future's completion (gloo completes futures on its own threads). Each call
leaves a `HostCall` `[group, seq, op, seconds]` in a deque right after it was issued (`seq`: the
group's sequence number, the recorder entry's `collective_seq_id`), and `seconds` is filled in
once it completed; the recorder's thread matches it to the entry of the same (group, seq).
`op` is set where gloo's recorder misnames the call: gloo has no reduce-scatter and runs it as an
all_reduce of the whole input, which the recorder records as `all_reduce`. This costs a few µs of
training-thread time per collective; on NCCL nothing is wrapped.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .c10d import sequence_number

HostCall = list  # [group (None: default), seq, op or None, seconds or None]


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


# API function -> (op name where the recorder's is wrong, position of the `group` argument)
_OPS: dict[str, tuple[str | None, int]] = {
    "all_reduce": (None, 2),
    "broadcast": (None, 2),
    "reduce": (None, 3),
    "all_gather": (None, 2),
    "all_gather_into_tensor": (None, 2),
    "all_gather_single": (None, 2),
    "reduce_scatter_tensor": ("reduce_scatter", 3),
    "reduce_scatter_single": ("reduce_scatter", 3),
    "all_to_all_single": (None, 4),
}


class HostTimer:
    """Wraps `torch.distributed`'s collectives (gloo only) and collects their durations."""

    def __init__(self, max_calls: int = 100_000) -> None:
        self.calls: deque[HostCall] = deque(maxlen=max_calls)
        self._originals: dict[str, Callable[..., Any]] = {}

    def install(self) -> None:
        """Replace the module functions by timed ones (undone by `remove`)."""
        for api, (op, group_at) in _OPS.items():
            fn = getattr(dist, api, None)
            if fn is None or hasattr(fn, "__scalemon_original__"):
                continue
            self._originals[api] = fn
            setattr(dist, api, self._wrap(fn, op, group_at))

    def remove(self) -> None:
        """Put the original functions back."""
        for api, fn in self._originals.items():
            setattr(dist, api, fn)
        self._originals.clear()

    def _wrap(self, fn: Callable[..., Any], op: str | None, group_at: int) -> Callable[..., Any]:
        calls = self.calls

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            work = fn(*args, **kwargs)
            try:
                group = _arg(args, kwargs, group_at, "group")
                call = [group, sequence_number(group), op, None]
                if work is None:
                    call[3] = time.perf_counter() - t
                else:
                    work.get_future().then(lambda _f: call.__setitem__(
                        3, time.perf_counter() - t))
                calls.append(call)
            except Exception:  # timing is never worth the collective
                pass
            return work

        timed.__scalemon_original__ = fn  # type: ignore[attr-defined]
        return timed


def original(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The unwrapped function behind a timed one (itself when not wrapped)."""
    return getattr(fn, "__scalemon_original__", fn)
