"""How many messages per second one hub ingests with no loss (no torch needed).

Starts a real `scalemon hub` process and simulated ranks: sender processes that each own the
PUSH sockets of a share of the ranks and send pre-encoded `step` messages round-robin across
them, with blocking sends so that back-pressure, not loss, throttles them. The rate is the
hub's history growth from the first to the last message; "lost" compares what the hub holds
with what was sent (and the hub's own reject and per-rank gap counts). Results go to
bench/results/.

    python bench/hub_throughput.py                       # 8, 64, 512 ranks
    python bench/hub_throughput.py --ranks 64 --messages 200000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import zmq

from scalemon import protocol
from scalemon.home.address import HubAddress
from scalemon.link.client import HubClient

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def sender(address: str, job: str, ranks: list[int], per_rank: int, go: mp.Event) -> None:
    """Send `per_rank` step messages for each of `ranks`, interleaved."""
    ctx = zmq.Context()
    socks = {}
    for r in ranks:
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, 1000)
        s.setsockopt(zmq.LINGER, -1)
        s.connect(HubAddress.parse(address).ingest)
        socks[r] = s
    frames = {r: [protocol.encode("step", job, r, seq, {
        "step": seq + 1, "loss": 2.0 + r * 1e-3, "tokens": 4096, "step_time_s": 0.1,
        "optimizer_time_s": 0.002, "allreduce_time_s": 0.01, "allreduce_count": 4,
        "allreduce_bytes": 1 << 20, "mem_allocated_bytes": 1 << 30}) for seq in range(per_rank)]
        for r in ranks}
    go.wait()
    for seq in range(per_rank):
        for r in ranks:
            socks[r].send(frames[r][seq])
    for s in socks.values():
        s.close()
    ctx.term()


def _thread_cpu(proc: psutil.Process) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of the hub, by thread id."""
    return {t.id: t.user_time + t.system_time for t in proc.threads()}


def _cpu_per_message(before: dict[int, float], after: dict[int, float], main_id: int,
                     messages: int) -> dict[str, float]:
    """The hub's CPU per message ingested during the run: all threads, its main thread (id
    `main_id`, the process id), and the others (the history's sealing thread, zmq's I/O)."""
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    main = spent.get(main_id, 0.0)
    total = sum(spent.values())
    per = 1e6 / max(1, messages)
    return {"hub_cpu_us_per_msg": total * per, "hub_main_us_per_msg": main * per,
            "hub_other_threads_us_per_msg": (total - main) * per}


def run_case(n_ranks: int, total: int, senders: int, home: Path) -> dict:
    job = f"tput{n_ranks}"
    hub = subprocess.Popen(
        [sys.executable, "-m", "scalemon.hub", "--job", job, "--home", str(home),
         "--lost-after", "3600", "--world-size", str(n_ranks)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    try:
        address = HubAddress.for_directory(home / "run" / job)
        client = HubClient(address, timeout_s=30)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.request("ping")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        per_rank = max(1, total // n_ranks)
        sent = per_rank * n_ranks
        go = mp.Event()
        shares = [list(range(n_ranks))[i::senders] for i in range(senders)]
        procs = [mp.Process(target=sender, args=(address.base, job, share, per_rank, go))
                 for share in shares if share]
        for p in procs:
            p.start()
        time.sleep(1.0 + n_ranks / 200)  # connections up and frames encoded
        hub_proc = psutil.Process(hub.pid)
        cpu0 = _thread_cpu(hub_proc)
        go.set()
        t0 = time.monotonic()
        head0 = client.request("ping")["head"]
        samples = [(t0, head0)]
        while samples[-1][1] < sent and time.monotonic() - t0 < 300:
            time.sleep(0.05)
            samples.append((time.monotonic(), client.request("ping")["head"]))
        cpu1 = _thread_cpu(hub_proc)
        for p in procs:
            p.join()
        state = client.state()
        first = next(t for t, h in samples if h > head0) if samples[-1][1] > head0 else t0
        last = next(t for t, h in samples if h >= samples[-1][1])
        received = state["hub"]["history"]
        gaps = sum(r["seq_gaps"] for r in state["state"]["ranks"])
        return {
            "ranks": n_ranks, "sent": sent, "received": received,
            "lost": sent - received, "rejected": state["hub"]["rejected"], "seq_gaps": gaps,
            "seconds": last - first, "msgs_per_s": (received - head0) / max(last - first, 1e-9),
            **_cpu_per_message(cpu0, cpu1, hub.pid, received - head0),
        }
    finally:
        hub.terminate()
        hub.wait(timeout=30)


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--messages", type=int, default=400_000, help="total per case")
    p.add_argument("--senders", type=int, default=2, help="sender processes")
    p.add_argument("--repeats", type=int, default=3, help="runs per case; the median is shown")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="smb", dir="/tmp") as tmp:
        for n in args.ranks:
            runs = []
            for i in range(args.repeats):
                home = Path(tmp) / f"{n}-{i}"
                home.mkdir()
                runs.append(run_case(n, args.messages, args.senders, home))
                print(f"{n:>4} ranks run {i + 1}: {runs[-1]['msgs_per_s']:>9,.0f} msg/s, "
                      f"lost {runs[-1]['lost']}, hub CPU {runs[-1]['hub_cpu_us_per_msg']:.1f} "
                      f"us/msg (main thread {runs[-1]['hub_main_us_per_msg']:.1f})", flush=True)
            runs.sort(key=lambda r: r["msgs_per_s"])
            median = dict(runs[len(runs) // 2])
            median["all_msgs_per_s"] = [r["msgs_per_s"] for r in runs]
            median["lost_total"] = sum(r["lost"] + r["seq_gaps"] for r in runs)
            rows.append(median)
    print()
    print(f"hub ingest, {args.senders} sender processes, {os.cpu_count()} CPUs, "
          f"median of {args.repeats} runs (goal >= 100,000 msg/s with no loss)")
    print(f"{'ranks':>6} | {'messages':>9} | {'msg/s':>10} | {'lost':>5} | {'rejected':>8} | "
          f"{'gaps':>5}")
    for r in rows:
        print(f"{r['ranks']:>6} | {r['sent']:>9,} | {r['msgs_per_s']:>10,.0f} | "
              f"{r['lost_total']:>5} | {r['rejected']:>8} | {r['seq_gaps']:>5}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "hub_throughput-cpu.json"
    out.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "machine": platform.node(), "cpus": os.cpu_count(),
                               "args": vars(args), "rows": rows}, indent=1))
    print(f"saved {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
