"""The state and reports of a 3-D parallel job: P2P rows folded per rank and shown beside the
collectives, each rank's place in the mesh, the pipeline's bubble (theoretical and measured),
the MoE routing's balance, groups named by their mesh dimension, a pipeline straggler."""

from __future__ import annotations

import pytest

from scalemon import protocol
from scalemon.protocol import Message
from scalemon.reports import groups as groupnames
from scalemon.reports.pipeline import moe_json, p2p_rows, pipeline_json, theoretical_bubble
from scalemon.reports.snapshot import snapshot_json
from scalemon.reports.stragglers import pipeline_waited, stragglers_json
from scalemon.state.jobstate import JobState

MESH_GROUPS = {"0": {"desc": "default_pg", "ranks": [0, 1, 2, 3]},
               "1": {"desc": "mesh_pp", "ranks": [0, 2]}, "2": {"desc": "mesh_pp", "ranks": [1, 3]},
               "3": {"desc": "mesh_tp", "ranks": [0, 1]}, "4": {"desc": "mesh_tp", "ranks": [2, 3]}}


def msg(mtype: str, rank: int, seq: int, body: dict, t: float = 1000.0) -> Message:
    return protocol.decode(protocol.encode(mtype, "job", rank, seq, body, t))


def job(world: int = 4, groups: dict | None = None) -> JobState:
    st = JobState()
    for rank in range(world):
        st.apply(msg("hello", rank, 0, {"host": "h", "pid": 10 + rank, "world_size": world,
                                        "local_rank": rank}))
    st.apply(msg("collectives", 0, 1, {"groups": groups or MESH_GROUPS, "stats": [],
                                       "issues": []}))
    return st


def test_p2p_rows_are_folded_per_rank_and_shown_with_src_dst_and_bandwidth():
    st = job()
    # stage 0 (rank 0) sends to stage 1 (rank 2) in pp [0,2]; rank 2 receives
    st.apply(msg("collectives", 0, 2, {"groups": {}, "stats": [], "issues": [], "p2p": [
        ["1", "send", 0, 2, 4, 4 << 20, 0.004, 4]]}))
    st.apply(msg("collectives", 0, 3, {"groups": {}, "stats": [], "issues": [], "p2p": [
        ["1", "send", 0, 2, 4, 4 << 20, 0.004, 4], ["1", "sent", 0, 2, 1, 1, 0.0, 0],
        ["1", "send", 0, 2, -1, 1, 0.0, 0], "junk"]}))
    st.apply(msg("collectives", 2, 1, {"groups": {}, "stats": [], "issues": [], "p2p": [
        ["1", "recv", 0, 2, 8, 8 << 20, 0.016, 8]]}))
    assert st.bad_p2p == 3 and st.bad_collectives == 0
    row = st.ranks[0].p2p.rows["1", "send", 0, 2]
    assert (row.count, row.bytes, row.timed) == (8, 8 << 20, 8)
    rows = {r["op"]: r for r in p2p_rows(st)}
    send = rows["send"]
    assert (send["src"], send["dst"], send["count"], send["bytes"]) == (0, 2, 8, 8 << 20)
    assert send["group"] == send["group_label"] == "pp [0,2]"
    assert send["time_s"] == pytest.approx(0.008)
    # bytes per op over the mean measured time: 1 MiB / 1 ms
    assert send["bandwidth_bytes_per_s"] == pytest.approx((1 << 20) / 0.001)
    assert rows["recv"]["bandwidth_bytes_per_s"] == pytest.approx((1 << 20) / 0.002)
    out = snapshot_json(st, now=1000.0)
    table = [r for r in out["collectives"] if r["op"] in ("send", "recv")]
    assert len(table) == 2
    assert {"src", "dst", "count", "bytes", "time_s", "bandwidth_bytes_per_s", "ranks",
            "time_p50_s", "busbw_gbps", "group", "sizes"} <= set(table[0])


def test_each_rank_has_its_mesh_coordinates_from_its_info_or_from_the_mesh_groups():
    st = job()
    assert st.mesh(3) == {"pp": 1, "tp": 1}  # from the groups: index in each dim's ranks
    assert st.job_mesh() == {"dims": ["pp", "tp"], "shape": {"pp": 2, "tp": 2}, "source": "hub"}
    for rank in range(4):
        st.apply(msg("info", rank, 5, {"key": "mesh", "value": {
            "coords": {"pp": rank // 2, "dp": 0, "tp": rank % 2},
            "shape": {"pp": 2, "dp": 1, "tp": 2}, "source": "init"}}))
    st.apply(msg("info", 1, 6, {"key": "mesh", "value": {"coords": {"pp": "x"}}}))
    out = snapshot_json(st, now=1000.0)
    assert {r["rank"]: r["mesh"] for r in out["ranks"]} == {
        0: {"pp": 0, "dp": 0, "tp": 0}, 1: {"pp": 0, "tp": 1},  # a bad info: the groups'
        2: {"pp": 1, "dp": 0, "tp": 0}, 3: {"pp": 1, "dp": 0, "tp": 1}}
    assert out["mesh"] == {"dims": ["pp", "dp", "tp"], "shape": {"pp": 2, "dp": 1, "tp": 2},
                           "source": "init"}
    assert JobState().job_mesh() is None and job(2, {"0": {"desc": "default_pg",
                                                           "ranks": [0, 1]}}).mesh(0) is None


def test_a_flattened_mesh_dimension_is_no_axis_but_its_group_is_named():
    groups = {"1": {"desc": "mesh_dp", "ranks": [0, 2]}, "2": {"desc": "mesh_dp",
                                                               "ranks": [1, 3]},
              "3": {"desc": "mesh_cp", "ranks": [0, 1]}, "4": {"desc": "mesh_cp",
                                                               "ranks": [2, 3]},
              "5": {"desc": "mesh_dp_cp", "ranks": [0, 1, 2, 3]}}
    st = job(4, groups)
    assert st.mesh(0) == {"dp": 0, "cp": 0} and st.mesh(3) == {"dp": 1, "cp": 1}
    assert st.job_mesh()["dims"] == ["dp", "cp"]
    assert groupnames.group_label(st.groups, "5") == "dp_cp [0-3]"


def test_groups_of_a_mesh_dimension_are_named_by_the_dimension_and_their_ranks():
    groups = {**MESH_GROUPS, "5": {"desc": "mesh_tp", "ranks": [2, 3]},
              "6": {"desc": "", "ranks": [0, 1]}}
    assert groupnames.group_desc(groups, "4") == "tp [2,3] (4)"  # two alike: by name too
    assert groupnames.group_label(groups, "3") == "tp [0,1]"
    assert groupnames.group_label(groups, "1") == "pp [0,2]"
    assert groupnames.group_label(groups, "0") == "default_pg [0-3]"
    assert groupnames.group_label(groups, "6") == "group 6 [0,1]"
    assert groupnames.mesh_dim("mesh_dp_all") == "dp_all" and groupnames.mesh_dim("mesh_") is None
    names = snapshot_json(job(), now=1000.0)["groups"]
    assert {"pp [0,2]", "pp [1,3]", "tp [0,1]", "tp [2,3]", "default_pg"} == set(names)


@pytest.mark.parametrize(("schedule", "p", "m", "v", "bubble"), [
    ("gpipe", 2, 4, None, 1 / 5), ("1F1B", 4, 8, None, 3 / 11),
    ("Schedule1F1B", 2, 2, None, 1 / 3), ("interleaved", 4, 8, 2, 3 / 19),
    ("ScheduleInterleaved1F1B", 2, 4, None, 1 / 5), ("zbv", 2, 4, None, None),
    ("gpipe", 2, None, None, None)])
def test_the_theoretical_bubble_of_each_schedule(schedule, p, m, v, bubble):
    assert theoretical_bubble(schedule, p, m, v) == (
        pytest.approx(bubble) if bubble is not None else None)


def set_latest(st: JobState, rank: int, **values: object) -> None:
    """A rank's latest step values (protocol 1.11 step fields and extras), as folded."""
    st.ranks[rank].metrics.update(values)


def test_the_pipeline_shows_the_schedules_bubble_beside_the_measured_one():
    st = job()
    assert pipeline_json(st) is None and snapshot_json(st, now=1000.0)["pipeline"] is None
    st.apply(msg("info", 0, 5, {"key": "pipeline", "value": {
        "schedule": "1f1b", "stages": 2, "microbatches": 4}}))
    for rank, bubble in enumerate((0.30, 0.20, 0.25, None)):
        set_latest(st, rank, pipeline_bubble=bubble)
    out = snapshot_json(st, now=1000.0)["pipeline"]
    assert out == {"schedule": "1f1b", "stages": 2, "microbatches": 4, "virtual_stages": None,
                   "theoretical_bubble": pytest.approx(0.2), "measured_bubble": 0.25,
                   "measured_ranks": 3}
    bare = job()  # no description: the stages from the mesh, no theory
    set_latest(bare, 0, pipeline_bubble=0.5)
    assert pipeline_json(bare)["stages"] == 2 and pipeline_json(bare)["theoretical_bubble"] \
        is None


def test_moe_shows_the_all_to_all_imbalance_and_the_dropped_tokens():
    st = job(2, {"0": {"desc": "default_pg", "ranks": [0, 1]}})
    assert moe_json(st) is None
    set_latest(st, 0, a2a_recv_bytes=300, a2a_send_bytes=200)
    set_latest(st, 1, a2a_recv_bytes=100, a2a_send_bytes=200)
    st.ranks[0].extra.update(moe_imbalance=1.5, moe_dropped_tokens=3, moe_aux_loss=0.01)
    st.ranks[1].extra.update(moe_imbalance=1.1, moe_dropped_tokens=4, moe_aux_loss=0.03)
    assert snapshot_json(st, now=1000.0)["moe"] == {
        "a2a_recv_imbalance": 1.5, "a2a_send_imbalance": 1.0, "imbalance": pytest.approx(1.3),
        "dropped_tokens": 7, "aux_loss": pytest.approx(0.02), "ranks": 2}


def test_the_stage_its_neighbours_wait_for_is_the_straggler():
    st = job()
    # rank 2 (stage 1, tp 0) is slow: rank 0 waits 0.4 s per step for it in backward
    for rank, waits in ((0, {"2": 0.4}), (1, {"3": 0.02}), (2, {"0": 0.01}), (3, {"1": 0.02})):
        set_latest(st, rank, p2p_waits=waits, step_time_s=1.0)
    ranks = snapshot_json(st, now=1000.0)["ranks"]
    assert pipeline_waited(ranks) == {0: 0.01, 1: 0.02, 2: 0.4, 3: 0.02}
    (named,) = stragglers_json(ranks)
    assert named == {"rank": 2, "measure": "p2p_waits", "value_s": 0.4, "bar_s": 0.1,
                     "reason": "its pipeline neighbours wait 0.4 s/step for it"}
    for rank in range(4):  # alike: nobody stands out
        set_latest(st, rank, p2p_waits={str((rank + 2) % 4): 0.05})
    assert stragglers_json(snapshot_json(st, now=1000.0)["ranks"]) == []


def test_the_wires_step_and_heartbeat_fields_reach_the_pipeline_stragglers_and_hang():
    """Protocol 1.11 as the agent sends it: step `pipeline_bubble`/`p2p_waits`, heartbeat
    `p2p_inflight`, folded by the reducer into the snapshot's pipeline, stragglers and hang."""
    st = job()
    st.apply(msg("info", 0, 5, {"key": "pipeline", "value": {
        "schedule": "gpipe", "stages": 2, "microbatches": 4}}))
    for rank in range(4):
        waits = {"2": 0.4} if rank == 0 else {str(rank ^ 2): 0.01}
        st.apply(msg("step", rank, 6, {"step": 3, "step_time_s": 1.0, "p2p_count": 8,
                                       "p2p_wait_s": sum(waits.values()), "p2p_waits": waits,
                                       "pipeline_bubble": sum(waits.values())}))
    out = snapshot_json(st, now=1000.0)
    assert out["pipeline"]["measured_bubble"] == pytest.approx(0.01)
    assert out["pipeline"]["theoretical_bubble"] == pytest.approx(0.2)
    assert [(s["rank"], s["measure"]) for s in out["stragglers"]] == [(2, "p2p_waits")]
    st.hang_after_s = 10.0
    for rank in range(4):
        inflight = [["1", "recv", 0, 1001.0, 64]] if rank == 2 else None
        st.apply(msg("heartbeat", rank, 7, {"phase": "collective", "dropped": 0,
                                            "groups": {"0": [3, 3]},
                                            "p2p_inflight": inflight}, t=1020.0))
    hang = snapshot_json(st, now=1030.0)["hang"]
    assert hang["culprits"] == [0] and hang["waiting"] == [2]
    assert "rank 2 waits in recv from rank 0 of pp [0,2]" in hang["text"]
