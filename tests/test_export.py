"""`scalemon export`: a monitored demo's history as a Perfetto trace and as JSON lines, from
its live hub and from its history file once the hub is gone; the trace checked against the
Trace Event Format's rules (and by Perfetto's trace processor where its binary is at hand)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import psutil
import pytest
from test_e2e import job_env

from conftest import torchrun_cmd, wait_for
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir
from scalemon.protocol import HUB_RANK, Message
from scalemon.reports import export

RANK_NAME = re.compile(r"^rank (\d+) \((.+)\)$")


def check_trace_rules(doc: dict) -> dict[int, str]:
    """Assert the Trace Event Format rules Perfetto's JSON importer relies on; returns the
    process names by pid. Every event has ph/ts/pid/tid (metadata too), X events a dur >= 0,
    slices of one thread do not overlap, every flow id has one start and one finish, each
    inside an X slice of its own thread, and every process is named as one rank."""
    assert isinstance(doc["traceEvents"], list)
    names: dict[int, str] = {}
    slices: dict[tuple[int, int], list[tuple[float, float]]] = {}
    flows: dict[int, list[dict]] = {}
    for e in doc["traceEvents"]:
        for key in ("ph", "ts", "pid", "tid"):
            assert key in e, (key, e)
        assert isinstance(e["ts"], (int, float)) and math.isfinite(e["ts"]), e
        assert e["pid"] > 0 and e["tid"] > 0, e  # 0: Perfetto's idle process and thread
        if e["ph"] == "M" and e["name"] == "process_name":
            names[e["pid"]] = e["args"]["name"]
        elif e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
            slices.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
        elif e["ph"] in ("s", "f"):
            flows.setdefault(e["id"], []).append(e)
    for spans in slices.values():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert start >= end - 1e-3, f"overlapping slices on one thread: {spans}"
    for flow_id, ends in flows.items():
        assert sorted(e["ph"] for e in ends) == ["f", "s"], (flow_id, ends)
        for e in ends:
            spans = slices.get((e["pid"], e["tid"]), [])
            assert any(a <= e["ts"] <= b for a, b in spans), f"flow end outside a slice: {e}"
        start, finish = sorted(ends, key=lambda e: e["ph"], reverse=True)
        assert start["ts"] <= finish["ts"] + 1e-3
    ranks = [RANK_NAME.match(n) for n in names.values()]
    assert all(ranks), names
    assert len({int(m.group(1)) for m in ranks}) == len(names), "one process per rank"
    return names


def run_export(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scalemon", "export", *args],
                          env=job_env(home, "unused"), capture_output=True, text=True,
                          timeout=120)


@pytest.mark.integration
def test_demo_export_live_and_after_the_hub(home: Path, tmp_path: Path) -> None:
    job = "exp1"
    done = subprocess.run(torchrun_cmd("--preset", "tiny", "--batch-size", "2", "--max-steps",
                                       "20", "--monitor"),
                          env=job_env(home, job), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    live = run_export(home, job, "--perfetto", str(tmp_path / "t.json"), "--jsonl",
                      str(tmp_path / "r.jsonl"))
    assert live.returncode == 0, live.stderr
    assert "ipc://" in live.stderr  # from the lingering hub
    records = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert all(tuple(r) == export.JSONL_FIELDS for r in records)
    assert [r["record"] for r in records] == list(range(len(records)))
    kinds = Counter(r["type"] for r in records)
    assert kinds["step"] == 40 and kinds["exit"] == 2 and kinds["collectives"] >= 2, kinds

    doc = json.loads((tmp_path / "t.json").read_text())
    names = check_trace_rules(doc)
    assert sorted(names.values()) == [f"rank {r} ({h})" for r, h in sorted(
        (r["rank"], r["body"]["host"]) for r in records if r["type"] == "hello")]
    pid_of = {int(RANK_NAME.match(n).group(1)): pid for pid, n in names.items()}
    events = doc["traceEvents"]
    for rank in (0, 1):
        timed = [r for r in records if r["type"] == "step" and r["rank"] == rank
                 and r["body"]["step_time_s"] is not None]
        steps = [e for e in events if e["ph"] == "X" and e["cat"] == "steps"
                 and e["pid"] == pid_of[rank]]
        assert len(steps) == len(timed) >= 19  # the first step of a process has no time
        assert sorted(e["args"]["step"] for e in steps) == sorted(r["body"]["step"]
                                                                   for r in timed)
        opt = [e for e in events if e["ph"] == "X" and e["cat"] == "optimizer"
               and e["pid"] == pid_of[rank]]
        assert len(opt) == 20
    issued = {(r["rank"], g, s) for r in records if r["type"] == "collectives"
              for g, s, _ in r["body"]["issues"]}
    coll = [e for e in events if e["ph"] == "X" and e["cat"] == "collective"]
    assert len(coll) == len(issued) > 0
    both = {(g, s) for _, g, s in issued if (0, g, s) in issued and (1, g, s) in issued}
    assert both, "gloo's Flight Recorder saw no collective of both ranks"
    starts = [e for e in events if e["ph"] == "s"]
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    linked = {(s["args"]["group"], s["args"]["seq"]) for s in starts
              if {s["pid"], finishes[s["id"]]["pid"]} == {pid_of[0], pid_of[1]}}
    assert linked == both  # every collective both ranks issued has its arrow across them

    hub_pid = JobFile.read(jobs_dir(home) / f"{job}.json").pid
    os.kill(hub_pid, signal.SIGTERM)
    wait_for(lambda: not psutil.pid_exists(hub_pid), timeout=30)
    offline = run_export(home, job, "--jsonl", str(tmp_path / "gone.jsonl"), "--perfetto",
                         str(tmp_path / "gone.json"))
    assert offline.returncode == 0, offline.stderr
    assert "history" in offline.stderr  # read from the file, not a hub
    gone = [json.loads(line) for line in (tmp_path / "gone.jsonl").read_text().splitlines()]
    rank_records = [r for r in gone if r["rank"] != HUB_RANK]
    assert rank_records == [r for r in records if r["rank"] != HUB_RANK]
    check_trace_rules(json.loads((tmp_path / "gone.json").read_text()))


def _msg(mtype: str, rank: int, seq: int, t: float, body: dict) -> Message:
    return Message(mtype, "hand", rank, seq, t, body)


def _two_host_history() -> list[tuple[int, Message]]:
    """Ranks 0 (host a, clock right) and 1 (host b, clock 5 s behind the hub's), one step each
    and one collective issued by both at the same true time; rank 1's loss is NaN."""
    msgs = []
    for rank, host, skew in ((0, "a", 0.0), (1, "b", -5.0)):
        base = 1000.0 + skew
        msgs += [
            _msg("hello", rank, 0, base, {"host": host, "pid": 10 + rank, "world_size": 2,
                                          "local_rank": 0}),
            _msg("heartbeat", rank, 1, base + 0.1, {"clock_offset_s": -skew}),
            _msg("step", rank, 2, base + 2.0, {"step": 1, "step_time_s": 1.0,
                                               "loss": math.nan if rank else 1.5,
                                               "optimizer_time_s": 0.1}),
            _msg("collectives", rank, 3, base + 2.1, {
                "groups": {"0": {"desc": "default_pg", "ranks": [0, 1]}}, "stats": [],
                "issues": [["0", 1, base + 1.5 + 0.01 * rank]]}),
        ]
    msgs.append(_msg("rank_state", HUB_RANK, 0, 1003.0, {"target": 1, "state": "lost"}))
    return list(enumerate(msgs))


def test_hand_built_trace_lines_up_clocks_and_links_collectives() -> None:
    doc = export.trace(_two_host_history(), "hand")
    names = check_trace_rules(doc)
    assert sorted(names.values()) == ["rank 0 (a)", "rank 1 (b)"]
    x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    steps = {e["pid"]: e for e in x if e["cat"] == "steps"}
    assert steps[1]["ts"] == steps[2]["ts"] == 0.0  # rank 1's clock corrected by 5 s
    assert steps[1]["dur"] == 1e6
    opt = {e["pid"]: e for e in x if e["cat"] == "optimizer"}
    assert opt[1]["ts"] == 0.9e6 and opt[1]["dur"] == 0.1e6  # at the end of its step
    coll = {e["pid"]: e for e in x if e["cat"] == "collective"}
    assert coll[1]["ts"] == 0.5e6 and coll[2]["ts"] == pytest.approx(0.51e6)
    assert coll[1]["dur"] == pytest.approx(0.01e6)  # until the last rank issued it
    assert coll[1]["name"] == "default_pg #1"
    s = next(e for e in doc["traceEvents"] if e["ph"] == "s")
    f = next(e for e in doc["traceEvents"] if e["ph"] == "f")
    assert (s["pid"], f["pid"], f["bp"]) == (1, 2, "e")
    assert steps[2]["args"]["loss"] is None  # NaN: strict JSON
    json.dumps(doc, allow_nan=False)
    lines = [json.loads(line) for line in export.jsonl_lines(_two_host_history())]
    assert lines[6]["body"]["loss"] is None and lines[6]["t"] == 997.0
    assert export.strict_json({1: b"\x01\xff", "x": (math.inf,)}) == {"1": "01ff", "x": [None]}


def _trace_processor_binary() -> str | None:
    """Perfetto's trace_processor_shell, where one is at hand: $SCALEMON_TRACE_PROCESSOR, or
    the one the `perfetto` package downloaded earlier (it downloads on first use: no network
    in tests)."""
    given = os.environ.get("SCALEMON_TRACE_PROCESSOR")
    if given:
        return given
    cached = sorted(Path.home().glob(".local/share/perfetto/prebuilts/trace_processor_shell*"))
    return str(cached[-1]) if cached and not cached[-1].name.endswith(".tmp") else None


def test_perfetto_trace_processor_loads_it(tmp_path: Path) -> None:
    pytest.importorskip("perfetto", reason="the perfetto package is not installed")
    binary = _trace_processor_binary()
    if binary is None:
        pytest.skip("no trace_processor_shell here (the perfetto package downloads it from "
                    "commondatastorage.googleapis.com on first use; set "
                    "SCALEMON_TRACE_PROCESSOR=PATH to one)")
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    path = tmp_path / "t.json"
    path.write_text(json.dumps(export.trace(_two_host_history(), "hand")))
    tp = TraceProcessor(trace=str(path), config=TraceProcessorConfig(bin_path=binary))
    try:
        names = sorted(r.name for r in tp.query("select name from process where name "
                                                 "like 'rank %'"))
        assert names == ["rank 0 (a)", "rank 1 (b)"]
        assert len(list(tp.query("select id from flow"))) == 1
        assert len(list(tp.query("select id from slice where name like 'step %'"))) == 2
    finally:
        tp.close()


def test_export_says_what_is_wrong(home: Path, tmp_path: Path) -> None:
    out = run_export(home, "nojob", "--jsonl", str(tmp_path / "x"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "no live hub for job 'nojob'" in out.stderr and "history" in out.stderr
    out = run_export(home, "nojob")
    assert out.returncode == 2 and "--perfetto FILE and/or --jsonl FILE" in out.stderr
    out = run_export(home, "ipc:///nowhere/x", "--jsonl", str(tmp_path / "x"),
                     "--timeout", "1")
    assert out.returncode == 2 and "Traceback" not in out.stderr and "no answer" in out.stderr
