"""What the rank detail screen draws (`RankDetail`): one rank's facts and every series it
sends, a plot per panel of the metrics table and one per numeric extra value it logs; for a
rank that stopped sending, what the hub read of its process and, once read, its stacks read
from outside (`outside_stacks_text`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scalemon import metrics, throughput
from scalemon.metrics import Metric
from scalemon.proc.stacks import StackReading, format_stacks
from scalemon.protocol import SILENT_RANK_STATES
from scalemon.reports.hangs import first_failure
from scalemon.state import alerts as alerting
from scalemon.state.ending import with_reason
from scalemon.state.fold import RankTrack
from scalemon.state.jobstate import RankView
from scalemon.text import display
from scalemon.text.display import NA

from ..model import DashboardData
from ..plotdata import Line, PlotSpec
from .nodes import process_text

DETAIL_PANELS: tuple[tuple[str, tuple[Metric, ...]], ...] = tuple(metrics.plot_panels())
"""The rank detail's plot panels from the table: (title, metrics), before the extra values."""
FETCHING = "fetching rank {rank}'s series from the hub…"
"""What a big job's rank's plots say until its earlier records came (`DashboardData.show_rank`)."""


@dataclass
class RankDetail:
    """What the rank detail screen draws."""

    rank: int
    facts: list[tuple[str, str]]
    plots: list[PlotSpec]  # one per DETAIL_PANELS entry
    extra_plots: dict[str, PlotSpec]  # numeric log(**extra) values by name
    stacks: str | None = None
    """The stacks last read from outside the rank's process (`outside_stacks_text`), or None."""


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
                            else _why_empty(group[0], view),
                            # a pipeline's bubble: no panel of n/a on every other job's ranks
                            hidden=show.when_seen and not lines and not fetching)
            if group[0].name == "loss_scale" and track is not None:
                spec.marks, spec.marks_label = track.skipped.array(), "skipped step"
            plots.append(spec)
        extras = track.extras if track is not None else {}
        extra_plots = {
            name: PlotSpec(f"{name} (log extra)",
                           lines=[line] if (line := Line.from_series(name, extras[name])) else [])
            for name in sorted(extras)}
        facts = _facts(data, view, now, track)
        stacks = outside_stacks_text(view.outside_stacks) if view.outside_stacks else None
    return RankDetail(rank, facts, plots, extra_plots, stacks)


def _why_empty(metric: Metric, view: RankView) -> str:
    show = metric.show
    if show is None or not show.na:
        return "no data yet"
    if show.needs_gpu and view.device not in (None, "cpu"):
        return "no data yet"  # a GPU rank: the value comes with the next message
    return f"n/a: {show.na}"


def _facts(data: DashboardData, v: RankView, now: float, track: RankTrack | None
           ) -> list[tuple[str, str]]:
    steps_s = track.steps_per_s(now) if track is not None else None
    tokens_s, _, source = throughput.rank_figure_at(v, now)  # the rank's row and --json figure
    m = v.metrics
    facts = [
        ("state", with_reason(v.state, v.state_reason)
         + _failure_note(data, v)),
        ("host / pid", f"{v.host or NA} / {display.text_of(v.pid)}"),
        ("device / backend", f"{v.device or NA} / {v.backend or NA}"),
        ("scalemon / torch", f"{v.agent_version or NA} / {v.torch_version or NA}"),
        ("step", display.text_of(v.step)),
        (f"steps/s  {throughput.LABELS[source or throughput.STEPS]}",
         f"{display.num(steps_s, 2)}  {display.si(tokens_s)}"),
        ("loss", display.num(m["loss"])),
        ("phase", f"{m['phase'] or NA} for {display.age(m['phase_since_s'])} s"),
        ("collectives issued / done", f"{display.text_of(m['collectives_issued'])} / "
                                      f"{display.text_of(m['collectives_completed'])}"),
        ("heartbeat age s", display.age(v.value("heartbeat_age_s", now))),
        ("skipped steps", display.text_of(m["skipped_steps"])),
        ("dropped / seq gaps", f"{display.text_of(m['dropped'])} / {v.seq_gaps}"),
        ("restarts", display.text_of(v.restart_count)),
        ("exit code / error", f"{display.text_of(v.exit_code)} / {v.error or '-'}"),
    ]
    if v.monitor_off:
        facts.insert(1, ("monitor off", f"{v.monitor_off} (no steps since)"))
    if v.state == "frozen" and v.where:
        facts.insert(1, ("where", v.where))
    if v.process is not None and v.state in SILENT_RANK_STATES:
        facts.insert(1, ("process", process_line(v.process)))
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
    failure = first_failure(data.state)  # the hang, where the job ended hung
    return ", the first rank to fail" if failure and failure["rank"] == v.rank else ""


def process_line(process: Mapping[str, Any]) -> str:
    """What was read of a silent rank's process, one line: "pid 101 (python): sleeping, CPU not
    moving; 12.34 s CPU, 4 threads". Every fact comes from a peer and may be missing."""
    pid, comm = process.get("pid"), process.get("comm")
    head = f"pid {pid}" if isinstance(pid, int) and not isinstance(pid, bool) else "pid ?"
    if isinstance(comm, str) and comm:
        head += f" ({comm})"
    said = process_text(process)
    more = []
    cpu, threads = process.get("cpu_s"), process.get("threads")
    if isinstance(cpu, (int, float)) and not isinstance(cpu, bool):
        more.append(f"{cpu:.2f} s CPU")
    if isinstance(threads, int) and not isinstance(threads, bool):
        more.append(f"{threads} thread{'s' if threads != 1 else ''}")
    return head + (f": {said}" if said else "") + ("; " + ", ".join(more) if more else "")


def outside_stacks_text(outside: Mapping[str, Any]) -> str:
    """The stacks read from outside a rank's process (`RankView.outside_stacks`: reading,
    process, reader, t) as text: who read them and when, then every thread (the one holding
    the GIL first) with its frames, innermost first, native ones marked, in the words of
    `scalemon stacks` (`scalemon.proc.stacks.format_stacks`); or why none were read. What a
    peer sent: the reading is checked as it is read (`StackReading.from_wire`)."""
    reader, t = outside.get("reader"), outside.get("t")
    head = "read from outside the process"
    if isinstance(reader, str) and reader:
        head += f" by the {reader}" if reader.startswith(("hub ", "relay ")) else f" by {reader}"
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        head += time.strftime(" at %H:%M:%S", time.localtime(t))
    reading = StackReading.from_wire(outside.get("reading"))
    return head + "\n" + format_stacks(reading, native=True)
