"""What the scalemon agent costs a training job.

CPU mode (the default): runs the demo trainer (2 gloo ranks under torchrun, CPU, tiny preset)
repeatedly, interleaving four modes in every round so that machine noise hits them alike:

- `off`      no monitor (DDP's built-in C++ all-reduce)
- `off-hook` no monitor, DDP with torch's own Python all-reduce comm hook: the fair baseline,
             since the monitor times the all-reduce through a Python comm hook and on gloo any
             Python hook changes DDP's timing by itself
- `on`       --monitor (agent + auto-started hub)
- `hub-kill` --monitor, the hub SIGKILLed once the job reaches --kill-at (or the first step
             after it by which the auto-started hub wrote its job file)

and prints the median step time of each mode (rank 0's wall time per step, warm-up steps
dropped), the ratio to `off`, and the agent's own time on the training thread per step (its
hooks and `log()`, measured by the agent itself). Results go to
bench/results/agent_overhead-cpu.json.

GPU mode (--gpu, needs one CUDA GPU): 1 rank under torchrun on the GPU (NCCL), the `gpt2-124m`
preset (GPT-2 124M shapes, byte-level vocab) with bf16 autocast and torch.compile, batch 16
(--batch-size) x block 1024, in modes `off` and `on` only (the Python-hook baseline and hub-kill
are CPU-stand-in concerns). On a GPU the host runs ahead of the device between the trainer's
loss reads (every --log-every steps), so a step's time is taken between those reads: the median,
over the intervals that start after the warm-up steps (torch.compile), of interval time / steps.
Results go to bench/results/agent_overhead-gpu-<device name>.json with the device and torch
version.

Goals: 'on' within 1% of 'off' (ratio <= 1.01), agent time <= 20 us per step.

    python bench/agent_overhead.py                 # CPU: 5 rounds of 300 steps
    python bench/agent_overhead.py --rounds 2 --steps 100 --kill-at 50
    python bench/agent_overhead.py --gpu           # GPU: 3 rounds of 60 steps, 10 warm-up
    python bench/agent_overhead.py --gpu --dry-run # print the torchrun commands, run nothing
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import free_port

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
TRAIN = str(REPO / "demo_train" / "train.py")

CPU_MODES = ("off", "off-hook", "on", "hub-kill")
GPU_MODES = ("off", "on")
# defaults per mode: rounds, steps, warm-up steps dropped
CPU_DEFAULTS = {"rounds": 5, "steps": 300, "warmup": 20}
GPU_DEFAULTS = {"rounds": 3, "steps": 60, "warmup": 10}
GPU_PRESET = "gpt2-124m"  # GPT-2 124M shapes (demo_train/model.py PRESETS)
GPU_BLOCK_SIZE = 1024
GPU_BATCH_SIZE = 16  # sequences per forward: 16k tokens a step, as nanoGPT's 124M on one GPU
GPU_LOG_EVERY = 10  # the trainer's default on CUDA, written out so the bench does not drift



def job_command(args: argparse.Namespace, mode: str, stats: Path, port: int) -> list[str]:
    """The torchrun command line of one run of `mode`."""
    nproc = "1" if args.gpu else "2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc,
           "--master-port", str(port), "--", TRAIN,
           "--max-steps", str(args.steps), "--stats-json", str(stats)]
    if args.gpu:
        cmd += ["--device", "cuda", "--preset", GPU_PRESET, "--block-size", str(GPU_BLOCK_SIZE),
                "--batch-size", str(args.batch_size), "--amp", "bf16", "--compile",
                "--log-every", str(args.log_every)]
    else:
        cmd += ["--device", "cpu"]
    if mode in ("on", "hub-kill"):
        cmd.append("--monitor")
    if mode == "off-hook":
        cmd.append("--python-comm-hook")
    return cmd


def job_env(home: Path, job: str) -> dict[str, str]:
    """What a run adds to the environment."""
    return {"SCALEMON_HOME": str(home), "SCALEMON_JOB_ID": job, "OMP_NUM_THREADS": "1",
            "SCALEMON_HUB_ARGS": "--linger 1"}


def run_job(args: argparse.Namespace, mode: str, home: Path, tag: str) -> dict:
    """One torchrun job; returns rank 0's stats JSON (with `killed_at`: the step after which
    hub-kill killed the hub, else None). A run that fails or is interrupted is stopped, its
    process group killed."""
    stats = home / f"{tag}.json"
    job = f"bench-{tag}"
    cmd = job_command(args, mode, stats, free_port())
    env = {**os.environ, **job_env(home, job)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    killed_at = None
    tail: collections.deque[str] = collections.deque(maxlen=40)  # shown if the run fails
    try:
        for line in proc.stdout:
            tail.append(line)
            logged = re.match(r"step (\d+) ", line) if mode == "hub-kill" else None
            if logged and killed_at is None and int(logged[1]) >= args.kill_at:
                # at --kill-at, or later if the auto-started hub has not written its job file
                job_file = home / "jobs" / f"{job}.json"
                if job_file.exists():
                    os.kill(json.loads(job_file.read_text())["pid"], signal.SIGKILL)
                    killed_at = int(logged[1])
        code = proc.wait()
    finally:
        if proc.poll() is None:
            stop_group(proc)
    if code != 0:
        raise RuntimeError(f"{mode} run failed with exit code {code}; its output ended:\n"
                           f"{''.join(tail)}")
    if mode == "hub-kill" and killed_at is None:
        raise RuntimeError(f"hub-kill run: the hub was not killed (no job file by the last step "
                           f"{args.steps}); output ended:\n{''.join(tail)}")
    result = json.loads(stats.read_text())
    result["killed_at"] = killed_at
    return result


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the process group of a run (torchrun and its ranks)."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def step_times(args: argparse.Namespace, r: dict, first: int) -> list[float]:
    """The measured step times of one run, seconds. CPU: rank 0's wall time of every step
    from `first` on (each step ends with a host read of its loss). GPU: interval time / steps
    of each interval between the trainer's loss reads that starts at step `first` or later
    (the host runs ahead of the device in between, so single steps are not timed)."""
    if not args.gpu:
        return r["step_times_s"][first:]
    return [s / n for step, n, s in r["intervals"] if step - n >= first]


def steps_in(args: argparse.Namespace, r: dict, first: int) -> int:
    """How many steps `step_times` covers."""
    if not args.gpu:
        return len(r["step_times_s"][first:])
    return sum(n for step, n, _ in r["intervals"] if step - n >= first)


def agent_step_times(r: dict, first: int) -> list[float]:
    """The agent's training-thread time of each step after the first `first`, microseconds
    (from its running total, read after every step's `log()`)."""
    totals = [0.0, *r["agent_totals_s"]][first:]
    return [1e6 * (b - a) for a, b in itertools.pairwise(totals)]


def gpu_info() -> dict:
    """Device name, torch and CUDA versions (and the driver), asked of a tiny subprocess so
    this process holds no CUDA context while the runs use the GPU."""
    code = ("import json, torch\n"
            "ok = torch.cuda.is_available()\n"
            "print(json.dumps({'device': torch.cuda.get_device_name(0) if ok else None,\n"
            "                  'torch': torch.__version__, 'cuda': torch.version.cuda}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    info = json.loads(out.stdout.strip().splitlines()[-1])
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30)
        info["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
    except (OSError, IndexError, subprocess.TimeoutExpired):
        info["driver"] = None
    return info


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def dry_run(args: argparse.Namespace, modes: tuple[str, ...]) -> int:
    """Print the command of every mode (the first round's order and tags), run nothing."""
    home = Path(tempfile.gettempdir()) / "smbXXXXXXXX"  # a temporary directory per bench
    what = (f"GPU: 1 NCCL rank, {GPU_PRESET}, bf16, compile, batch {args.batch_size} x block "
            f"{GPU_BLOCK_SIZE}, loss read every {args.log_every} steps" if args.gpu else
            "CPU: 2 gloo ranks, tiny preset")
    print(f"dry run, {what}; {args.rounds} rounds x {args.steps} steps, the first "
          f"{args.warmup} dropped; the order of the modes rotates each round; one run:")
    for i, mode in enumerate(modes):
        tag = f"0-{i}-{mode}"
        env = job_env(home, f"bench-{tag}")
        cmd = job_command(args, mode, home / f"{tag}.json", free_port())
        print(f"\n# {mode}" + (f" (the hub is SIGKILLed at 'step {args.kill_at} ')"
                               if mode == "hub-kill" else ""))
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
    out = ("agent_overhead-gpu-<device name>.json" if args.gpu else "agent_overhead-cpu.json")
    print(f"\nresults would go to {(RESULTS / out).relative_to(REPO)}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true",
                   help="GPU mode: 1 rank on the GPU, gpt2-124m, bf16, compile; off/on only")
    p.add_argument("--rounds", type=int, help="default: 5 (CPU), 3 (GPU)")
    p.add_argument("--steps", type=int, help="steps per run; default: 300 (CPU), 60 (GPU)")
    p.add_argument("--warmup", type=int,
                   help="steps dropped at the start of a run; default: 20 (CPU), 10 (GPU)")
    p.add_argument("--kill-at", type=int, default=100,
                   help="hub-kill: step at which to kill (CPU mode)")
    p.add_argument("--batch-size", type=int,
                   help=f"GPU mode: sequences per step (default {GPU_BATCH_SIZE})")
    p.add_argument("--log-every", type=int,
                   help=f"GPU mode: the trainer's loss read (host sync) every N steps; step "
                        f"times are measured between them (default {GPU_LOG_EVERY})")
    p.add_argument("--dry-run", action="store_true",
                   help="print the torchrun command of each mode and exit")
    args = p.parse_args()
    if not args.gpu and (args.batch_size is not None or args.log_every is not None):
        p.error("--batch-size and --log-every are for --gpu (the CPU runs are fixed)")
    for key, value in (GPU_DEFAULTS if args.gpu else CPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.gpu:
        args.batch_size = GPU_BATCH_SIZE if args.batch_size is None else args.batch_size
        args.log_every = GPU_LOG_EVERY if args.log_every is None else args.log_every
        if args.batch_size < 1 or args.log_every < 1:
            p.error("--batch-size and --log-every must be at least 1")
    if args.rounds < 1 or args.warmup < 0 or args.steps <= args.warmup:
        p.error("need --rounds >= 1 and --steps > --warmup >= 0")
    if args.gpu and args.steps < args.warmup + args.log_every:
        p.error(f"--gpu times intervals of --log-every {args.log_every} steps starting at or "
                f"after the warm-up: need --steps >= --warmup + --log-every")
    if not args.gpu and not 0 < args.kill_at < args.steps:
        p.error("hub-kill times the steps after --kill-at: need 0 < --kill-at < --steps")
    modes = GPU_MODES if args.gpu else CPU_MODES
    if args.dry_run:
        return dry_run(args, modes)
    if args.gpu:
        info = gpu_info()
        if info["device"] is None:
            print("agent_overhead.py --gpu: no CUDA GPU visible to torch "
                  f"{info['torch']}", file=sys.stderr)
            return 2
        print(f"GPU: {info['device']}, torch {info['torch']}, CUDA {info['cuda']}", flush=True)
    times: dict[str, list[float]] = {m: [] for m in modes}
    steps_measured: dict[str, int] = {m: 0 for m in modes}
    agent_us: list[float] = []  # mean per step, per run
    agent_step_us: list[float] = []  # every measured step of every run
    reader_us: list[float] = []  # the recorder thread's read time per step, per run
    with tempfile.TemporaryDirectory(prefix="smb", dir="/tmp") as tmp:
        home = Path(tmp)
        for rnd in range(args.rounds):
            k = rnd % len(modes)
            for i, mode in enumerate(modes[k:] + modes[:k]):  # rotate the order
                r = run_job(args, mode, home, f"{rnd}-{i}-{mode}")
                first = r["killed_at"] if mode == "hub-kill" else args.warmup
                run_times = step_times(args, r, first)
                if not run_times:
                    raise RuntimeError(f"{mode} run: no step timed after step {first}")
                times[mode].extend(run_times)
                steps_measured[mode] += steps_in(args, r, first)
                if mode == "on":
                    agent_us.append(1e6 * r["agent_time_total_s"] / r["agent_steps"])
                    agent_step_us.extend(agent_step_times(r, first))
                    if r.get("recorder_read_s") is not None:
                        reader_us.append(1e6 * r["recorder_read_s"] / r["agent_steps"])
                print(f"round {rnd + 1}/{args.rounds} {mode:>8}: median step "
                      f"{1e3 * statistics.median(run_times):.3f} ms", flush=True)
    base = statistics.median(times["off"])
    hook_base = statistics.median(times["off-hook"]) if "off-hook" in times else None
    rows = []
    for mode in modes:
        med = statistics.median(times[mode])
        rows.append({"mode": mode, "median_step_ms": 1e3 * med, "ratio_to_off": med / base,
                     "ratio_to_off_hook": med / hook_base if hook_base else None,
                     "steps_measured": steps_measured[mode]})
    agent_med = statistics.median(agent_us)
    agent_step_med = statistics.median(agent_step_us)
    print()
    if args.gpu:
        print(f"demo trainer on {info['device']} (torch {info['torch']}), {GPU_PRESET} preset, "
              f"bf16, compile, batch {args.batch_size} x block {GPU_BLOCK_SIZE}, 1 NCCL rank, "
              f"{args.rounds} rounds x {args.steps} steps (step time: between the loss reads "
              f"every {args.log_every} steps, after the first {args.warmup} steps)")
    else:
        print(f"demo trainer, tiny preset, 2 gloo ranks on CPU, {args.rounds} rounds x "
              f"{args.steps} steps (hub-kill: steps after the kill at {args.kill_at})")
    print(f"{'mode':>9} | {'median step ms':>14} | {'ratio to off':>12} | "
          f"{'ratio to off-hook':>17} | {'steps':>6}")
    for r in rows:
        hook = (f"{r['ratio_to_off_hook']:>17.4f}" if r["ratio_to_off_hook"] is not None
                else f"{'-':>17}")
        print(f"{r['mode']:>9} | {r['median_step_ms']:>14.3f} | {r['ratio_to_off']:>12.4f} | "
              f"{hook} | {r['steps_measured']:>6}")
    print(f"agent time on the training thread per step (goal <= 20 us): median step "
          f"{agent_step_med:.1f} us, mean {agent_med:.1f} us (median over runs of each run's "
          f"mean; the mean also holds the rare step the OS preempted mid-hook)")
    if reader_us:
        print(f"Flight Recorder reads, on the agent's own thread (not the training thread): "
              f"median {statistics.median(reader_us):.1f} us per step (agent's own timer; its "
              f"effect on training is in the 'on' ratio)")
    if args.gpu:
        on = next(r for r in rows if r["mode"] == "on")
        print(f"ratio goal <= 1.01: 'on' against 'off' (no monitor): "
              f"{on['ratio_to_off']:.4f}")
    else:
        print("ratio goal <= 1.01: 'on' against 'off' (no monitor) and against 'off-hook' "
              "(torch's own Python all-reduce hook, the agent's hook minus its timing)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.gpu:
        out = RESULTS / f"agent_overhead-gpu-{slug(info['device'])}.json"
        head = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "device": info["device"],
                "machine": platform.node(), "torch": info["torch"], "cuda": info["cuda"],
                "driver": info["driver"], "python": platform.python_version(),
                "args": {"rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
                         "preset": GPU_PRESET, "batch_size": args.batch_size,
                         "block_size": GPU_BLOCK_SIZE, "amp": "bf16", "compile": True,
                         "log_every": args.log_every},
                "step_time": "median over loss-read intervals after the warm-up of "
                             "interval time / steps"}
    else:
        out = RESULTS / "agent_overhead-cpu.json"
        head = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.node(),
                "cpus": os.cpu_count(), "python": platform.python_version(),
                "args": {"rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
                         "kill_at": args.kill_at}}
    out.write_text(json.dumps({
        **head, "rows": rows, "agent_us_per_step_runs": agent_us,
        "agent_us_per_step_median": agent_med,
        "agent_us_per_step_median_of_steps": agent_step_med, "agent_steps_measured":
        len(agent_step_us), "recorder_read_us_per_step_runs": reader_us,
    }, indent=1))
    print(f"saved {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
