"""Tokens/s of the demo trainer per configuration (and MFU and memory on a GPU).

CPU: every technique flag on the tiny and small presets, 2 gloo ranks under torchrun
(OMP_NUM_THREADS=1 each). GPU, when one is visible: `gpt2-124m` on 1 GPU (bf16 + compile, and
the variants around it) with tokens/s, MFU against the device's dense bf16 peak, and the
memory estimate against the measured peak (torch.cuda.max_memory_allocated).

Throughput is all ranks' tokens per step time of rank 0, timed between the trainer's host syncs
(its --log-every steps; the first --warmup steps dropped: they include torch.compile and
allocator warm-up). Results go to
bench/results/train_throughput-<device>.json with the device named.

    python bench/train_throughput.py                    # CPU table, then GPU if present
    python bench/train_throughput.py --only gpu --steps 50
    python bench/train_throughput.py --only cpu --filter zero
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
TRAIN = str(REPO / "demo_train" / "train.py")

# (name, flags): CPU runs are 2 ranks; --batch-size is the micro-batch
CPU_CONFIGS: list[tuple[str, tuple[str, ...]]] = [
    ("tiny fp32 ddp", ("--preset", "tiny", "--batch-size", "8")),
    ("tiny bf16", ("--preset", "tiny", "--batch-size", "8", "--amp", "bf16")),
    ("tiny fp16 + GradScaler", ("--preset", "tiny", "--batch-size", "8", "--amp", "fp16")),
    ("tiny grad-accum 4x2", ("--preset", "tiny", "--batch-size", "2", "--grad-accum", "4")),
    ("tiny activation-ckpt", ("--preset", "tiny", "--batch-size", "8",
                              "--activation-checkpointing")),
    ("tiny zero1", ("--preset", "tiny", "--batch-size", "8", "--zero", "1")),
    ("tiny zero2 (fsdp2)", ("--preset", "tiny", "--batch-size", "8", "--zero", "2")),
    ("tiny zero3 (fsdp2)", ("--preset", "tiny", "--batch-size", "8", "--zero", "3")),
    ("tiny torch-fused adamw", ("--preset", "tiny", "--batch-size", "8",
                                "--optimizer", "torch-fused")),
    ("tiny fused adamw (triton interp)", ("--preset", "tiny", "--batch-size", "8",
                                          "--optimizer", "fused")),
    ("tiny compile", ("--preset", "tiny", "--batch-size", "8", "--compile")),
    ("small fp32 ddp", ("--preset", "small", "--batch-size", "8")),
    ("small bf16", ("--preset", "small", "--batch-size", "8", "--amp", "bf16")),
    ("small activation-ckpt", ("--preset", "small", "--batch-size", "8",
                               "--activation-checkpointing")),
    ("small zero3 (fsdp2)", ("--preset", "small", "--batch-size", "8", "--zero", "3")),
]
# (name, flags): 1 GPU, one process
GPU_CONFIGS: list[tuple[str, tuple[str, ...]]] = [
    ("gpt2-124m bf16 compile", ("--preset", "gpt2-124m", "--batch-size", "16", "--amp", "bf16",
                                "--compile")),
    ("gpt2-124m bf16", ("--preset", "gpt2-124m", "--batch-size", "16", "--amp", "bf16")),
    ("gpt2-124m bf16 compile act-ckpt", ("--preset", "gpt2-124m", "--batch-size", "16",
                                         "--amp", "bf16", "--compile",
                                         "--activation-checkpointing")),
    ("gpt2-124m fp32", ("--preset", "gpt2-124m", "--batch-size", "16", "--amp", "off")),
    ("gpt2-124m bf16 compile fused-adamw", ("--preset", "gpt2-124m", "--batch-size", "16",
                                            "--amp", "bf16", "--compile",
                                            "--optimizer", "fused")),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(flags: tuple[str, ...], steps: int, nproc: int, tmp: Path, tag: str,
        timeout: float) -> dict:
    """One training job; returns rank 0's stats JSON (raises with the output's tail)."""
    stats = tmp / f"{tag}.json"
    args = [TRAIN, *flags, "--max-steps", str(steps), "--stats-json", str(stats)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), "--", *args]
    else:
        cmd = [sys.executable, *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not stats.exists():
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise RuntimeError(f"{' '.join(flags)} failed ({proc.returncode}):\n{tail}")
    return json.loads(stats.read_text())


def summarize(name: str, flags: tuple[str, ...], stats: dict, warmup: int) -> dict:
    """tokens/s (all ranks), MFU where the peak is known, memory estimate vs measured.

    Time is taken between the trainer's host syncs (its logged steps: every step on CPU,
    every --log-every on a GPU, where the host runs ahead of the device in between), over the
    intervals that end after `warmup` steps."""
    intervals = [(step, n, s) for step, n, s in stats["intervals"] if step - n >= warmup]
    intervals = intervals or stats["intervals"]
    steps = sum(n for _, n, _ in intervals)
    step_s = sum(s for _, _, s in intervals) / steps
    times = [s / n for _, n, s in intervals]
    world = stats["world_size"]
    per_rank = stats["tokens_per_step"] / step_s
    row = {
        "config": name, "flags": " ".join(flags), "world_size": world,
        "tokens_per_step": stats["tokens_per_step"] * world,
        "median_step_ms": 1e3 * step_s, "tokens_per_s": per_rank * world,
        "mfu": (stats["flops_per_token"] * per_rank / stats["peak_flops"]
                if stats["peak_flops"] else None),
        "memory_estimate_bytes": stats["memory_estimate"]["total"],
        "mem_peak_bytes": stats.get("mem_peak_bytes"),
        "final_loss": stats["losses"][-1], "steps_measured": steps,
        "step_ms_spread": [1e3 * min(times), 1e3 * max(times)],
    }
    if row["mem_peak_bytes"]:
        row["estimate_over_measured"] = row["memory_estimate_bytes"] / row["mem_peak_bytes"]
    return row


def table(rows: list[dict]) -> str:
    head = (f"{'config':<36} | {'ranks':>5} | {'tok/step':>8} | {'step ms':>8} | "
            f"{'tokens/s':>10} | {'MFU':>6} | {'est MiB':>8} | {'peak MiB':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        peak = f"{r['mem_peak_bytes'] / 2**20:.0f}" if r["mem_peak_bytes"] else "n/a"
        lines.append(
            f"{r['config']:<36} | {r['world_size']:>5} | {r['tokens_per_step']:>8} | "
            f"{r['median_step_ms']:>8.2f} | {r['tokens_per_s']:>10,.0f} | {mfu:>6} | "
            f"{r['memory_estimate_bytes'] / 2**20:>8.1f} | {peak:>8}")
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        return re.search(r"model name\s*:\s*(.+)", text).group(1).strip()
    except (OSError, AttributeError):
        return platform.processor() or "unknown CPU"


def bench(kind: str, configs: list[tuple[str, tuple[str, ...]]], args: argparse.Namespace,
          nproc: int) -> None:
    """Run `configs`, print the table, save the JSON."""
    import torch

    if kind == "gpu":
        device = torch.cuda.get_device_name(0)
        versions = {"cuda": torch.version.cuda, "driver": _nvidia_driver()}
    else:
        device = f"{cpu_model()} ({os.cpu_count()} CPUs)"
        versions = {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="smtp", dir="/tmp") as tmp:
        for i, (name, flags) in enumerate(configs):
            if args.filter and args.filter not in name:
                continue
            t0 = time.perf_counter()
            device_flag = ("--device", "cpu") if kind == "cpu" else ("--device", "cuda")
            stats = run((*flags, *device_flag), args.steps, nproc, Path(tmp), f"{kind}{i}",
                        args.timeout)
            rows.append(summarize(name, flags, stats, args.warmup))
            print(f"  {name}: {rows[-1]['tokens_per_s']:,.0f} tokens/s "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\n{device}, torch {torch.__version__}, {args.steps} steps, median of steps after "
          f"the first {args.warmup}\n{table(rows)}\n")
    slug = "cpu" if kind == "cpu" else re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"train_throughput-{slug}.json"
    out.write_text(json.dumps({
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device, "machine": platform.node(),
        "torch": torch.__version__, **versions, "python": platform.python_version(),
        "args": vars(args), "rows": rows,
    }, indent=1))
    print(f"saved {out.relative_to(REPO)}")


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps dropped at the start of a run")
    p.add_argument("--only", choices=("cpu", "gpu"), help="run one table only")
    p.add_argument("--filter", help="only configurations whose name contains this")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    args = p.parse_args()
    import torch

    if args.only != "gpu":
        bench("cpu", CPU_CONFIGS, args, nproc=2)
    if args.only != "cpu":
        if torch.cuda.is_available():
            bench("gpu", GPU_CONFIGS, args, nproc=1)
        else:
            print("no GPU visible: the gpt2-124m bf16 + compile run (tokens/s, MFU, memory "
                  "estimate vs measured peak) was skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
