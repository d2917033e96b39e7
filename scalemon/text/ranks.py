"""Ranks as text, one rule everywhere (hangs, failures, groups, dumps, dashboards): sorted, a
run of four or more consecutive ranks as a range ("0-7"), a long list cut after `limit` parts
with a count of what was left out."""

from __future__ import annotations

from collections.abc import Iterable

RUN_AT = 4
"""Consecutive ranks from this many on read as a range: "0-7"; fewer are listed: "0,1,2"."""


def rank_parts(ranks: Iterable[int]) -> list[str]:
    """The ranks, sorted, as parts: single ranks, and runs of `RUN_AT` or more as "a-b"."""
    parts: list[str] = []
    run: list[int] = []
    for r in sorted(ranks):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        parts.extend(_run_text(run))
        run = [r]
    parts.extend(_run_text(run))
    return parts


def _run_text(run: list[int]) -> list[str]:
    if len(run) >= RUN_AT:
        return [f"{run[0]}-{run[-1]}"]
    return [str(r) for r in run]


def rank_list(ranks: Iterable[int], limit: int | None = None) -> str:
    """"0,2,3", "0-7,9"; with `limit`, at most that many parts, then " (+N more)"."""
    parts = rank_parts(ranks)
    if limit is not None and len(parts) > limit:
        return ",".join(parts[:limit]) + f" (+{len(parts) - limit} more)"
    return ",".join(parts)


def ranks_text(ranks: Iterable[int], limit: int | None = None) -> str:
    """"rank 1", "ranks 0,2,3", "ranks 0-7,9"; "no rank" for none."""
    ranks = list(ranks)
    if not ranks:
        return "no rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + rank_list(ranks, limit)


def span_text(ranks: Iterable[int]) -> str:
    """Ranks in brackets: "[0,1]", "[0-7,9]" (a group's members)."""
    return "[" + rank_list(ranks) + "]"
