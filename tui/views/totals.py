"""The figures of a redraw that take a pass over every rank (`RankTotals`): the median step,
the straggler measure, the first failure, the header's counts and rates, and for a big job the
ranks by node, in table order, with the watch list and the histogram.

A small job's redraw computes them each time (`rank_totals`). A big job's dashboard, which
follows the hub's digest (`tui/digest_feed.py`), has its receiver compute them after digests
(at most every 2 s at 16,384 ranks: `DashboardData.totals`) and its redraws read them
(`totals_for`): a redraw then costs what is on screen (the header, the node rows shown), not
16,384 ranks. No textual import.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from scalemon import policy, throughput
from scalemon.policy import NODE_STATES
from scalemon.protocol import SILENT_RANK_STATES
from scalemon.reports import stragglers as straggler_rule
from scalemon.reports.hangs import first_failure
from scalemon.reports.stragglers import MEASURE_NAMES
from scalemon.state.jobstate import RankView
from scalemon.text import display

from ..model import DashboardData
from .flags import header_note
from .hang import current_hang


@dataclass
class NodeGroup:
    """One node's ranks (in rank order) and what orders and styles its row."""

    members: list[RankView]
    worst: str  # a NODE_STATES entry


@dataclass
class RankTotals:
    """What a redraw reads of every rank, as of one pass (`rank_totals`)."""

    version: int  # DashboardData.version when computed
    t: float  # the wall clock it was computed at
    median_step: float | None  # the running ranks' median step time
    failure: dict[str, Any] | None  # `reports.hangs.first_failure`
    measure: dict[int, float]  # each running rank's straggler measure in seconds
    measure_basis: str  # its basis (`reports.stragglers.measure`)
    job_state: str  # JobState.state
    ranks_seen: int
    running: int  # ranks in state "running"
    by_word: dict[str, list[int]]  # silent or exited ranks, by state word
    step_min: int | None
    step_max: int | None
    steps_per_s: float | None  # the running ranks' median step rate
    tokens: throughput.Figure  # the job's tokens/s (`throughput.state_figure`)
    dropped: int
    gaps: int
    stragglers: list[tuple[int, float]]  # (rank, seconds), largest first
    flag_note: str
    flag_style: str
    alert: str
    hang: dict[str, Any] | None = None  # `views.hang.current_hang` (None: no hang)
    nodes: dict[str | None, NodeGroup] | None = None  # by host (big jobs: `with_nodes`)
    hosts: list[str | None] | None = None  # the nodes in table order (trouble first)
    watch: Any = None  # `views.nodes.Watch`, made once from these totals
    histogram: Any = None  # `views.nodes.Histogram` (None: no measure, or not made yet)

    @property
    def measure_name(self) -> str:
        """What the straggler measure is called in the table ("late ms"), "" without one."""
        return MEASURE_NAMES.get(self.measure_basis, "")


def rank_totals(data: DashboardData, now: float, with_nodes: bool = False) -> RankTotals:
    """One pass over the ranks (call under the data's lock): the figures of `RankTotals`,
    with the ranks by node when `with_nodes`. The straggler measure is
    `scalemon.reports.stragglers.measure`: each running rank's median arrival lateness
    (`DashboardData.lateness`), else its compute time over the median rank's."""
    st = data.state
    running_ranks: list[int] = []
    step_times: list[Any] = []  # of the running ranks
    steps: list[int] = []
    compute: dict[int, float | None] = {}
    by_word: dict[str, list[int]] = {word: [] for word in (*SILENT_RANK_STATES, "exited")}
    dropped = gaps = 0
    for rank, v in st.ranks.items():  # one walk over the views: 16,384 of them
        m = v.metrics
        if v.state == "running":
            running_ranks.append(rank)
            step_times.append(m["step_time_s"])
        elif v.state in by_word:
            by_word[v.state].append(rank)
        if v.step is not None:
            steps.append(v.step)
        compute[rank] = v.compute_over_median_s
        dropped += m["dropped"] or 0
        gaps += v.seq_gaps
    median_step = straggler_rule.median_step_s(step_times)
    measure, basis = straggler_rule.measure(running_ranks, data.lateness.get(st), compute)
    views = st.ranks
    step_rates = [s for r, t in data.tracks.items()
                  if (v := views.get(r)) is not None and v.state == "running"
                  and (s := t.steps_per_s(now)) is not None]
    flag_note, flag_style = header_note(st.flags)
    totals = RankTotals(
        version=data.version, t=now, median_step=median_step, failure=first_failure(st),
        measure=measure, measure_basis=basis, job_state=st.state, ranks_seen=len(views),
        running=len(running_ranks), by_word=by_word,
        step_min=min(steps) if steps else None, step_max=max(steps) if steps else None,
        steps_per_s=statistics.median(step_rates) if step_rates else None,
        tokens=_tokens(data, now), dropped=dropped, gaps=gaps,
        stragglers=straggler_rule.stragglers(measure, median_step),
        flag_note=flag_note, flag_style=flag_style,
        alert="; ".join(a["text"] for a in st.alerts()),
        hang=current_hang(data, now) if running_ranks else None)
    if with_nodes:
        totals.nodes, totals.hosts = _by_node(data, measure, median_step)
    return totals


def totals_for(data: DashboardData, now: float, with_nodes: bool) -> RankTotals:
    """The totals a redraw reads (call under the lock): those the receiver computed after the
    hub's last digest (a big job's, `DashboardData.totals`), else computed now."""
    kept = data.totals
    if data.digest_followed and kept is not None and (kept.nodes is not None or not with_nodes):
        return kept
    return rank_totals(data, now, with_nodes)


def _tokens(data: DashboardData, now: float) -> throughput.Figure:
    """`throughput.state_figure` of the data's state, with the ranks' mesh coordinates kept
    between passes (`MeshCoords`: working them out is most of its cost)."""
    st = data.state
    coords = data.mesh_coords.of(st)
    ranks = [(throughput.rank_figure_at(st.ranks[r], now), coords[r]) for r in sorted(st.ranks)]
    live, live_source = throughput.job_figure((f.live, f.source, c) for f, c in ranks)
    last, last_source = throughput.job_figure((f.last, f.source, c) for f, c in ranks)
    return throughput.Figure(live, last, live_source or last_source)


_INDEX = {state: i for i, state in enumerate(NODE_STATES)}


def _by_node(data: DashboardData, measure: dict[int, float], median_step: float | None
             ) -> tuple[dict[str | None, NodeGroup], list[str | None]]:
    """The ranks by node, and the nodes in table order (`display.node_order_key`: trouble
    first): one pass over the ranks, kept lean (16,384 of them)."""
    bar = policy.straggler_bar(median_step)
    stuck_after = policy.stuck_after_s(median_step)
    gathered: dict[str | None, list[Any]] = {}  # host -> [members, worst, step times, late]
    rank_status = policy.rank_status
    for rank, v in sorted(data.state.ranks.items()):
        host = v.host or None
        node = gathered.get(host)
        if node is None:
            node = gathered[host] = [[], len(NODE_STATES) - 1, [], None]
        node[0].append(v)
        value = measure.get(rank)
        m = v.metrics
        worst = _INDEX[rank_status(v.state, v.exit_code, m["phase"], m["phase_since_s"],
                                   value is not None and value > bar, stuck_after)]
        if v.state == "running":
            step_time = m["step_time_s"]
            if step_time is not None:
                node[2].append(step_time)
            if value is not None and (node[3] is None or value > node[3]):
                node[3] = value
        if worst < node[1]:
            node[1] = worst
    keyed = []
    for host, (members, worst, step_times, late_max) in gathered.items():
        spread = display.spread(step_times)
        med = spread[1] if spread else None
        slow = med is not None and median_step is not None and med > median_step + bar
        keyed.append((display.node_order_key(NODE_STATES[worst], med, slow, late_max,
                                             members[0].rank), host))
    keyed.sort(key=itemgetter(0))
    nodes = {host: NodeGroup(g[0], NODE_STATES[g[1]]) for host, g in gathered.items()}
    return nodes, [host for _, host in keyed]
