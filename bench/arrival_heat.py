"""What the arrival lateness of a job's ranks costs the hub (`scalemon/state/arrival.py`): its
memory and its share of a seed after every rank issued many collectives (no hub, no terminal).

Every rank of one group issues `--collectives` collectives, 0.1 s apart (10 a second, as a job
of a step a second with ten buckets), each rank a little later than the one before; the tracker
settles each. Printed per size: seconds to take them in, RSS growth and pickled bytes, in all
and per rank, and the heat cells held.

    python bench/arrival_heat.py                           # 1,024 and 4,096 ranks x 2,000
    python bench/arrival_heat.py --ranks 16384 --collectives 600
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import platform
import time
from pathlib import Path
from typing import Any

import psutil

from scalemon.state.arrival import ArrivalTracker

RESULTS = Path(__file__).resolve().parent / "results"


def measure(ranks: int, collectives: int) -> dict[str, Any]:
    """One tracker of `ranks` ranks fed `collectives` collectives."""
    gc.collect()
    proc = psutil.Process()
    before = proc.memory_info().rss
    tracker = ArrivalTracker()
    tracker.set_group("0", range(ranks))
    start = time.perf_counter()
    for seq in range(collectives):
        base = 1000.0 + seq * 0.1
        for rank in range(ranks):
            tracker.issued("0", seq, rank, base + rank * 1e-6)
    took = time.perf_counter() - start
    grown = proc.memory_info().rss - before
    pickled = len(pickle.dumps(tracker, protocol=5))
    cells = sum(len(row) for row in tracker.heat.values())
    return {"ranks": ranks, "collectives": collectives, "seconds": round(took, 4),
            "rss_mb": round(grown / 1e6, 1), "rss_kb_per_rank": round(grown / ranks / 1e3, 2),
            "pickle_mb": round(pickled / 1e6, 2),
            "pickle_kb_per_rank": round(pickled / ranks / 1e3, 2), "heat_cells": cells}


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--collectives", type=int, default=2000)
    p.add_argument("--out", type=Path, default=RESULTS / "arrival_heat-cpu.json")
    args = p.parse_args()
    runs = [measure(r, args.collectives) for r in args.ranks]
    print(f"{'ranks':>6} {'colls':>6} {'s':>6} {'RSS MB':>8} {'KB/rank':>8} {'pickle MB':>10} "
          f"{'KB/rank':>8} {'cells':>9}")
    for r in runs:
        print(f"{r['ranks']:>6} {r['collectives']:>6} {r['seconds']:>6} {r['rss_mb']:>8} "
              f"{r['rss_kb_per_rank']:>8} {r['pickle_mb']:>10} {r['pickle_kb_per_rank']:>8} "
              f"{r['heat_cells']:>9}")
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(),
           "python": platform.python_version(), "args": vars(args) | {"out": str(args.out)},
           "runs": runs}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
