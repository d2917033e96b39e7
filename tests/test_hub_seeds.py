"""A dashboard's `seed`, and a big job's `state`, are made in a forked child of the hub
(hub/seeds.py, hub/forked_replies.py): the requests that come while it is made wait for that
child's reply where it answers them (a seed always; a state only at the same record count,
else the next child), the hub's loop goes on meanwhile, and a child that fails or too many
waiting get a reason instead (real forks; the replies go to a recording `send`)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from scalemon.hub import forked_replies
from scalemon.hub import seeds as seeds_module
from scalemon.hub.seeds import Seeds, States
from scalemon.link import seed
from scalemon.state.fold import JobFold
from scalemon.tui.sim import SimJob

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="seeds are made inline here")


def folded(ranks: int = 8, steps: int = 3) -> tuple[JobFold, list[bytes]]:
    fold, history = JobFold("seedjob"), []
    for seq, msg in enumerate(SimJob(job="seedjob", ranks=ranks).run(steps)):
        fold.apply(seq, msg)
        history.append(b"")
    return fold, history


def wait_for_gate(gate: Path) -> None:
    """Wait (at most a minute) for `gate` to exist: a child held until the test lets it go."""
    end = time.monotonic() + 60
    while not gate.exists() and time.monotonic() < end:
        time.sleep(0.01)


def gated_dump(monkeypatch: pytest.MonkeyPatch, gate: Path) -> None:
    """`seed.dump` waits for `gate` to exist (in the forked child too)."""
    real = seed.dump

    def dump(fold: JobFold) -> bytes:
        wait_for_gate(gate)
        return real(fold)

    monkeypatch.setattr(seed, "dump", dump)


def until_sent(replies: Any, sent: list[Any], count: int, head: int = 0) -> None:
    end = time.monotonic() + 60
    while len(sent) < count and time.monotonic() < end:
        replies.send_ready(head)
        time.sleep(0.01)
    assert len(sent) == count


def test_requests_wait_for_one_forked_seed_while_the_loop_goes_on_then_reuse_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fold, history = folded()
    head = len(history)
    gate = tmp_path / "gate"
    gated_dump(monkeypatch, gate)
    sent: list[Any] = []
    seeds = Seeds(SimpleNamespace(fold=fold, history=history),
                  lambda sock, envelope, op, reply: sent.append((sock, envelope, op, reply)))
    assert seeds.ask(("sock-a", [b"a"]), head) is None
    child = seeds._making
    assert child is not None and child.pid not in (None, os.getpid())
    assert seeds.ask(("sock-b", [b"b"]), head) is None
    assert seeds._making is child  # one child for both
    history.append(b"")  # the loop goes on: a record comes while the child works
    seeds.send_ready(head + 1)
    assert sent == [] and not child.done.is_set()
    gate.touch()
    until_sent(seeds, sent, 2)
    assert [(s[0], s[1], s[2]) for s in sent] == [("sock-a", [b"a"], "seed"),
                                                  ("sock-b", [b"b"], "seed")]
    reply = sent[0][3]
    assert sent[1][3] is reply
    assert reply["seq"] == head  # the fold as it stood at the fork
    loaded = seed.load(reply["seed"])
    assert loaded.next_seq == head and sorted(loaded.state.ranks) == list(range(8))
    assert seeds.made == 1 and len(seeds.fork_s) == 1
    # a record came since: the next asker gets a new seed, then the one after reuses it
    assert seeds.ask(("sock-c", [b"c"]), head + 1) is None
    until_sent(seeds, sent, 3)
    assert sent[2][3]["seq"] == head + 1
    assert seeds.ask(("sock-d", [b"d"]), head + 1) is sent[2][3]
    assert seeds.made == 2


def test_a_failed_child_and_too_many_waiting_get_a_reason_to_replay(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fold, history = folded()

    def broken(_fold: JobFold) -> bytes:
        raise RuntimeError("no pickling today")

    monkeypatch.setattr(seed, "dump", broken)
    sent: list[Any] = []
    seeds = Seeds(SimpleNamespace(fold=fold, history=history),
                  lambda sock, envelope, op, reply: sent.append(reply))
    assert seeds.ask(("s", [b"1"]), 5) is None
    until_sent(seeds, sent, 1)
    assert sent[0]["seed"] is None and "replay the history" in sent[0]["why"]

    gated_dump(monkeypatch, tmp_path / "gate")
    monkeypatch.setattr(forked_replies, "MAX_WAITING", 2)
    assert seeds.ask(("s", [b"2"]), 5) is None and seeds.ask(("s", [b"3"]), 5) is None
    over = seeds.ask(("s", [b"4"]), 5)
    assert over is not None and over["seed"] is None
    assert "2 dashboards already wait" in over["why"]
    seeds.close()  # the hub stops: the child is ended
    assert seeds._making is None


def test_a_big_jobs_state_is_made_off_the_loop_and_a_later_request_waits_for_the_next(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fold, history = folded()
    head = len(history)
    gate = tmp_path / "gate"
    real = seeds_module.snapshot_json

    def gated(state: Any) -> dict:
        wait_for_gate(gate)
        return real(state)

    monkeypatch.setattr(seeds_module, "snapshot_json", gated)
    calls = iter(range(1, 100))
    core = SimpleNamespace(fold=fold, state=fold.state, history=history)
    sent: list[Any] = []
    states = States(core, lambda sock, envelope, op, reply: sent.append((envelope, reply)),
                    lambda: {"stats": next(calls)})
    gate.touch()
    small = states.ask(("s", [b"small"]), head)  # 8 ranks: at once, on the loop
    assert small is not None and small["head"] == head and len(small["state"]["ranks"]) == 8
    gate.unlink()

    monkeypatch.setattr(seeds_module, "FORK_STATE_FROM_RANKS", 2)
    assert states.ask(("s", [b"a"]), head) is None
    assert states.ask(("s", [b"b"]), head) is None  # same record count: the same child
    assert states.ask(("s", [b"c"]), head + 1) is None  # a record came: the next child
    first = states._making
    assert first is not None and not first.done.is_set()
    gate.touch()
    until_sent(states, sent, 2, head + 1)
    assert [e for e, _ in sent] == [[b"a"], [b"b"]]
    assert sent[0][1]["head"] == head and sent[0][1]["hub"] == {"stats": 2}
    assert len(sent[0][1]["state"]["ranks"]) == 8
    assert states._making is not first  # started for the one that waited
    until_sent(states, sent, 3, head + 1)
    assert sent[2][0] == [b"c"] and sent[2][1]["head"] == head + 1
    assert sent[2][1]["hub"] == {"stats": 3} and states.made == 2
