"""A process's stacks in words: `where_text`, the one line a hang report shows for a rank that
stopped speaking, and `format_stacks`, every thread for a person to read.

The words say only what the reading shows. One reading cannot tell a frozen thread from a
slow one (that is the hang report's judgement, from how long the rank has been silent); it
can tell which thread held the GIL, whether the thread was in native code above its innermost
Python frame, and in which C function. Text from the process (function and file names) is
made safe for a terminal (`scalemon.text.safe.clean`).
"""

from __future__ import annotations

import os
import re

from scalemon.text.safe import clean

from .frames import Frame, StackReading, ThreadStack, gil_holder, main_thread, ordered_threads

NATIVE_SHOWN = 3
"""Native frames named in `where_text` (the innermost two and the one Python called, when
there are more)."""
NAME_CHARS = 80
"""Characters of one function's name in `where_text` (C++ names run long)."""
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+$")
# How Python calls C, not what it called: the interpreter's call and eval machinery, ctypes and
# libffi. Left out of where_text's chain (format_stacks shows them).
_GLUE_NAME = re.compile(
    r"(_?Py[A-Z_]|_PyEval|_Py_|cfunction_|method_vectorcall|vectorcall|slot_tp_|call_function|"
    r"do_call_core|_call_function_pointer|_ctypes_|ffi_|PyCFuncPtr_)")
_GLUE_LIBRARY = re.compile(r"(^|/)(libffi[^/]*|_ctypes[^/]*)$")
_GLUE_FILE = {"callproc.c", "_ctypes.c", "ceval.c", "call.c", "methodobject.c"}


def where_text(reading: StackReading) -> str:
    """Where the process is, in one line, from its GIL holder's stack (else its main
    thread's): "in native code holding the GIL: clock_nanosleep <- nanosleep <- sleep <-
    freeze_holding_the_gil() at faults.py:9"; "in native code (GIL released):
    clock_nanosleep <- time_sleep <- wait() at train.py:42"; with Python frames only,
    "holding the GIL in f() at x.py:3 (native frames not read)"."""
    if reading.error:
        return f"stacks not read: {clean(reading.error, one_line=True)}"
    thread = gil_holder(reading) or main_thread(reading) or next(iter(reading.threads), None)
    if thread is None:
        return "no Python thread found in the process"
    holds = thread.owns_gil
    python = next((f for f in thread.frames if not f.native), None)
    native = _called_natives(thread) if reading.native else []
    at = _python_text(python) if python is not None else None
    if not reading.native:
        gil = "holding the GIL" if holds else "GIL released"
        return (f"{gil} in {at} (native frames not read)" if at
                else f"{gil}, no Python frame (native frames not read)")
    if native:
        chain = " <- ".join([*native, *([at] if at else [])])
        return f"in native code {'holding the GIL' if holds else '(GIL released)'}: {chain}"
    if at is None:
        return f"{_thread_title(thread)} has no frames"
    return f"in Python {'holding the GIL' if holds else '(no thread holds the GIL)'}: {at}"


def format_stacks(reading: StackReading, native: bool = True) -> str:
    """Every thread of the reading, the GIL holder first, then the main thread: a header
    line per thread (name, ids, active or idle, whether it holds the GIL), then its frames
    innermost first, native ones marked [native] (left out when `native` is False)."""
    head = f"process {reading.pid}: stacks read by {clean(reading.tool, one_line=True)}"
    if reading.error:
        return f"{head}: not read: {clean(reading.error, one_line=True)}"
    lines = [f"{head} in {reading.took_s:.2f} s"
             + ("" if reading.native else ", Python frames only")]
    if reading.note:
        lines.append(f"note: {clean(reading.note, one_line=True)}")
    for thread in ordered_threads(reading):
        lines.append("")
        lines.append(_thread_header(thread))
        frames = [f for f in thread.frames if native or not f.native]
        lines.extend(f"    {_frame_line(frame)}" for frame in frames)
        if not frames:
            lines.append("    (no frames)")
        if thread.frames_cut:
            lines.append(f"    ({thread.frames_cut} frames in the middle not kept)")
    if reading.threads_cut:
        lines.append(f"\n({reading.threads_cut} more threads not kept)")
    return "\n".join(lines)


def is_glue(frame: Frame) -> bool:
    """Whether a native frame is only how Python called C (the interpreter's call machinery,
    ctypes, libffi) or unnamed (an address)."""
    base = os.path.basename(frame.file)
    return bool(_ADDRESS.match(frame.name) or _GLUE_NAME.match(frame.name)
                or _GLUE_LIBRARY.search(frame.library or "") or base in _GLUE_FILE)


def _called_natives(thread: ThreadStack) -> list[str]:
    """The names of the native frames above the innermost Python frame that are not glue,
    innermost first: all when few, else the innermost NATIVE_SHOWN - 1, "...", and the
    outermost (the C function Python called)."""
    above: list[str] = []
    for frame in thread.frames:
        if not frame.native:
            break
        if not is_glue(frame):
            above.append(_short(frame.name))
    if len(above) <= NATIVE_SHOWN:
        return above
    return [*above[: NATIVE_SHOWN - 1], "...", above[-1]]


def _short(name: str) -> str:
    name = clean(name, one_line=True)
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 1] + "…"


def _python_text(frame: Frame) -> str:
    call = _short(frame.name) if frame.name.startswith("<") else f"{_short(frame.name)}()"
    base = clean(os.path.basename(frame.file) or frame.file, one_line=True)
    return f"{call} at {base}:{frame.line}"


def _thread_title(thread: ThreadStack) -> str:
    name = clean(thread.name, one_line=True) if thread.name else "thread"
    return f"{name} (os id {thread.os_thread_id})" if thread.os_thread_id else name


def _thread_header(thread: ThreadStack) -> str:
    gil = ", holds the GIL" if thread.owns_gil else ""
    return (f"{_thread_title(thread)}, python id {thread.thread_id:#x}, "
            f"{'active' if thread.active else 'idle'}{gil}")


def _frame_line(frame: Frame) -> str:
    name = clean(frame.name, one_line=True)
    if frame.native:
        where = clean(os.path.basename(frame.library or frame.file), one_line=True)
        line = f":{frame.line}" if frame.line else ""
        source = "" if frame.file == frame.library else \
            f" {clean(os.path.basename(frame.file), one_line=True)}{line}"
        return f"[native] {name} ({where}{source})"
    return f"{name} ({clean(frame.file, one_line=True)}:{frame.line})"
