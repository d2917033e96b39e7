"""Pipeline, expert and point-to-point figures of a job as JSON-ready data: the send/recv rows
per (group, src -> dst), the pipeline's bubble (the schedule's theoretical one beside the
measured one) and the MoE routing's balance. Shared by `snapshot --json`, the summary and the
OpenMetrics export, so they never disagree."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from scalemon import metrics
from scalemon.collectives import P2PKey, P2PRow
from scalemon.reports.groups import group_desc, group_label
from scalemon.state.jobstate import JobState, RankView

_NUMBER = (int, float)


def latest(view: RankView, name: str) -> Any:
    """The rank's latest value of `name`: a metric of the table (`RankView.value`), else what
    its step messages or `log(**extra)` carried under that name; None when unknown."""
    if name in metrics.BY_NAME:
        return view.value(name)
    value = view.metrics.get(name)
    return view.extra.get(name) if value is None else value


def _numbers(views: Iterable[RankView], name: str) -> dict[int, float]:
    """{rank: latest `name`} of the ranks with a finite number for it."""
    out = {}
    for view in views:
        value = latest(view, name)
        if type(value) in _NUMBER and value == value and abs(value) != float("inf"):
            out[view.rank] = value
    return out


# --- point to point -------------------------------------------------------------------------

def p2p_rows(st: JobState) -> list[dict[str, Any]]:
    """The job's sends and receives, a row per (group, op, src, dst) pooled over the ranks (a
    send row is its sender's count, a recv row its receiver's), largest total time first: the
    keys of a `groups.collectives_table` row (`ranks` 2, `sizes` empty, bus factor 1) and
    `src`, `dst` (global ranks), `time_s` (summed measured time) and
    `bandwidth_bytes_per_s` (bytes per op over the mean measured time; None untimed)."""
    pooled: dict[P2PKey, P2PRow] = {}
    for view in st.ranks.values():
        for key, row in view.p2p.rows.items():
            pooled.setdefault(key, P2PRow()).merge(row)
    out = []
    for (group, op, src, dst), row in pooled.items():
        mean = row.time_s / row.timed if row.timed and row.time_s > 0 else None
        per_op = row.bytes / row.count if row.count else 0
        bandwidth = per_op / mean if mean else None
        gbps = bandwidth / 1e9 if bandwidth is not None else None
        out.append({
            "group": group_desc(st.groups, group), "group_name": group,
            "group_label": group_label(st.groups, group), "op": op, "src": src, "dst": dst,
            "ranks": 2, "count": row.count, "bytes": row.bytes, "timed": row.timed,
            "time_s": row.time_s, "time_p50_s": None, "time_p99_s": None, "time_max_s": None,
            "time_mean_s": mean, "time_total_s": mean * row.count if mean is not None else None,
            "bandwidth_bytes_per_s": bandwidth, "algbw_gbps": gbps, "busbw_gbps": gbps,
            "bus_factor": 1.0, "sizes": [],
        })
    out.sort(key=lambda r: (-(r["time_total_s"] or 0.0), r["group_name"], r["src"], r["dst"],
                            r["op"]))
    return out


# --- the pipeline bubble --------------------------------------------------------------------

def theoretical_bubble(schedule: str | None, stages: int | None, microbatches: int | None,
                       virtual_stages: int | None = None) -> float | None:
    """The idle share of a step of a pipeline of equal stages: (p-1)/(m+p-1) for GPipe and
    1F1B, (p-1)/(v*m+p-1) for an interleaved schedule of `virtual_stages` v per rank; None for
    another schedule (zero-bubble ones) or without p and m."""
    if not (stages and microbatches and stages > 0 and microbatches > 0 and schedule):
        return None
    kind = "".join(c for c in schedule.lower() if c.isalnum()).removeprefix("schedule")
    p, m = stages, microbatches
    if kind in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if kind.startswith(("interleaved", "loopedbfs")) and "zero" not in kind:
        v = virtual_stages or 1
        return (p - 1) / (v * m + p - 1)
    return None


def pipeline_json(st: JobState) -> dict[str, Any] | None:
    """The job's pipeline: {"schedule", "stages", "microbatches", "virtual_stages" (as the
    script described it; stages from the mesh's "pp" dimension otherwise),
    "theoretical_bubble", "measured_bubble" (median over the ranks of their latest
    `pipeline_bubble`), "measured_ranks" (how many had one)}; None without a described
    pipeline or a measured bubble."""
    info = st.pipeline()
    bubbles = _numbers(st.ranks.values(), "pipeline_bubble")
    if info is None and not bubbles:
        return None
    info = dict(info or {"schedule": None, "stages": None, "microbatches": None,
                         "virtual_stages": None})
    if info["stages"] is None:
        mesh = st.job_mesh()
        info["stages"] = (mesh or {}).get("shape", {}).get("pp")
    return {**info,
            "theoretical_bubble": theoretical_bubble(info["schedule"], info["stages"],
                                                     info["microbatches"],
                                                     info["virtual_stages"]),
            "measured_bubble": statistics.median(bubbles.values()) if bubbles else None,
            "measured_ranks": len(bubbles)}


# --- experts --------------------------------------------------------------------------------

def _imbalance(values: dict[int, float]) -> float | None:
    """max/mean of `values` (1.0: even), None without values or with a mean of 0."""
    if not values:
        return None
    mean = statistics.fmean(values.values())
    return max(values.values()) / mean if mean > 0 else None


def moe_json(st: JobState) -> dict[str, Any] | None:
    """The job's expert routing in its latest steps: {"a2a_recv_imbalance",
    "a2a_send_imbalance" (max/mean over the ranks of their latest all_to_all bytes received /
    sent), "imbalance" (median of the ranks' `moe_imbalance`), "dropped_tokens" (sum of their
    latest `moe_dropped_tokens`), "aux_loss" (median of `moe_aux_loss`), "ranks" (ranks with
    any of these)}; None when no rank has any."""
    views = list(st.ranks.values())
    recv = _numbers(views, "a2a_recv_bytes")
    send = _numbers(views, "a2a_send_bytes")
    imbalance = _numbers(views, "moe_imbalance")
    dropped = _numbers(views, "moe_dropped_tokens")
    aux = _numbers(views, "moe_aux_loss")
    seen = set(recv) | set(send) | set(imbalance) | set(dropped) | set(aux)
    if not seen:
        return None
    return {
        "a2a_recv_imbalance": _imbalance(recv),
        "a2a_send_imbalance": _imbalance(send),
        "imbalance": statistics.median(imbalance.values()) if imbalance else None,
        "dropped_tokens": int(sum(dropped.values())) if dropped else None,
        "aux_loss": statistics.median(aux.values()) if aux else None,
        "ranks": len(seen),
    }
