"""Shared libraries loaded in this process (libnccl, the CUDA runtime), as /proc/self/maps
lists them: the ones the agent calls into directly must be the very copies torch loaded."""

from __future__ import annotations


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
