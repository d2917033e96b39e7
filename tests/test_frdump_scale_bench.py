"""`bench/frdump_scale.py --quick`: 16 ranks x 200 entries written in the agent's dump format,
analysed by `scalemon dump --dir --json` in a process of its own; the results file has every
figure and the analysis names the planted culprit and mismatch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


@pytest.mark.timeout(120)
def test_quick_frdump_bench_measures_and_finds_the_planted_culprit(tmp_path: Path) -> None:
    out = tmp_path / "frdump_scale.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "frdump_scale.py"), "--quick",
                           "--out", str(out), "--tmp", str(tmp_path)],
                          capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["machine"]["cpus"] and data["machine"]["cpu"] and data["date"]
    (run,) = data["runs"]
    assert (run["ranks"], run["entries_per_rank"]) == (16, 200)
    assert run["exit_code"] == 0 and run["ranks_read"] == 16
    assert run["seconds"] > 0 and run["peak_rss_mb"] > 0
    assert run["dump_mb"] > 0 and run["generate_s"] >= 0
    assert run["culprit_found"] and run["culprits_found"] == [run["culprit_planted"]]
    assert run["waiting"] == 15 and run["mismatches"] == 1
    assert f"rank {run['culprit_planted']} never issued" in run["text"]
    assert "analysis s" in proc.stdout  # the table was printed
    assert not list(tmp_path.glob("frscale*"))  # the dumps were removed
