"""Collective durations on gloo, where the Flight Recorder records none.

The recorder gives gloo collectives their counts, sizes, sequence numbers and issue times, but no
duration (torch 2.13: `state` stays "scheduled", no `duration_ms`; gloo has no completion hook
and no `Work._get_duration`). On gloo only, the agent therefore wraps the `torch.distributed`
collective functions: a synchronous call is timed around the call, an `async_op=True` one from
the call to its future's completion (gloo completes futures on its own threads). Each call
leaves a `HostCall` `[group, seq, op, seconds]` in a deque right after it was issued (`seq`: the
group's sequence number, the recorder entry's `collective_seq_id`), and `seconds` is filled in
once it completed; the recorder's thread matches it to the entry of the same (group, seq).
The entry is in the ring from inside the call, the `HostCall` only once the call returned: while
a wrapped call is under way its token is in `HostTimer.issuing`, and the recorder leaves an
entry without its `HostCall` for a later read while that set is not empty (else it would name
a reduce-scatter taken in between by gloo's `all_reduce`: issue #37).
`op` is set where gloo's recorder misnames the call: gloo has no reduce-scatter and runs it as an
all_reduce of the whole input, which the recorder records as `all_reduce`. This costs a few µs of
training-thread time per collective; on NCCL nothing is wrapped.

With it come the P2P wrappers of `p2p.py` (gloo's recorder has no sends or receives). A
group that carries P2P counts them in its sequence number, so a call's `seq` is that number
less the P2P ops issued on the group (`P2PTimer.p2p_ops`): the collective sequence number.
`all_to_all_single` and `all_to_all` also add their bytes sent and received (the input's and
the output's, this rank's own share included) to the step's `a2a_*` counters.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .c10d import sequence_number
from .p2p import P2PTimer

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
    "all_to_all": (None, 2),
}


def _a2a_bytes(api: str, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(bytes sent, bytes received) of an all_to_all call: from the split sizes (rows of dim 0;
    an equal split when they are None) and the tensors' element size."""
    if api == "all_to_all":  # lists of tensors, one per rank
        outputs, inputs = _arg(args, kwargs, 0, "output_tensor_list"), _arg(
            args, kwargs, 1, "input_tensor_list")
        return (sum(t.numel() * t.element_size() for t in inputs),
                sum(t.numel() * t.element_size() for t in outputs))
    output, input_ = _arg(args, kwargs, 0, "output"), _arg(args, kwargs, 1, "input")
    return (_split_bytes(input_, _arg(args, kwargs, 3, "input_split_sizes")),
            _split_bytes(output, _arg(args, kwargs, 2, "output_split_sizes")))


def _split_bytes(tensor: Any, splits: Any) -> int:
    total = tensor.numel() * tensor.element_size()
    if not splits or tensor.dim() == 0 or tensor.shape[0] == 0:
        return total
    return sum(int(n) for n in splits) * (total // tensor.shape[0])


class HostTimer:
    """Wraps `torch.distributed`'s collectives (gloo only) and collects their durations."""

    def __init__(self, max_calls: int = 100_000) -> None:
        self.calls: deque[HostCall] = deque(maxlen=max_calls)
        self.issuing: set[object] = set()
        """A token per wrapped call under way: from before it is issued until its `HostCall`
        is in `calls` (set.add and discard are atomic: any thread may issue)."""
        self.p2p = P2PTimer()
        self._originals: dict[str, Callable[..., Any]] = {}

    def install(self) -> None:
        """Replace the module functions by timed ones, and the P2P methods (undone by
        `remove`)."""
        for api, (op, group_at) in _OPS.items():
            fn = getattr(dist, api, None)
            if fn is None or hasattr(fn, "__scalemon_original__"):
                continue
            self._originals[api] = fn
            setattr(dist, api, self._wrap(fn, op, group_at, api))
        try:
            self.p2p.install()
        except Exception as exc:  # the collectives stay timed
            logging.getLogger("scalemon.agent").warning(
                "scalemon: point-to-point ops are not recorded (%s: %s)", type(exc).__name__, exc)

    def remove(self) -> None:
        """Put the original functions back."""
        for api, fn in self._originals.items():
            setattr(dist, api, fn)
        self._originals.clear()
        self.p2p.remove()

    def _wrap(self, fn: Callable[..., Any], op: str | None, group_at: int,
              api: str) -> Callable[..., Any]:
        calls = self.calls
        issuing = self.issuing
        p2p = self.p2p
        a2a = api.startswith("all_to_all")

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            token = object()
            issuing.add(token)  # the recorder holds back entries without their call meanwhile
            try:
                t = time.perf_counter()
                work = fn(*args, **kwargs)
                try:
                    group = _arg(args, kwargs, group_at, "group")
                    call = [group, sequence_number(group) - p2p.p2p_ops(group), op, None]
                    if a2a:
                        try:  # noqa: SIM105 (sizes it cannot read: no bytes, still timed)
                            p2p.step.add_a2a(*_a2a_bytes(api, args, kwargs))
                        except Exception:
                            pass
                    if work is None:
                        call[3] = time.perf_counter() - t
                    else:
                        work.get_future().then(lambda _f: call.__setitem__(
                            3, time.perf_counter() - t))
                    calls.append(call)
                except Exception:  # timing is never worth the collective
                    pass
                return work
            finally:
                issuing.discard(token)

        timed.__scalemon_original__ = fn  # type: ignore[attr-defined]
        return timed


def original(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The unwrapped function behind a timed one (itself when not wrapped)."""
    return getattr(fn, "__scalemon_original__", fn)
