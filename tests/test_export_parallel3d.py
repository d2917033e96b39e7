"""OpenMetrics export (hub/openmetrics.py) of a 3-D parallel job: each rank's pipeline bubble,
the schedule's theoretical bubble and the ranks' median, P2P ops, bytes and time per (group,
op, src, dst) and the MoE balance; the exposition read back by prometheus_client's parsers,
the Prometheus text one and the strict OpenMetrics one."""

from __future__ import annotations

import pytest
from prometheus_client.core import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from test_openmetrics import samples
from test_snapshot_text_parallel3d import state_of
from test_tui_parallel3d import mesh_messages, p2p_messages, with_bubbles

from scalemon.hub.openmetrics import families
from scalemon.state.jobstate import JobState
from scalemon.tui.sim import SimJob


class _Fixed:
    def __init__(self, state: JobState, now: float) -> None:
        self.state, self.now = state, now

    def collect(self):  # noqa: ANN201 - prometheus_client's Collector protocol
        return families(self.state, "pp", self.now)


def pipeline_state() -> tuple[JobState, float]:
    """A pp2 x tp2 job of 4 ranks: bubbles 0.2 + 0.05 r, all_to_all bytes and MoE extras in its
    steps (`with_bubbles`), P2P rows."""
    sim = SimJob(ranks=4, gpu=False, amp=False)
    messages = with_bubbles(sim.run(10))
    t = sim.end_t(10)
    messages += mesh_messages(sim, t) + p2p_messages(sim, t)
    return state_of(messages), t + 0.5


def exposition(openmetrics: bool = False) -> str:
    st, now = pipeline_state()
    registry = CollectorRegistry()
    registry.register(_Fixed(st, now))  # type: ignore[arg-type]
    return (openmetrics_latest if openmetrics else generate_latest)(registry).decode()


def test_p2p_pipeline_and_moe_families_parse_and_carry_the_values():
    found = samples(exposition())
    job = ("job", "pp")
    send = (("dst", "2"), ("group", "pp [0,2]"), job, ("op", "send"), ("src", "0"))
    assert found[("scalemon_p2p_ops_total", send)] == 40
    assert found[("scalemon_p2p_bytes_total", send)] == 40 << 20
    assert found[("scalemon_p2p_seconds_total", send)] == pytest.approx(0.08)
    recv = (("dst", "3"), ("group", "pp [1,3]"), job, ("op", "recv"), ("src", "1"))
    assert found[("scalemon_p2p_bytes_total", recv)] == 40 << 20
    assert found[("scalemon_pipeline_bubble_theoretical_ratio",
                  (job, ("schedule", "1f1b")))] == pytest.approx(0.2)
    assert found[("scalemon_moe_router_imbalance_ratio", (job,))] == pytest.approx(1.3)
    assert found[("scalemon_moe_dropped_tokens", (job,))] == 8
    assert found[("scalemon_moe_a2a_recv_imbalance_ratio", (job,))] == pytest.approx(1.6)


def test_each_ranks_bubble_and_the_median_are_exported():
    found = samples(exposition())
    for rank in range(4):
        labels = (("host", "node0"), ("job", "pp"), ("rank", str(rank)))
        assert found[("scalemon_pipeline_bubble_ratio", labels)] == \
            pytest.approx(0.2 + 0.05 * rank)
        assert ("scalemon_p2p_wait_seconds", labels) in found
    assert found[("scalemon_pipeline_bubble_measured_ratio", (("job", "pp"),))] == \
        pytest.approx(0.275)


def test_the_strict_openmetrics_parser_reads_the_new_families():
    strict = {f.name: f for f in openmetrics_families(exposition(openmetrics=True))}
    assert {"scalemon_p2p_ops", "scalemon_p2p_bytes", "scalemon_p2p_seconds",
            "scalemon_pipeline_bubble_theoretical_ratio", "scalemon_moe_dropped_tokens"} <= \
        set(strict)


def test_a_job_without_a_pipeline_exports_no_sample_of_them():
    found = samples(generate_latest(_registry(JobState(job="x"))).decode())
    assert not [name for name, _ in found if "p2p" in name or "bubble" in name
                or "moe" in name]


def _registry(st: JobState) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_Fixed(st, 0.0))  # type: ignore[arg-type]
    return registry
