"""Benchmark FusedAdamW (one Triton launch per step) against torch.optim.AdamW.

Protocol: baselines torch AdamW with foreach=False,
foreach=True and fused=True on the same params and grads; workloads GPT-2 124M tensor shapes,
1000 x 4096, 10000 x 64 and 1 x 1G elements; fp32, and bf16 (ours: bf16 params with fp32
master/moments; torch: bf16 params and state); >= 20 warm-up and >= 100 timed steps per
implementation, interleaved, timed with CUDA events; median and p10/p90; GB/s from bytes moved
and as % of a measured device-to-device copy; time relative to fused=True. bf16 adds our
lighter modes: lo16 master + bf16 moments (18 B/param), fp32 master + bf16 moments (20), and
torch's own bytes (14: no master, bf16 moments) rounded to nearest or stochastically.

--host measures the host side of step() alone: microseconds per call and torch ops per call
(torch.profiler), for 148 tensors (GPT-2 124M's count) and 10000 tensors, with the same grads
every step and with a training loop's grads (zero_grad(set_to_none=True), then grads as
autograd makes them: new tensors, or added in place into grads that stayed, which is what
`ours flat`, FusedAdamW(flat_buffers=True), keeps), interleaved in rounds; zero_grad() is
timed too. On a GPU the tensors have GPT-2's shapes (10000 x 64 for the other) and the kernels
run; without one they are 64-element CPU tensors and our launch is stubbed out (torch's CPU
optimizers do their math, negligible at 64 elements: a reference, not a rival).

    python bench/fused_adam.py            # full run, saves bench/results/fused_adam_<gpu>.{json,md}
    python bench/fused_adam.py --quick    # fewer workloads and steps, no 1G case
    python bench/fused_adam.py --skip-1g  # leave out the 1G-element case
    python bench/fused_adam.py --host     # host time per step(), saves fused_adam_host-<device>

Without CUDA (and without --host) it runs a tiny sanity check under the Triton interpreter and
saves nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from machine import cpu_model

RESULTS = Path(__file__).resolve().parent / "results"
IMPLS = ("ours", "torch_foreach=False", "torch_foreach=True", "torch_fused=True")
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
# our bf16 modes beyond the default (fp32 master and moments): name -> FusedAdamW options
OURS_BF16 = {
    "ours_lo16+bf16m": {"master_weights": "lo16", "moment_dtype": "bf16"},
    "ours_fp32m+bf16m": {"master_weights": "fp32", "moment_dtype": "bf16"},
    # torch's bf16 fused=True bytes (14): no master, bf16 moments; rounded to nearest as
    # torch does, or stochastically (unbiased, small updates kept)
    "ours_pure-bf16": {"master_weights": False, "moment_dtype": "bf16"},
    "ours_pure-bf16-sr": {"master_weights": False, "moment_dtype": "bf16",
                          "stochastic_rounding": True},
}
HOST_IMPLS = ("ours", "ours flat", "ours+hook", "torch_fused=True", "torch_foreach=True",
              "empty step")
"""--host: `ours+hook` is ours with a (no-op) step hook registered, as the monitor's agent
registers them: torch's profiler range and hook calls around the step, for comparison;
`ours flat` is ours with ``flat_buffers=True`` (params and grads in flat buffers);
`empty step` does nothing but enter and leave ``torch.no_grad()`` after the same grad-making
as `ours flat`: the cost of running Python on caches that the 10000 grads just went through."""


class EmptyStep:
    """--host's floor: a step() that does no work (``zero_grad`` keeps the grads)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear."""

    def step(self) -> None:
        """Enter and leave no_grad, as every optimizer's step does."""
        with torch.no_grad():
            pass


def gpt2_124m_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of GPT-2 small (tied lm_head): 148 tensors, 124,439,808 elements."""
    d, layer = 768, []
    layer += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,)]  # ln_1, attn.c_attn, attn.c_proj
    layer += [(d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]  # ln_2, mlp.c_fc, mlp.c_proj
    return [(50257, d), (1024, d)] + layer * 12 + [(d,), (d,)]


def workloads(quick: bool, with_1g: bool) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(name, shapes) of each workload."""
    out = [("gpt2-124m", gpt2_124m_shapes()), ("1000x4096", [(4096,)] * 1000)]
    if not quick:
        out.append(("10000x64", [(64,)] * 10000))
        if with_1g:
            out.append(("1x1G", [(1 << 30,)]))
    return out


def bytes_per_param(impl: str, dtype: torch.dtype) -> int:
    """Bytes moved per parameter: read p,g,m,v and write p,m,v (ours bf16: its master mode)."""
    from scalemon.demo_train.fused_adam import bytes_per_param as ours_bytes

    if dtype == torch.float32:
        return 28
    if impl == "ours":
        return ours_bytes(dtype, "fp32", torch.float32)
    if impl in OURS_BF16:
        mode = OURS_BF16[impl]
        return ours_bytes(dtype, mode["master_weights"] or None, torch.bfloat16)
    return 2 * 7


def bytes_needed(numel: int, dtype: torch.dtype) -> int:
    """Device memory for shared params/grads, the state of all implementations and torch
    foreach's temporaries (about three param-sized buffers)."""
    size = torch.tensor([], dtype=dtype).element_size()
    ours = 12 if dtype != torch.float32 else 8
    if dtype != torch.float32:
        ours += (2 + 2 * 2) + (4 + 2 * 2)  # lo16 + bf16 moments; fp32 master + bf16 moments
        ours += 2 * (2 * 2)  # pure bf16, rounded to nearest and stochastically: bf16 moments
    return numel * (2 * size + ours + 3 * 2 * size + 3 * size)


def make_optimizers(params: list[torch.Tensor]) -> dict[str, torch.optim.Optimizer]:
    """The four implementations (and our bf16 modes for bf16 params) on the same (shared)
    params; each keeps its own state. lo16 rewrites the params' low rounding at its first
    step, harmless here: every implementation steps the same shared params."""
    from scalemon.demo_train.fused_adam import FusedAdamW

    opts = {
        "ours": FusedAdamW(params, **HYPER),
        "torch_foreach=False": torch.optim.AdamW(params, foreach=False, **HYPER),
        "torch_foreach=True": torch.optim.AdamW(params, foreach=True, **HYPER),
        "torch_fused=True": torch.optim.AdamW(params, fused=True, **HYPER),
    }
    if params[0].dtype == torch.bfloat16:
        opts.update({name: FusedAdamW(params, **HYPER, **kw) for name, kw in OURS_BF16.items()})
    return opts


def time_interleaved(opts: dict, warmup: int, iters: int) -> dict[str, dict[str, list[float]]]:
    """Per implementation: GPU ms (CUDA events) and host us per step, in rotating order."""
    names = list(opts)
    for _ in range(warmup):
        for name in names:
            opts[name].step()
    torch.cuda.synchronize()
    events: dict[str, list] = {n: [] for n in names}
    host: dict[str, list[float]] = {n: [] for n in names}
    for i in range(iters):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            opts[name].step()
            end.record()
            host[name].append((time.perf_counter() - t0) * 1e6)
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {n: {"ms": [s.elapsed_time(e) for s, e in events[n]], "host_us": host[n]} for n in names}


def copy_gbps(nbytes: int = 1 << 31, iters: int = 50) -> float:
    """Device-to-device copy bandwidth (read + write bytes) in GB/s, median of ``iters``."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").fill_(1.0)
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (statistics.median(times) * 1e-3) / 1e9


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100)."""
    ys = sorted(xs)
    pos = (len(ys) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)


def summarize(raw: dict, numel: int, dtype: torch.dtype, copy: float) -> list[dict[str, Any]]:
    """One row per implementation with median/p10/p90, GB/s, % of copy, ratio to fused."""
    rows = []
    fused = statistics.median(raw["torch_fused=True"]["ms"])
    for name, r in raw.items():
        med = statistics.median(r["ms"])
        gbps = numel * bytes_per_param(name, dtype) / (med * 1e-3) / 1e9
        rows.append(
            {
                "impl": name,
                "median_ms": med,
                "p10_ms": percentile(r["ms"], 10),
                "p90_ms": percentile(r["ms"], 90),
                "host_us": statistics.median(r["host_us"]),
                "bytes_per_param": bytes_per_param(name, dtype),
                "gbps": gbps,
                "pct_of_copy": 100 * gbps / copy,
                "time_vs_fused": med / fused,
            }
        )
    return rows


def run_case(shapes: list, dtype: torch.dtype, args: argparse.Namespace, copy: float) -> dict:
    """Build shared params/grads, time the four optimizers, free everything."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
    for p in params:
        p.requires_grad_(True)
        p.grad = torch.randn(p.shape, device="cuda", generator=gen).to(dtype) * 1e-2
    numel = sum(p.numel() for p in params)
    opts = make_optimizers(params)
    raw = time_interleaved(opts, args.warmup, args.iters)
    rows = summarize(raw, numel, dtype, copy)
    del opts, params
    torch.cuda.empty_cache()
    return {"numel": numel, "tensors": len(shapes), "rows": rows}


def driver_version() -> str:
    """NVIDIA driver version, or 'n/a'."""
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # missing NVML is a value, not an error
        return "n/a"


def header() -> dict[str, str]:
    """What the numbers were measured on."""
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_memory_gib": f"{props.total_memory / 2**30:.1f}",
        "driver": driver_version(),
        "cuda": str(torch.version.cuda),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def markdown(head: dict, copy: float, results: list[dict]) -> str:
    """The results as a markdown table."""
    lines = [f"# FusedAdamW benchmark on {head['gpu']}", ""]
    lines += [", ".join(f"{k} {v}" for k, v in head.items()), ""]
    lines += [f"Device-to-device copy: {copy:.0f} GB/s (read + write).", ""]
    lines.append(
        "| workload | dtype | impl | median ms | p10 ms | p90 ms | host us | B/param "
        "| GB/s | % of copy | time vs fused |"
    )
    lines.append("|" + "---|" * 11)
    for res in results:
        for r in res["rows"]:
            lines.append(
                f"| {res['workload']} | {res['dtype']} | {r['impl']} | {r['median_ms']:.3f} "
                f"| {r['p10_ms']:.3f} | {r['p90_ms']:.3f} | {r['host_us']:.0f} "
                f"| {r['bytes_per_param']} | {r['gbps']:.0f} | {r['pct_of_copy']:.1f} "
                f"| {r['time_vs_fused']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def save(head: dict, copy: float, results: list[dict], quick: bool) -> Path:
    """Write JSON and markdown under bench/results/, named after the GPU."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", head["gpu"]).strip("-").lower()
    stem = RESULTS / f"fused_adam_{slug}{'_quick' if quick else ''}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"header": head, "copy_gbps": copy, "hyper": HYPER, "results": results}
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(head, copy, results))
    return stem


def cpu_sanity() -> int:
    """No CUDA: check a few interpreter steps against torch and save nothing."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from scalemon.demo_train.fused_adam import FusedAdamW

    print("No CUDA device: the benchmark needs a GPU. Running a CPU interpreter sanity check;")
    print("interpreter timings mean nothing and are not saved.")
    ref_ps = [torch.randn(s, requires_grad=True) for s in [(3,), (4097,), ()]]
    our_ps = [p.detach().clone().requires_grad_() for p in ref_ps]
    ref, ours = torch.optim.AdamW(ref_ps, **HYPER), FusedAdamW(our_ps, **HYPER)
    for _ in range(3):
        for r, o in zip(ref_ps, our_ps, strict=True):
            r.grad = torch.randn_like(r)
            o.grad = r.grad.clone()
        ref.step()
        ours.step()
    err = max((r - o).abs().max().item() for r, o in zip(ref_ps, our_ps, strict=True))
    print(f"max |ours - torch.optim.AdamW| after 3 steps: {err:.2e}")
    return 0 if err < 1e-5 else 1


def host_workloads(cuda: bool) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(name, shapes) for --host: GPT-2's 148 tensors (64 elements each on CPU) and 10000."""
    gpt2 = gpt2_124m_shapes() if cuda else [(64,)] * len(gpt2_124m_shapes())
    return [(f"{len(gpt2)} tensors", gpt2), ("10000 tensors", [(64,)] * 10000)]


def stub_launch() -> None:
    """CPU: our kernel launch becomes a no-op (the Triton interpreter would time numpy)."""
    from scalemon.demo_train import adam_plan

    adam_plan.Plan.launch = lambda self, *args: None


def backward_like(params: list[torch.Tensor], gen: torch.Generator) -> None:
    """New grads as autograd gives them: a new tensor where ``.grad`` is None, else added in
    place (how flat buffers keep theirs)."""
    for p in params:
        g = torch.randn(p.shape, device=p.device, generator=gen, dtype=p.dtype)
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


def time_host(cases: dict, set_to_none: bool, rounds: int,
              iters: int) -> dict[str, dict[str, list[float]]]:
    """Host microseconds of each step() call (and, with ``set_to_none``, of the
    ``zero_grad(set_to_none=True)`` before it, after which grads are made as autograd makes
    them), implementations interleaved by rounds (the first round, which builds state and
    tables, is dropped). ``cases``: name -> (optimizer, its params). The device is
    synchronised before each timed call so that a full launch queue never blocks it."""
    first = next(iter(cases.values()))[1][0]
    gen = torch.Generator(device=first.device).manual_seed(0)
    names = list(cases)
    times: dict[str, dict[str, list[float]]] = {n: {"step": [], "zero_grad": []} for n in names}
    for r in range(rounds + 1):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            opt, params = cases[name]
            for _ in range(iters):
                if set_to_none:
                    _sync(first)
                    t0 = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    zero_us = (time.perf_counter() - t0) * 1e6
                    backward_like(params, gen)
                _sync(first)
                t0 = time.perf_counter()
                opt.step()
                if r > 0:
                    times[name]["step"].append((time.perf_counter() - t0) * 1e6)
                    if set_to_none:
                        times[name]["zero_grad"].append(zero_us)
    return times


def _sync(t: torch.Tensor) -> None:
    """Wait for the GPU (no-op on the CPU)."""
    if t.is_cuda:
        torch.cuda.synchronize()


def torch_ops_per_step(opt: torch.optim.Optimizer, params: list[torch.Tensor],
                       set_to_none: bool) -> int:
    """torch ops recorded by the profiler in one step() (its own record_function left out)."""
    from torch.profiler import ProfilerActivity, profile

    if set_to_none:
        opt.zero_grad(set_to_none=True)
        backward_like(params, torch.Generator(device=params[0].device).manual_seed(1))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    return sum(1 for e in prof.events() if not e.name.startswith("Optimizer."))


def host_case(shapes: list, set_to_none: bool, args: argparse.Namespace) -> list[dict]:
    """Rows of one --host case: every implementation on shared params, except ``ours flat``,
    which moves its params into its own buffers (a copy of the same values)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=gen).requires_grad_() for s in shapes]
    backward_like(params, gen)
    flat_params = [p.detach().clone().requires_grad_() for p in params]
    opts = {k: v for k, v in make_optimizers(params).items() if k in HOST_IMPLS}
    from scalemon.demo_train.fused_adam import FusedAdamW

    opts["ours+hook"] = FusedAdamW(params, **HYPER)
    opts["ours+hook"].register_step_post_hook(lambda *_: None)
    opts["ours flat"] = FusedAdamW(flat_params, **HYPER, flat_buffers=True)
    backward_like(flat_params, gen)
    opts["empty step"] = EmptyStep()
    on_flat = ("ours flat", "empty step")
    cases = {k: (opts[k], flat_params if k in on_flat else params) for k in HOST_IMPLS}
    raw = time_host(cases, set_to_none, args.rounds, args.iters)
    rows = []
    for name, t in raw.items():
        med = statistics.median(t["step"])
        zero = statistics.median(t["zero_grad"]) if t["zero_grad"] else None
        rows.append({
            "impl": name, "set_to_none": set_to_none, "tensors": len(shapes),
            "median_us": med, "p10_us": percentile(t["step"], 10),
            "p90_us": percentile(t["step"], 90), "us_per_tensor": med / len(shapes),
            "zero_grad_us": zero, "calls": len(t["step"]),
            "torch_ops_per_step": torch_ops_per_step(*cases[name], set_to_none),
        })
    return rows


def host_header() -> dict[str, str]:
    """What --host ran on (the CPU without a GPU)."""
    import triton

    if torch.cuda.is_available():
        return header()
    return {"device": f"{cpu_model()} ({os.cpu_count()} CPUs)", "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(),
            "launch": "stubbed (TRITON_INTERPRET=1, CPU tensors)"}


def host_markdown(head: dict, rows: list[dict]) -> str:
    """The --host rows as a markdown table."""
    lines = [f"# FusedAdamW host time per step() on {head.get('gpu', head.get('device'))}", ""]
    lines += [", ".join(f"{k} {v}" for k, v in head.items()), ""]
    lines.append("| workload | set_to_none | impl | step() median us | p10 us | p90 us "
                 "| us/tensor | torch ops/step | zero_grad() median us |")
    lines.append("|" + "---|" * 9)
    for r in rows:
        zero = "" if r.get("zero_grad_us") is None else f"{r['zero_grad_us']:.0f}"
        lines.append(
            f"| {r['workload']} | {r['set_to_none']} | {r['impl']} | {r['median_us']:.0f} "
            f"| {r['p10_us']:.0f} | {r['p90_us']:.0f} | {r['us_per_tensor']:.3f} "
            f"| {r['torch_ops_per_step']} | {zero} |"
        )
    return "\n".join(lines) + "\n"


def host_main(args: argparse.Namespace) -> int:
    """--host: time step() on the host, print and save the table."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        stub_launch()
    head = host_header()
    print("  ".join(f"{k}={v}" for k, v in head.items()))
    rows = []
    for name, shapes in host_workloads(torch.cuda.is_available()):
        for set_to_none in (False, True):
            for row in host_case(shapes, set_to_none, args):
                rows.append({"workload": name, **row})
            print("\n".join(host_markdown(head, rows).splitlines()[-len(HOST_IMPLS):]),
                  flush=True)
    print(host_markdown(head, rows))
    if not args.no_save:
        device = head.get("gpu", "cpu")
        slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()
        stem = RESULTS / f"fused_adam_host-{slug}"
        RESULTS.mkdir(parents=True, exist_ok=True)
        payload = {"header": head, "args": vars(args), "hyper": HYPER, "rows": rows}
        stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
        stem.with_suffix(".md").write_text(host_markdown(head, rows))
        print(f"saved {stem}.{{json,md}}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer workloads/steps, no 1G case")
    ap.add_argument("--skip-1g", action="store_true", help="leave out the 1G-element workload")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 20)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (default 100)")
    ap.add_argument("--no-save", action="store_true", help="print only")
    ap.add_argument("--host", action="store_true", help="host time per step() (CPU works)")
    ap.add_argument("--rounds", type=int, default=5, help="--host: interleaved rounds")
    args = ap.parse_args(argv)
    args.warmup = args.warmup or (5 if args.quick else 20)
    args.iters = args.iters or (10 if args.host else 20 if args.quick else 100)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or the CPU sanity check) and print/save the table."""
    args = parse_args(argv)
    if args.host:
        return host_main(args)
    if not torch.cuda.is_available():
        return cpu_sanity()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: unset it to benchmark compiled kernels on the GPU.")
        return 2
    head = header()
    print("  ".join(f"{k}={v}" for k, v in head.items()))
    copy = copy_gbps()
    print(f"device-to-device copy: {copy:.0f} GB/s")
    free = torch.cuda.mem_get_info()[0]
    results = []
    for name, shapes in workloads(args.quick, not args.skip_1g):
        for dtype in (torch.float32, torch.bfloat16):
            numel = sum(torch.Size(s).numel() for s in shapes)
            if bytes_needed(numel, dtype) > 0.85 * free:
                print(f"skip {name} {dtype}: needs {bytes_needed(numel, dtype) / 2**30:.0f} GiB")
                continue
            res = run_case(shapes, dtype, args, copy)
            res.update(workload=name, dtype=str(dtype).replace("torch.", ""))
            results.append(res)
            print("\n".join(markdown(head, copy, [res]).splitlines()[-4:]), flush=True)
    print(markdown(head, copy, results))
    if not args.no_save:
        print(f"saved {save(head, copy, results, args.quick)}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
