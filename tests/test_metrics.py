"""The table of metrics and everything derived from it agree: protocol validation, the reducer
and its JSON, the agent's bodies, the dashboard's columns, help and plots, the snapshot table,
the simulated job and docs/protocol.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scalemon import metrics, protocol
from scalemon.metrics import BY_NAME, METRICS, fields_of
from scalemon.protocol import Message
from scalemon.reports.snapshot import snapshot_json
from scalemon.reports.snapshot_text import format_snapshot
from scalemon.state import fold as model
from scalemon.state.jobstate import JobState
from scalemon.text import display
from scalemon.tui.screens.help import HELP
from scalemon.tui.sim import SimJob
from scalemon.tui.views.rank_detail import DETAIL_PANELS
from scalemon.tui.views.rows import COLUMNS

UNIT_SUFFIX = {"s": "_s", "bytes": "_bytes", "%": "_pct", "W": "_w", "°C": "_c",
               "s (Unix)": "_t"}
SAMPLE = {"float": 1.5, "int": 7, "bool": True, "str": "forward", "map": {"lr": 0.001},
          "list": [["0", 3, "all_reduce", 1.5]]}


def full_body(source: str) -> dict:
    """A body with every field of message `source`, each with a value of its kind."""
    return {m.name: SAMPLE[m.kind] for m in fields_of(source)}


def test_the_table_is_well_formed():
    kept = [m for m in METRICS if m.kept]
    assert len(BY_NAME) == len(kept), "two kept metrics share a name"
    for m in METRICS:
        assert m.source in metrics.SOURCES and m.kind in metrics.KINDS, m.name
        assert m.description and not m.description.endswith(" "), m.name
        if m.unit in UNIT_SUFFIX:  # units are in the names
            assert m.name.endswith(UNIT_SUFFIX[m.unit]), m.name
        if m.show is not None:
            assert m.show.style in metrics.STYLES, m.name
            assert m.show.of is None or m.show.of in BY_NAME, m.name
            assert m.show.column or m.show.plot, f"{m.name}: shown neither as column nor plot"
    headings = [c.heading for c in display.rank_columns()]
    assert len(headings) == len(set(headings)), headings


def test_protocol_validates_exactly_the_table_fields():
    for source in ("step", "heartbeat"):
        spec = protocol.MESSAGE_FIELDS[source]
        assert list(spec) == [m.name for m in fields_of(source)]
        for m in fields_of(source):
            types, required = spec[m.name]
            assert required == m.required and (type(None) in types) == m.nullable, m.name
        body = full_body(source)
        decoded = protocol.decode(protocol.encode(source, "j", 0, 0, body))
        assert decoded.body == body
        for m in fields_of(source):
            # a map is a list's wrong kind, a list every other kind's
            wrong = {**body, m.name: {"x": 1} if m.kind == "list" else [1]}
            with pytest.raises(protocol.ProtocolError, match=f"{source}.{m.name}"):
                protocol.decode(protocol.encode(source, "j", 0, 0, wrong))


def test_the_reducer_keeps_every_metric_under_its_name_and_the_json_shows_it():
    state = JobState()
    state.apply(Message("hello", "j", 0, 0, 10.0, {
        "host": "h", "pid": 1, "world_size": 1, "local_rank": 0, "agent_version": "9.9",
        "torch_version": "2.13", "config": {"preset": "tiny", "model": {"n_layer": 2}}}))
    step, beat = full_body("step"), full_body("heartbeat")
    well_known = {m.name: SAMPLE[m.kind] for m in METRICS if m.source == "extra"}
    step["extra"] = {"lr": 0.001, **well_known, "tokens_per_s": 5e4, "mfu": 0.4}
    state.apply(Message("step", "j", 0, 1, 11.0, step))
    state.apply(Message("heartbeat", "j", 0, 2, 12.0, beat))
    state.apply(Message("step", "j", 0, 3, 13.0, {"step": 2, "extra": {"lr": 0.002}}))
    view = state.ranks[0]
    assert set(view.metrics) == set(metrics.latest_of("step") + metrics.latest_of("heartbeat"))
    out = snapshot_json(state, now=20.0)
    rank = out["ranks"][0]
    for m in metrics.KEPT:
        if m.source == "heartbeat":
            assert rank[m.name] == beat[m.name], m.name
        elif m.source == "step":
            assert rank[m.name] is None, f"{m.name}: a step without it must not keep it"
        elif m.source == "extra":
            assert rank["extra"][m.name] == step["extra"][m.name] == view.value(m.name)
    assert rank["heartbeat_age_s"] == pytest.approx(7.0) == view.value("heartbeat_age_s", 20.0)
    assert rank["extra"] == {**step["extra"], "lr": 0.002}  # last value each
    assert rank["step"] == 2 and rank["agent_version"] == "9.9"
    assert rank["torch_version"] == "2.13"
    assert out["info"]["config"] == {"0": {"preset": "tiny", "model": {"n_layer": 2}}}
    with pytest.raises(KeyError):
        view.value("mem_alloc_gib")  # one name per metric: no display-unit aliases


def test_extra_names_per_rank_are_bounded():
    state = JobState()
    for i in range(200):
        state.apply(Message("step", "j", 0, i, 1.0, {"step": i, "extra": {f"x{i}": i}}))
    state.apply(Message("step", "j", 0, 201, 1.0, {"step": 201, "extra": {"x0": -1}}))
    extra = state.ranks[0].extra
    assert len(extra) == 64 and extra["x0"] == -1 and "x100" not in extra


def test_the_agent_sends_the_table_fields_and_nothing_else():
    from scalemon.agent.heartbeat import Heartbeat, Phase
    from scalemon.agent.nvml import GpuReader
    from scalemon.agent.steps import RawStep, ScaleTracker, StepFinisher

    finisher = StepFinisher(ScaleTracker(1024.0), Phase(), None)
    raw = RawStep(step=3, tokens=64, step_time_s=0.1, agent_time_s=1e-5, extra={"lr": 0.1},
                  loss=2.5, loss_scale=512.0, optimizer_spans=[], optimizer_untimed=0,
                  allreduce_spans=[], staged=None)
    body = finisher.finish(raw, None)
    assert body is not None and set(body) == {m.name for m in fields_of("step")}
    assert body["skipped"] is True and body["extra"] == {"lr": 0.1}
    protocol.check_body("step", body)

    from scalemon.agent.recorder import Recorder

    recorder = Recorder(lambda *_: True, 0, lambda: None, lambda: None, nccl=False, sources=[],
                        start=False)
    counters = {"dropped": 0, "queued": 0, "clock_offset_s": None,
                **recorder.heartbeat_fields()}  # what Run._counters adds
    beat = Heartbeat(Phase(), GpuReader(), lambda *_: True, lambda: counters, interval_s=60)
    body = beat.beat()
    beat.stop()
    # `same` only names the values a heartbeat leaves out (none in a first one)
    assert set(body) == {m.name for m in fields_of("heartbeat")} - {"same"}
    protocol.check_body("heartbeat", body)


def test_the_simulated_job_speaks_the_table():
    sim = SimJob(ranks=2)
    names = {m.name for m in fields_of("step")}
    for body in sim.step_bodies(10, sim.start_t):
        assert set(body) <= names
        protocol.check_body("step", body)
    assert set(sim.heartbeat(0, 10)) <= {m.name for m in fields_of("heartbeat")}


def test_dashboard_columns_help_and_plots_come_from_the_table():
    metric_columns = [c for c in COLUMNS if c.metric is not None]
    assert [c.metric for c in metric_columns] == list(metrics.COLUMNS)
    for c in metric_columns:
        assert c.heading == c.metric.show.heading and c.key == c.metric.name
        assert f"*{c.heading}*: {c.metric.description}" in HELP
    plotted = [m for _, group in DETAIL_PANELS for m in group]
    assert len(plotted) == len(set(plotted)) and set(plotted) == set(metrics.PLOTTED)
    assert set(model.AGGREGATED) <= set(BY_NAME)
    assert set(model.STEP_PLOTTED + model.EXTRA_PLOTTED + model.HEARTBEAT_PLOTTED) <= set(BY_NAME)


def test_snapshot_table_has_the_same_columns_and_shows_extras_and_info():
    sim = SimJob(ranks=2)
    state = JobState()
    for msg in sim.run(20):
        state.apply(msg)
    text = format_snapshot(snapshot_json(state, now=sim.end_t(20)))
    header = text.splitlines()[1]
    for c in display.rank_columns(dashboard=False):
        if c.metric is not None and c.metric.show.when_seen:  # no rank has one: no column
            assert c.heading not in header, c.heading
        else:
            assert c.heading in header, c.heading
    assert "late ms" in header  # arrival lateness: computed by the reducer, hub and dashboard
    assert "bubble %" not in header  # a pipeline's bubble, and this job has no pipeline
    row = text.splitlines()[2]
    assert re.search(r"\b0\b.*\b20\b", row) and "running" in row
    assert "rank 0 extra: lr=" in text and "mfu=" in text
    assert "info config (rank 0,1): preset=gpt2-124m" in text


def test_snapshot_shows_the_tokens_per_s_the_dashboard_derives_from_tokens_alone():
    """A script that logs `tokens` but no rate of its own (nanoGPT with `log(tokens=...)`):
    the dashboard shows tokens / step time, and so must `scalemon snapshot` (it said n/a; its
    node table reads the same `snapshot_text.snapshot_values`)."""
    from scalemon.reports.snapshot_text import _rank_lines  # the table without the job's header

    sim = SimJob(ranks=2)
    state = JobState()
    for msg in sim.run(6):
        if msg.type == "step":
            msg.body.get("extra", {}).pop("tokens_per_s", None)
        state.apply(msg)
    ranks = snapshot_json(state, now=sim.end_t(6))["ranks"]
    columns = [c for c in display.rank_columns(dashboard=False, seen=ranks) if c.key != "state"]
    at = next(i for i, c in enumerate(columns) if c.heading == "tok/s")  # state goes last
    for rank in ranks:
        derived = state.ranks[rank["rank"]].value("tokens_per_s")
        assert derived and "tokens_per_s" not in rank["extra"]
        shown = display.metric_text(BY_NAME["tokens_per_s"], {"tokens_per_s": derived})
        row = _rank_lines(ranks, 60)[1 + rank["rank"]]
        assert row.split()[at] == shown != display.NA, row


def test_docs_field_tables_are_generated_from_the_table():
    path = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
    text = path.read_text()
    assert text.count("<!-- metrics:") == 2 * len(metrics.GENERATED)
    assert metrics.render_docs(text) == text, (
        "docs/protocol.md is out of date: run `python -m scalemon.metrics --update-docs`")
    for m in METRICS:
        assert f"`{m.name}`" in text, m.name


ONE_MORE_ROW = '''
import json, sys
from scalemon import metrics
from scalemon.metrics import Metric, Overview, Show

# the whole change: one row (the producer is the fake rank below)
metrics.METRICS = (*metrics.METRICS, Metric(
    "probe_time_s", "step", "float", "s", "seconds the probe took",
    show=Show(unit="ms", scale=1e3, column="probe", width=6, plot="probe", key=5,
              overview=Overview("time", "probe", 3))))
metrics.derive()

from scalemon import protocol
from scalemon.reports.snapshot import snapshot_json
from scalemon.text import display
from scalemon.reports.snapshot_text import format_snapshot
from scalemon.reports.export import strict_json
from scalemon.state.fold import AGGREGATED, JobFold
from scalemon.protocol import Message, ProtocolError
from scalemon.tui.model import DashboardData
from scalemon.tui.screens.help import HELP
from scalemon.tui.views.overview import overview
from scalemon.tui.views.rank_detail import rank_detail

def step(rank, n, probe):
    body = {"step": n, "loss": 1.0, "step_time_s": 0.1, "probe_time_s": probe}
    return protocol.decode(protocol.encode("step", "j", rank, n + 1, body, t=100.0 + n))

hello = [Message("hello", "j", r, 0, 99.0, {"host": "h", "pid": 1, "world_size": 2,
                                            "local_rank": r}) for r in range(2)]
messages = hello + [step(r, n, 0.001 * (r + 1)) for n in range(1, 4) for r in range(2)]
try:  # the wire checks its kind
    protocol.decode(protocol.encode("step", "j", 0, 9, {"step": 9, "probe_time_s": "x"}))
    raise SystemExit("a string probe_time_s was accepted")
except ProtocolError as exc:
    assert "probe_time_s" in str(exc)

fold = JobFold("j")
for i, m in enumerate(messages):
    fold.apply(i, m)
state = strict_json(snapshot_json(fold.state, now=110.0))
assert state["ranks"][1]["probe_time_s"] == 0.002, state["ranks"][1]
assert "probe_time_s" in AGGREGATED and len(fold.agg["probe_time_s"]) == 3
x, _, _, mean = fold.tracks[0].series["probe_time_s"].arrays()
assert list(x) == [1, 2, 3] and all(abs(v - 0.001) < 1e-6 for v in mean)

text = format_snapshot(state)
assert "probe ms" in text.splitlines()[1], text
assert "2.0" in text.splitlines()[3], text
assert [c.key for c in display.node_columns() if c.group == "probe ms"] == [
    "probe_time_s.min", "probe_time_s.med", "probe_time_s.max"]
assert "*probe ms*: seconds the probe took" in HELP and "*probe ms*" in HELP.split("**Nodes")[1]
assert "`probe_time_s`" in metrics.markdown_fields("step")

data = DashboardData()
data.apply_messages(messages)
view = overview(data, now=110.0)
assert "probe" in [line.label for line in view.plots["time"].lines]
columns = __import__("importlib").import_module("scalemon.tui.views.rows").COLUMNS
assert "probe ms" in [c.heading for c in columns]
assert view.rows[1].cells[[c.key for c in view.columns].index("probe_time_s")] == "2.0"
detail = rank_detail(data, 0, now=110.0)
[plot] = [p for p in detail.plots if p.title == "probe"]
assert plot.lines and plot.unit == "ms"
print("derived")
'''


def test_one_more_row_reaches_wire_reducer_json_tables_help_plots_and_docs(tmp_path: Path):
    """Adding a metric is one row: in a fresh process, a row added to the table (and a rank
    that sends it) reaches protocol validation, the reducer and its JSON, the cross-rank
    aggregate, the snapshot text and node columns, the help, the dashboard's table, overview
    plot and rank detail, and the docs' field table, with no other file edited."""
    import subprocess
    import sys

    script = tmp_path / "one_more_row.py"
    script.write_text(ONE_MORE_ROW)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "derived", out.stdout + out.stderr
