"""A hang kept past the end of the job: the ranks as they stood when the hung job's first rank
ended abnormally (killed, failed, gone) or its user stopped it.

Whether a job hangs is judged from its ranks at a time (`reports.hangs`); once the ranks end,
the hang can no longer be told from them. So the reducer keeps a copy of the rank views at that
moment (`JobState.hang_end`), and `reports.hangs.last_hang` tells the hang from the copy: its
culprit, where the ranks waited, for how long, and how the job ended.

Only an end that cuts the job short keeps it (`note`): a rank ended by a signal, an exception or
a non-zero exit code, a rank found vanished after it was heard from past the hang threshold, or
the user's stop; a script that just exits after a long final save does not. The copy is kept
once per attempt of the job and dropped (`forget`) when the job shows it was not hung: a step
that ends within the threshold before that moment or after it, the vanished rank that kept it
speaking again, or a new attempt or run of the job.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from scalemon.state.failures import SIGNAL_REASON

if TYPE_CHECKING:
    from scalemon.state.jobstate import JobState, RankView


def hang_end(st: JobState, t: float, by: int | None = None) -> dict[str, Any]:
    """{"t": when it ended, "last_step_t", "step": the last step completed, "by": the rank
    found vanished that ended it (None: an exit or the user's stop), "ranks": rank -> a copy
    of its view}: the hung job `st` at `t`."""
    views = {r: _kept(v) for r, v in st.ranks.items()}
    steps = [v.step for v in views.values() if v.step is not None]
    return {"t": t, "last_step_t": st.last_step_t, "step": max(steps) if steps else None,
            "by": by, "ranks": views}


def abnormal_exit(body: Mapping[str, Any]) -> bool:
    """True for an `exit` body that cuts a job short: ended by a signal or an exception, or a
    non-zero exit code. `finish()` (code 0) and a plain interpreter exit (code None) are not."""
    return (body.get("reason") in (SIGNAL_REASON, "exception")
            or body.get("exit_code") not in (0, None))


def note(st: JobState, t: float, alive_t: float | None = None, by: int | None = None) -> None:
    """Keep the hang `st` is in as a rank ends abnormally at `t` (or its user stops it), where
    the rank was still alive (`alive_t`, else `t`) after the hang began: once, cheap checks
    first. `by`: the rank found vanished (`forget` drops the copy if it speaks again)."""
    if (st.hang_end is None and st.stop is None and st.last_step_t is not None
            and (t if alive_t is None else alive_t) - st.last_step_t >= st.hang_after_s
            and st.hang_possible()):
        st.hang_end = hang_end(st, t, by)


def forget(st: JobState, rank: int, step_t: float | None = None) -> None:
    """Drop the kept hang that news of `rank` shows was none: a step of it ending at `step_t`
    less than the hang threshold before the kept end or after it (the job still ran), or, with
    no `step_t`, `rank` speaking again after the hub took it for vanished, which kept it."""
    end = st.hang_end
    if end is None:
        return
    if (end["t"] - step_t < st.hang_after_s) if step_t is not None else end["by"] == rank:
        st.hang_end = None


def _kept(view: RankView) -> RankView:
    """A copy of `view` that later messages leave as it is (the fields they replace in place
    are copied; the counters a hang does not read are shared)."""
    kept = copy.copy(view)
    kept.metrics = dict(view.metrics)
    kept.extra = dict(view.extra)
    kept.alerts = dict(view.alerts)
    return kept
