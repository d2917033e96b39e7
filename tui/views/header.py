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
import statistics
import time
from dataclasses import dataclass
from typing import Any

from scalemon import policy, throughput
from scalemon.protocol import SILENT_RANK_STATES
from scalemon.reports import stragglers as straggler_rule
from scalemon.state.jobstate import JOB_ENDED_STATES
from scalemon.text import display
from scalemon.text.ranks import rank_list

from ..model import ConnState, DashboardData
from ..safe_text import clean
from .flags import header_note
from .hang import current_hang


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


def summary(data: DashboardData, now: float, median_step: float | None,
            failure: dict[str, Any] | None,
            measure: tuple[dict[int, float], str] | None = None) -> Summary:
    """The header's figures, its texts one line each; `median_step` (`median_step_s`),
    `failure` (`JobState.first_failure`) and the straggler `measure` (`straggler_measure`)
    as the rows use them. Call under the lock."""
    return _one_line_texts(_summary(data, now, median_step, failure, measure))


def _one_line_texts(s: Summary) -> Summary:
    """The summary with its texts (a job id, hang, hub and failure texts, flag values, the
    receiver's error) fit for the header: one line each, no control character (its segments
    go to the terminal as they are)."""
    texts = {f.name: clean(value, one_line=True) for f in dataclasses.fields(s)
             if isinstance(value := getattr(s, f.name), str)}
    conn = dataclasses.replace(s.conn, detail=clean(s.conn.detail, one_line=True))
    return dataclasses.replace(s, **texts, conn=conn)


def median_step_s(data: DashboardData) -> float | None:
    """The running ranks' median step time (`scalemon.reports.stragglers.median_step_s`)."""
    return straggler_rule.median_step_s(
        v.metrics["step_time_s"] for v in data.state.ranks.values() if v.state == "running")


def _waiting_text(data: DashboardData, now: float) -> str:
    """What the job does before any rank said a word: a job this dashboard launched (`scalemon
    demo`) is starting, its ranks importing torch; else the dashboard waits for ranks."""
    if data.launched_t is None:
        return "waiting for ranks: none has reported yet"
    took = max(0.0, now - data.launched_t)
    return (f"starting: the ranks import torch (torchrun launched {took:.0f} s ago; the first "
            "run takes ~10 s)...")


def _summary(data: DashboardData, now: float, median_step: float | None,
             failure: dict[str, Any] | None,
             measure: tuple[dict[int, float], str] | None = None) -> Summary:
    st = data.state
    ranks = list(st.ranks.values())
    steps = [v.step for v in ranks if v.step is not None]
    job_state = st.state
    state_text = job_state
    running = [v for v in ranks if v.state == "running"]
    by_word: dict[str, list[int]] = {word: [] for word in (*SILENT_RANK_STATES, "exited")}
    for v in ranks:
        if v.state in by_word:
            by_word[v.state].append(v.rank)
    hang = current_hang(data, now) if running else None
    hub_down = _hub_down_text(data, now)
    if job_state == "waiting":
        state_text = _waiting_text(data, now)
    elif job_state in ("stopped", "stopping"):
        state_text = st.stop_text() if job_state == "stopped" else "stopping: " + st.stop_text()
    elif hang is not None:
        job_state, state_text = "hung", f"HUNG (h: details): {hang['text']}"
    elif hub_down is not None and job_state not in JOB_ENDED_STATES:
        job_state, state_text = "hub down", hub_down
    elif job_state == "running" and not steps:  # started, not trained yet: say how far
        state_text = (f"starting: {len(ranks)} of {st.world_size or len(ranks)} ranks "
                      "connected, waiting for the first step")
    elif job_state in ("running", "degraded") and data.last_step_t is not None and running:
        quiet = now - data.last_step_t
        if quiet > policy.stuck_after_s(median_step):
            job_state, state_text = "stalled", f"stalled: no step for {quiet:.0f} s"
    said = [f"{word}: {rank_list(listed, limit=6)}" for word, listed in by_word.items() if listed]
    if said:  # "degraded, frozen: 1; gone: 2,3; exited: 0"
        state_text += ", " + "; ".join(said)
    step_rates = [s for r, t in data.tracks.items()
                  if st.ranks.get(r) is not None and st.ranks[r].state == "running"
                  and (s := t.steps_per_s(now)) is not None]
    tokens = throughput.state_figure(st, now)  # running ranks only, 0 after a quiet spell
    ended = job_state in JOB_ENDED_STATES
    elapsed = None
    if st.started_t is not None:
        elapsed = ((st.last_t or now) if ended else now) - st.started_t
    stragglers, basis = _stragglers(data, median_step, measure)
    flag_note, flag_style = header_note(st.flags)
    return Summary(
        job=st.job, world_size=st.world_size, ranks_seen=len(ranks), state=job_state,
        state_text=state_text, step_min=min(steps) if steps else None,
        step_max=max(steps) if steps else None,
        steps_per_s=statistics.median(step_rates) if step_rates else None,
        tokens_per_s=tokens.live,
        elapsed_s=elapsed, dropped=sum(v.metrics["dropped"] or 0 for v in ranks),
        gaps=sum(v.seq_gaps for v in ranks), rejected=data.rejected, records=data.records,
        stragglers=stragglers, straggler_basis=basis, conn=data.conn,
        hub_note=st.hub_notes[-1]["text"] if st.hub_notes else None,
        flag_note=flag_note, flag_style=flag_style,
        failure=failure["text"] if failure else "",
        alert="; ".join(a["text"] for a in st.alerts()),
        tokens_label=throughput.LABELS[tokens.source or throughput.STEPS],
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


def straggler_measure(data: DashboardData) -> tuple[dict[int, float], str]:
    """Each running rank's straggler measure in seconds, and its basis
    (`scalemon.reports.stragglers.measure`): its median arrival lateness (`DashboardData.lateness`),
    else its compute time over the median rank's. Call under the lock."""
    views = data.state.ranks.values()
    return straggler_rule.measure(
        (v.rank for v in views if v.state == "running"), data.lateness.get(data.state),
        {v.rank: v.compute_over_median_s for v in views})


def _stragglers(data: DashboardData, median_step: float | None,
                measure: tuple[dict[int, float], str] | None = None
                ) -> tuple[list[tuple[int, float]], str]:
    """Running ranks whose straggler measure (`straggler_measure`) is over
    `scalemon.reports.stragglers.straggler_bar`, largest first, and the basis."""
    values, basis = measure if measure is not None else straggler_measure(data)
    return straggler_rule.stragglers(values, median_step), basis
