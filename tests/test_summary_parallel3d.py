"""`scalemon summary` of a 3-D parallel job (pure functions, synthetic records): the mesh, the
pipeline's bubble (latest and over the run) beside its schedule's, the MoE balance and the
P2P rows, in the JSON and as the same lines `scalemon snapshot` prints."""

from __future__ import annotations

import json

from test_snapshot_text_parallel3d import state_of
from test_tui_parallel3d import mesh_messages, p2p_messages, with_bubbles

from scalemon.reports.export import strict_json
from scalemon.reports.snapshot import snapshot_json
from scalemon.reports.snapshot_text import parallel_lines
from scalemon.reports.summary import run_records, summarize
from scalemon.reports.summary_text import summary_text
from scalemon.tui.sim import SimJob


def pipeline_run() -> tuple[dict, dict]:
    """A pp2 x tp2 job of 4 ranks whose steps carry their bubble (rank r: 0.2 + 0.05 r),
    all_to_all bytes and MoE extras (`with_bubbles`); returns (its snapshot JSON, its
    summary)."""
    sim = SimJob(ranks=4, gpu=False, amp=False)
    messages = with_bubbles(sim.run(10))
    t = sim.end_t(10)
    messages += mesh_messages(sim, t) + p2p_messages(sim, t)
    state = snapshot_json(state_of(messages), now=t + 0.5)
    return state, summarize(state, run_records(messages), {"kind": "history", "where": "x"})


def test_the_summary_has_the_mesh_the_bubble_over_the_run_moe_and_p2p():
    state, s = pipeline_run()
    assert s["mesh"]["shape"] == {"pp": 2, "dp": 1, "tp": 2}
    pipeline = s["pipeline"]
    assert pipeline["schedule"] == "1f1b" and pipeline["theoretical_bubble"] == 0.2
    run = pipeline["measured_bubble_run"]
    assert run["samples"] == 40 and abs(run["median"] - 0.275) < 1e-9
    assert s["moe"]["dropped_tokens"] == 8 and s["moe"]["imbalance"] == 1.3
    sends = {(r["src"], r["dst"]) for r in s["p2p"] if r["op"] == "send"}
    assert sends == {(0, 2), (2, 0), (1, 3), (3, 1)}
    row = next(r for r in s["p2p"] if (r["op"], r["src"], r["dst"]) == ("send", 0, 2))
    assert row["count"] == 40 and row["bytes"] == 40 << 20 and abs(row["time_s"] - 0.08) < 1e-9
    assert all(r["op"] not in ("send", "recv") for r in s["collectives"])
    json.dumps(strict_json(s), allow_nan=False)  # what --json prints


def test_the_summary_text_carries_the_snapshots_lines_and_the_bubble_over_the_run():
    state, s = pipeline_run()
    text = summary_text(s)
    lines = text.splitlines()
    for line in parallel_lines(state):  # the same lines as `scalemon snapshot`
        assert any(out.startswith(line) for out in lines), line
    assert "mesh pp 2 x dp 1 x tp 2" in lines
    pipeline = next(line for line in lines if line.startswith("pipeline 1f1b"))
    assert pipeline.startswith("pipeline 1f1b, 2 stages x 4 microbatches: bubble measured "
                               "28% (median), theory 20%")
    assert "bubble over the run: median 27.5% p90" in pipeline
    assert ("all_to_all recv imbalance 1.60x, router imbalance 1.30x, dropped 8 tokens in the "
            "latest step") in text
    assert any(line.strip().startswith("send 0 -> 2 (pp") for line in lines)


def test_a_summary_without_a_pipeline_has_none_of_those_lines():
    sim = SimJob(ranks=2, gpu=False, amp=False)
    messages = sim.run(5)
    state = snapshot_json(state_of(messages), now=sim.end_t(5))
    s = summarize(state, run_records(messages))
    assert s["pipeline"] is None and s["moe"] is None and s["p2p"] == [] and s["mesh"] is None
    text = summary_text({**s, "source": {}})
    assert "pipeline" not in text and "point to point" not in text and "mesh" not in text
