"""A mixture-of-experts MLP with expert parallelism, for the demo trainer (--experts, --ep).

    router: Linear -> softmax -> the top-k experts of each token (the k gates renormalised to
            sum to 1 for k > 1; for k = 1 the gate is the router probability, as in Switch)
    capacity = ceil(capacity_factor * tokens * k / experts) per expert, counted over this
            rank's tokens (GShard's groups): assignments past it are dropped (their MLP output
            is zero, the residual carries the token) and counted; every token's first choice
            goes before any second choice
    load-balancing loss (Switch Transformer eq. 4): E * sum_e f_e * P_e (f_e the share of
            assignments routed to expert e, P_e its mean router probability): 1.0 when balanced;
            GPT.forward adds it to the loss times --moe-aux-coef

Expert parallelism (`shard_experts`, --ep N): each rank of the ep group keeps E / N of the
experts. A MoE layer all-gathers the per-expert token counts of the ep group (so every rank
knows the split sizes and the global load), sends each kept assignment's token to the rank
holding its expert with all_to_all_single (input/output split sizes), runs its experts, and
sends the outputs back with a second all_to_all_single; autograd flows back through both
(`all_to_all`). Without an ep group the same routing runs locally, with fixed-size buffers
(no host sync). Expert parameters then differ per rank: DDP leaves them out
(`ddp_ignore_experts`) and `sync_expert_grads` reduces them over the ranks holding the same
experts ("dp_rest").
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Expert(nn.Module):
    """One expert: the dense MLP's shape (4x expansion with GELU)."""

    def __init__(self, n_embd: int, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


@dataclass
class Routing:
    """Where each assignment (a token's choice of one expert) goes. Assignments are flat and
    choice-major: every token's first choice, then every token's second, ..."""

    token: torch.Tensor  # (A,) the token of each assignment
    expert: torch.Tensor  # (A,) its expert
    gate: torch.Tensor  # (A,) its weight in the combine
    pos: torch.Tensor  # (A,) its place in its expert's queue
    keep: torch.Tensor  # (A,) bool: within capacity
    routed: torch.Tensor  # (E,) assignments per expert, before capacity
    kept: torch.Tensor  # (E,) after
    aux_loss: torch.Tensor  # the load-balancing loss, 0-d float32
    capacity: int


def route(logits: torch.Tensor, k: int, capacity_factor: float) -> Routing:
    """Top-k routing of (N, E) router logits, with capacity and the load-balancing loss."""
    n, e = logits.shape
    probs = logits.float().softmax(dim=-1)
    top_p, top_i = probs.topk(k, dim=-1)  # (N, k)
    gates = top_p if k == 1 else top_p / top_p.sum(dim=-1, keepdim=True)
    expert = top_i.t().reshape(-1)  # choice-major: first choices have priority
    onehot = F.one_hot(expert, e)  # (A, E)
    pos = ((onehot.cumsum(dim=0) - 1) * onehot).sum(dim=-1)
    routed = onehot.sum(dim=0)
    capacity = math.ceil(capacity_factor * n * k / e)
    aux = e * (routed.float() / (n * k) * probs.mean(dim=0)).sum()
    return Routing(token=torch.arange(n, device=logits.device).repeat(k), expert=expert,
                   gate=gates.t().reshape(-1), pos=pos, keep=pos < capacity,
                   routed=routed, kept=routed.clamp(max=capacity), aux_loss=aux,
                   capacity=capacity)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward is the reverse exchange (split sizes swapped)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: Any) -> torch.Tensor:
    """Rows of `x` split by `in_splits` to the ranks of `group`; rows received by
    `out_splits`. Differentiable."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass
class LayerStats:
    """What one forward of a MoE layer measured (tensors on the single-rank path, host
    numbers under expert parallelism, where the counts came to the host anyway)."""

    load_max: Any  # tokens routed to the busiest expert rank (an expert, without ep)
    load_mean: Any  # mean over expert ranks
    dropped: Any  # assignments over capacity on this rank
    aux_loss: torch.Tensor


class MoE(nn.Module):
    """The MoE MLP: router, experts (a ModuleDict keyed by global expert index, so a rank's
    parameter names say which experts it holds) and output dropout."""

    def __init__(self, n_embd: int, experts: int, top_k: int, capacity_factor: float,
                 bias: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top-k {top_k} must be between 1 and the experts ({experts})")
        self.n_experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.router = nn.Linear(n_embd, experts, bias=False)
        self.experts = nn.ModuleDict({str(i): Expert(n_embd, bias) for i in range(experts)})
        self.dropout = nn.Dropout(dropout)
        self.group: Any = None  # the ep group, once shard_experts kept this rank's experts
        self.ep_rank, self.ep = 0, 1
        self.aux_loss: torch.Tensor | None = None  # of the latest forward
        self.stats: list[LayerStats] = []  # one per forward, taken by StepMeter

    @property
    def local(self) -> int:
        """Experts held here."""
        return self.n_experts // self.ep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        r = route(self.router(flat), self.top_k, self.capacity_factor)
        self.aux_loss = r.aux_loss
        if self.group is None:
            rows, out = self._local(flat, r)
        else:
            rows, out = self._parallel(flat, r)
        # the combine: each token's kept outputs weighted by their gates (dropped: zero)
        weight = (r.gate * r.keep).to(out.dtype).unsqueeze(-1)
        y = flat.new_zeros(flat.shape, dtype=out.dtype).index_add(0, r.token, out[rows] * weight)
        return self.dropout(y.to(x.dtype).reshape(shape))

    def _dispatch(self, flat: torch.Tensor, r: Routing, start: torch.Tensor,
                  total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(row of each assignment, buffer of `total` rows + 1): kept assignment -> the row
        `start[expert] + pos` holding its token; dropped ones -> the spare last row."""
        rows = torch.where(r.keep, start[r.expert] + r.pos, total)
        buffer = flat.new_zeros((total + 1, flat.shape[-1])).index_copy(0, rows, flat[r.token])
        return rows, buffer

    def _local(self, flat: torch.Tensor, r: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert here: one buffer of `capacity` rows per expert (fixed shapes, so no
        host sync; rows past an expert's count are padding, computed and never read)."""
        cap = r.capacity
        start = torch.arange(self.n_experts, device=flat.device) * cap
        rows, buffer = self._dispatch(flat, r, start, self.n_experts * cap)
        outs = [expert(buffer[i * cap:(i + 1) * cap]) for i, expert in
                enumerate(self.experts.values())]
        out = torch.cat([*outs, outs[0].new_zeros((1, flat.shape[-1]))])
        routed = r.routed.float()
        self.stats.append(LayerStats(routed.max(), routed.mean(), (~r.keep).sum(),
                                     r.aux_loss.detach()))
        return rows, out

    def _parallel(self, flat: torch.Tensor, r: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts spread over the ep group: counts, dispatch, experts, combine back."""
        ep, me, local = self.ep, self.ep_rank, self.local
        # [routed, kept] per expert of every rank: split sizes and load (a host sync on GPU:
        # all_to_all_single takes its split sizes as Python ints)
        mine = torch.stack([r.routed, r.kept])
        gathered = [torch.empty_like(mine) for _ in range(ep)]
        dist.all_gather(gathered, mine, group=self.group)
        counts = torch.stack(gathered).cpu()  # (ep, 2, E)
        kept = counts[:, 1].tolist()  # kept[s][e]: from rank s to expert e
        send_splits = [sum(kept[me][j * local:(j + 1) * local]) for j in range(ep)]
        first = me * local
        blocks = [kept[s][first + i] for s in range(ep) for i in range(local)]
        recv_splits = [sum(blocks[s * local:(s + 1) * local]) for s in range(ep)]
        # this rank's kept assignments in expert order (hence in destination-rank order)
        kept_here = counts[me, 1].to(flat.device)
        start = kept_here.cumsum(0) - kept_here
        total = sum(send_splits)
        rows, buffer = self._dispatch(flat, r, start, total)
        received = all_to_all(buffer[:total], recv_splits, send_splits, self.group)
        # received: per source rank, per local expert; each expert runs on all its rows
        parts = list(received.split(blocks))
        experts = list(self.experts.values())
        for i in range(local):
            sizes = [blocks[s * local + i] for s in range(ep)]
            outs = experts[i](torch.cat([parts[s * local + i] for s in range(ep)])).split(sizes)
            for s in range(ep):
                parts[s * local + i] = outs[s]
        back = all_to_all(torch.cat(parts), send_splits, recv_splits, self.group)
        out = torch.cat([back, back.new_zeros((1, flat.shape[-1]))])
        load = counts[:, 0].sum(dim=0).view(ep, local).sum(dim=1).float()  # per expert rank
        dropped = int(counts[me, 0].sum() - counts[me, 1].sum())
        self.stats.append(LayerStats(float(load.max()), float(load.mean()), dropped,
                                     r.aux_loss.detach()))
        return rows, out


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of `model`, in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_params(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of every expert parameter held here."""
    for name, p in model.named_parameters():
        if ".experts." in f".{name}":
            yield name, p


def shard_experts(model: nn.Module, group: Any) -> None:
    """Keep only this rank's experts in each MoE layer (rank i of the ep `group` of size N
    keeps experts [i E/N, (i+1) E/N)) and route through `group`. Called after the whole model
    was built with the same seed everywhere, so each expert has the weights it would have on
    one rank."""
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    for layer in moe_layers(model):
        if layer.n_experts % ep:
            raise ValueError(f"{layer.n_experts} experts do not split over {ep} ranks")
        layer.group, layer.ep_rank, layer.ep = group, me, ep
        mine = range(me * layer.local, (me + 1) * layer.local)
        for key in [k for k in layer.experts if int(k) not in mine]:
            del layer.experts[key]


def ddp_ignore_experts(model: nn.Module) -> None:
    """Have DDP (built after this) leave the expert parameters alone: they differ per rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    names = [name for name, _ in expert_params(model)]
    if names:
        DDP._set_params_and_buffers_to_ignore_for_model(model, names)


def sync_expert_grads(model: nn.Module, dp_rest: Any, dp_size: int) -> None:
    """The expert gradients as DDP would have made them: each rank's experts got the
    gradients of the whole ep group's tokens (through the all_to_all backward), so summing
    over the ranks holding the same experts (`dp_rest`, None: none other) and dividing by the
    data-parallel size gives the mean over every data-parallel rank's loss. Call after the
    last backward of the step."""
    grads = []
    for _, p in expert_params(model):
        if p.grad is None:  # no token reached it on any micro-batch here
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    if not grads:
        return
    if dp_rest is not None and dist.get_world_size(dp_rest) > 1:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=dp_rest)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))
    torch._foreach_div_(grads, dp_size)


class StepMeter:
    """The MoE figures of one step, over its micro-batches and layers: `moe_imbalance`
    (sum over layers of the busiest expert rank's routed tokens / sum of the mean: the
    slowdown of a step whose all_to_alls wait for the busiest rank; per expert without ep),
    `moe_dropped_tokens` (assignments over capacity on this rank) and `moe_aux_loss` (mean
    over layers and micro-batches, 1.0 when balanced). Call `begin()` before each forward and
    `end()` after it: activation checkpointing reruns forwards in backward, and what those
    record is not counted."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = moe_layers(model)
        self._reset()

    def _reset(self) -> None:
        self.load_max: Any = 0.0
        self.load_mean: Any = 0.0
        self.dropped: Any = 0
        self.aux: Any = 0.0
        self.forwards = 0

    def begin(self) -> None:
        for layer in self.layers:
            layer.stats.clear()

    def end(self) -> None:
        for layer in self.layers:
            for s in layer.stats:
                self.load_max = self.load_max + s.load_max
                self.load_mean = self.load_mean + s.load_mean
                self.dropped = self.dropped + s.dropped
                self.aux = self.aux + s.aux_loss
                self.forwards += 1
            layer.stats.clear()

    def take(self) -> dict[str, Any]:
        """The step's figures (tensors or numbers: never read here), and start a new step."""
        if not self.forwards:
            return {}
        out = {"moe_imbalance": self.load_max / self.load_mean,
               "moe_dropped_tokens": self.dropped, "moe_aux_loss": self.aux / self.forwards}
        self._reset()
        return out
