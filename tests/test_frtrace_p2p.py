"""P2P entries of Flight Recorder dumps (`scalemon dump`'s analysis): NCCL's send/recv entries
(is_p2p, "nccl:send 0->1" / "nccl:recv 1<-0" in group ranks) read with their peer's global
rank, the uncompleted ones in the wait-for graph beside the collectives; gloo's dumps (which
record no P2P) use the hub's heartbeats instead. Dumps built as torch 2.13 writes them."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

from scalemon.reports import frtrace
from scalemon.reports.frread import RankDump

T0 = 1_700_000_000_000_000_000


def entry(record: int, pg: tuple[str, str], seq: int, state: str, name: str = "all_reduce",
          *, p2p: bool = False, op_id: int | None = None) -> dict[str, Any]:
    done = state == "completed"
    return {
        "record_id": record, "pg_id": int(pg[0]), "process_group": list(pg),
        "collective_seq_id": seq, "p2p_seq_id": 1 if p2p else 0,
        "op_id": seq if op_id is None else op_id, "profiling_name": f"nccl:{name}",
        "time_created_ns": T0 + record * 1_000_000_000, "duration_ms": 1.0 if done else None,
        "input_sizes": [[256]], "input_dtypes": ["Float"], "output_sizes": [[256]],
        "output_dtypes": ["Float"], "state": state, "time_discovered_started_ns": None,
        "time_discovered_completed_ns": 2 if done else None, "retired": done,
        "timeout_ms": 600000, "is_p2p": p2p, "thread_id": "1", "thread_name": "pt_main",
        "frames": []}


CONFIG = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
          "1": {"name": "1", "desc": "mesh_pp", "ranks": "[1, 3]"},
          "2": {"name": "2", "desc": "mesh_tp", "ranks": "[2, 3]"}}
DEFAULT, PP, TP = ("0", "default_pg"), ("1", "mesh_pp"), ("2", "mesh_tp")


def dumps() -> dict[int, dict[str, Any]]:
    """Rank 1 (stage 0 of pp [1,3]) stopped before its send; rank 3 waits in recv from it
    (group rank 0 of pp); rank 2 waits in tp [2,3]'s all_reduce #2 for rank 3."""
    out = {}
    for rank in range(4):
        entries = [entry(s, DEFAULT, s, "completed") for s in (1, 2)]
        status = {"0": {"last_enqueued_collective": 2, "last_started_collective": 2,
                        "last_completed_collective": 2}}
        if rank == 3:  # pg_status counts the recv too (an op of its own)
            entries += [entry(5, TP, 1, "completed"), entry(6, PP, 0, "started", "recv 1<-0",
                                                            p2p=True, op_id=1)]
            status["1"] = {"last_enqueued_collective": 1, "last_started_collective": 1,
                           "last_completed_collective": 0}
        if rank == 2:
            entries += [entry(5, TP, 1, "completed"), entry(7, TP, 2, "started")]
        if rank == 1:  # earlier micro-batches' sends completed
            entries += [entry(3, PP, 0, "completed", "send 0->1", p2p=True, op_id=1)]
        out[rank] = {"version": "2.10", "pg_config": CONFIG, "pg_status": status,
                     "entries": entries}
    return out


def write(directory: Path, found: dict[int, dict[str, Any]]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for rank, dump in found.items():
        (directory / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(dump))
    return directory


def test_p2p_entries_are_read_with_the_peers_global_rank():
    dump = RankDump(3)
    dump.add(dumps()[3], "nccl_trace_rank_3")
    (recv,) = [e for e in dump.entries if e.is_p2p]
    assert (recv.op, recv.peer, recv.completed, recv.nbytes) == ("recv", 0, False, 1024)
    assert recv.t == T0 / 1e9 + 6
    assert dump.p2p_inflight({"1": (1, 3)}) == [["1", "recv", 1, recv.t, 1024]]
    assert dump.p2p_inflight({}) == []  # the group's ranks unknown: no peer
    assert dump.groups["1"].issued == 0  # pg_status counted the recv: not a collective


def test_a_stage_stopped_before_its_send_ends_a_chain_through_tp_and_pp(tmp_path):
    report = frtrace.analyse_directory(write(tmp_path / "d", dumps()))
    finding = report["culprit"]
    assert finding["culprits"] == [1] and finding["waiting"] == [2, 3]
    assert finding["causes"] == {"1": {"cause": "python"}}
    assert finding["chains"] == [[2, 3, 1]]
    assert finding["never_issued"] == {"1": ["send to rank 3 of pp [1,3]"]}
    assert report["text"] == ("rank 1 never issued send to rank 3 of pp [1,3]; rank 2 waits in "
                              "all_reduce #2 of tp [2,3] for rank 3; rank 3 waits in recv "
                              "from rank 1 of pp [1,3]")
    labels = {g["label"] for g in report["groups"]}
    assert labels == {"default_pg [0-3]", "pp [1,3]", "tp [2,3]"}
    pp = next(g for g in report["groups"] if g["label"] == "pp [1,3]")
    assert pp["finding"]["culprits"] == [1]  # the group by itself: its recv waits for rank 1
    text = frtrace.report_text(report)
    assert "culprit: rank 1 never issued send to rank 3 of pp [1,3]" in text


def test_gloo_dumps_without_p2p_entries_use_the_heartbeats_p2p_in_flight(tmp_path):
    found = dumps()
    for dump in found.values():  # gloo's recorder keeps no P2P entries
        dump["entries"] = [e for e in dump["entries"] if not e["is_p2p"]]
    directory = write(tmp_path / "g", found)
    (directory / frtrace.CONTEXT_FILE).write_text(json.dumps({
        "members": {"0": [0, 1, 2, 3], "1": [1, 3], "2": [2, 3]},
        "p2p": {"3": [["1", "recv", 1, 1000.0, 1024]]}}))
    report = frtrace.analyse_directory(directory)
    assert report["culprit"]["culprits"] == [1]
    assert report["culprit"]["chains"] == [[2, 3, 1]]
