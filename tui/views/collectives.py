"""What the collectives screen draws, built from `DashboardData` under its lock: the pipeline's
bubble and the MoE routing's balance in a line each, the table of collectives by (group, op,
size) with durations and bus bandwidth, the sends and receives by (src -> dst), the rank x time
heat map of arrival lateness, the ranking of ranks by lateness and each rank's Flight Recorder
health.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from scalemon import metrics
from scalemon.reports import parallel_text
from scalemon.reports.groups import collectives_table, group_desc
from scalemon.reports.pipeline import moe_json, p2p_rows, pipeline_json
from scalemon.state.arrival import HEAT_SPAN_S, heat_cell_s
from scalemon.text import display
from scalemon.text.display import LATE, NA
from scalemon.text.ranks import rank_list

from ..model import DashboardData

BUSBW_HELP = ("busbw = S/t x factor (nccl-tests): all_reduce 2(n-1)/n, all_gather/"
              "reduce_scatter/all_to_all (n-1)/n, broadcast/reduce 1; S = whole buffer, "
              "t = mean duration, 1 GB = 1e9 B")
TABLE_HEADINGS = ("group", "op", "n", "size", "count", "bytes", "p50 ms", "p99 ms",
                  "busbw GB/s")
"""Why a value is n/a is said once under the table (`Collectives.notes`), not on each row."""
P2P_HEADINGS = ("point to point", "group", "count", "bytes", "time", "bandwidth")
"""The sends and receives table: "send 0 -> 2", its group, ops, bytes, summed time, bytes per
op over the mean time."""
BAR = 16
"""Width of the largest lateness' bar in the ranking."""
HEAT_RANKS = 256
"""A job with more ranks shows the heat rows of this many, the latest (by median lateness)."""
MIN_COLUMN_S = 1.0
"""A heat map column covers at least this long (a step or so: finer ones are mostly empty);
on a short span each column is drawn several characters wide."""


@dataclass
class CollRow:
    """One line of the collectives table: cells in TABLE_HEADINGS order; `total` for an
    op's sum over several sizes (its size rows follow it); `note`: why a value is n/a."""

    cells: tuple[str, ...]
    total: bool = False
    size: bool = False
    note: str = ""


@dataclass
class Heat:
    """Arrival lateness binned by rank (rows) and time (columns), in seconds; NaN where the
    rank issued no collective in that column (`cells[row][column]`, one list per rank). `top`
    is the lateness of the darkest shade; each column is drawn `repeat` characters wide."""

    ranks: list[int]
    cells: list[list[float]]
    t0: float
    t1: float
    top: float
    repeat: int = 1
    of_ranks: int = 0
    """How many ranks have samples: more than `ranks` when only the latest are shown."""

    @property
    def columns(self) -> int:
        """Time columns per row."""
        return len(self.cells[0]) if self.cells else 0


@dataclass
class RankHealth:
    """A rank's arrival lateness and Flight Recorder figures, as text (lateness in ms)."""

    rank: int
    late_s: float | None
    cells: tuple[str, ...]  # HEALTH_HEADINGS but the rank: late ms, bar, issued, ...
    lost: int


HEALTH_HEADINGS = ("rank", "late ms", "", "issued", "completed", "recorder entries",
                   "lost (ring wrapped)", "read ms", "read % of run")


@dataclass
class Collectives:
    """What the collectives screen draws."""

    rows: list[CollRow]
    heat: Heat | None
    health: list[RankHealth]  # largest lateness first; ranks without one last
    wrapped: list[tuple[int, int]]  # (rank, entries lost) of ranks whose ring wrapped
    groups: list[str]  # "default_pg: 8 ranks (0-7)"
    bad: int  # collectives messages the reducer could not fold
    p2p: list[tuple[str, ...]] = field(default_factory=list)  # P2P_HEADINGS cells per row
    parallel: list[str] = field(default_factory=list)  # the pipeline's and MoE's lines

    @property
    def notes(self) -> list[str]:
        """Why values of the table are n/a: each reason once, in the order of the rows."""
        return list(dict.fromkeys(row.note for row in self.rows if row.note))


def collectives(data: DashboardData, heat_columns: int) -> Collectives:
    """The table, a heat map `heat_columns` wide, the ranking and the recorder health."""
    with data.lock:
        st = data.state
        table = [row for row in collectives_table(st.groups, st.ranks.values())
                 if not parallel_text.is_p2p(row)]  # sends and receives: their own table
        p2p = [parallel_text.p2p_cells(row) for row in p2p_rows(st)]
        parallel = [line for line in (parallel_text.pipeline_line(pipeline_json(st)),
                                      parallel_text.moe_line(moe_json(st))) if line]
        health = [_health(data, r) for r in sorted(st.ranks)]
        health.sort(key=lambda h: (h.late_s is None, -(h.late_s or 0.0), h.rank))  # latest 1st
        heat_rows = st.arrival.heat
        of_ranks = len(heat_rows)
        if of_ranks > HEAT_RANKS:  # a big job: the latest ranks' rows (by median lateness)
            shown = [h.rank for h in health if h.rank in heat_rows][:HEAT_RANKS]
        else:
            shown = list(heat_rows)
        samples = {r: list(heat_rows[r]) for r in shown}  # converted unlocked
        cell_s = heat_cell_s(st.arrival.world)
        groups = [f"{group_desc(st.groups, name)}: {len(g['ranks'])} ranks "
                  f"({rank_list(g['ranks'], limit=8)})"
                  for name, g in sorted(st.groups.items())]
        bad = st.bad_collectives
    top = max((h.late_s for h in health if h.late_s is not None), default=0.0)
    for h in health:
        if h.late_s is not None and top > 0:
            h.cells = (h.cells[0], "█" * round(BAR * h.late_s / top), *h.cells[2:])
    wrapped = [(h.rank, h.lost) for h in health if h.lost > 0]
    heat = heat_map(samples, heat_columns, cell_s)
    if heat is not None:
        heat.of_ranks = of_ranks
    return Collectives(_table_rows(table), heat, health, sorted(wrapped), groups, bad, p2p,
                       parallel)


# ---- the table -----------------------------------------------------------------------------

def _table_rows(table: list[dict[str, Any]]) -> list[CollRow]:
    rows = []
    for op in table:
        sizes = op["sizes"]
        note = _note(op, op["time_p50_s"] is not None)
        if len(sizes) == 1:
            rows.append(CollRow(_cells(op, sizes[0]["size_text"]), note=note))
            continue
        rows.append(CollRow(_cells(op, "all"), total=True, note=note))
        rows.extend(CollRow(_cells(size, size["size_text"], first=False), size=True,
                            note=_note(size, size["time_p50_s"] is not None))
                    for size in sizes)
    return rows


def _cells(row: dict[str, Any], size: str, first: bool = True) -> tuple[str, ...]:
    return (row["group"] if first else "", row["op"] if first else "", str(row["ranks"]),
            size, str(row["count"]), parallel_text.nbytes(row["bytes"]), ms(row["time_p50_s"]),
            ms(row["time_p99_s"]), gbps(row["busbw_gbps"]))


def _note(row: dict[str, Any], timed: bool) -> str:
    """Why a value is n/a (or that only part of the collectives was timed)."""
    if not timed:
        return ("n/a: gloo records no duration (the agent times DDP's all-reduce on the "
                "host, nothing else)")
    if row["bus_factor"] is None:
        return f"n/a: {row['op']} moves no data" if row["op"] == "barrier" else \
            f"n/a: nccl-tests defines no factor for {row['op']}"
    return ""


def ms(seconds: float | None) -> str:
    """A duration in ms with 3 significant digits."""
    if seconds is None:
        return NA
    value = seconds * 1e3
    return f"{value:.0f}" if value >= 1000 else f"{value:.3g}"


def gbps(value: float | None) -> str:
    """A bandwidth in GB/s with 3 significant digits."""
    if value is None:
        return NA
    return f"{value:.0f}" if value >= 1000 else f"{value:.3g}"


# ---- the heat map --------------------------------------------------------------------------

def heat_map(samples: dict[int, Sequence[tuple[float, ...]]], columns: int,
             cell_s: float = MIN_COLUMN_S) -> Heat | None:
    """Mean lateness per (rank, column) over the time the samples cover (at most the last
    HEAT_SPAN_S) in at most `columns` characters, each at least a heat cell (`cell_s`) long;
    None without samples or room. A sample is a heat cell (its start, lateness summed, count:
    `ArrivalTracker.heat`) or, in a state saved before cells, one collective's (issue time,
    lateness)."""
    samples = {r: a for r, a in samples.items() if len(a)}
    if not samples or columns < 1:
        return None
    t1 = max(float(a[-1][0]) for a in samples.values())
    t0 = max(min(float(a[0][0]) for a in samples.values()), t1 - HEAT_SPAN_S)
    width = max(t1 - t0, 1e-9)
    bins = max(1, min(columns, int(width / max(MIN_COLUMN_S, cell_s))))
    repeat, columns = columns // bins, bins
    ranks = sorted(samples)
    cells = []
    last = columns - 1
    for rank in ranks:
        n = [0] * columns
        total = [0.0] * columns
        for sample in samples[rank]:
            t = sample[0]
            if t >= t0:
                col = int((t - t0) / width * columns)
                if col > last:
                    col = last
                n[col] += sample[2] if len(sample) == 3 else 1
                total[col] += sample[1]
        cells.append([s / k if k else math.nan for s, k in zip(total, n, strict=True)])
    seen = [v for row in cells for v in row if not math.isnan(v)]
    top = max(seen) if any(math.isfinite(v) for v in seen) else 0.0
    return Heat(ranks, cells, t0, t1, max(top, 1e-3), repeat)


# ---- per rank ------------------------------------------------------------------------------

def _health(data: DashboardData, rank: int) -> RankHealth:
    st = data.state
    v = st.ranks[rank]
    m = v.metrics
    late = v.value("arrival_lateness_s")
    lost = m.get("recorder_lost")
    read = m.get("recorder_read_s")
    share = NA
    if read is not None and st.started_t is not None and v.last_seen_t is not None:
        elapsed = v.last_seen_t - st.started_t
        share = f"{100 * read / elapsed:.3f}" if elapsed > 0 else NA
    cells = (display.metric_text(metrics.BY_NAME[LATE], {LATE: late}), "",
             display.text_of(m.get("collectives_issued")),
             display.text_of(m.get("collectives_completed")),
             display.text_of(m.get("recorder_entries")), display.text_of(lost), ms(read), share)
    return RankHealth(rank, late, cells, lost if isinstance(lost, int) else 0)
