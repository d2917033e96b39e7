"""Point-to-point ops, all_to_all sizes, the mesh and the pipeline as the agent reports them
(`agent/p2p.py`, `agent/mesh.py`): units of the op-id arithmetic, the step fields and the NCCL
names, then real gloo ranks (torch.multiprocessing) under a `Run` that sends to a real hub."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import free_port, hub_messages
from scalemon import protocol
from scalemon.agent.mesh import mesh_from_groups
from scalemon.agent.p2p import OpIds, StepP2P, step_fields
from scalemon.collectives import P2PStats, p2p_group_ranks

# --- units ---------------------------------------------------------------------------------


def test_op_ids_become_collective_sequence_numbers():
    """all_reduce (op 1), 3 sends (ops 2-4), all_reduce (op 5), 2 recvs (6-7), all_reduce (8):
    the collectives are 1, 2, 3."""
    ids = OpIds()
    for op_id in (2, 3, 4, 6, 7):
        ids.add(op_id)
    assert [ids.collective_seq(x) for x in (1, 5, 8)] == [1, 2, 3]
    assert ids.total == 5 and [r[:2] for r in ids.runs] == [[2, 4], [6, 7]]


def test_step_fields_are_null_without_p2p_and_the_bubble_is_a_fraction():
    assert step_fields(None, 1.0) == dict.fromkeys(step_fields(None, 1.0))
    counters = StepP2P()
    counters.count, counters.nbytes, counters.wait_s = 4, 64, 0.25
    counters.waits = {1: 0.2, None: 0.05}
    counters.touched = True
    body = step_fields(counters.take(), 0.5)
    assert body["p2p_count"] == 4 and body["p2p_bytes"] == 64
    assert body["p2p_waits"] == {"1": 0.2, "any": 0.05}
    assert body["pipeline_bubble"] == 0.5 and body["a2a_send_bytes"] is None
    assert counters.take() is None  # taken: the next step starts from nothing
    counters.add_a2a(100, 40)
    body = step_fields(counters.take(), None)
    assert body["p2p_count"] is None and body["pipeline_bubble"] is None
    assert (body["a2a_send_bytes"], body["a2a_recv_bytes"]) == (100, 40)
    assert step_fields((1, 8, 3.0, {0: 3.0}, None, None), 2.0)["pipeline_bubble"] == 1.0


def test_nccl_p2p_names_give_sender_and_receiver():
    assert p2p_group_ranks("nccl:send 0->1") == ("send", 0, 1)
    assert p2p_group_ranks("nccl:recv 1<-0") == ("recv", 0, 1)
    assert p2p_group_ranks("nccl:all_reduce") is None
    stats = P2PStats()
    stats.add("0", "send", 0, 1, 16, 0.5)
    stats.add("0", "send", 0, 1, 16, None)
    assert stats.to_wire() == [["0", "send", 0, 1, 2, 32, 0.5, 1]]


def test_nccl_p2p_entries_become_p2p_rows_in_global_ranks():
    """A pipeline group of global ranks [2, 6]: NCCL's group ranks 0 and 1 are ranks 2 and 6,
    and its P2P entries go to `p2p` rows, never to `stats`."""
    import pickle

    from test_collectives import FakeSource, entry

    from scalemon.agent.recorder import Recorder

    class NcclRing(FakeSource):
        name = "nccl"

        def _dump(self, includeCollectives: bool, onlyActive: bool) -> bytes:  # noqa: N803
            return pickle.dumps({"version": "2.10", "pg_config": {"3": {"ranks": "[2, 6]"}},
                                 "pg_status": {}, "entries": list(self.entries)})

    sent = []
    send = entry(1, 0, "send 0->1", numel=256, group="3", desc="mesh_pp", backend="nccl",
                 is_p2p=True, state="completed", duration_ms=2.0, p2p_seq_id=1)
    recv = entry(2, 0, "recv 0<-1", numel=256, group="3", desc="mesh_pp", backend="nccl",
                 is_p2p=True, state="completed", duration_ms=3.0, p2p_seq_id=2)
    source = NcclRing()
    source.entries = [send, recv]
    recorder = Recorder(lambda t, b: sent.append((t, b)) or True, 0, lambda: None,
                        lambda: 1, nccl=True, sources=[source], start=False)
    recorder.read_all(False)
    body = next(b for t, b in sent if t == "collectives")
    assert body["stats"] == []
    assert sorted(body["p2p"]) == [["3", "recv", 6, 2, 1, 1024, 0.003, 1],
                                   ["3", "send", 2, 6, 1, 1024, 0.002, 1]]
    protocol.check_body("collectives", body)


class Group:
    def __init__(self, desc: str, ranks: list[int]) -> None:
        self.group_desc, self.ranks = desc, ranks


def test_the_mesh_is_found_from_groups_named_by_dimension():
    groups = {Group("default_pg", [0, 1, 2, 3]): "0", Group("mesh_dp", [1, 3]): "2",
              Group("mesh_tp", [2, 3]): "4", Group("mesh_dp_tp", [0, 1, 2, 3]): "5"}
    found = mesh_from_groups(groups, 3, lambda g: g.ranks)
    assert found == {"coords": {"dp": 1, "tp": 1}, "shape": {"dp": 2, "tp": 2},
                     "source": "groups"}
    assert mesh_from_groups({Group("default_pg", [0, 1]): "0"}, 0, lambda g: g.ranks) is None
    # a flattened dimension whose name is not its parts' (the demo's "dp_all", torchtitan's
    # "dp"), and torch's "default" for a dimension that reuses the default group: no axes
    groups = {Group("mesh_pp", [0, 4]): "1", Group("mesh_dp", [0, 2]): "2",
              Group("mesh_ep", [0, 1]): "3", Group("mesh_dp_all", [0, 1, 2, 3]): "4",
              Group("mesh_default", [0, 1, 2, 3, 4, 5, 6, 7]): "0"}
    assert mesh_from_groups(groups, 0, lambda g: g.ranks)["coords"] == {"pp": 0, "dp": 0,
                                                                         "ep": 0}


# --- real gloo ranks -------------------------------------------------------------------------

WORKER = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    import torch.multiprocessing as mp

    def worker(rank, world, port, job, hub):
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from scalemon.agent.run import Run
        scenario(rank, world, job, hub, Run)
        dist.destroy_process_group()

    {scenario}

    if __name__ == "__main__":
        world = int(sys.argv[1])
        mp.spawn(worker, args=(world, int(sys.argv[2]), sys.argv[3], sys.argv[4]), nprocs=world)
""")


def run_ranks(hub, world: int, scenario: str, timeout: float = 150.0, **env: str) -> list:
    """Run `scenario(rank, world, job, hub, Run)` on `world` gloo ranks; the hub's records."""
    import os

    script = hub.home / f"ranks-{hub.job}.py"  # a file: spawned children import it
    script.write_text(WORKER.replace("{scenario}", textwrap.dedent(scenario)))
    done = subprocess.run([sys.executable, str(script), str(world), str(free_port()), hub.job,
                           hub.address.base], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return hub_messages(hub, exits=world, timeout=30)


PIPELINE = """
    def scenario(rank, world, job, hub, Run):
        run = Run(job=job, hub=hub, heartbeat_s=0.5)
        run.describe_pipeline("1f1b", 2, 4)
        peer = 1 - rank
        x = torch.ones(16)  # 64 bytes
        # step 1: all_reduce, 3 sends 0 -> 1, all_reduce (the sequence numbers' case)
        dist.all_reduce(x)
        for _ in range(3):
            dist.send(x, 1) if rank == 0 else dist.recv(x, 0)
        dist.all_reduce(x)
        run.log(1)
        # step 2: rank 0 is late with its send; rank 1 waits for it
        if rank == 0:
            time.sleep(0.3)
            dist.send(x, 1)
        else:
            dist.recv(x, 0)
        run.log(2)
        # step 3: isend/irecv, then batch_isend_irecv both ways
        work = dist.isend(x, 1) if rank == 0 else dist.irecv(x, 0)
        work.wait()
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, torch.zeros(16), peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        run.log(3)
        # step 4: all_to_all_single, uneven: rank r sends 1 + r rows of 4 floats to each rank
        rows = 1 + rank
        out_splits = [1 + r for r in range(world)]
        out = torch.empty(sum(out_splits), 4)
        dist.all_to_all_single(out, torch.ones(rows * world, 4), out_splits, [rows] * world)
        dist.all_reduce(x)
        run.log(4)
        # then rank 1 waits in a recv for longer than the hang threshold
        if rank == 0:
            time.sleep(4.0)
            dist.send(x, 1)
        else:
            dist.recv(x, 0)
        run.log(5)
        dist.all_reduce(x)
        run.finish()
"""


@pytest.fixture(scope="module")
def pipeline_job() -> Iterator[list]:
    """The records of one 2-rank run of PIPELINE (a hang threshold of 2 s)."""
    from conftest import HubProcess

    home = Path(tempfile.mkdtemp(prefix="smp", dir="/tmp"))  # short: ipc socket paths
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SCALEMON_HOME", str(home))
        hub = HubProcess(home, "agentP2P", "--hang-after", "2")
        try:
            yield run_ranks(hub, 2, PIPELINE, SCALEMON_HANG_AFTER="2")
        finally:
            hub.kill()
            shutil.rmtree(home, ignore_errors=True)


def steps_of(messages: list, rank: int) -> dict[int, dict]:
    return {m.body["step"]: m.body for m in messages if m.type == "step" and m.rank == rank}


def p2p_rows(messages: list, rank: int) -> dict[tuple, list]:
    """Rank `rank`'s `collectives.p2p` rows summed by (group, op, src, dst)."""
    out: dict[tuple, list] = {}
    for m in messages:
        if m.type == "collectives" and m.rank == rank:
            for g, op, src, dst, count, nbytes, time_s, timed in m.body.get("p2p") or ():
                row = out.setdefault((g, op, src, dst), [0, 0, 0.0, 0])
                for i, v in enumerate((count, nbytes, time_s, timed)):
                    row[i] += v
    return out


@pytest.mark.integration
def test_every_send_and_recv_is_a_row_with_its_peers_and_bytes(pipeline_job):
    """3 sends (step 1), 1 (step 2), 1 isend (step 3), 1 from the batch, 1 after the hang: 7
    sends 0 -> 1 of 64 bytes; and the batch's send 1 -> 0."""
    rows0, rows1 = p2p_rows(pipeline_job, 0), p2p_rows(pipeline_job, 1)
    assert rows0[("0", "send", 0, 1)][:2] == [7, 7 * 64]
    assert rows0[("0", "recv", 1, 0)][:2] == [1, 64]
    assert rows1[("0", "recv", 0, 1)][:2] == [7, 7 * 64]
    assert rows1[("0", "send", 1, 0)][:2] == [1, 64]
    assert set(rows0) == {("0", "send", 0, 1), ("0", "recv", 1, 0)}
    assert set(rows1) == {("0", "recv", 0, 1), ("0", "send", 1, 0)}
    for rows in (rows0, rows1):
        for count, _, time_s, timed in rows.values():
            assert timed == count and time_s > 0
    recv_time = rows1[("0", "recv", 0, 1)][2]
    assert recv_time > 0.3 + 3.0  # the late send and the hang were waited for


@pytest.mark.integration
def test_a_late_send_is_the_receivers_wait_and_bubble(pipeline_job):
    steps0, steps1 = steps_of(pipeline_job, 0), steps_of(pipeline_job, 1)
    late = steps1[2]
    assert late["p2p_wait_s"] >= 0.25 and set(late["p2p_waits"]) == {"0"}
    assert late["p2p_waits"]["0"] == late["p2p_wait_s"]
    assert late["p2p_count"] == 1 and late["p2p_bytes"] == 64
    assert 0.0 <= late["pipeline_bubble"] <= 1.0 and late["pipeline_bubble"] > 0.25
    assert steps0[2]["p2p_wait_s"] < 0.2  # the sender hardly waited
    assert steps0[1]["pipeline_bubble"] is None  # the first step has no step time
    assert steps1[3]["p2p_count"] == 3 and set(steps1[3]["p2p_waits"]) == {"0"}
    assert steps0[4]["p2p_count"] is None and steps0[4]["pipeline_bubble"] is None
    assert steps1[5]["p2p_wait_s"] > 3.0 and steps1[5]["pipeline_bubble"] > 0.6


@pytest.mark.integration
def test_all_to_all_split_sizes_give_the_bytes_sent_and_received(pipeline_job):
    for rank in (0, 1):
        body = steps_of(pipeline_job, rank)[4]
        assert body["a2a_send_bytes"] == (1 + rank) * 2 * 4 * 4
        assert body["a2a_recv_bytes"] == (1 + 2) * 4 * 4
        assert steps_of(pipeline_job, rank)[3]["a2a_send_bytes"] is None


@pytest.mark.integration
def test_groups_carrying_p2p_count_collectives_only_and_host_times_match(pipeline_job):
    """On the default group: all_reduce x2 (step 1), all_to_all + all_reduce (step 4),
    all_reduce (end) = 5 collectives, beside 9 P2P ops on rank 0: the status says 5, and each
    collective got its host-timed duration (matched by collective sequence number)."""
    for rank in (0, 1):
        beats = [m.body for m in pipeline_job if m.type == "heartbeat" and m.rank == rank]
        assert beats[-1]["groups"]["0"] == [5, 5], beats[-1]["groups"]
        rows = [row for m in pipeline_job if m.type == "collectives" and m.rank == rank
                for row in m.body["stats"]]
        assert sum(r[3] for r in rows) == 5
        # timed == count per (group, op, size): a duration may come in a later message than
        # its collective (read between the enqueue and the host call's return)
        sums: dict[tuple, list[int]] = {}
        for r in rows:
            total = sums.setdefault(tuple(r[:3]), [0, 0])
            total[0] += r[3]
            total[1] += r[5]
        assert all(count == timed for count, timed in sums.values()), rows
        assert sum(r[3] for r in rows if r[1] == "all_reduce") == 4


@pytest.mark.integration
def test_a_rank_stuck_in_recv_names_the_peer_it_waits_for(pipeline_job):
    stuck = [m.body for m in pipeline_job if m.type == "heartbeat" and m.rank == 1
             and m.body.get("p2p_inflight")]
    assert stuck, "no heartbeat of rank 1 listed P2P ops in flight"
    beat = stuck[-1]
    assert all(b["phase"] == "collective" and b["stack"] for b in stuck)
    [row] = beat["p2p_inflight"]
    group, op, peer, t, nbytes = row
    assert (group, op, peer, nbytes) == ("0", "recv", 0, 64) and t > 1e9
    assert not any(m.body.get("p2p_inflight") for m in pipeline_job
                   if m.type == "heartbeat" and m.rank == 0)


@pytest.mark.integration
def test_the_pipeline_is_described(pipeline_job):
    infos = [m.body["value"] for m in pipeline_job if m.type == "info"
             and m.body["key"] == "pipeline"]
    assert infos == [{"schedule": "1f1b", "stages": 2, "microbatches": 4}] * 2


MESH = """
    def scenario(rank, world, job, hub, Run):
        from torch.distributed.device_mesh import init_device_mesh
        if rank >= 2:  # the agent first: the mesh is found among the groups
            run = Run(job=job, hub=hub)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        if rank < 2:  # given to init()
            run = Run(job=job, hub=hub, mesh=mesh)
        dist.all_reduce(torch.ones(4), group=mesh.get_group("tp"))
        run.log(1)
        time.sleep(2.5)  # the recorder's thread looks at the groups once a second
        run.log(2)
        run.finish()
"""


@pytest.mark.integration
def test_the_mesh_comes_from_init_or_from_the_groups(start_hub):
    hub = start_hub("agentMesh")
    messages = run_ranks(hub, 4, MESH)
    infos = {m.rank: m.body["value"] for m in messages if m.type == "info"
             and m.body["key"] == "mesh"}
    assert sorted(infos) == [0, 1, 2, 3]
    for rank, value in infos.items():
        assert value["coords"] == {"dp": rank // 2, "tp": rank % 2}, (rank, value)
        assert value["shape"] == {"dp": 2, "tp": 2}
        assert value["source"] == ("init" if rank < 2 else "groups")
    assert sum(m.type == "info" and m.body["key"] == "mesh" for m in messages) == 4  # once


def test_the_wrappers_are_installed_with_the_host_timer_and_removed_with_it(tmp_path):
    """The P2P methods are replaced (once: a second timer leaves them) while the timer is
    installed, and put back after; a collective's `wait()` passes through untouched."""
    import torch
    import torch.distributed as dist

    from scalemon.agent import c10d
    from scalemon.agent.hosttiming import HostTimer

    group_cls, work_cls = c10d.p2p_classes()
    names = ("send", "recv", "recv_anysource")
    originals = [vars(group_cls)[n] for n in names] + [vars(work_cls)["wait"]]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    timer, second = HostTimer(), HostTimer()
    try:
        timer.install()
        second.install()
        assert vars(group_cls)["send"] is not originals[0]
        assert vars(work_cls)["wait"] is not originals[3]
        assert not second.p2p._originals  # the first timer's wrappers stay in place
        dist.all_reduce(torch.ones(4), async_op=True).wait()
        assert timer.p2p.step.take() is None and not timer.p2p.inflight
        second.remove()
        timer.remove()
        assert [vars(group_cls)[n] for n in names] + [vars(work_cls)["wait"]] == originals
        dist.all_reduce(torch.ones(4), async_op=True).wait()  # the method binds as before
    finally:
        timer.remove()
        dist.destroy_process_group()


def test_a_mesh_seen_half_made_is_sent_only_once_whole_or_settled(monkeypatch) -> None:
    """init_device_mesh makes its groups a dimension at a time: the watcher, looking from the
    recorder's thread between two of them, must not say the half it saw."""
    import torch.distributed as dist

    from scalemon.agent import c10d
    from scalemon.agent.mesh import MeshWatcher

    class Group:
        def __init__(self, desc: str, ranks: list[int]) -> None:
            self.group_desc, self.ranks = desc, ranks

    made: dict = {}
    monkeypatch.setattr(c10d, "group_names", lambda: dict(made))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda pg: pg.ranks)
    sent: list = []
    watcher = MeshWatcher(lambda mtype, body: sent.append(body["value"]))
    made[Group("mesh_dp", [1, 3])] = "g1"  # the dp dimension made, tp not yet
    watcher.check()
    assert sent == []  # 2 ranks of 4: maybe half made
    made[Group("mesh_tp", [2, 3])] = "g2"
    watcher.check()  # whole: at once
    assert sent == [{"coords": {"dp": 1, "tp": 1}, "shape": {"dp": 2, "tp": 2},
                     "source": "groups"}]
    watcher.check()
    assert len(sent) == 1

    other = MeshWatcher(lambda mtype, body: sent.append(body["value"]))
    made.clear()
    made[Group("mesh_pp", [1, 3])] = "g3"  # a mesh of part of the world, for good
    other.check()
    assert len(sent) == 1
    other.check()  # the groups stayed as they were: sent
    assert sent[-1]["shape"] == {"pp": 2} and len(sent) == 2
