"""The pipeline bubble the monitor measures against the schedule's theoretical one.

For GPipe and 1F1B at two microbatch counts, the demo trainer runs a 2-stage pipeline of equal
stages (the `small` preset: 4 layers, 2 per stage) on gloo ranks with --monitor; while it runs,
`scalemon snapshot --json` is read every --poll seconds and each rank's `pipeline_bubble` (the
agent's: seconds its training thread waited in P2P `Work.wait()` over the step time) is kept
once per (rank, step). A configuration's measured bubble is the median over its ranks of each
rank's median over the steps seen after the first --warmup steps; the theoretical one is
(p - 1) / (m + p - 1) for p stages and m microbatches, as the snapshot's `pipeline` says it.

    python bench/pipeline_bubble.py                 # CPU: 2 gloo ranks, a few minutes
    python bench/pipeline_bubble.py --steps 60 --microbatches 2,4

On a CPU the two stages share the machine's cores with each other (and with anything else
running), so a stage's compute slows while the other computes too; the figures say what the
monitor reports there, not what a GPU pipeline would show. Results are appended to
bench/results/pipeline_bubble-<device>.json with the machine named.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import append_result, cpu_name, free_port

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "demo_train" / "train.py")



def job_env(home: Path) -> dict[str, str]:
    env = os.environ.copy()
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    env.update(OMP_NUM_THREADS="1", SCALEMON_HOME=str(home), SCALEMON_JOB_ID=home.name,
               SCALEMON_HUB_ARGS="--linger 20")
    return env


def snapshot(home: Path) -> dict | None:
    """`scalemon snapshot --json` of the job, None while there is no hub (or it failed)."""
    done = subprocess.run([sys.executable, "-m", "scalemon.cli", "snapshot", home.name,
                           "--json"], env=job_env(home), capture_output=True, text=True,
                          timeout=60)
    return json.loads(done.stdout) if done.returncode == 0 else None


def run(schedule: str, microbatches: int, args: argparse.Namespace) -> dict:
    """One monitored pipeline job; its measured and theoretical bubble."""
    with tempfile.TemporaryDirectory(prefix="bubble") as tmp:
        home = Path(tmp) / f"bubble-{schedule}-{microbatches}"
        home.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(args.stages), "--master-port", str(free_port()), "--", TRAIN,
               "--device", "cpu", "--amp", "off", "--preset", args.preset,
               "--batch-size", str(args.batch_size), "--max-steps", str(args.steps),
               "--pp", str(args.stages), "--pp-schedule", schedule,
               "--microbatches", str(microbatches), "--monitor"]
        seen: dict[tuple[int, int], float] = {}  # (rank, step) -> bubble
        step_times: dict[tuple[int, int], float] = {}
        pipeline = None
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=job_env(home), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            while True:
                running = proc.poll() is None
                snap = snapshot(home)
                if snap is not None:
                    pipeline = snap.get("pipeline") or pipeline
                    for r in snap["ranks"]:
                        step, bubble = r.get("step"), r.get("pipeline_bubble")
                        if step is not None and bubble is not None and step > args.warmup:
                            seen[(r["rank"], step)] = bubble
                            step_times[(r["rank"], step)] = r.get("step_time_s")
                if not running:
                    break
                time.sleep(args.poll)
        finally:
            if proc.poll() is None:
                proc.kill()
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)}: exit code {proc.returncode}")
        per_rank = {}
        for rank in sorted({r for r, _ in seen}):
            per_rank[rank] = statistics.median(b for (r, _), b in seen.items() if r == rank)
        measured = statistics.median(per_rank.values()) if per_rank else None
        p = args.stages
        theory = (pipeline or {}).get("theoretical_bubble", (p - 1) / (microbatches + p - 1))
        return {
            "schedule": schedule, "stages": p, "microbatches": microbatches,
            "theoretical": theory,
            "measured": measured, "per_rank": per_rank, "samples": len(seen),
            "step_time_s": statistics.median(t for t in step_times.values() if t)
            if step_times else None,
            "wall_s": round(time.perf_counter() - t0, 1),
        }


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", default="gpipe,1f1b")
    p.add_argument("--microbatches", default="2,8", help="two (or more) microbatch counts")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--preset", default="small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=5, help="steps left out at the start")
    p.add_argument("--poll", type=float, default=0.3, help="seconds between snapshots")
    args = p.parse_args()
    rows = [run(s, int(m), args) for s in args.schedules.split(",")
            for m in args.microbatches.split(",")]
    machine = cpu_name()
    print(f"pipeline bubble, {args.stages} equal stages ({args.preset}), gloo on {machine}")
    print(f"{'schedule':<10}{'m':>4}{'theoretical':>13}{'measured':>10}{'per rank':>22}"
          f"{'step s':>9}{'samples':>9}")
    for r in rows:
        ranks = " ".join(f"{b:.3f}" for b in r["per_rank"].values())
        measured = f"{r['measured']:.3f}" if r["measured"] is not None else "n/a"
        step = f"{r['step_time_s']:.3f}" if r["step_time_s"] else "n/a"
        print(f"{r['schedule']:<10}{r['microbatches']:>4}{r['theoretical']:>13.3f}"
              f"{measured:>10}{ranks:>22}{step:>9}{r['samples']:>9}")
    append_result("pipeline_bubble", {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "device": "cpu", "machine": machine,
        "host": platform.node(), "python": platform.python_version(), "args": vars(args),
        "measured_by": "the agent's pipeline_bubble per rank and step, from snapshot --json",
        "rows": rows,
    })


if __name__ == "__main__":
    main()
