"""The one table of per-rank metrics: what each value is called, where it comes from, its unit,
what it means and how people see it.

Everything else is derived from `METRICS`: the `step` and `heartbeat` body fields that
`protocol.decode` validates, the values the `JobState` reducer keeps per rank (and so the
`scalemon snapshot --json` keys), the columns of the dashboard's rank table and of the
`scalemon snapshot` table, the `?` help, the rank detail's plots and the field tables of
`docs/protocol.md` (regenerate them with `python -m scalemon.metrics --update-docs`).
`tests/test_metrics.py` checks that they agree.

To add a metric: add one `Metric` here, produce the value (agent, or the dashboard for a
`dashboard` one), run `python -m scalemon.metrics --update-docs`. Names carry their unit
(`_s` seconds, `_bytes`, `_pct`, `_w`, `_c`, `_t` Unix seconds) and are the same on the wire,
in the JSON and in the code; only `Show` converts for people (seconds to ms, bytes to GiB).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SOURCES = ("step", "heartbeat", "extra", "hub", "dashboard")
"""Where a value comes from: a field of the `step` or `heartbeat` message; a well-known name a
script passes to `log(**extra)` (kept in the rank's `extra`); computed by the reducer from the
envelope (`hub`); or computed by the dashboard from other metrics (`dashboard`)."""

KINDS = {"float": "number", "int": "int", "bool": "bool", "str": "str", "map": "map",
         "list": "array"}
"""Value kinds and how docs/protocol.md names them."""

STYLES = ("num", "signed", "loss_scale", "si", "used_of", "int", "age")
"""How `scalemon.text.display` writes a value: fixed decimals, signed decimals, an AMP loss scale,
k/M/G prefixes, `used/total`, a whole number, an age (one decimal below a minute)."""


@dataclass(frozen=True)
class Overview:
    """A line of one of the dashboard overview's plots, drawn from the metric's min, mean and
    max over the ranks at each step (which the reducer keeps for it: `AGGREGATED`)."""

    panel: str
    """The overview plot: "loss", "scale", "time" or "memory" (`tui/views/overview.py` lays
    them out)."""
    label: str = "mean"
    """The line's label in its plot."""
    order: int = 0
    """Position of the line in its plot (its colour)."""


@dataclass(frozen=True)
class Show:
    """How people see a metric. The shown number is the wire value times `scale`, in `unit`."""

    unit: str = ""
    scale: float = 1.0
    style: str = "num"
    digits: int = 1
    column: str | None = None
    """Heading in the rank tables (the unit is appended); None: no column."""
    width: int = 6
    plot: str | None = None
    """Plot title in the rank detail (the line's label inside a `group`); None: not plotted."""
    group: str | None = None
    """Metrics with the same group share one plot panel, titled by the group."""
    log: bool = False
    of: str | None = None
    """For style `used_of`: the metric holding the total."""
    na: str = ""
    """Why the value can be missing ("no GPU on this rank"): said instead of an empty plot."""
    key: int | None = None
    """Position among the key metrics, whose node rows (a big job's overview, the snapshot
    text) show min, median and max over the node's ranks; None: the node's worst value."""
    low_is_worse: bool = False
    """A low value is the bad one (a node row's worst is its min; else its max)."""
    overview: Overview | None = None
    """The overview plot line the metric draws, if any (its cross-rank spread is then kept)."""
    when_seen: bool = False
    """The rank tables have its column only while some rank has a value (a pipeline's
    bubble): every other job keeps its columns, not one of n/a on every row."""

    @property
    def needs_gpu(self) -> bool:
        """True for a value that is missing only where the rank has no GPU (or no NVML)."""
        return self.na in (_NO_GPU, _NO_NVML)

    @property
    def heading(self) -> str:
        """The column heading with its unit."""
        return f"{self.column} {self.unit}" if self.unit else str(self.column)


@dataclass(frozen=True)
class Metric:
    """One per-rank value."""

    name: str
    source: str
    kind: str
    unit: str
    """Unit of the value as sent and stored (docs): s, bytes, %, W, °C, "s (Unix)", or ""."""
    description: str
    required: bool = False
    nullable: bool = True
    kept: bool = True
    """False for message fields the reducer handles itself (the step number, `extra`)."""
    show: Show | None = None

    @property
    def aggregated(self) -> bool:
        """True when the reducer keeps the metric's min/mean/max over ranks per step."""
        return self.show is not None and self.show.overview is not None


_NO_GPU = "no GPU on this rank"
_NO_NVML = "no GPU or NVML on this rank"
_NO_DDP = "no all-reduce timed in a step yet (the recorder's come a few seconds after the step)"
_NO_SKEW = "no collective issued by every rank of a group yet"
_GLOO_P2P = ("recorded on the host by the agent's wrappers of the P2P calls, on gloo only (CPU "
             "tensors; NCCL's sends and receives show in the `collectives` message's `p2p` rows "
             "instead)")

METRICS: tuple[Metric, ...] = (
    # --- the step message -----------------------------------------------------------------
    Metric("step", "step", "int", "", "step number given by the training script",
           required=True, nullable=False, kept=False),
    Metric("loss", "step", "float", "", "loss of the step (may be NaN/Inf). null when not given, "
           "or when a CPU-side rank was given a device tensor (the agent never syncs the device).",
           show=Show(style="num", digits=4, column="loss", width=7, plot="loss", key=3,
                     overview=Overview("loss"))),
    Metric("tokens", "step", "int", "", "tokens processed in this step **on this rank**, as "
           "given by the script"),
    Metric("step_time_s", "step", "float", "s", "host wall time between this `log()` call and the "
           "previous one, i.e. one full iteration; null for the first step of the process",
           show=Show(unit="ms", scale=1e3, column="step", width=7, plot="step",
                     group="step time", key=1)),
    Metric("optimizer_time_s", "step", "float", "s", "total duration of the `optimizer.step()` "
           "calls of the step `optimizer_timed_step` (CUDA events on GPU, host clock on CPU). "
           "On CUDA the agent times one step every 0.5 s at most (SCALEMON_OPTIMIZER_TIMING_S; "
           "each timed step costs two event records on the training thread), and a step in "
           "between carries the last timed step's figure; on CPU every step is timed. Null "
           "when no optimizer is watched or none was timed yet",
           show=Show(unit="ms", scale=1e3, column="opt", width=6, plot="optimizer",
                     na="no optimizer watched", overview=Overview("time", "optim", 2))),
    Metric("optimizer_timed_step", "step", "int", "", "the step whose `optimizer.step()` calls "
           "`optimizer_time_s` measured: this step's own number where it was timed, an earlier "
           "one where the figure is carried; null with `optimizer_time_s`"),
    Metric("allreduce_time_s", "step", "float", "s", "sum of the durations of the step's "
           "all-reduces (issue to completion), so a sum, not wall time: they overlap with "
           "backward and with each other. On DDP over gloo the agent's comm hook times the "
           "gradient buckets (host clock) and sends them in the step message. Everywhere else "
           "(NCCL, or all-reduces not from DDP) the step message has null, and the Flight "
           "Recorder's all_reduce-type collectives of every process group issued between the "
           "previous `log()` and this one fill the rank's value seconds later (`collectives` "
           "message, `steps`; NCCL: `duration_ms`, gloo: the host timer); null when nothing "
           "was timed.",
           show=Show(unit="ms", scale=1e3, column="allred", width=6,
                     plot="all-reduce, sum over the step", na=_NO_DDP,
                     overview=Overview("time", "all-red", 1))),
    Metric("allreduce_count", "step", "int", "", "number of those all-reduces (DDP buckets from "
           "the gloo comm hook; else 0 in the step message, and the recorder's count once its "
           "`collectives.steps` row for the step arrived)"),
    Metric("allreduce_bytes", "step", "int", "bytes", "total size of those all-reduces"),
    Metric("allreduce_issue_t", "step", "float", "s (Unix)", "Unix seconds, the rank's clock, "
           "when the step's first all-reduce was issued; null when there was none"),
    Metric("p2p_count", "step", "int", "", "point-to-point ops (`send`, `recv`, `isend`, "
           "`irecv`, each op of `batch_isend_irecv`) this rank issued between the previous "
           "`log()` and this one, " + _GLOO_P2P + "; null when the rank issued none and waited "
           "in none in the step"),
    Metric("p2p_bytes", "step", "int", "bytes", "bytes of those ops (the tensors' sizes); null "
           "with `p2p_count`"),
    Metric("p2p_wait_s", "step", "float", "s", "seconds the training thread spent inside "
           "`Work.wait()` of P2P ops in the step (a blocking `send`/`recv` waits inside it too): "
           "the time this rank waited for its peers; null with `p2p_count`"),
    Metric("p2p_waits", "step", "map", "", "`p2p_wait_s` per peer: the peer's global rank (as "
           "a string; \"any\" for a receive from any source whose sender is not known) -> "
           "seconds waited on it in the step; null with `p2p_count`"),
    Metric("pipeline_bubble", "step", "float", "", "the fraction of the step (0-1) the rank "
           "spent waiting for its pipeline neighbours: `p2p_wait_s / step_time_s`, at most 1; "
           "null when the rank issued no P2P op in the step, and in the first step (no step "
           "time). Idle time spent in a collective instead (the last stage waiting in the "
           "tied-embedding all_reduce while the first one finishes its backward) is not in it: "
           "there it reads below the schedule's theoretical bubble",
           show=Show(unit="%", scale=100.0, column="bubble", width=6, plot="pipeline bubble",
                     na="no point-to-point ops in this rank's steps (gloo: host-recorded)",
                     when_seen=True)),
    Metric("a2a_send_bytes", "step", "int", "bytes", "bytes this rank sent in the step's "
           "`all_to_all_single` / `all_to_all` calls, from the input split sizes (an equal "
           "split when none are given) and the element size, its own share included; recorded "
           "on the host on gloo only; null when the step had none"),
    Metric("a2a_recv_bytes", "step", "int", "bytes", "bytes this rank received in those calls "
           "(the output split sizes), its own share included; null when the step had none"),
    Metric("arrival_lateness_s", "hub", "float", "s", "median, over the rank's last 100 "
           "(61 at 16,384 ranks: `state.arrival.arrival_window`) collectives that every rank "
           "of their group issued, of how much later this rank issued each one than the first "
           "rank of the group (Flight Recorder issue times, corrected by each host's "
           "`clock_offset_s`). A rank that computes slowly arrives last and then waits least, "
           "so this, not collective time, names stragglers.",
           show=Show(unit="ms", scale=1e3, digits=1, column="late", width=6,
                     plot="arrival lateness at collectives", na=_NO_SKEW, key=2)),
    Metric("compute_s", "dashboard", "float", "s", "step time minus all-reduce and optimizer "
           "time, at least 0: a lower bound of the compute time, since under DDP the all-reduce "
           "overlaps backward. The all-reduce subtracted is the step message's (gloo's comm "
           "hook); the recorder's, which come seconds later, are not subtracted",
           show=Show(unit="ms", scale=1e3, plot="compute", group="step time",
                     overview=Overview("time", "compute", 0))),
    Metric("tokens_per_s", "extra", "float", "", "tokens per second of this rank: the "
           "`tokens` of its latest steps (those that end within 10 s) over their wall time, "
           "the sum of their `step_time_s` (from the end of the step before them to the end of "
           "the last: `scalemon.throughput`); where the script passes a rate of its own "
           "(`log(tokens_per_s=...)`), that one, labelled as the script's",
           show=Show(style="si", column="tok/s", width=6, plot="tokens/s", low_is_worse=True,
                     na="the script gives neither log(tokens=...) nor log(tokens_per_s=...)")),
    Metric("mfu", "extra", "float", "", "model FLOPs utilisation: achieved over peak FLOP/s of "
           "the device, a fraction (`log(mfu=...)`; the demo trainer sends it where it knows the "
           "GPU's peak)",
           show=Show(unit="%", scale=100.0, column="MFU", width=5, plot="MFU", low_is_worse=True,
                     na="the script does not log(mfu=...)")),
    Metric("moe_imbalance", "extra", "float", "", "mixture of experts: the most tokens routed "
           "to one expert rank over the mean per expert rank, in the step (1 = balanced; "
           "`log(moe_imbalance=...)`, as the demo trainer sends it)"),
    Metric("moe_dropped_tokens", "extra", "int", "", "mixture of experts: tokens routed over an "
           "expert's capacity and dropped in the step (`log(moe_dropped_tokens=...)`)"),
    Metric("moe_aux_loss", "extra", "float", "", "mixture of experts: the load-balancing "
           "auxiliary loss of the step (`log(moe_aux_loss=...)`)"),
    Metric("loss_scale", "step", "float", "", "AMP `GradScaler` scale after the step; null "
           "without a scaler",
           show=Show(style="loss_scale", column="loss scale", width=10,
                     plot="AMP loss scale, log", log=True, na="no AMP GradScaler",
                     low_is_worse=True, overview=Overview("scale", "scale"))),
    Metric("skipped", "step", "bool", "", "true when the AMP loss scale dropped, i.e. the "
           "optimizer step was skipped because of inf/NaN gradients. The scale is compared with "
           "the previous step's, or with the scaler's initial scale for the first step. Absent "
           "when `loss_scale` is null."),
    Metric("skipped_steps", "step", "int", "", "cumulative number of skipped steps on this rank "
           "process; absent when `loss_scale` is null"),
    Metric("scaler", "step", "str", "", "the AMP scaler given to `init(scaler=...)`: `\"on\"` "
           "when its scale is read, `\"off\"` when it is disabled (`GradScaler(enabled=False)`, "
           "or a CUDA `GradScaler` without CUDA): no loss scaling, and the loss scale reads "
           "\"off\"; null without a scaler or when the agent cannot read it"),
    Metric("mem_allocated_bytes", "step", "int", "bytes", "bytes held by tensors just after the "
           "step (read by the agent's sender thread, at most every 0.2 s: steps in between "
           "carry the last reading; the caching allocator's `allocated_bytes.all.current`, what "
           "`torch.cuda.memory_allocated()` returns); null on CPU ranks",
           show=Show(unit="GiB", scale=1 / 2**30, digits=2, column="alloc", width=6,
                     plot="alloc", group="GPU memory, torch", na=_NO_GPU, key=4,
                     overview=Overview("memory"))),
    Metric("mem_reserved_bytes", "step", "int", "bytes", "bytes the caching allocator holds from "
           "the driver (`reserved_bytes.all.current`, as `torch.cuda.memory_reserved()`); null "
           "on CPU ranks",
           show=Show(unit="GiB", scale=1 / 2**30, digits=2, column="resv", width=6,
                     plot="resv", group="GPU memory, torch", na=_NO_GPU)),
    Metric("mem_peak_bytes", "step", "int", "bytes", "peak of `mem_allocated_bytes` since start "
           "or the script's last reset (`allocated_bytes.all.peak`, as "
           "`torch.cuda.max_memory_allocated()`); null on CPU ranks",
           show=Show(unit="GiB", scale=1 / 2**30, digits=2, column="peak", width=6,
                     plot="peak", group="GPU memory, torch", na=_NO_GPU)),
    Metric("mem_alloc_retries", "step", "int", "", "cumulative number of `cudaMalloc` calls that "
           "failed and succeeded only after the caching allocator released its cached blocks "
           "(`num_alloc_retries`, as `torch.cuda.memory_stats()` names it; read with the other "
           "memory counters). Each retry synchronizes the device and flushes the cache, so a "
           "count that keeps growing means memory pressure that slows the steps before an "
           "out-of-memory error; null on CPU ranks",
           show=Show(style="int", column="retry", width=5, plot="cudaMalloc retries, cumulative",
                     na=_NO_GPU)),
    Metric("agent_time_s", "step", "float", "s", "seconds the agent spent on the training thread "
           "for this step, i.e. the monitor's own overhead. It is the time in the agent's hooks "
           "(forward pre-hook, optimizer step hooks, all-reduce comm hook) since the previous "
           "`log()` call, plus the duration of that previous `log()` call. A call's own cost is "
           "known only after it returns, so it is carried by the next step.",
           show=Show(unit="ms", scale=1e3, digits=3, plot="monitor overhead")),
    Metric("extra", "step", "map", "", "extra keyword values given to `log()` (str keys; number, "
           "str or null values: NumPy scalars and one-element tensors are read, CUDA ones "
           "without a sync, once the step completed; any other value is left out with a warning "
           "on the rank); present only when there are any. The reducer keeps the last value of "
           "each name in the rank's `extra`.", kept=False),
    # --- computed from the envelope --------------------------------------------------------
    Metric("heartbeat_age_s", "hub", "float", "s", "seconds since the rank's last message of any "
           "kind (the reader's clock minus the envelope `t`, so it needs clocks in sync); "
           "none once the rank exited or finished",
           show=Show(column="hb", unit="s", style="age", width=4)),
    # --- the heartbeat message -------------------------------------------------------------
    Metric("phase", "heartbeat", "str", "", "what the training thread is doing. The agent sets "
           "`init`, `forward-backward` (from the model's forward until the all-reduce or the "
           "optimizer starts), `allreduce`, `optimizer`, `after-optimizer` and `data`; scripts "
           "can set any other name with `set_phase()`. While the rank is stuck (no `log()` for "
           "the hang threshold) the agent's own phases give way to `collective` (it waits in "
           "one: a group issued more than it completed) or `python` (it does not; its `stack` "
           "tells where).", required=True, nullable=False),
    Metric("phase_since_s", "heartbeat", "float", "s", "time spent in the current `phase` so far "
           "(monotonic clock)"),
    Metric("step", "heartbeat", "int", "", "last step number passed to `log()`; null before the "
           "first", kept=False),
    Metric("collectives_issued", "heartbeat", "int", "", "cumulative number of collectives "
           "this rank issued, over every process group the Flight Recorder knows (the sum of the "
           "last sequence numbers in `groups`)"),
    Metric("collectives_completed", "heartbeat", "int", "", "cumulative number of those the "
           "recorder saw complete. `issued > completed` for a long time means a collective is "
           "stuck (gloo marks completion late: compare ranks, not the two numbers)."),
    Metric("groups", "heartbeat", "map", "", "per process group (by its name, as "
           "`collectives.groups` describes it): `[last issued, last completed]` collective "
           "sequence numbers, from the Flight Recorder's `pg_status`; null where it is not "
           "readable"),
    Metric("inflight", "heartbeat", "list", "", "only while the training thread is stuck (no "
           "`log()` for the hang threshold): the collectives issued and not completed, as "
           "`[group, seq, op, issue time (Unix s, this host's clock), bytes]` (bytes: the "
           "larger of input and output; older agents send the first four); else null"),
    Metric("p2p_inflight", "heartbeat", "list", "", "only while the training thread is stuck "
           "and waits inside a P2P `Work.wait()` (gloo: the agent's wrappers see it): every P2P "
           "op it issued that has not completed, as `[group, op (\"send\" or \"recv\"), peer "
           "global rank (-1: any source), issue time (Unix s, this host's clock), bytes]`; "
           "else null"),
    Metric("stack", "heartbeat", "str", "", "only while the training thread is stuck: its "
           "Python stack (`sys._current_frames()`, taken by the agent's own thread); else null"),
    Metric("same", "heartbeat", "list", "", "(1.14) the fields of `SENT_WHEN_CHANGED` (`groups`, "
           "`inflight`, `p2p_inflight`, `stack`) left out of this heartbeat because their "
           "values are those of the process's previous one: the reducer keeps what it has. "
           "An agent leaves them out only for a hub of 1.14 or later, and sends them whole "
           "again at least once a minute and after a heartbeat it dropped; absent when none "
           "is left out", kept=False),
    Metric("clock_offset_s", "heartbeat", "float", "s", "the hub's clock minus this host's, "
           "estimated from the round trip of the agent's pings (the fastest of the last 8); "
           "null until the hub answered",
           show=Show(unit="ms", scale=1e3, style="signed", digits=2,
                     plot="clock offset to the hub")),
    Metric("recorder_read_s", "heartbeat", "float", "s", "cumulative seconds the agent's "
           "background thread spent reading the Flight Recorder (never on the training "
           "thread)", show=Show(unit="ms", scale=1e3, digits=1,
                                plot="Flight Recorder reading, cumulative")),
    Metric("recorder_entries", "heartbeat", "int", "", "cumulative number of recorder entries "
           "read"),
    Metric("recorder_lost", "heartbeat", "int", "", "cumulative number of recorder entries "
           "overwritten before they were read (gaps in `record_id`: the ring of "
           "TORCH_FR_BUFFER_SIZE entries wrapped between two reads)"),
    Metric("gpu_mem_used_bytes", "heartbeat", "int", "bytes", "NVML device memory in use (all "
           "processes on the GPU); null without GPU/NVML",
           show=Show(unit="GiB", scale=1 / 2**30, style="used_of", of="gpu_mem_total_bytes",
                     column="NVML", width=7, plot="GPU memory used, NVML", na=_NO_NVML)),
    Metric("gpu_mem_total_bytes", "heartbeat", "int", "bytes", "NVML device memory size; null "
           "without GPU/NVML"),
    Metric("gpu_util_pct", "heartbeat", "float", "%", "NVML GPU utilisation (share of time a "
           "kernel was running); null without GPU/NVML",
           show=Show(unit="%", style="int", column="GPU", width=5, plot="GPU utilisation",
                     na=_NO_NVML, low_is_worse=True)),
    Metric("gpu_power_w", "heartbeat", "float", "W", "NVML board power draw; null without "
           "GPU/NVML", show=Show(unit="W", style="int", plot="GPU power", na=_NO_NVML)),
    Metric("gpu_temp_c", "heartbeat", "float", "°C", "NVML GPU temperature; null without "
           "GPU/NVML", show=Show(unit="°C", style="int", plot="GPU temperature", na=_NO_NVML)),
    Metric("cpu_pct", "heartbeat", "float", "%", "CPU use of the rank process since the previous "
           "heartbeat; 100 = one core, can exceed 100",
           show=Show(unit="%", style="int", column="CPU", width=5, plot="CPU, 100 = one core")),
    Metric("rss_bytes", "heartbeat", "int", "bytes", "resident memory of the rank process",
           show=Show(unit="GiB", scale=1 / 2**30, digits=2, plot="process RSS")),
    Metric("dropped", "heartbeat", "int", "", "cumulative number of messages this rank dropped "
           "before sending ([section 7](#7-seq-drops-and-gaps))", required=True, nullable=False),
    Metric("queued", "heartbeat", "int", "", "messages waiting in the agent's send queues at this "
           "moment, including steps still waiting for the GPU"),
)

SENT_WHEN_CHANGED = ("groups", "inflight", "p2p_inflight", "stack")
"""The heartbeat's nested values that an agent sends when they change and, while they do not,
names in `same` (1.14): a hung job of 16,384 ranks would otherwise send each rank's stack and
collectives in flight every second, to be checked and folded again."""

KEPT: tuple[Metric, ...] = ()
"""The values a rank view holds (what `scalemon snapshot --json` shows per rank)."""
BY_NAME: dict[str, Metric] = {}
"""Every kept metric by name (the names the reducer, the JSON and the dashboard use)."""
COLUMNS: tuple[Metric, ...] = ()
"""Metrics with a column in the rank tables, in table order."""
PLOTTED: tuple[Metric, ...] = ()
"""Metrics the rank detail plots, in table order."""
AGGREGATED: tuple[Metric, ...] = ()
"""Metrics whose min/mean/max over the ranks the reducer keeps per step (for the overview)."""


def derive() -> None:
    """Make the views above from `METRICS`. Runs once at import; every module that uses the
    table reads these (or `METRICS`) when it is imported, so a test can add a row to `METRICS`
    and call this before importing the rest (`tests/test_metrics.py` shows that a metric is
    one row)."""
    global KEPT, BY_NAME, COLUMNS, PLOTTED, AGGREGATED
    KEPT = tuple(m for m in METRICS if m.kept and m.source in ("step", "heartbeat", "extra", "hub"))
    BY_NAME = {m.name: m for m in METRICS if m.kept}
    COLUMNS = tuple(m for m in METRICS if m.show and m.show.column)
    PLOTTED = tuple(m for m in METRICS if m.show and m.show.plot)
    AGGREGATED = tuple(m for m in METRICS if m.aggregated)


derive()


def fields_of(source: str) -> tuple[Metric, ...]:
    """The body fields of message `source` ("step" or "heartbeat"), in table order."""
    return tuple(m for m in METRICS if m.source == source)


def latest_of(source: str) -> tuple[str, ...]:
    """Names of the fields of message `source` whose latest value the reducer keeps."""
    return tuple(m.name for m in fields_of(source) if m.kept)


_WIRE_TYPES: dict[str, tuple[type, ...]] = {
    "float": (int, float), "int": (int,), "bool": (bool,), "str": (str,), "map": (dict,),
    "list": (list,),
}


def wire_types(metric: Metric) -> tuple[type, ...]:
    """The Python types `protocol.decode` accepts for a field (None where nullable)."""
    types = _WIRE_TYPES[metric.kind]
    return (*types, type(None)) if metric.nullable else types


def plot_panels() -> list[tuple[str, tuple[Metric, ...]]]:
    """The rank detail's plot panels: (title, metrics drawn in it), in table order."""
    panels: list[tuple[str, list[Metric]]] = []
    groups: dict[str, list[Metric]] = {}
    for m in PLOTTED:
        assert m.show is not None and m.show.plot is not None
        if m.show.group is None:
            panels.append((m.show.plot, [m]))
        elif m.show.group in groups:
            groups[m.show.group].append(m)
        else:
            groups[m.show.group] = [m]
            panels.append((m.show.group, groups[m.show.group]))
    return [(title, tuple(ms)) for title, ms in panels]


def overview_lines(panel: str) -> tuple[Metric, ...]:
    """The metrics drawn in overview plot `panel`, in their `Overview.order`."""
    return tuple(sorted((m for m in AGGREGATED if m.show and m.show.overview
                         and m.show.overview.panel == panel),
                        key=lambda m: m.show.overview.order if m.show and m.show.overview else 0))


# --- docs/protocol.md -----------------------------------------------------------------------

DOCS = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
_BLOCK = re.compile(r"(<!-- metrics:(\w+) begin[^>]*-->\n)(.*?)(<!-- metrics:\2 end -->)", re.S)


def markdown_fields(source: str) -> str:
    """The field table of a message for docs/protocol.md."""
    lines = ["| field | type | required | nullable | unit | meaning |",
             "|---|---|---|---|---|---|"]
    for m in fields_of(source):
        required = "yes" if m.required else "no"
        nullable = "yes" if m.nullable else ("no" if m.required else "**no**")
        lines.append(f"| `{m.name}` | `{KINDS[m.kind]}` | {required} | {nullable} | {m.unit} | "
                     f"{m.description} |")
    return "\n".join(lines) + "\n"


def markdown_state_keys() -> str:
    """The per-rank metric keys of the `state` map, for docs/protocol.md section 9.3."""
    by_source = {
        "step": "the latest `step` values",
        "heartbeat": "the latest `heartbeat` values",
        "extra": "well-known `extra` names, also shown as dashboard columns (inside `extra`)",
        "hub": "computed when the state is read",
    }
    lines = []
    for source, what in by_source.items():
        names = [m.name for m in KEPT if m.source == source]
        lines.append(f"* {what}: " + ", ".join(f"`{n}`" for n in names) + ";")
    lines.append("* `extra`: map of every name the rank passed to `log(**extra)` → its last "
                 "value (a name absent from a step keeps its earlier value).")
    return "\n".join(lines) + "\n"


def markdown_dashboard() -> str:
    """What the reference dashboard computes from the folded messages, for section 13."""
    return "".join(f"* `{m.name}` ({m.unit or 'no unit'}): {m.description}\n"
                   for m in METRICS if m.source == "dashboard")


GENERATED = {"step": lambda: markdown_fields("step"),
             "heartbeat": lambda: markdown_fields("heartbeat"),
             "state": markdown_state_keys,
             "dashboard": markdown_dashboard}


def render_docs(text: str) -> str:
    """`text` (docs/protocol.md) with every generated block rewritten from the table."""
    def block(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in GENERATED:
            raise ValueError(f"unknown generated block {name!r} in the docs")
        return match.group(1) + GENERATED[name]() + match.group(4)

    return _BLOCK.sub(block, text)


def derived_values(values: Mapping[str, Any], tokens_per_s: float | None = None
                   ) -> dict[str, float]:
    """The table's derived metrics of one step's values (a `step` body, or a snapshot's rank),
    the one rule for them: `tokens_per_s` is the rank's figure by `scalemon.throughput`'s
    definition as of this step (given: its window of steps, `TokenWindow.rate`), left out
    where None; `compute_s` the step time less its all-reduce and optimizer time. A value
    that cannot be derived is left out. The state folds them once per step
    (`RankView.derived`); series and texts made from records or JSON apply the same rule."""
    out: dict[str, float] = {}
    step_time = values.get("step_time_s")
    if tokens_per_s is not None:
        out["tokens_per_s"] = tokens_per_s
    if type(step_time) in (int, float):
        busy = 0.0
        for v in (values.get("allreduce_time_s"), values.get("optimizer_time_s")):
            if type(v) in (int, float):
                busy += v
        out["compute_s"] = max(0.0, step_time - busy)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m scalemon.metrics`: print the table, or rewrite the docs' generated blocks."""
    p = argparse.ArgumentParser(allow_abbrev=False,
                                description="scalemon's table of per-rank metrics")
    p.add_argument("--update-docs", action="store_true",
                   help=f"rewrite the generated field tables in {DOCS.name}")
    args = p.parse_args(argv)
    if args.update_docs:
        text = DOCS.read_text()
        new = render_docs(text)
        DOCS.write_text(new)
        print(f"{DOCS}: {'updated' if new != text else 'already up to date'}")
        return 0
    for m in METRICS:
        shown = m.show.heading if m.show and m.show.column else ""
        print(f"{m.source:<10} {m.name:<22} {m.kind:<6} {m.unit:<9} {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
