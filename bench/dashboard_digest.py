"""What a big job's digest costs, offline (no hub, no terminal): the hub's thread to build and
pack one (`hub/digest.py`), the dashboard to unpack and fold it (`tui/digest_feed.py`), its
receiver's pass over every rank (`tui/views/totals.py`) and a redraw's own work (the overview
built from that pass). CPU ms (process time), min and median of `--repeat` calls, on the fold of
a simulated run (every rank heard from since the previous digest, as at a step a second).

    python bench/dashboard_digest.py                       # 4,096 and 16,384 ranks
    python bench/dashboard_digest.py --ranks 4096 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack

from scalemon.hub import digest as hub_digest
from scalemon.link import seed
from scalemon.state.fold import JobFold
from scalemon.tui.digest_feed import apply_digest
from scalemon.tui.model import DashboardData
from scalemon.tui.sim import SimJob
from scalemon.tui.views.nodes import node_totals
from scalemon.tui.views.overview import overview

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_ms(fn: Any, repeat: int) -> tuple[float, float]:
    """(min, median) CPU ms of `repeat` calls of `fn`."""
    took = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        took.append((time.process_time() - start) * 1000.0)
    took.sort()
    return round(took[0], 1), round(took[len(took) // 2], 1)


def measure(ranks: int, steps: int, repeat: int) -> dict[str, Any]:
    """The figures at `ranks` ranks after `steps` simulated steps."""
    sim = SimJob(job="dig", ranks=ranks, gpu=True, straggler=ranks // 2)
    fold = JobFold("dig")
    for seq, msg in enumerate(sim.run(steps, heartbeat_every=3)):
        fold.apply(seq, msg)
    now = sim.end_t(steps) + 0.5
    data = DashboardData("dig")
    data.load_seed(_copy(fold), None)
    data.digest_followed = True
    core = SimpleNamespace(fold=fold, state=fold.state, history=[b""] * 10, topic=b"rec x y")
    digest = hub_digest.RankDigest(core)
    views = list(fold.state.ranks.values())

    def build() -> bytes:
        for v in views:  # every rank heard from since the previous digest
            v.last_seen_t = (v.last_seen_t or 0.0) + 1.0
            v.steps_received += 1
        return msgpack.packb(digest.build(), use_bin_type=True)

    blob = build()
    row: dict[str, Any] = {"ranks": ranks, "steps": steps, "digest_bytes": len(blob),
                           "hub_build_pack_ms": cpu_ms(build, repeat)}
    row["dashboard_apply_ms"] = cpu_ms(lambda: apply_digest(
        data, msgpack.unpackb(blob, raw=False, strict_map_key=False)), repeat)
    row["receiver_pass_ms"] = cpu_ms(lambda: setattr(data, "totals", node_totals(data, now)),
                                     repeat)
    row["redraw_view_ms"] = cpu_ms(lambda: overview(data, now, plots=True, visible=(0, 30),
                                                    nodes=None), repeat)
    return row


def _copy(fold: JobFold) -> JobFold:
    """A copy of `fold` (as a seed gives the dashboard one)."""
    return seed.load(seed.dump(fold))


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS / "dashboard_digest-cpu.json")
    args = parser.parse_args()
    rows = [measure(n, args.steps, args.repeat) for n in args.ranks]
    print(f"{'ranks':>6} {'bytes':>9} {'hub build+pack':>15} {'dash apply':>11} "
          f"{'pass':>11} {'redraw view':>12}   (CPU ms, min/median)")
    for r in rows:
        cells = [f"{a:.0f}/{b:.0f}" for a, b in (r["hub_build_pack_ms"],
                                                  r["dashboard_apply_ms"],
                                                  r["receiver_pass_ms"], r["redraw_view_ms"])]
        print(f"{r['ranks']:>6} {r['digest_bytes']:>9} {cells[0]:>15} {cells[1]:>11} "
              f"{cells[2]:>11} {cells[3]:>12}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_1m": os.getloadavg()[0]},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "digest_every_s": hub_digest.DIGEST_EVERY_S, "full_rows": hub_digest.DIGEST_FULL_ROWS,
        "results": rows}, indent=1))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
