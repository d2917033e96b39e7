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

A live view shows a rank's figure only while it trains (`rank_figure_at`): a rank that is not
running (ended, stopped, restarting, frozen, gone) has none (None), and a running rank from which
no step came for `stale_after_s` (`STALE_S`, or `STALE_STEPS` of its last step times where that
is longer) has 0: a hung or stalled job reads 0 tokens/s, not the rate it had before. The
figure as of its last step stays available as `last` (`snapshot --json`'s
`last_tokens_per_s`); the summary, a history over steps, keeps its per-step figures.

The job's figure (`job_tokens_per_s`) is the sum of the ranks' figures over the ranks that
process tokens of their own (`counted`): a rank of a tensor-parallel group processes the same
tokens as its tp peers, and the stages of a pipeline pass the same tokens along, so the ranks
with the same coordinates on every mesh axis but `SHARED_TOKEN_AXES` (one tp group x pipeline:
a "token group") count once, with the figure of the member nearest coordinate 0 on those axes
that has one (a pipeline whose script logs tokens on its last stage only counts that stage's).
The coordinates are the ones the hub knows from the ranks' `mesh` info or the `mesh_<dim>`
process groups (`JobState.mesh`); every other axis (dp, ep, data shards and replicas) splits the
data, and a rank without a mesh is a data-parallel replica of its own. What adds up: where every
rank has a figure, the job's is the sum of the rows of the ranks at coordinate 0 of
`SHARED_TOKEN_AXES`; in a job without such axes that is every row.
"""

from __future__ import annotations

import contextlib
import math
from array import array
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

WINDOW_S = 10.0
"""A live view's window: a rank's latest steps whose wall times add up to at most this (its
latest step always)."""
WINDOW_STEPS = 1024
"""... and at most this many steps (very short steps)."""
SHARED_TOKEN_AXES = ("tp", "tensor", "mp", "model", "pp", "pipe", "pipeline")
"""Mesh axes (as the script names its mesh's dims) whose ranks process the same tokens: tensor
(model) parallel and pipeline stages; of each token group one member counts for the job."""
STALE_S = 5.0
"""A running rank's live figure is 0 once no step came from it for this long ..."""
STALE_STEPS = 3.0
"""... or for this many of its last step times, where that is longer (slow steps keep it)."""
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


class TokenWindow:
    """A rank's latest steps for its live `tokens_per_s` (`WINDOW_S`, `WINDOW_STEPS`)."""

    __slots__ = ("steps", "tokens", "seconds", "last_step_s")

    def __init__(self) -> None:
        self.steps: deque[tuple[int, float]] = deque()
        self.tokens = 0
        self.seconds = 0.0
        self.last_step_s: float | None = None
        """The wall time of the rank's latest step that had one (with tokens or not): how
        long a quiet spell is before its live figure is 0 (`stale_after_s`)."""

    def add(self, tokens: Any, step_time_s: Any) -> None:
        """One step as its message gives them. It is in the window with a non-negative int of
        tokens and a finite positive step time (a process's first step has no time); a step
        without tokens still has its step time as the rank's `last_step_s`."""
        if type(step_time_s) not in (int, float) or not 0 < step_time_s < math.inf:
            return
        seconds = self.last_step_s = float(step_time_s)
        if type(tokens) is not int or tokens < 0:
            return
        self.steps.append((tokens, seconds))
        self.tokens += tokens
        self.seconds += seconds
        while len(self.steps) > 1 and (self.seconds > WINDOW_S
                                       or len(self.steps) > WINDOW_STEPS):
            old_tokens, old_seconds = self.steps.popleft()
            self.tokens -= old_tokens
            self.seconds -= old_seconds
        if len(self.steps) == 1:  # no rounding carried from the steps that left
            self.seconds = self.steps[0][1]

    def __getstate__(self) -> tuple[Any, ...]:
        """Pickled as two arrays (a seed or checkpoint of 16,384 ranks holds up to
        `WINDOW_STEPS` steps of each: a tuple per step costs pickle several opcodes and a memo
        entry each way)."""
        tokens: Any = [t for t, _ in self.steps]
        with contextlib.suppress(OverflowError):  # beyond 64 bits: kept a list
            tokens = array("Q", tokens)
        return (tokens, array("d", [s for _, s in self.steps]), self.tokens, self.seconds,
                self.last_step_s)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            for name, value in state[1].items():  # the slots' form (checkpoints before)
                setattr(self, name, value)
            return
        tokens, seconds, self.tokens, self.seconds, self.last_step_s = state
        self.steps = deque(zip(list(tokens), seconds.tolist(), strict=True))

    def clear(self) -> None:
        """Forget every step (a new process of the rank)."""
        self.steps.clear()
        self.tokens, self.seconds, self.last_step_s = 0, 0.0, None

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


class Figure(NamedTuple):
    """A rank's or the job's tokens/s as a live view shows it."""

    live: float | None
    """Now (`rank_figure_at`): None where no rank trains with a figure, 0 after a quiet spell."""
    last: float | None
    """As of the latest steps, however old and whatever the rank's state since."""
    source: str | None
    """`STEPS` or `SCRIPT` (of `last`); None without a figure."""


def stale_after_s(last_step_s: float | None) -> float:
    """How long a running rank may send no step before its live figure is 0: `STALE_S`, or
    `STALE_STEPS` times its last step's wall time where that is longer."""
    return max(STALE_S, STALE_STEPS * last_step_s) if last_step_s else STALE_S


def rank_figure_at(view: Any, now: float) -> Figure:
    """The `Figure` of a `RankView` at wall time `now`: live, its `view_figure` while it is
    running and its latest step came within `stale_after_s`; 0 when it is running but none
    came for that long (hung, stalled); None when it does not run (ended, stopped,
    restarting, frozen, gone: no live rate) or has no figure."""
    last, source = view_figure(view)
    live = last
    if last is not None and view.state != "running":
        live = None
    elif last is not None and (view.last_step_t is None or now - view.last_step_t
                               > stale_after_s(view.token_window.last_step_s)):
        live = 0.0
    return Figure(live, last, source)


def token_group(coords: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """The key of a rank's token group: its coordinates on every axis but
    `SHARED_TOKEN_AXES`."""
    return tuple(sorted((axis, c) for axis, c in coords.items() if axis not in SHARED_TOKEN_AXES))


def token_place(coords: Mapping[str, int]) -> tuple[int, ...]:
    """A rank's place in its token group: the member with the least counts (`counted`)."""
    return tuple(coords.get(axis, 0) for axis in SHARED_TOKEN_AXES)


def counted(ranks: Iterable[tuple[Any, Mapping[str, int] | None]]) -> list[Any]:
    """The keys, of the (key, mesh coordinates) given (the ranks that have a figure), whose
    figures count for the job, in the order given: every rank without a mesh, and of each
    token group (`token_group`: a tp group x pipeline) the member nearest coordinate 0 on the
    `SHARED_TOKEN_AXES` (the first given on a tie)."""
    given = list(ranks)
    best: dict[tuple[tuple[str, int], ...], tuple[tuple[int, ...], int]] = {}
    keep = set()
    for i, (_, coords) in enumerate(given):
        if coords is None:
            keep.add(i)
            continue
        place = (token_place(coords), i)
        group = token_group(coords)
        if group not in best or place < best[group]:
            best[group] = place
    keep.update(i for _, i in best.values())
    return [key for i, (key, _) in enumerate(given) if i in keep]


def job_tokens_per_s(ranks: Iterable[tuple[float | None, Mapping[str, int] | None]]
                     ) -> float | None:
    """The job's tokens/s from each rank's (figure, mesh coordinates), in rank order: the sum
    of the `counted` figures of those with one; None when none has one."""
    rates = counted((rate, coords) for rate, coords in ranks if rate is not None)
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


def job_figure(ranks: Iterable[tuple[float | None, str | None, Mapping[str, int] | None]]
               ) -> tuple[float | None, str | None]:
    """(`job_tokens_per_s`, `job_source` of the `counted` ranks) of the ranks' (figure,
    source, mesh coordinates), in rank order."""
    given = [(rate, source, coords) for rate, source, coords in ranks if rate is not None]
    kept = counted(((rate, source), coords) for rate, source, coords in given)
    if not kept:
        return None, None
    return math.fsum(rate for rate, _ in kept), job_source(source for _, source in kept)


def state_figure(state: Any, now: float) -> Figure:
    """The job's `Figure` of a `JobState` at wall time `now`: live, `job_figure` of its ranks'
    live figures (`rank_figure_at`: running ranks, 0 after a quiet spell; None where no rank
    trains); last, of their last figures (an ended job's last rate); with their mesh
    coordinates (`JobState.mesh`)."""
    ranks = [(rank_figure_at(state.ranks[r], now), state.mesh(r)) for r in sorted(state.ranks)]
    live, live_source = job_figure((f.live, f.source, coords) for f, coords in ranks)
    last, last_source = job_figure((f.last, f.source, coords) for f, coords in ranks)
    return Figure(live, last, live_source or last_source)
