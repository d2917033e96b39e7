"""How often a job that torchrun restarts finishes, with the monitor and without (issue #37).

`torchrun --nproc-per-node 2 --max-restarts 1` runs tests/jobs/restart_gloo.py: a plain gloo
DDP script whose rank 1 raises before step 5 in the first attempt; both ranks resume from their
own checkpoint and finish at step 10. Runs alternate with the monitor (the script uses
scalemon.agent: init, log, finish; the hub is the one rank 0 starts) and without, each with a
timeout; a run succeeds when torchrun exits 0 and both ranks said they reached the last step.

    python bench/restart_success.py                  # 20 runs each, a few minutes per 10 runs
    python bench/restart_success.py --runs 5 --torchrun-store
    python bench/restart_success.py --job demo       # the demo trainer instead (slower)

--torchrun-store has the script rendezvous in torchrun's store as it is, as a plain script
does: the static rendezvous keeps that store (and its keys) across attempts, so a restarted
worker can read the dead attempt's gloo address (failure kind `stale-rendezvous`). By default
the script keys its rendezvous by attempt, as demo_train does (tests/jobs/restart_gloo.py).
Failures are sorted by kind: `stale-rendezvous` (init_process_group's connectFullMesh refused),
`hang-in-rendezvous` (killed after --timeout s with a restarted rank still in
init_process_group: both sides of a gloo pair waited for the other to connect, each having
compared its address with a stale one), `timeout` (killed after --timeout s elsewhere), `exit N`
(anything else). Results are appended
to bench/results/restart_success-<device>.json with the machine named.
"""

from __future__ import annotations

import argparse
import contextlib
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

import psutil
from machine import append_result, cpu_name, free_port, job_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "jobs" / "restart_gloo.py"
TRAIN = REPO / "demo_train" / "train.py"
DEMO_STEPS = 12


def command(tmp: Path, monitor: bool, args: argparse.Namespace) -> list[str]:
    """torchrun with the restart script (or the demo trainer) of one run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--max-restarts", "1", "--master-port", str(free_port()), "--"]
    if args.job == "demo":
        cmd += [str(TRAIN), "--device", "cpu", "--max-steps", str(DEMO_STEPS),
                "--inject-crash", "1:5", "--ckpt-dir", str(tmp / "ckpt"), "--ckpt-every", "2",
                "--resume-or-start"]
        return cmd + (["--monitor"] if monitor else [])
    cmd += [str(SCRIPT), str(tmp / "ckpt"), "--steps", str(args.steps)]
    if args.torchrun_store:
        cmd.append("--torchrun-store")
    return cmd + (["--monitor"] if monitor else [])


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill a run started in a session of its own, with every descendant."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def stop_hubs(home: Path) -> None:
    """Stop the hub a monitored run's rank 0 started (it outlives the job by design)."""
    from scalemon.home.jobfile import JobFile

    for job_file in (home / "jobs").glob("*.json"):
        with contextlib.suppress(Exception):
            os.kill(JobFile.read(job_file).pid, signal.SIGKILL)


def kind_of(returncode: int | None, output: str, finished: int, job: str = "plain") -> str:
    """A run's outcome: ok, stale-rendezvous, hang-in-rendezvous (the plain script's restarted
    ranks never got past init_process_group), timeout, or exit N."""
    if returncode is None:
        if job == "plain" and output.count("attempt 1 starts") < 2:
            return "hang-in-rendezvous"
        return "timeout"
    if returncode == 0 and finished == 2:
        return "ok"
    if "connectFullMesh failed" in output:
        return "stale-rendezvous"
    return f"exit {returncode}"


def finished_ranks(job: str, output: str) -> int:
    """How many ranks said they reached the last step."""
    if job == "demo":  # rank 0 prints the last step; the exit code speaks for rank 1
        return 2 if f"step {DEMO_STEPS} loss" in output else 0
    return output.count("done at step")


def one_run(monitor: bool, args: argparse.Namespace, index: int) -> dict:
    """One torchrun job; its outcome, wall time and the end of its output when it failed."""
    with tempfile.TemporaryDirectory(prefix="rst", dir="/tmp") as tmp_name:
        tmp = Path(tmp_name)
        home = tmp / f"restart{index}{'m' if monitor else 'p'}"
        home.mkdir()
        log = tmp / "out.log"
        t0 = time.perf_counter()
        with open(log, "wb") as out:
            proc = subprocess.Popen(command(tmp, monitor, args), env=job_env(home, linger_s=10),
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                returncode: int | None = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                returncode = None
                kill_tree(proc)
        wall = time.perf_counter() - t0
        stop_hubs(home)
        output = log.read_text(errors="replace")
    kind = kind_of(returncode, output, finished_ranks(args.job, output), args.job)
    row = {"monitor": monitor, "kind": kind, "exit_code": returncode, "wall_s": round(wall, 2)}
    if kind != "ok":
        row["tail"] = output[-1500:]
    return row


def summary(rows: list[dict], monitor: bool) -> dict:
    """Runs, successes, failures by kind and the median wall time of one arm."""
    mine = [r for r in rows if r["monitor"] == monitor]
    kinds = Counter(r["kind"] for r in mine)
    ok = kinds.pop("ok", 0)
    return {"monitor": monitor, "runs": len(mine), "successes": ok,
            "failures": dict(sorted(kinds.items())),
            "median_wall_s": round(statistics.median(r["wall_s"] for r in mine), 2)
            if mine else None}


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="runs with the monitor, and as many "
                                                          "without (default 20)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a run is "
                                                                  "killed as hung (default 120)")
    p.add_argument("--steps", type=int, default=10, help="steps of the restart script")
    p.add_argument("--job", choices=("plain", "demo"), default="plain",
                   help="plain: tests/jobs/restart_gloo.py; demo: demo_train/train.py")
    p.add_argument("--torchrun-store", action="store_true",
                   help="the plain script rendezvous in torchrun's store as it is")
    args = p.parse_args()
    rows = []
    for i in range(args.runs):
        for monitor in (True, False):  # alternating: both arms see the same machine
            row = one_run(monitor, args, i)
            rows.append(row)
            print(f"run {i + 1:>3} {'monitor' if monitor else 'plain':<8} {row['kind']:<18}"
                  f"{row['wall_s']:>7.1f} s", flush=True)
    machine = cpu_name()
    arms = [summary(rows, True), summary(rows, False)]
    print(f"\nrestart under torchrun --max-restarts 1 ({args.job}"
          f"{', torchrun store' if args.torchrun_store else ''}), 2 gloo ranks on {machine}")
    print(f"{'':<10}{'runs':>6}{'ok':>6}{'median s':>10}  failures")
    for arm in arms:
        failures = ", ".join(f"{k}: {n}" for k, n in arm["failures"].items()) or "-"
        print(f"{'monitor' if arm['monitor'] else 'plain':<10}{arm['runs']:>6}"
              f"{arm['successes']:>6}{arm['median_wall_s']:>10}  {failures}")
    append_result("restart_success", {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "device": "cpu", "machine": machine,
        "host": platform.node(), "python": platform.python_version(), "args": vars(args),
        "command": " ".join(command(Path("TMP"), True, args)),
        "summary": arms, "runs": rows,
    })


if __name__ == "__main__":
    main()
