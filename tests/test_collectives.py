"""Collectives from the Flight Recorder: bandwidth, arrival skew, hang analysis (units) and
the agent's reader fed with recorder dumps shaped as torch writes them."""

from __future__ import annotations

import pickle
import sys
import threading
import time
from collections import deque

import pytest

from scalemon import protocol
from scalemon.collectives import (
    CollectiveStats,
    StatRow,
    bucket_text,
    buffer_bytes,
    bus_factor,
    hist_quantile,
    size_bucket,
)
from scalemon.protocol import Message
from scalemon.reports.hangs import job_hang
from scalemon.reports.snapshot import snapshot_json
from scalemon.reports.snapshot_text import format_snapshot
from scalemon.reports.waitfor import find_culprits, wait_for_graph
from scalemon.state.arrival import HEAT_BUDGET, ArrivalTracker, arrival_window, heat_cell_s
from scalemon.state.jobstate import JobState


def msg(mtype: str, rank: int, seq: int, body: dict, t: float = 1000.0) -> Message:
    """A message as the hub would fold it (through encode/decode, so it is valid)."""
    return protocol.decode(protocol.encode(mtype, "job", rank, seq, body, t))


def hello(rank: int, world: int, host: str = "h0") -> Message:
    return msg("hello", rank, 0, {"host": host, "pid": 100 + rank, "world_size": world,
                                  "local_rank": rank})


def entry(rid: int, seq: int, op: str = "all_reduce", numel: int = 1024, group: str = "0",
          desc: str = "default_pg", t: float = 1000.0, backend: str = "gloo",
          **extra: object) -> dict:
    """A Flight Recorder entry as torch 2.13 writes it."""
    out_sizes = [[2, numel]] if op == "all_gather" else [[numel]]
    return {"record_id": rid, "pg_id": int(group), "process_group": [group, desc],
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": f"{backend}:{op}", "time_created_ns": int(t * 1e9),
            "input_sizes": [[numel]], "input_dtypes": ["Float"], "output_sizes": out_sizes,
            "output_dtypes": ["Float"], "state": "scheduled", "retired": True,
            "is_p2p": False, "timeout_ms": 600000, **extra}


# --- definitions ------------------------------------------------------------------------------

def test_bus_factors_are_those_of_nccl_tests():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("_allgather_base", 4) == pytest.approx(0.75)
    assert bus_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    assert bus_factor("broadcast", 8) == 1.0
    assert bus_factor("barrier", 8) is None


def test_s_is_the_whole_buffer_and_sizes_bucket_by_powers_of_two():
    assert buffer_bytes(entry(0, 1, "all_reduce", 1024)) == 4096
    assert buffer_bytes(entry(0, 1, "all_gather", 1024)) == 2 * 4096  # the gathered output
    assert [size_bucket(n) for n in (0, 1, 2, 4096, 4097)] == [0, 0, 1, 12, 13]
    assert bucket_text(20) == "≤ 1 MiB"


def test_duration_quantiles_come_within_half_a_histogram_bucket():
    row = StatRow()
    for ms in range(1, 101):
        row.add_time(ms / 1000)
    assert hist_quantile(row.hist, 0.5) == pytest.approx(0.050, rel=0.13)
    assert hist_quantile(row.hist, 0.99) == pytest.approx(0.099, rel=0.13)
    stats = CollectiveStats()
    stats.merge_wire([["0", "all_reduce", 12, 100, 409600, row.timed, row.time_sum_s,
                       row.time_max_s, [[i, n] for i, n in row.hist.items()]]])
    assert stats.rows["0", "all_reduce", 12].time_max_s == pytest.approx(0.1)
    with pytest.raises(ValueError, match="bad collectives.stats row"):
        stats.merge_wire([["0", "all_reduce"]])


# --- arrival skew and culprits ----------------------------------------------------------------

def test_arrival_skew_ranks_the_rank_that_issues_last():
    tracker = ArrivalTracker()
    tracker.set_group("0", [0, 1, 2])
    for seq in range(1, 21):
        for rank, late in ((0, 0.0), (1, 0.050), (2, 0.010)):
            tracker.issued("0", seq, rank, 100.0 + seq + late)
    assert tracker.median(1) == pytest.approx(0.050)
    assert tracker.median(2) == pytest.approx(0.010)
    assert tracker.median(0) == 0.0
    tracker.issued("0", 99, 0, 1.0)  # not every rank reported it: no sample yet
    assert tracker.complete == 20


def test_the_heat_of_each_rank_is_summed_in_cells_that_fit_a_budget_whatever_the_job_size():
    """Heat cells of a second in a small job: 2,000 collectives in 200 s are 200 cells per rank
    holding every sample (the map's means unchanged); in a job of 16,384 ranks the cells are
    39 s wide and a rank keeps the 16 that cover the map's 600 s (213 KB a rank before)."""
    tracker = ArrivalTracker()
    tracker.set_group("0", [0, 1, 2])
    for seq in range(2000):
        for rank, late in ((0, 0.0), (1, 0.050), (2, 0.010)):
            tracker.issued("0", seq, rank, 100.0 + seq * 0.1 + late)
    assert heat_cell_s(3) == 1.0
    cells = tracker.heat[1]
    assert 199 <= len(cells) <= 201 and sum(n for _, _, n in cells) == 2000
    assert sum(total for _, total, _ in cells) == pytest.approx(2000 * 0.050)
    starts = [t for t, _, _ in cells]
    assert all(b - a >= 1.0 for a, b in zip(starts, starts[1:], strict=False))  # a second each

    big = ArrivalTracker()
    big.set_group("0", range(16384))  # the job's size, from its default group
    big.set_group("7", [5, 9])  # a pair that issues: cells as wide as the job asks
    assert heat_cell_s(16384) == pytest.approx(600 * 16384 / HEAT_BUDGET)
    for seq in range(3000):
        big.issued("7", seq, 5, 1000.0 + seq * 0.5)
        big.issued("7", seq, 9, 1000.0 + seq * 0.5 + 0.002)
    cells = big.heat[9]
    assert len(cells) == cells.maxlen == 16  # 1,500 s of collectives: the latest 16 cells
    assert all(n in (78, 79) for _, _, n in list(cells)[:-1])  # 39.3 s of them at 2 a second
    assert sum(total for _, total, _ in cells) == pytest.approx(
        0.002 * sum(n for _, _, n in cells))
    # the lateness median over fewer samples in a big job: 1,000,000 over every rank
    assert tracker.lateness[1].maxlen == arrival_window(3) == 100
    assert big.lateness[9].maxlen == arrival_window(16384) == 61
    state = JobState()  # the job's size from the ranks' hellos, before any group is known
    state.apply(Message("hello", "j", 3, 0, 1.0, {"host": "h", "pid": 9, "local_rank": 3,
                                                  "world_size": 16384}))
    assert state.arrival.world == 16384 and state.arrival.series(3).maxlen == 61


def core(finding: dict | None) -> dict | None:
    """The keys the Flight Recorder dump analysis reads."""
    return finding and {k: finding[k] for k in ("group", "seq", "culprits", "waiting")}


def test_culprits_are_those_that_never_issued_what_the_others_wait_in():
    members = {"0": (0, 1, 2, 3), "1": (0, 1)}
    status = {0: {"0": [12, 11], "1": [3, 3]}, 1: {"0": [9, 9], "1": [3, 3]},
              2: {"0": [12, 11]}, 3: {"0": [12, 11]}}
    assert core(find_culprits(status, members, set())) == {
        "group": "0", "seq": 10, "culprits": [1], "waiting": [0, 2, 3]}
    same = {r: {"0": [12, 11]} for r in range(4)}
    found = find_culprits(same, {"0": (0, 1, 2, 3)}, {2})
    assert core(found) == {"group": "0", "seq": 12, "culprits": [2], "waiting": [0, 1, 3]}
    assert found["causes"] == {2: {"cause": "gone"}}
    stuck = find_culprits(same, {"0": (0, 1, 2, 3)}, set())
    assert stuck["culprits"] == [] and stuck["waiting"] == [0, 1, 2, 3]
    assert {c["cause"] for c in stuck["causes"].values()} == {"stuck"}
    done = {r: {"0": [12, 12]} for r in range(4)}
    assert find_culprits(done, {"0": (0, 1, 2, 3)}, set()) is None


def test_a_subgroup_chain_names_the_rank_at_its_end_alone():
    """Rank 1 stops in Python; rank 0 waits for it in the subgroup {0,1}, rank 2 waits in the
    default group for both: rank 1 alone is the culprit, rank 0 waits on it."""
    members = {"0": (0, 1, 2), "1": (0, 1)}
    status = {0: {"0": [15, 15], "1": [3, 2]}, 1: {"0": [15, 15], "1": [2, 2]},
              2: {"0": [16, 15]}}
    inflight = {0: [["1", 3, "all_gather", 100.0, 64]], 2: [["0", 16, "all_reduce", 99.0, 16]]}
    found = wait_for_graph(status, members, inflight=inflight)
    assert found["culprits"] == [1] and found["waiting"] == [0, 2]
    assert found["causes"] == {1: {"cause": "python"}}
    assert found["waits"][0] == {"group": "1", "seq": 3, "op": "all_gather", "t": 100.0,
                                 "for": [1]}
    assert found["waits"][2]["for"] == [0, 1] and found["waits"][2]["seq"] == 16
    assert found["chains"] == [[2, 0, 1]]  # through rank 0, which waits itself


def test_two_disjoint_subgroups_each_have_their_culprit():
    members = {"0": (0, 1, 2, 3), "1": (0, 1), "2": (2, 3)}
    status = {0: {"0": [5, 5], "1": [4, 3]}, 1: {"0": [5, 5], "1": [3, 3]},
              2: {"0": [5, 5], "2": [4, 3]}, 3: {"0": [5, 5], "2": [3, 3]}}
    found = wait_for_graph(status, members)
    assert found["culprits"] == [1, 3] and found["waiting"] == [0, 2]
    assert found["chains"] == [[0, 1], [2, 3]]
    assert (found["waits"][0]["group"], found["waits"][2]["group"]) == ("1", "2")


def test_a_rank_waiting_in_another_collective_is_a_link_not_an_end():
    """Rank 0 waits in subgroup {0,1} for rank 1, which waits in subgroup {1,2} for rank 2:
    the chain 0 -> 1 -> 2 ends at rank 2."""
    members = {"0": (0, 1, 2), "1": (0, 1), "2": (1, 2)}
    status = {0: {"0": [7, 7], "1": [2, 1]}, 1: {"0": [7, 7], "1": [1, 1], "2": [4, 3]},
              2: {"0": [7, 7], "2": [3, 3]}}
    found = wait_for_graph(status, members)
    assert found["culprits"] == [2] and found["waiting"] == [0, 1]
    assert found["chains"] == [[0, 1, 2]]
    assert (found["group"], found["seq"]) == ("2", 4)


def test_a_desync_names_the_rank_that_issued_another_op():
    members = {"0": (0, 1, 2)}
    status = {r: {"0": [5, 4]} for r in range(3)}
    inflight = {0: [["0", 5, "all_reduce", 1.0, 16]], 1: [["0", 5, "all_reduce", 1.0, 16]],
                2: [["0", 5, "all_gather", 1.0, 48]]}
    found = wait_for_graph(status, members, inflight=inflight)
    assert found["culprits"] == [2] and found["waiting"] == [0, 1]
    assert found["causes"][2] == {"cause": "desync", "group": "0", "seq": 5}
    (desync,) = found["desync"]
    assert desync["ranks"] == [2] and desync["others"] == [0, 1]
    assert desync["issued"][0] == {"op": "all_reduce", "bytes": 16, "ranks": [0, 1]}
    assert found["waits"][0]["for"] == [2]  # the others wait for the odd one
    sizes = {r: [["0", 5, "all_reduce", 1.0, 64 if r == 1 else 16]] for r in range(3)}
    assert wait_for_graph(status, members, inflight=sizes)["culprits"] == [1]


def test_teardown_and_deadlock():
    members = {"0": (0, 1, 2)}
    status = {0: {"0": [9, 9]}, 1: {"0": [9, 9]}, 2: {"0": [10, 9]}}
    found = wait_for_graph(status, members, finished={0, 1})
    assert found["culprits"] == [2] and found["waiting"] == []
    assert found["causes"][2] == {"cause": "teardown", "for": [0, 1]}
    # 0 waits in group 1 for 1, 1 waits in group 2 for 0: collectives in different orders
    members = {"1": (0, 1), "2": (0, 1)}
    status = {0: {"1": [1, 0], "2": [0, 0]}, 1: {"1": [0, 0], "2": [1, 0]}}
    found = wait_for_graph(status, members)
    assert found["culprits"] == [0, 1]
    assert {c["cause"] for c in found["causes"].values()} == {"deadlock"}
    assert found["chains"] == [[0, 1]]


# --- the reducer ------------------------------------------------------------------------------

def collectives_body(rank: int, seqs: range, late: float, seconds: float) -> dict:
    stats = CollectiveStats()
    row = stats.row("0", "all_reduce", size_bucket(4 << 20))
    for _ in seqs:
        row.count += 1
        row.bytes += 4 << 20
        row.add_time(seconds)
    return {"groups": {"0": {"desc": "default_pg", "ranks": [0, 1]}}, "stats": stats.to_wire(),
            "issues": [["0", s, 500.0 + s + late] for s in seqs], "step": 5}


def test_the_reducer_sums_collectives_and_measures_arrival_lateness():
    st = JobState()
    for rank in (0, 1):
        st.apply(hello(rank, 2))
    st.apply(msg("collectives", 0, 1, collectives_body(0, range(1, 11), 0.0, 0.004)))
    st.apply(msg("collectives", 1, 1, collectives_body(1, range(1, 11), 0.030, 0.002)))
    out = snapshot_json(st, now=1000.0)
    (row,) = out["collectives"]
    assert (row["group"], row["op"], row["count"], row["bytes"]) == (
        "default_pg", "all_reduce", 10, 10 * (4 << 20))
    # busbw = S / mean time * 2(n-1)/n, mean over both ranks' durations
    assert row["busbw_gbps"] == pytest.approx((4 << 20) / 0.003 * 1.0 / 1e9, rel=1e-6)
    assert row["sizes"][0]["size_text"] == "≤ 4 MiB"
    lateness = {r["rank"]: r["arrival_lateness_s"] for r in out["ranks"]}
    assert lateness[1] == pytest.approx(0.030) and lateness[0] == 0.0
    assert out["hang"] is None
    text = format_snapshot(out)
    assert f"default_pg all_reduce: 10 x, {10 * (4 << 20)} bytes, p50 " in text
    assert f"busbw {row['busbw_gbps']:.3g}" in text and "HUNG" not in text


def test_bad_collectives_rows_are_counted_and_the_rest_goes_on():
    st = JobState()
    st.apply(hello(0, 1))
    st.apply(msg("collectives", 0, 1, {"groups": {}, "stats": [["x"]], "issues": []}))
    st.apply(msg("step", 0, 2, {"step": 1}))
    assert st.bad_collectives == 1 and st.ranks[0].step == 1


def test_a_rank_never_heard_from_is_named_as_such_not_as_python_without_a_stack():
    st = JobState(hang_after_s=10.0)
    for rank in (0, 2):  # rank 1 died before its agent's first message
        st.apply(hello(rank, 3))
    groups = {"0": {"desc": "default_pg", "ranks": [0, 1, 2]}}
    st.apply(msg("collectives", 0, 1, {"groups": groups, "stats": [], "issues": []}))
    for rank in (0, 2):
        st.apply(msg("step", rank, 2, {"step": 4}, t=1000.0))
        st.apply(msg("heartbeat", rank, 3, {
            "phase": "allreduce", "dropped": 0, "groups": {"0": [10, 9]},
            "inflight": [["0", 10, "all_reduce", 1000.5]]}, t=1020.0))
    hang = snapshot_json(st, now=1037.5)["hang"]
    assert hang["culprits"] == [1] and hang["causes"][0]["cause"] == "unheard"
    assert hang["text"].startswith("rank 1: never reported to the hub: its process did not "
                                   "start, or ended before its agent's first message; never "
                                   "issued all_reduce #10"), hang["text"]
    assert "no stack yet" not in hang["text"]


def test_a_hang_names_the_rank_that_never_issued_and_carries_every_stack():
    st = JobState(hang_after_s=10.0)
    for rank in (0, 1, 2):
        st.apply(hello(rank, 3))
    groups = {"0": {"desc": "default_pg", "ranks": [0, 1, 2]}}
    st.apply(msg("collectives", 0, 1, {"groups": groups, "stats": [], "issues": []}))
    for rank in (0, 1, 2):
        st.apply(msg("step", rank, 2, {"step": 4}, t=1000.0))
    for rank, status in ((0, [10, 9]), (1, [9, 9]), (2, [10, 9])):
        inflight = [["0", 10, "all_reduce", 1000.5]] if status[0] == 10 else []
        st.apply(msg("heartbeat", rank, 3, {
            "phase": "allreduce", "dropped": 0, "groups": {"0": status}, "inflight": inflight,
            "stack": f'  File "train.py", line 1, in rank{rank}\n'}, t=1020.0))
    assert job_hang(st, now=1005.0) is None  # not long enough
    hang = snapshot_json(st, now=1037.5)["hang"]
    assert hang["culprits"] == [1] and hang["waiting"] == [0, 2]
    assert (hang["group"], hang["op"], hang["seq"]) == ("default_pg [0,1,2]", "all_reduce", 10)
    assert hang["since_s"] == pytest.approx(37.5)
    assert hang["text"] == ("rank 1 never issued all_reduce #10 of default_pg [0,1,2] (in "
                            "Python: train.py:1 in rank1()); ranks 0,2 wait in all_reduce #10 "
                            "of default_pg [0,1,2] for rank 1 (37 s)")
    assert hang["causes"] == [{
        "rank": 1, "cause": "python", "culprit": True, "phase": "allreduce",
        "frame": "train.py:1 in rank1()",
        "text": "rank 1: python, train.py:1 in rank1(); never issued all_reduce #10 of "
                "default_pg [0,1,2]"}]
    assert [w["text"] for w in hang["waits"]] == [
        f"rank {r}: waiting in all_reduce #10 of default_pg [0,1,2] for rank 1 (37 s)"
        for r in (0, 2)]
    assert hang["chains"] == [[0, 1], [2, 1]]
    assert hang["ranks"]["1"]["frame"] == "train.py:1 in rank1()"
    assert set(hang["stacks"]) == {"0", "1", "2"} and "rank1" in hang["stacks"]["1"]
    text = format_snapshot(snapshot_json(st, now=1037.5))  # `scalemon snapshot` for people
    assert "HUNG: rank 1 never issued all_reduce #10 of default_pg [0,1,2]" in text
    assert "  state HUNG  " in text.splitlines()[0]  # not "running"
    assert 'rank 1 stack:\n    File "train.py", line 1, in rank1' in text
    # frozen in native code: its stacks read from outside name where, and stand for its stack
    where = "frozen in native code holding the GIL: sleep <- stuck() at train.py:9"
    st.apply(msg("rank_stacks", protocol.HUB_RANK, 1, {"target": 1, "reader": "hub on h0",
                                                       "reading": {
        "pid": 101, "tool": "py-spy 0.4.3", "native": True, "error": None, "took_s": 0.1,
        "t": 1038.0, "threads": [{"thread_id": 7, "name": "MainThread", "os_thread_id": 101,
                                  "active": True, "owns_gil": True, "frames": [
                                      {"name": "sleep", "file": "libc.so.6", "line": 0,
                                       "native": True},
                                      {"name": "stuck", "file": "train.py", "line": 9,
                                       "native": False}]}]}}))
    st.apply(msg("rank_state", protocol.HUB_RANK, 2, {"target": 1, "state": "frozen",
                                                      "reason": "no message for 5.2 s",
                                                      "where": where}))
    hang = job_hang(st, now=1039.0)
    assert hang["culprits"] == [1] and hang["gone"] == []
    assert hang["causes"][0]["cause"] == "frozen"
    assert f"rank 1: {where}; never issued all_reduce #10" in hang["text"]
    assert "read from outside the process by hub on h0" in hang["stacks"]["1"]
    assert "stuck" in hang["stacks"]["1"]
    st.apply(msg("rank_state", protocol.HUB_RANK, 3, {"target": 1, "state": "gone",
                                                      "reason": "process 101 ended"}))
    hang = job_hang(st, now=1040.0)
    assert hang["culprits"] == [1] and hang["gone"] == [1]
    assert "rank 1: gone: process 101 ended; never issued all_reduce #10" in hang["text"]


# --- the agent's reader -----------------------------------------------------------------------

class FakeSource:
    """A recorder ring whose content the test sets."""

    name = "fr"

    def __init__(self) -> None:
        self.entries: list[dict] = []
        self.status: dict = {}
        self.config: dict = {"0": {"desc": "default_pg", "ranks": "[0, 1]"}}
        self.seen: set[int] = set()
        self.last_id: int | None = None

    def read(self, collectives: bool) -> dict:
        return pickle.loads(self._dump(includeCollectives=collectives, onlyActive=False))

    def _dump(self, includeCollectives: bool, onlyActive: bool) -> bytes:  # noqa: N803
        out = {"version": "2.10", "pg_config": self.config, "pg_status": self.status}
        if includeCollectives:
            out["entries"] = list(self.entries)
        return pickle.dumps(out)


def reader(source: FakeSource, **kwargs: object):
    from scalemon.agent.recorder import Recorder

    sent: list[tuple[str, dict]] = []
    rec = Recorder(lambda t, b: sent.append((t, b)) or True, threading.get_ident(),
                   kwargs.pop("last_log", lambda: None), lambda: 7, nccl=False,
                   sources=[source], start=False, **kwargs)
    return rec, sent


def test_the_reader_sends_each_entry_once_and_counts_what_the_ring_overwrote():
    source = FakeSource()
    source.entries = [entry(i, i + 1, t=100.0 + i) for i in range(5)]
    source.status = {"0": {"last_enqueued_collective": "5", "last_completed_collective": "5"}}
    rec, sent = reader(source)
    rec.read_all(False)
    ((mtype, body),) = sent
    assert mtype == "collectives" and body["step"] == 7
    assert body["stats"] == [["0", "all_reduce", 12, 5, 5 * 4096, 0, 0.0, 0.0, []]]
    assert [i[:2] for i in body["issues"]] == [["0", s] for s in range(1, 6)]
    assert body["groups"]["0"]["desc"] == "default_pg"
    rec.read_all(False)  # nothing new: nothing sent
    assert len(sent) == 1
    source.entries = [entry(i, i + 1) for i in range(8, 12)]  # 5, 6, 7 were overwritten
    rec.read_all(False)
    assert rec.lost == 3 and rec.entries == 9
    assert sent[-1][1]["groups"] == {}  # groups are sent once
    fields = rec.heartbeat_fields()
    assert fields["groups"] == {"0": [5, 5]} and fields["recorder_lost"] == 3


def test_a_group_whose_members_are_not_known_yet_is_sent_once_they_are():
    """A group first read without its members (neither the recorder's config nor c10d knew
    them yet) is not sent memberless, which the hub would ignore for good: it goes with
    them at a later read."""
    source = FakeSource()
    source.config = {}
    source.entries = [entry(0, 1, t=100.0)]
    rec, sent = reader(source)
    rec.read_all(False)
    assert sent[0][1]["groups"] == {} and sent[0][1]["issues"]
    source.config = {"0": {"desc": "default_pg", "ranks": "[0, 1]"}}
    source.entries.append(entry(1, 2, t=101.0))
    rec.read_all(False)
    assert sent[1][1]["groups"] == {"0": {"desc": "default_pg", "ranks": [0, 1]}}
    source.entries.append(entry(2, 3, t=102.0))
    rec.read_all(False)
    assert sent[2][1]["groups"] == {}  # sent once


def test_nccl_entries_wait_for_their_duration_and_gloo_calls_get_the_host_one():
    source = FakeSource()
    now = time.time()
    source.entries = [entry(0, 1, backend="nccl", t=now, state="started"),
                      entry(1, 2, backend="nccl", t=now, state="completed", duration_ms=2.0)]
    rec, sent = reader(source)
    rec.read_all(False)
    assert sent[0][1]["stats"][0][3:6] == [1, 4096, 1]  # one taken, with its duration
    source.entries[0] = {**source.entries[0], "state": "completed", "duration_ms": 4.0}
    rec.read_all(False)
    assert sent[1][1]["stats"][0][3:7] == [1, 4096, 1, 0.004]

    # gloo: the recorder has no duration; the host timer's call of the same (group, seq) does
    import torch.distributed as dist

    source = FakeSource()
    calls: deque = deque()
    rec, sent = reader(source, host_calls=calls)
    group = object()
    source.entries = [entry(0, 1, "all_reduce")]
    calls.append([group, 1, "reduce_scatter", None])  # issued, not completed yet
    names = dist.distributed_c10d._world.pg_names
    names[group] = "0"
    try:
        rec.read_all(False)
        assert sent[0][1]["stats"][0][1] == "reduce_scatter"  # gloo's recorder says all_reduce
        assert sent[0][1]["stats"][0][5] == 0
        rec._host_calls["0", 1][3] = 0.25  # it completed
        rec.read_all(False)
        assert sent[1][1]["stats"][0][3:7] == [0, 0, 1, 0.25]
    finally:
        del names[group]


def test_a_stuck_training_thread_gets_its_stack_and_collectives_in_flight_reported():
    source = FakeSource()
    source.entries = [entry(0, 1), entry(1, 2, t=123.0)]
    source.status = {"0": {"last_enqueued_collective": "2", "last_completed_collective": "1"}}
    rec, _ = reader(source, last_log=lambda: time.perf_counter() - 60.0)
    assert rec._stuck()
    rec.read_all(True)
    fields = rec.heartbeat_fields()
    assert fields["inflight"] == [["0", 2, "all_reduce", 123.0, 4096]]  # with its bytes
    assert "test_a_stuck_training_thread" in fields["stack"]
    assert rec.blocked() is True  # group 0 issued #2, completed #1
    rec.last_log = time.perf_counter  # it logged a step: no longer stuck
    assert not rec._stuck() and rec.heartbeat_fields()["stack"] is None
    assert rec.blocked() is None


def test_a_dump_lands_where_torchs_analyzer_looks_and_is_reported(tmp_path):
    source = FakeSource()
    source.entries = [entry(0, 1)]
    rec, sent = reader(source)
    result = rec.write_dump(str(tmp_path / "fr"), rank=3)
    assert result["error"] is None and result["files"] == [str(tmp_path / "fr" / "rank_3")]
    assert pickle.loads((tmp_path / "fr" / "rank_3").read_bytes())["entries"][0]["record_id"] == 0
    assert sent[-1] == ("info", {"key": "fr_dump", "value": result})
    bad = rec.write_dump("/proc/no/such/dir", rank=3)
    assert bad["error"] and bad["files"] == []


def test_the_stack_is_the_training_threads_not_the_readers():
    source = FakeSource()
    rec, _ = reader(source)
    stack = rec.training_stack()
    assert stack and sys._getframe().f_code.co_name in stack


def test_nccl_ras_status_is_read_as_ncclras_does_and_its_absence_said():
    import socket

    from scalemon.agent.ras import RasUnavailable, ras_status

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    said: list[str] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            f = conn.makefile("rwb")
            for answer in (b"SERVER PROTOCOL 2\n", b"OK\n"):
                said.append(f.readline().decode().strip())
                f.write(answer)
                f.flush()
            said.append(f.readline().decode().strip())
            f.write(b"Job summary\n  Nodes 1, processes 2\nCommunicators... (1 total)\n")
            f.flush()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        report = ras_status("127.0.0.1", port, timeout_s=2.0)
    finally:
        thread.join(timeout=5)
        server.close()
    assert said == ["CLIENT PROTOCOL 2", "TIMEOUT 2", "STATUS"]
    assert "Communicators" in report
    with pytest.raises(RasUnavailable, match="no NCCL RAS at 127.0.0.1"):
        ras_status("127.0.0.1", port, timeout_s=1.0)  # closed now


def test_nccl_ras_is_not_asked_for_a_process_without_a_nccl_group():
    """A rank whose agent guessed NCCL (CUDA is there) but that never made a process group
    (or made a gloo one) sends no RAS report: the port could be another job's on the node."""
    import socket

    from scalemon.agent.recorder import Recorder

    server = socket.create_server(("127.0.0.1", 0))  # a RAS port that would answer
    server.settimeout(0.5)
    sent: list = []
    recorder = Recorder(lambda *m: sent.append(m) or True, threading.get_ident(),
                        lambda: None, lambda: None, nccl=True, sources=[], start=False,
                        ras_port=server.getsockname()[1])
    try:
        recorder.relay_ras()
        with pytest.raises(TimeoutError):
            server.accept()  # nobody connected
    finally:
        server.close()
    assert sent == []


def test_a_big_hang_stays_small_in_words_and_in_json():
    """4096 ranks, half of them in Python, the other half waiting for them: one sentence per
    kind of rank, awaited ranks as ranges, at most 64 of them listed per waiting rank."""
    import json

    n = 4096
    st = JobState(hang_after_s=10.0)
    st.groups = {"0": {"desc": "default_pg", "ranks": list(range(n))}}
    st.last_step_t = 0.0
    for r in range(n):
        view = st.rank(r)
        view.step, view.last_step_t = 5, 0.0
        late = r < n // 2
        view.metrics.update(groups={"0": [99, 99] if late else [100, 99]},
                            inflight=None if late else [["0", 100, "all_reduce", 1.0, 64]],
                            stack='  File "train.py", line 3, in step\n')
    hang = job_hang(st, now=50.0)
    assert hang["culprits"] == list(range(n // 2))
    assert hang["text"] == (
        "ranks 0-2047 never issued all_reduce #100 of default_pg [0-4095] (in Python: "
        "train.py:3 in step()); ranks 2048-4095 wait in all_reduce #100 of default_pg [0-4095] "
        "for ranks 0-2047 (49 s)")
    assert {len(w["for"]) for w in hang["waits"]} == {64}
    assert {w["for_count"] for w in hang["waits"]} == {2048}
    assert len(json.dumps(hang)) < 8 << 20


def test_the_recorder_reads_every_ring_without_stack_traces(monkeypatch):
    """Read with stack traces, the generic ring of a monitored gloo job on a machine with CUDA
    (H100, torch 2.11) made both ranks die with SIGSEGV at interpreter exit, every run; without
    them they exit 0 (issue #25). Every read, and the dumps written for `scalemon dump`, must
    ask for none (torch's own default is to include them)."""
    import torch._C._distributed_c10d as c10d

    from scalemon.agent.rings import find_sources

    calls: list[dict] = []

    def dump(**kwargs):
        calls.append(kwargs)
        return pickle.dumps({"entries": [], "pg_status": {}})

    monkeypatch.setattr(c10d, "_dump_fr_trace", dump, raising=False)
    monkeypatch.setattr(c10d, "_dump_nccl_trace", dump, raising=False)
    sources = find_sources(nccl=True)
    assert [s.name for s in sources] == ["fr", "nccl"]
    for source in sources:
        source.read(True)
        source.read(False)
        source._dump(includeCollectives=True, onlyActive=False)  # as write_dump calls it
    assert len(calls) == 6
    assert all(call.get("includeStackTraces") is False for call in calls), calls


def test_a_frozen_rank_inside_a_collective_every_member_issued_is_the_culprit_not_the_network():
    st = JobState(hang_after_s=10.0)
    for rank in (0, 1, 2):
        st.apply(hello(rank, 3))
    groups = {"0": {"desc": "default_pg", "ranks": [0, 1, 2]}}
    st.apply(msg("collectives", 0, 1, {"groups": groups, "stats": [], "issues": []}))
    for rank in (0, 1, 2):
        st.apply(msg("step", rank, 2, {"step": 4}, t=1000.0))
        st.apply(msg("heartbeat", rank, 3, {
            "phase": "collective", "dropped": 0, "groups": {"0": [10, 9]},
            "inflight": [["0", 10, "all_reduce", 1000.5]]}, t=1020.0))
    assert job_hang(st, now=1037.5)["culprits"] == []  # every member issued it: stuck
    where = "frozen in native code holding the GIL: ncclGroupEnd <- step() at train.py:7"
    st.apply(msg("rank_state", protocol.HUB_RANK, 1, {"target": 1, "state": "frozen",
                                                      "where": where}))
    hang = job_hang(st, now=1037.5)
    assert hang["culprits"] == [1] and hang["waiting"] == [0, 2]
    assert hang["text"].startswith(f"rank 1: {where}; inside all_reduce #10 of default_pg "
                                   "[0,1,2]; ranks 0,2 wait in all_reduce #10"), hang["text"]
    assert "network" not in hang["text"]
