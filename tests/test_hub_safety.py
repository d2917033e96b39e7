"""Issue #13: what a hub must refuse or keep, each scenario on real processes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from conftest import wait_for


def test_home_and_run_directories_are_created_for_this_user_only(tmp_path, monkeypatch):
    home = tmp_path / "fresh" / "home"
    monkeypatch.setenv("SCALEMON_HOME", str(home))
    proc = subprocess.Popen([sys.executable, "-m", "scalemon.hub", "--job", "jobP", "--home",
                             str(home), "--linger", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (home / "jobs" / "jobP.json").exists(), timeout=15)
        for path in (home, home / "run", home / "run" / "jobP", home / "jobs"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory of another user")
def test_a_run_directory_of_another_user_is_refused_with_whose_it_is(home):
    """Another user made run/<job> first (in a shared, writable SCALEMON_HOME): the hub must
    not bind its sockets there, and the agent must not send there."""
    theirs = home / "run" / "jobQ"
    theirs.mkdir(parents=True)
    os.chown(theirs, 65534, 65534)
    out = subprocess.run([sys.executable, "-m", "scalemon.hub", "--job", "jobQ", "--home",
                          str(home)], capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert f"{theirs} belongs to" in out.stderr and "uid 65534" in out.stderr
    assert "SCALEMON_HOME" in out.stderr
    assert not (theirs / "ingest.sock").exists()
    assert not (home / "jobs" / "jobQ.json").exists()

    agent = subprocess.run(
        [sys.executable, "-c", "import scalemon.agent as sm; print(sm.init() is None)"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "SCALEMON_HOME": str(home), "SCALEMON_JOB_ID": "jobQ"})
    assert agent.stdout.strip() == "True"  # the monitor is off, training goes on
    assert "monitor not started" in agent.stderr and "belongs to" in agent.stderr
