"""How the world's ranks are laid out on one DeviceMesh: pipeline (pp), data (dp), expert (ep)
and tensor (tp) parallel, torchtitan's order (tp innermost: its ranks are neighbours, on one
node where the node has enough GPUs; pp outermost).

    world = pp x dp x tp, and ep divides dp: the experts of a MoE layer are spread over ep
    ranks of the same data-parallel replica set (dp = dp_rest x ep); non-expert parameters
    are replicated over all dp ranks, each expert's over the dp_rest ranks that hold it.

`Layout.build()` makes the DeviceMesh (dims of size 1 left out, "dp" always kept) and the
process groups each technique uses; `Layout` alone is pure arithmetic, checked before
torch.distributed starts (`layout_problem`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Layout:
    """Sizes of each parallel dimension (their product is the world size)."""

    world_size: int
    pp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks: what pp and tp leave of the world."""
        return self.world_size // (self.pp * self.tp)

    @property
    def dp_rest(self) -> int:
        """Replicas of each expert (dp = dp_rest x ep)."""
        return self.dp // self.ep

    @property
    def dims(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the mesh's dims, outermost first; size-1 dims left out, dp kept."""
        if self.ep > 1:
            dims = (("pp", self.pp), ("dp", self.dp_rest), ("ep", self.ep), ("tp", self.tp))
        else:
            dims = (("pp", self.pp), ("dp", self.dp), ("tp", self.tp))
        return tuple((n, s) for n, s in dims if s > 1 or n == "dp")

    def coords(self, rank: int) -> dict[str, int]:
        """The mesh coordinates of global `rank` (row-major over `dims`)."""
        out: dict[str, int] = {}
        for name, size in reversed(self.dims):
            out[name] = rank % size
            rank //= size
        return dict(reversed(list(out.items())))

    def dp_rank(self, rank: int) -> int:
        """`rank`'s index among the data-parallel ranks (dp, with ep folded in): which data it
        reads. pp stages and tp ranks of one replica read the same batches."""
        c = self.coords(rank)
        return c.get("dp", 0) * self.ep + c.get("ep", 0)


def layout_problem(world_size: int, pp: int, tp: int, ep: int, experts: int) -> str | None:
    """What is wrong with these sizes for `world_size` ranks, or None."""
    if world_size % (pp * tp):
        return (f"--pp {pp} x --tp {tp} = {pp * tp} does not divide the world size "
                f"{world_size}: start a multiple of {pp * tp} ranks")
    dp = world_size // (pp * tp)
    if ep > 1 and experts == 0:
        return "--ep needs --experts (a MoE model to spread over ranks)"
    if ep > 1 and dp % ep:
        return (f"--ep {ep} must divide the data-parallel size {dp} (world {world_size} / "
                f"(pp {pp} x tp {tp}))")
    if experts and ep > 1 and experts % ep:
        return f"--experts {experts} must be a multiple of --ep {ep}"
    return None


@dataclass
class Mesh:
    """The DeviceMesh of a run and the groups each technique uses (None: not parallel there)."""

    layout: Layout
    device_mesh: Any
    groups: dict[str, Any] = field(default_factory=dict)
    """"pp", "tp", "ep": the dim's group; "dp": all data-parallel ranks (dp and ep flattened);
    "dp_rest": the ranks holding the same experts (expert gradients are averaged there)."""

    def group(self, name: str) -> Any:
        return self.groups.get(name)


def build_mesh(layout: Layout, device_type: str) -> Mesh:
    """Init the DeviceMesh of `layout` (a collective: every rank calls it) and its groups."""
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(n for n, _ in layout.dims)
    mesh = init_device_mesh(device_type, tuple(s for _, s in layout.dims), mesh_dim_names=names)
    groups: dict[str, Any] = {}
    for name in names:
        groups[name] = mesh[name].get_group()
    if "ep" in names:
        groups["dp"] = mesh["dp", "ep"]._flatten("dp_all").get_group()
        groups["dp_rest"] = mesh["dp"].get_group()
    return Mesh(layout, mesh, groups)
