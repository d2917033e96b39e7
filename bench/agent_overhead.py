"""What the scalemon agent costs a training job.

Runs the demo trainer (2 gloo ranks under torchrun, CPU) repeatedly, interleaving three modes in
every round so that machine noise hits them alike:

- `off`      no monitor (DDP's built-in C++ all-reduce)
- `off-hook` no monitor, DDP with torch's own Python all-reduce comm hook: the fair baseline,
             since the monitor times the all-reduce through a Python comm hook and on gloo any
             Python hook changes DDP's timing by itself
- `on`       --monitor (agent + auto-started hub)
- `hub-kill` --monitor, the hub SIGKILLed once the job reaches --kill-at

and prints the median step time of each mode (rank 0's wall time per step, warm-up steps
dropped), the ratio to `off`, and the agent's own time on the training thread per step (its
hooks and `log()`, measured by the agent itself). Results go to bench/results/.

    python bench/agent_overhead.py                 # 5 rounds of 300 steps
    python bench/agent_overhead.py --rounds 2 --steps 100
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(mode: str, steps: int, kill_at: int, home: Path, tag: str) -> dict:
    """One torchrun job; returns rank 0's stats JSON."""
    stats = home / f"{tag}.json"
    job = f"bench-{tag}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "--", str(REPO / "demo_train" / "train.py"),
           "--max-steps", str(steps), "--stats-json", str(stats), "--device", "cpu"]
    if mode in ("on", "hub-kill"):
        cmd.append("--monitor")
    if mode == "off-hook":
        cmd.append("--python-comm-hook")
    env = {**os.environ, "SCALEMON_HOME": str(home), "SCALEMON_JOB_ID": job,
           "OMP_NUM_THREADS": "1", "SCALEMON_HUB_ARGS": "--linger 1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    killed_at = None
    for line in proc.stdout:
        if mode == "hub-kill" and killed_at is None and line.startswith(f"step {kill_at} "):
            job_file = json.loads((home / "jobs" / f"{job}.json").read_text())
            os.kill(job_file["pid"], signal.SIGKILL)
            killed_at = kill_at
    if proc.wait() != 0:
        raise RuntimeError(f"{mode} run failed with exit code {proc.returncode}")
    result = json.loads(stats.read_text())
    result["killed_at"] = killed_at
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20, help="steps dropped at the start of a run")
    p.add_argument("--kill-at", type=int, default=100, help="hub-kill: step at which to kill")
    args = p.parse_args()
    modes = ("off", "off-hook", "on", "hub-kill")
    times: dict[str, list[float]] = {m: [] for m in modes}
    agent_us: list[float] = []  # mean per step, per run
    agent_step_us: list[float] = []  # every measured step of every run
    with tempfile.TemporaryDirectory(prefix="smb", dir="/tmp") as tmp:
        home = Path(tmp)
        for rnd in range(args.rounds):
            k = rnd % len(modes)
            for i, mode in enumerate(modes[k:] + modes[:k]):  # rotate the order
                r = run_job(mode, args.steps, args.kill_at, home, f"{rnd}-{i}-{mode}")
                first = args.kill_at if mode == "hub-kill" else args.warmup
                times[mode].extend(r["step_times_s"][first:])
                if mode == "on":
                    agent_us.append(1e6 * r["agent_time_total_s"] / r["agent_steps"])
                    totals = r["agent_totals_s"][first - 1:]
                    agent_step_us.extend(1e6 * (b - a) for a, b in itertools.pairwise(totals))
                print(f"round {rnd + 1}/{args.rounds} {mode:>8}: median step "
                      f"{1e3 * statistics.median(r['step_times_s'][first:]):.3f} ms", flush=True)
    base = statistics.median(times["off"])
    hook_base = statistics.median(times["off-hook"])
    rows = []
    for mode in modes:
        med = statistics.median(times[mode])
        rows.append({"mode": mode, "median_step_ms": 1e3 * med, "ratio_to_off": med / base,
                     "ratio_to_off_hook": med / hook_base, "steps_measured": len(times[mode])})
    agent_med = statistics.median(agent_us)
    agent_step_med = statistics.median(agent_step_us)
    print()
    print(f"demo trainer, tiny preset, 2 gloo ranks on CPU, {args.rounds} rounds x "
          f"{args.steps} steps (hub-kill: steps after the kill at {args.kill_at})")
    print(f"{'mode':>9} | {'median step ms':>14} | {'ratio to off':>12} | "
          f"{'ratio to off-hook':>17} | {'steps':>6}")
    for r in rows:
        print(f"{r['mode']:>9} | {r['median_step_ms']:>14.3f} | {r['ratio_to_off']:>12.4f} | "
              f"{r['ratio_to_off_hook']:>17.4f} | {r['steps_measured']:>6}")
    print(f"agent time on the training thread per step (goal <= 20 us): median step "
          f"{agent_step_med:.1f} us, mean {agent_med:.1f} us (median over runs of each run's "
          f"mean; the mean also holds the rare step the OS preempted mid-hook)")
    print("ratio goal <= 1.01: 'on' against 'off' (no monitor) and against 'off-hook' (torch's "
          "own Python all-reduce hook, the agent's hook minus its timing)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "agent_overhead-cpu.json"
    out.write_text(json.dumps({
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.node(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "args": vars(args),
        "rows": rows, "agent_us_per_step_runs": agent_us, "agent_us_per_step_median": agent_med,
        "agent_us_per_step_median_of_steps": agent_step_med, "agent_steps_measured":
        len(agent_step_us),
    }, indent=1))
    print(f"saved {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
