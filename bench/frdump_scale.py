"""`scalemon dump --dir` at thousands of ranks: seconds and peak memory of the analysis.

For each size, dumps of N ranks x E entries are written into a temporary directory in the
format the agent writes (`agent/recorder.py`: torch's Flight Recorder pickle, protocol 2,
without stack traces, `nccl_rank_<rank>`), each with the summary the agent writes beside it
(`rank_<rank>.summary`, by the same function, `scalemon.reports.frsummary.write_summary`;
its cost is timed apart: "summary ms" per rank, which a job pays on every rank at once, on
each agent's recorder thread; --no-summaries leaves them out, so that the analysis reads every
pickle), then `python -m scalemon.cli dump --dir DIR --json`
(what the hub runs, `hub/frdump.py`) analyses them in a process of its own while its process
tree's RSS is sampled (the analysis may use worker processes: their RSS counts too). Besides
the wall seconds, the CPU seconds of the analysis and its workers (`cpu_s`: on a machine others
use, the wall seconds say how much of it they left) and the others' use of the machine during
the run (`others_cpu_pct`, % of one core; "busy %" is theirs in the second before it).

The job the dumps describe: N = pp x dp x tp ranks (tp 8 and pp 4 from 64 ranks up), a mesh
of groups as `init_device_mesh` makes them (default_pg, mesh_tp, mesh_dp, mesh_pp), steps of
tp all_reduce, pp send/recv (P2P entries), dp all_reduce and now and then a default_pg
all_reduce; each rank's ring keeps its last E entries. In the last step one rank (the planted
culprit) stops before its tp all_reduce: its tp peers wait in that all_reduce, every other
rank waits in the default group's all_reduce. One rank of a tp group has another dtype at one
completed collective (a planted mismatch).

    python bench/frdump_scale.py                   # 512, 1024, 2048, 4096 ranks x 2000
    python bench/frdump_scale.py --ranks 512 --entries 2000
    python bench/frdump_scale.py --quick           # 16 ranks x 200 (the test)
    python bench/frdump_scale.py --no-summaries    # every rank's pickle read by the analysis

Results are appended to bench/results/frdump_scale-cpu.json (--out to write elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import platform
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import psutil
from machine import append_result, cpu_name, machine_busy_pct

from scalemon.reports.frsummary import write_summary

REPO = Path(__file__).resolve().parents[1]
T0_NS = 1_790_000_000_000_000_000
SAMPLE_S = 0.05


# --- the job the dumps describe -------------------------------------------------------------

class Mesh:
    """pp x dp x tp ranks and their groups, named as torch names them (uids "0", "1", ...)."""

    def __init__(self, ranks: int) -> None:
        self.tp, self.pp = (8, 4) if ranks >= 64 else (4, 2)
        if ranks % (self.tp * self.pp):
            raise SystemExit(f"{ranks} ranks: not a multiple of tp x pp = {self.tp * self.pp}")
        self.ranks, self.dp = ranks, ranks // (self.tp * self.pp)
        self.groups: dict[str, tuple[str, list[int]]] = {"0": ("default_pg", list(range(ranks)))}
        self.of: dict[int, dict[str, str]] = {r: {"default": "0"} for r in range(ranks)}
        for kind in ("tp", "dp", "pp"):
            for members in self._members(kind):
                name = str(len(self.groups))
                self.groups[name] = (f"mesh_{kind}", members)
                for r in members:
                    self.of[r][kind] = name

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp stage, dp index, tp index) of `rank`."""
        return rank // (self.tp * self.dp), rank // self.tp % self.dp, rank % self.tp

    def _members(self, kind: str) -> list[list[int]]:
        by: dict[tuple[int, int], list[int]] = {}
        for r in range(self.ranks):
            p, d, t = self.coords(r)
            key = {"tp": (p, d), "dp": (p, t), "pp": (d, t)}[kind]
            by.setdefault(key, []).append(r)
        return list(by.values())

    def culprit(self) -> int:
        return self.ranks // 2 + 3


_KEYS = ("record_id", "pg_id", "process_group", "collective_seq_id", "p2p_seq_id", "op_id",
         "profiling_name", "time_created_ns", "duration_ms", "input_sizes", "input_dtypes",
         "output_sizes", "output_dtypes", "state", "time_discovered_started_ns",
         "time_discovered_completed_ns", "retired", "timeout_ms", "is_p2p", "thread_id",
         "thread_name", "frames")


def _ops(mesh: Mesh, rank: int, steps: int) -> list[tuple[str, str, list[int], str, int]]:
    """(group kind, op, size, dtype, step) of every op `rank` issued, the hung last step
    included."""
    p, _, _ = mesh.coords(rank)
    out = []
    for step in range(steps):
        if p > 0:
            out.append(("pp", f"recv {p}<-{p - 1}", [4096, 512], "BFloat16", step))
        out += [("tp", "all_reduce", [4096, 1024], "BFloat16", step)] * 2
        if p < mesh.pp - 1:
            out.append(("pp", f"send {p}->{p + 1}", [4096, 512], "BFloat16", step))
        out.append(("dp", "all_reduce", [1 << 20], "Float", step))
        if step % 10 == 9:
            out.append(("default", "all_reduce", [1], "Float", step))
    culprit = mesh.culprit()
    if rank != culprit:  # the last step: a tp all_reduce, then the default group's
        out.append(("tp", "all_reduce", [4096, 1024], "BFloat16", steps))
        if mesh.of[rank]["tp"] != mesh.of[culprit]["tp"]:
            out.append(("default", "all_reduce", [1], "Float", steps))
    return out


def rank_dump(mesh: Mesh, rank: int, entries: int) -> dict[str, Any]:
    """`rank`'s Flight Recorder as torch 2.13 writes it (NCCL, no stack traces)."""
    steps = entries // 4 + 2
    ops = _ops(mesh, rank, steps)
    seq: dict[str, list[int]] = {}  # group -> [collective seq, p2p seq, op id, completed op]
    ring = []
    groups = mesh.of[rank]
    mismatch_at = steps // 2 if rank == mesh.culprit() ^ 1 else -1
    for record, (kind, op, size, dtype, step) in enumerate(ops):
        name = groups[kind]
        counters = seq.setdefault(name, [0, 0, 0, 0])
        p2p = op.startswith(("send", "recv"))
        counters[1 if p2p else 0] += 1
        counters[2] += 1
        done = step < steps
        if done:
            counters[3] = counters[2]
        if step == mismatch_at and kind == "tp" and not p2p:
            dtype, mismatch_at = "Float", -1
        values = (record, int(name), (name, mesh.groups[name][0]), counters[0], counters[1],
                  counters[2], f"nccl:{op}", T0_NS + record * 1_000_000, 1.25 if done else None,
                  [list(size)], [dtype], [list(size)], [dtype],
                  "completed" if done else "started", T0_NS + record * 1_000_000 + 10,
                  T0_NS + record * 1_000_000 + 1_250_000 if done else None, done, 600000, p2p,
                  "140000000000000", "pt_main_thread", [])
        ring.append(dict(zip(_KEYS, values, strict=True)))
    return {
        "version": "2.10", "comm_lib_version": "2.27.5",
        "pg_config": {name: {"name": name, "desc": mesh.groups[name][0],
                             "ranks": str(mesh.groups[name][1])} for name in groups.values()},
        "pg_status": {name: {"last_enqueued_collective": c[2], "last_started_collective": c[2],
                             "last_completed_collective": c[3]} for name, c in seq.items()},
        "entries": ring[-entries:],
        "nccl_comm_state": {},
    }


def _write_ranks(args: tuple[str, int, list[int], int, bool]) -> tuple[int, float, float]:
    """Write some ranks' dumps (and summaries); returns their bytes and the summaries' wall
    and CPU seconds."""
    directory, ranks, chunk, entries, summaries = args
    mesh = Mesh(ranks)
    written, wall, cpu = 0, 0.0, 0.0
    for rank in chunk:
        data = pickle.dumps(rank_dump(mesh, rank, entries), protocol=2)
        path = Path(directory) / f"nccl_rank_{rank}"
        path.write_bytes(data)
        written += len(data)
        if summaries:  # as the agent's recorder thread does once the dump is written
            start, start_cpu = time.perf_counter(), time.thread_time()
            write_summary(Path(directory), rank, [path])
            wall += time.perf_counter() - start
            cpu += time.thread_time() - start_cpu
    return written, wall, cpu


def generate(directory: Path, ranks: int, entries: int, workers: int,
             summaries: bool = True) -> tuple[int, float, float]:
    """Write the dumps of `ranks` ranks, each with its summary unless not `summaries`;
    returns their bytes and the summaries' wall and CPU seconds (all ranks')."""
    chunks = [list(range(i, ranks, workers * 4)) for i in range(workers * 4)]
    with ProcessPoolExecutor(workers) as pool:
        parts = list(pool.map(_write_ranks, [(str(directory), ranks, c, entries, summaries)
                                             for c in chunks if c]))
    return (sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts))


# --- the analysis, measured -----------------------------------------------------------------

def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # ended meanwhile
            total += p.memory_info().rss
    return total


def analyse(directory: Path, timeout_s: float) -> dict[str, Any]:
    """`scalemon dump --dir DIRECTORY --json` in a process of its own: wall seconds, the peak
    RSS of its process tree (sampled), its report."""
    out_path = directory.parent / f"{directory.name}.report.json"
    cmd = [sys.executable, "-m", "scalemon.cli", "dump", "--dir", str(directory), "--json"]
    peak = 0
    used_before = _children_cpu_s()
    busy_before = _machine_busy_s()
    with open(out_path, "w") as out:
        start = time.monotonic()
        # run beside the dump, not in the checkout: its scalemon/ would shadow an installed one
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True,
                                cwd=directory.parent)
        watched = psutil.Process(proc.pid)
        stderr: list[str] = []
        reader = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
        reader.start()
        while proc.poll() is None:
            peak = max(peak, _tree_rss(watched))
            if time.monotonic() - start > timeout_s:
                proc.kill()
            time.sleep(SAMPLE_S)
        seconds = time.monotonic() - start
        reader.join(5)
    cpu = _children_cpu_s() - used_before  # the analysis and its workers (it waited for them)
    others = _machine_busy_s() - busy_before - cpu
    report = json.loads(out_path.read_text()) if proc.returncode == 0 else {}
    out_path.unlink()
    used = re.search(r"(\d+) of \d+ ranks read from their summaries", "".join(stderr))
    return {"seconds": round(seconds, 2), "peak_rss_mb": round(peak / 2**20, 1),
            "cpu_s": round(cpu, 1), "others_cpu_pct": round(100 * max(others, 0.0) / seconds),
            "exit_code": proc.returncode, "report": report, "stderr": "".join(stderr)[-2000:],
            "summaries_used": int(used[1]) if used else 0}


def _children_cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy so far (every process's)."""
    c = psutil.cpu_times()
    return sum(c) - c.idle - getattr(c, "iowait", 0.0)


def run(ranks: int, entries: int, args: argparse.Namespace) -> dict[str, Any]:
    """One size: generate, analyse, check the planted culprit."""
    mesh = Mesh(ranks)
    with tempfile.TemporaryDirectory(prefix="frscale", dir=args.tmp) as tmp:
        directory = Path(tmp) / "dumps"
        directory.mkdir()
        start = time.monotonic()
        nbytes, summary_s, summary_cpu_s = generate(directory, ranks, entries, args.workers,
                                                    not args.no_summaries)
        generated = time.monotonic() - start
        busy = machine_busy_pct(1.0)
        result = analyse(directory, args.timeout)
    report = result.pop("report")
    culprit = report.get("culprit") or {}
    mismatches = sum(g["mismatches"]["count"] for g in report.get("groups") or ())
    return {
        "ranks": ranks, "entries_per_rank": entries, "seconds": result["seconds"],
        "peak_rss_mb": result["peak_rss_mb"], "cpu_s": result["cpu_s"],
        "others_cpu_pct": result["others_cpu_pct"], "exit_code": result["exit_code"],
        "generate_s": round(generated, 1), "dump_mb": round(nbytes / 2**20, 1),
        "summary_ms_per_rank": round(1000 * summary_s / ranks, 2),
        "summary_cpu_ms_per_rank": round(1000 * summary_cpu_s / ranks, 2),
        "summaries_used": result["summaries_used"],
        "groups": len(mesh.groups), "ranks_read": len(report.get("read") or ()),
        "culprit_planted": mesh.culprit(), "culprits_found": culprit.get("culprits"),
        "culprit_found": culprit.get("culprits") == [mesh.culprit()],
        "waiting": len(culprit.get("waiting") or ()), "mismatches": mismatches,
        "text": str(report.get("text") or "")[:300], "machine_busy_pct_before": round(busy),
        "stderr": result["stderr"] if result["exit_code"] else "",
    }


COLUMNS = (("ranks", "ranks", "{:>6}"), ("entries_per_rank", "entries", "{:>7}"),
           ("dump_mb", "dump MB", "{:>8}"), ("generate_s", "gen s", "{:>6}"),
           ("summary_ms_per_rank", "summary ms", "{:>10}"),
           ("summaries_used", "summaries", "{:>9}"),
           ("seconds", "analysis s", "{:>10}"), ("cpu_s", "CPU s", "{:>6}"),
           ("peak_rss_mb", "peak RSS MB", "{:>11}"),
           ("culprit_found", "culprit", "{!s:>7}"), ("mismatches", "mism", "{:>4}"),
           ("machine_busy_pct_before", "busy %", "{:>6}"),
           ("others_cpu_pct", "others %", "{:>8}"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--entries", type=int, default=2000, help="entries per rank's ring")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="processes writing the dumps")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per analysis")
    p.add_argument("--tmp", help="where the dumps are written (default: the system's)")
    p.add_argument("--quick", action="store_true", help="16 ranks x 200 entries (the test)")
    p.add_argument("--no-summaries", action="store_true",
                   help="write no summaries beside the dumps: the analysis reads every pickle")
    p.add_argument("--out", type=Path, help="results file (default: bench/results/"
                                            "frdump_scale-cpu.json, appended)")
    p.add_argument("--note", default="", help="a note saved with the results")
    args = p.parse_args(argv)
    if args.quick:
        args.ranks, args.entries = [16], 200
    print("  ".join(title.rjust(len(fmt.format(0))) for _, title, fmt in COLUMNS))
    runs = []
    for ranks in args.ranks:
        row = run(ranks, args.entries, args)
        runs.append(row)
        print("  ".join(fmt.format(row[key]) for key, _, fmt in COLUMNS), flush=True)
        if row["exit_code"]:
            print(row["stderr"], file=sys.stderr)
    result = {"bench": "frdump_scale", "device": "cpu", "date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(),
                          "python": platform.python_version(),
                          "memory_gb": round(psutil.virtual_memory().total / 2**30, 1)},
              "command": " ".join(["python", "bench/frdump_scale.py", *(argv or sys.argv[1:])]),
              "note": args.note, "runs": runs}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    else:
        append_result("frdump_scale", result)
    return 0 if all(r["exit_code"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
