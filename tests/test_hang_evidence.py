"""A hang named right as its evidence arrives (issue #40): a stuck rank's agent sends its stack
and collectives in flight once (protocol 1.14: later heartbeats name them in `same`), the hub
keeps them, and the hub's hang report is made again as newer heartbeats come, its alert updated
until it names the rank that holds the others up. Real hubs, real ZeroMQ."""

from __future__ import annotations

import json
import shlex
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from conftest import FakeRank, hub_messages, wait_for
from scalemon import protocol
from scalemon.hub.alerts_out import ALERT_CMD_ENV, REMAKE_S
from scalemon.link.client import HubClient
from scalemon.protocol import Message
from scalemon.state.jobstate import JobState

APPEND = "import sys\nwith open(sys.argv[1], 'a') as f:\n    f.write(sys.stdin.read())\n"
WAITING_STACK = '  File "train.py", line 9, in step\n    loss.backward()\n'
CULPRIT_STACK = '  File "train.py", line 4, in batches\n    next(loader)\n'


def hang_alerts(path: Path) -> list[dict]:
    if not path.exists():
        return []
    alerts = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [a for a in alerts if a["kind"] == "hang"]


def stuck_beat(rank: FakeRank, culprit: bool) -> None:
    """A heartbeat of a rank stuck after step 1: the culprit never issued all_reduce #2 (in
    Python), the others issued it and wait in it."""
    rank.send("heartbeat", {
        "phase": "python" if culprit else "collective", "dropped": 0,
        "groups": {"0": [1, 1] if culprit else [2, 1]},
        "inflight": None if culprit else [["0", 2, "all_reduce", time.time() - 2.0, 64]],
        "stack": CULPRIT_STACK if culprit else WAITING_STACK})


@pytest.mark.timeout(90)
def test_a_hub_that_first_hears_some_ranks_names_the_culprit_when_the_rest_arrive(
        start_hub, zctx: zmq.Context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks 0 and 1 are heard stuck first; ranks 2 and 3 only later (a hub behind, their
    heartbeats late). The first alert guesses (ranks 2 and 3, provisional: 2 ranks not heard
    since the hang began); once they are heard, an update names rank 3 alone, not provisional."""
    out = tmp_path / "alerts.jsonl"
    script = tmp_path / "append.py"
    script.write_text(APPEND)
    monkeypatch.setenv(ALERT_CMD_ENV, shlex.join([sys.executable, str(script), str(out)]))
    hub = start_hub("hangEv", "--hang-after", "2")
    ranks = [FakeRank(zctx, hub.address, "hangEv", r) for r in range(4)]
    for r in ranks:
        r.hello(world_size=4)
    ranks[0].send("collectives", {"groups": {"0": {"desc": "default_pg", "ranks": [0, 1, 2, 3]}},
                                  "stats": [], "issues": []})
    for r in ranks:
        r.send("heartbeat", {"phase": "forward", "dropped": 0, "groups": {"0": [1, 1]}})
        r.step(1)
    time.sleep(2.3)  # the hang threshold passes: only ranks 0 and 1 are heard stuck

    def beat(who: list[int]) -> None:
        for r in who:
            stuck_beat(ranks[r], culprit=r == 3)

    first = wait_for(lambda: beat([0, 1]) or hang_alerts(out), timeout=15, interval=0.3)[0]
    assert first["provisional"] is True and first["not_heard"] == 2, first
    assert first["ranks"] == [2, 3] and "provisional, 2 ranks not heard since" in first["text"]
    assert first["update"] == 0

    began = time.monotonic()
    final = wait_for(lambda: beat([0, 1, 2, 3]) or [a for a in hang_alerts(out)
                                                   if not a["provisional"]],
                     timeout=REMAKE_S + 15, interval=0.3)[0]
    took = time.monotonic() - began
    assert final["ranks"] == [3] and final["update"] >= 1, final
    assert final["text"].startswith(f"job hung (update {final['update']}): rank 3 never "
                                    "issued all_reduce #2 of default_pg [0-3]"), final["text"]
    assert took <= REMAKE_S + 5, took  # remade within its pace once the evidence is there

    client = HubClient(hub.address, timeout_s=10)
    try:
        hang = client.state()["state"]["hang"]
    finally:
        client.close()
    assert hang["culprits"] == [3] and hang["provisional"] is False and hang["not_heard"] == 0
    time.sleep(1.5)  # nothing new: no further alert
    assert len(hang_alerts(out)) == final["update"] + 1


@pytest.mark.timeout(90)
def test_a_stuck_agent_sends_its_stack_once_and_the_hub_keeps_it(
        start_hub, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real agent (`Run`) whose training thread stops calling `log()` for the hang threshold:
    over ZeroMQ its first stuck heartbeat carries its stack, the next ones name it in `same`,
    and the hub's state shows the stack all along; once the rank steps again the stack goes
    (null, sent as such)."""
    from scalemon.agent.run import Run

    monkeypatch.setenv("SCALEMON_HANG_AFTER", "1")
    hub = start_hub("stackOnce", "--hang-after", "1")
    run = Run(job="stackOnce", hub=hub.address.base, heartbeat_s=0.1)
    try:
        run.log(1, loss=1.0)
        wait_for(lambda: run.sender.hub_version == protocol.PROTOCOL_VERSION)
        run.log(2, loss=1.0)
        seen: list[str | None] = []

        def watch() -> None:  # the hub's view of rank 0 while the training thread is stuck
            client = HubClient(hub.address, timeout_s=10)
            try:
                end = time.monotonic() + 2.6  # inside the 3 s wait
                while time.monotonic() < end:
                    rank = client.state()["state"]["ranks"][0]
                    seen.append(rank.get("stack"))
                    time.sleep(0.2)
            finally:
                client.close()

        watcher = threading.Thread(target=watch)
        watcher.start()
        threading.Event().wait(3.0)  # stuck: one frame, one stack, for 3 s (threshold 1 s)
        watcher.join()
        run.log(3, loss=1.0)  # steps again
        time.sleep(0.5)
    finally:
        run.finish()
    beats = [m.body for m in hub_messages(hub) if m.type == "heartbeat"]
    with_stack = [b for b in beats if b.get("stack")]
    named_same = [b for b in beats if "stack" in (b.get("same") or ())]
    waiting = [b for b in with_stack if "threading.Event().wait(3.0)" in b["stack"]]
    assert len(waiting) == 1, [b.get("stack") for b in beats]  # the same stack: sent once
    # again only when it changed (the thread left the wait for the next line, still stuck)
    assert all(a["stack"] != b["stack"] for a, b in zip(with_stack, with_stack[1:], strict=False))
    assert len(with_stack) <= 2
    assert len(named_same) >= 8  # ~10 a second for ~2 s, none carrying it
    assert all("stack" not in b for b in named_same)
    first = beats.index(waiting[0])
    assert all(b.get("same") for b in beats[first + 1:first + 9])
    # the hub held it while it was not sent: every look after the first stuck beat shows it
    held = [s for s in seen if s]
    assert len(held) >= 5 and all(s == waiting[0]["stack"] for s in held)
    assert seen[-1] == waiting[0]["stack"]
    assert "stack" in beats[-1] and beats[-1]["stack"] is None  # null goes as null
    assert "stack" not in (beats[-1].get("same") or ())


def test_the_agent_leaves_values_out_only_for_a_hub_that_keeps_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole before the hub answered and for a 1.13 hub; for a 1.14 hub `same` from the second
    beat; whole again after a beat it dropped, and after `RESEND_S`."""
    from types import SimpleNamespace

    import scalemon.agent.heartbeat as heartbeat
    from scalemon.agent.heartbeat import Heartbeat, Phase
    from scalemon.agent.nvml import GpuReader

    fields = {"dropped": 0, "stack": WAITING_STACK, "groups": {"0": [2, 1]},
              "inflight": [["0", 2, "all_reduce", 1.0, 64]], "p2p_inflight": None}
    hub = SimpleNamespace(hub_version=None)
    accept = [True]
    sent: list[dict] = []
    beat = Heartbeat(Phase(), GpuReader(), lambda _, body: sent.append(body) or accept[0],
                     lambda: dict(fields), interval_s=60, hub=hub)
    try:
        def names() -> tuple[set[str], list[str]]:
            body = beat.beat()
            return {n for n in ("stack", "groups", "inflight", "p2p_inflight") if n in body}, \
                body.get("same", [])

        whole = ({"stack", "groups", "inflight", "p2p_inflight"}, [])
        assert names() == whole and names() == whole  # the hub has not answered
        hub.hub_version = (1, 13)
        assert names() == whole
        hub.hub_version = (1, 14)  # the last went whole: these are what the hub holds
        assert names() == ({"p2p_inflight"}, ["groups", "inflight", "stack"])  # null: sent
        fields["stack"] = CULPRIT_STACK
        assert names() == ({"p2p_inflight", "stack"}, ["groups", "inflight"])  # it changed
        accept[0] = False
        assert names() == ({"p2p_inflight"}, ["groups", "inflight", "stack"])  # dropped...
        accept[0] = True
        assert names() == whole  # ...so the next goes whole
        monkeypatch.setattr(heartbeat, "RESEND_S", 0.0)
        assert names() == whole
    finally:
        beat.stop()
    for body in sent:
        protocol.check_body("heartbeat", body)


def two_rank_job(step_t: float, heard: tuple[int, ...] | list[int] = (0, 1)) -> JobState:
    """A job of two ranks whose last step ended at `step_t`; the ranks `heard` sent a stuck
    heartbeat 30 s later (rank 1 never issued all_reduce #2, rank 0 waits in it)."""
    st = JobState(job="unit", hang_after_s=10.0)
    st.apply(Message("collectives", "unit", 0, 1, step_t, {
        "groups": {"0": {"desc": "default_pg", "ranks": [0, 1]}}, "stats": [],
        "issues": []}))
    for r in (0, 1):
        st.apply(Message("hello", "unit", r, 0, step_t, {"host": "h", "pid": 100 + r,
                                                         "world_size": 2, "local_rank": r}))
        st.apply(Message("step", "unit", r, 2, step_t, {"step": 1, "loss": 1.0}))
    for r in heard:
        st.apply(Message("heartbeat", "unit", r, 3, step_t + 30.0, {
            "phase": "python" if r == 1 else "collective", "dropped": 0,
            "groups": {"0": [1, 1] if r == 1 else [2, 1]},
            "stack": CULPRIT_STACK if r == 1 else WAITING_STACK}))
    return st


def test_the_hang_alert_passes_the_global_cap_and_its_updates_are_paced() -> None:
    """Ranks' own alerts filling the minute's cap do not hold the job's hang back; an update
    comes only when the report changes, and not before its pace."""
    from test_alerts_out import Book

    from scalemon.hub.alerts_out import PER_MINUTE, AlertsOut

    n = PER_MINUTE + 2
    t0 = time.time() - 100.0
    state = JobState(job="unit", hang_after_s=10.0)
    state.apply(Message("collectives", "unit", 0, 1, t0, {
        "groups": {"0": {"desc": "default_pg", "ranks": list(range(n))}}, "stats": [],
        "issues": []}))
    for r in range(n):
        state.apply(Message("hello", "unit", r, 0, t0, {"host": "h", "pid": 100 + r,
                                                        "world_size": n, "local_rank": r}))
        state.apply(Message("step", "unit", r, 2, t0, {"step": 1, "loss": float("nan")}))
    seq = [3]

    def beat(ranks: range, late: int | None) -> None:  # stuck heartbeats, 90 s into the hang
        for r in ranks:
            culprit = r == late
            state.apply(Message("heartbeat", "unit", r, seq[0], t0 + 90.0, {
                "phase": "python" if culprit else "collective", "dropped": 0,
                "groups": {"0": [1, 1] if culprit else [2, 1]},
                "stack": CULPRIT_STACK if culprit else WAITING_STACK}))
        seq[0] += 1

    sent: list[dict] = []
    out = AlertsOut("unit", Book(), sent.append)
    beat(range(0, n - 2), None)  # ranks n-2 and n-1 not heard since
    out.check(state, 10.0)
    hangs = [a for a in sent if a["kind"] == "hang"]
    assert len(sent) == PER_MINUTE + 1 and len(hangs) == 1  # the cap, and the hang past it
    assert hangs[0]["provisional"] and hangs[0]["ranks"] == [n - 2, n - 1]

    beat(range(n - 2, n), n - 1)  # now heard: rank n-1 is the one
    out.check(state, 11.5)  # every rank heard: made again at once (its pace allows)
    assert [a["ranks"] for a in sent if a["kind"] == "hang"][1:] == [[n - 1]]
    assert sent[-1]["update"] == 1 and not sent[-1]["provisional"]
    beat(range(n), n - 1)
    out.check(state, 13.0)  # the same finding: no alert
    out.check(state, 60.0)  # made again when due (30 s later): still the same
    assert len([a for a in sent if a["kind"] == "hang"]) == 2


def test_a_provisional_hang_does_not_hold_back_the_hang_named_after_it() -> None:
    """A hub behind takes a pause for a hang and guesses (provisional); steps come, then the
    job really hangs within the minute: that hang is named, not held by the rate limit."""
    from test_alerts_out import Book

    from scalemon.hub.alerts_out import AlertsOut

    sent: list[dict] = []
    out = AlertsOut("unit", Book(), sent.append)
    out.check(two_rank_job(time.time() - 40.0, heard=[0]), 10.0)
    assert [(a["kind"], a["provisional"]) for a in sent] == [("hang", True)]
    out.check(two_rank_job(time.time(), heard=[]), 20.0)  # it stepped: no hang
    out.check(two_rank_job(time.time() - 40.0, heard=[0, 1]), 30.0)  # hung again, all heard
    assert [(a["provisional"], a["ranks"], a["update"]) for a in sent] == [
        (True, [1], 0), (False, [1], 0)]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="made on the loop here")
def test_a_big_jobs_hang_report_is_made_off_the_loop_and_taken_at_the_next_look(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """From HANG_OFF_LOOP_FROM ranks the report is made in a forked child: the look that
    starts it returns at once (the child waits on a file here), the child's end brings the
    next look forward, and that look sends the hang; a step before it is taken drops it."""
    from test_alerts_out import Book

    from scalemon.hub import alerts_out
    from scalemon.hub.alerts_out import AlertsOut

    gate = tmp_path / "gate"
    real = alerts_out.job_hang

    def gated(state: JobState, wall: float):  # runs in the child
        end = time.monotonic() + 60
        while not gate.exists() and time.monotonic() < end:
            time.sleep(0.01)
        return real(state, wall)

    monkeypatch.setattr(alerts_out, "job_hang", gated)
    monkeypatch.setattr(alerts_out, "HANG_OFF_LOOP_FROM", 2)

    sent: list[dict] = []
    out = AlertsOut("unit", Book(), sent.append)
    hung = two_rank_job(time.time() - 40.0)
    assert out.check(hung, 10.0) == [] and sent == []  # started in a child, not waited for
    child = out._hang_job
    assert child is not None and not child.done.is_set()
    assert out.check(hung, 10.5) == []  # not due yet: the scan's own pace
    gate.touch()
    assert wait_for(lambda: child.done.is_set(), 30)
    out.check(hung, 10.6)  # brought forward by the child's end
    assert [(a["kind"], a["ranks"], a["provisional"]) for a in sent] == [("hang", [1], False)]

    gate.unlink()
    later = two_rank_job(time.time() - 40.0)
    later.apply(Message("heartbeat", "unit", 0, 4, time.time(), {"phase": "collective"}))
    out.check(later, 60.0)  # due again (new messages): a second child
    again = out._hang_job
    assert again is not None and not again.done.is_set()
    out.check(two_rank_job(time.time()), 70.0)  # it stepped: the report under way is dropped
    assert out._hang_job is None and again.killed
    out.close()
