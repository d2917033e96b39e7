"""P2P ops in the wait-for graph (`reports.waitfor`) and in the hang's words (`reports.hangs`):
a rank blocked in recv(src) waits for src, in send(dst) for dst; chains that mix P2P and
collectives end at the culprit."""

from __future__ import annotations

from scalemon import protocol
from scalemon.protocol import Message
from scalemon.reports.hangs import job_hang
from scalemon.reports.waitfor import wait_for_graph


def test_a_stage_that_stops_before_its_send_is_the_end_of_the_pipeline_chain():
    """3 stages over the default group: stage 0 stops in Python before its send; stage 1
    waits in recv from 0, stage 2 in recv from 1."""
    status = {r: {"0": [5, 5]} for r in range(3)}
    p2p = {1: [["0", "recv", 0, 100.0, 64]], 2: [["0", "recv", 1, 100.5, 64]]}
    found = wait_for_graph(status, {"0": (0, 1, 2)}, p2p=p2p)
    assert found["culprits"] == [0] and found["waiting"] == [1, 2]
    assert found["causes"] == {0: {"cause": "python"}}
    assert found["waits"][1] == {"group": "0", "seq": None, "op": "recv", "peer": 0,
                                 "t": 100.0, "for": [0]}
    assert found["chains"] == [[2, 1, 0]]
    assert (found["group"], found["seq"]) == ("0", None)


def test_a_chain_mixes_a_tp_collective_and_a_pp_recv():
    """Rank 3 waits in tp [2,3]'s all_reduce for rank 2, which waits in recv from rank 0 of
    pp [0,2]; rank 0 is in Python: it alone is the culprit."""
    members = {"tp": (2, 3), "pp": (0, 2), "tp0": (0, 1)}
    status = {0: {"tp0": [4, 4], "pp": [2, 2]}, 1: {"tp0": [4, 4]},
              2: {"tp": [3, 3], "pp": [2, 2]}, 3: {"tp": [4, 3]}}
    p2p = {2: [["pp", "recv", 0, 10.0, 128]]}
    found = wait_for_graph(status, members, p2p=p2p)
    assert found["culprits"] == [0] and found["waiting"] == [2, 3]
    assert found["waits"][3]["for"] == [2] and found["waits"][2]["for"] == [0]
    assert found["chains"] == [[3, 2, 0]]


def test_a_send_whose_receiver_posted_its_recv_is_stuck_not_a_culprit():
    p2p = {0: [["0", "send", 1, 1.0, 8]], 1: [["0", "recv", 0, 1.0, 8]]}
    found = wait_for_graph({0: {}, 1: {}}, {"0": (0, 1)}, p2p=p2p)
    assert found["culprits"] == [] and found["waits"][0]["for"] == []
    assert found["waits"][1]["for"] == []  # its sender issued the send: neither holds up
    assert found["causes"] == {0: {"cause": "stuck"}, 1: {"cause": "stuck"}}


def test_1f1b_stages_exchanging_both_ways_are_no_deadlock_the_tp_rank_in_python_is_named():
    """pp2 x tp2: stages 0 and 2 each have a send and a recv to the other in flight (1F1B's
    batched exchange, matched), and rank 0 also waits in its tp all_reduce for rank 1, which
    is in Python. Not a deadlock of 0 and 2: rank 1 alone is the culprit."""
    p2p = {0: [["pp", "send", 2, 1.0, 8], ["pp", "recv", 2, 1.0, 8]],
           2: [["pp", "send", 0, 1.0, 8], ["pp", "recv", 0, 1.0, 8]]}
    status = {0: {"tp01": [5, 4], "pp": [0, 0]}, 1: {"tp01": [4, 4]},
              2: {"tp23": [5, 5], "pp": [0, 0]}, 3: {"tp23": [5, 5]}}
    members = {"tp01": (0, 1), "tp23": (2, 3), "pp": (0, 2)}
    found = wait_for_graph(status, members, p2p=p2p)
    assert found["culprits"] == [1], found["causes"]
    assert found["causes"][1] == {"cause": "python"}
    assert found["waits"][0]["group"] == "tp01" and found["waits"][0]["for"] == [1]
    assert found["causes"][2] == {"cause": "stuck"}


def test_a_receive_from_any_source_blames_no_rank_minus_one():
    found = wait_for_graph({1: {}}, {"0": (0, 1)}, p2p={1: [["0", "recv", -1, 1.0, 4]]})
    assert found is None or -1 not in found["culprits"]


def test_sends_to_each_other_are_a_deadlock_and_gone_and_finished_peers_end_chains():
    p2p = {0: [["0", "send", 1, 1.0, 8]], 1: [["0", "send", 0, 1.0, 8]]}
    found = wait_for_graph({}, {"0": (0, 1)}, p2p=p2p)
    assert found["culprits"] == [0, 1]
    assert {c["cause"] for c in found["causes"].values()} == {"deadlock"}
    recv = {1: [["0", "recv", 0, 1.0, 8]]}
    assert wait_for_graph({}, {}, {0}, p2p=recv)["causes"] == {0: {"cause": "gone"}}
    done = wait_for_graph({}, {}, finished={0}, p2p=recv)
    assert done["culprits"] == [1] and done["causes"][1] == {"cause": "teardown", "for": [0]}


def test_a_p2p_wait_binds_before_a_collective_in_flight_and_bad_rows_are_ignored():
    """A rank inside a recv also has an all_reduce in flight (issued async): the recv binds;
    rows that are not P2P rows are skipped."""
    members = {"0": (0, 1, 2)}
    status = {0: {"0": [3, 3]}, 1: {"0": [4, 3]}, 2: {"0": [4, 3]}}
    p2p = {1: [["0", "recv", 2, 5.0, 8], ["0", "bogus", 0], "x", ["0", "recv", "2"]]}
    found = wait_for_graph(status, members, p2p=p2p)
    assert found["waits"][1]["op"] == "recv" and found["waits"][1]["for"] == [2]
    assert found["waits"][2]["for"] == [0] and found["culprits"] == [0]
    assert found["chains"] == [[1, 2, 0]]


# --- the hang in words --------------------------------------------------------------------

def msg(mtype: str, rank: int, seq: int, body: dict, t: float = 1000.0) -> Message:
    return protocol.decode(protocol.encode(mtype, "job", rank, seq, body, t))


def test_the_hang_says_who_waits_in_which_recv_and_names_the_stage_with_its_stack():
    from scalemon.state.jobstate import JobState

    st = JobState(hang_after_s=10.0)
    for rank in (0, 1, 2):
        st.apply(msg("hello", rank, 0, {"host": "h", "pid": 10 + rank, "world_size": 3,
                                        "local_rank": rank}))
    groups = {"0": {"desc": "default_pg", "ranks": [0, 1, 2]},
              "1": {"desc": "mesh_pp", "ranks": [0, 1, 2]}}
    st.apply(msg("collectives", 0, 1, {"groups": groups, "stats": [], "issues": []}))
    for rank in (0, 1, 2):
        st.apply(msg("step", rank, 2, {"step": 4}))
        st.apply(msg("heartbeat", rank, 3, {
            "phase": "python" if rank == 0 else "collective", "dropped": 0,
            "groups": {"0": [6, 6], "1": [0, 0]},
            "stack": f'  File "stage.py", line {rank + 7}, in stage{rank}\n'}, t=1020.0))
    inflight = {1: [["1", "recv", 0, 1001.0, 64]], 2: [["1", "recv", 1, 1002.0, 64]]}
    for rank, items in inflight.items():
        st.ranks[rank].metrics["p2p_inflight"] = items  # the heartbeat's (protocol 1.11)
    hang = job_hang(st, now=1030.0)
    assert hang["culprits"] == [0] and hang["waiting"] == [1, 2]
    assert hang["chains"] == [[2, 1, 0]]
    assert hang["text"] == (
        "rank 0 never issued send to rank 1 of pp [0,1,2] (in Python: stage.py:7 in stage0()); "
        "rank 1 waits in recv from rank 0 of pp [0,1,2] (29 s); "
        "rank 2 waits in recv from rank 1 of pp [0,1,2] (28 s)")
    assert [w["text"] for w in hang["waits"]] == [
        "rank 1: waiting in recv from rank 0 of pp [0,1,2] (29 s)",
        "rank 2: waiting in recv from rank 1 of pp [0,1,2] (28 s)"]
    assert hang["waits"][0]["peer"] == 0 and hang["waits"][0]["seq"] is None
    assert hang["causes"][0]["frame"] == "stage.py:7 in stage0()"
    assert hang["ranks"]["1"]["p2p_inflight"] == inflight[1]


def test_a_waiting_ranks_frame_is_its_own_code_not_the_agents_timed_wait():
    """A rank blocked in recv has the agent's timed `Work.wait` innermost in its stack (in a
    checkout the agent is the repo's agent/, not under site-packages): its frame is the
    script's line that called recv."""
    import importlib.util

    from scalemon.reports.hangs import user_frame

    agent_dir = importlib.util.find_spec("scalemon.agent").submodule_search_locations[0]
    stack = (f'  File "/home/u/train.py", line 90, in step\n    dist.recv(x, 0)\n'
             f'  File "/x/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py",'
             f' line 2799, in recv\n    work.wait()\n'
             f'  File "{agent_dir}/p2p.py", line 222, in wait\n    result = fn(work)\n')
    assert user_frame(stack) == "train.py:90 in step()"
