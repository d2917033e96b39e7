"""NCCL's debug log on a real GPU: the demo trainer under torchrun, 1 rank on NCCL, monitored.

1. `scalemon toggle JOB NCCL_DEBUG=INFO` on the running job: NCCL lines reach the hub's log
   within seconds and the toggle's reply counts more than 0 of them; a second toggle
   (NCCL_DEBUG_SUBSYS, NCCL rewrites its file) counts some too, none cut.
2. A job launched with NCCL_DEBUG=INFO (and COLL, for a line per step): its lines reach the hub
   and are still on the job's stdout, those NCCL printed before `sm.init` first; the file
   NCCL opened is the one the agent followed (NCCL expanded %p as the agent did).

Skipped without CUDA and NCCL (this is the GPU check of tests/test_nccllog.py, which runs the
same paths against a stand-in for libnccl)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_collectives_jobs import job_env, snapshot

from conftest import kill_tree, torchrun_cmd, wait_for

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.distributed.is_available()
         and torch.distributed.is_nccl_available()),
    reason="needs a CUDA GPU and torch built with NCCL")

START_S = 120
"""Longest wait for the job's first steps: torch with CUDA, the CUDA context and the NCCL
communicator start slowly on a machine whose cores the other test workers keep busy (the
suite runs 14 workers on the 16-core H100 machine)."""


NCCL_ENV = ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")


def start_demo(home: Path, out: Path, *args: str, **env: str) -> subprocess.Popen:
    full = {**job_env(home), **env}
    for name in NCCL_ENV:  # none from the machine's environment: only what the test sets
        if name not in env:
            full.pop(name, None)
    full.pop("PYTHONUNBUFFERED", None)  # C's stdout block-buffered, as under most launchers
    with open(out, "w") as log:
        return subprocess.Popen(
            torchrun_cmd("--preset", "tiny", "--batch-size", "2", "--monitor", *args, nproc=1,
                         device="cuda"),
            env=full, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def nccl_lines(home: Path) -> list[str]:
    state = snapshot(home) or {}
    return [line["text"] for line in state.get("log", {}).get("last", [])
            if line["source"] == "nccl"]


def test_toggling_nccl_debug_on_shows_lines_and_counts_them(home: Path, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    proc = start_demo(home, out, "--max-steps", "100000", "--step-delay", "0.02")
    try:
        wait_for(lambda: (s := snapshot(home)) and s["ranks"]
                 and (s["ranks"][0]["step"] or 0) >= 3, timeout=START_S, interval=0.5)
        assert not nccl_lines(home)
        done = subprocess.run(
            [sys.executable, "-m", "scalemon.cli", "toggle", home.name, "NCCL_DEBUG=INFO",
             "--wait", "30"], env=job_env(home), capture_output=True, text=True, timeout=60)
        print(done.stdout, done.stderr)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "ncclResetDebugInit" in done.stdout  # NCCL re-read its settings, live
        assert "NCCL_DEBUG_SUBSYS was unset, so scalemon set it to" in done.stdout
        counted = [line for line in done.stdout.splitlines() if "NCCL log:" in line]
        assert counted and "line(s) in the 3 s after it was applied" in counted[0], done.stdout
        assert int(counted[0].split("NCCL log: ")[1].split()[0]) > 0
        lines = wait_for(lambda: nccl_lines(home), timeout=10, interval=0.5)
        assert any("NCCL INFO" in line for line in lines), lines[:5]
        # again: NCCL reopens the same file with mode "w", and its new lines soon outgrow the
        # old ones; they are read from its start, each whole
        done = subprocess.run(
            [sys.executable, "-m", "scalemon.cli", "toggle", home.name,
             "NCCL_DEBUG_SUBSYS=INIT,COLL", "--wait", "30"], env=job_env(home),
            capture_output=True, text=True, timeout=60)
        print(done.stdout, done.stderr)
        assert done.returncode == 0, done.stdout + done.stderr
        counted = [line for line in done.stdout.splitlines() if "NCCL log:" in line]
        assert counted and int(counted[0].split("NCCL log: ")[1].split()[0]) > 0, done.stdout
        host = socket.gethostname().split(".")[0]
        lines = nccl_lines(home)
        # (a WARN comes after an empty line: src/debug.cc writes "\n" before it)
        assert lines and all(line.startswith(f"{host}:") for line in lines if line), lines
        assert proc.poll() is None, out.read_text()[-3000:]
    finally:
        kill_tree(proc)


def test_launched_with_nccl_debug_lines_reach_the_hub_and_stdout(home: Path,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    proc = start_demo(home, out, "--max-steps", "30", NCCL_DEBUG="INFO",
                      NCCL_DEBUG_SUBSYS="INIT,COLL")
    try:
        assert proc.wait(timeout=START_S + 60) == 0, out.read_text()[-3000:]
    finally:
        kill_tree(proc)
    printed = out.read_text()
    lines = wait_for(lambda: [line for line in nccl_lines(home) if "NCCL INFO" in line],
                     timeout=15, interval=0.5)
    assert any("AllReduce" in line for line in lines), lines[:5]
    for line in lines[-5:]:  # the very lines the hub got are on the job's stdout too
        assert line in printed, (line, printed[-3000:])
    # and what NCCL printed before the agent started (eager init: device_id), before those
    assert "Init COMPLETE" in printed
    assert printed.index("Init COMPLETE") < printed.index("AllReduce"), printed[:3000]
    files = list((home / "run" / home.name).glob("nccl.*.log"))
    assert any("AllReduce" in f.read_text() for f in files), files  # %p expanded as we did
