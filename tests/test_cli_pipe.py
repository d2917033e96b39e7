"""`scalemon ... | head`: a command whose reader left stops quietly (real hub, fake ranks,
`scalemon` processes writing into a pipe nobody reads)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import zmq

from conftest import SCALEMON, FakeRank, wait_for
from scalemon.cli.main import STDOUT_CLOSED
from scalemon.link.client import HubClient

JOB = "piped1"


def run_into_closed_pipe(*args: str, home: Path) -> subprocess.CompletedProcess:
    """`scalemon ARGS` whose stdout is a pipe already closed at its reading end: every write
    fails (EPIPE), as once `head -1` has read its line and left."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([SCALEMON, *args], stdout=write_end, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True, timeout=60,
                              env={**os.environ, "SCALEMON_HOME": str(home)})
    finally:
        os.close(write_end)


@pytest.fixture
def job_with_data(home: Path, start_hub, zctx: zmq.Context) -> str:
    hub = start_hub(JOB)
    for rank in range(4):
        fake = FakeRank(zctx, hub.address, JOB, rank)
        fake.hello(world_size=4)
        for step in range(1, 30):
            fake.step(step, loss=3.0 - step * 0.01)
    client = HubClient(hub.address)
    wait_for(lambda: all(r["step"] == 29 for r in client.state()["state"]["ranks"])
             and len(client.state()["state"]["ranks"]) == 4)
    client.close()
    return JOB


@pytest.mark.parametrize("args", [["snapshot", JOB], ["snapshot", JOB, "--json"],
                                  ["jobs"], ["jobs", "--json"], ["flags", JOB]],
                         ids=" ".join)
def test_a_closed_stdout_ends_the_command_quietly(args: list[str], job_with_data: str,
                                                  home: Path):
    out = run_into_closed_pipe(*args, home=home)
    assert out.stderr == ""  # no BrokenPipeError, no "Exception ignored" at exit
    assert out.returncode == STDOUT_CLOSED


def test_with_a_reader_the_same_commands_write_everything(job_with_data: str, home: Path):
    out = subprocess.run([SCALEMON, "snapshot", JOB], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "SCALEMON_HOME": str(home)})
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.startswith(f"job {JOB}  world size 4")
