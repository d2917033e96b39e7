"""The cyclic garbage collector paused around work that makes many objects and no cycles
(reading Flight Recorder dumps, pickling and unpickling a seed): each collection started
meanwhile would walk everything made so far."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off meanwhile; on again after if it was on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
