"""Shared libraries loaded in this process (libnccl, the CUDA runtime), as /proc/self/maps
lists them: the ones the agent calls into directly must be the very copies torch loaded."""

from __future__ import annotations

import contextlib
import ctypes


def mapped_libraries(fragment: str) -> list[str]:
    """Paths of the mapped shared libraries whose path contains `fragment`, each once, in the
    order /proc/self/maps lists them (by address, which is not the order they were loaded in:
    later ones usually lie lower); empty where /proc/self/maps cannot be read."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                path = fields[-1] if len(fields) >= 6 else ""
                if fragment in path and ".so" in path and path not in found:
                    found.append(path)
    except OSError:
        return []
    return found


def flush_c_stdio() -> None:
    """Write out what the C library's output streams hold. NCCL writes its lines to C's
    `stdout` with fwrite and never flushes it (src/debug.cc): on a pipe or a file that stream is
    block-buffered, so its lines can sit there until the process exits, and are lost if it is
    killed."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None)
        libc.fflush.argtypes = [ctypes.c_void_p]
        libc.fflush(None)
