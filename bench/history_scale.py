"""A long job's history: disk per record, `scalemon summary`, one rank's and one step range's
records (issue #40 item 5).

Generates the history of a job of `--ranks` ranks at 1 step/s (the step bodies of
`scalemon.tui.sim.SimJob.step_bodies`: a rank's template with its numbers varied each step)
through the hub's own writer (`scalemon.home.history.History`, flushed every step as the hub
flushes, its tail sealed into compressed chunks), builds the summary's checkpoint once (what a
hub's background thread, or the first summary, does: `scalemon.link.checkpoint.catch_up`),
then times `scalemon summary --json` in a subprocess (with its peak RSS), reading one rank's
records and a 100-step range (`read_selected`), and compares the bytes per record on disk with
the earlier format (every record as a 4-byte length and its frame: the same frames' bytes).

    .venv/bin/python bench/history_scale.py --records 100000000
    .venv/bin/python bench/history_scale.py --quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from machine import append_result, cpu_name

from scalemon import protocol
from scalemon.home.history import History, ReadStats, Selection, history_path
from scalemon.home.history_read import read_selected
from scalemon.link.checkpoint import catch_up
from scalemon.tui.sim import SimJob

JOB = "hscale"
GIB = 1 << 30


def generate(path: Path, records: int, ranks: int) -> dict[str, Any]:
    """Write `records` step records (after one hello per rank) with the hub's writer."""
    sim = SimJob(job=JOB, ranks=ranks)
    rng = random.Random(7)
    history = History(path, memory_limit=10_000)
    for r in range(ranks):
        history.append(protocol.encode("hello", JOB, r, 0, sim.hello(r), t=sim.start_t))
    templates = sim.step_bodies(1, sim.start_t + 1)
    old_bytes = sum(4 + len(f) for f in history.get(0, ranks))
    written, step, worst_flush = 0, 0, 0.0
    started = time.perf_counter()
    while written < records:
        step += 1
        t = sim.start_t + step
        step_time = 1.0 + rng.gauss(0, 0.01)
        loss = 2.0 + 3.0 * math.exp(-step / 20000)
        now = min(ranks, records - written)
        for rank, body in enumerate(templates[:now]):
            body = dict(body, step=step, step_time_s=step_time,
                        loss=loss + rng.gauss(0, 0.04) + rank * 0.005,
                        optimizer_time_s=0.08 * (1 + rng.gauss(0, 0.02)),
                        allreduce_issue_t=t - 0.4 + rng.random() * 0.01,
                        extra={"lr": 6e-4})
            body["allreduce_time_s"] = step_time * 0.3 * (1 + rng.gauss(0, 0.02))
            if step % 10 == 0:
                body["extra"] = {"lr": 6e-4, "mfu": 0.41 + rng.gauss(0, 0.002)}
            frame = protocol.encode("step", JOB, rank, step, body, t + rank * 1e-5)
            history.append(frame)
            old_bytes += 4 + len(frame)
        written += now
        before = time.perf_counter()
        history.flush()
        worst_flush = max(worst_flush, time.perf_counter() - before)
        if step % 5000 == 0:
            rate = written / (time.perf_counter() - started)
            print(f"  {written:,} records, {rate:,.0f}/s", file=sys.stderr, flush=True)
    history.settle()  # this loop outpaces a hub 100x: let the sealing thread catch up
    seconds = time.perf_counter() - started
    chunks = len(history._sealed.entries)
    sealed = history._tail_base  # records in chunks; the rest is the tail, uncompressed
    seal_s = history.seal_s
    history.close()
    return {"records": written + ranks, "steps": step, "generate_s": round(seconds, 1),
            "old_format_bytes": old_bytes, "chunks": chunks, "sealed_records": sealed,
            "seal_s_total": round(seal_s, 2),
            "seal_ms_per_chunk": round(1000 * seal_s / max(1, chunks), 1),
            "worst_flush_ms": round(1000 * worst_flush, 1)}


def disk(path: Path) -> dict[str, int]:
    """The history's files and their sizes."""
    return {p.name: p.stat().st_size for p in sorted(path.parent.iterdir()) if p.is_file()}


def timed_summary(home: Path) -> dict[str, Any]:
    """`scalemon summary --json` of the job in a subprocess: seconds, peak RSS, a check."""
    env = {**os.environ, "SCALEMON_HOME": str(home)}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = psutil.Popen([sys.executable, "-m", "scalemon", "summary", JOB, "--json"],
                            env=env, stdout=out, stderr=err)
        peak = 0
        while proc.poll() is None:
            try:
                peak = max(peak, proc.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)
        seconds = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"summary failed: {err.read().decode()[-2000:]}")
        summary = json.loads(out.read())
    return {"summary_s": round(seconds, 2), "summary_peak_rss_mb": round(peak / 2**20),
            "summary_last_step": summary["steps"]["last"],
            "summary_step_time_median": summary["step_time"]["median"],
            "summary_digest": summary["source"].get("digest")}


def timed_read(path: Path, select: Selection) -> dict[str, Any]:
    stats = ReadStats()
    started = time.perf_counter()
    found = read_selected(path, select, JOB, stats)
    return {"s": round(time.perf_counter() - started, 2), "records": len(found),
            "bytes_read": stats.bytes_read, "tail_bytes_read": stats.tail_bytes,
            "chunks_read": stats.chunks_read,
            "chunks_skipped": stats.chunks_skipped}


def run(records: int, ranks: int, directory: Path) -> dict[str, Any]:
    path = history_path(JOB, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    made = generate(path, records, ranks)
    started = time.perf_counter()
    stats = ReadStats()
    checkpoint = catch_up(path, JOB, stats=stats)
    digest_s = time.perf_counter() - started
    files = disk(path)
    stored = sum(size for name, size in files.items()
                 if name.endswith(("history.smlog", ".chunks", ".index")))
    out: dict[str, Any] = {
        **made, "ranks": ranks,
        "bytes_per_record": round(stored / made["records"], 1),
        "bytes_per_sealed_record": round(
            (files.get("history.smlog.chunks", 0) + files.get("history.smlog.index", 0))
            / max(1, made["sealed_records"]), 1),
        "old_bytes_per_record": round(made["old_format_bytes"] / made["records"], 1),
        "ratio_vs_old": round(made["old_format_bytes"] / stored, 2),
        "files": files,
        "checkpoint_build_s": round(digest_s, 1),
        "checkpoint_build_records_per_s": round(stats.records / digest_s),
        "checkpoint_at": checkpoint.next_seq,
        "machine_load_before": round(load_before, 1),
    }
    out.update(timed_summary(directory))
    mid = made["steps"] // 2
    out["read_one_rank"] = timed_read(path, Selection(ranks={ranks // 2}))
    out["read_100_steps"] = timed_read(path, Selection(steps=(mid, mid + 99)))
    out["machine_load_after"] = round(os.getloadavg()[0], 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int,
                        help="step records to generate (default 100M; --quick: 200k)")
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--quick", action="store_true",
                        help="a short run for a test: 200k records, not saved in bench/results")
    parser.add_argument("--json", type=Path, help="also write the run's figures here")
    parser.add_argument("--dir", type=Path, help="where to write the history (default: a "
                        "temporary folder, removed after)")
    parser.add_argument("--keep", action="store_true", help="keep the history written")
    args = parser.parse_args(argv)
    records = args.records or (200_000 if args.quick else 100_000_000)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        result = run(records, args.ranks, Path(tmp))
        if args.keep:
            print(f"history kept in {tmp} (until this exits)")
    rows = [("records", result["records"]), ("bytes/record", result["bytes_per_record"]),
            ("old bytes/record", result["old_bytes_per_record"]),
            ("ratio vs old", result["ratio_vs_old"]), ("generate s", result["generate_s"]),
            ("seal ms/chunk", result["seal_ms_per_chunk"]),
            ("worst flush ms", result["worst_flush_ms"]),
            ("checkpoint build s", result["checkpoint_build_s"]),
            ("summary s", result["summary_s"]),
            ("summary peak RSS MB", result["summary_peak_rss_mb"]),
            ("one rank s", result["read_one_rank"]["s"]),
            ("one rank bytes read", result["read_one_rank"]["bytes_read"]),
            ("100 steps s", result["read_100_steps"]["s"]),
            ("100 steps chunks read", result["read_100_steps"]["chunks_read"])]
    for name, value in rows:
        print(f"{name:>24}  {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if not args.quick:
        append_result("history_scale", {
            "device": "cpu", "machine": {"cpu": cpu_name(), "cpus": os.cpu_count()},
            "command": "bench/history_scale.py " + " ".join(argv or sys.argv[1:]),
            "t": time.strftime("%Y-%m-%dT%H:%M:%S"), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
