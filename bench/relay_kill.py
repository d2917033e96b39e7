"""Training speed while a node's relay is killed and replaced (issue #11).

Two torchrun node agents on this machine stand for two nodes (c10d rendezvous on loopback, each
with its own node name, home and runtime directory; `jobs/` and `keys/` shared, as a cluster's
home is). The ranks of the node without the hub reach it through their relay. Part way through,
the relay is killed with SIGKILL; the node's ranks start a new one. From the job's history
(read over CurveZMQ tcp, as from the login node) the ranks' own step times are compared in three
windows: before the kill, the gap until the new relay reported, and after. Every window's median
is divided by the same run's "before" median; medians over repeated runs.

    .venv/bin/python bench/relay_kill.py [--repeats 3] [--steps 300] [--kill-at 0.4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cluster import NODES, make_cluster, node_env, relay_pid
from machine import cpu_name

from scalemon import protocol
from scalemon.home.jobfile import JobFile
from scalemon.link.client import HubClient

REPO = Path(__file__).resolve().parents[1]


def one_run(steps: int, kill_at: float, port: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="smk", dir="/tmp"))
    homes = make_cluster(root)
    procs = []
    try:
        for node_rank, node in enumerate(NODES):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--node-rank", str(node_rank), "--nproc-per-node", "2",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--rdzv-id", "relaykill", "--", str(REPO / "demo_train" / "train.py"),
                   "--device", "cpu", "--monitor", "--max-steps", str(steps)]
            procs.append(subprocess.Popen(cmd, env=node_env(homes[node], node),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
        job_path = homes["login"] / "jobs" / "tr-relaykill.json"
        client = None
        killed_t = None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.2)
            if client is None and job_path.exists():
                os.environ.update(node_env(homes["login"], "login"))
                client = HubClient(JobFile.read(job_path).hub_address(), timeout_s=10)
            if client is None or killed_t is not None:
                continue
            ranks = client.state()["state"]["ranks"]
            if len(ranks) == 4 and min(r["step"] or 0 for r in ranks) >= steps * kill_at:
                relay_node = next(n for n in NODES if relay_pid(homes[n]))
                os.kill(relay_pid(homes[relay_node]), signal.SIGKILL)
                killed_t = time.time()
        codes = [p.wait(timeout=60) for p in procs]
        assert client is not None and killed_t is not None, "the job never got going"
        records = fetch_all(client)
        client.close()
        return windows(records, killed_t, relay_node) | {"exit_codes": codes}
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


def fetch_all(client: HubClient) -> list[protocol.Message]:
    out, since = [], 0
    while True:
        records, head = client.fetch(since)
        out += [protocol.decode(r) for r in records]
        since += len(records)
        if not records or since >= head:
            return out


def windows(messages: list[protocol.Message], killed_t: float, relay_node: str) -> dict:
    """Median step time of the relay node's ranks and the hub node's, per window."""
    hosts = {m.rank: m.body["host"] for m in messages if m.type == "hello"}
    up = [m for m in messages if m.type == "relay" and m.body["state"] == "up"
          and m.t > killed_t]
    back_t = up[0].t if up else float("inf")
    out: dict = {"relay_node": relay_node, "gap_s": (up[0].body.get("gap_s") if up else None)}
    for label, lo, hi in (("before", 0.0, killed_t), ("gap", killed_t, back_t),
                          ("after", back_t, float("inf"))):
        for side, on_relay in (("relay_node", True), ("hub_node", False)):
            times = [m.body["step_time_s"] for m in messages
                     if m.type == "step" and m.body.get("step_time_s") and lo <= m.t < hi
                     and (hosts.get(m.rank) == relay_node) == on_relay]
            out[f"{label}_{side}_ms"] = statistics.median(times) * 1e3 if times else None
            out[f"{label}_{side}_steps"] = len(times)
    ranks = {m.rank for m in messages if m.type == "step"}
    out["steps_seen"] = sum(m.type == "step" for m in messages)
    out["ranks"] = len(ranks)
    return out


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-at", type=float, default=0.4,
                   help="kill the relay once every rank passed this fraction of the steps")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "relay_kill-cpu.json")
    args = p.parse_args()
    runs = []
    for i in range(args.repeats):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        runs.append(one_run(args.steps, args.kill_at, port))
        print(f"run {i + 1}: {runs[-1]}", flush=True)
    print(f"\n{'window':8} {'relay node ms':>14} {'ratio':>6} {'hub node ms':>12} {'ratio':>6}")
    summary = {}
    for label in ("before", "gap", "after"):
        row = {}
        for side in ("relay_node", "hub_node"):
            ratios = [r[f"{label}_{side}_ms"] / r[f"before_{side}_ms"] for r in runs
                      if r[f"{label}_{side}_ms"] and r[f"before_{side}_ms"]]
            ms = [r[f"{label}_{side}_ms"] for r in runs if r[f"{label}_{side}_ms"]]
            row[side] = {"median_ms": statistics.median(ms) if ms else None,
                         "ratio_to_before": statistics.median(ratios) if ratios else None}
        summary[label] = row
        rn, hn = row["relay_node"], row["hub_node"]
        print(f"{label:8} {_f(rn['median_ms']):>14} {_f(rn['ratio_to_before'], 3):>6} "
              f"{_f(hn['median_ms']):>12} {_f(hn['ratio_to_before'], 3):>6}")
    delivered = [f"{r['steps_seen']}/{4 * args.steps}" for r in runs]
    print(f"step messages in the history, per run: {', '.join(delivered)} "
          "(4 ranks; a lost message shows as fewer)")
    gaps = [r["gap_s"] for r in runs if r["gap_s"] is not None]
    print(f"relay gap (kill -> new relay reported): median {_f(statistics.median(gaps), 2)} s"
          if gaps else "no replaced relay seen")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": cpu_name(),
        "cpus": os.cpu_count(), "args": {k: str(v) for k, v in vars(args).items()},
        "summary": summary, "gap_s": gaps, "delivered": delivered, "runs": runs}, indent=1))
    print(f"saved {args.out}")
    return 0


def _f(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    raise SystemExit(main())
