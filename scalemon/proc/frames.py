"""A process's stacks as read from outside: every thread's frames, innermost first, Python's
and (when asked) the native ones between them, which thread holds the GIL; and their wire
form, bounded, read back without trusting the peer that sent it.

`scalemon.proc.pyspy` fills these from py-spy's JSON; `scalemon.proc.stacktext` says them in
words; `scalemon.proc.stacks` is the one entry point for all three.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

MAX_THREADS = 64
"""Threads a reading carries on the wire; the rest are counted (`threads_cut`)."""
MAX_FRAMES = 80
"""Frames per thread on the wire; beyond them the middle of the stack is cut (`frames_cut`)."""
KEEP_OUTER = 16
"""Of a cut stack, the outermost frames kept (where the script called in: train.py, step());
the rest of MAX_FRAMES are the innermost (where the thread is)."""
MAX_TEXT = 300
"""Characters of any one string on the wire."""
MAX_WIRE_BYTES = 256 << 10
"""The most a reading's wire form takes as JSON: threads beyond it are cut (the GIL holder
and the main thread kept first), so a look fits one protocol message (1 MiB) with room to
spare; the other bounds alone allow 64 x 80 frames of 300-character strings, some 4 MiB."""


@dataclass(frozen=True)
class Frame:
    """One frame: a Python function at a line of a file, or a native (C/C++) function."""

    name: str
    file: str
    """The Python file's path; for a native frame its source file where debug information
    names one (callproc.c), else the shared library."""
    line: int
    """The line in `file`; 0 where unknown (most native frames)."""
    native: bool
    library: str | None = None
    """A native frame's shared library (libc.so.6's path); None for a Python frame."""


@dataclass(frozen=True)
class ThreadStack:
    """One thread of the process: its frames, innermost first."""

    thread_id: int
    """The interpreter's id of the thread (threading.get_ident() in the process)."""
    name: str | None
    """The thread's name (threading's: "MainThread"), None where py-spy found none."""
    os_thread_id: int | None
    """The kernel's id of the thread (the process's pid for its first thread)."""
    active: bool
    """py-spy's judgement: the kernel says the thread is running (not waiting), refined by
    py-spy's list of idle Python frames."""
    owns_gil: bool
    frames: tuple[Frame, ...] = ()
    frames_cut: int = 0
    """Frames left out of the middle of the stack to keep it within MAX_FRAMES."""


@dataclass(frozen=True)
class StackReading:
    """A process's stacks, read once from outside it (or why they could not be)."""

    pid: int
    tool: str
    """What read them ("py-spy 0.4.3")."""
    native: bool
    """Whether native frames were read (False for Python frames only)."""
    threads: tuple[ThreadStack, ...] = ()
    error: str | None = None
    """Why no stacks were read, in one plain sentence; None when they were."""
    note: str | None = None
    """What the reader had to leave out (native frames it could not read), or None."""
    took_s: float = 0.0
    """How long the reading took, the tool's start included."""
    t: float = 0.0
    """When it was read (time.time())."""
    threads_cut: int = 0
    """Threads left out to keep the reading within MAX_THREADS."""

    def to_wire(self) -> dict[str, Any]:
        """The reading as plain JSON-safe data, bounded: at most MAX_THREADS threads (the GIL
        holder and the main thread among them; in the order read), MAX_FRAMES frames each,
        MAX_TEXT characters a string, MAX_WIRE_BYTES in all."""
        chosen: dict[int, dict[str, Any]] = {}
        size = 0
        for thread in ordered_threads(self)[:MAX_THREADS]:
            wire = _thread_wire(thread)
            size += len(json.dumps(wire))
            if chosen and size > MAX_WIRE_BYTES:
                break
            chosen[id(thread)] = wire
        kept = [chosen[id(thread)] for thread in self.threads if id(thread) in chosen]
        return {
            "pid": self.pid, "tool": _cut(self.tool), "native": self.native,
            "error": None if self.error is None else _cut(self.error),
            "note": None if self.note is None else _cut(self.note),
            "took_s": self.took_s, "t": self.t,
            "threads_cut": self.threads_cut + len(self.threads) - len(kept),
            "threads": kept,
        }

    @classmethod
    def from_wire(cls, wire: Any) -> StackReading:
        """The reading a peer sent (`to_wire`'s form), checked field by field and bounded
        again. Never raises: what does not fit the form gives a reading with an error that
        says which field was wrong."""
        try:
            return _reading_from_wire(wire)
        except _Malformed as bad:
            pid = wire.get("pid") if isinstance(wire, dict) else None
            return cls(pid=pid if _is_int(pid) else -1, tool="?", native=False,
                       error=f"a malformed stack reading arrived: {bad}")


def gil_holder(reading: StackReading) -> ThreadStack | None:
    """The thread that held the GIL when the stacks were read, or None (no thread held it:
    all were waiting outside Python, or the interpreter has no GIL)."""
    return next((thread for thread in reading.threads if thread.owns_gil), None)


def main_thread(reading: StackReading) -> ThreadStack | None:
    """The process's main thread: the one named MainThread, else the one whose kernel id is
    the process's pid; None where neither is among the threads."""
    for thread in reading.threads:
        if thread.name == "MainThread":
            return thread
    return next((t for t in reading.threads if t.os_thread_id == reading.pid), None)


def ordered_threads(reading: StackReading) -> list[ThreadStack]:
    """The threads, the GIL holder first, then the main thread, then the others in the order
    read."""
    first = [t for t in (gil_holder(reading), main_thread(reading)) if t is not None]
    first = list(dict.fromkeys(first))  # the holder may be the main thread
    return first + [t for t in reading.threads if t not in first]


def bounded_frames(thread: ThreadStack) -> ThreadStack:
    """The thread with at most MAX_FRAMES frames: the innermost and the KEEP_OUTER outermost
    kept, the middle cut and counted."""
    if len(thread.frames) <= MAX_FRAMES:
        return thread
    inner = thread.frames[: MAX_FRAMES - KEEP_OUTER]
    outer = thread.frames[-KEEP_OUTER:]
    return replace(thread, frames=inner + outer,
                   frames_cut=thread.frames_cut + len(thread.frames) - MAX_FRAMES)


class _Malformed(ValueError):
    """A field of a peer's reading does not fit the form."""


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"


def _frame_wire(frame: Frame) -> dict[str, Any]:
    return {"name": _cut(frame.name), "file": _cut(frame.file), "line": frame.line,
            "native": frame.native,
            "library": None if frame.library is None else _cut(frame.library)}


def _thread_wire(thread: ThreadStack) -> dict[str, Any]:
    thread = bounded_frames(thread)
    return {"thread_id": thread.thread_id,
            "name": None if thread.name is None else _cut(thread.name),
            "os_thread_id": thread.os_thread_id, "active": thread.active,
            "owns_gil": thread.owns_gil, "frames_cut": thread.frames_cut,
            "frames": [_frame_wire(frame) for frame in thread.frames]}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _get(wire: dict[str, Any], key: str, kinds: tuple[type, ...], where: str,
         optional: bool = False) -> Any:
    """`wire[key]` checked for its type (bool is no int here)."""
    value = wire.get(key)
    if value is None and optional:
        return None
    wrong = ((isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds)
             or (isinstance(value, float) and not math.isfinite(value)))
    if wrong:
        shown = repr(value) if value is None or isinstance(value, bool | float) else \
            type(value).__name__
        raise _Malformed(f"{where}{key} is {'missing' if key not in wire else shown}")
    if isinstance(value, str):
        return _cut(value)
    return value


def _count(wire: dict[str, Any], key: str, where: str) -> int:
    value = _get(wire, key, (int,), where, optional=True)
    if value is not None and value < 0:
        raise _Malformed(f"{where}{key} is {value}")
    return value or 0


def _seconds(wire: dict[str, Any], key: str) -> float:
    value = _get(wire, key, (int, float), "", optional=True) or 0
    try:
        return float(value)
    except OverflowError:  # an int past float's range
        raise _Malformed(f"{key} is out of range") from None


def _frame_from_wire(wire: Any, where: str) -> Frame:
    if not isinstance(wire, dict):
        raise _Malformed(f"{where}is not a map")
    return Frame(name=_get(wire, "name", (str,), where), file=_get(wire, "file", (str,), where),
                 line=_get(wire, "line", (int,), where),
                 native=_get(wire, "native", (bool,), where),
                 library=_get(wire, "library", (str,), where, optional=True))


def _thread_from_wire(wire: Any, where: str) -> ThreadStack:
    if not isinstance(wire, dict):
        raise _Malformed(f"{where}is not a map")
    frames = _get(wire, "frames", (list,), where)
    inner = frames[: MAX_FRAMES - KEEP_OUTER]
    outer = frames[max(len(inner), len(frames) - KEEP_OUTER):]
    return ThreadStack(
        thread_id=_get(wire, "thread_id", (int,), where),
        name=_get(wire, "name", (str,), where, optional=True),
        os_thread_id=_get(wire, "os_thread_id", (int,), where, optional=True),
        active=_get(wire, "active", (bool,), where),
        owns_gil=_get(wire, "owns_gil", (bool,), where),
        frames=tuple(_frame_from_wire(f, f"{where}frame {i}: ")
                     for i, f in enumerate(inner + outer)),
        frames_cut=_count(wire, "frames_cut", where) + len(frames) - len(inner) - len(outer))


def _reading_from_wire(wire: Any) -> StackReading:
    if not isinstance(wire, dict):
        raise _Malformed(f"it is {type(wire).__name__}, not a map")
    threads = _get(wire, "threads", (list,), "")
    kept = threads[:MAX_THREADS]
    return StackReading(
        pid=_get(wire, "pid", (int,), ""), tool=_get(wire, "tool", (str,), ""),
        native=_get(wire, "native", (bool,), ""),
        threads=tuple(_thread_from_wire(t, f"thread {i}: ") for i, t in enumerate(kept)),
        error=_get(wire, "error", (str,), "", optional=True),
        note=_get(wire, "note", (str,), "", optional=True),
        took_s=_seconds(wire, "took_s"), t=_seconds(wire, "t"),
        threads_cut=_count(wire, "threads_cut", "") + len(threads) - len(kept),
    )

