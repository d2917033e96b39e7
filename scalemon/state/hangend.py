"""A hang kept past the end of the job: the ranks as they stood when the hung job's first rank
ended (killed, gone) or its user stopped it.

Whether a job hangs is judged from its ranks at a time (`reports.hangs`); once the ranks end,
the hang can no longer be told from them. So the reducer keeps a copy of the rank views at that
moment (`JobState.hang_end`, once per run of the job), and `reports.hangs.last_hang` tells the
hang from the copy: its culprit, where the ranks waited, for how long, and how the job ended.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scalemon.state.jobstate import JobState, RankView


def hang_end(st: JobState, t: float) -> dict[str, Any]:
    """{"t": when it ended, "last_step_t", "step": the last step completed, "ranks": rank ->
    a copy of its view}: the hung job `st` at `t`."""
    views = {r: _kept(v) for r, v in st.ranks.items()}
    steps = [v.step for v in views.values() if v.step is not None]
    return {"t": t, "last_step_t": st.last_step_t, "step": max(steps) if steps else None,
            "ranks": views}


def _kept(view: RankView) -> RankView:
    """A copy of `view` that later messages leave as it is (the fields they replace in place
    are copied; the counters a hang does not read are shared)."""
    kept = copy.copy(view)
    kept.metrics = dict(view.metrics)
    kept.extra = dict(view.extra)
    kept.alerts = dict(view.alerts)
    return kept
