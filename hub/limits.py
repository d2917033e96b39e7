"""What the hub keeps of what peers send, bounded: refusals counted by the hub's own reason
classes (a fixed set, never the sender's text), the latest few refusals' details (truncated),
peers' names capped, the process's open-file limit raised to its hard limit, and the helper
processes it starts niced."""

from __future__ import annotations

import logging
import re
import resource
import shutil
import time
from collections import Counter, deque
from typing import Any

from scalemon.protocol import ProtocolError, VersionMismatch

log = logging.getLogger("scalemon.hub")

MAX_NAME_CHARS = 256
"""Node names, users, hosts and other names a peer gives the hub (a host name is at most 253)."""
DETAIL_CHARS = 200
"""A refusal's text is kept this long in `reject_recent`."""
RECENT_REJECTS = 16
"""`reject_recent` holds this many of the latest refusals."""

_CLASSES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern)) for name, pattern in (
        ("over a size limit", r"\S+ (is|has) over the hub's limit"),
        ("frame too big", r"frame of \d+ bytes exceeds"),
        ("not bytes", r"frame is "),
        ("not msgpack", r"not msgpack"),
        ("undecodable frame", r"undecodable frame"),
        ("bad version field", r"bad protocol version field"),
        ("not a map", r"(message is a |'body' is |request is not a map|reply is not a map)"),
        ("bad header field", r"header field "),
        ("unknown message type", r"unknown message type"),
        ("missing field", r"\w+ message lacks required field"),
        ("hub-only message type", r"\w+ message from rank"),
        ("bad hello", r"hello[. ]"),
        ("wrong job", r"message for job "),
        ("rank reserved for the hub", r"rank -1 is reserved"),
        ("rank out of range", r"rank -?\d+ is (outside|beyond|negative)"),
        ("bad field", r"\w+\.\w+ (is|has|holds) "),
        ("unknown request", r"unknown request op"),
        ("bad request field", r"request \w+\.\w+ is "),
        ("refused by role", r"refused: "),
        ("not the rank's key", r"\w+ for rank -?\d+ from key "),
        ("unknown command", r"unknown command"),
    ))
REASON_CLASSES = ("other protocol major version", *(name for name, _ in _CLASSES), "other")
"""Every key `reject_reasons` can have."""


def reason_class(exc: ProtocolError) -> str:
    """The class of a refusal, one of REASON_CLASSES (whatever text the sender put in it)."""
    if isinstance(exc, VersionMismatch):
        return REASON_CLASSES[0]
    text = str(exc)
    for name, pattern in _CLASSES:
        if pattern.match(text):
            return name
    return "other"


class RejectBook:
    """Refusals: counts per reason class and the latest few, each text cut to DETAIL_CHARS."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_REJECTS)

    def add(self, exc: ProtocolError, size: int) -> str:
        """Count one refusal of a frame of `size` bytes; returns its class."""
        reason = reason_class(exc)
        self.counts[reason] += 1
        self.recent.append({"t": time.time(), "reason": reason, "bytes": size,
                            "detail": clip(str(exc), DETAIL_CHARS)})
        return reason


def clip(text: str, limit: int) -> str:
    """`text`, cut to at most `limit` characters (saying so)."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def check_name(what: str, value: str, limit: int = MAX_NAME_CHARS) -> str:
    """`value` when it is at most `limit` characters; else raises ProtocolError (a clean
    refusal for the peer, counted as "over a size limit")."""
    if len(value) > limit:
        raise ProtocolError(f"{what} has over the hub's limit of {limit} characters "
                            f"({len(value)}: {value[:40]!r}…)")
    return value


def raise_open_files_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, hard,
                        exc)
    elif soft == resource.RLIM_INFINITY or hard == resource.RLIM_INFINITY:
        soft = 1 << 20 if soft == resource.RLIM_INFINITY else soft
    return soft


def niced(cmd: list[str], niceness: int) -> list[str]:
    """`cmd` run at a lower CPU priority (`nice -n`, where the system has it): a helper
    process of the hub's takes what the hub's loop leaves."""
    nice = shutil.which("nice")
    return [nice, "-n", str(niceness), *cmd] if nice else cmd
