"""A dashboard's `seed` is made in a forked child of the hub (hub/seeds.py): the requests that
come while it is made wait for that one seed, the hub's loop goes on meanwhile, and a child
that fails or too many waiting dashboards get a reason to replay instead (real forks; the
replies go to a recording `send`)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from scalemon.hub import seeds as seeds_module
from scalemon.hub.seeds import Seeds
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


def gated_dump(monkeypatch: pytest.MonkeyPatch, gate: Path) -> None:
    """`seed.dump` waits for `gate` to exist (in the forked child too)."""
    real = seed.dump

    def dump(fold: JobFold) -> bytes:
        end = time.monotonic() + 60
        while not gate.exists() and time.monotonic() < end:
            time.sleep(0.01)
        return real(fold)

    monkeypatch.setattr(seed, "dump", dump)


def until_sent(seeds: Seeds, sent: list[Any], count: int) -> None:
    end = time.monotonic() + 60
    while len(sent) < count and time.monotonic() < end:
        seeds.send_ready()
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
    assert seeds.ask("sock-a", [b"a"]) is None
    child = seeds._making
    assert child is not None and child.pid not in (None, os.getpid())
    assert seeds.ask("sock-b", [b"b"]) is None
    assert seeds._making is child  # one child for both
    history.append(b"")  # the loop goes on: a record comes while the child works
    seeds.send_ready()
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
    assert seeds.ask("sock-c", [b"c"]) is None
    until_sent(seeds, sent, 3)
    assert sent[2][3]["seq"] == head + 1
    assert seeds.ask("sock-d", [b"d"]) is sent[2][3]
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
    assert seeds.ask("s", [b"1"]) is None
    until_sent(seeds, sent, 1)
    assert sent[0]["seed"] is None and "replay the history" in sent[0]["why"]

    gated_dump(monkeypatch, tmp_path / "gate")
    monkeypatch.setattr(seeds_module, "MAX_WAITING", 2)
    assert seeds.ask("s", [b"2"]) is None and seeds.ask("s", [b"3"]) is None
    over = seeds.ask("s", [b"4"])
    assert over is not None and over["seed"] is None
    assert "2 dashboards already wait" in over["why"]
    seeds.close()  # the hub stops: the child is ended
    assert seeds._making is None
