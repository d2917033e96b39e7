"""NCCL's debug log as the agent handles it: which subsystems a live NCCL_DEBUG toggle asks for,
where NCCL writes its lines, and what a toggle's first seconds of lines say.

NCCL reads NCCL_DEBUG, NCCL_DEBUG_SUBSYS and NCCL_DEBUG_FILE once, at its first log call
(`ncclDebugInit` in src/debug.cc), and again only after `ncclResetDebugInit()`. A new
communicator does not read them again. Its default subsystems (INIT,BOOTSTRAP,ENV) log at
communicator creation and destruction only, so turning NCCL_DEBUG=INFO on in a running job
prints nothing; COLL prints a line per collective. The live toggle therefore asks for
`LIVE_SUBSYS` (NCCL's defaults plus COLL) when the user set no NCCL_DEBUG_SUBSYS.

This module does no I/O on its own beyond reading the hostname; torch is not imported.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

VERBOSE = ("INFO", "TRACE")
"""NCCL_DEBUG levels that print INFO lines (the ones a person turns on to see something)."""
DEFAULT_SUBSYS = "INIT,BOOTSTRAP,ENV"
"""NCCL's subsystems when NCCL_DEBUG_SUBSYS is unset (src/debug.cc)."""
LIVE_SUBSYS = DEFAULT_SUBSYS + ",COLL"
"""What a live NCCL_DEBUG toggle sets NCCL_DEBUG_SUBSYS to when the user set none."""
RUNNING_SUBSYS = frozenset({"COLL", "P2P", "ALL"})
"""Subsystems that print lines for a communicator that already runs (per collective, per
peer-to-peer connection)."""
PROBE_S = 3.0
"""After a toggle that turns NCCL's lines on, the agent counts the lines of this many seconds
and reports the count (a follow-up `toggle_result` with `log_lines`)."""


def verbose(level: str | None) -> bool:
    """True when NCCL_DEBUG=`level` prints INFO lines."""
    return (level or "").strip().upper() in VERBOSE


def prints_when_running(subsys: str | None) -> bool:
    """True when NCCL_DEBUG_SUBSYS=`subsys` (None: NCCL's default) includes a subsystem that logs
    for a communicator that is already running. A leading `^` excludes the listed ones."""
    words = [w.strip().upper() for w in (subsys or DEFAULT_SUBSYS).split(",") if w.strip()]
    if words and words[0].startswith("^"):
        excluded = {words[0][1:], *words[1:]}
        return "ALL" not in excluded and not {"COLL", "P2P"} <= excluded
    return bool(RUNNING_SUBSYS & set(words))


def opens_file(level: str | None) -> bool:
    """True when NCCL_DEBUG=`level` makes NCCL open NCCL_DEBUG_FILE (above VERSION: WARN, INFO,
    ABORT, TRACE; src/debug.cc, ncclDebugInit). It opens it with mode "w" every time it reads
    its settings, so after each `ncclResetDebugInit()` the file starts empty."""
    return (level or "").strip().upper() in ("WARN", "INFO", "ABORT", "TRACE")


def short_hostname() -> str:
    """The hostname as NCCL writes it into file names and lines (`%h`): gethostname() up to the
    first dot (getHostName, src/misc/utils.cc), `%` and `/` replaced by `-` as NCCL 2.29 on does
    (getHostNameForLog, src/debug.cc; 2.28 keeps them, which no usable host name has)."""
    return socket.gethostname().split(".", 1)[0].replace("%", "-").replace("/", "-")


def expand_debug_file(template: str, pid: int | None = None, host: str | None = None) -> Path:
    """NCCL_DEBUG_FILE as NCCL opens it: `%h` the hostname, `%p` the pid, `%%` a percent sign;
    any other `%x` is kept."""
    pid = os.getpid() if pid is None else pid
    out: list[str] = []
    i = 0
    while i < len(template):
        ch = template[i]
        if ch != "%" or i + 1 >= len(template):
            out.append(ch)
            i += 1
            continue
        code = template[i + 1]
        out.append({"%": "%", "h": host if host is not None else short_hostname(),
                    "p": str(pid)}.get(code, "%" + code))
        i += 2
    return Path("".join(out))


def followable(path: Path) -> bool:
    """False for a NCCL_DEBUG_FILE that is no log file of NCCL's own: the process's streams
    (/dev/stdout, /dev/stderr, /proc/self/fd/N: following them would send the job's whole
    output as NCCL lines) or an existing FIFO, socket or device."""
    if str(path).startswith(("/dev/", "/proc/")):
        return False
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return True  # NCCL creates it


def probe_text(lines: int, window_s: float, *, steps: int, level: str | None,
               subsys: str | None, nccl_loaded: bool, path: Path | None) -> str:
    """What a count of NCCL lines in the first `window_s` after a toggle means, in words. Never
    says lines arrived when `lines` is 0; when it is, says the likely why."""
    when = f"in the {window_s:g} s after it was applied"
    if lines > 0:
        where = f" (from {path})" if path is not None else ""
        return f"{lines} NCCL log line(s) {when}{where}"
    if not nccl_loaded:
        return f"no NCCL log line {when}: NCCL is not loaded in this process (no NCCL job)"
    if path is None:
        return (f"no NCCL log line {when}: NCCL writes to a file the agent cannot follow "
                "(NCCL_DEBUG_FILE)")
    if not verbose(level):
        return f"no NCCL log line {when}: NCCL_DEBUG={level or 'unset'} prints no INFO lines"
    if not prints_when_running(subsys):
        return (f"no NCCL log line {when}: NCCL_DEBUG_SUBSYS={subsys or DEFAULT_SUBSYS} prints "
                "nothing for a communicator that is already running (add COLL for a line per "
                "collective; new communicators print INIT lines)")
    if steps <= 0:
        return (f"no NCCL log line {when}: no step finished since, so likely no collective ran "
                "(the job is slow, idle or hung); NCCL prints at its next collective")
    return (f"no NCCL log line {when} although {steps} step(s) ran: NCCL may have kept the "
            f"settings it read before, or runs no collective here; see {path}")
