"""What the screens draw, built from `DashboardData` under its lock: the header summary, the
rank table's rows (formatted text, only for the rows on screen), plot data and a rank's facts.

Stragglers are named by when each rank reaches the step's first gradient all-reduce against
the median rank (an all-reduce makes every rank's step equally long, so step time cannot tell
who is slow), or, without all-reduce timing, by compute time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from scalemon.jobstate import RankView
from scalemon.tui import format as fmt
from scalemon.tui.model import ConnState, DashboardData, RankTrack
from scalemon.tui.plotdata import Line, PlotSpec

MAX_LINES = 4
"""Up to this many ranks a plot draws one line per rank; above, a min..max band and the mean."""
STRAGGLER_MIN_S = 0.010
"""A rank must arrive this much later than the median (and 10% of a step) to be named."""

# series name -> (title, unit); x is the step for all of them
SERIES: dict[str, tuple[str, str]] = {
    "loss": ("loss", ""),
    "loss_scale": ("AMP loss scale, log", ""),
    "step_ms": ("step time", "ms"),
    "compute_ms": ("compute", "ms"),
    "allreduce_ms": ("all-reduce, sum of buckets", "ms"),
    "optimizer_ms": ("optimizer", "ms"),
    "late_ms": ("arrival at all-reduce - median", "ms"),
    "agent_ms": ("monitor overhead", "ms"),
    "tokens_per_s": ("tokens/s", ""),
    "mem_alloc_gib": ("GPU memory", "GiB"),
    "mem_resv_gib": ("reserved", "GiB"),
    "mem_peak_gib": ("peak", "GiB"),
    "nvml_used_gib": ("GPU memory used, NVML", "GiB"),
    "gpu_util_pct": ("GPU utilisation", "%"),
    "gpu_power_w": ("GPU power", "W"),
    "gpu_temp_c": ("GPU temperature", "°C"),
    "cpu_pct": ("CPU, 100 = one core", "%"),
    "rss_gib": ("process RSS", "GiB"),
}

# rank table: (key, heading with unit, width)
COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("rank", "rank", 4),
    ("state", "state", 10),
    ("step", "step", 6),
    ("loss", "loss", 7),
    ("step_ms", "step ms", 7),
    ("allreduce_ms", "allred ms", 9),
    ("optimizer_ms", "opt ms", 6),
    ("late_ms", "late ms", 7),
    ("hb_age", "hb s", 4),
    ("loss_scale", "loss scale", 10),
    ("mem_alloc", "alloc GiB", 9),
    ("mem_resv", "resv GiB", 8),
    ("mem_peak", "peak GiB", 8),
    ("nvml", "NVML GiB", 9),
    ("gpu_util", "GPU %", 5),
    ("cpu", "CPU %", 5),
    ("host", "host", 14),
)
DETAIL_PLOTS: tuple[tuple[str, ...], ...] = (
    ("loss",), ("loss_scale",), ("step_ms", "compute_ms"), ("allreduce_ms",), ("late_ms",),
    ("optimizer_ms",), ("tokens_per_s",), ("agent_ms",),
    ("mem_alloc_gib", "mem_resv_gib", "mem_peak_gib"), ("nvml_used_gib",), ("gpu_util_pct",),
    ("gpu_power_w",), ("gpu_temp_c",), ("cpu_pct",), ("rss_gib",),
)
_SHORT = {"step_ms": "step", "compute_ms": "compute", "mem_alloc_gib": "alloc",
          "mem_resv_gib": "resv", "mem_peak_gib": "peak"}


PHASES = {"allreduce": "allred", "optimizer": "optim", "after-optimizer": "post-opt",
          "forward": "fwd", "backward": "bwd"}


@dataclass
class Summary:
    """The header's figures."""

    job: str | None
    world_size: int | None
    ranks_seen: int
    state: str  # JobState.state, or "stalled"
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
    stragglers: list[tuple[int, float]]  # (rank, seconds late or slower than the median)
    straggler_basis: str  # "all-reduce arrival", "compute time" or ""
    conn: ConnState


@dataclass
class Row:
    """One rank's table row: text cells in COLUMNS order and a style key."""

    rank: int
    cells: tuple[str, ...]
    style: str  # "", "straggler", "lost", "exited", "stuck", "finished"


@dataclass
class Overview:
    """What the overview screen draws."""

    summary: Summary
    rank_ids: list[int]  # every known rank, in order
    rows: list[Row]  # the rows asked for (all by default), in rank order
    plots: dict[str, PlotSpec] | None  # None when plots were not asked for


@dataclass
class RankDetail:
    """What the rank detail screen draws."""

    rank: int
    facts: list[tuple[str, str]]
    plots: list[PlotSpec]


def overview(data: DashboardData, now: float | None = None, plots: bool = True,
             visible: tuple[int, int] | None = None) -> Overview:
    """Header figures, the table rows at positions `visible` (start, stop) of the sorted
    ranks (all when None: only what is on screen needs formatting) and, when `plots`,
    the four overview plots."""
    now = time.time() if now is None else now
    with data.lock:
        summary = _summary(data, now)
        straggling = {r for r, _ in summary.stragglers}
        rank_ids = sorted(data.state.ranks)
        shown = rank_ids if visible is None else rank_ids[visible[0]:visible[1]]
        median_step = _median_step_s(data)
        rows = [_row(data, data.state.ranks[r], now, r in straggling, median_step)
                for r in shown]
        specs = _overview_plots(data) if plots else None
    return Overview(summary, rank_ids, rows, specs)


def _median_step_s(data: DashboardData) -> float | None:
    times = [v.step_time_s for v in data.state.ranks.values()
             if v.step_time_s is not None and v.state == "running"]
    return statistics.median(times) if times else None


def _summary(data: DashboardData, now: float) -> Summary:
    st = data.state
    ranks = list(st.ranks.values())
    steps = [v.step for v in ranks if v.step is not None]
    job_state = st.state
    state_text = job_state
    running = [v for v in ranks if v.state == "running"]
    lost = [v.rank for v in ranks if v.state == "lost"]
    exited = [v.rank for v in ranks if v.state == "exited"]
    median_step = _median_step_s(data)
    if job_state == "waiting":
        state_text = "waiting for ranks"
    elif job_state in ("running", "degraded") and data.last_step_t is not None and running:
        quiet = now - data.last_step_t
        if quiet > max(10.0, 10.0 * (median_step or 0.0)):
            job_state, state_text = "stalled", f"stalled: no step for {quiet:.0f} s"
    if lost:
        state_text += f", lost ranks: {_rank_list(lost)}"
    if exited:
        state_text += f", exited: {_rank_list(exited)}"
    rates = [t.rates(now) for r, t in data.tracks.items()
             if st.ranks.get(r) is not None and st.ranks[r].state == "running"]
    step_rates = [s for s, _ in rates if s is not None]
    token_rates = [k for _, k in rates if k is not None]
    ended = job_state in ("finished", "ended")
    elapsed = None
    if st.started_t is not None:
        elapsed = ((st.last_t or now) if ended else now) - st.started_t
    stragglers, basis = _stragglers(data, median_step)
    return Summary(
        job=st.job, world_size=st.world_size, ranks_seen=len(ranks), state=job_state,
        state_text=state_text, step_min=min(steps) if steps else None,
        step_max=max(steps) if steps else None,
        steps_per_s=statistics.median(step_rates) if step_rates else None,
        tokens_per_s=sum(token_rates) if token_rates else None,
        elapsed_s=elapsed, dropped=sum(v.dropped or 0 for v in ranks),
        gaps=sum(v.seq_gaps for v in ranks), rejected=data.rejected, records=data.records,
        stragglers=stragglers, straggler_basis=basis, conn=data.conn,
    )


def _stragglers(data: DashboardData, median_step: float | None
                ) -> tuple[list[tuple[int, float]], str]:
    """Running ranks that reach the all-reduce late (or, without all-reduce timing, compute
    slower) than the median rank by at least 10 ms and 10% of a step; latest first."""
    bar = max(STRAGGLER_MIN_S, 0.1 * (median_step or 0.0))
    running = {r for r, v in data.state.ranks.items() if v.state == "running"}
    late = [(r, t.late_ema) for r, t in data.tracks.items()
            if r in running and t.late_ema is not None]
    basis = "all-reduce arrival"
    if not late:
        late = [(r, t.compute_ema) for r, t in data.tracks.items()
                if r in running and t.compute_ema is not None]
        basis = "compute time" if late else ""
    found = sorted(((r, v) for r, v in late if v > bar), key=lambda rv: -rv[1])
    return found, basis


def _row(data: DashboardData, v: RankView, now: float, straggler: bool,
         median_step: float | None) -> Row:
    track = data.tracks.get(v.rank)
    late = track.late_ema if track is not None else None
    state, style = v.state, ""
    if v.state == "lost":
        style = "lost"
    elif v.state == "exited":
        state, style = f"exited {fmt.NA if v.exit_code is None else v.exit_code}", "exited"
    elif v.state == "finished":
        style = "finished"
    elif (v.phase_since_s is not None and v.phase
          and v.phase_since_s > max(10.0, 10.0 * (median_step or 0.0))):
        state, style = f"{PHASES.get(v.phase, v.phase)} {v.phase_since_s:.0f}s", "stuck"
    elif straggler:
        style = "straggler"
    hb_age = None if v.last_seen_t is None else now - v.last_seen_t
    cells = (
        str(v.rank), state, fmt.NA if v.step is None else str(v.step), fmt.num(v.loss),
        fmt.ms(v.step_time_s), fmt.ms(v.allreduce_time_s), fmt.ms(v.optimizer_time_s),
        fmt.signed_ms(late), fmt.age(hb_age), fmt.scale(v.loss_scale),
        fmt.gib(v.mem_allocated_bytes), fmt.gib(v.mem_reserved_bytes),
        fmt.gib(v.mem_peak_bytes), fmt.used_of(v.gpu_mem_used_bytes, v.gpu_mem_total_bytes),
        fmt.pct(v.gpu_util_pct), fmt.pct(v.cpu_pct), v.host or fmt.NA,
    )
    return Row(v.rank, cells, style)


def lines_per_rank(data: DashboardData) -> bool:
    """True when the loss and memory plots draw one line per rank (else a band)."""
    if data.loss_mode == "ranks":
        return True
    if data.loss_mode == "band":
        return False
    return len(data.tracks) <= MAX_LINES


def _per_rank(data: DashboardData, name: str, label: str = "r{rank}") -> list[Line]:
    lines = []
    for i, rank in enumerate(sorted(data.tracks)):
        line = Line.from_series(label.format(rank=rank), data.tracks[rank].series.get(name),
                                color=i)
        if line is not None:
            lines.append(line)
    return lines


def _band(data: DashboardData, name: str, label: str = "mean") -> list[Line]:
    agg = data.agg.get(name)
    if agg is None or not len(agg):
        return []
    return [line for line in (Line.from_series("min..max", agg, color=-1, band=True),
                              Line.from_series(label, agg, color=0, mean=True)) if line]


def _overview_plots(data: DashboardData) -> dict[str, PlotSpec]:
    per_rank = lines_per_rank(data)
    loss = PlotSpec("loss",
                    lines=_per_rank(data, "loss") if per_rank else _band(data, "loss"))
    scale = PlotSpec("AMP loss scale, log", lines=_band(data, "loss_scale", "scale")[1:],
                     log=True, marks=data.skipped.array(), marks_label="skipped",
                     empty="n/a: no AMP GradScaler")
    timing = PlotSpec(
        "time", unit="ms",
        lines=[line for line in (
            Line.from_series("compute", data.agg["compute_ms"], 0, mean=True),
            Line.from_series("all-red", data.agg["allreduce_ms"], 1, mean=True),
            Line.from_series("optim", data.agg["optimizer_ms"], 2, mean=True),
        ) if line])
    has_gpu_mem = any("mem_alloc_gib" in t.series for t in data.tracks.values())
    if has_gpu_mem:
        mem_title, mem_name = "GPU alloc", "mem_alloc_gib"
    else:
        mem_title, mem_name = "RSS, no GPU", "rss_gib"
    if per_rank:
        mem_lines = _per_rank(data, mem_name)
    elif has_gpu_mem:
        mem_lines = _band(data, mem_name)
    else:
        mem_lines = _rss_band(data)
    memory = PlotSpec(mem_title, unit="GiB", lines=mem_lines)
    return {"loss": loss, "scale": scale, "time": timing, "memory": memory}


def _rss_band(data: DashboardData) -> list[Line]:
    parts = [t.series["rss_gib"].arrays() for t in data.tracks.values() if "rss_gib" in
             t.series]
    if not parts:
        return []
    x, lo, hi = (np.concatenate([p[i] for p in parts]) for i in range(3))
    return [Line("min..max", x, lo, hi, color=-1, band=True)]


def rank_detail(data: DashboardData, rank: int, now: float | None = None) -> RankDetail | None:
    """Facts and every series of one rank; None when the rank is unknown."""
    now = time.time() if now is None else now
    with data.lock:
        view = data.state.ranks.get(rank)
        if view is None:
            return None
        track = data.tracks.get(rank)
        series = track.series if track is not None else {}
        plots = []
        for group in DETAIL_PLOTS:
            title, unit = SERIES[group[0]]
            lines = [line for i, name in enumerate(group) if (line := Line.from_series(
                _short(name), series.get(name), color=i))]
            spec = PlotSpec(title if len(group) == 1 else _group_title(group), unit=unit,
                            lines=lines, log=group[0] == "loss_scale",
                            empty=_why_empty(group[0], view))
            if group[0] == "loss_scale" and track is not None:
                spec.marks, spec.marks_label = track.skipped.array(), "skipped step"
            plots.append(spec)
        facts = _facts(view, now, track)
    return RankDetail(rank, facts, plots)


def _short(name: str) -> str:
    return _SHORT.get(name, SERIES[name][0])


def _group_title(group: tuple[str, ...]) -> str:
    return "step time" if group[0] == "step_ms" else "GPU memory, torch"


def _why_empty(name: str, view: RankView) -> str:
    gpu = name.startswith(("mem_", "nvml", "gpu_"))
    if gpu and (view.device in (None, "cpu")):
        return "n/a: no GPU on this rank"
    if name == "loss_scale":
        return "n/a: no AMP GradScaler"
    if name in ("allreduce_ms", "late_ms"):
        return "n/a: no DDP all-reduce timed"
    return "no data yet"


def _rank_list(ranks: list[int], limit: int = 6) -> str:
    text = ", ".join(str(r) for r in sorted(ranks)[:limit])
    return text + (f" (+{len(ranks) - limit})" if len(ranks) > limit else "")


def _facts(v: RankView, now: float, track: RankTrack | None) -> list[tuple[str, str]]:
    steps_s, tokens_s = track.rates(now) if track is not None else (None, None)
    hb = None if v.last_seen_t is None else now - v.last_seen_t
    return [
        ("state", v.state + (f" ({v.state_reason})" if v.state_reason else "")),
        ("host / pid", f"{v.host or fmt.NA} / {v.pid if v.pid is not None else fmt.NA}"),
        ("device / backend", f"{v.device or fmt.NA} / {v.backend or fmt.NA}"),
        ("step", fmt.NA if v.step is None else str(v.step)),
        ("steps/s  tokens/s", f"{fmt.num(steps_s, 2)}  {fmt.si(tokens_s)}"),
        ("loss", fmt.num(v.loss)),
        ("phase", f"{v.phase or fmt.NA} for {fmt.age(v.phase_since_s)} s"),
        ("collectives issued / done", f"{_opt(v.collectives_issued)} / "
                                      f"{_opt(v.collectives_completed)}"),
        ("heartbeat age s", fmt.age(hb)),
        ("skipped steps", _opt(v.skipped_steps)),
        ("dropped / seq gaps", f"{_opt(v.dropped)} / {v.seq_gaps}"),
        ("restarts", _opt(v.restart_count)),
        ("exit code / error", f"{_opt(v.exit_code)} / {v.error or '-'}"),
    ]


def _opt(value: object) -> str:
    return fmt.NA if value is None else str(value)
