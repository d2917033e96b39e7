"""The Flight Recorder's rings as this torch build exposes them (the generic one, gloo's and
the CPU's; NCCL's where NCCL is in use), and whether a group runs NCCL. `recorder.py` reads
them."""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from typing import Any

from . import c10d


class RecorderSource:
    """One Flight Recorder ring: the generic one (gloo, CPU) or NCCL's."""

    def __init__(self, name: str, dump: Callable[..., bytes], **options: bool) -> None:
        self.name = name
        self._dump = functools.partial(dump, **options) if options else dump
        self.seen: set[int] = set()  # record ids taken, above the ring's oldest
        self.last_id: int | None = None

    def read(self, collectives: bool) -> dict[str, Any]:
        """The recorder's content as a dict (`entries` only with `collectives`)."""
        return pickle.loads(self._dump(includeCollectives=collectives, onlyActive=False))


def find_sources(nccl: bool) -> list[RecorderSource]:
    """The recorder rings this torch build exposes (NCCL's only where NCCL is in use)."""
    generic, nccl_dump = c10d.recorder_dumps()
    sources = []
    if generic is not None:
        # no stack traces: their symbolization costs more than the rest of the read (its first
        # use imports torch._inductor, seconds during which no status is read), and on a
        # machine with CUDA (H100, torch 2.11) a gloo job whose generic ring was read with
        # them died with SIGSEGV at interpreter exit, every run (issue #25; without them:
        # exit 0). tests/test_collectives.py keeps both rings without stack traces.
        sources.append(RecorderSource("fr", generic, includeStackTraces=False))
    if nccl and nccl_dump is not None:
        sources.append(RecorderSource("nccl", nccl_dump, includeStackTraces=False))
    return sources


def group_uses_nccl(group: Any = None, unknown: bool = False) -> bool:
    """True when `group` (default: the default group) runs NCCL for CUDA tensors; `unknown`
    where its backend cannot be read."""
    try:
        import torch.distributed as dist

        return "nccl" in str(dist.get_backend(group))
    except Exception:
        return unknown
