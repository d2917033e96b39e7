"""`snapshot --json` names the stragglers the dashboard names, by the same rule: a real hub fed
a simulated job with one slow rank, `scalemon snapshot` processes, and the dashboard's own
fold of the same messages."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import zmq

from conftest import SCALEMON, wait_for
from scalemon import protocol
from scalemon.link.client import HubClient
from scalemon.protocol import Message
from scalemon.tui.model import DashboardData
from scalemon.tui.sim import SimJob
from scalemon.tui.views.overview import overview

STEPS = 60


def feed(zctx: zmq.Context, hub, messages: list[Message]) -> None:
    """Send `messages` to the hub as their ranks would; return once it stored them all."""
    push = zctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 5000)
    push.connect(hub.address.ingest)
    for m in messages:
        push.send(protocol.encode(m.type, m.job, m.rank, m.seq, m.body, t=m.t))
    client = HubClient(hub.address)
    wait_for(lambda: client.request("ping")["head"] >= len(messages), timeout=60)
    client.close()
    push.close()


def snapshot_json(job: str, home: Path) -> dict:
    out = subprocess.run([SCALEMON, "snapshot", job, "--json"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "SCALEMON_HOME": str(home)})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def dashboard_stragglers(sim: SimJob, messages: list[Message]) -> list[tuple[int, float]]:
    """What the dashboard's header names, from the same messages."""
    data = DashboardData()
    data.apply_messages(messages)
    return overview(data, now=sim.end_t(STEPS)).summary.stragglers


@pytest.mark.parametrize(("collectives", "measure"), [(True, "arrival_lateness_s"),
                                                     (False, "compute_over_median_s")],
                         ids=["arrival", "compute"])
def test_snapshot_json_names_the_dashboards_stragglers(
        collectives: bool, measure: str, home: Path, start_hub, zctx: zmq.Context):
    job = f"slow{int(collectives)}"
    hub = start_hub(job, "--lost-after", "600")
    sim = SimJob(job=job, ranks=4, straggler=2, straggler_s=0.04)
    messages = [m for m in sim.run(STEPS) if collectives or m.type != "collectives"]
    feed(zctx, hub, messages)
    state = snapshot_json(job, home)
    named = state["stragglers"]
    assert [s["rank"] for s in named] == [2]
    assert named[0]["measure"] == measure and named[0]["value_s"] > named[0]["bar_s"] >= 0.01
    rank2 = next(r for r in state["ranks"] if r["rank"] == 2)
    assert named[0]["value_s"] == rank2[measure]  # the rank's own field, as the JSON has it
    expected = dashboard_stragglers(sim, messages)
    assert [(s["rank"], pytest.approx(s["value_s"])) for s in named] == expected

    hub.kill()  # the hub gone: the history replayed says the same
    replayed = snapshot_json(job, home)
    assert [(s["rank"], s["measure"]) for s in replayed["stragglers"]] == [(2, measure)]


def test_no_straggler_is_an_empty_list(home: Path, start_hub, zctx: zmq.Context):
    hub = start_hub("even1", "--lost-after", "600")
    sim = SimJob(job="even1", ranks=4)
    messages = sim.run(STEPS)
    feed(zctx, hub, messages)
    assert snapshot_json("even1", home)["stragglers"] == []
    assert dashboard_stragglers(sim, messages) == []
