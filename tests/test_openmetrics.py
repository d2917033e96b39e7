"""OpenMetrics export (hub/openmetrics.py): real hubs fed by fake ranks, scraped over HTTP and
read from the textfile, parsed with prometheus_client's own parser. A scrape carries the
per-node and job aggregates; `?ranks=all` (or $SCALEMON_METRICS_PER_RANK=1) every rank's
series too."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO, FakeRank, kill_tree, torchrun_cmd, wait_for
from scalemon.collectives import CollectiveStats
from scalemon.home.history import history_path, read_messages
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir
from scalemon.hub.openmetrics import RANK_GAUGES, families, parse_address
from scalemon.protocol import HUB_RANK, SILENT_RANK_STATES, Message
from scalemon.state.jobstate import JobState

GROUP = "0"
ISSUE_FAMILIES = {f"scalemon_{name}" for name in (
    "step", "loss", "step_time_seconds", "tokens_per_second", "mfu_ratio", "loss_scale",
    "mem_allocated_bytes", "gpu_utilization_ratio", "arrival_lateness_seconds", "rank_up",
    "collective_busbw_gbps", "collective_seconds", "hang", "alerts")}
"""The families issue #28 asks for."""


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of an exposition, parsed by prometheus_client."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def rank_value(found: dict, name: str, job: str, rank: int) -> float | None:
    for (sample, labels), value in found.items():
        d = dict(labels)
        if sample == name and d.get("job") == job and d.get("rank") == str(rank):
            return value
    return None


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        return reply.read().decode()


def job_file(home: Path, job: str) -> JobFile:
    return JobFile.read(jobs_dir(home) / f"{job}.json")


def feed(zctx, hub, job: str) -> None:
    """Two ranks: rank 0 with GPU-like values, rank 1 with a NaN loss and nothing measured
    but its steps; both issue all-reduces on one group."""
    ranks = [FakeRank(zctx, hub.address, job, r) for r in (0, 1)]
    for rank in ranks:
        rank.hello(world_size=2)
    for step in range(1, 6):
        ranks[0].send("step", {
            "step": step, "loss": 2.5, "tokens": 1000, "step_time_s": 0.25,
            "loss_scale": 65536.0, "mem_allocated_bytes": 3 << 30,
            "extra": {"mfu": 0.42, "tokens_per_s": 8000.0}})
        ranks[1].send("step", {"step": step, "loss": float("nan"), "tokens": 1000,
                               "step_time_s": 0.5})
    ranks[0].send("heartbeat", {"phase": "forward", "dropped": 0, "gpu_util_pct": 75.0,
                                "gpu_mem_used_bytes": 5 << 30})
    stats = CollectiveStats()
    for _ in range(10):  # 10 all-reduces of 1 MiB, 1 ms each
        row = stats.row(GROUP, "allreduce", 20)
        row.count += 1
        row.bytes += 1 << 20
        row.add_time(0.001)
    for rank in ranks:
        rank.send("collectives", {"groups": {GROUP: {"desc": "default_pg", "ranks": [0, 1]}},
                                  "stats": stats.to_wire(), "issues": [], "step": 5})


def test_scraped_metrics_carry_every_rank_with_their_values(start_hub, zctx, home):
    hub = start_hub("omA", "--metrics", "127.0.0.1:0", "--world-size", "2")
    base = job_file(home, "omA").metrics_url
    assert base and re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", base), base
    assert not base.endswith(":0/metrics")
    url = f"{base}?ranks=all"
    feed(zctx, hub, "omA")

    def complete() -> dict | None:
        found = samples(scrape(url))
        done = (rank_value(found, "scalemon_step", "omA", 1) == 5
                and rank_value(found, "scalemon_gpu_utilization_ratio", "omA", 0) is not None
                and any(k[0] == "scalemon_collective_busbw_gbps" for k in found))
        return found if done else None

    found = wait_for(complete, timeout=20)
    host = os.uname().nodename
    up = {dict(labels)["rank"]: (dict(labels)["host"], v) for (name, labels), v in found.items()
          if name == "scalemon_rank_up"}
    assert up == {"0": (host, 1.0), "1": (host, 1.0)}
    assert rank_value(found, "scalemon_step", "omA", 0) == 5
    assert rank_value(found, "scalemon_loss", "omA", 0) == 2.5
    assert math.isnan(rank_value(found, "scalemon_loss", "omA", 1))  # a real NaN loss
    assert rank_value(found, "scalemon_step_time_seconds", "omA", 0) == 0.25
    assert rank_value(found, "scalemon_step_time_seconds", "omA", 1) == 0.5
    assert rank_value(found, "scalemon_tokens_per_second", "omA", 0) == 8000.0
    assert rank_value(found, "scalemon_tokens_per_second", "omA", 1) == 2000.0  # tokens / time
    assert rank_value(found, "scalemon_mfu_ratio", "omA", 0) == 0.42
    assert rank_value(found, "scalemon_loss_scale", "omA", 0) == 65536.0
    assert rank_value(found, "scalemon_mem_allocated_bytes", "omA", 0) == 3 << 30
    assert rank_value(found, "scalemon_gpu_utilization_ratio", "omA", 0) == 0.75
    assert rank_value(found, "scalemon_gpu_memory_used_bytes", "omA", 0) == 5 << 30
    # not measured on rank 1: no sample, rather than a NaN that reads as a value
    for name in ("scalemon_mfu_ratio", "scalemon_loss_scale", "scalemon_mem_allocated_bytes",
                 "scalemon_gpu_utilization_ratio"):
        assert rank_value(found, name, "omA", 1) is None, name
    op = (("group", "default_pg"), ("job", "omA"), ("op", "allreduce"))
    # 1 MiB in 1 ms over 2 ranks: algbw 1.048576 GB/s, bus factor 2(n-1)/n = 1
    assert found[("scalemon_collective_busbw_gbps", op)] == pytest.approx(1.048576)
    assert found[("scalemon_collective_seconds_count", op)] == 10
    assert found[("scalemon_collective_seconds_sum", op)] == pytest.approx(0.01)
    assert found[("scalemon_collective_bytes_total", op)] == 10 << 20
    assert 0.0005 < found[("scalemon_collective_seconds", (*op, ("quantile", "0.5")))] < 0.002
    assert found[("scalemon_hang", (("job", "omA"),))] == 0
    assert found[("scalemon_alerts", (("job", "omA"), ("kind", "loss_not_finite")))] == 1
    assert found[("scalemon_alerts", (("job", "omA"), ("kind", "skipped_steps")))] == 0
    assert found[("scalemon_world_size", (("job", "omA"),))] == 2

    # the plain scrape: no rank's series, the node's and the job's aggregates
    plain = samples(scrape(base))
    assert not any("rank" in dict(labels) for _, labels in plain)
    node = (("job", "omA"), ("node", host))
    assert plain[("scalemon_node_step", (*node, ("stat", "max")))] == 5
    assert plain[("scalemon_node_step_time_seconds", (*node, ("stat", "mean")))] == 0.375
    assert plain[("scalemon_job_step_time_seconds", (("job", "omA"), ("stat", "min")))] == 0.25
    assert math.isnan(plain[("scalemon_node_loss", (*node, ("stat", "min")))])  # rank 1's NaN
    assert plain[("scalemon_node_ranks", (*node, ("state", "running")))] == 2
    assert plain[("scalemon_collective_bytes_total", op)] == 10 << 20

    # Prometheus may ask for OpenMetrics proper: the strict OpenMetrics parser reads it
    request = urllib.request.Request(url, headers={
        "Accept": "application/openmetrics-text; version=1.0.0"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("application/openmetrics-text")
        strict = {f.name: f for f in openmetrics_families(reply.read().decode())}
    assert {"scalemon_loss", "scalemon_collective_seconds", "scalemon_collective_bytes"} <= \
        set(strict)
    request = urllib.request.Request(base, headers={
        "Accept": "application/openmetrics-text; version=1.0.0", "Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.headers["Content-Encoding"] == "gzip"
        strict = {f.name: f for f in openmetrics_families(gzip.decompress(reply.read()).decode())}
    assert {"scalemon_node_loss", "scalemon_job_loss", "scalemon_collective_seconds"} <= \
        set(strict)
    assert "scalemon_loss" not in strict

    listed = subprocess.run([sys.executable, "-m", "scalemon", "jobs", "--json"],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert [j["metrics_url"] for j in json.loads(listed.stdout)] == [base]


def test_scrapes_while_ranks_join_and_step_all_parse(start_hub, zctx, home):
    """The HTTP threads never read the state the loop changes (ranks appearing mid-scrape):
    every scrape parses, and the last one has every rank."""
    hub = start_hub("omR", "--metrics", "127.0.0.1:0", "--world-size", "64")
    url = job_file(home, "omR").metrics_url + "?ranks=all"
    ranks = [FakeRank(zctx, hub.address, "omR", r) for r in range(64)]
    scrapes = 0
    for rank in ranks:
        rank.hello(world_size=64)
        for step in range(1, 21):
            rank.step(step, loss=1.0 / step)
        if rank.rank % 4 == 0:
            assert samples(scrape(url))  # parses (a broken text raises)
            scrapes += 1
    assert scrapes == 16

    def all_ranks() -> dict | None:
        found = samples(scrape(url))
        steps = {r: rank_value(found, "scalemon_step", "omR", r) for r in range(64)}
        return found if set(steps.values()) == {20} else None

    found = wait_for(all_ranks, timeout=30)
    assert rank_value(found, "scalemon_loss", "omR", 63) == 0.05
    assert hub.proc.poll() is None


def rank_states(found: dict, job: str) -> dict[int, str]:
    """{rank: state} of the `scalemon_rank_state` samples of value 1."""
    out = {}
    for (name, labels), value in found.items():
        d = dict(labels)
        if name == "scalemon_rank_state" and d.get("job") == job and value == 1:
            assert int(d["rank"]) not in out, "one state per rank"
            out[int(d["rank"])] = d["state"]
    return out


def test_a_rank_whose_process_is_killed_reads_down_and_gone(start_hub, zctx, home, request):
    hub = start_hub("omL", "--metrics", ":0", "--lost-after", "0.5", "--world-size", "2")
    url = job_file(home, "omL").metrics_url
    assert url.startswith("http://127.0.0.1:")  # ":PORT" alone: loopback
    url += "?ranks=all"
    # rank 1's process: a real one on the hub's host, killed without an exit message
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    request.addfinalizer(victim.kill)
    ranks = [FakeRank(zctx, hub.address, "omL", r) for r in (0, 1)]
    for rank, pid in zip(ranks, (None, victim.pid), strict=True):
        rank.hello(world_size=2, pid=pid)
        rank.step(1)

    def both_running() -> bool:
        for rank in ranks:
            rank.heartbeat()
        return rank_states(samples(scrape(url)), "omL") == {0: "running", 1: "running"}

    wait_for(both_running, timeout=20)
    victim.kill()
    victim.wait()

    def rank1_gone() -> dict | None:
        ranks[0].heartbeat()
        found = samples(scrape(url))
        return found if rank_states(found, "omL").get(1) == "gone" else None

    found = wait_for(rank1_gone, timeout=20)
    assert rank_value(found, "scalemon_rank_up", "omL", 1) == 0
    assert rank_value(found, "scalemon_rank_up", "omL", 0) == 1
    assert rank_states(found, "omL") == {0: "running", 1: "gone"}
    node = (("job", "omL"), ("node", os.uname().nodename))
    plain = samples(scrape(url.removesuffix("?ranks=all")))
    assert plain[("scalemon_node_ranks", (*node, ("state", "gone")))] == 1
    assert plain[("scalemon_ranks", (("job", "omL"), ("state", "running")))] == 1


def test_the_rank_state_family_says_the_hubs_word_for_each_rank():
    state = JobState(job="x")
    for r in range(6):
        state.apply(Message("hello", "x", r, 0, 100.0, {"host": "h", "pid": 10 + r,
                                                        "world_size": 6, "local_rank": r}))
    for seq, (r, word) in enumerate({1: "frozen", 2: "gone", 3: "unreachable", 4: "silent",
                                     5: "lost"}.items(), 1):  # lost: a hub before 1.12
        state.apply(Message("rank_state", "x", HUB_RANK, seq, 101.0,
                            {"target": r, "state": word, "reason": "no message for 5 s"}))
    by_name = {f.name: f for f in families(state, "x", now=102.0)}
    states = {s.labels["rank"]: s.labels["state"] for s in by_name["scalemon_rank_state"].samples
              if s.value == 1}
    assert states == {"0": "running", "1": "frozen", "2": "gone", "3": "unreachable",
                      "4": "silent", "5": "silent"}
    up = {s.labels["rank"]: s.value for s in by_name["scalemon_rank_up"].samples}
    assert up == {"0": 1, **{str(r): 0 for r in range(1, 6)}}
    doc = by_name["scalemon_rank_state"].documentation
    assert all(word in doc for word in SILENT_RANK_STATES) and "lost" not in doc
    assert "lost" not in by_name["scalemon_rank_up"].documentation


def test_scalemon_help_names_the_metrics_variables():
    out = subprocess.run([sys.executable, "-m", "scalemon", "--help"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "COLUMNS": "100"})
    env_part = out.stdout[out.stdout.index("environment variables:"):]
    for var in ("SCALEMON_METRICS", "SCALEMON_METRICS_FILE", "SCALEMON_METRICS_PER_RANK"):
        assert re.search(rf"^  {var}\s+\S", env_part, re.M), var


def test_metrics_file_is_written_atomically_for_the_textfile_collector(start_hub, zctx, home,
                                                                       monkeypatch):
    monkeypatch.setenv("SCALEMON_METRICS_PER_RANK", "1")  # the file: every rank's series too
    out = home / "prom"
    out.mkdir()
    path = out / "scalemon.prom"
    hub = start_hub("omF", "--metrics-file", str(path), "--world-size", "2")
    assert job_file(home, "omF").metrics_url is None  # no HTTP asked for
    feed(zctx, hub, "omF")

    def written() -> dict | None:
        if not path.exists():
            return None
        found = samples(path.read_text())
        return found if rank_value(found, "scalemon_step", "omF", 1) == 5 else None

    found = wait_for(written, timeout=30)
    assert rank_value(found, "scalemon_loss", "omF", 0) == 2.5
    assert math.isnan(rank_value(found, "scalemon_loss", "omF", 1))
    hub.kill(15)  # SIGTERM: the file keeps the final state
    assert rank_value(samples(path.read_text()), "scalemon_step", "omF", 0) == 5
    # no temporary left (while the hub runs, a render may be writing one)
    assert sorted(p.name for p in out.iterdir()) == ["scalemon.prom"]


def _hub_cmd(home: Path, job: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "scalemon.hub", "--job", job, "--home", str(home), *args]


def test_a_port_in_use_stops_the_hub_with_the_address(home):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(_hub_cmd(home, "omP", "--metrics", f"127.0.0.1:{port}"),
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr
    bad = subprocess.run(_hub_cmd(home, "omP", "--metrics", "localhost:http"),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "expected HOST:PORT" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


def test_the_environment_asks_for_metrics_and_a_busy_port_only_logs(start_hub, home,
                                                                    monkeypatch):
    monkeypatch.setenv("SCALEMON_METRICS", "127.0.0.1:0")
    start_hub("omE")
    assert job_file(home, "omE").metrics_url.startswith("http://127.0.0.1:")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setenv("SCALEMON_METRICS", f"127.0.0.1:{port}")
        hub = start_hub("omB")  # serves on without metrics
        assert job_file(home, "omB").metrics_url is None
        assert f"cannot serve metrics on 127.0.0.1:{port}" in hub.log.read_text()


@pytest.mark.parametrize(("text", "expected"), [
    (":9464", ("127.0.0.1", 9464)), ("9464", ("127.0.0.1", 9464)),
    ("0.0.0.0:0", ("0.0.0.0", 0)), ("[::1]:80", ("::1", 80)), ("node7:9", ("node7", 9)),
])
def test_metrics_addresses(text, expected):
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["", "host:", "host:99999", "host:port"])
def test_bad_metrics_addresses_say_what_is_expected(text):
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        parse_address(text)


def exported_names(per_rank: bool = True) -> set[str]:
    """Every sample name the exporter can produce (counters' _total, summaries' _sum/_count),
    with or without the per-rank series."""
    suffixes = {"counter": ("_total",), "summary": ("", "_sum", "_count"), "gauge": ("",)}
    return {f.name + s for f in families(JobState(job="x"), "x", per_rank=per_rank)
            for s in suffixes[f.type]}


def test_every_gauge_reads_a_known_metric_and_the_issue_names_are_there():
    assert exported_names() >= ISSUE_FAMILIES
    from scalemon.metrics import BY_NAME
    assert all(g.source in BY_NAME for g in RANK_GAUGES)


def test_the_grafana_dashboard_queries_only_exported_metrics():
    board = json.loads((REPO / "contrib" / "grafana-scalemon.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    queried = {n for e in exprs for n in re.findall(r"\bscalemon_[a-z_]+", e)}
    assert queried - exported_names(per_rank=False) == set()  # drawn by a default scrape
    assert {"scalemon_node_loss", "scalemon_collective_busbw_gbps", "scalemon_ranks",
            "scalemon_hang"} <= queried


def collectives_seen(home: Path, job: str) -> dict[int, dict[str, object]]:
    """Per rank, what its `collectives` messages in the job's history said: how many, the
    groups listed with their members, issues sent, and (group, seq) issued by every rank."""
    messages, _ = read_messages(history_path(job, home))
    per_rank: dict[int, dict[str, object]] = {}
    issued: dict[int, set] = {}
    for m in messages:
        if m.type != "collectives" or m.rank == HUB_RANK:
            continue
        row = per_rank.setdefault(m.rank, {"messages": 0, "groups": {}, "issues": 0})
        row["messages"] += 1
        for name, group in (m.body.get("groups") or {}).items():
            row["groups"][name] = group.get("ranks")
        row["issues"] += len(m.body.get("issues") or [])
        issued.setdefault(m.rank, set()).update(
            (i[0], i[1]) for i in m.body.get("issues") or [])
    common = set.intersection(*issued.values()) if issued else set()
    return {**per_rank, "issued_by_all": len(common)}


@pytest.mark.integration
def test_a_monitored_demo_is_scraped_with_every_rank(home):
    env = os.environ.copy()
    env.update(SCALEMON_HOME=str(home), SCALEMON_JOB_ID="omD", OMP_NUM_THREADS="1",
               SCALEMON_HUB_ARGS="--linger 30", SCALEMON_METRICS="127.0.0.1:0")
    log = home / "omD.out"
    with open(log, "w") as out:
        job = subprocess.Popen(torchrun_cmd("--monitor", "--max-steps", "100000"), env=env,
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        path = jobs_dir(home) / "omD.json"
        url = wait_for(lambda: path.exists() and JobFile.read(path).metrics_url, timeout=120)
        url += "?ranks=all"

        seen: dict[str, object] = {}

        def both_stepping() -> tuple[str, dict] | None:
            assert job.poll() is None, log.read_text()
            text = scrape(url)
            found = samples(text)
            steps = [rank_value(found, "scalemon_step", "omD", r) for r in (0, 1)]
            late = [rank_value(found, "scalemon_arrival_lateness_seconds", "omD", r)
                    for r in (0, 1)]
            busbw = any(name == "scalemon_collective_busbw_gbps" for name, _ in found)
            seen.update(steps=steps, lateness=late, busbw=busbw)
            done = all(s and s >= 3 for s in steps) and None not in late and busbw
            return (text, found) if done else None

        try:
            text, found = wait_for(both_stepping, timeout=180, interval=0.5)
        except AssertionError as exc:  # say what the hub had, to tell where the ranks' went
            raise AssertionError(f"{exc}; last scrape: {seen}; the history's collectives: "
                                 f"{collectives_seen(home, 'omD')}") from None
    finally:
        kill_tree(job)
    declared = {f.name for f in text_string_to_metric_families(text)}
    assert declared >= ISSUE_FAMILIES, ISSUE_FAMILIES - declared
    # what a CPU rank measures, for every rank (MFU, memory, GPU and loss scale need a GPU/AMP)
    for rank in (0, 1):
        assert rank_value(found, "scalemon_rank_up", "omD", rank) == 1
        assert rank_value(found, "scalemon_loss", "omD", rank) > 0
        assert rank_value(found, "scalemon_step_time_seconds", "omD", rank) > 0
        assert rank_value(found, "scalemon_tokens_per_second", "omD", rank) > 0
        assert rank_value(found, "scalemon_arrival_lateness_seconds", "omD", rank) >= 0
    op = next(dict(labels) for name, labels in found if name == "scalemon_collective_seconds_count")
    assert op["job"] == "omD" and op["group"] and op["op"]
    assert found[("scalemon_hang", (("job", "omD"),))] == 0
