"""`scalemon snapshot` for people on a 3-D parallel job: the mesh column, the rank table grouped
by a mesh axis (`--group-by`, and its error naming the axes), the pipeline's bubble, the MoE
balance, the P2P rows and a pipeline hang's chain; from a JobState fed synthetic messages."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest
from test_tui_parallel3d import mesh_messages, p2p_messages, pipeline_hang

from scalemon.cli import snapshot as cli_snapshot
from scalemon.protocol import Message
from scalemon.reports.parallel_text import (
    chain_text,
    mesh_text,
    moe_line,
    pipeline_line,
    unknown_axis_text,
)
from scalemon.reports.snapshot import snapshot_json
from scalemon.reports.snapshot_text import format_snapshot, group_by_problem
from scalemon.state.jobstate import JobState
from scalemon.tui.sim import SimJob


def state_of(messages: list[Message]) -> JobState:
    st = JobState()
    for m in messages:
        st.apply(m)
    return st


def pipeline_job(moe: bool = True) -> tuple[dict[str, Any], float]:
    """A pp2 x tp2 job of 4 ranks, 10 steps, its mesh, P2P and pipeline described; with
    `moe`, its ranks log the MoE extras. Returns its snapshot JSON and time."""
    sim = SimJob(ranks=4, gpu=False, amp=False)
    messages = sim.run(10)
    t = sim.end_t(10)
    messages += mesh_messages(sim, t) + p2p_messages(sim, t)
    for r, body in enumerate(sim.step_bodies(11, t + 0.1)):
        body["pipeline_bubble"] = 0.2 + 0.05 * r
        if moe:
            body["extra"].update(moe_imbalance=(1.2, 1.3, 1.3, 1.6)[r], moe_dropped_tokens=3)
        messages.append(sim.message(r, "step", body, t + 0.1))
    st = state_of(messages)
    return snapshot_json(st, now=t + 0.5), t


def test_pipeline_and_moe_lines():
    assert pipeline_line({"schedule": "1f1b", "stages": 2, "microbatches": 4,
                          "measured_bubble": 0.31, "theoretical_bubble": 0.2}) == (
        "pipeline 1f1b, 2 stages x 4 microbatches: bubble measured 31% (median), theory 20%")
    assert pipeline_line({"schedule": "interleaved", "stages": 2, "microbatches": 4,
                          "virtual_stages": 2, "measured_bubble": None,
                          "theoretical_bubble": 1 / 9}) == (
        "pipeline interleaved, 2 stages x 4 microbatches (2 virtual stages per rank): bubble "
        "measured n/a, theory 11%")
    assert pipeline_line({"schedule": "1f1b", "stages": 2, "microbatches": 2,
                          "virtual_stages": 1, "measured_bubble": 0.2,
                          "theoretical_bubble": 1 / 3}).startswith(
        "pipeline 1f1b, 2 stages x 2 microbatches: ")  # one stage per rank: not said
    # sends and receives measured, the schedule never described: no made-up theory
    assert pipeline_line({"schedule": None, "stages": None, "microbatches": None,
                          "measured_bubble": 0.25, "theoretical_bubble": None}) == (
        "pipeline bubble measured 25% (median); no theory: the script did not describe its "
        "schedule (scalemon.agent.describe_pipeline)")
    assert pipeline_line(None) is None and moe_line(None) is None
    assert moe_line({"a2a_recv_imbalance": 1.4, "imbalance": 1.3, "dropped_tokens": 12}) == (
        "all_to_all recv imbalance 1.40x, router imbalance 1.30x, dropped 12 tokens in the latest "
        "step")
    assert mesh_text({"pp": 0, "dp": 1, "tp": 0}, ["pp", "dp", "tp"]) == "pp0 dp1 tp0"
    assert mesh_text(None, ["pp"]) == "n/a"


def test_a_chain_names_the_op_on_each_edge_and_the_culprits_cause_at_its_end():
    hang = {"chains": [[2, 1, 0], [4, 3]],
            "waits": [{"rank": 2, "op": "recv"}, {"rank": 1, "op": "recv"},
                      {"rank": 4, "op": "all_reduce"}],
            "causes": [{"rank": 0, "cause": "python", "culprit": True,
                        "frame": "train.py:40 in step()"},
                       {"rank": 3, "cause": "gone", "culprit": True,
                        "text": "rank 3: lost: no exit reported"}]}
    assert chain_text([2, 1, 0], hang) == "2 -recv-> 1 -recv-> 0 (in Python: train.py:40 in step())"
    assert chain_text([4, 3], hang) == "4 -all_reduce-> 3 (lost: no exit reported)"


def test_the_snapshot_text_has_the_mesh_column_pipeline_moe_and_p2p_lines():
    state, _ = pipeline_job()
    text = format_snapshot(state)
    lines = text.splitlines()
    heading = next(line for line in lines if line.lstrip().startswith("rank"))
    assert heading.split()[:2] == ["rank", "mesh"]
    assert "bubble %" in heading  # ranks of a pipeline: its column (absent from other jobs')
    end = heading.index("bubble %") + len("bubble %")  # right-aligned under its heading
    assert next(line for line in lines if line.split()[:1] == ["1"])[end - 4:end] == "25.0"
    row = next(line for line in lines if line.split()[:1] == ["3"])
    assert row.split()[1:4] == ["pp1", "dp0", "tp1"]
    assert "mesh pp 2 x dp 1 x tp 2" in lines
    assert next(line for line in lines if line.startswith("pipeline 1f1b, 2 stages x 4 "
                                                          "microbatches: bubble measured "))
    assert "theory 20%" in text
    # the median; 4 x 3
    assert "router imbalance 1.30x, dropped 12 tokens in the latest step" in text
    p2p = lines.index(next(line for line in lines if line.startswith("point to point")))
    assert any(line.strip().startswith("send 0 -> 2 (pp") and "40 x, 40.0 MiB, 80 ms" in line
               for line in lines[p2p:])
    assert not any("send" in line for line in lines if line.startswith("  default_pg"))


def test_group_by_puts_a_heading_over_each_coordinates_ranks_and_names_the_axes():
    state, _ = pipeline_job(moe=False)
    text = format_snapshot(state, group_by="tp")
    lines = text.splitlines()
    at = lines.index("── tp 0: 2 ranks")
    assert [line.split()[0] for line in lines[at + 1:at + 3]] == ["0", "2"]
    at = lines.index("── tp 1: 2 ranks")
    assert [line.split()[0] for line in lines[at + 1:at + 3]] == ["1", "3"]
    assert group_by_problem(state, "tp") is None
    assert group_by_problem(state, "ep") == "no mesh axis 'ep': the mesh has pp, dp, tp"
    with pytest.raises(ValueError, match="the mesh has pp, dp, tp"):
        format_snapshot(state, group_by="ep")
    plain, _ = snapshot_json(state_of(SimJob(ranks=2).run(3)), now=0.0), 0
    assert group_by_problem(plain, "tp") == unknown_axis_text("tp", [])
    assert "mesh" not in format_snapshot(plain).splitlines()[1].split()


def test_scalemon_snapshot_group_by_an_unknown_axis_exits_2_naming_the_axes(
        monkeypatch, capsys):
    state, _ = pipeline_job(moe=False)

    class Client:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def state(self) -> dict[str, Any]:
            return {"state": state, "hub": None}

    class Address:
        base = "ipc:///nowhere"

    monkeypatch.setattr(cli_snapshot, "resolve_hub", lambda target: ("j", Address()))
    monkeypatch.setattr("scalemon.link.client.HubClient", Client)
    monkeypatch.setattr("scalemon.link.client.hub_key_problem", lambda address: None)
    args = argparse.Namespace(target="j", timeout=1.0, json=False, group_by="ep")
    assert cli_snapshot.cmd_snapshot(args) == 2
    assert "--group-by no mesh axis 'ep': the mesh has pp, dp, tp" in capsys.readouterr().err
    args.group_by = "pp"
    assert cli_snapshot.cmd_snapshot(args) == 0
    out = capsys.readouterr().out
    assert "── pp 0: 2 ranks" in out and "── pp 1: 2 ranks" in out
    args.json = True
    assert cli_snapshot.cmd_snapshot(args) == 0
    assert json.loads(capsys.readouterr().out)["mesh"]["dims"] == ["pp", "dp", "tp"]


def test_the_snapshot_text_draws_a_pipeline_hangs_chain():
    messages, t = pipeline_hang()
    text = format_snapshot(snapshot_json(state_of(messages), now=t + 0.5))
    assert "  waits for: 2 -recv-> 1 -recv-> 0 (in Python: train.py:40 in step())" in \
        text.splitlines()
