"""The header's figures (`Summary`): the job's state in words (with the ranks that stopped
sending or exited, by word), steps, rates, what was lost on the way, the stragglers, the hub's
and the flags' notes, the first failure and the alerts.

Stragglers are named by how late each rank issues the collectives of its groups against the
first rank (`arrival_lateness_s`: a collective makes every rank's step equally long, so step
time cannot tell who is slow), or, before any collective was seen by every rank, by compute
time. A hung job (`reports.hangs.job_hang`) says so in the header's state.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from scalemon import policy, throughput
from scalemon.state.jobstate import JOB_ENDED_STATES
from scalemon.text import display
from scalemon.text.ranks import rank_list

from ..model import ConnState, DashboardData
from ..safe_text import clean
from .totals import RankTotals


@dataclass
class Summary:
    """The header's figures."""

    job: str | None
    world_size: int | None
    ranks_seen: int
    state: str  # JobState.state, "stalled" or "hung"
    state_text: str
    step_min: int | None
    step_max: int | None
    steps_per_s: float | None
    tokens_per_s: float | None
    """The job's live figure (`scalemon.throughput.state_figure`): the sum of the running
    ranks' rows' tok/s, a tp group's or a pipeline's ranks counted once (0 once no step came
    for a while: hung, stalled; None when no rank trains)."""
    elapsed_s: float | None
    dropped: int
    gaps: int
    rejected: int
    records: int
    stragglers: list[tuple[int, float]]  # (rank, seconds late or slower), largest first
    straggler_basis: str  # ARRIVAL_BASIS, COMPUTE_BASIS or ""
    conn: ConnState
    hub_note: str | None = None
    """The hub's last note (it repaired the history or skipped records), on the hub's line."""
    flag_note: str = ""  # a flag change under way, or flags that differ across ranks
    flag_style: str = ""
    failure: str = ""  # which rank failed first and why (JobState.first_failure), or ""
    alert: str = ""  # the job's training-health alerts (JobState.alerts), or ""
    tokens_label: str = throughput.LABELS[throughput.STEPS]
    """"tokens/s", or "tokens/s (script)" where a rank's figure is its script's own."""


def summary(data: DashboardData, now: float, totals: RankTotals) -> Summary:
    """The header's figures, its texts one line each, from the pass over the ranks `totals`
    (`views.totals`). Call under the lock."""
    return _one_line_texts(_summary(data, now, totals))


def _one_line_texts(s: Summary) -> Summary:
    """The summary with its texts (a job id, hang, hub and failure texts, flag values, the
    receiver's error) fit for the header: one line each, no control character (its segments
    go to the terminal as they are)."""
    texts = {f.name: clean(value, one_line=True) for f in dataclasses.fields(s)
             if isinstance(value := getattr(s, f.name), str)}
    conn = dataclasses.replace(s.conn, detail=clean(s.conn.detail, one_line=True))
    return dataclasses.replace(s, **texts, conn=conn)


def _waiting_text(data: DashboardData, now: float) -> str:
    """What the job does before any rank said a word: a job this dashboard launched (`scalemon
    demo`) is starting, its ranks importing torch; else the dashboard waits for ranks."""
    if data.launched_t is None:
        return "waiting for ranks: none has reported yet"
    took = max(0.0, now - data.launched_t)
    return (f"starting: the ranks import torch (torchrun launched {took:.0f} s ago; the first "
            "run takes ~10 s)...")


def _summary(data: DashboardData, now: float, t: RankTotals) -> Summary:
    st = data.state
    job_state = t.job_state
    state_text = job_state
    hang = t.hang
    hub_down = _hub_down_text(data, now)
    if job_state == "waiting":
        state_text = _waiting_text(data, now)
    elif job_state in ("stopped", "stopping"):
        state_text = st.stop_text() if job_state == "stopped" else "stopping: " + st.stop_text()
    elif hang is not None:
        job_state, state_text = "hung", f"HUNG (h: details): {hang['text']}"
    elif hub_down is not None and job_state not in JOB_ENDED_STATES:
        job_state, state_text = "hub down", hub_down
    elif job_state == "running" and t.step_max is None:  # started, not trained yet
        state_text = (f"starting: {t.ranks_seen} of {st.world_size or t.ranks_seen} ranks "
                      "connected, waiting for the first step")
    elif job_state in ("running", "degraded") and data.last_step_t is not None and t.running:
        quiet = now - data.last_step_t
        if quiet > policy.stuck_after_s(t.median_step):
            job_state, state_text = "stalled", f"stalled: no step for {quiet:.0f} s"
    said = [f"{word}: {rank_list(listed, limit=6)}" for word, listed in t.by_word.items()
            if listed]
    if said:  # "degraded, frozen: 1; gone: 2,3; exited: 0"
        state_text += ", " + "; ".join(said)
    ended = job_state in JOB_ENDED_STATES
    elapsed = None
    if st.started_t is not None:
        elapsed = ((st.last_t or now) if ended else now) - st.started_t
    tokens = t.tokens
    return Summary(
        job=st.job, world_size=st.world_size, ranks_seen=t.ranks_seen, state=job_state,
        state_text=state_text, step_min=t.step_min, step_max=t.step_max,
        steps_per_s=t.steps_per_s, tokens_per_s=tokens.live,
        elapsed_s=elapsed, dropped=t.dropped, gaps=t.gaps, rejected=data.rejected,
        records=data.records, stragglers=t.stragglers,
        straggler_basis=t.measure_basis, conn=data.conn,
        hub_note=st.hub_notes[-1]["text"] if st.hub_notes else None,
        flag_note=t.flag_note, flag_style=t.flag_style,
        failure=t.failure["text"] if t.failure else "",
        alert=t.alert, tokens_label=throughput.LABELS[tokens.source or throughput.STEPS],
    )


def _hub_down_text(data: DashboardData, now: float) -> str | None:
    """"hub down: no data since 14:02:11 (35 s ago)" when records stopped coming because the
    hub did (the receiver is not connected and had records before): the job may well be
    training. None while connected."""
    last_t = data.state.last_t
    if data.conn.status in ("connected", "connecting") or last_t is None:
        return None
    clock = time.strftime("%H:%M:%S", time.localtime(last_t))
    quiet = max(0.0, now - last_t)
    ago = f"{quiet:.0f} s" if quiet < 120 else display.duration(quiet)
    return f"hub down: no data since {clock} ({ago} ago)"
