"""`bench/scale.py --quick`: 64 simulated ranks on 8 simulated nodes, each node a real relay
with its own ipc directory and CurveZMQ tcp connection to one real hub, the real dashboard
following in tmux (where tmux exists), and a late attach. Every message the ranks sent is
received by the hub or its drop is counted, and the results file has every figure."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import REPO

pytestmark = pytest.mark.integration


@pytest.mark.timeout(200)
def test_quick_scale_bench_delivers_or_counts_every_message(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "scale.py"), "--quick",
                           "--hang", "14", "--out", str(out)], capture_output=True, text=True,
                          timeout=170, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["machine"]["cpus"] and data["machine"]["cpu"]
    (run,) = data["runs"]
    assert (run["ranks"], run["nodes"], run["ranks_per_node"]) == (64, 8, 8)
    assert run["hub_tcp"] and run["hub_relays"] == 8  # one relay per node reached the hub

    # everything the plan says was sent, and every message received or its drop counted
    assert run["sent"] == run["messages_planned"] > 0
    drops = run["dropped_by_ranks"] + run["dropped_by_relays"]
    assert run["hub_received"] + drops == run["sent"]
    assert run["unaccounted"] == 0 and run["delivered_all"]
    assert run["seq_gaps"] == drops  # what was dropped shows as gaps, and only that
    assert run["relay_received"] == run["sent"] - run["dropped_by_ranks"]
    assert run["hub_rejected"] == 0
    assert run["ranks_seen"] == run["ranks_finished"] == 64
    assert run["syncs_answered"] > 0
    # the relays answer their ranks' syncs once they know the hub's clock (protocol 1.13)
    assert 0 < run["syncs_answered_by_relays"] <= run["syncs_answered"]
    # the hang after the load: the hub's alert named it, and the planted culprit, in time
    assert run["hang_culprits"] == [run["hang_culprit_planted"]], run.get("hang_text")
    assert 10.0 <= run["hang_named_after_s"] <= 20.0
    assert run["goals_met"]["hang_named"] is True

    # the figures the report compares across sizes
    for key in ("achieved_msgs_per_s", "hub_cpu_pct", "hub_rss_peak_mb", "workers_cpu_pct",
                "machine_busy_pct", "hub_drain_s"):
        assert isinstance(run[key], (int, float)), key
    assert run["attach_records"] >= run["hub_received"] and run["attach_s"] > 0
    if shutil.which("tmux"):
        assert run["dashboard"] and run["redraws"] > 0
        assert run["redraw_ms_p99"] >= run["redraw_ms_p50"] > 0
        assert run["dashboard_received"] == run["hub_received"]
    assert "unacc" in proc.stdout  # the table was printed

    # nothing left behind: no process of the run, no directory
    left = [p.pid for p in psutil.process_iter(["cmdline"])
            if run["home"] in " ".join(p.info["cmdline"] or [])]
    assert not left and not Path(run["home"]).exists()


@pytest.mark.timeout(120)
def test_quick_scale_bench_with_the_flight_recorders_messages_counts_them(tmp_path: Path) -> None:
    """`--collectives-every 1`: each rank's `collectives` message once a second of steps (a
    tick of 5 a second: 5 messages a rank in the quick run's 5 s), counted in the plan and
    delivered like the others."""
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "scale.py"), "--quick",
                           "--no-dashboard", "--collectives-every", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert run["collectives_every_s"] == 1.0
    assert run["collectives_sent"] == 64 * 5
    assert run["sent"] == run["messages_planned"] and run["unaccounted"] == 0
    assert run["hub_rejected"] == 0 and run["ranks_finished"] == 64


def test_the_arrival_heat_bench_prints_and_saves_each_size(tmp_path: Path) -> None:
    out = tmp_path / "heat.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "arrival_heat.py"), "--ranks",
                           "8", "64", "--collectives", "300", "--out", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [r["ranks"] for r in runs] == [8, 64]
    # 300 collectives 0.1 s apart: 30 cells of a second a rank, every sample in one of them
    assert [r["heat_cells"] for r in runs] in ([8 * 30, 64 * 30], [8 * 31, 64 * 31])
    assert all(r["pickle_mb"] > 0 and r["seconds"] > 0 for r in runs)
    assert "pickle MB" in proc.stdout
