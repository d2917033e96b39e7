"""What the log screen draws, built from `DashboardData` under its lock: the newest lines of
NCCL's debug files and torch's stderr that the agents stream, filtered by a one-line query.

The query is words separated by spaces: `rank:1` or `rank:0,2-3`, `src:nccl` / `src:stderr`
/ `src:all`, `sub:WORD` (a word of the part after `NCCL ` in NCCL's lines: a level such as
INFO or WARN, a subsystem or a word like AllReduce or Channel; the whole line elsewhere),
and any other words: text the line must hold (case-insensitive).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from scalemon.flags import FLAGS
from scalemon.state.flagstate import LogLine

from ..model import DashboardData

SHOWN_MAX = 1000
"""Matching lines drawn at most (the newest)."""
SOURCES = ("nccl", "stderr")
EMPTY_HELP = ("no log lines yet: toggle NCCL_DEBUG=INFO (f) — lines appear here as the ranks "
              "write them")
GLOO_FLAGS = (("TORCH_DISTRIBUTED_DEBUG", "DETAIL"), ("TORCH_CPP_LOG_LEVEL", "INFO"))
"""What makes torch write about a gloo job's collectives (gloo has no log of its own)."""
GLOO_HELP = ("no log lines yet: this job's ranks use gloo, which writes no NCCL log; toggle "
             + " and ".join(f"{name}={value} (f: {FLAGS[name].tier})"
                            for name, value in GLOO_FLAGS)
             + " — torch's lines appear here as the ranks write them")
QUERY_HELP = "rank:0,2  src:nccl|stderr|all  sub:INFO|WARN|AllReduce|...  other words: text"
QUERY_HELPS = (QUERY_HELP, "rank:0,2  src:nccl|stderr  sub:INFO|WARN|...  other words: text",
               "rank:0,2  src:nccl  sub:INFO  words: text", "rank:  src:  sub:  text")
"""`QUERY_HELP`, then shorter for narrower terminals: each whole, never cut."""


@dataclass
class LogFilter:
    """What lines to show: None / "" for no condition."""

    ranks: set[int] | None = None
    source: str | None = None
    sub: str | None = None
    text: str = ""
    error: str = ""
    """What could not be read in the query (the rest still applies)."""

    def matches(self, line: LogLine) -> bool:
        """Whether `line` passes every condition."""
        if self.ranks is not None and line.rank not in self.ranks:
            return False
        if self.source is not None and line.source != self.source:
            return False
        if self.sub is not None and not self._sub_re.search(_after_nccl(line.text)):
            return False
        return not self.text or self.text in line.text.lower()

    @property
    def _sub_re(self) -> re.Pattern[str]:
        return _word_re(self.sub or "")


_WORD_RES: dict[str, re.Pattern[str]] = {}


def _word_re(word: str) -> re.Pattern[str]:
    found = _WORD_RES.get(word)
    if found is None:
        found = _WORD_RES[word] = re.compile(
            rf"(?<![A-Za-z0-9_]){re.escape(word)}(?![A-Za-z0-9_])", re.IGNORECASE)
    return found


def _after_nccl(text: str) -> str:
    """The part of an NCCL line after `NCCL ` (`INFO AllReduce: ...`); other lines whole."""
    _, sep, rest = text.partition("NCCL ")
    return rest if sep else text


def parse_filter(query: str) -> LogFilter:
    """The filter a query typed in the filter bar asks for (see the module's docstring)."""
    f = LogFilter()
    words: list[str] = []
    errors: list[str] = []
    for word in query.split():
        key, sep, value = word.partition(":")
        key = key.lower()
        if sep and key in ("rank", "ranks", "r"):
            try:
                f.ranks = parse_ranks(value)
            except ValueError:
                errors.append(f"rank:{value} is not a list of ranks like 1 or 0,2-3")
        elif sep and key in ("src", "source"):
            value = value.lower()
            if value in ("", "all"):
                f.source = None
            elif value in SOURCES:
                f.source = value
            else:
                errors.append(f"src:{value}: expected nccl, stderr or all")
        elif sep and key in ("sub", "level", "lvl"):
            f.sub = value or None
        else:
            words.append(word)
    f.text = " ".join(words).lower()
    f.error = "; ".join(errors)
    return f


def parse_ranks(text: str) -> set[int]:
    """`0,2-3` -> {0, 2, 3}; raises ValueError."""
    ranks: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.partition("-")
        if dash:
            lo, hi = int(first), int(last)
            if hi < lo or hi - lo > 100_000:
                raise ValueError(part)
            ranks.update(range(lo, hi + 1))
        else:
            ranks.add(int(part))
    return ranks


@dataclass
class LogView:
    """What the log screen draws."""

    lines: list[LogLine]  # the newest SHOWN_MAX matching lines, oldest first
    matched: int  # lines of those kept that match
    kept: int  # lines the reducer keeps
    total: int  # lines received since the job began
    dropped: dict[int, int] = field(default_factory=dict)  # rank -> lines its agent left out
    hint: str = EMPTY_HELP  # what to toggle for lines, while there are none: by the backend


def log_view(data: DashboardData, f: LogFilter) -> LogView:
    """The lines that pass `f`, and the counts."""
    with data.lock:
        flags = data.state.flags
        kept = list(flags.log)
        total = flags.log_total
        dropped = {r: v.log_dropped for r, v in flags.ranks.items() if v.log_dropped}
        backends = [v.backend for v in data.state.ranks.values()]
    matching = [line for line in kept if f.matches(line)]
    return LogView(matching[-SHOWN_MAX:], len(matching), len(kept), total, dropped,
                   empty_help(backends))


def empty_help(backends: list[str | None]) -> str:
    """What to toggle for log lines, given the ranks' backends ("nccl", "gloo",
    "cpu:gloo,cuda:nccl"; None: not said): the NCCL hint unless every rank said it has no
    NCCL, the gloo one then."""
    if backends and all(b is not None and "nccl" not in b.lower() for b in backends):
        return GLOO_HELP
    return EMPTY_HELP
