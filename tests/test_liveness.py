"""The hub's liveness rules on their own (hub/liveness.py, hub/looks.py): what a look at a
silent rank's process makes of it, ranks on other nodes looked at again, and when a job with
frozen ranks counts as abandoned. The real processes are in tests/test_liveness_jobs.py."""

from __future__ import annotations

import logging

from scalemon.hub.liveness import LOOK_AGAIN_S, RELAY_SILENT_S, Liveness
from scalemon.hub.looks import Looks
from scalemon.hub.relay_book import RelayBook
from scalemon.hub.statelog import EACH_PER_WINDOW, WINDOW_S, RankStateLog
from scalemon.protocol import HUB_RANK, Message
from scalemon.state.jobstate import JobState


def job(*states: tuple[int, str, str]) -> JobState:
    """Ranks (rank, host, state) of a job; the hub's host is "hub"."""
    st = JobState()
    for rank, host, state in states:
        st.apply(Message("hello", "j", rank, 0, 1.0, {"host": host, "pid": 1000 + rank,
                                                      "world_size": len(states),
                                                      "local_rank": 0}))
        if state != "running":
            st.apply(Message("rank_state", "j", HUB_RANK, rank, 2.0,
                             {"target": rank, "state": state, "reason": "test"}))
    return st


def test_a_remote_rank_is_looked_at_through_its_relay_then_frozen_or_gone() -> None:
    relays = RelayBook(lost_after_s=10.0)
    relays.report("n1", 77, {}, now=100.0)
    looks, live = Looks("hub", relays), Liveness(5.0, 60.0, "hub")
    st = job((0, "n1", "running"), (1, "n1", "running"))
    live.heard(0, 100.0)
    live.heard(1, 100.0)
    assert live.check(st, relays, looks, 106.0) == []  # a relay looks: nothing said yet
    assert [a["rank"] for a in relays.take_asks("n1")] == [0, 1]
    looks.answered("n1", [
        {"rank": 0, "pid": 1000, "process": {"pid": 1000, "exists": True, "state": "S",
                                             "state_word": "sleeping", "cpu_moving": False},
         "reading": None, "where": "in native code holding the GIL: sleep <- f() at a.py:1"},
        {"rank": 1, "pid": 1001, "process": {"pid": 1001, "exists": False}},
        {"rank": 5, "pid": 9},  # not asked: ignored
        "garbage"])
    said = {look["rank"]: live.on_look(st, look) for look in looks.take(106.5)}
    assert said[0]["state"] == "frozen" and said[0]["where"].startswith("frozen in native")
    assert "CPU time not moving" in said[0]["reason"]
    assert said[1]["state"] == "gone" and "process 1001 ended" in said[1]["reason"]
    unknown = {"rank": 0, "pid": 1000, "process": {"pid": 1000, "exists": None}}
    live._looking[0] = 6.0
    assert live.on_look(st, unknown)["state"] == "frozen"  # "cannot tell" is not gone


def test_frozen_and_unreachable_remote_ranks_are_looked_at_again_or_made_unreachable() -> None:
    relays = RelayBook(lost_after_s=10.0)
    relays.report("n1", 77, {}, now=100.0)
    looks, live = Looks("hub", relays), Liveness(5.0, 60.0, "hub")
    st = job((0, "n1", "frozen"), (1, "n1", "unreachable"))
    assert live.check(st, relays, looks, 101.0) == []
    assert [a["rank"] for a in relays.take_asks("n1")] == [0, 1]  # looked at again
    looks.take(200.0)  # the relay never answered: given up
    relays.report("n1", 77, {}, now=101.0 + LOOK_AGAIN_S / 2)
    assert live.check(st, relays, looks, 101.0 + LOOK_AGAIN_S / 2) == []
    assert relays.take_asks("n1") == []  # not before LOOK_AGAIN_S
    later = 101.0 + LOOK_AGAIN_S / 2 + RELAY_SILENT_S + 1  # the relay fell silent
    live._looking.clear()
    found = live.check(st, relays, looks, later)
    assert [(b["target"], b["state"]) for b in found] == [(0, "unreachable")]


def test_a_job_whose_ranks_are_all_frozen_or_ended_is_abandoned_after_the_linger() -> None:
    live = Liveness(5.0, 60.0, "hub")
    st = job((0, "hub", "frozen"), (1, "hub", "gone"))
    live.last_any_recv = 0.0
    assert live.lifecycle_state(st, 30.0) == "degraded"  # frozen has not ended
    assert live.lifecycle_state(st, 61.0) == "abandoned"
    st = job((0, "hub", "running"), (1, "hub", "frozen"))
    assert live.lifecycle_state(st, 1000.0) == "running"  # a rank runs: never abandoned


def test_a_big_jobs_ranks_are_scanned_once_per_ranks_over_the_scan_rate() -> None:
    """8,192 ranks: a scan every 2 s, not every housekeeping turn (the first scan at once)."""
    from scalemon.hub.liveness import SCAN_RANKS_PER_S

    n = 2 * SCAN_RANKS_PER_S
    relays = RelayBook(lost_after_s=10.0)
    relays.report("n1", 77, {}, now=100.0)
    looks, live = Looks("hub", relays), Liveness(5.0, 60.0, "hub")
    st = job(*((rank, "n1", "running") for rank in range(n)))
    for rank in range(n):
        live.heard(rank, 100.0)
    assert live.check(st, relays, looks, 101.0) == []  # everyone heard: nothing to say
    live.heard(0, 90.0)  # rank 0 last spoke long ago, seen at the next scan only
    live._looking.clear()
    assert live.check(st, relays, looks, 102.9) == []
    assert relays.take_asks("n1") == []
    live.check(st, relays, looks, 103.1)
    assert [a["rank"] for a in relays.take_asks("n1")] == [0]  # its relay is asked to look


def test_the_hubs_log_says_each_state_change_while_few_then_counts_them(caplog) -> None:
    """A wave of 40 ranks lost in one window: the first 16 a line each, the rest one line per
    state when the window ends (the records keep every change; the log says less)."""

    states = RankStateLog()
    with caplog.at_level(logging.WARNING, logger="scalemon.hub"):
        for rank in range(40):
            states.say({"target": rank, "state": "unreachable" if rank < 30 else "silent",
                        "reason": "no message for 9.0 s"}, 100.0 + rank * 0.01)
        lines = [r.getMessage() for r in caplog.records]
        assert lines == [f"rank {r} unreachable: no message for 9.0 s"
                         for r in range(EACH_PER_WINDOW)]
        states.tick(100.0 + WINDOW_S - 0.5)  # the window is not over: nothing more
        assert len(caplog.records) == EACH_PER_WINDOW
        states.tick(100.0 + WINDOW_S)
        lines = [r.getMessage() for r in caplog.records][EACH_PER_WINDOW:]
        assert len(lines) == 2
        assert lines[0].startswith("10 more ranks silent in 10 s (ranks 30-39); each is a "
                                   "rank_state record")
        assert lines[1].startswith("14 more ranks unreachable in 10 s (ranks 16-29)")
        states.say({"target": 7, "state": "gone", "reason": "process ended"}, 200.0)
        assert caplog.records[-1].getMessage() == "rank 7 gone: process ended"  # a new window
