"""The metric families of a hub's job state (what `hub/openmetrics.py` exports): by default
per-node and job aggregates of every per-rank gauge, so that the series grow with the nodes,
not the ranks; with `per_rank`, a series per rank as well (and the P2P rows per src/dst pair).

A value not measured (None: no GPU, no optimizer, no step yet) has no sample; a loss that is
NaN or infinite is exported as such (a real finding, not a missing value). Pure functions of a
`JobState`: the exporter runs them off the hub's loop (`hub/metrics_render.py`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)

from scalemon import throughput
from scalemon.reports.groups import collectives_table
from scalemon.reports.hangs import job_hang
from scalemon.reports.pipeline import moe_json, p2p_rows, pipeline_json
from scalemon.state import alerts as alerting

if TYPE_CHECKING:
    from scalemon.state.jobstate import JobState, RankView


@dataclass(frozen=True)
class RankGauge:
    """One per-rank gauge: `scalemon_<name>` from the rank's value `source` times `scale`."""

    name: str
    source: str
    help: str
    scale: float = 1.0
    nan: bool = False
    """Export NaN and infinities (the loss); else such a value is left out like a None."""


RANK_GAUGES: tuple[RankGauge, ...] = (
    RankGauge("loss", "loss", "Loss of the rank's latest step (NaN when it was NaN).", nan=True),
    RankGauge("step_time_seconds", "step_time_s", "Wall time of the rank's latest step."),
    RankGauge("tokens_per_second", "tokens_per_s", "Tokens per second of the rank (the "
              "script's tokens_per_s, else its steps' tokens over their wall time); 0 while "
              "it runs with no step for a while (stalled, hung), no sample once it ended."),
    RankGauge("mfu_ratio", "mfu", "Model FLOPs utilisation of the rank, 0..1."),
    RankGauge("loss_scale", "loss_scale", "AMP GradScaler scale after the rank's latest step."),
    RankGauge("optimizer_time_seconds", "optimizer_time_s", "Time in optimizer.step() in the "
              "rank's latest step."),
    RankGauge("allreduce_seconds", "allreduce_time_s", "Sum of the durations of the "
              "all-reduces of the rank's latest timed step."),
    RankGauge("mem_allocated_bytes", "mem_allocated_bytes", "Bytes held by tensors (torch "
              "caching allocator) after the rank's latest step."),
    RankGauge("mem_reserved_bytes", "mem_reserved_bytes", "Bytes reserved by the torch caching "
              "allocator."),
    RankGauge("mem_peak_bytes", "mem_peak_bytes", "Peak bytes held by tensors."),
    RankGauge("gpu_memory_used_bytes", "gpu_mem_used_bytes", "NVML device memory in use."),
    RankGauge("gpu_memory_total_bytes", "gpu_mem_total_bytes", "NVML device memory size."),
    RankGauge("gpu_utilization_ratio", "gpu_util_pct", "NVML GPU utilisation, 0..1.",
              scale=0.01),
    RankGauge("gpu_power_watts", "gpu_power_w", "NVML board power draw."),
    RankGauge("gpu_temperature_celsius", "gpu_temp_c", "NVML GPU temperature."),
    RankGauge("cpu_utilization_ratio", "cpu_pct", "CPU use of the rank process (1 = one core).",
              scale=0.01),
    RankGauge("rss_bytes", "rss_bytes", "Resident memory of the rank process."),
    RankGauge("arrival_lateness_seconds", "arrival_lateness_s", "Median lateness of the rank "
              "at collectives, behind the first rank of each group (stragglers)."),
    RankGauge("heartbeat_age_seconds", "heartbeat_age_s", "Seconds since the rank's last "
              "message."),
    RankGauge("pipeline_bubble_ratio", "pipeline_bubble", "Share of the rank's latest step "
              "spent waiting for its pipeline neighbours (P2P waits over step time), 0..1; no "
              "sample outside a pipeline."),
    RankGauge("p2p_wait_seconds", "p2p_wait_s", "Seconds the rank's training thread waited "
              "in sends and receives in its latest step."),
)
"""The per-rank gauges besides `scalemon_step` and `scalemon_rank_up`, labels job, rank, host."""

RANK_LABELS = ("job", "rank", "host")
COLLECTIVE_LABELS = ("job", "group", "op")
P2P_LABELS = ("job", "group", "op", "src", "dst")


@dataclass
class GaugeRows:
    """A gauge family as plain rows (label values, value): what the big families are kept as,
    since `hub/metrics_render.py` writes their text without `prometheus_client`'s per-sample
    objects (`metric()` makes one of those, for everything else)."""

    name: str
    documentation: str
    labelnames: tuple[str, ...]
    rows: list[tuple[tuple[str, ...], float]] = field(default_factory=list)

    def add(self, labels: tuple[str, ...], value: float) -> None:
        self.rows.append((labels, value))

    def metric(self) -> Metric:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in self.rows:
            family.add_metric(list(labels), value)
        return family


Family = Metric | GaugeRows
"""A family as `family_parts` gives it."""

STATS = ("min", "mean", "max")
"""What the per-node and job aggregates of a per-rank gauge say (label `stat`)."""
NODE_LABELS = ("job", "node", "stat")
STEP_HELP = "Latest step number of the rank."
RANK_STATE_WORDS = ("running; frozen (its process exists but sends nothing: the job hangs on "
                    "it), gone (its process ended without reporting an exit), unreachable (its "
                    "node's relay is silent too), silent (nothing on its node can look at its "
                    "process); exited, finished, stopped, restarting")


def families(state: JobState, job: str, now: float | None = None,
             per_rank: bool = True) -> list[Metric]:
    """The metric families of `state` as they are now (call where nothing changes it: the
    hub's loop, or a forked copy of it): the per-node and job aggregates, and with `per_rank`
    the per-rank series and the P2P rows per (src, dst) too."""
    shared, rank_only = family_parts(state, job, now, per_rank)
    return [f.metric() if isinstance(f, GaugeRows) else f for f in shared + rank_only]


def family_parts(state: JobState, job: str, now: float | None = None,
                 per_rank: bool = True) -> tuple[list[Family], list[Family]]:
    """(the families every scrape gets, those only a per-rank scrape gets: [] without
    `per_rank`), built once."""
    now = time.time() if now is None else now
    views = [state.ranks[r] for r in sorted(state.ranks)]
    values = [_rank_values(view, now) for view in views]
    shared: list[Family] = [*_aggregate_families(views, values, job)]
    shared += _collective_families(state, job)
    shared += _parallel_families(state, job)
    shared += _job_families(state, job, now)
    if not per_rank:
        return shared, []
    return shared, [*_rank_families(views, values, job), *_p2p_families(state, job)]


def _rank_values(view: RankView, now: float) -> list[float | None]:
    """The rank's step, then its value of each of RANK_GAUGES (scaled; None: no sample)."""
    out: list[float | None] = [_number(view.step)]
    for gauge in RANK_GAUGES:
        if gauge.source == "tokens_per_s":  # live: 0 when stalled, none once ended
            value = _number(throughput.rank_figure_at(view, now).live, gauge.nan)
        else:
            value = _number(view.value(gauge.source, now), gauge.nan)
        out.append(None if value is None else value * gauge.scale)
    return out


def _rank_families(views: list[RankView], values: list[list[float | None]],
                   job: str) -> list[GaugeRows]:
    """A series per rank (labels job, rank, host) of the step, the state and every gauge."""
    step = GaugeRows("scalemon_step", STEP_HELP, RANK_LABELS)
    up = GaugeRows("scalemon_rank_up", "1 while the rank runs, 0 once it stopped sending "
                   "(frozen, gone, unreachable, silent), exited, finished, was stopped or "
                   "restarts.", RANK_LABELS)
    rank_state = GaugeRows("scalemon_rank_state",
                           f"1 for the rank's current state: {RANK_STATE_WORDS}.",
                           (*RANK_LABELS, "state"))
    gauges = [GaugeRows(f"scalemon_{g.name}", g.help, RANK_LABELS) for g in RANK_GAUGES]
    for view, row in zip(views, values, strict=True):
        names = (job, str(view.rank), view.host or "")
        up.add(names, 1 if view.state == "running" else 0)
        rank_state.add((*names, view.state), 1)
        for family, value in zip((step, *gauges), row, strict=True):
            if value is not None:
                family.add(names, value)
    return [step, up, rank_state, *gauges]


def _aggregate_families(views: list[RankView], values: list[list[float | None]],
                        job: str) -> list[GaugeRows]:
    """Ranks by state per node and for the job; min, mean and max of the step and of every
    gauge over each node's ranks (`scalemon_node_*`) and over the job's (`scalemon_job_*`)."""
    by_node: dict[str, list[int]] = {}
    for i, view in enumerate(views):
        by_node.setdefault(view.host or "", []).append(i)
    node_ranks = GaugeRows("scalemon_node_ranks", "Ranks on the node in each state (states "
                           f"with none have no sample): {RANK_STATE_WORDS}.",
                           ("job", "node", "state"))
    job_ranks = GaugeRows("scalemon_ranks", "Ranks of the job in each state (states with none "
                          "have no sample).", ("job", "state"))
    nodes = sorted(by_node.items())
    for node, members in nodes:
        for word, n in _counts(views[i].state for i in members).items():
            node_ranks.add((job, node, word), n)
    for word, n in _counts(view.state for view in views).items():
        job_ranks.add((job, word), n)
    out = [node_ranks, job_ranks]
    node_labels = [[(job, node, stat) for stat in STATS] for node, _ in nodes]
    job_labels = [(job, stat) for stat in STATS]
    helps = (("step", STEP_HELP), *((g.name, g.help) for g in RANK_GAUGES))
    columns = list(zip(*values, strict=True)) if values else [() for _ in helps]
    for (name, text), column in zip(helps, columns, strict=True):
        node = GaugeRows(f"scalemon_node_{name}", f"{text} Over the node's ranks: min, mean "
                         "and max (stat).", NODE_LABELS)
        whole = GaugeRows(f"scalemon_job_{name}", f"{text} Over the job's ranks: min, mean "
                          "and max (stat).", ("job", "stat"))
        for (_, members), labels in zip(nodes, node_labels, strict=True):
            # no value on the node: no stats, no rows
            node.rows += zip(labels, _stats([column[i] for i in members]), strict=False)
        whole.rows += zip(job_labels, _stats(column), strict=False)
        out += [node, whole]
    return out


def _counts(words: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for word in words:
        out[word] = out.get(word, 0) + 1
    return out


def _stats(column: Any) -> tuple[float, ...]:
    """The STATS (min, mean, max) of the values that are not None (none: ()); a NaN among
    them makes every stat NaN (a NaN loss on a node is the finding, not a value to average
    away)."""
    present = [v for v in column if v is not None]
    if not present:
        return ()
    if any(v != v for v in present):
        return (math.nan,) * len(STATS)
    return min(present), sum(present) / len(present), max(present)


def _number(value: Any, nan: bool = False) -> float | None:
    """A number to export, or None: not a number (None, text, bool), or not finite unless
    `nan`."""
    if type(value) not in (int, float):
        return None
    if not nan and not math.isfinite(value):
        return None
    return value


def _collective_families(state: JobState, job: str) -> list[Metric]:
    busbw = GaugeMetricFamily(
        "scalemon_collective_busbw_gbps", "Bus bandwidth of the (group, op)'s timed "
        "collectives, GB/s (nccl-tests' busbw of the mean duration).", labels=COLLECTIVE_LABELS)
    seconds = Metric("scalemon_collective_seconds", "Duration of the (group, op)'s timed "
                     "collectives: p50 and p99 over every rank, sum and count of the "
                     "collectives issued (sum = mean duration x count).", "summary")
    nbytes = CounterMetricFamily("scalemon_collective_bytes", "Bytes of the (group, op)'s "
                                 "collectives, as one member rank issued them.",
                                 labels=COLLECTIVE_LABELS)
    for row in collectives_table(state.groups, state.ranks.values()):
        labels = [job, row["group"], row["op"]]
        names = dict(zip(COLLECTIVE_LABELS, labels, strict=True))
        if (value := _number(row["busbw_gbps"])) is not None:
            busbw.add_metric(labels, value)
        for q, key in (("0.5", "time_p50_s"), ("0.99", "time_p99_s")):
            if (value := _number(row[key])) is not None:
                seconds.add_sample("scalemon_collective_seconds", {**names, "quantile": q}, value)
        if (total := _number(row["time_total_s"])) is not None:
            seconds.add_sample("scalemon_collective_seconds_count", names, row["count"])
            seconds.add_sample("scalemon_collective_seconds_sum", names, total)
        nbytes.add_metric(labels, row["bytes"])
    return [busbw, seconds, nbytes]


def _p2p_families(state: JobState, job: str) -> list[Metric]:
    """Sends and receives per (group, op, src, dst): a pair of ranks each (per-rank scrapes
    only)."""
    ops = CounterMetricFamily("scalemon_p2p_ops", "Sends or receives from src to dst (global "
                              "ranks), as the sending or receiving rank counted them.",
                              labels=P2P_LABELS)
    nbytes = CounterMetricFamily("scalemon_p2p_bytes", "Bytes sent or received from src to "
                                 "dst.", labels=P2P_LABELS)
    seconds = CounterMetricFamily("scalemon_p2p_seconds", "Summed measured time of the sends "
                                  "or receives from src to dst.", labels=P2P_LABELS)
    for row in p2p_rows(state):
        labels = [job, row["group"], row["op"], str(row["src"]), str(row["dst"])]
        ops.add_metric(labels, row["count"])
        nbytes.add_metric(labels, row["bytes"])
        if (value := _number(row["time_s"])) is not None:
            seconds.add_metric(labels, value)
    return [ops, nbytes, seconds]


def _parallel_families(state: JobState, job: str) -> list[Metric]:
    """The pipeline's bubble (theory and the ranks' median) and the MoE routing's balance
    (`reports.pipeline`)."""
    theory = GaugeMetricFamily("scalemon_pipeline_bubble_theoretical_ratio", "The schedule's "
                               "bubble for equal stages: (p-1)/(m+p-1) for GPipe and 1F1B, "
                               "(p-1)/(v*m+p-1) interleaved.", labels=["job", "schedule"])
    measured = GaugeMetricFamily("scalemon_pipeline_bubble_measured_ratio", "Median over the "
                                 "ranks of their latest step's pipeline bubble.",
                                 labels=["job"])
    pipeline = pipeline_json(state) or {}
    if (value := _number(pipeline.get("theoretical_bubble"))) is not None:
        theory.add_metric([job, str(pipeline.get("schedule") or "")], value)
    if (value := _number(pipeline.get("measured_bubble"))) is not None:
        measured.add_metric([job], value)
    moe = moe_json(state) or {}
    out: list[Metric] = [theory, measured]
    for name, key, text in (
            ("moe_a2a_recv_imbalance_ratio", "a2a_recv_imbalance", "Max over mean of the "
             "ranks' all_to_all bytes received in their latest step (1: even)."),
            ("moe_router_imbalance_ratio", "imbalance", "Median over the ranks of their "
             "latest moe_imbalance (max over mean tokens routed per expert rank)."),
            ("moe_dropped_tokens", "dropped_tokens", "Tokens over the experts' capacity in "
             "the ranks' latest step, summed.")):
        family = GaugeMetricFamily(f"scalemon_{name}", text, labels=["job"])
        if (value := _number(moe.get(key))) is not None:
            family.add_metric([job], value)
        out.append(family)
    return out


def _job_families(state: JobState, job: str, now: float) -> list[Metric]:
    hang = job_hang(state, now)
    hung = GaugeMetricFamily("scalemon_hang", "1 while the job is hung (no rank completed a "
                             "step for the hang threshold while it runs).", labels=["job"])
    hung.add_metric([job], 1 if hang else 0)
    since = GaugeMetricFamily("scalemon_hang_seconds", "Seconds since the last completed step "
                              "of the hung job (no sample while it is not hung).",
                              labels=["job"])
    if hang:
        since.add_metric([job], hang["since_s"])
    alerts = GaugeMetricFamily("scalemon_alerts", "Ranks with a training-health alert in force, "
                               "by kind (loss_not_finite, loss_scale_floor, skipped_steps).",
                               labels=["job", "kind"])
    counts = dict.fromkeys(alerting.KINDS, 0)
    for alert in state.alerts():
        counts[alert["kind"]] = len(alert["ranks"])
    for kind, n in counts.items():
        alerts.add_metric([job, kind], n)
    world = GaugeMetricFamily("scalemon_world_size", "Ranks the job has (largest world size "
                              "reported).", labels=["job"])
    if state.world_size is not None:
        world.add_metric([job], state.world_size)
    job_state = GaugeMetricFamily("scalemon_job_state", "1 for the job's current state "
                                  "(waiting, running, degraded, restarting, stopping, finished, "
                                  "stopped, crashed, lost, hung).", labels=["job", "state"])
    job_state.add_metric([job, "hung" if hang else state.state], 1)
    return [hung, since, alerts, world, job_state]
