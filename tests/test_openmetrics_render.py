"""OpenMetrics off the hub's loop, with bounded cardinality (hub/metrics_families.py,
hub/metrics_render.py, hub/openmetrics.py `Exporter`): the default families are per-node and
job aggregates; the texts are made in a forked child from the state as it stood; a scrape
reads bytes only."""

from __future__ import annotations

import logging
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from test_openmetrics import samples

from scalemon.hub import metrics_render
from scalemon.hub.metrics_families import families
from scalemon.hub.metrics_render import Variant
from scalemon.hub.openmetrics import Exporter
from scalemon.protocol import Message
from scalemon.state.jobstate import JobState

JOB = "agg"


def two_nodes(step_times: dict[int, float | None]) -> JobState:
    """Ranks 0-2 on nodeA and 3-5 on nodeB, each at step 7 with the given step time (None:
    the rank sent no step)."""
    state = JobState(job=JOB)
    for r in range(6):
        state.apply(Message("hello", JOB, r, 0, 100.0, {
            "host": "nodeA" if r < 3 else "nodeB", "pid": 10 + r, "world_size": 6,
            "local_rank": r % 3}))
    for r, seconds in step_times.items():
        if seconds is not None:
            state.apply(Message("step", JOB, r, 1, 101.0, {
                "step": 7, "loss": 2.0 + r, "tokens": 100, "step_time_s": seconds}))
    return state


def exposition(state: JobState, per_rank: bool) -> dict:
    out = {}
    for family in families(state, JOB, now=102.0, per_rank=per_rank):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def stat(found: dict, name: str, which: str, node: str | None = None) -> float | None:
    labels = [("job", JOB), ("stat", which)] + ([("node", node)] if node else [])
    return found.get((name, tuple(sorted(labels))))


def test_by_default_the_families_are_per_node_and_job_aggregates_not_per_rank():
    state = two_nodes({0: 0.1, 1: 0.2, 2: 0.6, 3: 1.0, 4: 1.0, 5: None})
    found = exposition(state, per_rank=False)
    assert not any("rank" in dict(labels) for _, labels in found)
    assert stat(found, "scalemon_node_step_time_seconds", "min", "nodeA") == 0.1
    assert stat(found, "scalemon_node_step_time_seconds", "mean", "nodeA") == pytest.approx(0.3)
    assert stat(found, "scalemon_node_step_time_seconds", "max", "nodeA") == 0.6
    # rank 5 sent no step: left out of its node's figures, not counted as 0
    assert stat(found, "scalemon_node_step_time_seconds", "min", "nodeB") == 1.0
    assert stat(found, "scalemon_job_step_time_seconds", "mean") == pytest.approx(2.9 / 5)
    assert stat(found, "scalemon_job_step", "max") == 7
    assert stat(found, "scalemon_job_loss", "max") == 6.0
    running = (("job", JOB), ("node", "nodeB"), ("state", "running"))
    assert found[("scalemon_node_ranks", running)] == 3
    assert found[("scalemon_ranks", (("job", JOB), ("state", "running")))] == 6
    # a gauge no rank measured: its families are declared, with no sample
    assert stat(found, "scalemon_node_gpu_power_watts", "max", "nodeA") is None


def test_per_rank_adds_every_ranks_series_to_the_aggregates():
    state = two_nodes({0: 0.1, 1: 0.2, 2: 0.6, 3: 1.0, 4: 1.0, 5: None})
    plain, every = exposition(state, per_rank=False), exposition(state, per_rank=True)
    assert set(plain) < set(every)
    rank5 = (("host", "nodeB"), ("job", JOB), ("rank", "5"))
    assert every[("scalemon_rank_up", rank5)] == 1
    assert ("scalemon_step_time_seconds", rank5) not in every
    assert every[("scalemon_step_time_seconds", (("host", "nodeA"), ("job", JOB),
                                                 ("rank", "2")))] == 0.6


def test_a_nan_loss_makes_its_nodes_loss_nan_and_leaves_the_other_node_alone():
    state = two_nodes({r: 0.5 for r in range(6)})
    state.apply(Message("step", JOB, 1, 2, 101.5, {"step": 8, "loss": float("nan"),
                                                   "tokens": 100, "step_time_s": 0.5}))
    found = exposition(state, per_rank=False)
    for which in ("min", "mean", "max"):
        assert math.isnan(stat(found, "scalemon_node_loss", which, "nodeA"))
        assert math.isnan(stat(found, "scalemon_job_loss", which))
    assert stat(found, "scalemon_node_loss", "min", "nodeB") == 5.0


def test_the_cardinality_grows_with_the_nodes_not_the_ranks():
    def series(ranks_per_node: int) -> int:
        state = JobState(job=JOB)
        for r in range(4 * ranks_per_node):
            state.apply(Message("hello", JOB, r, 0, 100.0, {
                "host": f"n{r // ranks_per_node}", "pid": r + 1, "world_size": 64,
                "local_rank": r % ranks_per_node}))
            state.apply(Message("step", JOB, r, 1, 101.0, {"step": 1, "loss": 1.0,
                                                           "step_time_s": 0.1}))
        return sum(len(f.samples) for f in families(state, JOB, 102.0, per_rank=False))

    assert series(2) == series(16)


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    made = Exporter(JOB, ("127.0.0.1", 0), per_rank=False)
    yield made
    made.close()


def slow_families(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Building the families takes `seconds` longer (in the forked child too)."""
    real = metrics_render.family_parts

    def slow(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(metrics_render, "family_parts", slow)


def test_update_leaves_the_render_to_a_child_with_the_state_as_it_stood(exporter, monkeypatch):
    slow_families(monkeypatch, 1.0)
    state = two_nodes({r: 0.5 for r in range(6)})
    started = time.perf_counter()
    exporter.update(state, time.monotonic())
    assert time.perf_counter() - started < 0.5  # the loop does not wait for the render
    assert exporter.fork_s and exporter.fork_s[-1] < 0.5
    # the loop folds on meanwhile: the render is of the state when it started
    state.apply(Message("step", JOB, 0, 2, 101.5, {"step": 99, "loss": 1.0,
                                                   "step_time_s": 0.5}))
    text = exporter.text(wait_s=20)
    assert text is not None
    found = samples(text.decode())
    assert found[("scalemon_job_step", (("job", JOB), ("stat", "max")))] == 7


def test_a_scrape_of_every_rank_waits_for_the_next_render_and_a_bad_query_is_refused(
        exporter):
    state = two_nodes({r: 0.5 for r in range(6)})
    stop = threading.Event()

    def loop() -> None:  # the hub's housekeeping
        while not stop.wait(0.05):
            exporter.update(state, time.monotonic())

    threading.Thread(target=loop, daemon=True).start()
    try:
        url = exporter.url
        with urllib.request.urlopen(f"{url}?ranks=all", timeout=30) as reply:
            every = samples(reply.read().decode())
        assert every[("scalemon_step", (("host", "nodeB"), ("job", JOB), ("rank", "4")))] == 7
        with urllib.request.urlopen(url, timeout=30) as reply:
            plain = samples(reply.read().decode())
        assert not any("rank" in dict(labels) for _, labels in plain)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}?ranks=3", timeout=30)
        assert refused.value.code == 400
        assert b"ranks=all" in refused.value.read()
    finally:
        stop.set()


def test_the_setting_asks_every_scrape_for_every_rank(monkeypatch, caplog):
    monkeypatch.setenv("SCALEMON_METRICS_PER_RANK", "1")
    assert Exporter(JOB).default == Variant(per_rank=True)
    monkeypatch.setenv("SCALEMON_METRICS_PER_RANK", "0")
    assert Exporter(JOB).default == Variant(per_rank=False)
    monkeypatch.setenv("SCALEMON_METRICS_PER_RANK", "yes")
    with caplog.at_level(logging.ERROR, logger="scalemon.hub"):
        assert Exporter(JOB).default == Variant(per_rank=False)
    assert "SCALEMON_METRICS_PER_RANK='yes': expected 0 or 1" in caplog.text


def test_a_render_that_fails_is_logged_and_the_last_text_is_kept(exporter, monkeypatch,
                                                                 caplog):
    state = two_nodes({r: 0.5 for r in range(6)})
    exporter.update(state, 0.0, force=True)
    before = exporter.text(wait_s=0)
    assert before is not None

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("a bug in the families")

    monkeypatch.setattr(metrics_render, "family_parts", broken)
    with caplog.at_level(logging.ERROR, logger="scalemon.hub"):
        exporter.update(state, 100.0)
        for _ in range(200):
            if "a bug in the families" in caplog.text:
                break
            time.sleep(0.05)
    assert "could not build the OpenMetrics text: RuntimeError: a bug in the families" \
        in caplog.text
    assert exporter.text(wait_s=0) is before


@pytest.mark.parametrize("openmetrics", [False, True])
def test_the_rows_are_written_as_prometheus_client_writes_them(openmetrics):
    from prometheus_client.exposition import generate_latest as text_latest
    from prometheus_client.openmetrics.exposition import generate_latest as om_latest

    from scalemon.hub.metrics_families import GaugeRows
    from scalemon.hub.metrics_render import exposition

    rows = GaugeRows("scalemon_x", 'Odd "help" \\ with\na newline.', ("job", "host", "rank"))
    for i, value in enumerate((1, 2.5, 1e21, 1e-7, float("nan"), float("inf"), -float("inf"),
                               123456789012, 0.1 + 0.2)):
        rows.add(("j", f'node "{i}" \\ \n', str(i)), value)
    other = GaugeRows("scalemon_y", "Same labels, another family.", ("job", "host", "rank"))
    other.add(("j", 'node "0" \\ \n', "0"), 3)

    class Fixed:
        def collect(self):  # noqa: ANN201 - prometheus_client's Collector protocol
            return [rows.metric(), other.metric()]

    expected = (om_latest if openmetrics else text_latest)(Fixed())
    assert exposition([rows, other], openmetrics) == expected
