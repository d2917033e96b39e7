"""A directory of Flight Recorder dumps read at scale (scalemon/reports/frscan.py): read by
worker processes it gives the report read in one process gives, each rank kept without its
entries, the progress told as ranks are read; `scalemon dump --dir` shows it on a terminal
only. Dumps made by bench/frdump_scale.py's generator (torch's NCCL format, a planted hang and
a planted mismatch)."""

from __future__ import annotations

import io
import json
import pickle
import sys
from pathlib import Path

import pytest

from conftest import REPO
from scalemon.cli.dump import ReadProgress
from scalemon.reports import frscan, frtrace
from scalemon.reports.frtable import SeqTable

sys.path.insert(0, str(REPO / "bench"))
import frdump_scale  # noqa: E402


def write(directory: Path, ranks: int, entries: int) -> frdump_scale.Mesh:
    directory.mkdir(parents=True, exist_ok=True)
    mesh = frdump_scale.Mesh(ranks)
    for rank in range(ranks):
        dump = frdump_scale.rank_dump(mesh, rank, entries)
        (directory / f"nccl_rank_{rank}").write_bytes(pickle.dumps(dump, protocol=2))
    return mesh


@pytest.fixture(scope="module")
def dumps64(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, frdump_scale.Mesh]:
    directory = tmp_path_factory.mktemp("fr64") / "d"
    return directory, write(directory, 64, 120)


def test_worker_processes_read_what_one_process_reads(dumps64, monkeypatch):
    directory, mesh = dumps64
    assert frscan.PARALLEL_FROM <= 64  # read by worker processes
    told: list[tuple[int, int]] = []
    apart = frtrace.analyse_directory(directory, progress=lambda n, of: told.append((n, of)))
    assert told[0] == (0, 64) and told[-1] == (64, 64)
    assert [n for n, _ in told] == sorted(n for n, _ in told)
    monkeypatch.setattr(frscan, "PARALLEL_FROM", 10**9)  # all in this process
    here = frtrace.analyse_directory(directory)
    assert json.dumps(apart, sort_keys=True) == json.dumps(here, sort_keys=True)
    assert apart["culprit"]["culprits"] == [mesh.culprit()]
    assert len(apart["culprit"]["waiting"]) == 63
    (tp,) = [g for g in apart["groups"] if g["mismatches"]["count"]]
    assert mesh.culprit() ^ 1 in tp["ranks"]
    (mismatch,) = tp["mismatches"]["first"]
    assert mismatch["field"] == "dtypes"
    assert "Float" in mismatch["by_rank"][str(mesh.culprit() ^ 1)]


def test_the_ranks_read_keep_no_entry_of_their_rings(dumps64):
    directory, _ = dumps64
    scan = frscan.scan_directory(directory, workers=2)
    assert sorted(scan.dumps) == list(range(64)) and scan.problems == {}
    for dump in scan.dumps.values():
        assert dump.entries == [] and dump.cells == {}
        assert dump.groups  # what the analysis needs stays
    # the collectives of all ranks, one cell per distinct shape: 64 ranks share each
    default = scan.table.groups["0"]
    assert all(sum(len(r) for r in by_cell.values()) <= 64 for by_cell in default.values())
    assert max(len(by_cell) for by_cell in default.values()) == 1


def test_a_table_of_parts_is_the_table_of_the_whole(dumps64):
    directory, _ = dumps64
    whole = frscan.read_ranks([(r, [str(directory / f"nccl_rank_{r}")], None)
                               for r in range(64)]).table
    parts = SeqTable()
    for start in (32, 0, 48, 16):  # in any order
        parts.merge(frscan.read_ranks([(r, [str(directory / f"nccl_rank_{r}")], None)
                                       for r in range(start, start + 16)]).table)
    assert whole.groups.keys() == parts.groups.keys()
    for name, seqs in whole.groups.items():
        assert {s: {c: sorted(r) for c, r in cells.items()} for s, cells in seqs.items()} == \
            {s: {c: sorted(r) for c, r in cells.items()} for s, cells in parts.groups[name].items()}
        assert whole.mismatches(name, 8) == parts.mismatches(name, 8)


def test_a_huge_rank_number_in_a_file_name_is_still_a_rank(tmp_path):
    directory = tmp_path / "d"
    write(directory, 16, 40)
    huge = 10**20  # beyond an array of 8-byte integers
    (directory / "nccl_rank_3").rename(directory / f"nccl_rank_{huge}")
    report = frtrace.analyse_directory(directory)
    assert huge in report["read"] and 3 not in report["read"]


def test_progress_is_one_line_rewritten_and_cleared():
    out = io.StringIO()
    progress = ReadProgress(out)
    progress(0, 4096)
    progress(1, 4096)  # within EVERY_S of the last: not shown
    progress(4096, 4096)
    progress.clear()
    text = out.getvalue()
    assert text.count("\r") == 4  # two lines, then blanks over them and back
    assert "read 0/4096 ranks (0%), 0 s" in text and "read 1/4096" not in text
    assert "read 4096/4096 ranks (100%), 0 s, analysing" in text
    assert text.endswith("\r") and "\n" not in text
