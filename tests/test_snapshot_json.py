"""`scalemon snapshot --json` is strict JSON where a number stays a number: a NaN loss and an
infinite loss scale are `null`, never a string, and the alert's text still says NaN. A real hub
fed by a fake rank, read by a `scalemon snapshot` process."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import zmq

from conftest import SCALEMON, FakeRank, wait_for
from scalemon.link.client import HubClient


def _strict(text: str) -> dict:
    """`text` parsed, failing on the NaN/Infinity literals strict JSON has not."""
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in strict JSON")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_null_and_the_alert_says_nan(home: Path, start_hub,
                                                            zctx: zmq.Context) -> None:
    hub = start_hub("nanjob")
    rank = FakeRank(zctx, hub.address, "nanjob", 0)
    rank.hello(world_size=1)
    rank.send("step", {"step": 1, "loss": math.nan, "loss_scale": math.inf,
                       "step_time_s": 0.01, "extra": {"grad": -math.inf, "lr": 0.5}})
    client = HubClient(hub.address)
    wait_for(lambda: client.request("ping")["head"] >= 2, timeout=60)
    client.close()
    out = subprocess.run([SCALEMON, "snapshot", "nanjob", "--json"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "SCALEMON_HOME": str(home)})
    assert out.returncode == 0, out.stderr
    state = _strict(out.stdout)
    [r0] = state["ranks"]
    assert r0["loss"] is None and r0["loss_scale"] is None and r0["step_time_s"] == 0.01
    assert r0["extra"] == {"grad": None, "lr": 0.5}
    [alert] = [a for a in state["alerts"] if a["kind"] == "loss_not_finite"]
    assert alert["value"] is None and "loss is NaN on rank 0" in alert["text"]
    text = subprocess.run([SCALEMON, "snapshot", "nanjob"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "SCALEMON_HOME": str(home)}).stdout
    assert "nan" in text  # people still read the NaN in the table
