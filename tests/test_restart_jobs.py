"""Jobs that torchrun restarts, monitored (issue #37): rank 1 raises in the first attempt,
`torchrun --max-restarts 1` starts both ranks again, they resume from their checkpoints and
finish; the job exits 0 and `scalemon snapshot --json` has both ranks at the last step.

The restarted workers rendezvous under a store prefix of their attempt (demo_train/parallel.py
`attempt_store`, the same in tests/jobs/restart_gloo.py): torchrun's static rendezvous keeps
its store, keys and all, across attempts, and a restarted gloo rank could otherwise connect to
the dead attempt's address (bench/restart_success.py measures both)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_collectives_jobs import job_env, snapshot

from conftest import REPO, free_port, torchrun_cmd, wait_for

pytestmark = pytest.mark.integration


def finished(home) -> dict:
    """`scalemon snapshot --json` once both ranks finished."""
    return wait_for(lambda: (s := snapshot(home)) and len(s["ranks"]) == 2 and all(
        r["state"] == "finished" for r in s["ranks"]) and s, timeout=60)


def test_the_demo_resumes_after_a_crash_and_both_ranks_reach_the_last_step(home, tmp_path):
    cmd = torchrun_cmd("--monitor", "--max-steps", "12", "--inject-crash", "1:5",
                       "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "2",
                       "--resume-or-start", extra=("--max-restarts", "1"))
    done = subprocess.run(cmd, env=job_env(home), capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "rank 1: injected crash before step 5" in out
    assert "checkpoint: resumed from" in out and "step 12 loss" in out
    state = finished(home)
    assert [(r["rank"], r["step"]) for r in state["ranks"]] == [(0, 12), (1, 12)], (
        state["attempts"], [(r["pid"], r["steps_received"], r["seq_seen"]) for r in state["ranks"]])
    # one job, two attempts: the first's crash kept, not overwritten by the second's end
    assert state["state"] == "finished" and state["max_restarts"] == 1
    first, second = state["attempts"]
    assert (first["attempt"], second["attempt"]) == (0, 1)
    assert first["how"] == "crashed" and "InjectedCrash" in first["first_failure"]
    assert first["first_failure"].startswith("rank 1 failed first")
    assert first["end"] is not None and first["end"] <= second["start"]
    assert second["how"] == "finished" and second["first_failure"] is None
    assert second["last_step"] == 12 and state["first_failure"] is None
    assert {r["restart_count"] for r in state["ranks"]} == {1}


def test_a_plain_monitored_gloo_script_restarts_and_finishes(home, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--max-restarts", "1", "--master-port", str(free_port()), "--",
           str(REPO / "tests" / "jobs" / "restart_gloo.py"), str(tmp_path / "ckpt"),
           "--monitor", "--steps", "10", "--crash-at", "5"]
    done = subprocess.run(cmd, env=job_env(home), capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "planted crash before step 5" in out and out.count("done at step 10") == 2, out
    assert "rank 1: attempt 1 starts after step 4" in out  # its own checkpoint
    state = finished(home)
    assert [(r["rank"], r["step"]) for r in state["ranks"]] == [(0, 10), (1, 10)], state["ranks"]
