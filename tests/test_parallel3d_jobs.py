"""3-D parallel jobs under the monitor, end to end (issue #36): the demo trainer with pipeline x
tensor parallel and with expert parallel, as real torchrun jobs of gloo ranks on the CPU, the
hub the ranks start, and `scalemon snapshot --json` as users run it: each rank's place in the
mesh, the stage-to-stage sends and receives, the pipeline bubble, groups named by their mesh
dimension, all_to_all rows and the routing imbalance."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_collectives_jobs import job_env, snapshot

from conftest import REPO, kill_tree, torchrun_cmd, wait_for

pytestmark = pytest.mark.integration


def finished(home, nproc: int) -> dict:
    """The snapshot once every rank finished and the collectives of the last read are in."""
    return wait_for(lambda: (s := snapshot(home)) and len(s["ranks"]) == nproc and all(
        r["state"] == "finished" for r in s["ranks"]) and s, timeout=40, interval=0.5)


def test_pp2_tp2_losses_mesh_sends_and_bubble(home, tmp_path):
    """`torchrun --nproc-per-node 4 train.py --pp 2 --tp 2 --monitor`: the losses equal the one
    rank run's (same global batch) at every step; the snapshot names each rank's mesh place,
    the sends and receives between the stages with their ranks, each rank's bubble beside the
    schedule's theoretical one, and the groups by their mesh dimension."""
    flags = ("--amp", "off", "--max-steps", "10")
    stats = tmp_path / "pp_tp.json"
    done = subprocess.run(torchrun_cmd(*flags, "--pp", "2", "--tp", "2", "--monitor",
                                       "--stats-json", str(stats), nproc=4),
                          env=job_env(home), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    one = tmp_path / "one.json"
    alone = subprocess.run([sys.executable, str(REPO / "demo_train" / "train.py"), "--device",
                            "cpu", *flags, "--stats-json", str(one)],
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stdout[-2000:] + alone.stderr[-2000:]
    got, want = json.loads(stats.read_text()), json.loads(one.read_text())
    assert got["steps"] == want["steps"] == list(range(1, 11))
    for step, a, b in zip(got["steps"], got["losses"], want["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-4), f"step {step}: pp2 x tp2 {a} vs one rank {b}"

    state = finished(home, 4)
    meshes = {r["rank"]: r["mesh"] for r in state["ranks"]}
    assert meshes == {r: {"pp": r // 2, "dp": 0, "tp": r % 2} for r in range(4)}, meshes
    labels = {g["label"] for g in state["groups"].values()}
    assert {"tp [0,1]", "tp [2,3]"} <= labels, labels
    p2p = [row for row in state["collectives"] if row["op"] in ("send", "recv")]
    pairs = {(row["op"], row["src"], row["dst"]) for row in p2p}
    # activations forward (stage 0 -> 1), gradients backward (1 -> 0), per tp rank
    for src, dst in ((0, 2), (1, 3), (2, 0), (3, 1)):
        assert ("send", src, dst) in pairs and ("recv", src, dst) in pairs, pairs
    assert all(row["count"] > 0 and row["bytes"] > 0 for row in p2p)
    bubbles = [r["pipeline_bubble"] for r in state["ranks"]]
    assert all(b is not None and 0.0 <= b <= 1.0 for b in bubbles), bubbles
    pipeline = state["pipeline"]
    assert (pipeline["stages"], pipeline["schedule"]) == (2, "1f1b"), pipeline
    m = pipeline["microbatches"]
    assert pipeline["theoretical_bubble"] == pytest.approx(1 / (m + 1))
    assert pipeline["measured_bubble"] is not None


def test_expert_parallel_shows_all_to_all_and_the_routing_imbalance(home, tmp_path):
    """`torchrun --nproc-per-node 2 train.py --experts 4 --ep 2 --monitor`: the all_to_all
    dispatch and combine are rows with each rank's bytes, and the routing imbalance is there."""
    done = subprocess.run(torchrun_cmd("--amp", "off", "--max-steps", "6", "--experts", "4",
                                       "--ep", "2", "--monitor", nproc=2),
                          env=job_env(home), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "moe: imbalance" in done.stdout, done.stdout[-2000:]
    state = finished(home, 2)
    a2a = [row for row in state["collectives"] if row["op"].startswith("all_to_all")]
    assert a2a and all(row["count"] > 0 for row in a2a), state["collectives"]
    for rank in state["ranks"]:
        assert rank["a2a_send_bytes"] and rank["a2a_recv_bytes"], rank
        assert rank["extra"]["moe_imbalance"] >= 1.0, rank
    moe = state["moe"]
    assert moe["imbalance"] >= 1.0 and moe["a2a_recv_imbalance"] >= 1.0, moe


def test_a_slow_pipeline_stage_is_named_the_straggler_its_neighbour_waits_for(home, tmp_path):
    """Stage 1 of two sleeps 0.2 s before each backward (`--slow-rank 1:0.2`): stage 0 waits
    for it in its P2P ops, so stage 1, not stage 0, is named the straggler while the job runs,
    by its neighbour's waits."""
    out = tmp_path / "job.out"
    with open(out, "w") as log:
        proc = subprocess.Popen(
            torchrun_cmd("--amp", "off", "--max-steps", "400", "--pp", "2", "--slow-rank",
                         "1:0.2", "--monitor", nproc=2),
            env=job_env(home), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # both ranks seen: rank 0 may name its neighbour before rank 1's first message
        # reached the hub (a loaded machine)
        state = wait_for(lambda: (s := snapshot(home)) and s["stragglers"]
                         and len(s["ranks"]) == 2 and s, timeout=150, interval=1.0)
        named = state["stragglers"]
        assert [s["rank"] for s in named] == [1], named
        assert named[0]["measure"] == "p2p_waits" and named[0]["value_s"] > 0.1, named
        assert named[0]["reason"].startswith("its pipeline neighbours wait"), named
        waits = {r["rank"]: r["p2p_waits"] for r in state["ranks"]}
        assert waits[0]["1"] > 0.1 and waits[1].get("0", 0.0) < waits[0]["1"], waits
    finally:
        kill_tree(proc)
