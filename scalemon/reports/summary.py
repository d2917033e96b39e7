"""A run's summary, and two runs compared: pure functions from a job's history and state.

`run_records` reads a job's history (every `step` message of every rank, every heartbeat's
memory) into per-step series; `summarize` makes the summary of `scalemon summary --json` from
them (through `figures_of`), or from the `RunFigures` of a long history's digest
(`scalemon.state.digest`), and the job's state (`reports.snapshot.snapshot_json`);
`compare` puts two summaries side by side with ratios B/A; `scalemon.reports.summary_text`
writes them for people. The JSON schema is in docs/summary.md. Every number that is not
finite (a NaN loss) becomes None (JSON null).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from scalemon import throughput
from scalemon.metrics import derived_values
from scalemon.protocol import Message
from scalemon.reports import stragglers
from scalemon.reports.parallel_text import is_p2p
from scalemon.state.fold import step_values
from scalemon.state.runfigures import (
    Quantiles,
    RunFigures,
    StepClock,
    exact_quantile,
    finite,
    per_step_total,
    quantiles_of,
    series_of,
)

SLOWEST_SHOWN = 3
"""How many of the slowest ranks (by median step time) the summary names."""
RANK_LINES_MAX = 16
"""The text form writes a line per rank up to this many ranks; beyond, half as many: the
largest (slowest, most memory). --json has every rank."""
STALLS_SHOWN = 10
"""How many stalls (no rank completed a step for the hang threshold) the summary lists."""
LOSS_AT = (0.1, 0.5, 1.0)
"""Where in the steps both runs have a loss for `compare` reads them (fractions of the range),
besides the last common step."""
SCHEMA = 1
"""The version of the summary's JSON layout (docs/summary.md)."""


@dataclass
class RunRecords:
    """What a summary needs from a job's history: each rank's values by step (a restarted
    rank's repeated steps: the later record wins) and its largest memory readings."""

    steps: dict[int, dict[int, dict[str, float]]] = field(default_factory=dict)
    """rank -> step -> the step's numbers (`fold.step_values`: loss, step_time_s,
    tokens_per_s (the rank's as of the step, as the dashboard showed it: `scalemon.throughput`;
    or the script's own), mfu, mem_*_bytes, compute_s ...)."""
    own_rate: set[int] = field(default_factory=set)
    """Ranks that sent a tokens_per_s of their own (`log(tokens_per_s=...)`)."""
    step_t: dict[int, dict[int, float]] = field(default_factory=dict)
    """rank -> step -> when the step message was sent (the rank's clock)."""
    heartbeat_max: dict[int, dict[str, float]] = field(default_factory=dict)
    """rank -> the largest `rss_bytes` and `gpu_mem_used_bytes` its heartbeats carried."""
    bubbles: dict[int, dict[int, float]] = field(default_factory=dict)
    """rank -> step -> the step's `pipeline_bubble` (ranks of a pipeline, steps with P2P)."""


HEARTBEAT_MEMORY = ("rss_bytes", "gpu_mem_used_bytes")


def run_records(messages: Iterable[Message]) -> RunRecords:
    """The per-step series of every rank from a job's messages, in history order."""
    bodies: dict[int, dict[int, tuple[float, dict[str, Any]]]] = {}
    out = RunRecords()
    own_rate = out.own_rate
    for msg in messages:
        if msg.type == "step":
            bodies.setdefault(msg.rank, {})[msg.body["step"]] = (msg.t, msg.body)
            extra = msg.body.get("extra")
            if extra and "tokens_per_s" in extra:
                own_rate.add(msg.rank)
        elif msg.type == "heartbeat":
            seen = out.heartbeat_max.setdefault(msg.rank, {})
            for name in HEARTBEAT_MEMORY:
                value = msg.body.get(name)
                if type(value) in (int, float) and value > seen.get(name, -1):
                    seen[name] = float(value)
    for rank, by_step in sorted(bodies.items()):
        window = throughput.TokenWindow()  # the rank's tokens/s as of each step
        out.steps[rank] = {}
        for s, (_, b) in sorted(by_step.items()):
            window.add(b.get("tokens"), b.get("step_time_s"))
            # as the dashboard: never mixed with the script's own
            rate = None if rank in own_rate else window.rate()
            out.steps[rank][s] = step_values(b, derived_values(b, rate))
        out.step_t[rank] = {s: t for s, (t, _) in sorted(by_step.items())}
        bubbles = {s: b["pipeline_bubble"] for s, (_, b) in sorted(by_step.items())
                   if finite(b.get("pipeline_bubble")) is not None}
        if bubbles:
            out.bubbles[rank] = bubbles
    return out


# --- numbers ---------------------------------------------------------------------------------
quantile = exact_quantile
"""The `q` quantile (0..1) of the finite values, interpolated as numpy does (`runfigures`)."""
__all__ = ["finite", "quantile"]


def ratio(b: Any, a: Any) -> float | None:
    """b / a, or None where either is unknown or a is 0."""
    a, b = finite(a), finite(b)
    if a is None or b is None or a == 0:
        return None
    return b / a


def _stats(values: list[float] | Quantiles, quantiles: dict[str, float]) -> dict[str, Any]:
    found = values if isinstance(values, Quantiles) else quantiles_of(values)
    return found.stats(quantiles)


def figures_of(records: RunRecords, coords: Mapping[int, Any]) -> RunFigures:
    """The figures of every record kept (exact); `coords`: rank -> mesh coordinates (which
    ranks' tokens/s count for the job, `throughput.counted`)."""
    steps = records.steps
    out = RunFigures(ranks=set(steps), own_rate=set(records.own_rate),
                     heartbeat_max=records.heartbeat_max)
    out.last_step = {r: max(s) for r, s in steps.items() if s}
    every = {s for by_step in steps.values() for s in by_step}
    out.step_count, out.first_step = len(every), (min(every) if every else None)
    for by_step in records.step_t.values():
        for s, t in by_step.items():
            out.clock.add(t, s)
    losses = {r: s for r, s in series_of(steps, "loss").items() if s}
    if losses:
        out.loss_rank = min(losses)
        out.loss = losses[out.loss_rank]
    tokens = series_of(steps, "tokens_per_s")
    out.tokens_ranks = throughput.counted((r, coords.get(r)) for r in sorted(tokens)
                                          if tokens[r])
    counted = {r: tokens[r] for r in out.tokens_ranks}
    out.tokens_job = quantiles_of(per_step_total(counted, "sum", lambda rates: (
        throughput.job_tokens_per_s((v, coords.get(r)) for r, v in rates))))
    out.tokens_per_rank = quantiles_of(v for s in tokens.values() for v in s.values())
    out.mfu = quantiles_of(per_step_total(series_of(steps, "mfu"), "mean"))
    times = series_of(steps, "step_time_s")
    out.step_time = {r: quantiles_of(s.values()) for r, s in sorted(times.items())}
    out.step_time_all = quantiles_of(v for s in times.values() for v in s.values())
    out.compute_median = {r: quantile(s.values(), 0.5)
                          for r, s in series_of(steps, "compute_s").items()}
    out.bubbles = quantiles_of(b for by_step in records.bubbles.values()
                               for b in by_step.values())
    for rank, by_step in steps.items():
        row: dict[str, float | None] = {}
        for name in ("mem_allocated_bytes", "mem_peak_bytes"):
            values = [v[name] for v in by_step.values() if finite(v.get(name)) is not None]
            row[name] = max(values) if values else None
        out.memory[rank] = row
    return out


# --- the summary -----------------------------------------------------------------------------
def summarize(state: Mapping[str, Any], records: RunRecords | RunFigures,
              source: dict[str, Any] | None = None) -> dict[str, Any]:
    """The summary of a run (docs/summary.md) from its state and its history's records (or
    their `RunFigures`)."""
    ranks = list(state.get("ranks") or [])
    by_rank = {r["rank"]: r for r in ranks}
    if isinstance(records, RunRecords):
        records = figures_of(records, {r: v.get("mesh") for r, v in by_rank.items()})
    per_rank_time = _step_time_per_rank(records)
    return {
        "schema": SCHEMA,
        "job": state.get("job"),
        "state": state.get("state"),
        "world_size": state.get("world_size"),
        "source": source or {},
        "steps": _steps(records, by_rank),
        "wall_time": _wall_time(state, records),
        "loss": _loss(records),
        "tokens_per_s": _throughput(records),
        "mfu": _mfu(records),
        "step_time": per_rank_time,
        "stragglers": _stragglers(state, records, per_rank_time),
        "hangs": _hangs(state, records),
        "first_failure": state.get("first_failure"),
        "toggles": list(state.get("toggles") or []),
        "collectives": [_collective(c) for c in state.get("collectives") or []
                        if not is_p2p(c)],
        "p2p": [_p2p(c) for c in state.get("collectives") or [] if is_p2p(c)],
        "mesh": state.get("mesh"),
        "pipeline": _pipeline(state, records),
        "moe": state.get("moe"),
        "memory": _memory(records, sorted(set(by_rank) | records.ranks)),
        "config": _config(state),
        "flags": _flags(state),
        "versions": _versions(ranks),
    }


def _steps(records: RunFigures, by_rank: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """The first and last step numbers logged, how many steps, each rank's last."""
    last = dict(records.last_step)
    for rank, view in by_rank.items():  # a rank whose steps are not in the records
        if rank not in last and isinstance(view.get("step"), int):
            last[rank] = view["step"]
    return {
        "first": records.first_step,
        "last": max(last.values()) if last else None,
        "last_on_every_rank": min(last.values()) if last else None,
        "count": records.step_count,
        "last_per_rank": {str(r): s for r, s in sorted(last.items())},
    }


def _wall_time(state: Mapping[str, Any], records: RunFigures) -> dict[str, Any]:
    """Seconds from the first message to the last, and from the first step to the last."""
    started, last = finite(state.get("started_t")), finite(state.get("last_t"))
    first_t, last_t = records.clock.first, records.clock.last
    return {
        "started_t": started, "last_t": last,
        "seconds": last - started if started is not None and last is not None else None,
        "steps_seconds": last_t - first_t if first_t is not None and last_t is not None
        else None,
    }


def _loss(records: RunFigures) -> dict[str, Any]:
    """First, last and least loss of the lowest rank that logs one (the rank a trainer prints
    for), with their steps, and how many of its losses were NaN or infinite."""
    if records.loss_rank is None or not records.loss:
        return {"rank": None, "first": None, "last": None, "min": None, "nonfinite": 0}
    rank = records.loss_rank
    values = records.loss
    steps = sorted(values)
    good = [(v, s) for s, v in values.items() if finite(v) is not None]
    best = min(good) if good else None
    return {
        "rank": rank,
        "first": {"step": steps[0], "value": values[steps[0]]},
        "last": {"step": steps[-1], "value": values[steps[-1]]},
        "min": {"step": best[1], "value": best[0]} if best else None,
        "nonfinite": len(values) - len(good),
    }


def loss_series(records: RunRecords | RunFigures) -> dict[int, float]:
    """step -> loss of the rank `summarize` takes the loss of (the lowest that logs one)."""
    if isinstance(records, RunFigures):
        return dict(records.loss)
    series = {r: s for r, s in series_of(records.steps, "loss").items() if s}
    return series[min(series)] if series else {}


def _throughput(records: RunFigures) -> dict[str, Any]:
    """tokens/s (`scalemon.throughput`) of one rank (its figure as of each step, as the
    dashboard showed it then) and of the job (per step, `job_tokens_per_s` of the ranks'
    figures: of a tp group x pipeline the member nearest coordinate 0 with figures,
    `throughput.counted`), median and p10 over the steps (p10: the slow tail); `source`:
    `steps`, or `script` where a counted rank's is its script's own."""
    q = {"median": 0.5, "p10": 0.1}
    source = throughput.job_source(
        throughput.SCRIPT if r in records.own_rate else throughput.STEPS
        for r in records.tokens_ranks)
    return {"job": _stats(records.tokens_job, q), "per_rank": _stats(records.tokens_per_rank, q),
            "source": source}


def _mfu(records: RunFigures) -> dict[str, Any]:
    """MFU (a fraction; the ranks' mean per step), median and p10 over the steps; None
    (null) where no rank logs one (a device of unknown peak FLOP/s)."""
    return _stats(records.mfu, {"median": 0.5, "p10": 0.1})


def _step_time_per_rank(records: RunFigures) -> dict[str, Any]:
    """Each rank's step time (median, p90 over its steps), the median of the ranks' medians,
    the p90 of every rank's steps, and the slowest ranks: those whose median is over the
    ranks' median, slowest first."""
    q = {"median": 0.5, "p90": 0.9}
    per_rank = {r: _stats(s, q) for r, s in sorted(records.step_time.items())}
    known = {r: v["median"] for r, v in per_rank.items() if v["median"] is not None}
    middle = quantile(known.values(), 0.5)
    slower = [r for r, v in known.items() if middle is not None and v > middle]
    slowest = sorted(slower, key=lambda r: (-known[r], r))[:SLOWEST_SHOWN]
    return {
        "median": middle,
        "p90": records.step_time_all.quantile(0.9),
        "per_rank": {str(r): v for r, v in per_rank.items()},
        "slowest": [{"rank": r, "median": known[r]} for r in slowest],
    }


def _stragglers(state: Mapping[str, Any], records: RunFigures,
                step_time: Mapping[str, Any]) -> dict[str, Any]:
    """The stragglers now (the state's, `scalemon.reports.stragglers`), and over the run by the same
    rule and bar: a rank's arrival lateness at collectives where the ranks have one (the state's
    last), else its median compute time over the median rank's."""
    compute = records.compute_median
    known = [v for v in compute.values() if v is not None]
    middle = quantile(known, 0.5) if known else None
    over = {r: v - middle if v is not None and middle is not None else None
            for r, v in compute.items()}
    lateness = {r["rank"]: finite(r.get("arrival_lateness_s"))
                for r in state.get("ranks") or []}
    ranks = sorted(records.ranks | set(lateness))
    values, basis = stragglers.measure(ranks, lateness, over)
    median = step_time.get("median")
    run = [{"rank": r, "measure": stragglers.MEASURE_FIELDS[basis], "value_s": v,
            "bar_s": stragglers.straggler_bar(median)}
           for r, v in stragglers.stragglers(values, median)]
    return {"now": list(state.get("stragglers") or []), "over_run": run,
            "basis": basis or None}


def _hangs(state: Mapping[str, Any], records: RunFigures) -> dict[str, Any]:
    """The hang now (a live job's), the hang it ended in (`hangs.last_hang`), and the stalls
    of the run: stretches where no rank completed a step for the job's hang threshold
    (`hang_after_s`; at least a second, `stall_after_s`: the history's clock is kept to the
    second, `StepClock`), the hang it ended in the last of them."""
    hang, last = state.get("hang"), state.get("last_hang")
    after = finite(state.get("hang_after_s"))
    stalls = [{"after_step": s0, "seconds": seconds, "t": t0}
              for t0, s0, seconds in records.clock.stalls(after)]
    if last:
        stalls.append({"after_step": last.get("step"), "seconds": last.get("since_s"),
                       "t": last["ended_t"] - (last.get("since_s") or 0.0)})
    return {
        "now": {"text": hang["text"], "since_s": hang.get("since_s"),
                "culprits": hang.get("culprits") or []} if hang else None,
        "last": {k: last.get(k) for k in ("summary", "text", "since_s", "culprits", "step",
                                          "end")} if last else None,
        "hang_after_s": after,
        "stall_after_s": None if after is None else StepClock.stall_floor(after),
        "stalls": sorted(stalls, key=lambda s: -s["seconds"])[:STALLS_SHOWN],
        "stall_count": len(stalls),
        "alerts": [{k: a.get(k) for k in ("kind", "ranks", "since_step", "text")}
                   for a in state.get("alerts") or []],
        "fr_dumps": len(state.get("fr_dumps") or []),
    }


def _collective(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: row.get(k) for k in ("group", "op", "ranks", "count", "bytes", "time_p50_s",
                                    "time_total_s", "busbw_gbps")}


def _p2p(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: row.get(k) for k in ("group", "op", "src", "dst", "count", "bytes", "time_s",
                                    "bandwidth_bytes_per_s")}


def _pipeline(state: Mapping[str, Any], records: RunFigures) -> dict[str, Any] | None:
    """The state's pipeline (schedule, stages, microbatches, theoretical and latest measured
    bubble) and `measured_bubble_run`: median and p90 of every rank's `pipeline_bubble` over
    the steps of the run; None without a pipeline."""
    bubbles = records.bubbles
    pipeline = state.get("pipeline")
    if not pipeline and not bubbles.n:
        return None
    return {**(pipeline or {}),
            "measured_bubble_run": _stats(bubbles, {"median": 0.5, "p90": 0.9})}


def _memory(records: RunFigures, ranks: list[int]) -> dict[str, Any]:
    """Each rank's largest memory readings over the run, and the largest of any rank."""
    per_rank = {}
    for rank in ranks:
        row: dict[str, Any] = {name: (records.memory.get(rank) or {}).get(name)
                               for name in ("mem_allocated_bytes", "mem_peak_bytes")}
        beats = records.heartbeat_max.get(rank, {})
        row.update({name: beats.get(name) for name in HEARTBEAT_MEMORY})
        torch_peak = [v for v in (row["mem_allocated_bytes"], row["mem_peak_bytes"])
                      if v is not None]
        row["peak_bytes"] = max(torch_peak) if torch_peak else None
        per_rank[str(rank)] = row

    def most(name: str) -> float | None:
        values = [row[name] for row in per_rank.values() if row[name] is not None]
        return max(values) if values else None

    return {"peak_bytes": most("peak_bytes"), "rss_bytes": most("rss_bytes"),
            "per_rank": per_rank}


def _config(state: Mapping[str, Any]) -> dict[str, Any]:
    """The ranks' `init(config=...)`, flattened to dotted keys: the value where every rank
    agrees, else the values by rank."""
    by_rank = (state.get("info") or {}).get("config") or {}
    flat = {str(r): flatten(c) for r, c in by_rank.items()}
    keys = sorted({k for f in flat.values() for k in f})
    out: dict[str, Any] = {}
    for key in keys:
        values = {r: f.get(key) for r, f in flat.items()}
        distinct = {_key_text(v) for v in values.values()}
        out[key] = next(iter(values.values())) if len(distinct) == 1 else {"by_rank": values}
    return out


def _key_text(value: Any) -> str:
    """A JSON value as text that two equal values share."""
    return json.dumps(value, sort_keys=True, default=str)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested map as {"a.b": leaf}; lists are leaves."""
    if not isinstance(value, dict):
        return {prefix or "config": value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(item, dict) and item:
            out.update(flatten(item, name))
        else:
            out[name] = item
    return out


def _flags(state: Mapping[str, Any]) -> dict[str, Any]:
    """Each flag's value where the reporting ranks agree, else its values by rank (flags no
    rank reported are left out)."""
    out: dict[str, Any] = {}
    for row in state.get("flags") or []:
        values = {r: v for r, v in (row.get("values") or {}).items() if v is not None}
        if not values:
            continue
        distinct = set(values.values())
        out[row["name"]] = next(iter(distinct)) if len(distinct) == 1 else {"by_rank": values}
    return out


def _versions(ranks: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The agent (scalemon) and torch versions, each with the ranks that run it."""
    out: dict[str, dict[str, list[int]]] = {"agent": {}, "torch": {}}
    for r in ranks:
        for what, key in (("agent", "agent_version"), ("torch", "torch_version")):
            if r.get(key):
                out[what].setdefault(str(r[key]), []).append(r["rank"])
    return out


# --- compare ---------------------------------------------------------------------------------
RATIOS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tokens_per_s", ("tokens_per_s", "job", "median")),
    ("tokens_per_s_p10", ("tokens_per_s", "job", "p10")),
    ("mfu", ("mfu", "median")),
    ("step_time_s", ("step_time", "median")),
    ("step_time_p90_s", ("step_time", "p90")),
    ("peak_memory_bytes", ("memory", "peak_bytes")),
    ("rss_bytes", ("memory", "rss_bytes")),
    ("wall_time_s", ("wall_time", "seconds")),
    ("steps", ("steps", "last")),
)
"""What `compare` sets side by side, and where in a summary each value is."""


def _at(summary: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = summary
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def compare(a: Mapping[str, Any], b: Mapping[str, Any], loss_a: Mapping[int, float],
            loss_b: Mapping[int, float]) -> dict[str, Any]:
    """Two summaries side by side (docs/summary.md): each figure of A and B with the ratio
    B/A, the loss at equal steps, and what differs in config, flags and versions."""
    figures = {}
    for name, path in RATIOS:
        va, vb = _at(a, path), _at(b, path)
        figures[name] = {"a": va, "b": vb, "ratio": ratio(vb, va)}
    return {
        "schema": SCHEMA,
        "a": {"job": a.get("job"), "state": a.get("state"), "world_size": a.get("world_size")},
        "b": {"job": b.get("job"), "state": b.get("state"), "world_size": b.get("world_size")},
        "figures": figures,
        "loss": {"a": a.get("loss"), "b": b.get("loss"),
                 "at_steps": loss_at_equal_steps(loss_a, loss_b)},
        "config": differences(a.get("config") or {}, b.get("config") or {}),
        "flags": differences(a.get("flags") or {}, b.get("flags") or {}),
        "versions": differences(_version_sets(a), _version_sets(b)),
        "summaries": {"a": dict(a), "b": dict(b)},
    }


def _version_sets(summary: Mapping[str, Any]) -> dict[str, str]:
    """{"agent": "0.9", "torch": "2.5.1,2.6.0"}: the versions a run's ranks run."""
    return {what: ",".join(sorted(by)) for what, by in (summary.get("versions") or {}).items()
            if by}


def common_steps(steps_a: Iterable[int], steps_b: Iterable[int]) -> list[int]:
    """The steps to read both losses at: those nearest 10%, 50% and 100% of the range both
    runs logged, and the last step both have."""
    both = sorted(set(steps_a) & set(steps_b))
    if not both:
        return []
    lo, hi = both[0], both[-1]
    picked = {both[-1]}
    for q in LOSS_AT:
        target = lo + q * (hi - lo)
        picked.add(min(both, key=lambda s: (abs(s - target), s)))
    return sorted(picked)


def loss_at_equal_steps(loss_a: Mapping[int, float],
                        loss_b: Mapping[int, float]) -> list[dict[str, Any]]:
    """The two runs' losses at `common_steps`, with B - A."""
    out = []
    for step in common_steps(loss_a, loss_b):
        va, vb = finite(loss_a[step]), finite(loss_b[step])
        out.append({"step": step, "a": loss_a[step], "b": loss_b[step],
                    "b_minus_a": vb - va if va is not None and vb is not None else None})
    return out


def differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The keys whose values differ between two flat maps: {"key", "a", "b"} (None where one
    side lacks the key)."""
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if _key_text(va) != _key_text(vb):
            out.append({"key": key, "a": va, "b": vb})
    return out


# --- text ------------------------------------------------------------------------------------
