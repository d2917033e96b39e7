"""Tokens/s of the demo trainer per configuration, against a plain baseline in the same run.

After one discarded warm-up run, every configuration runs --rounds times; within a round the
configurations run one after the other in an order rotated each round, so slow drifts of the
machine hit them all alike. A run's
figure is its median step time after --warmup steps (torch.compile and allocator warm-up),
taken between the trainer's host syncs (its logged steps: every step on CPU, every 10th on a
GPU, where the host runs ahead of the device in between). Reported per configuration: the
median over runs of tokens/s and its spread (min..max over runs), and the ratio to its
baseline computed within each round (paired), median and min..max over rounds. The baseline
`plain` is the same model with torch's fused AdamW and no monitor. A difference is resolved
when the ratio's min..max excludes 1.0; the plain runs' own spread says what the machine
resolves.

    python bench/train_throughput.py --quick          # CPU, 1 process, tiny: a minute or two
    python bench/train_throughput.py --only cpu       # CPU, 2 gloo ranks, every technique
    python bench/train_throughput.py --only gpu       # 1 GPU: gpt2-124m bf16 + compile
    python bench/train_throughput.py --only gpu --filter fused --rounds 5

GPU table: gpt2-124m (GPT-2 124M shapes, byte vocabulary) bf16 + compile (the whole model, as
nanoGPT) with torch's fused AdamW (`plain`), with --monitor, with --optimizer fused (ours),
with each block compiled instead (`compile blocks`, the trainer's default before #12), and
eager (the host-bound case where a slow optimizer step shows), plus MFU and the memory estimate
against the measured peak. The optimizer's own figures come from bench/fused_adam.py: `--host`
(host time of step() for 148 and 10000 tensors, set_to_none or not) and the full run (device
time against a measured copy at GPT-2 124M and 1G elements). Results go to
bench/results/train_throughput_rounds-<device>.json with the device named.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from machine import cpu_model, free_port

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
TRAIN = str(REPO / "demo_train" / "train.py")


@dataclass(frozen=True)
class Config:
    """One configuration: trainer flags, and the configuration its ratio is taken against."""

    name: str
    flags: tuple[str, ...]
    baseline: str = "plain"
    env: dict[str, str] = field(default_factory=dict)


TINY = ("--preset", "tiny", "--batch-size", "8")
SMALL = ("--preset", "small", "--batch-size", "8")
TORCH_FUSED = ("--optimizer", "torch-fused")
# --quick: one process on the CPU, a minute or two
QUICK_CONFIGS = [
    Config("plain", (*TINY, *TORCH_FUSED)),
    Config("torch foreach adamw", (*TINY, "--optimizer", "torch")),
    Config("fused adamw (triton interp)", (*TINY, "--optimizer", "fused")),
    Config("monitor", (*TINY, *TORCH_FUSED, "--monitor")),
]
# CPU: 2 gloo ranks, every technique flag on the tiny and small presets
CPU_CONFIGS = [
    Config("plain", (*TINY, *TORCH_FUSED)),
    Config("monitor", (*TINY, *TORCH_FUSED, "--monitor")),
    Config("tiny fp32 ddp (torch adamw)", TINY),
    Config("tiny bf16", (*TINY, "--amp", "bf16")),
    Config("tiny fp16 + GradScaler", (*TINY, "--amp", "fp16")),
    Config("tiny grad-accum 4x2", ("--preset", "tiny", "--batch-size", "2", "--grad-accum", "4")),
    Config("tiny activation-ckpt", (*TINY, "--activation-checkpointing")),
    Config("tiny zero1", (*TINY, "--zero", "1")),
    Config("tiny zero2 (fsdp2)", (*TINY, "--zero", "2")),
    Config("tiny zero3 (fsdp2)", (*TINY, "--zero", "3")),
    Config("tiny fused adamw (triton interp)", (*TINY, "--optimizer", "fused")),
    Config("tiny fused-flat adamw (triton interp)", (*TINY, "--optimizer", "fused-flat")),
    Config("tiny compile", (*TINY, *TORCH_FUSED, "--compile")),
    Config("tiny compile blocks", (*TINY, *TORCH_FUSED, "--compile", "blocks")),
    Config("plain small", (*SMALL, *TORCH_FUSED), baseline="plain small"),
    Config("small fp32 ddp (torch adamw)", SMALL, baseline="plain small"),
    Config("small bf16", (*SMALL, "--amp", "bf16"), baseline="plain small"),
    Config("small activation-ckpt", (*SMALL, "--activation-checkpointing"),
           baseline="plain small"),
    Config("small zero3 (fsdp2)", (*SMALL, "--zero", "3"), baseline="plain small"),
]
# GPU: one process on one GPU
GPT2 = ("--preset", "gpt2-124m", "--batch-size", "16", "--amp", "bf16")
GPU_CONFIGS = [
    Config("plain", (*GPT2, "--compile", *TORCH_FUSED)),
    Config("monitor", (*GPT2, "--compile", *TORCH_FUSED, "--monitor")),
    Config("fused adamw", (*GPT2, "--compile", "--optimizer", "fused")),
    Config("fused adamw + monitor", (*GPT2, "--compile", "--optimizer", "fused", "--monitor")),
    Config("fused-flat adamw", (*GPT2, "--compile", "--optimizer", "fused-flat")),
    Config("compile blocks", (*GPT2, "--compile", "blocks", *TORCH_FUSED)),
    Config("plain eager", (*GPT2, *TORCH_FUSED), baseline="plain eager"),
    Config("fused adamw eager", (*GPT2, "--optimizer", "fused"), baseline="plain eager"),
    Config("fused-flat adamw eager", (*GPT2, "--optimizer", "fused-flat"),
           baseline="plain eager"),
    Config("compile act-ckpt", (*GPT2, "--compile", *TORCH_FUSED,
                                "--activation-checkpointing")),
    Config("fp32 (no amp)", ("--preset", "gpt2-124m", "--batch-size", "16", "--amp", "off",
                             *TORCH_FUSED)),
]
DEFAULTS = {  # kind -> steps, warm-up steps dropped, rounds
    "quick": (30, 5, 5),
    "cpu": (30, 5, 3),
    "gpu": (60, 20, 3),
}



def command(flags: tuple[str, ...], steps: int, nproc: int, stats: Path) -> list[str]:
    """The command line of one run (torchrun for more than one rank)."""
    args = [TRAIN, *flags, "--max-steps", str(steps), "--stats-json", str(stats)]
    if nproc == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(free_port()), "--", *args]


def run(cfg: Config, kind: str, args: argparse.Namespace, tmp: Path, tag: str) -> dict:
    """One training job; rank 0's stats JSON (raises with the output's tail)."""
    stats = tmp / f"{tag}.json"
    device = ("--device", "cuda" if kind == "gpu" else "cpu")
    nproc = 2 if kind == "cpu" else 1
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "SCALEMON_HOME": str(tmp / "home"), "SCALEMON_JOB_ID": f"bench-{tag}",
           "SCALEMON_HUB_ARGS": "--linger 1", **cfg.env}
    (tmp / "home").mkdir(exist_ok=True)
    cmd = command((*cfg.flags, *device), args.steps, nproc, stats)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not stats.exists():
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise RuntimeError(f"{cfg.name} failed ({proc.returncode}):\n{tail}")
    return json.loads(stats.read_text())


def run_figures(stats: dict, warmup: int) -> dict:
    """tokens/s (all ranks) from the median step time over the intervals that start after
    `warmup` steps, and what else one run tells."""
    intervals = [(step, n, s) for step, n, s in stats["intervals"] if step - n >= warmup]
    intervals = intervals or stats["intervals"]
    step_s = statistics.median(s / n for _, n, s in intervals)
    world = stats["world_size"]
    per_rank = stats["tokens_per_step"] / step_s
    return {
        "tokens_per_s": per_rank * world, "median_step_ms": 1e3 * step_s,
        "tokens_per_step": stats["tokens_per_step"] * world, "world_size": world,
        "mfu": (stats["flops_per_token"] * per_rank / stats["peak_flops"]
                if stats["peak_flops"] else None),
        "memory_estimate_bytes": stats["memory_estimate"]["total"],
        "mem_peak_bytes": stats.get("mem_peak_bytes"), "final_loss": stats["losses"][-1],
    }


def rounds(configs: list[Config], kind: str, args: argparse.Namespace) -> dict[str, list]:
    """Every configuration --rounds times, in an order rotated each round; per configuration
    the figures of each round."""
    runs: dict[str, list[dict]] = {c.name: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="smtp", dir="/tmp") as tmp:
        for i in range(args.warmup_runs):  # cold caches would otherwise hit the first run
            run(configs[0], kind, args, Path(tmp), f"{kind}-warm{i}")
        for r in range(args.rounds):
            k = r % len(configs)
            for i, cfg in enumerate(configs[k:] + configs[:k]):
                t0 = time.perf_counter()
                stats = run(cfg, kind, args, Path(tmp), f"{kind}-r{r}-{i}")
                runs[cfg.name].append(run_figures(stats, args.warmup))
                print(f"  round {r + 1}/{args.rounds} {cfg.name}: "
                      f"{runs[cfg.name][-1]['tokens_per_s']:,.0f} tokens/s "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return runs


def summarize(cfg: Config, runs: dict[str, list[dict]]) -> dict:
    """Median of runs and spread; the per-round ratio to the baseline, median and spread."""
    mine = runs[cfg.name]
    tps = [r["tokens_per_s"] for r in mine]
    med = statistics.median(tps)
    base = runs.get(cfg.baseline, [])
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(mine, base, strict=False)]
    last = mine[-1]
    row = {
        "config": cfg.name, "flags": " ".join(cfg.flags), "baseline": cfg.baseline,
        "runs": len(mine), "tokens_per_s_median": med,
        "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
        "spread_pct": 100 * (max(tps) - min(tps)) / med,
        "ratio_to_baseline_median": statistics.median(ratios) if ratios else None,
        "ratio_to_baseline_min": min(ratios) if ratios else None,
        "ratio_to_baseline_max": max(ratios) if ratios else None,
        "median_step_ms": statistics.median(r["median_step_ms"] for r in mine),
        "mfu_median": (statistics.median(r["mfu"] for r in mine)
                       if last["mfu"] is not None else None),
        "tokens_per_step": last["tokens_per_step"], "world_size": last["world_size"],
        "memory_estimate_bytes": last["memory_estimate_bytes"],
        "mem_peak_bytes": last["mem_peak_bytes"], "tokens_per_s_runs": tps,
    }
    if row["mem_peak_bytes"]:
        row["estimate_over_measured"] = row["memory_estimate_bytes"] / row["mem_peak_bytes"]
    return row


def table(rows: list[dict]) -> str:
    """The rows as a text table."""
    head = (f"{'config':<34} | {'ranks':>5} | {'tokens/s med':>12} | {'spread':>7} | "
            f"{'vs baseline':>22} | {'MFU':>6} | {'peak MiB':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        mfu = f"{100 * r['mfu_median']:.1f}%" if r["mfu_median"] is not None else "n/a"
        peak = f"{r['mem_peak_bytes'] / 2**20:.0f}" if r["mem_peak_bytes"] else "n/a"
        if r["config"] == r["baseline"]:
            vs = "baseline"
        elif r["ratio_to_baseline_median"] is None:
            vs = "n/a"
        else:
            vs = (f"{r['ratio_to_baseline_median']:.3f} [{r['ratio_to_baseline_min']:.3f}-"
                  f"{r['ratio_to_baseline_max']:.3f}]")
        lines.append(
            f"{r['config']:<34} | {r['world_size']:>5} | {r['tokens_per_s_median']:>12,.0f} | "
            f"{r['spread_pct']:>6.1f}% | {vs:>22} | {mfu:>6} | {peak:>8}")
    return "\n".join(lines)


def nvidia_driver() -> str | None:
    """The NVIDIA driver version, or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return None


def gpu_name() -> str:
    """The GPU's name, asked of a subprocess (this process holds no CUDA context)."""
    code = "import torch; print(torch.cuda.get_device_name(0))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def bench(kind: str, configs: list[Config], args: argparse.Namespace) -> None:
    """Run `configs` in rounds, print the table, save the JSON."""
    import torch

    configs = [c for c in configs if not args.filter or args.filter in c.name
               or c.name == c.baseline]
    if kind == "gpu":
        device = gpu_name()
        versions = {"cuda": torch.version.cuda, "driver": nvidia_driver()}
    else:
        device = f"{cpu_model()} ({os.cpu_count()} CPUs)"
        versions = {}
    runs = rounds(configs, kind, args)
    rows = [summarize(c, runs) for c in configs]
    print(f"\n{device}, torch {torch.__version__}, {args.rounds} rounds of {args.steps} steps, "
          f"median step after the first {args.warmup}; vs baseline: median [min-max] of the "
          f"per-round ratios of tokens/s\n{table(rows)}\n")
    slug = "cpu" if kind != "gpu" else re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"train_throughput_rounds-{slug}{'-quick' if kind == 'quick' else ''}.json"
    out.write_text(json.dumps({
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device, "machine": platform.node(),
        "torch": torch.__version__, **versions, "python": platform.python_version(),
        "kind": kind, "args": vars(args), "rows": rows,
    }, indent=1) + "\n")
    print(f"saved {out.relative_to(REPO)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (steps, warm-up and rounds default per kind of run)."""
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU, one process, tiny, 4 configs")
    p.add_argument("--only", choices=("cpu", "gpu"), help="run one table only")
    p.add_argument("--steps", type=int, help="steps per run")
    p.add_argument("--warmup", type=int, help="steps dropped at the start of a run")
    p.add_argument("--rounds", type=int, help="runs of every configuration")
    p.add_argument("--filter", help="only configurations whose name contains this "
                                    "(and their baselines)")
    p.add_argument("--warmup-runs", type=int, default=1,
                   help="runs of the first configuration before the rounds, discarded")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    return p.parse_args(argv)


def with_defaults(args: argparse.Namespace, kind: str) -> argparse.Namespace:
    """A copy of `args` with the kind's defaults where a flag was not given."""
    steps, warmup, n = DEFAULTS[kind]
    out = argparse.Namespace(**vars(args))
    out.steps, out.warmup = args.steps or steps, args.warmup if args.warmup is not None else warmup
    out.rounds = args.rounds or n
    return out


def main(argv: list[str] | None = None) -> int:
    """CPU table (or --quick), then the GPU table when a GPU is visible."""
    args = parse_args(argv)
    import torch

    if args.quick:
        bench("quick", QUICK_CONFIGS, with_defaults(args, "quick"))
        return 0
    if args.only != "gpu":
        bench("cpu", CPU_CONFIGS, with_defaults(args, "cpu"))
    if args.only != "cpu":
        if torch.cuda.is_available():
            bench("gpu", GPU_CONFIGS, with_defaults(args, "gpu"))
        else:
            print("no GPU visible: the gpt2-124m bf16 + compile table was skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
