"""Where each rank sits in the job's layout: its device-mesh coordinates and the pipeline the
script described, from the `info` messages "mesh" and "pipeline" (protocol 1.11), else from the
process groups a `DeviceMesh` makes (described "mesh_<dim>"). Values from the wire are checked
here: a malformed one reads as absent."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MESH_DESC_PREFIX = "mesh_"
"""torch describes the group of a `DeviceMesh` dimension "mesh_<dim name>"."""


def _dim_map(value: Any) -> dict[str, int] | None:
    """{dim: int} from the wire, or None when it is not one."""
    if not isinstance(value, dict) or not value:
        return None
    out = {}
    for dim, n in value.items():
        if not isinstance(dim, str) or type(n) is not int or n < 0:
            return None
        out[dim] = n
    return out


def _name_order(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def mesh_groups(groups: Mapping[str, Mapping[str, Any]], rank: int) -> dict[str, list[int]]:
    """The mesh dimensions `rank` is in, from the groups described "mesh_<dim>", in the order
    torch made them: {dim: the group's sorted ranks}. A flattened dimension (its group holds
    another dimension's group of more than one rank) is left out: it is no axis of its own."""
    found: dict[str, list[int]] = {}
    for name in sorted(groups, key=_name_order):
        group = groups[name]
        desc = str(group.get("desc") or "")
        ranks = group.get("ranks") or []
        if desc.startswith(MESH_DESC_PREFIX) and len(desc) > len(MESH_DESC_PREFIX) \
                and rank in ranks:
            found.setdefault(desc[len(MESH_DESC_PREFIX):], sorted(ranks))
    return mesh_axes(found)


def mesh_axes(found: Mapping[str, list[int]]) -> dict[str, list[int]]:
    """The axes among one rank's mesh dimensions `found` ({dim: the group's sorted ranks}):
    without a flattened dimension (its group holds another dimension's group of more than one
    rank: "dp_all", "dp_shard_cp") and without "default" (torch's name for a dimension that
    reuses the default group, whose own name is lost). The agent (`agent/mesh.py`) and the hub
    apply this one rule."""
    sets = {dim: set(ranks) for dim, ranks in found.items()}
    flat = {dim for dim, ranks in sets.items()
            if any(other != dim and len(inner) > 1 and inner <= ranks
                   and (len(inner) < len(ranks) or len(other) < len(dim))
                   for other, inner in sets.items())}
    return {dim: list(ranks) for dim, ranks in found.items()
            if dim not in flat and dim != "default"}


def rank_coords(infos: Mapping[int, Any], groups: Mapping[str, Mapping[str, Any]],
                rank: int) -> dict[str, int] | None:
    """`rank`'s mesh coordinates: its info "mesh" `coords`, else its index in each mesh
    dimension's group (`mesh_groups`); None when neither says."""
    info = infos.get(rank)
    coords = _dim_map(info.get("coords")) if isinstance(info, dict) else None
    if coords is not None:
        return coords
    dims = mesh_groups(groups, rank)
    return {dim: ranks.index(rank) for dim, ranks in dims.items()} or None


def job_mesh(infos: Mapping[int, Any], groups: Mapping[str, Mapping[str, Any]]
             ) -> dict[str, Any] | None:
    """The job's mesh: {"dims": [names, outermost first], "shape": {dim: size}, "source":
    "init" | "groups" (how the agent found it) | "hub" (from the groups the hub knows)}, from
    the lowest rank that described one; None when no rank did and no group is a mesh's."""
    for rank in sorted(infos):
        info = infos[rank]
        shape = _dim_map(info.get("shape")) if isinstance(info, dict) else None
        if shape is not None:
            source = info.get("source")
            return {"dims": list(shape), "shape": shape,
                    "source": source if isinstance(source, str) else None}
    ranks = sorted({r for g in groups.values() for r in g.get("ranks") or ()})
    for rank in ranks:
        dims = mesh_groups(groups, rank)
        if dims:
            return {"dims": list(dims), "shape": {d: len(r) for d, r in dims.items()},
                    "source": "hub"}
    return None


def pipeline_info(infos: Mapping[int, Any]) -> dict[str, Any] | None:
    """The pipeline the script described (info "pipeline", the lowest rank's that reads
    right): {"schedule": str, "stages": int, "microbatches": int, "virtual_stages": int or
    None}; None without one."""
    for rank in sorted(infos):
        info = infos[rank]
        if not isinstance(info, dict):
            continue
        schedule, stages, micro = info.get("schedule"), info.get("stages"), info.get(
            "microbatches")
        virtual = info.get("virtual_stages")
        if not (isinstance(schedule, str) and type(stages) is int and stages > 0
                and type(micro) is int and micro > 0):
            continue
        if not (type(virtual) is int and virtual > 0):
            virtual = None
        return {"schedule": schedule, "stages": stages, "microbatches": micro,
                "virtual_stages": virtual}
    return None
