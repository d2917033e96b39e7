"""The hub's OpenMetrics export at scale: 16,384 ranks (2,048 nodes x 8) by default.

A hub's state is built by folding simulated hello, step, heartbeat and collectives messages
(the bodies of `tui/sim.py`) into a `JobFold`, as the hub's loop does. Then:

1. the render itself, in this process: building the families, the text of the default scrape
   (per-node and job aggregates) and of `?ranks=all` (every rank's series too): seconds, bytes,
   series (sample lines);
2. the exporter as the hub runs it (`hub/openmetrics.py` `Exporter`, HTTP on 127.0.0.1): how
   long `update` stands the loop still (the fork), how long a render takes to arrive, and the
   seconds a scrape takes over HTTP (default, `?ranks=all`, OpenMetrics, gzip);
3. ingest while scraping: a loop that folds step messages as fast as it can and calls
   `update` every 0.25 s (the hub's housekeeping), `--seconds` per run, each mode in turn for
   `--rounds` rounds (the machine's load then hits every mode): "none" (no exporter),
   "forked" (the exporter's renders, no scrape), "scraped" (scraped once a second by another
   process, default and `?ranks=all` in turn), "flood" (scraped back to back) and "in_loop"
   (the families and text made on the loop, every rank's: what the hub did before). Folds/s,
   the loop thread's CPU share, and the longest gap between two folds (how long ingest
   waited).

    .venv/bin/python bench/openmetrics_scale.py                 # 2048 nodes x 8
    .venv/bin/python bench/openmetrics_scale.py --nodes 64 --seconds 2 --rounds 1   # quick

Saves bench/results/openmetrics_scale-cpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from scalemon.collectives import CollectiveStats
from scalemon.hub.metrics_families import family_parts
from scalemon.hub.metrics_render import Variant, render
from scalemon.hub.openmetrics import Exporter
from scalemon.protocol import Message
from scalemon.state.fold import JobFold
from scalemon.tui.sim import SimJob

REPO = Path(__file__).resolve().parents[1]
JOB = "om"
HOUSEKEEPING_S = 0.25


class _Sim(SimJob):
    """`SimJob`'s bodies without its per-collective bookkeeping (too big at 16k ranks)."""

    def _startup_collectives(self, t: float) -> None:
        pass

    def _step_collectives(self, step: int, start: float, compute: float, end: float) -> None:
        pass


def build_state(nodes: int, per_node: int, steps: int) -> tuple[JobFold, _Sim, int]:
    """A fold of `nodes` x `per_node` ranks after `steps` steps, a heartbeat and a
    `collectives` message each; returns it, the simulator and the next seq."""
    ranks = nodes * per_node
    t0 = time.time() - steps - 2
    sim = _Sim(job=JOB, ranks=ranks, ranks_per_host=per_node, step_s=1.0, start_t=t0)
    fold = JobFold(job=JOB, world_size=ranks)
    seq = 0

    def apply(msg: Message) -> None:
        nonlocal seq
        fold.apply(seq, msg)
        seq += 1

    for r in range(ranks):
        apply(sim.message(r, "hello", sim.hello(r), t0))
    for step in range(1, steps + 1):
        t = t0 + step
        for r, body in enumerate(sim.step_bodies(step, t)):
            apply(sim.message(r, "step", body, t))
    stats = CollectiveStats()
    for _ in range(10):
        row = stats.row("0", "all_reduce", 25)
        row.count += 1
        row.bytes += 25 << 20
        row.add_time(0.002)
    wire = stats.to_wire()
    t = t0 + steps + 1
    groups = {"0": {"desc": "default_pg", "ranks": list(range(ranks))}}
    for r in range(ranks):
        apply(sim.message(r, "collectives", {"groups": groups if r == 0 else {}, "stats": wire,
                                             "issues": [], "step": steps}, t))
        apply(sim.message(r, "heartbeat", sim.heartbeat(r, steps), t))
    return fold, sim, seq


def series(text: bytes) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))


def measure_render(fold: JobFold) -> dict[str, Any]:
    now = time.time()
    started = time.perf_counter()
    family_parts(fold.state, JOB, now, per_rank=False)
    build_s = time.perf_counter() - started
    out: dict[str, Any] = {"families_build_s": round(build_s, 3)}
    for name, variant in (("default", Variant()), ("per_rank", Variant(per_rank=True))):
        got = render(fold.state, JOB, [variant], now)
        text = got.texts[variant]
        out[name] = {"render_s": round(got.seconds, 3), "bytes": len(text),
                     "series": series(text)}
    return out


def scrape(url: str, openmetrics: bool = False, gz: bool = False) -> tuple[float, int]:
    headers = {}
    if openmetrics:
        headers["Accept"] = "application/openmetrics-text; version=1.0.0"
    if gz:
        headers["Accept-Encoding"] = "gzip"
    started = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                timeout=120) as reply:
        body = reply.read()
    took = time.perf_counter() - started
    if gz:
        body = gzip.decompress(body)
    return took, len(body)


def measure_exporter(fold: JobFold) -> dict[str, Any]:
    exporter = Exporter(JOB, ("127.0.0.1", 0))
    assert exporter.url is not None
    stop = threading.Event()

    def housekeeping() -> None:  # the hub's loop, which here folds nothing
        while not stop.wait(HOUSEKEEPING_S):
            exporter.update(fold.state, time.monotonic())

    try:
        started = time.perf_counter()
        exporter.update(fold.state, time.monotonic())
        fork_s = time.perf_counter() - started
        threading.Thread(target=housekeeping, daemon=True).start()
        first, _ = scrape(exporter.url)
        out: dict[str, Any] = {"update_s": round(fork_s, 4),
                               "first_text_after_s": round(time.perf_counter() - started, 3)}
        for name, url, om, gz in (
                ("default", exporter.url, False, False),
                ("default_gzip", exporter.url, False, True),
                ("default_openmetrics", exporter.url, True, False),
                ("per_rank", exporter.url + "?ranks=all", False, False),
                ("per_rank_gzip", exporter.url + "?ranks=all", False, True)):
            first, size = scrape(url, om, gz)  # a new variant: waits for a render
            again, _ = scrape(url, om, gz)
            out[name] = {"first_scrape_s": round(first, 3), "scrape_s": round(again, 4),
                         "bytes": size}
        return out
    finally:
        stop.set()
        exporter.close()


SCRAPER = """
import json, sys, time, urllib.request
url, until, n, took = sys.argv[1], time.monotonic() + float(sys.argv[2]), 0, []
every = float(sys.argv[3])
while time.monotonic() < until:
    time.sleep(max(0.0, n * every - (time.monotonic() - until + float(sys.argv[2]))))
    started = time.perf_counter()
    with urllib.request.urlopen(url + ("?ranks=all" if n % 2 else ""), timeout=120) as reply:
        reply.read()
    took.append(time.perf_counter() - started)
    n += 1
print(json.dumps(took))
"""
"""A Prometheus stand-in, in a process of its own: scrapes the default and `?ranks=all` in
turn, one every `every` seconds (0: back to back)."""


def ingest_loop(fold: JobFold, sim: _Sim, seq: int, seconds: float, mode: str,
                steps: int) -> dict[str, Any]:
    """Fold step messages for `seconds`; `mode`: "none", "forked" (the exporter's renders,
    no scrape), "scraped" (the same, scraped once a second by another process), "flood"
    (scraped back to back) or "in_loop" (families and text made on the loop, every rank:
    what the hub did before)."""
    ranks = sim.ranks
    body_of = {r: b for r, b in enumerate(sim.step_bodies(steps + 1, time.time()))}
    exporter = Exporter(JOB, ("127.0.0.1", 0)) if mode in ("forked", "scraped", "flood") \
        else None
    scraper = None
    if exporter is not None:
        while exporter.text(Variant(per_rank=True), wait_s=0.05) is None:  # asked, rendered
            exporter.update(fold.state, time.monotonic())
        if mode in ("scraped", "flood"):
            assert exporter.url is not None
            every = "1.0" if mode == "scraped" else "0"
            scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, exporter.url,
                                        str(seconds), every], stdout=subprocess.PIPE, text=True)
    folded, worst, in_loop = 0, 0.0, []
    cpu = time.thread_time()
    step = steps + 1
    started = last = time.perf_counter()
    next_house = started + HOUSEKEEPING_S
    r = 0
    while (now := time.perf_counter()) - started < seconds:
        worst = max(worst, now - last)
        last = now
        body = body_of[r]
        body["step"] = step
        fold.apply(seq, Message("step", JOB, r, sim.seq.get(r, 0), time.time(), body))
        sim.seq[r] = sim.seq.get(r, 0) + 1
        seq += 1
        folded += 1
        r += 1
        if r == ranks:
            r, step = 0, step + 1
        if now >= next_house:
            next_house = now + HOUSEKEEPING_S
            if exporter is not None:
                exporter.update(fold.state, time.monotonic())
            elif mode == "in_loop" and (not in_loop or now - in_loop[-1][0] >= 1.0):
                began = time.perf_counter()
                render(fold.state, JOB, [Variant(per_rank=True)], time.time())
                in_loop.append((began, time.perf_counter() - began))
    took = time.perf_counter() - started
    scrapes = json.loads(scraper.communicate(timeout=300)[0]) if scraper is not None else []
    cpu = time.thread_time() - cpu
    out: dict[str, Any] = {"mode": mode, "seconds": round(took, 2),
                           "folds_per_s": round(folded / took), "longest_wait_s": round(worst, 4),
                           "loop_cpu_share": round(cpu / took, 2)}
    if exporter is not None:
        out.update(renders=exporter.renders, fork_s_max=round(max(exporter.fork_s), 4),
                   fork_s_mean=round(sum(exporter.fork_s) / len(exporter.fork_s), 4),
                   scrapes=len(scrapes),
                   scrape_s_max=round(max(scrapes), 4) if scrapes else None,
                   scrape_s_median=round(sorted(scrapes)[len(scrapes) // 2], 4)
                   if scrapes else None)
        exporter.close()
    if in_loop:
        out.update(renders=len(in_loop), render_on_loop_s_max=round(max(t for _, t in in_loop), 3))
    return out


def by_mode(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs of one mode: median folds/s and loop CPU share, the longest wait of all."""
    def median(key: str) -> float:
        values = sorted(r[key] for r in runs)
        return values[len(values) // 2]

    out: dict[str, Any] = {"runs": len(runs), "folds_per_s_median": median("folds_per_s"),
                           "loop_cpu_share_median": median("loop_cpu_share"),
                           "longest_wait_s": max(r["longest_wait_s"] for r in runs)}
    if any("fork_s_max" in r for r in runs):
        out["fork_s_max"] = max(r["fork_s_max"] for r in runs)
        out["renders"] = sum(r["renders"] for r in runs)
    scrapes = [r for r in runs if r.get("scrapes")]
    if scrapes:
        out["scrapes"] = sum(r["scrapes"] for r in scrapes)
        out["scrape_s_max"] = max(r["scrape_s_max"] for r in scrapes)
        out["scrape_s_median"] = median("scrape_s_median")
    if any("render_on_loop_s_max" in r for r in runs):
        out["render_on_loop_s_max"] = max(r["render_on_loop_s_max"] for r in runs)
    return out


def machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {"cpus": os.cpu_count(), "loadavg_1m": round(load[0], 2),
            "machine_busy": load[0] > (os.cpu_count() or 1) * 0.5}


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2048)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="length of each ingest run")
    parser.add_argument("--rounds", type=int, default=3,
                        help="ingest runs of each mode, taken in turn")
    parser.add_argument("--out", type=Path,
                        default=REPO / "bench" / "results" / "openmetrics_scale-cpu.json")
    args = parser.parse_args()
    started = time.perf_counter()
    fold, sim, seq = build_state(args.nodes, args.ranks_per_node, args.steps)
    result: dict[str, Any] = {
        "ranks": args.nodes * args.ranks_per_node, "nodes": args.nodes,
        "build_state_s": round(time.perf_counter() - started, 1), "machine_before": machine()}
    result["render"] = measure_render(fold)
    result["exporter"] = measure_exporter(fold)
    modes = ("none", "forked", "scraped", "flood", "in_loop")
    runs = []
    for n in range(args.rounds):  # the modes in turn, so that the machine's load hits each
        for i, mode in enumerate(modes):
            k = n * len(modes) + i
            runs.append({"round": n, **ingest_loop(fold, sim, seq + k * 10_000_000,
                                                   args.seconds, mode, args.steps + k * 1000)})
    result["ingest"] = runs
    result["ingest_by_mode"] = {mode: by_mode([r for r in runs if r["mode"] == mode])
                                for mode in modes}
    result["render_child_maxrss_mb"] = round(
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)  # shared pages too
    result["bench_maxrss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    result["machine_after"] = machine()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"saved {args.out}")
    return 0


def print_table(r: dict[str, Any]) -> None:
    print(f"{r['ranks']} ranks on {r['nodes']} nodes (state built in {r['build_state_s']} s; "
          f"load {r['machine_before']['loadavg_1m']} on {r['machine_before']['cpus']} cpus)")
    ren = r["render"]
    print(f"families of the default scrape built in {ren['families_build_s']} s")
    print(f"{'render (in one process)':<26}{'seconds':>9}{'MB':>9}{'series':>10}")
    for name in ("default", "per_rank"):
        v = ren[name]
        print(f"{name:<26}{v['render_s']:>9}{v['bytes'] / 1e6:>9.1f}{v['series']:>10}")
    ex = r["exporter"]
    print(f"exporter: update (fork) stands the loop still {ex['update_s'] * 1000:.1f} ms; first "
          f"text after {ex['first_text_after_s']} s")
    print(f"{'scrape over HTTP':<26}{'first s':>9}{'then s':>9}{'MB':>9}")
    for name in ("default", "default_gzip", "default_openmetrics", "per_rank", "per_rank_gzip"):
        v = ex[name]
        print(f"{name:<26}{v['first_scrape_s']:>9}{v['scrape_s']:>9}{v['bytes'] / 1e6:>9.1f}")
    print(f"render children's peak RSS {r['render_child_maxrss_mb']} MB (pages shared with the "
          f"hub included; the hub here: {r['bench_maxrss_mb']} MB)")
    print(f"{'ingest (fold loop), median':<26}{'folds/s':>9}{'wait s':>9}{'cpu':>6}  notes "
          "(wait: the longest gap between two folds, of all runs)")
    for mode, run in r["ingest_by_mode"].items():
        notes = f"{run['runs']} runs"
        if "fork_s_max" in run:
            notes += f", {run['renders']} renders, fork max {run['fork_s_max'] * 1000:.0f} ms"
        if "scrapes" in run:
            notes += (f", {run['scrapes']} scrapes (median "
                      f"{run['scrape_s_median']} s, max {run['scrape_s_max']} s)")
        if "render_on_loop_s_max" in run:
            notes += f", renders on the loop up to {run['render_on_loop_s_max']} s"
        print(f"{mode:<26}{run['folds_per_s_median']:>9}{run['longest_wait_s']:>9}"
              f"{run['loop_cpu_share_median']:>6}  {notes}")


if __name__ == "__main__":
    raise SystemExit(main())
