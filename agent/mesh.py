"""This rank's place in the job's DeviceMesh, sent as the `mesh` info.

Either given (`init(mesh=DeviceMesh)`: its `mesh_dim_names` and `get_coordinate()`), or found
among the process groups: torch names each group a DeviceMesh makes for a dimension
`mesh_<dim>` (its `group_desc`), and a rank is in one group per dimension, so its coordinate on
`dim` is its place among that group's sorted ranks and the dimension's size the group's. The
groups are looked at again from the recorder's thread whenever their number changed; an info
goes out once per change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from scalemon.state.mesh import mesh_axes

from . import c10d

MESH_PREFIX = "mesh_"


def mesh_of(mesh: Any) -> dict[str, Any] | None:
    """The `mesh` info of a DeviceMesh given by the script (None: this rank is not in it)."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    shape = tuple(int(n) for n in mesh.shape)
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(len(shape)))
    return {"coords": {str(n): int(c) for n, c in zip(names, coordinate, strict=True)},
            "shape": {str(n): s for n, s in zip(names, shape, strict=True)}, "source": "init"}


def mesh_from_groups(groups: Mapping[Any, str], rank: int,
                     ranks_of: Callable[[Any], list[int]]) -> dict[str, Any] | None:
    """The `mesh` info found in `groups` (group -> name) whose desc is `mesh_<dim>`; None where
    there is none. A dimension made by flattening others (`mesh_dp_all`) is left out
    (`scalemon.state.mesh.mesh_axes`)."""
    found: dict[str, list[int]] = {}
    for pg in list(groups):
        desc = str(getattr(pg, "group_desc", "") or "")
        if not desc.startswith(MESH_PREFIX) or len(desc) == len(MESH_PREFIX):
            continue
        dim = desc[len(MESH_PREFIX):]
        ranks = sorted(ranks_of(pg))
        if dim not in found and rank in ranks:
            found[dim] = ranks
    axes = mesh_axes(found)  # the hub's rule: no flattened dimension, no "default"
    if not axes:
        return None
    return {"coords": {dim: ranks.index(rank) for dim, ranks in axes.items()},
            "shape": {dim: len(ranks) for dim, ranks in axes.items()}, "source": "groups"}


class MeshWatcher:
    """Sends this rank's `mesh` info: the given mesh's, or what the groups say."""

    def __init__(self, submit: Callable[[str, dict[str, Any]], Any]) -> None:
        self.submit = submit
        self.given = False
        self.sent: dict[str, Any] | None = None
        self._groups_seen = -1
        self._settled = True  # what the groups said was sent (or none is to be)

    def use(self, mesh: Any) -> None:
        """The script's DeviceMesh: send its coordinates; no more looking at groups."""
        self.given = True
        self._send(mesh_of(mesh))

    def check(self) -> None:
        """Look at the process groups again if their number changed (recorder's thread). A
        mesh found while its groups are still being made (`init_device_mesh` makes them a
        dimension at a time) covers fewer ranks than the world: it is sent only once the
        number of groups stayed the same until the next look, so that a rank does not say a
        mesh it is not in."""
        if self.given:
            return
        groups = c10d.group_names()
        changed = len(groups) != self._groups_seen
        if not changed and self._settled:
            return
        self._groups_seen = len(groups)
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        value = mesh_from_groups(groups, dist.get_rank(), dist.get_process_group_ranks)
        if (changed and value is not None
                and math.prod(value["shape"].values()) != dist.get_world_size()):
            self._settled = False  # maybe half made: looked at again at the next check
            return
        self._settled = True
        self._send(value)

    def _send(self, value: dict[str, Any] | None) -> None:
        if value is not None and value != self.sent:
            self.sent = value
            self.submit("info", {"key": "mesh", "value": value})
