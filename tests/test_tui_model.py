"""The dashboard's data layer, without textual: series, braille raster, model, formats."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from collections import deque

import pytest

from scalemon import metrics
from scalemon.metrics import derived_values
from scalemon.protocol import Message
from scalemon.reports.stragglers import ARRIVAL_BASIS, COMPUTE_BASIS
from scalemon.state.fold import step_values
from scalemon.state.series import Series
from scalemon.text import display as fmt
from scalemon.tui.model import DashboardData
from scalemon.tui.sim import SimJob
from scalemon.tui.views.nodes import bin_counts
from scalemon.tui.views.overview import overview
from scalemon.tui.widgets.braille import (
    DOT_BITS,
    column_envelope,
    interp,
    line_spans,
    pack,
    rasterize,
)


def test_series_stays_bounded_and_keeps_the_extremes():
    s = Series(cap=64)
    values = [math.sin(i / 50) for i in range(10_000)]
    values[7777] = 42.0  # one spike among 10k points
    for i, v in enumerate(values):
        s.add(i, v)
    x, lo, hi, mean = s.arrays()
    assert len(x) <= 64 and s.stride >= 128
    assert max(hi) == pytest.approx(42.0) and min(lo) == pytest.approx(-1.0, abs=1e-3)
    assert x[0] < 200 and x[-1] > 9_800  # the whole run, evenly
    assert all(b > a for a, b in zip(x, x[1:], strict=False))
    assert all(a <= m + 1e-6 and m <= b + 1e-6 for a, m, b in zip(lo, mean, hi, strict=True))


def test_series_ignores_non_finite_values_and_shows_the_filling_bucket():
    s = Series(cap=4)
    s.add(1, float("nan"))
    assert len(s) == 0
    for i in range(5):
        s.add(i, float(i))
    assert s.stride == 2 and len(s.xs) == 2  # halved once: (0,1) (2,3), then 4 is filling
    x, lo, hi, _ = s.arrays()
    assert list(x) == [0.5, 2.5, 4] and list(lo) == [0, 2, 4] and list(hi) == [1, 3, 4]


def test_braille_column_envelope_and_packing():
    lo, hi = column_envelope([0.0, 1, 2, 3], [0.0, 5, 1, 2], [0.0, 5, 1, 2], 0.0, 4.0, 2)
    assert list(lo) == [0, 1] and list(hi) == [5, 2]
    # left column of dots, all four rows; the right one unlit (top > bottom)
    assert pack([0, 1], [3, 0], rows=1) == [[0x01 | 0x02 | 0x04 | 0x40]]
    assert pack([1, 0], [2, 0], rows=2) == [[0x02 | 0x04 | 0x08], [0]]


def test_braille_empty_columns_are_nan():
    lo, hi = column_envelope([0.0, 3.0], [1.0, 2.0], [1.5, 2.5], 0.0, 3.0, 4)
    assert [math.isnan(v) for v in lo] == [False, True, True, False] and hi[3] == 2.5


def test_braille_line_is_continuous_and_rising():
    x = [float(i) for i in range(100)]
    raster = rasterize([(x, x, x, 3, False)], rows=4, cols=10, x_range=(0, 99),
                       y_range=(0, 99))
    mask = [[False] * 20 for _ in range(16)]
    for r in range(4):
        for c in range(10):
            code = raster.codes[r][c]
            for dy in range(4):
                for dx in range(2):
                    mask[r * 4 + dy][c * 2 + dx] = bool(code & DOT_BITS[dy][dx])
    lit_rows = [[y for y in range(16) if mask[y][c]] for c in range(20)]
    assert all(len(rows) for rows in lit_rows)  # every pixel column lit: no holes
    assert max(lit_rows[0]) == 15 and min(lit_rows[-1]) == 0  # bottom-left to top-right
    assert {raster.colors[r][c] for r in range(4) for c in range(10) if raster.codes[r][c]} == {3}


def test_line_spans_interpolate_missing_columns():
    col = [0.0, math.nan, math.nan, 3.0]
    tops, bots = line_spans(col, col, 0.0, 3.0, 4)
    # 0..3 (3 at the top, row 0), each column stretched to touch the one before it
    assert (tops, bots) == ([3, 2, 1, 0], [3, 3, 2, 1])


def test_histogram_bins_hold_their_left_edge_and_the_last_its_right_edge_too():
    # edges 0, 2.5, 5, 7.5, 10; values outside the range are left out
    assert bin_counts([0.0, 0.5, 1.0, 2.5, 10.0, -1.0, 11.0], 4, 0.0, 10.0) == [3, 1, 0, 1]
    assert bin_counts([0.1 * i for i in range(11)], 10, 0.0, 1.0) == [1] * 9 + [2]


def test_bin_counts_and_interp_match_numpy():
    """The plain-Python histogram and interpolation give numpy's numbers (tests have numpy)."""
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    for _ in range(300):
        values = [rng.choice([rng.gauss(5, 20), round(rng.uniform(-5, 40), 1), 0.0])
                  for _ in range(rng.randint(1, 200))]
        lo, hi = min(0.0, min(values)), max(values)
        hi = hi if hi > lo else lo + 1.0
        bins = rng.choice([1, 3, 12, 40])
        edges = np.linspace(lo, hi, bins + 1).tolist()  # on an edge, and an ulp either side
        values += [math.nextafter(e, d) for e in edges for d in (-math.inf, e, math.inf)]
        assert bin_counts(values, bins, lo, hi) == np.histogram(values, bins, (lo, hi))[0].tolist()
        xp = sorted(rng.sample(range(300), rng.randint(2, 30)))
        fp = [rng.gauss(0, 10) for _ in xp]
        xs = [float(x) for x in range(xp[0], xp[-1] + 1) if x not in xp]
        assert interp(xs, [float(x) for x in xp], fp) == np.interp(xs, xp, fp).tolist()


def metric_cell(name: str, value: object, **others: object) -> str:
    """The table text of metric `name` holding `value` (and `others`, for used/total)."""
    return fmt.metric_text(metrics.BY_NAME[name], {name: value, **others})


def test_formats_say_na_never_zero():
    assert metric_cell("step_time_s", None) == "n/a"
    assert metric_cell("mem_allocated_bytes", None) == "n/a"
    assert metric_cell("gpu_util_pct", None) == "n/a"
    assert metric_cell("gpu_mem_used_bytes", None, gpu_mem_total_bytes=80 << 30) == "n/a"
    assert metric_cell("step_time_s", 0.0123) == "12.3"
    assert metric_cell("mem_allocated_bytes", 3 << 30) == "3.00"
    assert fmt.num(float("nan")) == "nan" and fmt.scale(65536.0) == "65536"
    assert metric_cell("arrival_lateness_s", 0.021) == "21.0" and fmt.duration(3725) == "1:02:05"
    assert metric_cell("arrival_lateness_s", None) == "n/a"


def test_compute_time_is_clamped_and_missing_values_are_left_out():
    body = {"step": 1, "step_time_s": 0.1, "allreduce_time_s": 0.2, "optimizer_time_s": 0.01,
            "loss": None, "tokens": 100}
    v = step_values(body, derived_values(body))
    assert v["compute_s"] == 0.0 and v["step_time_s"] == pytest.approx(0.1)
    assert "loss" not in v and "mem_allocated_bytes" not in v and "tokens_per_s" not in v
    body = {"step": 2, "extra": {"tokens_per_s": 5e4, "lr": 1e-3}}
    with_extra = step_values(body, derived_values(body))
    assert with_extra == {"tokens_per_s": 5e4}  # the table's extras; `lr` is plotted apart


def test_the_rank_that_issues_its_collectives_late_is_named():
    sim = SimJob(ranks=8, straggler=5, straggler_s=0.04)
    data = DashboardData()
    data.apply_messages(sim.run(60))
    view = overview(data, now=sim.end_t(60) + 0.5)
    assert [r for r, _ in view.summary.stragglers] == [5]
    assert view.summary.straggler_basis == ARRIVAL_BASIS
    # its gradient buckets are issued 0.7..1.0 of its extra compute late: median 0.85 of it
    assert view.summary.stragglers[0][1] == pytest.approx(0.04 * 0.85, rel=0.1)
    at = [c.key for c in view.columns].index("arrival_lateness_s")
    assert view.rows[5].cells[at] == f"{data.state.ranks[5].value('arrival_lateness_s') * 1e3:.1f}"
    styles = {row.rank: row.style for row in view.rows}
    assert styles[5] == "straggler" and all(styles[r] == "" for r in range(8) if r != 5)
    # every rank's step time is the same (the all-reduce equalises it): not a usable signal
    at = [c.key for c in view.columns].index("step_time_s")
    steps = {row.cells[at] for row in view.rows}
    assert len(steps) == 1


def test_no_straggler_without_one():
    sim = SimJob(ranks=4)
    data = DashboardData()
    data.apply_messages(sim.run(60))
    assert overview(data, now=sim.end_t(60)).summary.stragglers == []


def test_stragglers_by_compute_time_before_any_collective_and_largest_lateness_first():
    sim = SimJob(ranks=4, straggler=2, straggler_s=0.04)
    data = DashboardData()
    data.apply_messages(m for m in sim.run(60) if m.type != "collectives")
    summary = overview(data, now=sim.end_t(60)).summary
    assert summary.straggler_basis == COMPUTE_BASIS and [r for r, _ in summary.stragglers] == [2]
    # two late ranks: the one with the larger lateness comes first, whatever its number
    data = DashboardData()
    data.apply_messages(SimJob(ranks=4).run(10))
    with data.lock:
        for rank, late in ((1, 0.015), (3, 0.050), (0, 0.001)):
            data.state.arrival.lateness[rank] = deque([late] * 5)
            data.state.ranks[rank].lateness = data.state.arrival.lateness[rank]
    summary = overview(data, now=sim.end_t(10)).summary
    assert summary.stragglers == [(3, 0.050), (1, 0.015)]
    assert summary.straggler_basis == ARRIVAL_BASIS


def test_summary_rates_state_and_na_cells_of_a_cpu_job():
    sim = SimJob(ranks=2, gpu=False, amp=False, step_s=0.1)
    data = DashboardData()
    data.apply_messages(sim.run(100, finish=True))
    view = overview(data, now=sim.end_t(100) + 1.0)
    s = view.summary
    assert s.state == "finished" and s.step_min == s.step_max == 100
    assert s.elapsed_s == pytest.approx(10.0, abs=0.1)
    cells = dict(zip([c.key for c in view.columns], view.rows[0].cells, strict=True))
    assert "pipeline_bubble" not in cells  # no pipeline: no column of n/a
    assert cells["loss_scale"] == "n/a" and cells["mem_allocated_bytes"] == "n/a"
    assert cells["gpu_mem_used_bytes"] == "n/a" and cells["mfu"] == "n/a"
    assert cells["state"] == "finished" and cells["step"] == "100"
    assert view.plots is not None and not view.plots["scale"].has_data
    assert view.plots["scale"].empty.startswith("n/a")
    assert view.plots["memory"].title.startswith("RSS")


def test_rates_while_running():
    sim = SimJob(ranks=2, step_s=0.1)
    data = DashboardData()
    data.apply_messages(sim.run(100))
    s = overview(data, now=sim.end_t(100) + 0.1).summary
    assert s.steps_per_s == pytest.approx(10.0, rel=0.05)
    assert s.tokens_per_s == pytest.approx(2 * 8192 * 10.0, rel=0.05)
    assert s.state == "running"
    stalled = overview(data, now=sim.end_t(100) + 60).summary
    assert stalled.state == "stalled" and stalled.steps_per_s == 0.0


def test_ranks_that_stop_sending_by_the_hubs_word_and_band_mode_for_many_ranks():
    sim = SimJob(ranks=16)
    msgs = sim.run(20)
    t = sim.end_t(20) + 6
    said = {3: "gone", 5: "frozen", 7: "unreachable", 9: "lost"}  # lost: a hub before 1.12
    msgs += [Message("rank_state", "sim", -1, i, t, {"target": r, "state": word,
                                                     "reason": "no message for 5.1 s"})
             for i, (r, word) in enumerate(said.items(), 1)]
    data = DashboardData()
    data.apply_messages(msgs)
    view = overview(data, now=t)
    assert view.summary.state == "degraded"
    assert view.summary.state_text == "degraded, frozen: 5; gone: 3; unreachable: 7; silent: 9"
    for rank, word in {3: "gone", 5: "frozen", 7: "unreachable", 9: "silent"}.items():
        assert view.rows[rank].style == word and view.rows[rank].cells[1] == word
    assert not any("lost" in row.cells[1] for row in view.rows)
    loss = view.plots["loss"]
    assert [line.band for line in loss.lines] == [True, False]  # 16 ranks: band + mean


def test_long_history_is_folded_in_chunks_and_only_visible_rows_are_formatted():
    sim = SimJob(ranks=4)
    data = DashboardData()
    versions = []
    data.apply_batch((i, m) for i, m in enumerate(sim.run(1500)))
    versions.append(data.version)
    assert versions[0] >= 3  # > CHUNK records: the lock was released in between
    assert data.next_seq == data.records
    view = overview(data, sim.end_t(1500), plots=False, visible=(1, 3))
    assert view.rank_ids == [0, 1, 2, 3] and [r.rank for r in view.rows] == [1, 2]
    assert view.plots is None


def test_headless_modules_do_not_import_textual():
    code = ("import sys; import scalemon.tui.model, scalemon.tui.views.overview, "
            "scalemon.tui.views.rank_detail, "
            "scalemon.tui.feed, scalemon.tui.sim, scalemon.tui.widgets.braille, "
            "scalemon.tui.views.collectives, scalemon.tui.views.hang, scalemon.cli.main; "
            "assert 'textual' not in sys.modules, 'textual imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
