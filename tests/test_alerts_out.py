"""Alerts out (`$SCALEMON_ALERT_CMD`, hub/alerts_out.py): a real hub runs the owner's command
with each alert as JSON on stdin, rate-limited, killed after its timeout, audited; the rules
for stragglers, memory, hangs and the global cap on a folded job state."""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import FakeRank, wait_for
from scalemon.home.history import run_dir
from scalemon.hub.alerts_out import (
    ALERT_CMD_ENV,
    KINDS,
    PER_MINUTE,
    RANK_KINDS,
    STRAGGLER_STEPS,
    AlertsOut,
)
from scalemon.link.client import HubClient
from scalemon.protocol import HUB_RANK, SILENT_RANK_STATES, Message
from scalemon.state.jobstate import JobState

APPEND = "import sys\nwith open(sys.argv[1], 'a') as f:\n    f.write(sys.stdin.read())\n"
HANG = ("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\n"
        "time.sleep(120)\n")


def alert_cmd(tmp_path: Path, script: str, out: Path) -> str:
    path = tmp_path / "alert_cmd.py"
    path.write_text(script)
    return shlex.join([sys.executable, str(path), str(out)])


def alerts_in(path: Path, kind: str | None = None) -> list[dict]:
    if not path.exists():
        return []
    found = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [a for a in found if kind is None or a["kind"] == kind]


def audit(home: Path, job: str) -> list[dict]:
    path = run_dir(job, home) / "toggles.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def beating(rank: FakeRank, predicate, timeout: float = 15.0):
    """Wait for `predicate` while `rank` keeps sending heartbeats (so it is not lost)."""
    def check():
        rank.heartbeat()
        return predicate()
    return wait_for(check, timeout=timeout, interval=0.2)


def hub_alerts(hub) -> list:
    client = HubClient(hub.address, timeout_s=5)
    try:
        return client.state()["state"]["alerts"]
    finally:
        client.close()


def test_nan_alert_runs_the_command_once_rate_limited_then_rank_gone(
        start_hub, zctx, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        request: pytest.FixtureRequest) -> None:
    out = tmp_path / "alerts.jsonl"
    monkeypatch.setenv(ALERT_CMD_ENV, alert_cmd(tmp_path, APPEND, out))
    hub = start_hub("alertA", "--lost-after", "3")
    ranks = [FakeRank(zctx, hub.address, "alertA", r) for r in range(2)]
    # rank 1's process: a real one on the hub's host, killed below without an exit message
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    request.addfinalizer(victim.kill)
    ranks[0].hello()
    ranks[1].hello(pid=victim.pid)
    ranks[0].step(1, loss=math.nan)
    [alert] = beating(ranks[0], lambda: alerts_in(out, "loss_not_finite"))
    assert (alert["rank"], alert["step"], alert["job"], alert["value"]) == (0, 1, "alertA", None)
    assert "loss is NaN on rank 0" in alert["text"] and alert["host"]  # null value: text says

    ranks[0].step(2, loss=1.0)  # the alert clears, then comes back within the minute
    beating(ranks[0], lambda: not hub_alerts(hub))
    ranks[0].step(3, loss=math.nan)
    beating(ranks[0], lambda: [e for e in audit(home, "alertA") if e["event"] == "alert"
                               and e["kind"] == "loss_not_finite" and e["sent"] is False])
    victim.kill()
    victim.wait()
    [gone] = beating(ranks[0], lambda: alerts_in(out, "rank_gone"))  # its process ended
    assert gone["rank"] == 1 and gone["text"].startswith(
        f"rank 1 gone: process {victim.pid} ended without reporting an exit")
    assert len(alerts_in(out, "loss_not_finite")) == 1

    entries = audit(home, "alertA")
    sent = sorted((e["kind"], e["rank"]) for e in entries if e["event"] == "alert" and e["sent"])
    assert sent == [("loss_not_finite", 0), ("rank_gone", 1)]
    suppressed = next(e for e in entries if e["event"] == "alert" and not e["sent"])
    assert "at most one per 60 s" in suppressed["why"]
    beating(ranks[0], lambda: len([e for e in audit(home, "alertA")
                                   if e["event"] == "alert command"
                                   and e.get("outcome") == "exited"]) == 2)
    assert all(e["exit_code"] == 0 for e in audit(home, "alertA")
               if e.get("outcome") == "exited")


def test_a_command_that_hangs_is_killed_and_the_hub_serves_on(
        start_hub, zctx, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pid_file = tmp_path / "pid"
    monkeypatch.setenv(ALERT_CMD_ENV, alert_cmd(tmp_path, HANG, pid_file))
    hub = start_hub("alertB", "--lost-after", "60")
    rank = FakeRank(zctx, hub.address, "alertB", 0)
    rank.hello(world_size=1)
    rank.step(1, loss=math.inf)
    pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text()))
    assert psutil.pid_exists(pid)
    rank.step(2, loss=math.inf)  # the hub takes messages and answers while the command hangs
    assert hub_alerts(hub)[0]["kind"] == "loss_not_finite"
    killed = wait_for(lambda: [e for e in audit(home, "alertB")
                               if e["event"] == "alert command"
                               and e.get("outcome", "").startswith("killed")], timeout=30)
    assert "10 s timeout" in killed[0]["outcome"] and killed[0]["kind"] == "loss_not_finite"
    assert not psutil.pid_exists(pid)
    assert hub_alerts(hub)[0]["kind"] == "loss_not_finite"  # still serving


def test_a_command_line_that_does_not_split_is_said_and_the_hub_runs(
        start_hub, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALERT_CMD_ENV, "notify 'unclosed")
    hub = start_hub("alertC")
    assert hub_alerts(hub) == []
    [refused] = [e for e in audit(home, "alertC") if e["event"] == "alert command refused"]
    assert "is not a command line" in refused["why"]


# --- the rules, on a folded state -----------------------------------------------------------
class Book:
    """An audit that keeps its entries."""

    def __init__(self) -> None:
        self.entries: list[dict] = []

    def write(self, entry: dict) -> None:
        self.entries.append(entry)


def _state(ranks: int = 2, t: float | None = None) -> JobState:
    state = JobState(job="unit")
    t = time.time() if t is None else t
    for r in range(ranks):
        state.apply(Message("hello", "unit", r, 0, t, {"host": "h", "pid": 100 + r,
                                                       "world_size": ranks, "local_rank": r}))
    return state


def _step(state: JobState, rank: int, step: int, t: float) -> None:
    state.apply(Message("step", "unit", rank, step + 1, t,
                        {"step": step, "loss": 1.0, "step_time_s": 0.1}))


def test_straggler_for_n_steps_memory_and_hang() -> None:
    sent: list[dict] = []
    book = Book()
    state = _state()
    out = AlertsOut("unit", book, sent.append, state)
    now = 0.0
    for step in range(1, STRAGGLER_STEPS + 3):
        for r in (0, 1):
            _step(state, r, step, time.time())
        state.ranks[1].compute_over_median_s = 0.05  # over the 10 ms bar, every step
        now += 1.1
        out.check(state, now)
    stragglers = [a for a in sent if a["kind"] == "straggler"]
    assert [(a["rank"], a["step"], a["since_step"]) for a in stragglers] == [
        (1, STRAGGLER_STEPS + 1, 1)]

    state.apply(Message("heartbeat", "unit", 0, 99, time.time(),
                        {"gpu_mem_total_bytes": 100, "gpu_mem_used_bytes": 90}))
    now += 1.1
    out.check(state, now)
    assert not [a for a in sent if a["kind"] == "memory"]
    state.apply(Message("heartbeat", "unit", 0, 100, time.time(),
                        {"gpu_mem_total_bytes": 100, "gpu_mem_used_bytes": 96}))
    now += 1.1
    out.check(state, now)
    [memory] = [a for a in sent if a["kind"] == "memory"]
    assert memory["rank"] == 0 and memory["value"] == 0.96 and "96%" in memory["text"]

    old = _state(t=time.time() - 100)  # no step for 100 s: hung
    _step(old, 0, 1, time.time() - 100)
    _step(old, 1, 1, time.time() - 100)
    sent.clear()
    AlertsOut("unit", book, sent.append).check(old, 0.0)
    [hang] = [a for a in sent if a["kind"] == "hang"]
    assert hang["rank"] is None and hang["text"].startswith("job hung")
    quiet: list[dict] = []
    AlertsOut("unit", book, quiet.append, old).check(old, 0.0)  # primed: fired long ago
    assert quiet == []


def test_global_cap_suppresses_and_the_next_alert_says_how_many() -> None:
    sent: list[dict] = []
    book = Book()
    state = _state(ranks=PER_MINUTE + 2)
    out = AlertsOut("unit", book, sent.append, state)
    for r in range(PER_MINUTE + 2):
        state.apply(Message("rank_state", "unit", HUB_RANK, r, time.time(),
                            {"target": r, "state": "gone", "reason": "killed?"}))
    fired = out.check(state, 10.0)
    assert len(fired) == PER_MINUTE + 2 and len(sent) == PER_MINUTE
    held = [e for e in book.entries if e["event"] == "alert" and not e["sent"]]
    assert len(held) == 2 and all("in the last minute" in e["why"] for e in held)
    state.apply(Message("step", "unit", 0, 50, time.time(), {"step": 5, "loss": math.nan}))
    out.check(state, 75.0)
    assert sent[-1]["kind"] == "loss_not_finite" and sent[-1]["suppressed"] == 2


def test_a_rank_that_stops_sending_alerts_by_the_hubs_word() -> None:
    """One alert kind per word (`rank_frozen`, `rank_gone`, `rank_unreachable`,
    `rank_silent`), its text the word and why: a frozen rank's where-text when known."""
    sent: list[dict] = []
    state = _state(ranks=5)
    out = AlertsOut("unit", Book(), sent.append, state)
    where = ("frozen in native code holding the GIL: sleep <- freeze_holding_the_gil() at "
             "faults.py:11")
    said = [(0, {"state": "frozen", "reason": "no message for 5.0 s", "where": where,
                 "process": {"pid": 100, "exists": True, "state_word": "sleeping"}}),
            (1, {"state": "gone", "reason": "process 101 ended without reporting an exit"}),
            (2, {"state": "unreachable", "reason": "its node's relay is silent"}),
            (3, {"state": "silent", "reason": "no reader on its node"}),
            (4, {"state": "lost", "reason": "no message for 5.0 s"})]  # a hub before 1.12
    for seq, (rank, body) in enumerate(said):
        state.apply(Message("rank_state", "unit", HUB_RANK, seq, time.time(),
                            {"target": rank, **body}))
    out.check(state, 10.0)
    assert [(a["kind"], a["rank"], a["text"]) for a in sent] == [
        ("rank_frozen", 0, f"rank 0 frozen: {where}"),
        ("rank_gone", 1, "rank 1 gone: process 101 ended without reporting an exit"),
        ("rank_unreachable", 2, "rank 2 unreachable: its node's relay is silent"),
        ("rank_silent", 3, "rank 3 silent: no reader on its node"),
        ("rank_silent", 4, "rank 4 silent: no message for 5.0 s")]
    assert not [k for k in KINDS if "lost" in k]
    assert {RANK_KINDS[w] for w in SILENT_RANK_STATES} <= set(KINDS)

    sent.clear()  # the frozen rank's process is killed: a new word, a new alert
    state.apply(Message("rank_state", "unit", HUB_RANK, 10, time.time(),
                        {"target": 0, "state": "gone",
                         "reason": "process 100 ended after it froze without reporting an exit"}))
    out.check(state, 20.0)
    assert [(a["kind"], a["rank"]) for a in sent] == [("rank_gone", 0)]


def test_a_frozen_rank_that_speaks_again_and_freezes_again_alerts_twice() -> None:
    sent: list[dict] = []
    state = _state(ranks=2)
    out = AlertsOut("unit", Book(), sent.append, state)

    def freeze(seq: int) -> None:
        state.apply(Message("rank_state", "unit", HUB_RANK, seq, time.time(),
                            {"target": 1, "state": "frozen", "reason": "no message for 5 s"}))

    freeze(0)
    out.check(state, 10.0)
    out.check(state, 20.0)  # still frozen: nothing new
    assert [a["kind"] for a in sent] == ["rank_frozen"]
    assert sent[0]["text"] == "rank 1 frozen: no message for 5 s"  # no where-text yet
    _step(state, 1, 7, time.time())  # it speaks again: running
    assert state.ranks[1].state == "running"
    out.check(state, 30.0)
    freeze(1)
    out.check(state, 100.0)  # past the per-rank limit of one a minute
    assert [a["kind"] for a in sent] == ["rank_frozen", "rank_frozen"]
