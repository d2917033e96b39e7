"""Two CUDA runtime calls made without releasing the GIL, for the training thread's hot path.

torch's `Event.record()` and `Tensor.copy_()` release the GIL around their CUDA call. Each
release lets a waiting background thread (the agent's sender, heartbeat or recorder, or the
script's own) take the GIL, and the training thread then waits until that thread blocks again:
measured on an H100 (bench/agent_ab.py --breakdown), a 2-5 µs event record cost 18-48 µs
on the training thread and a one-float pinned copy ~100 µs. `cudaEventRecord` and a
device-to-host `cudaMemcpyAsync` into pinned memory are asynchronous (they return at once), so
here they are called through `ctypes.PyDLL`, which keeps the GIL, on the libcudart that torch
loaded. Where that library is not found, or a call fails once, `CudaDirect` is not used and the
agent goes back to torch's calls (the same values, a costlier path).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from .libs import mapped_libraries

log = logging.getLogger("scalemon.agent")

CUDA_MEMCPY_DEVICE_TO_HOST = 2
"""`cudaMemcpyDeviceToHost` in `cudaMemcpyKind`."""


def loaded_cudart() -> str | None:
    """Path of the CUDA runtime library loaded in this process (the one torch uses), from
    /proc/self/maps, or None."""
    found = mapped_libraries("libcudart.so")
    # several runtimes (CuPy, JAX beside torch): the one shipped with torch's CUDA wheels
    found.sort(key=lambda p: ("cuda_runtime" not in p and "/torch/" not in p, p))
    return found[0] if found else None


def runtime_library() -> Any | None:
    """torch's CUDA runtime library through ctypes (releasing the GIL in its calls), or None
    where it is not loaded."""
    path = loaded_cudart()
    if path is None:
        return None
    try:
        return ctypes.CDLL(path)
    except OSError as exc:
        log.info("scalemon: the CUDA runtime %s could not be opened (%s)", path, exc)
        return None


class CudaDirect:
    """`record(event, stream)` and `copy_scalar(dst, src, stream)` through the runtime's C
    API, holding the GIL. Build with `CudaDirect.load()`; None where unavailable."""

    def __init__(self, lib: Any) -> None:
        self._event_record = lib.cudaEventRecord
        self._event_record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._event_record.restype = ctypes.c_int
        self._memcpy = lib.cudaMemcpyAsync
        self._memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.c_int, ctypes.c_void_p]
        self._memcpy.restype = ctypes.c_int

    @classmethod
    def load(cls) -> CudaDirect | None:
        """The direct calls on torch's libcudart, or None (not loaded, symbols missing)."""
        path = loaded_cudart()
        if path is None:
            return None
        try:
            return cls(ctypes.PyDLL(path))
        except (OSError, AttributeError) as exc:
            log.info("scalemon: direct CUDA calls unavailable (%s): using torch's", exc)
            return None

    def record(self, event: torch.cuda.Event, stream: int) -> None:
        """Record `event` (one torch already created and recorded once) on the stream with
        the raw handle `stream`."""
        code = self._event_record(event.cuda_event, stream)
        if code != 0:
            raise RuntimeError(f"cudaEventRecord returned CUDA error {code}")

    def copy_scalar(self, dst: torch.Tensor, src: torch.Tensor, stream: int) -> None:
        """Copy the one element of the CUDA tensor `src` into the pinned host float32 `dst`
        (0-d), in stream order; `src` must be float32 and stay alive until the stream ran the
        copy (the caller keeps it, or frees it into the same stream's allocator)."""
        code = self._memcpy(dst.data_ptr(), src.data_ptr(), 4, CUDA_MEMCPY_DEVICE_TO_HOST,
                            stream)
        if code != 0:
            raise RuntimeError(f"cudaMemcpyAsync returned CUDA error {code}")
