"""CUDA graphs and the agent's background threads.

Two hazards, both out of sight of a CPU test:

* A captured graph's outputs are static buffers that each replay overwrites without an in-place
  operation (no version change), so a loss the sender thread copies after the next replay
  would be the next step's. Every capture in the process (`torch.cuda.graph`,
  `make_graphed_callables`, torch.compile's CUDA graphs) goes through
  `torch.cuda.CUDAGraph.capture_begin`, which `watch_captures` wraps to tell the agent, which
  then copies values at `log()` (steps.py).
* While a thread captures in CUDA's global mode (torch's default), a potentially unsafe CUDA
  call from any other thread, such as the sender's event queries and copies or the Flight
  Recorder's event queries, fails and invalidates that capture. `capture_mode_thread_local`
  sets the calling thread's capture mode to thread-local, under which only a capture of its
  own restricts it (what CUDA's `cudaThreadExchangeStreamCaptureMode` is for).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger("scalemon.agent")

CAPTURE_MODE_THREAD_LOCAL = 1
"""`cudaStreamCaptureModeThreadLocal` in `cudaStreamCaptureMode`."""


class CaptureState:
    """How many CUDA graph captures are in progress in this process (counted once
    `watch_captures` ran): the training thread's hooks record no event while one is, since a
    timing event cannot be captured and a failed call would invalidate the user's capture."""

    active = 0


CAPTURE = CaptureState()
_listeners: list[weakref.WeakMethod | Callable[[], Any]] = []
_wrapped = False


def watch_captures(callback: Callable[[], Any]) -> None:
    """Count captures in `CAPTURE`, and call `callback()` (a bound method, held weakly) when a
    CUDA graph capture begins in this process, before the capture starts. It must be quick;
    what it raises is swallowed."""
    global _wrapped
    _listeners.append(weakref.WeakMethod(callback) if hasattr(callback, "__self__")
                      else callback)
    if _wrapped:
        return
    import torch

    graph_class = torch.cuda.CUDAGraph
    begin, end = graph_class.capture_begin, graph_class.capture_end

    @functools.wraps(begin)
    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        _tell_listeners()
        CAPTURE.active += 1
        try:
            return begin(self, *args, **kwargs)
        except BaseException:
            CAPTURE.active -= 1
            raise

    @functools.wraps(end)
    def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return end(self, *args, **kwargs)
        finally:
            CAPTURE.active = max(0, CAPTURE.active - 1)

    graph_class.capture_begin, graph_class.capture_end = capture_begin, capture_end
    _wrapped = True


def _tell_listeners() -> None:
    for ref in list(_listeners):
        callback = ref() if isinstance(ref, weakref.WeakMethod) else ref
        if callback is None:
            _listeners.remove(ref)
            continue
        with contextlib.suppress(Exception):  # the user's capture must go on
            callback()


def capture_mode_thread_local() -> bool:
    """Set the calling thread's CUDA stream-capture mode to thread-local through torch's CUDA
    runtime library; True when it was set (False where that library is not loaded)."""
    from .cudart import runtime_library

    cudart = runtime_library()
    if cudart is None:
        return False
    try:
        mode = ctypes.c_int(CAPTURE_MODE_THREAD_LOCAL)
        return cudart.cudaThreadExchangeStreamCaptureMode(ctypes.byref(mode)) == 0
    except Exception as exc:  # an old runtime without the call
        log.info("scalemon: could not set this thread's CUDA capture mode (%s)", exc)
        return False
