"""Whether the monitor counts every collective of a job exactly, to its end (issue #37).

tests/jobs/fsdp2_plain.py (FSDP2: `fully_shard` on 4 Linear layers, 30 steps, 2 gloo ranks,
monitored) runs --runs times with --busy busy-loop processes beside it (default 2: both cores
of a 2-core machine taken). Each rank must count exactly layers x steps reduce-scatters and
no collective under another op. A run is exact when both ranks did, by their own `collectives`
records in the hub's history, and `scalemon snapshot --json` says the same.

    python bench/end_of_job.py                    # 20 runs, a few minutes
    python bench/end_of_job.py --runs 5 --busy 0

A miss is named by what it looked like: `misnamed` (a reduce-scatter counted as gloo's
`all_reduce`: the recorder read its entry before the host timer's call was there), `lost`
(fewer reduce-scatters and nothing in their place), `failed` (the job did not exit 0).
Results are appended to bench/results/end_of_job-<device>.json with the machine named.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from machine import append_result, cpu_name, free_port, job_env

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "jobs" / "fsdp2_plain.py"


def snapshot_rows(home: Path) -> dict[str, int] | None:
    """(op -> count) of the default group in `scalemon snapshot --json`, once both ranks
    finished; None when they did not within a minute."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        done = subprocess.run([sys.executable, "-m", "scalemon.cli", "snapshot", home.name,
                               "--json"], env=job_env(home), capture_output=True, text=True,
                              timeout=60)
        if done.returncode == 0:
            state = json.loads(done.stdout)
            if len(state["ranks"]) == 2 and all(r["state"] == "finished"
                                                for r in state["ranks"]):
                return {r["op"]: r["count"] for r in state["collectives"]
                        if r["group"] == "default_pg"}
        time.sleep(0.5)
    return None


def per_rank(home: Path) -> dict[int, dict[str, int]]:
    """Each rank's collectives by op, summed over its `collectives` records in the history."""
    from scalemon.home.history import history_path, read_messages

    messages, _ = read_messages(history_path(home.name, home))
    out: dict[int, dict[str, int]] = {}
    for _, m in messages:
        if m.type == "collectives":
            for row in m.body.get("stats") or ():
                mine = out.setdefault(m.rank, {})
                mine[row[1]] = mine.get(row[1], 0) + row[3]
    return out


def stop_hub(home: Path) -> None:
    """Stop the hub rank 0 started (it outlives the job by design)."""
    from scalemon.home.jobfile import JobFile

    for job_file in (home / "jobs").glob("*.json"):
        with contextlib.suppress(Exception):
            os.kill(JobFile.read(job_file).pid, signal.SIGKILL)


def verdict(ranks: dict[int, dict[str, int]], snap: dict[str, int] | None,
            expected: int) -> str:
    """exact, misnamed, lost or failed (see the module's docstring)."""
    if snap is None or set(ranks) != {0, 1}:
        return "failed"
    if all(r.get("reduce_scatter") == expected and set(r) == {"all_gather", "reduce_scatter"}
           for r in ranks.values()) and snap.get("reduce_scatter") == expected:
        return "exact"
    if any("all_reduce" in r for r in ranks.values()):
        return "misnamed"
    return "lost"


def one_run(index: int, args: argparse.Namespace) -> dict:
    """One job with `args.busy` busy loops beside it."""
    expected = args.layers * args.steps
    with tempfile.TemporaryDirectory(prefix="eoj", dir="/tmp") as tmp:
        home = Path(tmp) / f"endofjob{index}"
        home.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), "--", str(JOB), "--layers",
               str(args.layers), "--steps", str(args.steps)]
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy)]
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, env=job_env(home), capture_output=True, text=True,
                                  timeout=args.timeout)
            returncode: int | None = done.returncode
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            for proc in busy:
                proc.kill()
                proc.wait()
        wall = time.perf_counter() - t0
        snap = snapshot_rows(home) if returncode == 0 else None
        ranks = per_rank(home) if returncode == 0 else {}
        stop_hub(home)
    kind = verdict(ranks, snap, expected) if returncode == 0 else "failed"
    return {"kind": kind, "exit_code": returncode, "wall_s": round(wall, 1),
            "snapshot": snap, "ranks": {str(r): ops for r, ops in sorted(ranks.items())}}


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--busy", type=int, default=2, help="busy-loop processes beside each job")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--label", default="", help="a note saved with the results (e.g. the code)")
    args = p.parse_args()
    rows = []
    for i in range(args.runs):
        row = one_run(i, args)
        rows.append(row)
        rs = " ".join(f"r{r}:{ops.get('reduce_scatter')}"
                      + (f"+ar{ops['all_reduce']}" if "all_reduce" in ops else "")
                      for r, ops in row["ranks"].items())
        print(f"run {i + 1:>3} {row['kind']:<9}{row['wall_s']:>7.1f} s  {rs}", flush=True)
    kinds = Counter(r["kind"] for r in rows)
    machine = cpu_name()
    expected = args.layers * args.steps
    print(f"\nFSDP2 {args.layers} layers x {args.steps} steps, 2 gloo ranks, {args.busy} busy "
          f"loops, on {machine}: {kinds.get('exact', 0)} of {len(rows)} runs counted "
          f"{expected} reduce-scatters on both ranks exactly; "
          + (", ".join(f"{k}: {n}" for k, n in sorted(kinds.items()) if k != "exact")
             or "no misses")
          + f"; median wall {statistics.median(r['wall_s'] for r in rows):.1f} s")
    append_result("end_of_job", {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "device": "cpu", "machine": machine,
        "host": platform.node(), "python": platform.python_version(), "args": vars(args),
        "expected_reduce_scatters_per_rank": expected,
        "summary": {"runs": len(rows), **{k: kinds.get(k, 0)
                                          for k in ("exact", "misnamed", "lost", "failed")}},
        "runs": rows,
    })


if __name__ == "__main__":
    main()
