"""Flight Recorder dumps read by scalemon itself (scalemon/reports/frtrace.py): dumps torch wrote
in a
real 2-rank gloo job (pickle and JSON), hangs and mismatches cut from them, the NCCL format
built as torch writes it, damaged files and files that try to make the reader call something,
and `scalemon dump --dir` on them."""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, free_port
from scalemon.reports import frtrace
from scalemon.reports.frtrace import DumpError
from scalemon.tui.views.hang import _dump_lines


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Dumps of tests/jobs/fr_write.py, written by torch (2 gloo ranks)."""
    out = tmp_path_factory.mktemp("frw")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(REPO / "tests" / "jobs" / "fr_write.py"),
           str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


def load(path: Path) -> dict[str, Any]:
    return frtrace.load_file(path)


def write_dir(directory: Path, dumps: dict[int, dict[str, Any]], prefix: str = "rank_",
              as_json: bool = False) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for rank, dump in dumps.items():
        data = json.dumps(dump).encode() if as_json else pickle.dumps(dump, protocol=2)
        (directory / f"{prefix}{rank}").write_bytes(data)
    return directory


def analysed(directory: Path) -> dict[str, Any]:
    return frtrace.analyse_directory(directory)


def culprit_of(report: dict[str, Any]) -> dict[str, Any]:
    """The report's headline finding without its causes, desyncs and chains."""
    keys = ("group", "seq", "culprits", "waiting", "label", "op")
    return {k: report["culprit"][k] for k in keys}


def by_label(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["label"].split(" [")[0]: g for g in report["groups"]}  # "tp [2,3]" -> "tp"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scalemon.cli", "dump", *args],
                          capture_output=True, text=True, timeout=60)


# --- real gloo dumps ----------------------------------------------------------------------

def test_real_gloo_dumps_read_the_same_as_pickle_and_as_json(real):
    reports = {kind: analysed(real / kind) for kind in ("pickle", "json")}
    for kind, report in reports.items():
        assert report["read"] == [0, 1] and report["missing"] == {}, kind
        assert report["versions"] == ["2.10"] and report["skipped_entries"] == 0
        groups = by_label(report)
        assert sorted(groups) == ["default_pg", "side"]
        assert groups["default_pg"]["ranks"] == [0, 1] and groups["side"]["ranks"] == [0, 1]
        side = groups["side"]["status"]
        assert side["0"] == side["1"] == {
            "last_issued": 2, "last_completed": 2, "issued_op": "all_reduce",
            "completed_op": "all_reduce", "source": "dump", "note": None}
        default = groups["default_pg"]["status"]["1"]
        # 3 all_reduce, all_gather, broadcast, barrier: the send/recv pair between them is
        # counted in pg_status (op ids) but is no collective (collective_seq_id)
        assert (default["last_issued"], default["last_completed"]) == (6, 6)
        assert report["culprit"] is None and "no culprit" in report["text"]
        assert all(g["mismatches"]["count"] == 0 for g in report["groups"])
    assert reports["pickle"]["groups"] == reports["json"]["groups"]
    rank = frtrace.RankDump(0)
    rank.add(load(real / "pickle" / "rank_0"), "rank_0")
    assert [e.op for e in rank.entries] == ["all_reduce"] * 3 + [
        "all_gather", "broadcast", "all_reduce", "all_reduce", "barrier"]
    assert rank.entries[3].output_sizes == [[2, 4, 3]]


def _hung(real: Path) -> dict[int, dict[str, Any]]:
    """The real dumps as if rank 1 never issued default_pg's #6 (the barrier) while rank 0
    waits in it."""
    dumps = {r: load(real / "pickle" / f"rank_{r}") for r in (0, 1)}
    dumps[0]["pg_status"]["0"].update(last_enqueued_collective=6, last_completed_collective=5)
    dumps[1]["pg_status"]["0"].update(last_enqueued_collective=5, last_completed_collective=5)
    dumps[1]["entries"] = [e for e in dumps[1]["entries"] if e["profiling_name"] !=
                           "gloo:barrier"]
    for e in dumps[0]["entries"]:
        if e["profiling_name"] == "gloo:barrier":
            e["retired"] = False  # as gloo leaves the one a rank waits in
    return dumps


def test_a_hang_in_real_dumps_names_the_rank_that_never_issued(real, tmp_path):
    report = analysed(write_dir(tmp_path / "d", _hung(real)))
    assert culprit_of(report) == {"group": "0", "seq": 6, "culprits": [1], "waiting": [0],
                                  "label": "default_pg [0,1]", "op": "barrier"}
    assert report["culprit"]["causes"] == {"1": {"cause": "python"}}
    assert report["culprit"]["chains"] == [[0, 1]]
    assert report["text"] == "rank 1 never issued barrier #6 of default_pg [0,1]; rank 0 " \
                             "waits in barrier #6 of default_pg [0,1] for rank 1"
    status = by_label(report)["default_pg"]["status"]
    assert (status["0"]["last_issued"], status["0"]["last_completed"]) == (6, 5)
    assert (status["1"]["last_issued"], status["1"]["issued_op"]) == (5, "broadcast")
    assert by_label(report)["side"]["finding"] is None
    text = frtrace.report_text(report)
    assert "culprit: rank 1 never issued barrier #6 of default_pg [0,1]" in text
    assert "  1      #5 broadcast  #5 broadcast    culprit" in text


def test_ops_dtypes_and_sizes_that_differ_at_one_sequence_number_are_mismatches(real, tmp_path):
    dumps = {r: load(real / "pickle" / f"rank_{r}") for r in (0, 1)}
    one = {e["collective_seq_id"]: e for e in dumps[1]["entries"] if e["pg_id"] == 0}
    one[2]["input_dtypes"] = ["Half"]
    one[3]["input_sizes"] = [[4, 4]]
    one[4]["profiling_name"] = "gloo:reduce_scatter"
    report = analysed(write_dir(tmp_path / "d", dumps))
    found = by_label(report)["default_pg"]["mismatches"]
    assert found["count"] == 3
    assert [(m["seq"], m["field"]) for m in found["first"]] == [
        (2, "dtypes"), (3, "sizes"), (4, "op")]
    assert found["first"][2]["by_rank"] == {
        "0": "all_gather in [[4, 3]] out [[2, 4, 3]] Float",
        "1": "reduce_scatter in [[4, 3]] out [[2, 4, 3]] Float"}
    text = frtrace.report_text(report)
    assert "MISMATCH of op at #4: rank 0: all_gather" in text
    assert by_label(report)["side"]["mismatches"]["count"] == 0


# --- damaged and hostile files ------------------------------------------------------------

class _Calls:
    """Unpickling this calls os.system: what a hostile 'dump' would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_file_that_names_a_callable_is_refused_and_nothing_is_called(real, tmp_path):
    marker = tmp_path / "called"
    hostile = {"version": "2.10", "entries": [_Calls(marker)], "pg_status": {}}
    for proto in (2, 4):  # GLOBAL and STACK_GLOBAL
        path = tmp_path / f"p{proto}"
        path.write_bytes(pickle.dumps(hostile, protocol=proto))
        with pytest.raises(DumpError, match=r"names posix\.system.*refused"):
            frtrace.load_file(path)
    directory = tmp_path / "d"
    directory.mkdir()
    (directory / "rank_0").write_bytes((real / "pickle" / "rank_0").read_bytes())
    (directory / "rank_1").write_bytes(pickle.dumps(hostile))
    done = cli("--dir", str(directory), "--json")
    assert not marker.exists()
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["read"] == [0] and "posix.system" in report["missing"]["1"]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"scalemon dump: rank 1 gave no dump: {report['missing']['1']}"]


@pytest.mark.parametrize("content,why", [
    (b"", "the file is empty"),
    (b"garbage\n", "neither a pickle nor JSON"),
    (b"{not json", "not valid JSON"),
    (b'{"a": 1}', "not a Flight Recorder dump"),
    (b'{"entries": 3}', "'entries' is not a list"),
    (pickle.dumps([1, 2]), "not a Flight Recorder dump"),
])
def test_files_that_are_no_dump_say_why(tmp_path, content, why):
    path = tmp_path / "rank_0"
    path.write_bytes(content)
    with pytest.raises(DumpError, match=why):
        frtrace.load_file(path)


def test_a_truncated_dump_leaves_the_others_analysed(real, tmp_path):
    directory = tmp_path / "d"
    directory.mkdir()
    (directory / "rank_0").write_bytes((real / "pickle" / "rank_0").read_bytes())
    (directory / "rank_1").write_bytes((real / "pickle" / "rank_1").read_bytes()[:300])
    done = cli("--dir", str(directory))
    assert done.returncode == 0, done.stderr
    assert "rank 1 gave no dump: its dump could not be read: rank_1: a damaged pickle" \
        in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    assert "default_pg [0,1] (group name 0, 2 ranks)" in done.stdout


def test_dump_dir_without_dumps_or_directory_fails_with_one_line(tmp_path):
    done = cli("--dir", str(tmp_path))
    assert done.returncode == 1
    assert done.stderr.startswith("scalemon dump: no Flight Recorder dump in ")
    done = cli("--dir", str(tmp_path / "nope"))
    assert done.returncode == 2 and done.stderr.strip().endswith("is not a directory")
    assert len(done.stderr.strip().splitlines()) == 1


# --- the NCCL format, built as torch writes it (no GPU here: real NCCL dumps not tried) -----

def _nccl_entry(record: int, pg: tuple[str, str], pg_id: int, seq: int, state: str,
                op: str = "all_reduce", size: int = 1024) -> dict[str, Any]:
    done = state == "completed"
    return {
        "record_id": record, "pg_id": pg_id, "process_group": pg, "collective_seq_id": seq,
        "p2p_seq_id": 0, "op_id": seq, "profiling_name": f"nccl:{op}",
        "time_created_ns": 1_700_000_000_000_000_000 + record, "duration_ms": 1.5 if done
        else None, "input_sizes": [[size]], "input_dtypes": ["BFloat16"],
        "output_sizes": [[size]], "output_dtypes": ["BFloat16"], "state": state,
        "time_discovered_started_ns": 1 if state != "scheduled" else None,
        "time_discovered_completed_ns": 2 if done else None, "retired": done,
        "timeout_ms": 600000, "is_p2p": False, "thread_id": "1", "thread_name": "pt_main",
        "frames": [{"name": "train_step", "filename": "train.py", "line": 42}]}


def nccl_dumps() -> dict[int, dict[str, Any]]:
    """4 ranks; default group (uid 0) and "tp" = ranks 2,3 (uid 1). Ranks 0-2 issued
    all_reduce #7 of the default group, rank 3 stopped after #6; the tp group is done."""
    dumps = {}
    for rank in range(4):
        last = 6 if rank == 3 else 7
        entries = [_nccl_entry(s - 1, ("0", "default_pg"), 0, s,
                               "completed" if s < 7 else "started") for s in range(1, last + 1)]
        if rank in (2, 3):
            entries += [_nccl_entry(10 + s, ("1", "tp"), 1, s, "completed", "all_gather")
                        for s in (1, 2)]
        status = {"0": {"last_enqueued_collective": last, "last_started_collective": last,
                        "last_completed_collective": 6}}
        if rank in (2, 3):
            status["1"] = {"last_enqueued_collective": 2, "last_started_collective": 2,
                           "last_completed_collective": 2}
        dumps[rank] = {
            "version": "2.10", "comm_lib_version": "2.27.5",
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
                          "1": {"name": "1", "desc": "tp", "ranks": "[2, 3]"}},
            "pg_status": status, "entries": entries,
            "nccl_comm_state": {"abc": {"nccl_comm_state": "ok"}},
        }
    return dumps


def _as_json_dump(dump: dict[str, Any]) -> dict[str, Any]:
    """What the `_json` variant writes: pg_status numbers as text, no nulls for times."""
    out = copy.deepcopy(dump)
    out["pg_status"] = {k: {n: str(v) for n, v in s.items()} for k, s in dump["pg_status"].items()}
    for e in out["entries"]:
        for key in ("time_discovered_started_ns", "time_discovered_completed_ns"):
            e[key] = e[key] or 0
        if e["duration_ms"] is None:
            del e["duration_ms"]
    return out


@pytest.mark.parametrize("as_json", [False, True])
def test_nccl_format_dumps_name_the_rank_that_never_issued(tmp_path, as_json):
    dumps = nccl_dumps()
    if as_json:
        dumps = {r: _as_json_dump(d) for r, d in dumps.items()}
    # as torch writes them by itself on a timeout (TORCH_FR_DUMP_TEMP_FILE)
    directory = write_dir(tmp_path / "d", dumps, prefix="nccl_trace_rank_", as_json=as_json)
    done = cli("--dir", str(directory), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert culprit_of(report) == {"group": "0", "seq": 7, "culprits": [3],
                                  "waiting": [0, 1, 2], "label": "default_pg [0-3]",
                                  "op": "all_reduce"}
    groups = by_label(report)
    assert groups["default_pg"]["ranks"] == [0, 1, 2, 3]  # from pg_config: no hub needed
    assert groups["tp"]["ranks"] == [2, 3] and groups["tp"]["finding"] is None
    assert groups["tp"]["status"]["3"]["issued_op"] == "all_gather"
    assert groups["default_pg"]["status"]["0"] == {
        "last_issued": 7, "last_completed": 6, "issued_op": "all_reduce",
        "completed_op": "all_reduce", "source": "dump", "note": None}


def test_an_older_format_without_pg_status_is_read_from_its_entries(tmp_path):
    """Before `pg_status`, `is_p2p` and `collective_seq_id` (`seq_id`) existed."""
    dumps = nccl_dumps()
    for dump in dumps.values():
        dump["version"] = "1.5"
        del dump["pg_status"]
        for e in dump["entries"]:
            e["seq_id"] = e.pop("collective_seq_id")
            del e["is_p2p"], e["p2p_seq_id"]
    report = analysed(write_dir(tmp_path / "d", dumps))
    assert report["versions"] == ["1.5"]
    assert report["culprit"]["culprits"] == [3] and report["culprit"]["waiting"] == [0, 1, 2]
    status = by_label(report)["default_pg"]["status"]
    assert (status["1"]["last_issued"], status["1"]["last_completed"]) == (7, 6)


def test_ranks_missing_and_gone_come_from_what_the_hub_knew(tmp_path):
    """The hub's context: rank 3 wrote nothing because its process is gone; the gloo-style
    groups have no pg_config, so their ranks come from the hub."""
    dumps = nccl_dumps()
    for dump in dumps.values():
        dump["pg_config"] = {"": {"name": "", "desc": "", "ranks": "[]"}}  # as gloo writes
    directory = write_dir(tmp_path / "d", {r: d for r, d in dumps.items() if r != 3})
    context = {"asked": [0, 1, 2, 3], "gone": [3],
               "missing": {"3": "its process exited (killed by SIGKILL)"},
               "members": {"0": [0, 1, 2, 3], "1": [2, 3]}, "descs": {"1": "tp"}}
    (directory / frtrace.CONTEXT_FILE).write_text(json.dumps(context))
    report = analysed(directory)
    assert report["read"] == [0, 1, 2] and report["gone"] == [3]
    assert culprit_of(report) == {"group": "0", "seq": 7, "culprits": [3],
                                  "waiting": [0, 1, 2], "label": "default_pg [0-3]",
                                  "op": "all_reduce"}
    assert report["culprit"]["causes"] == {"3": {"cause": "gone"}}
    # rank 2 completed all it issued in tp: nobody waits there, so no finding of its own
    assert by_label(report)["tp"]["finding"] is None
    assert by_label(report)["tp"]["status"]["3"]["note"] == "its process exited (killed by SIGKILL)"
    assert report["missing"] == {"3": "its process exited (killed by SIGKILL)"}
    assert "rank 3: process gone" in report["text"]
    assert by_label(report)["default_pg"]["status"]["3"]["note"] == \
        "its process exited (killed by SIGKILL)"


def test_a_silent_rank_is_filled_in_from_its_last_heartbeat(tmp_path):
    dumps = nccl_dumps()
    directory = write_dir(tmp_path / "d", {r: d for r, d in dumps.items() if r != 3})
    context = {"asked": [0, 1, 2, 3], "missing": {"3": "no answer within 15 s"},
               "heartbeat": {"3": {"0": [6, 6], "1": [2, 2]}}}
    (directory / frtrace.CONTEXT_FILE).write_text(json.dumps(context))
    report = analysed(directory)
    assert report["culprit"]["culprits"] == [3] and report["culprit"]["seq"] == 7
    row = by_label(report)["default_pg"]["status"]["3"]
    assert (row["last_issued"], row["source"]) == (6, "heartbeat")
    assert "from its last heartbeat; no dump: no answer within 15 s" in \
        frtrace.report_text(report)


# --- the dashboard's dump panel -----------------------------------------------------------

def test_the_dump_panel_shows_the_analysis_as_tables_never_a_traceback(tmp_path):
    report = analysed(write_dir(tmp_path / "d", nccl_dumps()))
    lines = _dump_lines({"directory": str(tmp_path / "d"), "state": "analysed",
                         "requested": [0, 1, 2, 3], "written": [0, 1, 2, 3], "missing": [],
                         "analysis": frtrace.report_text(report), "exit_code": None,
                         "report": report})
    text = "\n".join(t for t, _ in lines)
    assert ("culprit: rank 3 never issued all_reduce #7 of default_pg [0-3]; ranks 0,1,2 wait "
            "in all_reduce #7 of default_pg [0-3] for rank 3", "bold red") in lines
    assert "tp [2,3] (group name 1, 2 ranks)" in text and "Traceback" not in text
    assert "  ranks  last issued    last completed  role     note" in text


# --- what the hub adds -------------------------------------------------------------------

def test_the_hub_says_why_each_rank_gave_nothing():
    from scalemon.hub.frdump import WAIT_S, job_context
    from scalemon.state.jobstate import JobState, RankView

    state = JobState(job="j", world_size=9)
    state.ranks = {r: RankView(rank=r) for r in range(8)}
    state.ranks[1].state, state.ranks[1].state_reason = "gone", "process 7 ended (killed?)"
    state.ranks[2].state, state.ranks[2].state_reason = "exited", "killed by SIGKILL"
    state.ranks[4].metrics["groups"] = {"0": [11, 11]}
    state.ranks[5].state, state.ranks[5].state_reason = "frozen", "no message for 5.2 s"
    state.ranks[5].where = "frozen in native code holding the GIL: sleep <- f() at x.py:3"
    state.ranks[6].state, state.ranks[6].state_reason = "unreachable", "relay silent"
    state.ranks[7].state = "silent"
    state.groups = {"0": {"desc": "default_pg", "ranks": list(range(9))}}
    context = job_context(state, asked=list(range(8)), written=[0],
                          errors={3: "OSError: [Errno 28] No space left on device"})
    assert context["missing"] == {
        "1": "gone (process 7 ended (killed?)): its process ended without reporting an exit",
        "2": "its process exited (killed by SIGKILL)",
        "3": "its agent could not write it: OSError: [Errno 28] No space left on device",
        "4": f"no answer within {WAIT_S:g} s (stuck in C++ holding the GIL, or its agent "
             "thread is gone)",
        "5": "frozen (no message for 5.2 s): its process exists but sends nothing (its agent's "
             "thread cannot run); frozen in native code holding the GIL: sleep <- f() at x.py:3",
        "6": "unreachable (relay silent): its node's relay is silent too; taken for ended",
        "7": "silent (no message): nothing on its node can look at its process; taken for "
             "ended",
        "8": "never reported to the hub (its agent is off or never started)"}
    # a frozen rank's process exists: not among the gone
    assert context["gone"] == [1, 2, 6, 7] and context["heartbeat"] == {"4": {"0": [11, 11]}}
    assert context["members"] == {"0": list(range(9))}
    assert context["descs"] == {"0": "default_pg"}


def test_a_report_too_big_for_the_history_keeps_its_findings():
    from scalemon.hub.frdump import REPORT_MAX_BYTES, _fitting

    ranks = list(range(4096))
    dumps = {}
    for r in ranks:
        dump = frtrace.RankDump(r)
        dump.add({"version": "2.10", "pg_status": {"0": {
            "last_enqueued_collective": 9 if r else 8, "last_completed_collective": 8}},
            "entries": []}, f"rank_{r}")
        dumps[r] = dump
    report = frtrace.analyse(dumps, members={"0": ranks}, descs={"0": "default_pg"},
                             asked=ranks)
    assert len(json.dumps(report)) > REPORT_MAX_BYTES
    small = _fitting(report)
    assert len(json.dumps(small)) <= REPORT_MAX_BYTES and "analysis.json" in small["cut"]
    assert small["culprit"]["culprits"] == [0] and small["culprit"]["waiting"] == ranks[1:]
    assert "ranks 1-4095 wait in collective #9 of default_pg [0-4095] for rank 0" in \
        frtrace.report_text(small)
    text = frtrace.report_text(report)
    assert "  1-4095  #9" in text  # ranks with the same row share it


def test_reading_dumps_imports_no_torch(real):
    code = ("import sys; from scalemon.cli.main import main; "
            f"assert main(['dump', '--dir', {str(real / 'pickle')!r}]) == 0; "
            "assert 'torch' not in sys.modules, 'scalemon dump imported torch'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "side [0,1] (group name 1, 2 ranks)" in done.stdout
