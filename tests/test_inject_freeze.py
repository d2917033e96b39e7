"""The demo trainer's --inject-freeze RANK:STEP (demo_train/faults.py): parsed and refused as
the other planted faults are, first attempt only, and in a real process it holds the GIL: a
second Python thread of that process prints nothing while it is frozen."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import wait_for
from scalemon.demo_train import train
from scalemon.demo_train.faults import Faults, RankStep


def test_the_flag_parses_as_rank_and_step(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.parse_args(["--inject-freeze", "1:5"]).inject_freeze == RankStep(1, 5)
    assert train.parse_args([]).inject_freeze is None


@pytest.mark.parametrize(("value", "says"), [
    ("1:3", "--inject-freeze 1:3 names rank 1, and this job has 1 rank(s)"),
    ("1:0", "argument --inject-freeze: need RANK >= 0 and STEP >= 1; got '1:0'"),
    ("5", "argument --inject-freeze: expected RANK:STEP, e.g. 1:5; got '5'"),
])
def test_a_mistaken_value_is_refused_saying_what_is_wrong(value, says, capsys,
                                                          monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(["--inject-freeze", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"train.py: error: {says}" in err, err


def test_the_freeze_is_planted_in_the_first_attempt_only(monkeypatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert Faults(1, freeze=RankStep(1, 7)).freeze_step == 7
    assert Faults(0, freeze=RankStep(1, 7)).freeze_step is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert Faults(1, freeze=RankStep(1, 7)).freeze_step is None


# a process whose second thread prints a heartbeat every 20 ms; its main thread then takes
# the planted fault (argv[1] "freeze"), or sleeps in libc through ctypes.CDLL, which releases
# the GIL (argv[1] "release": the control)
CHILD = """
import ctypes, sys, threading, time
from scalemon.demo_train.faults import Faults, RankStep

def beat():
    n = 0
    while True:
        n += 1
        print(f"beat {n}", flush=True)
        time.sleep(0.02)

threading.Thread(target=beat, daemon=True).start()
time.sleep(0.3)
print("freezing", flush=True)
if sys.argv[1] == "freeze":
    Faults(0, freeze=RankStep(0, 1)).before_step(1)
else:
    ctypes.CDLL(None).sleep(3600)
"""


def beats_while_frozen(mode: str, tmp_path) -> tuple[int, str]:
    """Heartbeats the child printed in the second after it froze, and its stderr."""
    out, err = tmp_path / f"{mode}.out", tmp_path / f"{mode}.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=stdout,
                                stderr=stderr)
    try:
        wait_for(lambda: "freezing" in out.read_text(), timeout=60)
        time.sleep(1.0)
        assert proc.poll() is None, err.read_text()  # frozen, not gone
        after = out.read_text().split("freezing", 1)[1]
        return after.count("beat"), err.read_text()
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_frozen_process_runs_no_other_python_thread(tmp_path) -> None:
    beats, err = beats_while_frozen("freeze", tmp_path)
    assert "rank 0: injected freeze before step 1 (native code holding the GIL)" in err
    assert beats <= 1, beats  # one may slip in between the line and the call
    control, _ = beats_while_frozen("release", tmp_path)  # the same sleep, GIL released
    assert control >= 10, control
