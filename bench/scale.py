"""Thousands of ranks through relays into one hub: delivery, hub CPU and memory, the
dashboard's redraw time and CPU, and a late attach (no torch needed).

For each size, on this one machine: a real hub (`python -m scalemon.hub --listen
tcp://127.0.0.1:0`, a private SCALEMON_HOME and runtime directory under /tmp), and simulated
nodes (`sim_nodes.py`) hosted by a few worker processes. Each simulated node is a real `Relay`
(its own ipc directory, its own CurveZMQ tcp connection to the hub, which it finds in the job
file, keys made on first use) with its ranks, which send real protocol messages over ipc to
it: `hello`, `step`s at `--rate` per second, a `heartbeat` a second, a `sync` round trip a
second, and `exit` at the end. The real dashboard (`scalemon attach JOB` in a tmux pane, as
bench/dashboard_load.py runs it) follows the job while it runs. Afterwards a fresh client
attaches late, as the dashboard does (`HubFeed`: the hub's fold of the history, `seed`, then
the records since, into DashboardData), and is timed from connecting to holding everything the
hub held; with `--replay` also without the seed (the whole history replayed), to compare.

Every message is accounted for: the ranks' `seq` numbers (sent, and dropped by a full socket),
the relays' counts (received, forwarded, dropped), the hub's `received` and per-rank `seq_gaps`.
`unaccounted` = sent - (hub received + rank drops + relay drops), 0 expected.

On a machine of two cores the simulator of 4096 ranks, the hub and the dashboard together need
more than both: the dashboard's own figures at those sizes come from bench/dashboard_load.py
--pin (the dashboard on a core of its own, as on a login node).

The workers run at nice 19 (`--worker-nice`): the nodes they stand for are other machines, so
the hub and the dashboard get the CPU first and the simulator the rest; a worker that falls
behind its schedule says so (`tick_lag_*`, `achieved_msgs_per_s`). Other users' processes
that competed during a run are listed in its `busiest_other_processes`.

    python bench/scale.py --replay --wait-quiet 900 --quiet-pct 15   # 512-4096 ranks, 5 steps/s
    python bench/scale.py --no-dashboard --wait-quiet 900 --quiet-pct 15 \
        --out bench/results/scale-nodash-cpu.json                # the hub without a dashboard
    python bench/scale.py --ranks 4096 --rate 1 2 3 --wait-quiet 900 --quiet-pct 15 \
        --out bench/results/scale-rates-cpu.json                 # the rate 4096 ranks sustain
    python bench/scale.py --quick --out /tmp/q.json   # 64 ranks on 8 nodes, 5 s (the test)
    python bench/scale.py --ranks 16384 --rate 1 --collectives-every 2 --no-dashboard \
        --out bench/results/scale-16k-collectives-cpu.json   # with the Flight Recorder's
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from dashboard_load import find_dashboard, tmux
from machine import cpu_name, machine_busy_pct
from sim_nodes import Plan, run_worker

from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir
from scalemon.link.client import HubClient
from scalemon.policy import HANG_AFTER_S

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
REDRAW_P99_MS = 100.0
DASHBOARD_CPU_PCT = 50.0
ATTACH_S = 5.0
HUB_MAIN_PCT = 50.0
"""The hub's main thread, in % of one core (issue #40: at 16,384 ranks, 1 step/s)."""
HUB_RSS_MB = 1024.0
HANG_NAMED_S = HANG_AFTER_S + 10.0
"""A hang named within the threshold + 10 s of the last step."""


# ---- one run ---------------------------------------------------------------------------------

class Case:
    """One size at one rate: starts everything, measures, and cleans up whatever happens."""

    def __init__(self, ranks: int, rate: float, args: argparse.Namespace) -> None:
        self.ranks = ranks
        self.rate = rate
        self.args = args
        self.nodes = -(-ranks // args.ranks_per_node)
        self.job = f"scale{ranks}"
        self.home = Path(tempfile.mkdtemp(prefix="sms", dir="/tmp"))
        self.runtime = self.home / "rt"
        self.runtime.mkdir(mode=0o700)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SCALEMON_")}
        self.env.update(SCALEMON_HOME=str(self.home), SCALEMON_RUNTIME_DIR=str(self.runtime))
        self.alerts_path = self.home / "alerts.jsonl"
        self.culprit = ranks // 2 + 3 if ranks > 8 else ranks - 1
        if args.hang:  # the hub's own alerts say when it named the hang, and whom
            self.env["SCALEMON_ALERT_CMD"] = (
                f"sh -c 'cat >> {self.alerts_path}; echo >> {self.alerts_path}'")
        self.hub: subprocess.Popen | None = None
        self.workers: list[tuple[mp.Process, Any]] = []
        self.tmux_server = f"smscale-{os.getpid()}-{ranks}"
        self.dashboard: psutil.Process | None = None
        self.tmux_proc: psutil.Process | None = None
        self.busiest_others: list[list[Any]] = []
        self.stats_path = self.home / "dash.json"
        self.samples: list[dict[str, float]] = []
        self.log = lambda text: print(f"  [{ranks} ranks @ {rate:g}/s] {text}", flush=True)

    # -- setup
    def start_hub(self) -> tuple[HubAddress, JobFile]:
        out = open(self.home / "hub.log", "wb")  # noqa: SIM115 - the hub's for its life
        hub_args = ["--job", self.job, "--home", str(self.home), "--listen",
                    "tcp://127.0.0.1:0", "--world-size", str(self.ranks), "--linger", "600"]
        if self.args.hub_profile:  # cProfile of the hub, written when it is stopped
            run = ["-c", "import cProfile, sys; from scalemon.hub.main import main; "
                   f"cProfile.run('main(sys.argv[1:])', {str(self.home / 'hub.prof')!r})"]
        else:
            run = ["-m", "scalemon.hub"]
        self.hub = subprocess.Popen([sys.executable, *run, *hub_args], env=self.env,
                                    stdout=out, stderr=subprocess.STDOUT)
        out.close()
        path = jobs_dir(self.home) / f"{self.job}.json"
        end = time.monotonic() + 30
        while time.monotonic() < end:
            if self.hub.poll() is not None:
                raise RuntimeError(f"the hub exited: {(self.home / 'hub.log').read_text()}")
            try:
                jf = JobFile.read(path)
                if jf.pid == self.hub.pid and jf.tcp:
                    return jf.hub_address(), jf
            except ValueError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the hub did not write its job file in 30 s")

    def start_workers(self) -> None:
        spawn = mp.get_context("spawn")
        names = [(f"sim{i:04d}", i * self.args.ranks_per_node) for i in range(self.nodes)]
        count = max(1, min(self.args.workers, self.nodes))
        for w in range(count):
            share = names[w * len(names) // count:(w + 1) * len(names) // count]
            plan = Plan(job=self.job, home=str(self.home), runtime_dir=str(self.runtime),
                        world_size=self.ranks, nodes=share,
                        ranks_per_node=self.args.ranks_per_node, rate=self.rate,
                        seconds=self.args.seconds, sync_s=self.args.sync_s,
                        hang_s=self.args.hang, hang_culprit=self.culprit,
                        hang_whole_beats=self.args.hang_whole_beats,
                        collectives_every_s=self.args.collectives_every)
            parent, child = spawn.Pipe()
            proc = spawn.Process(target=run_worker, args=(plan, child, self.args.worker_nice),
                                 daemon=True)
            proc.start()
            child.close()
            self.workers.append((proc, parent))
        end = time.monotonic() + 120 + self.nodes / 4
        for proc, conn in self.workers:
            if not conn.poll(max(0.0, end - time.monotonic())):
                raise RuntimeError(f"worker {proc.pid} not ready in time")
            kind, value = conn.recv()
            if kind != "ready" or not value:
                raise RuntimeError(f"worker {proc.pid}: {kind} {value}")

    def start_dashboard(self) -> None:
        width, height = self.args.size.split("x")
        cmd = (f"env SCALEMON_HOME={self.home} SCALEMON_RUNTIME_DIR={self.runtime} "
               f"{sys.executable} -m scalemon attach {self.job} --stats-json {self.stats_path}")
        tmux(self.tmux_server, "new-session", "-d", "-s", "bench", "-x", width, "-y", height,
             cmd)
        self.dashboard = find_dashboard(self.job)
        with contextlib.suppress(ValueError, psutil.Error):  # the terminal's own CPU
            self.tmux_proc = psutil.Process(int(tmux(self.tmux_server, "display-message",
                                                     "-p", "#{pid}").strip()))
        time.sleep(2.0)  # attached and idle

    # -- measuring
    def sample(self, client: HubClient) -> None:
        """CPU times and memory of the hub, the dashboard and the workers; the hub's head."""
        s: dict[str, float] = {"t": time.time(), "mono": time.monotonic()}
        hub = psutil.Process(self.hub.pid)
        with hub.oneshot():
            cpu = hub.cpu_times()
            s["hub_cpu_s"] = cpu.user + cpu.system
            s["hub_rss"] = hub.memory_info().rss
            s["hub_main_cpu_s"] = next((t.user_time + t.system_time for t in hub.threads()
                                        if t.id == hub.pid), 0.0)
        if self.dashboard is not None:
            try:
                with self.dashboard.oneshot():
                    cpu = self.dashboard.cpu_times()
                    s["dash_cpu_s"] = cpu.user + cpu.system
                    s["dash_rss"] = self.dashboard.memory_info().rss
                    s["dash_ui_cpu_s"] = next((t.user_time + t.system_time
                                               for t in self.dashboard.threads()
                                               if t.id == self.dashboard.pid), 0.0)
            except psutil.Error:
                pass
        if self.tmux_proc is not None:
            with contextlib.suppress(psutil.Error):
                cpu = self.tmux_proc.cpu_times()
                s["tmux_cpu_s"] = cpu.user + cpu.system
        total = 0.0
        for proc, _ in self.workers:
            try:
                cpu = psutil.Process(proc.pid).cpu_times()
                total += cpu.user + cpu.system
            except psutil.Error:
                pass
        s["workers_cpu_s"] = total
        mine = psutil.Process().cpu_times()
        s["bench_cpu_s"] = mine.user + mine.system
        busy = psutil.cpu_times()
        s["machine_busy_s"] = sum(busy) - busy.idle - getattr(busy, "iowait", 0.0)
        s["softirq_s"] = getattr(busy, "softirq", 0.0) + getattr(busy, "irq", 0.0)
        t = time.perf_counter()
        try:
            s["head"] = client.request("ping")["head"]
        except Exception:  # a hub too busy to answer in time is itself a finding
            s["head"] = float("nan")
        s["ping_ms"] = (time.perf_counter() - t) * 1000
        self.samples.append(s)

    def window(self, t0: float, t1: float) -> dict[str, float | None]:
        """Rates over the samples in [t0, t1] (wall time): CPU as % of one core, etc."""
        inside = [s for s in self.samples if t0 - 0.3 <= s["t"] <= t1 + 0.3]
        if len(inside) < 2:
            return {}
        a, b = inside[0], inside[-1]
        dt = b["t"] - a["t"]

        def pct(key: str) -> float | None:
            if key not in a or key not in b:
                return None
            return 100.0 * (b[key] - a[key]) / dt

        return {"seconds": dt, "hub_cpu_pct": pct("hub_cpu_s"),
                "hub_main_thread_cpu_pct": pct("hub_main_cpu_s"),
                "workers_cpu_pct": pct("workers_cpu_s"),
                "dashboard_cpu_pct": pct("dash_cpu_s"),
                "dashboard_ui_thread_cpu_pct": pct("dash_ui_cpu_s"),
                "tmux_cpu_pct": pct("tmux_cpu_s"),
                "machine_busy_pct": pct("machine_busy_s"),
                "bench_cpu_pct": pct("bench_cpu_s"),
                "softirq_pct": pct("softirq_s"),
                "hub_rss_peak_mb": max(s["hub_rss"] for s in inside) / 2**20,
                "dashboard_rss_peak_mb": max((s.get("dash_rss", 0) for s in inside),
                                             default=0) / 2**20 or None,
                "hub_ingest_per_s": (b["head"] - a["head"]) / dt,
                "hub_ping_ms_max": max(s["ping_ms"] for s in inside),
                "hub_ping_ms_p50": statistics.median(s["ping_ms"] for s in inside)}

    def run(self) -> dict[str, Any]:
        self.background = machine_busy_pct(2.0)
        end = time.monotonic() + self.args.wait_quiet
        while self.background > self.args.quiet_pct and time.monotonic() < end:
            self.log(f"machine busy {self.background:.0f}% of a core: waiting for it to quieten")
            time.sleep(10.0)
            self.background = machine_busy_pct(2.0)
        self.log(f"machine busy {self.background:.0f}% of a core before the run (other users)")
        self.log(f"{self.nodes} nodes, {min(self.args.workers, self.nodes)} worker processes")
        address, jf = self.start_hub()
        client = HubClient(address, timeout_s=60)
        t_setup = time.monotonic()
        self.start_workers()
        relays = client.state()["hub"]["relays"]
        self.log(f"{relays} relays connected to the hub over CurveZMQ in "
                 f"{time.monotonic() - t_setup:.1f} s")
        if relays != self.nodes:
            raise RuntimeError(f"{relays} relays reached the hub, expected {self.nodes}")
        rss_idle = psutil.Process(self.hub.pid).memory_info().rss
        if self.args.dashboard:
            self.start_dashboard()
        start_t = time.time() + 1.0
        for _, conn in self.workers:
            conn.send(("go", start_t))
        procs_before = process_cpu()
        results: dict[int, dict[str, Any]] = {}
        give_up = time.monotonic() + self.args.seconds * 3 + self.args.hang + 90
        while len(results) < len(self.workers) and time.monotonic() < give_up:
            self.sample(client)
            for i, (proc, conn) in enumerate(self.workers):
                if i not in results and conn.poll(0):
                    kind, value = conn.recv()
                    if kind != "done":
                        raise RuntimeError(f"worker {proc.pid}: {kind} {value}")
                    results[i] = value
            time.sleep(0.5)
        if len(results) < len(self.workers):
            raise RuntimeError("workers did not finish in time")
        self.hang = self.hang_found(max(r["t_last_step_wall"] for r in results.values()))
        self.busiest_others = busiest_others(procs_before, process_cpu(), time.time() - start_t,
                                             self.own_pids())
        load_end = max(r["t_last_monotonic"] for r in results.values())
        load_end_wall = start_t + (load_end - min(r["t0_monotonic"] for r in results.values()))
        final_head, drained_at = self.wait_drained(client)
        drained_at = min([s["mono"] for s in self.samples if s["head"] >= final_head]
                         + [drained_at])
        state = client.state()
        self.sample(client)
        dash = self.stop_dashboard()
        attach = late_attach(address, self.args.replay)
        self.log(f"late attach: {attach['records']} records, {attach['note']}, in "
                 f"{attach['seconds']:.2f} s (seed {attach['seed_bytes'] / 2**20:.1f} MiB)"
                 + (f"; replaying them all instead: {attach['replay_s']:.2f} s"
                    if attach["replay_s"] is not None else ""))
        return self.figures(results, state, dash, attach, start_t, load_end_wall,
                            drained_at - max(r["t_end_monotonic"] for r in results.values()),
                            rss_idle, jf)

    def hang_found(self, last_step_wall: float) -> dict[str, Any]:
        """When the hub's hang alerts came after the last step (`--hang`): the first (maybe
        provisional), the first that named the planted culprit alone and not provisionally,
        and whom the last one named. The hub remakes its report as heartbeats arrive and
        sends an update once it no longer guesses (and when its culprits change after)."""
        if not self.args.hang:
            return {}
        alerts = []
        with contextlib.suppress(OSError):
            for line in self.alerts_path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    alerts.append(json.loads(line))
        hangs = [a for a in alerts if a.get("kind") == "hang"]
        during = self.window(last_step_wall + 1.0, last_step_wall + self.args.hang)
        found = {"hang_s": self.args.hang, "hang_culprit_planted": self.culprit,
                 "alerts": len(alerts), "hang_alerts": len(hangs),
                 "hang_whole_beats": self.args.hang_whole_beats,
                 # the hub while every rank beats stuck (the hub's own clock: it may lag)
                 "hang_hub_main_thread_cpu_pct": during.get("hub_main_thread_cpu_pct"),
                 "hang_hub_ingest_per_s": during.get("hub_ingest_per_s")}
        if not hangs:
            self.log(f"the hub named no hang in {self.args.hang:g} s")
            return {**found, "hang_first_alert_after_s": None, "hang_named_after_s": None,
                    "hang_culprits": None, "hang_culprit_count": None}
        first, last = hangs[0], hangs[-1]
        right = next((a for a in hangs if a.get("ranks") == [self.culprit]
                      and not a.get("provisional")), None)
        after = None if right is None else float(right["t"]) - last_step_wall
        for a in hangs:
            self.log(f"hang alert {float(a['t']) - last_step_wall:.1f} s after the last step"
                     f" ({len(a.get('ranks') or [])} culprits): {a['text'][:160]}")
        culprits = last.get("ranks") or []
        return {**found, "hang_first_alert_after_s": float(first["t"]) - last_step_wall,
                "hang_first_culprit_count": len(first.get("ranks") or []),
                "hang_first_provisional": first.get("provisional"),
                "hang_named_after_s": after,  # the planted culprit alone, not provisional
                "hang_culprits": culprits[:16], "hang_culprit_count": len(culprits),
                "hang_text": last["text"][:300]}

    def own_pids(self) -> set[int]:
        """This run's processes: the bench, the hub, the workers, the dashboard, its tmux."""
        pids = {os.getpid(), self.hub.pid, *(proc.pid for proc, _ in self.workers)}
        for proc in (self.dashboard, self.tmux_proc):
            if proc is not None:
                pids.add(proc.pid)
        with contextlib.suppress(psutil.Error):
            pids.update(c.pid for c in psutil.Process().children(recursive=True))
        return pids

    def wait_drained(self, client: HubClient) -> tuple[int, float]:
        """The hub's head once it stopped growing for 1 s (the backlog taken), and when it
        was first seen there."""
        last, since = -1, time.monotonic()
        end = time.monotonic() + 120
        while time.monotonic() < end:
            head = client.request("ping")["head"]
            now = time.monotonic()
            if head != last:
                last, since = head, now
            elif now - since >= 1.0:
                break
            time.sleep(0.1)
        return last, since

    def stop_dashboard(self) -> dict[str, Any] | None:
        if self.dashboard is None:
            return None
        tmux(self.tmux_server, "send-keys", "-t", "bench", "q")
        end = time.monotonic() + 30
        while not self.stats_path.exists() and time.monotonic() < end:
            time.sleep(0.2)
        time.sleep(0.3)
        try:
            return json.loads(self.stats_path.read_text())
        except (OSError, ValueError):
            return None

    # -- results
    def figures(self, results: dict[int, dict[str, Any]], state: dict[str, Any],
                dash: dict[str, Any] | None, attach: dict[str, Any], start_t: float,
                load_end_wall: float, drain_s: float, rss_idle: int,
                jf: JobFile) -> dict[str, Any]:
        ranks_sent: dict[int, list[int]] = {}
        relays: dict[str, dict[str, Any]] = {}
        for r in results.values():
            ranks_sent.update({int(k): v for k, v in r["ranks"].items()})
            relays.update(r["relays"])
        sent = sum(v[0] for v in ranks_sent.values())
        rank_dropped = sum(v[1] for v in ranks_sent.values())
        relay_dropped = sum(int(s["dropped"]) for s in relays.values())
        relay_received = sum(int(s["received"]) for s in relays.values())
        relay_forwarded = sum(int(s["forwarded"]) for s in relays.values())
        hub = state["hub"]
        views = state["state"]["ranks"]
        hub_relays = state["state"].get("relays") or {}
        seconds_taken = max(r["seconds_taken"] for r in results.values())
        ticks = min(r["ticks_sent"] for r in results.values())
        ticks_planned = int(round(self.args.seconds * self.rate))
        heartbeats = sum(r["heartbeats_sent"] for r in results.values())
        # every step, the heartbeats the ranks sent (every second, or every
        # `heartbeat_stepping_s` while stepping in a big job), hello and exit
        collectives = sum(r["collectives_sent"] for r in results.values())
        planned = (self.ranks * (ticks_planned + 2) + heartbeats + collectives
                   + 1)  # rank 0 says the group once
        load = self.window(start_t, load_end_wall)
        redraws = sorted(dash["redraw_ms"]) if dash and dash.get("redraw_ms") else []
        dash_received = (sum(dash["by_type"].get(t, 0) for t in
                             ("hello", "step", "heartbeat", "exit", "collectives"))
                          if dash else None)
        row = {
            "ranks": self.ranks, "nodes": self.nodes, "ranks_per_node": self.args.ranks_per_node,
            "workers": len(self.workers), "steps_per_s_per_rank": self.rate,
            "seconds": self.args.seconds, "sync_every_s": self.args.sync_s,
            "target_msgs_per_s": self.ranks * self.rate + (
                sum(r["heartbeats_in_load"] for r in results.values()) - self.ranks
                + collectives) / self.args.seconds,
            # steps and heartbeats (not the 4 start and end messages) over the time taken
            "achieved_msgs_per_s": (sent - 4 * self.ranks) / seconds_taken
            if seconds_taken else None,
            "heartbeats_sent": heartbeats,
            "collectives_every_s": self.args.collectives_every,
            "collectives_sent": collectives,
            "ticks_planned": ticks_planned, "ticks_sent": ticks,
            "seconds_taken": seconds_taken,
            "tick_lag_p50_s": max(r["lag_p50_s"] or 0 for r in results.values()),
            "tick_lag_p99_s": max(r["lag_p99_s"] or 0 for r in results.values()),
            "tick_lag_max_s": max(r["lag_max_s"] or 0 for r in results.values()),
            "messages_planned": planned,
            "sent": sent,
            "dropped_by_ranks": rank_dropped,
            "relay_received": relay_received, "relay_forwarded": relay_forwarded,
            "dropped_by_relays": relay_dropped,
            "hub_received": hub["received"], "hub_rejected": hub["rejected"],
            "hub_records": hub["history"],
            "seq_gaps": sum(v["seq_gaps"] for v in views),
            "unaccounted": sent - (hub["received"] + rank_dropped + relay_dropped),
            "ranks_seen": len(views),
            "ranks_finished": sum(v["state"] == "finished" for v in views),
            "ranks_lost_records": sum(1 for v in views if v.get("state_reason")
                                      and "no message" in str(v.get("state_reason"))),
            "hub_relays": hub["relays"],
            "hub_relays_dropped": sum(int(b.get("dropped") or 0) for b in hub_relays.values()),
            "syncs_answered": sum(r["syncs_answered"] for r in results.values()),
            "syncs_answered_by_relays": sum(r["syncs_answered_by_relays"]
                                            for r in results.values()),
            "sync_rtt_p50_ms": _ms(statistics.median(
                [r["sync_rtt_p50_s"] for r in results.values() if r["sync_rtt_p50_s"]] or [0])),
            "sync_rtt_p99_ms": _ms(max(r["sync_rtt_p99_s"] or 0 for r in results.values())),
            "hub_drain_s": drain_s,
            "hub_cpu_pct": load.get("hub_cpu_pct"),
            "hub_main_thread_cpu_pct": load.get("hub_main_thread_cpu_pct"),
            "hub_rss_idle_mb": rss_idle / 2**20,
            "hub_rss_peak_mb": load.get("hub_rss_peak_mb"),
            "hub_rss_end_mb": self.samples[-1]["hub_rss"] / 2**20,
            "hub_ingest_per_s": load.get("hub_ingest_per_s"),
            "hub_ping_ms_p50": load.get("hub_ping_ms_p50"),
            "hub_ping_ms_max": load.get("hub_ping_ms_max"),
            "workers_cpu_pct": load.get("workers_cpu_pct"),
            "workers_rank_side_cpu_pct": 100 * sum(r["rank_cpu_s"] for r in results.values())
            / seconds_taken,
            "workers_relay_side_cpu_pct": 100 * sum(r["relay_cpu_s"] for r in results.values())
            / seconds_taken,
            "machine_busy_pct": load.get("machine_busy_pct"),
            "background_busy_pct_before": self.background,
            "softirq_pct": load.get("softirq_pct"),
            "bench_cpu_pct": load.get("bench_cpu_pct"),
            "busiest_other_processes": self.busiest_others,
            "others_cpu_pct": _others(load),
            "dashboard": dash is not None,
            "dashboard_cpu_pct": load.get("dashboard_cpu_pct"),
            "dashboard_ui_thread_cpu_pct": load.get("dashboard_ui_thread_cpu_pct"),
            "tmux_cpu_pct": load.get("tmux_cpu_pct"),
            "dashboard_rss_peak_mb": load.get("dashboard_rss_peak_mb"),
            "redraws": len(redraws),
            "redraw_ms_p50": statistics.median(redraws) if redraws else None,
            "redraw_ms_p99": _pct(redraws, 0.99),
            "redraw_ms_max": redraws[-1] if redraws else None,
            "dashboard_received": dash_received,
            "dashboard_delivery": (dash_received / hub["received"]
                                   if dash_received is not None and hub["received"] else None),
            "attach_records": attach["records"], "attach_s": attach["seconds"],
            "attach_seeded_at": attach["seeded_at"], "attach_seed_s": attach["seed_s"],
            "attach_seed_bytes": attach["seed_bytes"], "attach_how": attach["note"],
            "attach_replay_s": attach["replay_s"],
            "attach_rss_mb": attach["rss_mb"],
            "attach_seed_reply_s": attach["seed"].get("reply_s"),
            "attach_seed_load_s": attach["seed"].get("load_s"),
            "hub_tcp": bool(jf.tcp),
            "home": str(self.home),
        }
        rate = row["hub_ingest_per_s"] or None
        for who in ("hub", "dashboard", "workers"):  # CPU per message the hub took in
            cpu = row[f"{who}_cpu_pct"]
            row[f"{who}_cpu_us_per_msg"] = (cpu * 1e4 / rate) if cpu is not None and rate \
                else None
        row.update(self.hang)
        row["delivered_all"] = row["unaccounted"] == 0 and row["seq_gaps"] == (
            rank_dropped + relay_dropped)
        row["kept_schedule"] = (ticks == row["ticks_planned"]
                                and seconds_taken <= self.args.seconds * 1.05 + 1.0 / self.rate)
        row["sustained"] = bool(
            row["kept_schedule"] and row["delivered_all"] and rank_dropped + relay_dropped == 0
            and row["hub_drain_s"] < 2.0
            and (row["dashboard_delivery"] is None or row["dashboard_delivery"] >= 0.999))
        redraw, dash_cpu = row["redraw_ms_p99"], row["dashboard_cpu_pct"]
        row["goals_met"] = {  # None: not measured (no dashboard)
            "nothing_lost": row["unaccounted"] == 0 and rank_dropped + relay_dropped == 0,
            "redraw_p99": None if redraw is None else redraw <= REDRAW_P99_MS,
            "dashboard_cpu": None if dash_cpu is None else dash_cpu <= DASHBOARD_CPU_PCT,
            "attach": row["attach_s"] <= ATTACH_S,
            "hub_main_thread": (None if row["hub_main_thread_cpu_pct"] is None
                                else row["hub_main_thread_cpu_pct"] <= HUB_MAIN_PCT),
            "hub_rss": (None if row["hub_rss_peak_mb"] is None
                        else row["hub_rss_peak_mb"] <= HUB_RSS_MB),
            "hang_named": (None if not self.args.hang else
                           row["hang_named_after_s"] is not None
                           and row["hang_named_after_s"] <= HANG_NAMED_S
                           and row["hang_culprits"] == [self.culprit])}
        return row

    def close(self) -> None:
        """Stop everything this run started, whatever state it is in."""
        for proc, conn in self.workers:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("stop", None))
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        if shutil.which("tmux"):
            tmux(self.tmux_server, "kill-server")
        if self.hub is not None and self.hub.poll() is None:
            self.hub.terminate()
            try:
                self.hub.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.hub.kill()
                self.hub.wait(timeout=10)
        if self.args.keep:
            print(f"  kept {self.home}")
        else:
            shutil.rmtree(self.home, ignore_errors=True)


def process_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds so far of every process of the machine: pid -> (command, seconds)."""
    out = {}
    for proc in psutil.process_iter(["cmdline", "name", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is None:
            continue
        cmd = " ".join(proc.info["cmdline"] or []) or proc.info["name"] or "?"
        out[proc.pid] = (cmd[:100], times.user + times.system)
    return out


def busiest_others(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                   seconds: float, ours: set[int]) -> list[list[Any]]:
    """The other processes that used the most CPU meanwhile (% of one core): other users of
    the machine, whose work competes with the run's."""
    used = [(100.0 * (cpu - before.get(pid, ("", 0.0))[1]) / max(seconds, 1e-9), cmd)
            for pid, (cmd, cpu) in after.items() if pid not in ours]
    return [[round(pct, 1), cmd] for pct, cmd in sorted(used, reverse=True)[:5] if pct >= 1.0]


def _others(load: dict[str, float | None]) -> float | None:
    """Machine CPU not spent by this benchmark's processes nor in the kernel's interrupt
    handling (the loopback network's): other users of the machine."""
    if load.get("machine_busy_pct") is None:
        return None
    ours = sum(load.get(k) or 0.0 for k in ("hub_cpu_pct", "workers_cpu_pct",
                                            "dashboard_cpu_pct", "bench_cpu_pct",
                                            "tmux_cpu_pct", "softirq_pct"))
    return load["machine_busy_pct"] - ours


def _pct(ordered: list[float], q: float) -> float | None:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


# ---- a late attach ---------------------------------------------------------------------------

def _late_attach(address: HubAddress, replay: bool, conn: Any) -> None:
    """In its own process: what `scalemon attach` does first (`HubFeed.run` into
    DashboardData: the hub's fold, `seed`, then the records since), timed from connecting to
    having everything the hub held when it answered; then, with `replay`, the same by
    replaying the whole history, as a dashboard without a seed would."""
    import threading

    from scalemon.tui.feed import HubFeed
    from scalemon.tui.model import DashboardData

    def attach(use_seed: bool) -> dict[str, Any]:
        head = HubClient(address, timeout_s=60).request("ping")["head"]
        data, stop = DashboardData(), threading.Event()
        feed = HubFeed(address=address, timeout_s=60, use_seed=use_seed)
        t0 = time.perf_counter()
        thread = threading.Thread(target=feed.run, args=(data, stop.is_set, lambda *_: None),
                                  daemon=True)
        thread.start()
        seeded_s = None
        end = time.monotonic() + 300
        while data.next_seq < head and time.monotonic() < end:
            if seeded_s is None and data.seeded_at is not None:
                seeded_s = time.perf_counter() - t0
            time.sleep(0.005)
        seconds = time.perf_counter() - t0
        if seeded_s is None and data.seeded_at is not None:
            seeded_s = seconds  # caught up by the seed alone
        stop.set()
        thread.join(timeout=30)
        return {"records": data.next_seq, "head": head, "seconds": seconds,
                "seeded_at": data.seeded_at, "seed_s": seeded_s, "note": feed.seed_note,
                "ranks": len(data.state.ranks), "seed": feed.seed_figures}

    try:
        out = attach(use_seed=True)
        out["rss_mb"] = psutil.Process().memory_info().rss / 2**20
        reply = HubClient(address, timeout_s=60).request("seed")
        out["seed_bytes"] = len(reply["seed"] or b"")
        out["replay_s"] = attach(use_seed=False)["seconds"] if replay else None
        conn.send(out)
    finally:
        conn.close()


def late_attach(address: HubAddress, replay: bool) -> dict[str, Any]:
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    proc = spawn.Process(target=_late_attach, args=(address, replay, child), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(360):
            raise RuntimeError("the late attach did not finish in 360 s")
        return parent.recv()
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


# ---- the table -------------------------------------------------------------------------------

COLUMNS = [
    ("ranks", "ranks", "{:>5}"), ("nodes", "nodes", "{:>5}"),
    ("steps_per_s_per_rank", "st/s", "{:>4g}"),
    ("target_msgs_per_s", "target/s", "{:>8,.0f}"), ("achieved_msgs_per_s", "sent/s", "{:>8,.0f}"),
    ("tick_lag_p99_s", "lag99 s", "{:>7.3f}"),
    ("sent", "sent", "{:>9,}"), ("hub_received", "hub recv", "{:>9,}"),
    ("dropped_by_ranks", "drop rk", "{:>7,}"), ("dropped_by_relays", "drop rl", "{:>7,}"),
    ("unaccounted", "unacc", "{:>5,}"), ("seq_gaps", "gaps", "{:>5,}"),
    ("hub_cpu_pct", "hub %", "{:>5.0f}"), ("hub_main_thread_cpu_pct", "main %", "{:>6.0f}"),
    ("hub_rss_peak_mb", "hub MB", "{:>6.0f}"), ("hub_drain_s", "drain s", "{:>7.1f}"),
    ("workers_cpu_pct", "wrk %", "{:>5.0f}"), ("machine_busy_pct", "box %", "{:>5.0f}"),
    ("others_cpu_pct", "other %", "{:>7.0f}"),
    ("dashboard_cpu_pct", "dash %", "{:>6.0f}"), ("redraw_ms_p50", "p50 ms", "{:>6.0f}"),
    ("redraw_ms_p99", "p99 ms", "{:>6.0f}"), ("dashboard_delivery", "dash dlv", "{:>8.3f}"),
    ("attach_records", "attach rec", "{:>10,}"), ("attach_seed_bytes", "seed B", "{:>10,}"),
    ("attach_s", "attach s", "{:>8.2f}"), ("attach_replay_s", "replay s", "{:>8.2f}"),
    ("sustained", "sustained", "{!s:>9}"),
]


def table(rows: list[dict[str, Any]]) -> str:
    """The figures of every run, one line each."""
    grid = [[title for _, title, _ in COLUMNS]]
    for r in rows:
        grid.append(["n/a" if r.get(key) is None else fmt.format(r[key])
                     for key, _, fmt in COLUMNS])
    widths = [max(len(line[i]) for line in grid) for i in range(len(COLUMNS))]
    return "\n".join(" ".join(f"{cell:>{w}}" for cell, w in zip(line, widths, strict=True))
                     for line in grid)


def growth(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each figure at the largest size over the same at the smallest (same rate)."""
    if len(rows) < 2:
        return {}
    a, b = rows[0], rows[-1]
    keys = ("target_msgs_per_s", "achieved_msgs_per_s", "hub_cpu_pct", "hub_main_thread_cpu_pct",
            "hub_rss_peak_mb", "hub_cpu_us_per_msg", "workers_cpu_pct", "dashboard_cpu_pct",
            "dashboard_cpu_us_per_msg", "redraw_ms_p50", "redraw_ms_p99", "attach_records",
            "attach_seed_bytes", "attach_s", "attach_replay_s")
    return {k: (b[k] / a[k] if a.get(k) and b.get(k) is not None else None) for k in keys}


# ---- main ------------------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--rate", type=float, nargs="+", default=[5.0],
                   help="steps per second per rank (several: each size at each rate)")
    p.add_argument("--seconds", type=float, default=25.0, help="load per run")
    p.add_argument("--workers", type=int, default=8, help="processes hosting the nodes")
    p.add_argument("--sync-s", type=float, default=1.0,
                   help="a sync round trip per rank this often, as the agent (0: none)")
    p.add_argument("--worker-nice", type=int, default=19,
                   help="CPU priority of the workers below the hub's and the dashboard's: the "
                        "nodes they stand for are other machines (0: the same)")
    p.add_argument("--size", default="160x50", help="terminal size of the dashboard")
    p.add_argument("--no-dashboard", dest="dashboard", action="store_false",
                   help="leave the dashboard out")
    p.add_argument("--quick", action="store_true",
                   help="64 ranks on 8 nodes, 5 s, 2 workers (the test)")
    p.add_argument("--out", type=Path, help="results file (default bench/results/scale-cpu.json)")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                   help="before each run wait up to S seconds for the machine to be idle "
                        "(others' processes under --quiet-pct)")
    p.add_argument("--quiet-pct", type=float, default=25.0, metavar="PCT",
                   help="idle enough: CPU in use by others, in %% of one core")
    p.add_argument("--hang", type=float, default=0.0, metavar="S",
                   help="after the load, the job hangs S seconds (one rank stuck in its data "
                        "loader, the others in an all-reduce) before its ranks exit; the hub's "
                        "alert command ($SCALEMON_ALERT_CMD) times when it names the hang")
    p.add_argument("--collectives-every", type=float, default=0.0, metavar="S",
                   help="each rank sends a `collectives` message this often, with 4 gradient "
                        "all-reduces a step (the Flight Recorder's reads); 0: none")
    p.add_argument("--hang-whole-beats", action="store_true",
                   help="with --hang: every hang heartbeat carries its stack and collectives in "
                        "flight, as agents before protocol 1.14 sent them (not once)")
    p.add_argument("--keep", action="store_true", help="keep each run's home (logs, history)")
    p.add_argument("--replay", action="store_true",
                   help="also time a late attach that replays the whole history (no seed)")
    p.add_argument("--hub-profile", action="store_true",
                   help="run the hub under cProfile (hub.prof in the run's home; with --keep)")
    args = p.parse_args(argv)
    if args.quick:
        args.ranks, args.seconds, args.workers = [64], 5.0, 2
    if args.dashboard and shutil.which("tmux") is None:
        print("tmux not found: running without the dashboard", file=sys.stderr)
        args.dashboard = False
    out = args.out or RESULTS / "scale-cpu.json"
    rows = []
    for rate in args.rate:
        for n in args.ranks:
            case = Case(n, rate, args)
            try:
                rows.append(case.run())
            finally:
                case.close()
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(f"{len(rows)} runs: {args.seconds:g} s each, {args.ranks_per_node} ranks per node, "
          f"a relay per node over CurveZMQ tcp, {cpu_name()}")
    print(table(rows))
    by_rate = {rate: [r for r in rows if r["steps_per_s_per_rank"] == rate] for rate in args.rate}
    summary = {
        "growth_first_to_last_size": {str(rate): growth(rs) for rate, rs in by_rate.items()},
        "largest_sustained": max(
            ({"ranks": r["ranks"], "steps_per_s_per_rank": r["steps_per_s_per_rank"],
              "target_msgs_per_s": r["target_msgs_per_s"]} for r in rows if r["sustained"]),
            key=lambda x: x["target_msgs_per_s"], default=None),
        "goals": {"redraw_p99_ms": REDRAW_P99_MS, "dashboard_cpu_pct": DASHBOARD_CPU_PCT,
                  "attach_s": ATTACH_S, "unaccounted": 0, "hub_main_thread_cpu_pct": HUB_MAIN_PCT,
                  "hub_rss_peak_mb": HUB_RSS_MB, "hang_named_after_s": HANG_NAMED_S},
    }
    for r in rows:
        goals = ", ".join(f"{k} {'n/a' if v is None else 'yes' if v else 'NO'}"
                          for k, v in r["goals_met"].items())
        print(f"{r['ranks']:>5} ranks @ {r['steps_per_s_per_rank']:g}/s: {goals}")
    print(f"largest load sustained: {summary['largest_sustained']}")
    for rate, g in summary["growth_first_to_last_size"].items():
        if g:
            print(f"growth {rows[0]['ranks']} -> {rows[-1]['ranks']} ranks at {rate}/s: " +
                  ", ".join(f"{k} x{v:.2f}" for k, v in g.items() if v is not None))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "machine": machine(), "args": _jsonable(vars(args)),
                               "runs": rows, "summary": summary}, indent=1))
    print(f"saved {out}")
    return 0 if all(r["unaccounted"] == 0 for r in rows) else 1


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}


if __name__ == "__main__":
    sys.exit(main())
