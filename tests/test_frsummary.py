"""Each rank's Flight Recorder dump summed up beside it (scalemon/reports/frsummary.py,
`rank_<N>.summary`, what the agent writes with its dump): the analysis reads the summaries
instead of the pickles and gives the same JSON byte for byte; a summary that is damaged, stale,
of another rank or of another format is ignored (the dump read instead) and said; the agent
writes it on its recorder thread when the hub's `dump_fr` command comes. Dumps made by
bench/frdump_scale.py's generator (a planted hang and a planted mismatch)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest

from conftest import REPO
from scalemon.reports import frscan, frsummary, frtrace

sys.path.insert(0, str(REPO / "bench"))
import frdump_scale  # noqa: E402


def write(directory: Path, ranks: int, entries: int, summaries: bool) -> frdump_scale.Mesh:
    directory.mkdir(parents=True, exist_ok=True)
    mesh = frdump_scale.Mesh(ranks)
    for rank in range(ranks):
        path = directory / f"nccl_rank_{rank}"
        path.write_bytes(pickle.dumps(frdump_scale.rank_dump(mesh, rank, entries), protocol=2))
        if summaries:
            frsummary.write_summary(directory, rank, [path])
    return mesh


def analysis(directory: Path) -> tuple[str, list[str]]:
    """The analysis as `scalemon dump --json` prints it, and what it said."""
    notes: list[str] = []
    report = frtrace.analyse_directory(directory, say=notes.append)
    return json.dumps(report, indent=1), notes


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, frdump_scale.Mesh]:
    """The same 64 ranks' dumps twice: without summaries, and with them."""
    base = tmp_path_factory.mktemp("frsum")
    write(base / "plain", 64, 120, summaries=False)
    return base / "plain", base / "summed", write(base / "summed", 64, 120, summaries=True)


def same_json_but_paths(plain: str, summed: str, a: Path, b: Path) -> bool:
    return plain.replace(str(a), "DIR") == summed.replace(str(b), "DIR")


def test_summaries_give_the_analysis_the_dumps_give_byte_for_byte(pair, monkeypatch):
    plain_dir, summed_dir, mesh = pair
    plain, said = analysis(plain_dir)
    assert said == []  # no summary: nothing to say
    summed, said = analysis(summed_dir)
    assert said == ["64 of 64 ranks read from their summaries"]
    assert same_json_but_paths(plain, summed, plain_dir, summed_dir)
    report = json.loads(summed)
    assert report["culprit"]["culprits"] == [mesh.culprit()]
    assert sum(g["mismatches"]["count"] for g in report["groups"]) == 1
    monkeypatch.setattr(frscan, "PARALLEL_FROM", 10**9)  # in this process: same again
    assert analysis(summed_dir)[0] == summed


def test_the_analysis_reads_no_pickle_where_summaries_stand(pair, monkeypatch):
    plain_dir, summed_dir, _ = pair
    monkeypatch.setattr(frscan, "PARALLEL_FROM", 10**9)  # in this process, to see its calls

    def no_pickle(*args: object) -> None:
        raise AssertionError("a dump was read although its summary stands")

    expected = analysis(plain_dir)[0]
    monkeypatch.setattr(frscan, "summarise", no_pickle)
    assert same_json_but_paths(expected, analysis(summed_dir)[0], plain_dir, summed_dir)


def test_a_damaged_or_stale_summary_is_ignored_and_said(pair, tmp_path):
    plain_dir, summed_dir, mesh = pair
    directory = tmp_path / "d"
    directory.mkdir()
    for path in summed_dir.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
        os.utime(directory / path.name, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))
    (directory / "rank_5.summary").write_bytes(b"\x92damaged")  # not msgpack
    (directory / "rank_7.summary").write_bytes(  # another rank's
        (directory / "rank_8.summary").read_bytes())
    (directory / "rank_9.summary").write_bytes(  # this rank's, of a layout to come
        msgpack.packb({"format": frsummary.FORMAT + 1, "rank": 9}))
    wrong = msgpack.unpackb((directory / "rank_11.summary").read_bytes())
    wrong["dump"]["groups"][0][3] = "7"  # a count as text
    (directory / "rank_11.summary").write_bytes(msgpack.packb(wrong))
    # rank 6's dump changed after its summary was written: the new dump counts
    culprit = mesh.culprit()
    changed = frdump_scale.rank_dump(mesh, culprit, 120)
    (directory / "nccl_rank_6").write_bytes(pickle.dumps(changed, protocol=2))
    (plain_dir.parent / "plain6").mkdir(exist_ok=True)
    for path in plain_dir.iterdir():  # the expected: the plain dumps, rank 6 changed alike
        (plain_dir.parent / "plain6" / path.name).write_bytes(path.read_bytes())
    (plain_dir.parent / "plain6" / "nccl_rank_6").write_bytes(
        pickle.dumps(changed, protocol=2))
    expected = analysis(plain_dir.parent / "plain6")[0]
    got, said = analysis(directory)
    assert same_json_but_paths(expected, got, plain_dir.parent / "plain6", directory)
    (note,) = said
    assert note.startswith("59 of 64 ranks read from their summaries; 5 summaries ignored, "
                           "the dump read instead (rank 5: damaged (")
    assert "rank 6: stale: the dump files differ" in note
    assert "rank 7: it sums up rank 8, not 7" in note
    assert note.endswith("; 2 more)")
    scan = frscan.scan_directory(directory)
    assert sorted(scan.summaries_ignored) == [5, 6, 7, 9, 11]
    assert scan.summaries_ignored[9] == "not a summary of this scalemon's format"
    assert scan.summaries_ignored[11].startswith("damaged (TypeError")


def test_a_rank_whose_files_cannot_be_read_is_summed_up_with_why(tmp_path):
    """A summary of a damaged dump says why, as reading the dump does; a rank with a second
    file the summary does not name is read from its files."""
    write(tmp_path / "a", 8, 40, summaries=False)
    (tmp_path / "a" / "nccl_rank_2").write_bytes(b"\x80\x02}q\x00(")  # cut short
    plain = analysis(tmp_path / "a")[0]
    for rank in range(8):
        frsummary.write_summary(tmp_path / "a", rank, [tmp_path / "a" / f"nccl_rank_{rank}"])
    summed, said = analysis(tmp_path / "a")
    assert summed == plain and said == ["8 of 8 ranks read from their summaries"]
    assert "damaged pickle" in json.loads(summed)["missing"]["2"]
    (tmp_path / "a" / "rank_3").write_bytes((tmp_path / "a" / "nccl_rank_3").read_bytes())
    said = analysis(tmp_path / "a")[1]
    assert said == ["7 of 8 ranks read from their summaries; 1 summary ignored, the dump read "
                    "instead (rank 3: stale: the dump files differ (names, sizes or times) "
                    "from those it sums up)"]


def test_scalemon_dump_dir_says_how_the_ranks_were_read_on_stderr_only(pair):
    plain_dir, summed_dir, _ = pair
    runs = [subprocess.run([sys.executable, "-m", "scalemon.cli", "dump", "--dir", str(d),
                            "--json"], capture_output=True, text=True, timeout=120)
            for d in (plain_dir, summed_dir)]
    assert [r.returncode for r in runs] == [0, 0]
    assert same_json_but_paths(runs[0].stdout, runs[1].stdout, plain_dir, summed_dir)
    assert runs[0].stderr == ""
    assert runs[1].stderr == "scalemon dump: 64 of 64 ranks read from their summaries\n"


# --- the agent writes it --------------------------------------------------------------------

def test_the_dump_fr_command_writes_the_summary_on_the_recorder_thread(tmp_path, monkeypatch):
    from test_collectives import FakeSource, entry

    from scalemon.agent import frsummary as agent_summary
    from scalemon.agent.recorder import Recorder
    from scalemon.agent.run import Run

    threads: list[str] = []
    real_write = agent_summary.write_summary

    def watched(*args: object) -> Path:
        threads.append(threading.current_thread().name)
        return real_write(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(agent_summary, "write_summary", watched)
    source = FakeSource()
    source.config = {}  # the members unknown: the summary's status is the rank's own
    source.entries = [entry(i, i + 1, state="completed") for i in range(30)]
    source.entries[-1]["state"] = "started"
    source.status = {"0": {"last_enqueued_collective": 30, "last_started_collective": 30,
                           "last_completed_collective": 29}}
    sent: list[tuple[str, dict]] = []
    recorder = Recorder(lambda t, b: sent.append((t, b)) or True, threading.get_ident(),
                        lambda: None, lambda: 7, nccl=False, sources=[source])
    try:
        run = SimpleNamespace(recorder=recorder, env=SimpleNamespace(rank=3))
        Run._on_command(run, {"name": "dump_fr", "directory": str(tmp_path / "fr")})  # type: ignore[arg-type]
        deadline = time.monotonic() + 30
        while not any(b.get("key") == "fr_dump" for _, b in sent):
            assert time.monotonic() < deadline, "no dump within 30 s"
            time.sleep(0.05)
    finally:
        recorder.stop()
    assert threads == ["scalemon-recorder"]  # its own thread, never the training thread's
    assert sorted(p.name for p in (tmp_path / "fr").iterdir()) == ["rank_3", "rank_3.summary"]
    summed, said = analysis(tmp_path / "fr")
    assert said == ["1 of 1 ranks read from their summaries"]
    (tmp_path / "fr" / "rank_3.summary").unlink()
    assert analysis(tmp_path / "fr") == (summed, [])
    assert json.loads(summed)["groups"][0]["status"]["3"]["last_issued"] == 30


def test_a_summary_that_cannot_be_written_leaves_the_dump_and_warns_once(tmp_path):
    from scalemon.agent.frsummary import write_beside
    from scalemon.agent.warn import Warnings

    dump = tmp_path / "rank_0"
    dump.write_bytes(pickle.dumps({"version": "2.10", "entries": []}))
    (tmp_path / "rank_0.summary.tmp").mkdir()  # where the summary is written first
    warnings = Warnings()
    write_beside(str(tmp_path), 0, [str(dump)], warnings)
    assert warnings.said("fr-summary") and dump.exists()
    assert not (tmp_path / "rank_0.summary").exists()
