"""How the dashboard copes with many ranks: CPU, redraw time and delivery (no torch needed).

For each rank count, starts a real hub, the real dashboard (`scalemon attach JOB`) in a
160x50 tmux pane of a private tmux server (a real terminal, nothing shared), and simulated
ranks in a sender process: every rank sends a `step` (the fields of a GPU run with AMP, one
straggler) 10 times a second and a `heartbeat` once a second. It reports the dashboard
process's CPU use while the ranks send, its redraw times (timer tick to the screen being
refreshed; written by `--stats-json` on exit) and how many of the messages sent it received.
Results go to bench/results/.

    python bench/dashboard_load.py                  # 8, 64, 512 ranks, 20 s each
    python bench/dashboard_load.py --ranks 512 --seconds 30
    python bench/dashboard_load.py --ranks 4096 --rate 2 --seconds 20
    python bench/dashboard_load.py --ranks 512 1024 2048 4096 --rate 5 --seconds 25 --pin \
        --out bench/results/dashboard_load-pinned-cpu.json  # the dashboard on a core of its own
    python bench/dashboard_load.py --ranks 16384 --rate 1 --seconds 30 --pin \
        --out bench/results/dashboard_load-16k-cpu.json  # a big job: the hub's digest

From `DIGEST_FROM_RANKS` ranks on the dashboard follows the hub's digest (`tui/digest_feed.py`)
instead of every record: `digest` says what it received (digests, the few other records one by
one, fetches of shown ranks' records), and `late_attach` how long a second dashboard took,
attaching once the ranks sent everything, to show the hub's fold (`seed_s`) and its first
digest (`first_digest_s`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import psutil
import zmq

from scalemon import protocol
from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir
from scalemon.link.client import HubClient
from scalemon.tui.feed import HubFeed
from scalemon.tui.model import DashboardData
from scalemon.tui.sim import SimJob

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

RANK_TYPES = ("hello", "step", "heartbeat")
ALL_CPUS = sorted(os.sched_getaffinity(0))


RANKS_PER_SOCKET = 64
"""Simulated ranks share PUSH sockets (the hub does not care which socket a message comes
by): one socket per rank hit ZeroMQ's 1023-socket limit of a context at 1024 ranks. Each step
of a socket's ranks goes as one multipart message, as a node's relay forwards them (the hub
takes each part as one message)."""


class QuietSim(SimJob):
    """SimJob's step and heartbeat bodies without its Flight Recorder bookkeeping (no
    `collectives` messages are sent here, so it would only grow)."""

    def _startup_collectives(self, t: float) -> None:
        pass

    def _step_collectives(self, step: int, start: float, compute: float, end: float) -> None:
        pass


class Framer:
    """Frames of one rank assembled from a packed body: the header's constant part is packed
    once, `seq` and `t` at send time (the bodies are packed before the run, so that making
    thousands of ranks' messages costs the sender little). `frame` gives the bytes
    `protocol.encode` gives, up to the order of the map's keys."""

    def __init__(self, job: str, rank: int) -> None:
        pack = msgpack.packb
        self.head = {mtype: (b"\x87" + pack("v") + pack(list(protocol.PROTOCOL_VERSION))
                             + pack("type") + pack(mtype) + pack("job") + pack(job)
                             + pack("rank") + pack(rank) + pack("seq"))
                     for mtype in RANK_TYPES}
        self.seq = 0

    def frame(self, mtype: str, t: float, body: bytes) -> bytes:
        seq, self.seq = self.seq, self.seq + 1
        pack = msgpack.packb
        return b"".join((self.head[mtype], pack(seq), b"\xa1t", pack(t), b"\xa4body", body))


def send_ranks(address: str, job: str, ranks: int, seconds: float, rate: float,
               ready: mp.Event, go: mp.Event, sent: mp.Value, late: mp.Value) -> None:
    """Simulated ranks: hello, then `rate` steps/s per rank and a heartbeat per second, their
    bodies packed before `ready` is set, sent from `go` on at the planned times."""
    ctx = zmq.Context()
    sim = QuietSim(job=job, ranks=ranks, straggler=ranks // 2, step_s=1.0 / rate)
    groups = [range(g, min(ranks, g + RANKS_PER_SOCKET)) for g in range(0, ranks,
                                                                       RANKS_PER_SOCKET)]
    shared = []
    for _ in groups:
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.setsockopt(zmq.LINGER, 5000)
        s.connect(HubAddress.parse(address).ingest)
        shared.append(s)
    framers = [Framer(job, r) for r in range(ranks)]
    steps = int(seconds * rate)
    every = max(1, int(rate))  # a heartbeat a second
    pack = msgpack.packb
    bodies = [[pack(b) for b in sim.step_bodies(step, 0.0)] for step in range(1, steps + 1)]
    beats = {step: [pack(sim.heartbeat(r, step)) for r in range(ranks)]
             for step in range(every, steps + 1, every)}
    hellos = [pack(sim.hello(r)) for r in range(ranks)]
    ready.set()
    count = 0
    go.wait()
    now = time.time()
    for group, s in zip(groups, shared, strict=True):
        s.send_multipart([framers[r].frame("hello", now, hellos[r]) for r in group])
        count += len(group)
    start = time.monotonic()
    for step in range(1, steps + 1):
        delay = start + step / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        late.value = max(late.value, -delay)
        now = time.time()
        step_bodies, beat = bodies[step - 1], beats.get(step)
        for group, s in zip(groups, shared, strict=True):
            frames = [framers[r].frame("step", now, step_bodies[r]) for r in group]
            if beat is not None:
                frames += [framers[r].frame("heartbeat", now, beat[r]) for r in group]
            s.send_multipart(frames)
            count += len(frames)
    sent.value = count
    for s in shared:
        s.close()
    ctx.term()


def tmux(server: str, *args: str) -> str:
    """Run a tmux command on our private server."""
    out = subprocess.run(["tmux", "-L", server, *args], capture_output=True, text=True,
                         timeout=30)
    return out.stdout


def find_dashboard(job: str, timeout: float = 60.0) -> psutil.Process:
    """The `scalemon attach` process of this run."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info["cmdline"] or []
            if "attach" in cmd and job in cmd:
                return proc
        time.sleep(0.2)
    raise RuntimeError("the dashboard did not start")


def hub_head(address: HubAddress) -> int:
    return HubClient(address, timeout_s=5).request("ping")["head"]


def late_attach(address: HubAddress, timeout: float = 60.0) -> dict:
    """A dashboard's receiver attaching now (in this process, no screen): seconds to the hub's
    fold loaded and to the first digest folded (None: not within `timeout`)."""
    data, feed, stop = DashboardData(), HubFeed(address=address), threading.Event()
    start = time.monotonic()
    thread = threading.Thread(target=feed.run, args=(data, stop.is_set, lambda *_: None),
                              daemon=True)
    thread.start()
    seeded = first = None
    while time.monotonic() - start < timeout and first is None:
        if seeded is None and data.seeded_at is not None:
            seeded = time.monotonic() - start
        if data.digests:
            first = time.monotonic() - start
        time.sleep(0.02)
    stop.set()
    thread.join(10)
    return {"seed_s": seeded, "first_digest_s": first, "followed": data.digest_followed,
            "ranks": len(data.state.ranks), "note": feed.seed_note, "seed": feed.seed_figures}


def pin(pid: int, cpus: list[int]) -> None:
    """Keep process `pid`, every thread of it, on `cpus` (threads do not follow their
    process's affinity once started)."""
    for thread in psutil.Process(pid).threads():
        os.sched_setaffinity(thread.id, cpus)


def run_one(ranks: int, seconds: float, rate: float, size: str, pinned: bool) -> dict:
    """One measurement; returns its figures. `pinned`: the dashboard has the last CPU to
    itself, everything else (hub, sender, tmux, this script) the others."""
    cpus = ALL_CPUS  # this script pins itself below: its own affinity is no guide then
    dash_cpus, rest = (cpus[-1:], cpus[:-1] or cpus) if pinned else (cpus, cpus)
    pin(os.getpid(), rest)
    home = Path(tempfile.mkdtemp(prefix="smb", dir="/tmp"))
    job = f"load{ranks}"
    server = f"smbench-{os.getpid()}-{ranks}"
    stats_path = home / "stats.json"
    hub = subprocess.Popen([sys.executable, "-m", "scalemon.hub", "--job", job, "--home",
                            str(home), "--lost-after", "60", "--linger", "600"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        job_file = jobs_dir(home) / f"{job}.json"
        end = time.monotonic() + 30
        while not job_file.exists() and time.monotonic() < end:
            time.sleep(0.1)
        address = HubAddress.parse(JobFile.read(job_file).address)
        width, height = size.split("x")
        cmd = (f"env SCALEMON_HOME={home} {sys.executable} -m scalemon attach {job} "
               f"--stats-json {stats_path}")
        tmux(server, "new-session", "-d", "-s", "bench", "-x", width, "-y", height, cmd)
        dash = find_dashboard(job)
        time.sleep(2.0)  # attached and idle
        pin(hub.pid, rest)
        pin(dash.pid, dash_cpus)
        ready, go, sent, late = mp.Event(), mp.Event(), mp.Value("q", 0), mp.Value("d", 0.0)
        sender = mp.Process(target=send_ranks, args=(address.base, job, ranks, seconds, rate,
                                                     ready, go, sent, late))
        sender.start()
        ready.wait(600)  # the bodies packed, the sockets connected
        pin(sender.pid, rest)
        cpu0, t0 = dash.cpu_times(), time.monotonic()
        hub_cpu0 = psutil.Process(hub.pid).cpu_times()
        go.set()
        sender.join(seconds + 120)
        cpu1, t1 = dash.cpu_times(), time.monotonic()
        hub_cpu1 = psutil.Process(hub.pid).cpu_times()
        cpu_pct = 100.0 * ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / (t1 - t0)
        hub_pct = 100.0 * ((hub_cpu1.user + hub_cpu1.system)
                           - (hub_cpu0.user + hub_cpu0.system)) / (t1 - t0)
        head = hub_head(address)
        hub_behind_s = time.monotonic() - t1  # the hub's answer waits for its backlog
        attach = late_attach(address)
        time.sleep(3.0)  # let the dashboard drain what is queued
        screen = tmux(server, "capture-pane", "-p", "-t", "bench")
        tmux(server, "send-keys", "-t", "bench", "q")
        end = time.monotonic() + 30
        while not stats_path.exists() and time.monotonic() < end:
            time.sleep(0.2)
        stats = json.loads(stats_path.read_text())
    finally:
        tmux(server, "kill-server")
        hub.terminate()
        hub.wait(timeout=10)
        shutil.rmtree(home, ignore_errors=True)
    digest = stats.get("digest") or {}
    received = sum(stats["by_type"].get(t, 0) for t in RANK_TYPES)
    if digest.get("followed"):  # by_type is the hub's count: the dashboard got the few only
        received = digest.get("few_records", 0)
    redraws = stats["redraw_ms"]
    ordered = sorted(redraws)
    return {
        "ranks": ranks, "steps_per_s_per_rank": rate, "seconds": seconds,
        "messages_sent": sent.value, "hub_records": head, "dashboard_received": received,
        "delivery": received / sent.value if sent.value and not digest.get("followed")
        else None,
        "dashboard_cpu_pct_of_one_core": cpu_pct,
        "hub_cpu_pct_of_one_core": hub_pct,
        "sender_late_max_s": late.value, "send_s": t1 - t0,
        "hub_ping_after_s": hub_behind_s,
        "digest": stats.get("digest"), "late_attach": attach,
        "pinned": {"dashboard": dash_cpus, "others": rest} if pinned else None,
        "redraws": len(redraws),
        "redraw_ms_median": statistics.median(redraws) if redraws else None,
        "redraw_ms_p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        if ordered else None,
        "redraws_per_s": len(redraws) / max(1e-9, t1 - t0 + 5),
        "plot_redraws": len(stats.get("plot_redraw_ms", [])),
        "plot_redraw_ms_median": statistics.median(stats["plot_redraw_ms"])
        if stats.get("plot_redraw_ms") else None,
        "redraw_ms_top": sorted(redraws)[-10:],
        "redraw_ms_in_order": [round(ms, 1) for ms in redraws],  # when the slow ones came
        "terminal": size,
        "screen_header": screen.splitlines()[:3],
    }


def cell(value: float | None, width: int, digits: int) -> str:
    """A number for the table, or n/a (a run with no redraws or nothing sent)."""
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'n/a':>{width}}"


def main() -> int:
    """Run the benchmark and print a table."""
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rate", type=float, default=10.0, help="steps per second per rank")
    p.add_argument("--size", default="160x50", help="terminal size of the dashboard")
    p.add_argument("--pin", action="store_true",
                   help="the dashboard on the last CPU alone, the hub and the ranks on the rest "
                        "(as on a login node: the job's load is elsewhere)")
    p.add_argument("--out", type=Path, default=RESULTS / "dashboard_load-cpu.json")
    args = p.parse_args()
    if shutil.which("tmux") is None:
        print("tmux is needed (the dashboard runs in a real terminal)", file=sys.stderr)
        return 2
    rows = [run_one(n, args.seconds, args.rate, args.size, args.pin) for n in args.ranks]
    print(f"{'ranks':>6} {'msg/s':>7} {'sent':>8} {'received':>9} {'delivery':>9} "
          f"{'CPU %':>6} {'redraw med ms':>14} {'p99 ms':>7} {'redraws/s':>9} {'hub %':>6} "
          f"{'digests':>7} {'few':>6} {'attach s':>8}")
    for r in rows:
        print(f"{r['ranks']:>6} {r['messages_sent'] / r['seconds']:>7.0f} "
              f"{r['messages_sent']:>8} {r['dashboard_received']:>9} {cell(r['delivery'], 9, 4)} "
              f"{cell(r['dashboard_cpu_pct_of_one_core'], 6, 1)} "
              f"{cell(r['redraw_ms_median'], 14, 1)} {cell(r['redraw_ms_p99'], 7, 1)} "
              f"{cell(r['redraws_per_s'], 9, 1)} {cell(r['hub_cpu_pct_of_one_core'], 6, 1)} "
              f"{(r['digest'] or {}).get('digests', 0):>7} "
              f"{(r['digest'] or {}).get('few_records', 0):>6} "
              f"{cell(r['late_attach']['first_digest_s'], 8, 2)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = args.out
    out.write_text(json.dumps({
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": rows,
    }, indent=1))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
