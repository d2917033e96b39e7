"""The flags a person may change in a running job, and when each change takes effect.

One table, imported by the agent (which applies changes), the hub (which refuses bad ones before
any rank sees them) and the dashboard (which shows the tiers). Tiers, as read from the NCCL
2.28/2.29 and torch 2.11-2.13 sources (see docs/flags.md):

- **live**: the running process picks the new value up (environment re-read, or a torch call).
- **new communicator**: read when a communicator is created; the demo trainer moves its work
  to a new group at the step boundary, other scripts get it for groups created afterwards.
- **restart**: read once per process; the job checkpoints, its workers exit and torchrun starts
  them again with the new value in their environment from the start.

Values are strings as in the environment; the empty string unsets a variable. Anything not in
the table, and any value its check refuses, raises `FlagError` naming what was wrong.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from scalemon.options import did_you_mean

LIVE = "live"
NEW_COMMUNICATOR = "new communicator"
RESTART = "restart"
TIERS = (LIVE, NEW_COMMUNICATOR, RESTART)

PG_TIMEOUT = "pg_timeout_s"
"""Not an environment variable: the timeout of the job's process groups, in seconds."""

RESTART_EXIT_CODE = 75
"""Exit code of a worker that stops so torchrun restarts it with new flags (EX_TEMPFAIL)."""

MAX_VALUE_CHARS = 200


class FlagError(ValueError):
    """A flag or value scalemon does not change; the text says what was wrong."""


@dataclass(frozen=True)
class Flag:
    """One flag of the panel."""

    name: str
    tier: str
    why: str
    """One line: why the flag has its tier."""
    check: Callable[[str], str | None]
    """Returns what is wrong with a (non-empty) value, or None."""
    hint: str
    """The values it takes, for error messages and the panel."""
    unsettable: bool = True
    """Whether the empty value (unset the variable) is accepted."""


def _choice(*values: str) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        return None if value in values else f"expected one of {', '.join(values)}"

    return check


def _int_range(low: int, high: int) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        if not re.fullmatch(r"[0-9]+", value):
            return "expected a whole number"
        return None if low <= int(value) <= high else f"expected {low} .. {high}"

    return check


def _names(known: tuple[str, ...], per_collective: bool) -> Callable[[str], str | None]:
    """NCCL's list syntax: `A,B`, `^A` (all but), and for NCCL_ALGO/PROTO per collective
    `allreduce:tree,ring;broadcast:ring`."""
    lower = {k.lower() for k in known}
    collectives = {"allreduce", "broadcast", "reduce", "allgather", "reducescatter"}

    def names_ok(text: str) -> str | None:
        body = text[1:] if text.startswith("^") else text
        for name in body.split(","):
            if name.lower() not in lower:
                return f"{name!r} is not one of {', '.join(known)}"
        return None

    def check(value: str) -> str | None:
        parts = value.split(";") if per_collective else [value]
        for part in parts:
            if per_collective and ":" in part:
                func, _, part = part.partition(":")
                if func.lower() not in collectives:
                    return f"{func!r} is not a collective ({', '.join(sorted(collectives))})"
            problem = names_ok(part)
            if problem:
                return problem
        return None

    return check


def _interfaces(value: str) -> str | None:
    if re.fullmatch(r"[\^=]?[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*", value):
        return None
    return "expected interface name prefixes like eth0 or ^docker,lo (optionally = for exact)"


def _seconds(value: str) -> str | None:
    try:
        seconds = float(value)
    except ValueError:
        return "expected a number of seconds"
    return None if 1 <= seconds <= 7 * 24 * 3600 else "expected 1 .. 604800 seconds"


_SUBSYS = ("INIT", "COLL", "P2P", "SHM", "NET", "GRAPH", "TUNING", "ENV", "ALLOC", "CALL",
           "PROXY", "NVLS", "BOOTSTRAP", "REG", "PROFILE", "RAS", "ALL")
_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "NVLS", "NVLSTree", "PAT")
_PROTOS = ("LL", "LL128", "Simple")
_NO_CACHE_WHY = ("NCCL caches it at its first read unless the job was launched with "
                 "NCCL_NO_CACHE naming it (NCCL >= 2.29.7); then a new communicator reads it")

FLAGS: dict[str, Flag] = {f.name: f for f in (
    Flag("NCCL_DEBUG", LIVE, "NCCL re-reads it when scalemon calls ncclResetDebugInit()",
         _choice("VERSION", "WARN", "INFO", "TRACE"), "VERSION, WARN, INFO, TRACE"),
    Flag("NCCL_DEBUG_SUBSYS", LIVE, "re-read with NCCL_DEBUG by ncclResetDebugInit()",
         _names(_SUBSYS, False), "comma list of " + ",".join(_SUBSYS) + " (^ excludes)"),
    Flag("TORCH_DISTRIBUTED_DEBUG", LIVE,
         "set_debug_level() switches torch's checks now; DETAIL wraps groups created after it "
         "(the demo trainer makes new ones)", _choice("OFF", "INFO", "DETAIL"),
         "OFF, INFO, DETAIL"),
    Flag(PG_TIMEOUT, LIVE, "torch's _set_pg_timeout() applies to the groups' later operations",
         _seconds, "seconds (the process groups' timeout)", unsettable=False),
    Flag("TORCH_NCCL_ENABLE_TIMING", LIVE,
         "_enable_collectives_timing() turns timing on in running NCCL groups; it cannot be "
         "turned off again", _choice("1"), "1 (on; one-way)", unsettable=False),
    Flag("NCCL_ALGO", NEW_COMMUNICATOR, "read when a communicator is created (tuning.cc)",
         _names(_ALGOS, True), ",".join(_ALGOS) + " (^ excludes; per collective op:list;...)"),
    Flag("NCCL_PROTO", NEW_COMMUNICATOR, "read when a communicator is created (tuning.cc)",
         _names(_PROTOS, True), ",".join(_PROTOS) + " (^ excludes)"),
    Flag("TORCH_NCCL_ASYNC_ERROR_HANDLING", NEW_COMMUNICATOR,
         "read by the process group's constructor", _choice("0", "1", "2", "3"), "0, 1, 2, 3"),
    Flag("TORCH_NCCL_BLOCKING_WAIT", NEW_COMMUNICATOR, "read by the process group's constructor",
         _choice("0", "1"), "0, 1"),
    Flag("NCCL_BUFFSIZE", NEW_COMMUNICATOR, _NO_CACHE_WHY, _int_range(65536, 1 << 30),
         "bytes, 65536 .. 1073741824"),
    Flag("NCCL_MIN_NCHANNELS", NEW_COMMUNICATOR, _NO_CACHE_WHY, _int_range(1, 128), "1 .. 128"),
    Flag("NCCL_MAX_NCHANNELS", NEW_COMMUNICATOR, _NO_CACHE_WHY, _int_range(1, 128), "1 .. 128"),
    Flag("NCCL_P2P_DISABLE", RESTART, "read once when NCCL first builds its topology (paths.cc)",
         _choice("0", "1"), "0, 1"),
    Flag("NCCL_IB_DISABLE", RESTART, "read once when NCCL first loads its network plugins",
         _choice("0", "1"), "0, 1"),
    Flag("NCCL_SOCKET_IFNAME", RESTART, "read once at NCCL's first interface discovery",
         _interfaces, "interface prefixes: eth0, ^docker,lo, =ib0"),
    Flag("TORCH_FR_BUFFER_SIZE", RESTART, "the Flight Recorder's ring is sized at start",
         _int_range(0, 10_000_000), "entries, 0 .. 10000000 (0: off)"),
    Flag("TORCH_CPP_LOG_LEVEL", RESTART, "torch's C++ logging reads it once, at `import torch`",
         _choice("INFO", "WARNING", "ERROR", "FATAL"), "INFO, WARNING, ERROR, FATAL"),
)}

NCCL_NO_CACHE_FLAGS = ("NCCL_BUFFSIZE", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")
"""New-communicator flags only where NCCL_NO_CACHE names them; restart otherwise."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SHELL = re.compile(r"[;&|`$<>(){}\[\]\\'\"*?!#~\s]")


def check(name: str, value: str) -> Flag:
    """The flag `name` if `value` is acceptable for it; raises FlagError saying what is not."""
    flag = FLAGS.get(name)
    if flag is None:
        known = ", ".join(FLAGS)
        guess = did_you_mean(name, FLAGS, cutoff=0.8, fold=str.upper)
        if name.startswith(("NCCL_", "TORCH_")):
            raise FlagError(f"{name} is not among the flags scalemon can change (unknown or not "
                            f"safe to change in a running job){guess}; it changes: {known}")
        raise FlagError(f"{name} is not a flag scalemon changes{guess}: only these, with "
                        f"checked values: {known}")
    if value == "":
        if not flag.unsettable:
            raise FlagError(f"{name} cannot be unset; values: {flag.hint}")
        return flag
    if len(value) > MAX_VALUE_CHARS:
        raise FlagError(f"{name}: value of {len(value)} characters is longer than "
                        f"{MAX_VALUE_CHARS}")
    if _CONTROL.search(value):
        raise FlagError(f"{name}: the value holds a control character (newline, tab, ...); "
                        f"values: {flag.hint}")
    bad = _SHELL.findall(value.replace(";", "") if name in ("NCCL_ALGO", "NCCL_PROTO")
                         else value)
    if bad:
        chars = " ".join(sorted({repr(c) for c in bad}))
        raise FlagError(f"{name}={value!r}: the value holds characters no valid value has "
                        f"({chars}); values: {flag.hint}")
    problem = flag.check(value)
    if problem:
        raise FlagError(f"{name}={value!r}: {problem}")
    return flag


def parse_assignment(text: str) -> tuple[str, str]:
    """`NAME=VALUE` -> (name, value); raises FlagError for text without '='."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise FlagError(f"{text!r}: expected NAME=VALUE (NAME= unsets it)")
    return name, value


def tier_text(tier: str) -> str:
    """A tier as the panel shows it."""
    return {LIVE: "live", NEW_COMMUNICATOR: "new comm", RESTART: "restart"}.get(tier, tier)
