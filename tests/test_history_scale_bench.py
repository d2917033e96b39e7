"""`bench/history_scale.py --quick`: a generated history through the hub's writer, its
checkpoint, `scalemon summary` in a process of its own, one rank's and a step range's reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


@pytest.mark.timeout(180)
def test_quick_history_bench_measures_disk_summary_and_reads(tmp_path: Path) -> None:
    out = tmp_path / "history_scale.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "history_scale.py"), "--quick",
                           "--records", "40000", "--ranks", "64", "--dir", str(tmp_path),
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["records"] == 40064 and run["chunks"] >= 1
    assert run["bytes_per_sealed_record"] < run["old_bytes_per_record"] / 4
    assert run["summary_last_step"] == run["steps"] and "exact" in run["summary_digest"]
    assert run["read_one_rank"]["records"] == 40000 // 64 + 1  # its steps and its hello
    assert run["read_one_rank"]["bytes_read"] < run["files"]["history.smlog.chunks"] / 4
    assert run["read_100_steps"]["records"] == 100 * 64
