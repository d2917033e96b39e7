"""Tokens per second: the one definition every view shows (the dashboard's rank rows, header
and rank detail, `scalemon snapshot` and its `--json`, `scalemon summary`, the OpenMetrics
gauge and the demo trainer's printed line).

A rank's figure is `tokens_per_s`: the tokens of the steps in a window over the wall time from
the end of the step before the window to the end of the window's last step. The agent's
`step_time_s` is the wall time between two consecutive `log()` calls (step ends), so that time
is the sum of the window's `step_time_s`; a step whose message was lost leaves both its tokens
and its time out, and a process's first step (no step before it) is not in any window. The
live views' window (`TokenWindow`) is a rank's latest steps that end within `WINDOW_S` of wall
time. Where the script passes a rate of its own (`log(tokens_per_s=...)`), that one is shown
instead, labelled as the script's (`SCRIPT`).

The job's figure (`job_tokens_per_s`) is the sum of the ranks' figures over the ranks that
process tokens of their own: a rank of a tensor-parallel group processes the same tokens as its
tp peers, and the stages of a pipeline pass the same tokens along, so of each tp group and each
pipeline only the rank at coordinate 0 of the mesh axes `SHARED_TOKEN_AXES` is counted (the
coordinates the hub knows from the ranks' `mesh` info or the `mesh_<dim>` process groups:
`JobState.mesh`); every other axis (dp, ep, data shards and replicas) splits the data, and a rank
without a mesh is a data-parallel replica of its own. The rows of the counted ranks add up to
the job's figure; in a job without tp or pp that is every row.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

WINDOW_S = 10.0
"""A live view's window: a rank's latest steps whose wall times add up to at most this (its
latest step always)."""
WINDOW_STEPS = 1024
"""... and at most this many steps (very short steps)."""
SHARED_TOKEN_AXES = ("tp", "pp")
"""Mesh axes whose ranks process the same tokens: only coordinate 0 of each counts for the
job."""
STEPS = "steps"
"""`source` of a figure made from the steps' `tokens` and `step_time_s` (the definition)."""
SCRIPT = "script"
"""`source` of a figure the script measured and passed itself (`log(tokens_per_s=...)`)."""
LABELS = {STEPS: "tokens/s", SCRIPT: "tokens/s (script)"}
"""How each source is labelled where the figure is shown."""


def tokens_per_s(tokens: float, seconds: float) -> float | None:
    """The definition: `tokens` of the steps in a window over `seconds`, the wall time from the
    end of the step before the window to the end of its last step; None without time."""
    return tokens / seconds if seconds > 0 else None


def step_of(tokens: Any, step_time_s: Any) -> tuple[int, float] | None:
    """(tokens, wall seconds) of one step that can be in a window: a non-negative int of
    tokens and a finite positive step time; else None (a process's first step has no time)."""
    if type(tokens) is not int or tokens < 0:
        return None
    if type(step_time_s) not in (int, float) or not 0 < step_time_s < math.inf:
        return None
    return tokens, float(step_time_s)


class TokenWindow:
    """A rank's latest steps for its live `tokens_per_s` (`WINDOW_S`, `WINDOW_STEPS`)."""

    __slots__ = ("steps", "tokens", "seconds")

    def __init__(self) -> None:
        self.steps: deque[tuple[int, float]] = deque()
        self.tokens = 0
        self.seconds = 0.0

    def add(self, tokens: Any, step_time_s: Any) -> None:
        """One step as its message gives them; a step `step_of` refuses is left out."""
        step = step_of(tokens, step_time_s)
        if step is None:
            return
        self.steps.append(step)
        self.tokens += step[0]
        self.seconds += step[1]
        while len(self.steps) > 1 and (self.seconds > WINDOW_S
                                       or len(self.steps) > WINDOW_STEPS):
            old_tokens, old_seconds = self.steps.popleft()
            self.tokens -= old_tokens
            self.seconds -= old_seconds
        if len(self.steps) == 1:  # no rounding carried from the steps that left
            self.seconds = self.steps[0][1]

    def clear(self) -> None:
        """Forget every step (a new process of the rank)."""
        self.steps.clear()
        self.tokens, self.seconds = 0, 0.0

    def rate(self) -> float | None:
        """The window's `tokens_per_s`; None before a step with tokens and a time."""
        return tokens_per_s(self.tokens, self.seconds) if self.steps else None


def rank_figure(extra: Mapping[str, Any], window_rate: float | None
                ) -> tuple[float | None, str | None]:
    """(figure, source) of one rank: the script's own rate where its `log()` extras carry one
    (`SCRIPT`), else the steps' (`STEPS`, `window_rate`); (None, None) without either."""
    own = extra.get("tokens_per_s")
    if type(own) in (int, float):
        return float(own), SCRIPT
    return (window_rate, STEPS) if window_rate is not None else (None, None)


def counts_for_job(coords: Mapping[str, int] | None) -> bool:
    """True for a rank whose tokens count for the job: at 0 on every `SHARED_TOKEN_AXES` axis
    of its mesh coordinates (None: no mesh, a replica of its own)."""
    return coords is None or all(coords.get(axis, 0) == 0 for axis in SHARED_TOKEN_AXES)


def job_tokens_per_s(ranks: Iterable[tuple[float | None, Mapping[str, int] | None]]
                     ) -> float | None:
    """The job's tokens/s from each rank's (figure, mesh coordinates): the sum over the ranks
    that `counts_for_job`, of those with a figure; None when none has one."""
    rates = [rate for rate, coords in ranks if rate is not None and counts_for_job(coords)]
    return math.fsum(rates) if rates else None


def job_source(sources: Iterable[str | None]) -> str | None:
    """The job figure's source: `SCRIPT` when any rank's figure is the script's, else
    `STEPS` when one has a figure; None without."""
    found = {s for s in sources if s is not None}
    return SCRIPT if SCRIPT in found else (STEPS if found else None)


def view_figure(view: Any) -> tuple[float | None, str | None]:
    """(figure, source) of a `RankView`: the script's rate, else its window's as the state
    folded it (`RankView.derived`)."""
    return rank_figure(view.extra, view.derived.get("tokens_per_s"))


def state_figure(state: Any) -> tuple[float | None, str | None]:
    """(the job's tokens/s, its source) of a `JobState`: `job_tokens_per_s` of its ranks'
    `view_figure`s with their mesh coordinates (`JobState.mesh`)."""
    figures = [(*view_figure(view), state.mesh(rank)) for rank, view in state.ranks.items()]
    return (job_tokens_per_s((rate, coords) for rate, _, coords in figures),
            job_source(source for _, source, coords in figures if counts_for_job(coords)))
