"""One look at a rank's process from outside: its facts twice (is its CPU time moving?) and its
stacks, every thread with native frames. The hub runs it for the ranks on its own host, a
node's relay for the ranks on its node (`hub/looks.py`, `relay/looks.py`); both send the same
wire form, so the hub records a relay's look as its own."""

from __future__ import annotations

import time
from typing import Any

from .facts import cpu_moving, process_facts
from .stacks import read_stacks, where_text

CPU_WINDOW_S = 0.25
"""How long apart the two readings of a process's CPU time are."""


def look_at(pid: int, native: bool = True, timeout_s: float = 10.0) -> dict[str, Any]:
    """What a silent rank's process is doing, as the wire carries it: {"pid", "process" (the
    facts, with `cpu_moving`), "reading" (its stacks; absent when the process is gone),
    "where" (where it is stuck, in words, or None)}. Never raises; blocks up to
    `timeout_s` + `CPU_WINDOW_S` (run it off the hub's loop)."""
    before = process_facts(pid)
    if before.exists:
        time.sleep(CPU_WINDOW_S)
    after = process_facts(pid)
    process = after.to_wire()
    process["cpu_moving"] = cpu_moving(before, after)
    look: dict[str, Any] = {"pid": pid, "process": process, "reading": None, "where": None}
    if not after.exists or after.state == "Z":
        return look
    reading = read_stacks(pid, native=native, timeout_s=timeout_s)
    look["reading"] = reading.to_wire()
    look["where"] = where_text(reading) if not reading.error else None
    return look

