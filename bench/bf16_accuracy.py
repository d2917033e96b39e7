"""Accuracy of FusedAdamW's bf16 modes against fp32 AdamW over a training run of the demo GPT.

Every mode trains the demo model (demo_train/model.py, preset `tiny` by default) from the same
initial weights on the same batches of the demo's byte corpus, with the demo trainer's
optimizer settings (AdamW, lr 1e-3 constant, betas (0.9, 0.95), weight decay 0.1 on matrices
and embeddings only):

    fp32          torch.optim.AdamW, fp32 params and compute: the reference
    bf16 torch    torch.optim.AdamW on bf16 params: bf16 state, no master    14 B/param
    ours 28B      FusedAdamW, fp32 master, fp32 moments (the default)        28
    ours 26B      FusedAdamW, master_weights="lo16", fp32 moments            26
    ours 20B      FusedAdamW, fp32 master, moment_dtype="bf16"               20
    ours 18B      FusedAdamW, master_weights="lo16", moment_dtype="bf16"     18
    ours 14B      FusedAdamW, master_weights=False, moment_dtype="bf16"      14
    ours 14B SR   the same, stochastic_rounding=True                         14

The bf16 modes run the model in bf16 (bf16 params, no autocast). Reported per mode: the train
loss (mean of the last 10% of steps), the validation loss on fixed held-out batches (computed
with the model in its own dtype, and with its fp32 weights -- the master where there is one --
in an fp32 model), the mean |train loss - fp32's| over the run, and the relative L2 distance
of the fp32 weights from fp32's. On CPU our kernel runs under the Triton interpreter (about
0.3 s a step for `tiny` on 2 cores). Saves bench/results/bf16_accuracy-<device>.json.

    python bench/bf16_accuracy.py                       # 300 steps
    python bench/bf16_accuracy.py --steps 40 --no-save  # a smoke run
    python bench/bf16_accuracy.py --schedule cosine     # lr decays to 10%: smaller updates
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

from machine import cpu_name

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

# (name, bf16 params?, optimizer: "torch" or FusedAdamW options)
MODES: list[tuple[str, bool, str | dict]] = [
    ("fp32", False, "torch"),
    ("bf16 torch", True, "torch"),
    ("ours 28B", True, {"master_weights": "fp32", "moment_dtype": None}),
    ("ours 26B", True, {"master_weights": "lo16", "moment_dtype": None}),
    ("ours 20B", True, {"master_weights": "fp32", "moment_dtype": "bf16"}),
    ("ours 18B", True, {"master_weights": "lo16", "moment_dtype": "bf16"}),
    ("ours 14B", True, {"master_weights": False, "moment_dtype": "bf16"}),
    ("ours 14B SR", True, {"master_weights": False, "moment_dtype": "bf16",
                           "stochastic_rounding": True}),
]
BETAS = (0.9, 0.95)  # demo_train/parallel.py build_optimizer's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", help="demo model preset")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--schedule", choices=("constant", "cosine"), default="constant")
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--only", help="run only modes whose name contains this (plus fp32)")
    ap.add_argument("--no-save", action="store_true", help="print only")
    return ap.parse_args(argv)


def merged_rows(out: Path, args: argparse.Namespace, rows: list[dict]) -> list[dict]:
    """With --only: the saved run's rows of the other modes kept (the CPU runs are
    deterministic: same seed, same batches, same fp32 row), this run's replacing their own."""
    if not args.only or not out.exists():
        return rows
    saved = json.loads(out.read_text())
    same = {k: v for k, v in saved.get("args", {}).items() if k != "only"} == {
        k: v for k, v in vars(args).items() if k != "only"}
    if not same:
        return rows
    mine = {r["mode"] for r in rows}
    order = [name for name, _, _ in MODES]
    kept = [r for r in saved.get("rows", []) if r["mode"] not in mine] + rows
    return sorted(kept, key=lambda r: order.index(r["mode"]) if r["mode"] in order else 99)


def param_groups(model, weight_decay: float) -> list[dict]:
    """Weight decay on matrices and embeddings only (the demo trainer's split)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def make_optimizer(model, spec: str | dict, args: argparse.Namespace):
    """torch.optim.AdamW (foreach) or FusedAdamW with the mode's options."""
    import torch

    groups = param_groups(model, args.weight_decay)
    if spec == "torch":
        return torch.optim.AdamW(groups, lr=args.lr, betas=BETAS)
    from scalemon.demo_train.fused_adam import FusedAdamW

    return FusedAdamW(groups, lr=args.lr, betas=BETAS, **spec)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """The lr of a step: constant, or cosine from lr to lr/10."""
    if args.schedule == "constant":
        return args.lr
    frac = step / max(1, args.steps - 1)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def fp32_weights(model, opt) -> list:
    """The model's weights in fp32: the optimizer's master where it keeps one."""
    master = getattr(opt, "fp32_master", None)
    return [(master(p) if master else p.detach()).float() for p in model.parameters()]


def mean_loss(model, batches: list) -> float:
    """Mean cross-entropy of ``model`` over fixed batches."""
    import torch

    with torch.no_grad():
        return sum(model(x, y)[1].float().item() for x, y in batches) / len(batches)


def fp32_twin(config, weights: list):
    """An fp32 model of ``config`` holding ``weights`` (in parameters() order)."""
    import torch

    from scalemon.demo_train.model import GPT

    twin = GPT(config)
    with torch.no_grad():
        for p, w in zip(twin.parameters(), weights, strict=True):
            p.copy_(w)
    return twin


def train_one(spec: tuple, init: dict, config, data: tuple, args: argparse.Namespace) -> dict:
    """Train one mode; its losses, validation losses and fp32 weights."""
    import torch

    from scalemon.demo_train.model import GPT

    name, bf16, opt_spec = spec
    batches, val = data
    model = GPT(config)
    model.load_state_dict(init)
    if bf16:
        model.to(torch.bfloat16)
    opt = make_optimizer(model, opt_spec, args)
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = batches.batch_at(step)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.float().item())
    weights = fp32_weights(model, opt)
    return {
        "mode": name, "losses": losses, "seconds": time.perf_counter() - t0,
        "val_own_dtype": mean_loss(model, val),
        "val_fp32_weights": mean_loss(fp32_twin(config, weights), val), "weights": weights,
    }


def bytes_of(spec: tuple) -> int:
    """Optimizer bytes moved per parameter for a mode."""
    import torch

    from scalemon.demo_train.fused_adam import bytes_per_param

    _, bf16, opt_spec = spec
    if opt_spec == "torch":
        return 14 if bf16 else 28
    moments = torch.bfloat16 if opt_spec["moment_dtype"] == "bf16" else torch.float32
    return bytes_per_param(torch.bfloat16, opt_spec["master_weights"] or None, moments)


def compare(run: dict, ref: dict, spec: tuple) -> dict:
    """A mode's row: its figures and its distance from the fp32 run."""
    import torch

    tail = max(1, len(run["losses"]) // 10)
    diff = [abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True)]
    w = torch.cat([t.flatten() for t in run["weights"]])
    w_ref = torch.cat([t.flatten() for t in ref["weights"]])
    return {
        "mode": run["mode"], "bytes_per_param": bytes_of(spec),
        "train_loss_last10pct": sum(run["losses"][-tail:]) / tail,
        "val_loss_own_dtype": run["val_own_dtype"],
        "val_loss_fp32_weights": run["val_fp32_weights"],
        "val_gap_vs_fp32": run["val_fp32_weights"] - ref["val_fp32_weights"],
        "mean_abs_train_loss_diff_vs_fp32": sum(diff) / len(diff),
        "weight_rel_dist_vs_fp32": float((w - w_ref).norm() / w_ref.norm()),
        "seconds": run["seconds"],
        "train_loss_every_10_steps": run["losses"][::10],
    }


def table(rows: list[dict]) -> str:
    """The rows as a text table."""
    head = (f"{'mode':<11} | {'B/param':>7} | {'train':>7} | {'val bf16':>8} | "
            f"{'val fp32w':>9} | {'val gap':>8} | {'|dloss|':>8} | {'w dist':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['mode']:<11} | {r['bytes_per_param']:>7} | {r['train_loss_last10pct']:>7.4f} | "
            f"{r['val_loss_own_dtype']:>8.4f} | {r['val_loss_fp32_weights']:>9.4f} | "
            f"{r['val_gap_vs_fp32']:>+8.4f} | {r['mean_abs_train_loss_diff_vs_fp32']:>8.4f} | "
            f"{r['weight_rel_dist_vs_fp32']:>8.2e}")
    return "\n".join(lines)


def setup(args: argparse.Namespace) -> tuple:
    """Config, initial weights, train batches and validation batches."""
    import torch

    from scalemon.demo_train.data import ByteBatches, load_corpus, train_val_split
    from scalemon.demo_train.model import GPT, GPTConfig

    config = GPTConfig.preset(args.preset)
    torch.manual_seed(args.seed)
    init = GPT(config).state_dict()
    train, val = train_val_split(load_corpus(block_size=config.block_size))
    batches = ByteBatches(train, config.block_size, args.batch_size, seed=args.seed)
    val_src = ByteBatches(val, config.block_size, args.batch_size, seed=args.seed + 1)
    val_batches = [val_src.batch_at(i) for i in range(args.val_batches)]
    return config, init, (batches, val_batches)


def run_modes(args: argparse.Namespace, log: Callable[[str], None]) -> list[dict]:
    """Train every selected mode; rows compared with the fp32 run."""
    config, init, data = setup(args)
    specs = [m for m in MODES if m[0] == "fp32" or not args.only or args.only in m[0]]
    runs = []
    for spec in specs:
        runs.append(train_one(spec, init, config, data, args))
        log(f"  {spec[0]}: val {runs[-1]['val_fp32_weights']:.4f} "
            f"({runs[-1]['seconds']:.0f} s)")
    return [compare(run, runs[0], spec) for run, spec in zip(runs, specs, strict=True)]


def main(argv: list[str] | None = None) -> int:
    """Train, print the table, save the JSON."""
    args = parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU: before triton is imported
    import torch
    import triton

    rows = run_modes(args, lambda line: print(line, flush=True))
    device = cpu_name()
    print(f"\n{device}, torch {torch.__version__}, triton {triton.__version__}, preset "
          f"{args.preset}, {args.steps} steps, batch {args.batch_size}, lr {args.lr} "
          f"({args.schedule})\n{table(rows)}")
    if not args.no_save:
        suffix = "" if args.schedule == "constant" else f"-{args.schedule}"
        out = RESULTS / f"bf16_accuracy-cpu{suffix}.json"
        RESULTS.mkdir(parents=True, exist_ok=True)
        rows = merged_rows(out, args, rows)
        out.write_text(json.dumps({
            "when": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device,
            "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "args": vars(args), "rows": rows,
        }, indent=1) + "\n")
        print(f"saved {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
