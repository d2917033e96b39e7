"""What the screens draw, built from `DashboardData` under its lock: the header summary, the
rank table's rows (formatted text, only for the rows on screen) or, for a big job, the node
overview (`views.nodes`), plot data and a rank's facts.

Stragglers are named by how late each rank issues the collectives of its groups against the
first rank (`arrival_lateness_s`: a collective makes every rank's step equally long, so step
time cannot tell who is slow), or, before any collective was seen by every rank, by compute
time. A hung job (`JobState.hang`) says so in the header's state.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from array import array
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from scalemon import metrics, policy
from scalemon.metrics import Metric
from scalemon.reports import stragglers as straggler_rule
from scalemon.reports.stragglers import MEASURE_NAMES
from scalemon.state import alerts as alerting
from scalemon.state.fold import RankTrack
from scalemon.state.jobstate import JOB_ENDED_STATES, RankView
from scalemon.text import display
from scalemon.text.display import AGGREGATE_AT, NA, Column
from scalemon.text.ranks import rank_list
from scalemon.tui.model import ConnState, DashboardData
from scalemon.tui.plotdata import Line, PlotSpec, scaled
from scalemon.tui.safe_text import clean
from scalemon.tui.views import nodes as nodeview
from scalemon.tui.views.flags import header_note
from scalemon.tui.views.hang import current_hang
from scalemon.tui.views.nodes import NodeView

MAX_LINES = 4
"""Up to this many ranks a plot draws one line per rank; above, a min..max band and the mean."""

COLUMNS: tuple[Column, ...] = display.rank_columns()
"""The rank table: rank, state, step, one column per metric of the table that has one, host."""
MONITOR_OFF = "mon. off"
"""The state cell of a rank whose agent switched itself off (the reason is in its detail)."""
DETAIL_PANELS: tuple[tuple[str, tuple[Metric, ...]], ...] = tuple(metrics.plot_panels())
"""The rank detail's plot panels from the table: (title, metrics), before the extra values."""


PHASES = {"allreduce": "allred", "optimizer": "optim", "after-optimizer": "post-opt",
          "forward": "fwd", "backward": "bwd"}


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


@dataclass
class Row:
    """One rank's table row: text cells in COLUMNS order and a style key."""

    rank: int
    cells: tuple[str, ...]
    style: str  # "", "straggler", "lost", "exited", "stuck", "finished", "stopped", "alert"


@dataclass
class Overview:
    """What the overview screen draws."""

    summary: Summary
    rank_ids: list[int]  # every known rank, in order
    rows: list[Row]  # the rows asked for (all by default), in rank order; none for nodes
    plots: dict[str, PlotSpec] | None  # None when plots were not asked for
    nodes: NodeView | None = None  # a row per node instead of per rank, when asked for


FETCHING = "fetching rank {rank}'s series from the hub…"
"""What a big job's rank's plots say until its earlier records came (`DashboardData.show_rank`)."""


@dataclass
class RankDetail:
    """What the rank detail screen draws."""

    rank: int
    facts: list[tuple[str, str]]
    plots: list[PlotSpec]  # one per DETAIL_PANELS entry
    extra_plots: dict[str, PlotSpec]  # numeric log(**extra) values by name


def overview(data: DashboardData, now: float | None = None, plots: bool = True,
             visible: tuple[int, int] | None = None, *, nodes: bool | None = False,
             ranks: Collection[int] | None = None) -> Overview:
    """Header figures, the table rows at positions `visible` (start, stop) of the sorted
    ranks (all when None: only what is on screen needs formatting) and, when `plots`,
    the four overview plots. `ranks`: only these ranks in the table (a node's). `nodes`:
    a row per node instead (`Overview.nodes`, `visible` then counts node rows); None: when
    the job has `AGGREGATE_AT` ranks or more."""
    now = time.time() if now is None else now
    with data.lock:
        median_step = _median_step_s(data)
        failure = data.state.first_failure()
        measure = straggler_measure(data)
        summary = _one_line_texts(_summary(data, now, median_step, failure, measure))
        straggling = {r for r, _ in summary.stragglers}
        rank_ids = sorted(data.state.ranks)
        if nodes is None:
            nodes = len(rank_ids) >= AGGREGATE_AT
        if ranks is not None:
            wanted = set(ranks)
            rank_ids = [r for r in rank_ids if r in wanted]
        first = failure["rank"] if failure else None
        node_view = None
        rows: list[Row] = []
        if nodes:
            late = data.lateness.values
            node_view = nodeview.node_view(
                data, measure[0], MEASURE_NAMES.get(measure[1], ""), median_step, first,
                lambda v: rank_values(data, v, now, late), visible)
        else:
            shown = rank_ids if visible is None else rank_ids[visible[0]:visible[1]]
            rows = [_row(data, data.state.ranks[r], now, r in straggling, median_step, first)
                    for r in shown]
        specs = _overview_plots(data) if plots else None
    return Overview(summary, rank_ids, rows, specs, node_view)


def _one_line_texts(s: Summary) -> Summary:
    """The summary with its texts (a job id, hang, hub and failure texts, flag values, the
    receiver's error) fit for the header: one line each, no control character (its segments
    go to the terminal as they are)."""
    texts = {f.name: clean(value, one_line=True) for f in dataclasses.fields(s)
             if isinstance(value := getattr(s, f.name), str)}
    conn = dataclasses.replace(s.conn, detail=clean(s.conn.detail, one_line=True))
    return dataclasses.replace(s, **texts, conn=conn)


def _median_step_s(data: DashboardData) -> float | None:
    return straggler_rule.median_step_s(
        v.metrics["step_time_s"] for v in data.state.ranks.values() if v.state == "running")


def _summary(data: DashboardData, now: float, median_step: float | None,
             failure: dict[str, Any] | None,
             measure: tuple[dict[int, float], str] | None = None) -> Summary:
    """The header's figures; `median_step`, `failure` (`JobState.first_failure`) and the
    straggler `measure` (`straggler_measure`) as the rows use them."""
    st = data.state
    ranks = list(st.ranks.values())
    steps = [v.step for v in ranks if v.step is not None]
    job_state = st.state
    state_text = job_state
    running = [v for v in ranks if v.state == "running"]
    lost = [v.rank for v in ranks if v.state == "lost"]
    exited = [v.rank for v in ranks if v.state == "exited"]
    hang = current_hang(data, now) if running else None
    hub_down = _hub_down_text(data, now)
    if job_state == "waiting":
        state_text = "waiting for ranks"
    elif job_state in ("stopped", "stopping"):
        state_text = st.stop_text() if job_state == "stopped" else "stopping: " + st.stop_text()
    elif hang is not None:
        job_state, state_text = "hung", f"HUNG (h: details): {hang['text']}"
    elif hub_down is not None and job_state not in JOB_ENDED_STATES:
        job_state, state_text = "hub down", hub_down
    elif job_state in ("running", "degraded") and data.last_step_t is not None and running:
        quiet = now - data.last_step_t
        if quiet > policy.stuck_after_s(median_step):
            job_state, state_text = "stalled", f"stalled: no step for {quiet:.0f} s"
    if lost:
        state_text += f", lost ranks: {rank_list(lost, limit=6)}"
    if exited:
        state_text += f", exited: {rank_list(exited, limit=6)}"
    rates = [t.rates(now) for r, t in data.tracks.items()
             if st.ranks.get(r) is not None and st.ranks[r].state == "running"]
    step_rates = [s for s, _ in rates if s is not None]
    token_rates = [k for _, k in rates if k is not None]
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
        tokens_per_s=sum(token_rates) if token_rates else None,
        elapsed_s=elapsed, dropped=sum(v.metrics["dropped"] or 0 for v in ranks),
        gaps=sum(v.seq_gaps for v in ranks), rejected=data.rejected, records=data.records,
        stragglers=stragglers, straggler_basis=basis, conn=data.conn,
        hub_note=st.hub_notes[-1]["text"] if st.hub_notes else None,
        flag_note=flag_note, flag_style=flag_style,
        failure=failure["text"] if failure else "",
        alert="; ".join(a["text"] for a in st.alerts()),
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


def rank_values(data: DashboardData, v: RankView, now: float,
                late: dict[int, float | None] | None = None) -> dict[str, object]:
    """Every metric of the table for one rank, by name: from the messages, the well-known
    extras, and what the reducer computes (heartbeat age, arrival lateness: from `late`,
    `DashboardData.lateness`, when given)."""
    values: dict[str, object] = dict(v.metrics)
    for m in metrics.KEPT:
        if m.source != "step" and m.source != "heartbeat":
            if late is not None and m.name == "arrival_lateness_s":
                values[m.name] = late.get(v.rank)
            else:
                values[m.name] = v.value(m.name, now)
    return values


def _row(data: DashboardData, v: RankView, now: float, straggler: bool,
         median_step: float | None, first_failed: int | None = None) -> Row:
    state, style = v.state, ""
    phase, since = v.metrics["phase"], v.metrics["phase_since_s"]
    if v.state == "lost":
        style = "lost"
    elif v.state == "exited":
        state, style = f"exited {NA if v.exit_code is None else v.exit_code}", "exited"
        if v.rank == first_failed:
            state = "failed 1st"
        elif v.peer_loss:
            state = "peer lost"
    elif v.monitor_off:  # its steps stopped for that reason, not because it is stuck
        state, style = MONITOR_OFF, "stuck"
    elif v.state == "finished":
        style = "finished"
    elif v.state == "stopped":
        style = "stopped"
    elif (alert := alerting.worst(v.alerts)) is not None:
        state, style = alerting.short_text(alert), "alert"
    elif policy.is_stuck(phase, since, policy.stuck_after_s(median_step)):
        state, style = f"{PHASES.get(phase, phase)} {since:.0f}s", "stuck"
    elif straggler:
        style = "straggler"
    values = rank_values(data, v, now)
    frame = {"rank": str(v.rank), "state": state, "step": NA if v.step is None else str(v.step),
             "host": v.host or NA}
    cells = tuple(display.metric_text(c.metric, values) if c.metric is not None else frame[c.key]
                  for c in COLUMNS)
    return Row(v.rank, cells, style)


def lines_per_rank(data: DashboardData) -> bool:
    """True when the loss and memory plots draw one line per rank (else a band)."""
    if data.loss_mode == "ranks":
        return True
    if data.loss_mode == "band":
        return False
    return len(data.tracks) <= MAX_LINES


def _scale(name: str) -> float:
    show = metrics.BY_NAME[name].show
    return show.scale if show is not None else 1.0


def _per_rank(data: DashboardData, name: str, label: str = "r{rank}") -> list[Line]:
    lines = []
    for i, rank in enumerate(sorted(data.tracks)):
        line = Line.from_series(label.format(rank=rank), data.tracks[rank].series.get(name),
                                color=i, scale=_scale(name))
        if line is not None:
            lines.append(line)
    return lines


def _band(data: DashboardData, name: str, label: str = "mean") -> list[Line]:
    agg = data.agg.get(name)
    if agg is None or not len(agg):
        return []
    scale = _scale(name)
    return [line for line in (Line.from_series("min..max", agg, color=-1, band=True, scale=scale),
                              Line.from_series(label, agg, color=0, mean=True, scale=scale))
            if line]


OVERVIEW_PANELS = ("loss", "scale", "time", "memory")
"""The overview's plots; which metrics each draws comes from the table (`Show.overview`)."""
OVERVIEW_LINES = {panel: metrics.overview_lines(panel) for panel in OVERVIEW_PANELS}
"""Each overview plot's metrics, in their order (read from the table once, not per redraw)."""


def _overview_plots(data: DashboardData) -> dict[str, PlotSpec]:
    per_rank = lines_per_rank(data)
    lines = OVERVIEW_LINES
    plots: dict[str, PlotSpec] = {}
    loss = lines["loss"][0]
    plots["loss"] = PlotSpec(loss.show.plot if loss.show else loss.name,
                             lines=_per_rank(data, loss.name) if per_rank else
                             _band(data, loss.name))
    scale = lines["scale"][0]
    plots["scale"] = PlotSpec(
        scale.show.plot if scale.show else scale.name,
        lines=_band(data, scale.name, _label(scale))[1:], log=True,
        marks=data.skipped.array(), marks_label="skipped",
        empty=f"n/a: {scale.show.na if scale.show else ''}")
    plots["time"] = PlotSpec(
        "time", unit=display.unit(lines["time"][0].name),
        lines=[line for line in (
            Line.from_series(_label(m), data.agg[m.name], color, mean=True, scale=_scale(m.name))
            for color, m in enumerate(lines["time"])) if line])
    plots["memory"] = _memory_plot(data, lines["memory"][0].name, per_rank)
    return plots


def _label(metric: Metric) -> str:
    """A metric's line label in an overview plot (`Overview.label`)."""
    overview = metric.show.overview if metric.show else None
    return overview.label if overview else metric.name


def _memory_plot(data: DashboardData, name: str, per_rank: bool) -> PlotSpec:
    """The overview's memory plot: metric `name` (GPU memory), else each rank's RSS."""
    has_gpu_mem = len(data.agg[name]) > 0 or any(name in t.series for t in data.tracks.values())
    if has_gpu_mem:
        mem_title, mem_name = "GPU alloc", name
    elif data.big():  # no per-rank series but those of the ranks opened
        mem_title, mem_name = "RSS of the ranks opened, no GPU", "rss_bytes"
    else:
        mem_title, mem_name = "RSS, no GPU", "rss_bytes"
    if per_rank:
        mem_lines = _per_rank(data, mem_name)
    elif has_gpu_mem:
        mem_lines = _band(data, mem_name)
    else:
        mem_lines = _rss_band(data)
    return PlotSpec(mem_title, unit=display.unit(name), lines=mem_lines)


def _rss_band(data: DashboardData) -> list[Line]:
    parts = [t.series["rss_bytes"].arrays() for t in data.tracks.values()
             if "rss_bytes" in t.series]
    if not parts:
        return []
    x, lo, hi = (array("d", itertools.chain.from_iterable(p[i] for p in parts))
                 for i in range(3))
    scale = _scale("rss_bytes")
    return [Line("min..max", x, scaled(lo, scale), scaled(hi, scale), color=-1, band=True)]


def rank_detail(data: DashboardData, rank: int, now: float | None = None) -> RankDetail | None:
    """Facts and every series of one rank (the table's plot panels, then one plot per numeric
    extra value the script logs); None when the rank is unknown."""
    now = time.time() if now is None else now
    with data.lock:
        view = data.state.ranks.get(rank)
        if view is None:
            return None
        track = data.tracks.get(rank)
        series = track.series if track is not None else {}
        fetching = data.needs_backfill(rank)  # a big job's rank: its series come from the hub
        plots = []
        for title, group in DETAIL_PANELS:
            show = group[0].show
            assert show is not None
            lines = [line for i, m in enumerate(group) if (line := Line.from_series(
                m.show.plot if m.show else m.name, series.get(m.name), color=i,
                scale=m.show.scale if m.show else 1.0))]
            spec = PlotSpec(title, unit=show.unit, lines=lines, log=show.log,
                            empty=FETCHING.format(rank=rank) if fetching
                            else _why_empty(group[0], view))
            if group[0].name == "loss_scale" and track is not None:
                spec.marks, spec.marks_label = track.skipped.array(), "skipped step"
            plots.append(spec)
        extras = track.extras if track is not None else {}
        extra_plots = {
            name: PlotSpec(f"{name} (log extra)",
                           lines=[line] if (line := Line.from_series(name, extras[name])) else [])
            for name in sorted(extras)}
        facts = _facts(data, view, now, track)
    return RankDetail(rank, facts, plots, extra_plots)


def _why_empty(metric: Metric, view: RankView) -> str:
    show = metric.show
    if show is None or not show.na:
        return "no data yet"
    if show.needs_gpu and view.device not in (None, "cpu"):
        return "no data yet"  # a GPU rank: the value comes with the next message
    return f"n/a: {show.na}"


def _facts(data: DashboardData, v: RankView, now: float, track: RankTrack | None
           ) -> list[tuple[str, str]]:
    steps_s, tokens_s = track.rates(now) if track is not None else (None, None)
    m = v.metrics
    facts = [
        ("state", v.state + (f" ({v.state_reason})" if v.state_reason else "")
         + _failure_note(data, v)),
        ("host / pid", f"{v.host or NA} / {_opt(v.pid)}"),
        ("device / backend", f"{v.device or NA} / {v.backend or NA}"),
        ("scalemon / torch", f"{v.agent_version or NA} / {v.torch_version or NA}"),
        ("step", _opt(v.step)),
        ("steps/s  tokens/s", f"{display.num(steps_s, 2)}  {display.si(tokens_s)}"),
        ("loss", display.num(m["loss"])),
        ("phase", f"{m['phase'] or NA} for {display.age(m['phase_since_s'])} s"),
        ("collectives issued / done", f"{_opt(m['collectives_issued'])} / "
                                      f"{_opt(m['collectives_completed'])}"),
        ("heartbeat age s", display.age(v.value("heartbeat_age_s", now))),
        ("skipped steps", _opt(m["skipped_steps"])),
        ("dropped / seq gaps", f"{_opt(m['dropped'])} / {v.seq_gaps}"),
        ("restarts", _opt(v.restart_count)),
        ("exit code / error", f"{_opt(v.exit_code)} / {v.error or '-'}"),
    ]
    if v.monitor_off:
        facts.insert(1, ("monitor off", f"{v.monitor_off} (no steps since)"))
    facts.extend(("ALERT", a["text"]) for a in alerting.rank_alerts(v.rank, v.alerts))
    if v.rank in data.partial_series:
        facts.append(("plots", f"from step {data.partial_series[v.rank]} on: the hub keeps a "
                               "big job's rank's latest records for them (all in its history)"))
    if v.extra:
        facts.append(("log extra", display.flat_text(v.extra)))
    for key, by_rank in sorted(data.state.info.items()):
        if v.rank in by_rank:
            facts.append((f"info {key}", display.flat_text(by_rank[v.rank])))
    return facts


def _failure_note(data: DashboardData, v: RankView) -> str:
    """", the first rank to fail" or ", only because a peer went away" for failed ranks."""
    if v.peer_loss:
        return ", only because a peer went away"
    failure = data.state.first_failure()
    return ", the first rank to fail" if failure and failure["rank"] == v.rank else ""


def _opt(value: object) -> str:
    return NA if value is None else str(value)
