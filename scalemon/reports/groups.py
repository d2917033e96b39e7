"""A job's process groups and collectives as people read them: each group by name and ranks,
and the table of collectives per (group, op, size) pooled over the ranks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from scalemon.collectives import StatRow, bucket_text, bus_factor, hist_quantile
from scalemon.text.ranks import span_text

if TYPE_CHECKING:
    from scalemon.state.jobstate import RankView


Groups = dict[str, dict[str, Any]]
"""Process groups by name (the same on every rank): {"desc": str, "ranks": [int]}."""


MESH_PREFIX = "mesh_"
"""torch describes the group of a `DeviceMesh` dimension "mesh_<dim>" ("mesh_tp")."""


def mesh_dim(desc: str) -> str | None:
    """The mesh dimension a group's description names ("mesh_tp" -> "tp", a flattened
    "mesh_dp_all" -> "dp_all"), None for any other description."""
    if desc.startswith(MESH_PREFIX) and len(desc) > len(MESH_PREFIX):
        return desc[len(MESH_PREFIX):]
    return None


def short_name(desc: str, name: str, ranks: list[int] | tuple[int, ...], shared: int) -> str:
    """The one naming rule (the live views' and the Flight Recorder reports'): a mesh
    dimension's group by its dimension and ranks ("tp [2,3]"); another by its description
    ("default_pg"), "group <name>" without one, with its name where `shared` (the groups with
    this description, or for a mesh group with these ranks too) is more than one."""
    dim = mesh_dim(desc)
    if dim is not None:
        text = f"{dim} {span_text(list(ranks))}" if ranks else dim
        return f"{text} ({name})" if shared > 1 else text
    if not desc or desc == "undefined":
        return f"group {name}"
    return f"{desc} ({name})" if shared > 1 else desc


def group_desc(groups: Groups, name: str) -> str:
    """A group's short name: "tp [2,3]" for a mesh dimension's group; its description
    ("default_pg"), "group <name>" when torch gives none, with its name where two groups
    share one description."""
    group = groups.get(name)
    desc = group["desc"] if group else ""
    ranks = group.get("ranks") or [] if group else []
    if mesh_dim(desc) is not None:
        shared = sum(1 for g in groups.values()
                     if g["desc"] == desc and list(g.get("ranks") or []) == list(ranks))
    else:
        shared = sum(1 for g in groups.values() if g["desc"] == desc) if desc else 1
    return short_name(desc, name, ranks, shared)


def group_label(groups: Groups, name: str) -> str:
    """A group as people know it, by name and ranks: "user_pg [0,1]", "group 1 [0,1]", "tp
    [2,3]" (a mesh dimension's group names its ranks already)."""
    group = groups.get(name)
    short = group_desc(groups, name)
    if group and mesh_dim(group["desc"]) is not None:
        return short
    ranks = f" {span_text(group['ranks'])}" if group and group.get("ranks") else ""
    return short + ranks


def collectives_table(groups: Groups, views: Iterable[RankView]) -> list[dict[str, Any]]:
    """The job's collectives so far, a row per (group, op) with its size buckets in `sizes`,
    largest total time first. Counts and bytes are one rank's (the largest: every member
    issues each collective); durations pool every rank's."""
    per_key: dict[tuple[str, str, int], list[StatRow]] = {}
    for view in views:
        for key, row in view.collectives.rows.items():
            per_key.setdefault(key, []).append(row)
    by_op: dict[tuple[str, str], list[tuple[dict[str, Any], StatRow]]] = {}
    for (group, op, bucket), rows in per_key.items():
        n = len(groups.get(group, {}).get("ranks", ())) or len(rows)
        timing = StatRow()
        for row in rows:
            timing.merge(row)
        size = _row(groups, group, op, n, max(r.count for r in rows),
                    max(r.bytes for r in rows), timing)
        size["size_bucket"], size["size_text"] = bucket, bucket_text(bucket)
        by_op.setdefault((group, op), []).append((size, timing))
    table = []
    for (group, op), sizes in by_op.items():
        timing = StatRow()
        for _, size_timing in sizes:
            timing.merge(size_timing)
        row = _row(groups, group, op, sizes[0][0]["ranks"], sum(s["count"] for s, _ in sizes),
                   sum(s["bytes"] for s, _ in sizes), timing)
        row["sizes"] = sorted((s for s, _ in sizes), key=lambda s: s["size_bucket"])
        table.append(row)
    table.sort(key=lambda r: (-(r["time_total_s"] or 0.0), r["group"], r["op"]))
    return table


def _row(groups: Groups, group: str, op: str, n: int, count: int, nbytes: int,
         timing: StatRow) -> dict[str, Any]:
    mean = timing.time_sum_s / timing.timed if timing.timed else None
    per_op = nbytes / count if count else 0
    algbw = per_op / mean / 1e9 if mean else None
    factor = bus_factor(op, n)
    return {
        "group": group_desc(groups, group), "group_name": group,
        "group_label": group_label(groups, group), "op": op, "ranks": n,
        "count": count, "bytes": nbytes, "timed": timing.timed,
        "time_p50_s": hist_quantile(timing.hist, 0.5),
        "time_p99_s": hist_quantile(timing.hist, 0.99),
        "time_max_s": timing.time_max_s if timing.timed else None,
        "time_mean_s": mean,
        "time_total_s": mean * count if mean is not None else None,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * factor if algbw is not None and factor is not None else None,
        "bus_factor": factor,
    }
