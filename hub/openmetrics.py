"""OpenMetrics export of a hub's job state: `/metrics` over HTTP and/or a textfile for
node_exporter, in the Prometheus text format made by `prometheus_client`.

`scalemon hub --metrics HOST:PORT` (or `$SCALEMON_METRICS`) serves `/metrics`;
`--metrics-file PATH` (or `$SCALEMON_METRICS_FILE`) writes the same text every few seconds,
atomically (a temporary file in the same directory, renamed over the old one).

Thread safety: the hub's state is changed by its main loop only. That loop builds the metric
families from it (`families`) in its housekeeping, every `SNAPSHOT_S` seconds (less often when
a build is slow: `BUILD_SHARE`), and swaps in the new list; the HTTP server's threads only
read the latest list, never the state, so a scrape never sees a dict changing size. (Writing
the text out still holds the GIL: at 4096 ranks about 0.4 s per scrape, ingest waits in its
queues meanwhile.)

A value not measured (None: no GPU, no optimizer, no step yet) has no sample; a loss that is
NaN or infinite is exported as such (a real finding, not a missing value).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest, make_wsgi_app
from prometheus_client.registry import Collector, CollectorRegistry

from scalemon import settings, throughput
from scalemon.reports.groups import collectives_table
from scalemon.reports.hangs import job_hang
from scalemon.reports.pipeline import moe_json, p2p_rows, pipeline_json
from scalemon.state import alerts as alerting

from . import METRICS_ENV, METRICS_FILE_ENV

if TYPE_CHECKING:
    from scalemon.state.jobstate import JobState

log = logging.getLogger("scalemon.hub")

SNAPSHOT_S = 1.0
"""The families served are rebuilt from the state at most this often..."""
BUILD_SHARE = 0.05
"""...and less often where a build takes longer, so that the hub's loop spends at most this
share of its time on them (a 4096-rank job's build takes about 0.3 s: one every 6 s)."""
FILE_EVERY_S = 5.0
"""The metrics file is rewritten this often."""
LOOPBACK = "127.0.0.1"
_WILDCARDS = ("", "*", "0.0.0.0", "::")


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

_T = TypeVar("_T")
RANK_LABELS = ("job", "rank", "host")
COLLECTIVE_LABELS = ("job", "group", "op")
P2P_LABELS = ("job", "group", "op", "src", "dst")


class MetricsAddressError(ValueError):
    """A --metrics / $SCALEMON_METRICS value that is not [HOST]:PORT."""


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `[IPv6]:PORT`, `:PORT` or `PORT` -> (host, port); no host: 127.0.0.1.
    Raises MetricsAddressError saying what is expected."""
    value = text.strip()
    if value.startswith("http://"):
        value = value[len("http://"):].split("/", 1)[0]
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "", value
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port.isdigit() or int(port) > 65535:
        raise MetricsAddressError(
            f"metrics address {text!r}: expected HOST:PORT, :PORT (127.0.0.1) or PORT, with a "
            "port of 0 (any free port) to 65535, e.g. 127.0.0.1:9464")
    return (host or LOOPBACK), int(port)


def families(state: JobState, job: str, now: float | None = None) -> list[Metric]:
    """The metric families of `state` as they are now (call from the thread that owns it)."""
    now = time.time() if now is None else now
    views = [state.ranks[r] for r in sorted(state.ranks)]
    out: list[Metric] = []
    step = GaugeMetricFamily("scalemon_step", "Latest step number of the rank.",
                             labels=RANK_LABELS)
    up = GaugeMetricFamily("scalemon_rank_up", "1 while the rank runs, 0 once it stopped "
                           "sending (frozen, gone, unreachable, silent), exited, finished, was "
                           "stopped or restarts.", labels=RANK_LABELS)
    rank_state = GaugeMetricFamily(
        "scalemon_rank_state", "1 for the rank's current state: running; frozen (its process "
        "exists but sends nothing: the job hangs on it), gone (its process ended without "
        "reporting an exit), unreachable (its node's relay is silent too), silent (nothing on "
        "its node can look at its process); exited, finished, stopped, restarting.",
        labels=[*RANK_LABELS, "state"])
    labels = [[job, str(view.rank), view.host or ""] for view in views]
    for view, names in zip(views, labels, strict=True):
        if view.step is not None:
            step.add_metric(names, view.step)
        up.add_metric(names, 1 if view.state == "running" else 0)
        rank_state.add_metric([*names, view.state], 1)
    out += [step, up, rank_state]
    for gauge in RANK_GAUGES:
        family = GaugeMetricFamily(f"scalemon_{gauge.name}", gauge.help, labels=RANK_LABELS)
        for view, names in zip(views, labels, strict=True):
            if gauge.source == "tokens_per_s":  # live: 0 when stalled, none once ended
                value = _number(throughput.rank_figure_at(view, now).live, gauge.nan)
            else:
                value = _number(view.value(gauge.source, now), gauge.nan)
            if value is not None:
                family.add_metric(names, value * gauge.scale)
        out.append(family)
    out += _collective_families(state, job)
    out += _parallel_families(state, job)
    out += _job_families(state, job, now)
    return out


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


def _parallel_families(state: JobState, job: str) -> list[Metric]:
    """Sends and receives per (group, op, src, dst), the pipeline's bubble (theory and the
    ranks' median) and the MoE routing's balance (`reports.pipeline`)."""
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
    out = [ops, nbytes, seconds, theory, measured]
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


class _Latest(Collector):
    """The registry's one collector: it yields the families last built by the hub's loop."""

    def __init__(self) -> None:
        self.latest: list[Metric] = []

    def collect(self) -> Iterable[Metric]:
        return list(self.latest)  # one reference read: the list itself is never changed


class Exporter:
    """The export of one hub: an HTTP server (`url`) and/or a file, fed by `update`."""

    def __init__(self, job: str, address: tuple[str, int] | None = None,
                 path: Path | None = None) -> None:
        """Start the HTTP server at `address` (port 0: any free one); raises OSError when it
        cannot bind. The file at `path` is written from the first `update` on."""
        self.job = job
        self.path = path
        self._collector = _Latest()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self._collector)
        self.url: str | None = None
        self._server: WSGIServer | None = None
        self._built = self._written = -math.inf
        self._build_every = SNAPSHOT_S
        self._file_every = FILE_EVERY_S
        self._file_error: str | None = None
        if address is not None:
            host, port = address
            self._server = _serve(self.registry, "0.0.0.0" if host == "*" else host, port)
            bound = self._server.server_address[1]
            self.url = f"http://{_url_host(host)}:{bound}/metrics"

    def update(self, state: JobState, now: float, force: bool = False) -> None:
        """From the hub's loop: rebuild the families (every SNAPSHOT_S, or longer: BUILD_SHARE)
        and write the file (every FILE_EVERY_S, or longer); `force` does both now. Never
        raises: the hub goes on."""
        if force or now - self._built >= self._build_every:
            self._built = now
            started = time.perf_counter()
            try:
                self._collector.latest = families(state, self.job)
            except Exception:  # a bug here must not take the hub down
                log.exception("could not build the OpenMetrics families")
            took = time.perf_counter() - started
            self._build_every = max(SNAPSHOT_S, took / BUILD_SHARE)
        if self.path is not None and (force or now - self._written >= self._file_every):
            self._written = now
            started = time.perf_counter()
            self._write_file()
            took = time.perf_counter() - started
            self._file_every = max(FILE_EVERY_S, took / BUILD_SHARE)

    def text(self) -> bytes:
        """The exposition of the latest families (what `/metrics` serves)."""
        return generate_latest(self.registry)

    def _write_file(self) -> None:
        assert self.path is not None
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(self.text())
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            error = f"{type(exc).__name__}: {exc}"
            if error != self._file_error:  # said once, not every few seconds
                log.error("could not write the metrics file %s: %s (retrying every %.0f s)",
                          self.path, exc, FILE_EVERY_S)
            self._file_error = error
            return
        if self._file_error is not None:
            log.info("metrics file %s written again", self.path)
            self._file_error = None

    def close(self) -> None:
        """Stop the HTTP server (the file stays, with the last state written)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    """A WSGI server with a daemon thread per request (a slow scraper holds only its own)."""

    daemon_threads = True


class _V6Server(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    """No access log on the hub's stderr (hub.log) for every scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _serve(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """`/metrics` of `registry` served by a daemon thread; raises OSError when it cannot
    bind."""
    server_class = _V6Server if ":" in host else _Server
    server = make_server(host, port, make_wsgi_app(registry), server_class, _Quiet)
    threading.Thread(target=server.serve_forever, name="openmetrics", daemon=True).start()
    return server


def _url_host(host: str) -> str:
    """The host to put in the URL: a wildcard binds every interface, so this host's name."""
    if host in _WILDCARDS:
        fqdn = socket.getfqdn()
        return fqdn if fqdn and fqdn != "localhost" else socket.gethostname()
    return f"[{host}]" if ":" in host else host


def start_exporter(job: str, address: str | None, path: str | None) -> Exporter | None:
    """The exporter the hub's options ask for, each option defaulting to its environment
    variable ($SCALEMON_METRICS, $SCALEMON_METRICS_FILE); None when neither is asked for.

    A bad option value or a port in use raises ValueError/OSError saying which (the hub
    reports it and exits 2). The same from the environment is logged and that export left
    out: an auto-started hub must not fail the job over its metrics."""
    bind = _option(address, METRICS_ENV, "--metrics", parse_address)
    file = _option(path, METRICS_FILE_ENV, "--metrics-file", _metrics_file)
    if bind is None and file is None:
        return None
    try:
        exporter = Exporter(job, bind, file)
    except OSError as exc:
        assert bind is not None
        error = (f"cannot serve metrics on {bind[0]}:{bind[1]}: {exc.strerror or exc} (choose "
                 "another port, or port 0 for any free one)")
        if address is not None:
            raise OSError(f"--metrics: {error}") from None
        log.error("$%s: %s; serving no metrics over HTTP", METRICS_ENV, error)
        if file is None:
            return None
        exporter = Exporter(job, None, file)
    if exporter.url:
        log.info("serving OpenMetrics on %s", exporter.url)
    if exporter.path:
        log.info("writing OpenMetrics to %s every %.0f s", exporter.path, FILE_EVERY_S)
    return exporter


def _option(value: str | None, env: str, option: str,
            parse: Callable[[str], _T]) -> _T | None:
    """`parse(value)`; without a value, `parse($env)`, where an error is logged, not raised."""
    if value is not None:
        try:
            return parse(value)
        except ValueError as exc:
            raise ValueError(f"{option}: {exc}") from None
    from_env = settings.raw(env)
    if not from_env:
        return None
    try:
        return parse(from_env)
    except ValueError as exc:
        log.error("$%s: %s; exporting no metrics that way", env, exc)
        return None


def _metrics_file(text: str) -> Path:
    """The metrics file to write; ValueError when its directory does not exist."""
    path = Path(text).expanduser().absolute()
    if not path.parent.is_dir():
        raise ValueError(f"{text!r}: directory {str(path.parent)!r} does not exist; create it "
                         "or name another file")
    return path
