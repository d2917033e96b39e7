"""What a hung job's heartbeats cost the hub, per heartbeat: decoded (`protocol.decode`, which
checks every nested value) and folded (`JobState.apply`), as agents before protocol 1.14 sent
them (every one with its stack, groups and collectives in flight) and as they send them now
(those once, then named in `same`); and what making the hang report costs (`job_hang`), which
the hub's alerts now do again as heartbeats arrive.

    python bench/hang_beats.py [--ranks 4096 16384] [--beats 3]

Prints a table and saves bench/results/hang_beats-cpu.json."""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import timeit
from pathlib import Path
from typing import Any

from machine import RESULTS, cpu_name, machine_busy_pct

from scalemon import protocol
from scalemon.metrics import SENT_WHEN_CHANGED
from scalemon.reports.hangs import job_hang
from scalemon.state.jobstate import JobState
from scalemon.tui.sim import _STACK_BACKWARD, _STACK_DATA, GROUP, SimJob

REPEAT = 3


def hang_frames(ranks: int, beats: int, once: bool, t0: float) -> list[bytes]:
    """`beats` heartbeats of each of `ranks` ranks hung after step 10 (rank ranks // 2 in its
    data loader, the others in all_reduce #11), encoded as the relays forward them."""
    sim = SimJob(ranks=8)
    culprit = ranks // 2
    frames = []
    for beat in range(beats):
        t = t0 + 11.0 + beat
        for rank in range(ranks):
            late = rank == culprit
            body: dict[str, Any] = sim.heartbeat(rank % 8, 10)
            body.update(phase="python" if late else "collective", phase_since_s=1.0 + beat,
                        groups={GROUP: [10 if late else 11, 10]}, collectives_issued=11,
                        collectives_completed=10,
                        inflight=None if late else [[GROUP, 11, "all_reduce", t0 + 0.5]],
                        stack=_STACK_DATA if late else _STACK_BACKWARD)
            if once and beat > 0:
                body["same"] = [n for n in SENT_WHEN_CHANGED if body.pop(n, None) is not None]
            frames.append(protocol.encode("heartbeat", "hb", rank, 100 + beat, body, t=t))
    return frames


def started_job(ranks: int, t0: float) -> JobState:
    st = JobState(hang_after_s=10.0)
    st.apply(protocol.Message("collectives", "hb", 0, 1, t0, {
        "groups": {GROUP: {"desc": "default_pg", "ranks": list(range(ranks))}},
        "stats": [], "issues": []}))
    for rank in range(ranks):
        st.apply(protocol.Message("hello", "hb", rank, 0, t0, {
            "host": f"n{rank // 8}", "pid": 1000 + rank, "world_size": ranks,
            "local_rank": rank % 8}))
        st.apply(protocol.Message("step", "hb", rank, 2, t0, {"step": 10, "loss": 1.0}))
    return st


def measure(ranks: int, beats: int) -> list[dict[str, Any]]:
    rows = []
    t0 = time.time() - 60.0
    for once in (False, True):
        frames = hang_frames(ranks, beats, once, t0)
        decoded = folded = float("inf")
        for _ in range(REPEAT):  # the least of a few: the machine is shared
            st = started_job(ranks, t0)
            began = time.perf_counter()
            messages = [protocol.decode(f) for f in frames]
            decoded = min(decoded, time.perf_counter() - began)
            began = time.perf_counter()
            for m in messages:
                st.apply(m)
            folded = min(folded, time.perf_counter() - began)
        began = time.perf_counter()
        hang = job_hang(st, t0 + 11.0 + beats)
        report_s = time.perf_counter() - began
        stacks = sum(1 for v in st.ranks.values() if v.metrics.get("stack"))
        one = frames[-1]  # a later beat: whole, or naming its values in `same`
        one_us = min(timeit.repeat(functools.partial(protocol.decode, one), number=5000,
                                   repeat=5)) / 5e3
        rows.append({
            "ranks": ranks, "beats_per_rank": beats,
            "agent": "1.14 (once, then same)" if once else "before 1.14 (every beat whole)",
            "bytes_per_beat": sum(map(len, frames)) / len(frames),
            "decode_us_per_beat": decoded / len(frames) * 1e6,
            "fold_us_per_beat": folded / len(frames) * 1e6,
            "later_beat_bytes": len(one), "later_beat_decode_us": one_us * 1e6,
            "report_s": report_s,
            "culprits": hang["culprits"] if hang else None,
            "ranks_with_stack_kept": stacks,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--beats", type=int, default=3, help="heartbeats per rank in the hang")
    p.add_argument("--out", type=Path, default=RESULTS / "hang_beats-cpu.json")
    args = p.parse_args(argv)
    busy = machine_busy_pct(2.0)
    rows = [row for ranks in args.ranks for row in measure(ranks, args.beats)]
    print(f"machine busy {busy:.0f}% of a core before the run (other users)")
    print(f"{'ranks':>6} {'agent':<32} {'B/beat':>7} {'decode us':>10} {'fold us':>8} "
          f"{'later B':>8} {'later us':>9} {'report s':>9} culprits  stacks kept")
    for r in rows:
        print(f"{r['ranks']:>6} {r['agent']:<32} {r['bytes_per_beat']:>7.0f} "
              f"{r['decode_us_per_beat']:>10.1f} {r['fold_us_per_beat']:>8.1f} "
              f"{r['later_beat_bytes']:>8} {r['later_beat_decode_us']:>9.1f} "
              f"{r['report_s']:>9.2f} {r['culprits']!s:<9} {r['ranks_with_stack_kept']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"),
                                    "machine": cpu_name(), "machine_busy_pct": busy,
                                    "args": {k: str(v) for k, v in vars(args).items()},
                                    "runs": rows}, indent=1))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
