"""What the overview draws for a big job: a row per node (host), the slowest ranks and those
that failed or stopped sending (frozen, gone, unreachable, silent), and the spread of the
straggler measure over the ranks as a histogram.

From `display.AGGREGATE_AT` ranks on the overview shows this instead of a row per rank. No
textual import. Built under the data's lock from the pass over the ranks (`views.totals`:
per redraw for a job the dashboard folds itself, once per hub digest for a big job), nothing
per rank's history (the lateness medians come from `DashboardData.lateness`); only the node
rows on screen are formatted.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from scalemon import policy
from scalemon.reports import snapshot_text
from scalemon.state.jobstate import RankView
from scalemon.text import display
from scalemon.text.display import LATE, NO_HOST, Column

from ..model import DashboardData
from .totals import RankTotals, rank_totals

NODE_COLUMNS: tuple[Column, ...] = display.node_columns()
"""The node table: node, counts, worst state, step range, metric spreads (display.py)."""
TOP_K = snapshot_text.TOP_STRAGGLERS
"""The slowest ranks always listed above the node table."""
FAILED_SHOWN = 7
"""Ranks that failed or stopped sending listed above the node table; the others are counted
("+N more")."""
BINS = 8
"""Bars of the histogram (as many lines as the straggler list)."""
WORST_STYLES = {"failed": "exited", "gone": "gone", "unreachable": "unreachable",
                "silent": "silent", "frozen": "frozen", "restarting": "stuck", "stuck": "stuck",
                "straggler": "straggler", "running": "", "finished": "finished"}
"""A node row's style key (the rank table's styles) by its worst state."""


@dataclass
class NodeRow:
    """One node's table row: text cells in NODE_COLUMNS order and a style key."""

    host: str | None  # None: ranks whose host is not known yet (shown as "?")
    cells: tuple[str, ...]
    style: str


@dataclass
class WatchedRank:
    """A rank named above the node table."""

    rank: int
    host: str  # as the rank sent it (NO_HOST when unknown): clean it before showing
    text: str  # "+24.2 ms", "gone (process 101 ended without reporting an exit)", or
    #            "frozen (sleeping, CPU not moving): frozen in native code holding the GIL: ..."
    flagged: bool  # a straggler (over the bar), or a rank that failed for a reason of its own


@dataclass
class Watch:
    """The slowest ranks by the straggler measure and the ranks that failed or stopped
    sending."""

    measure: str  # what the ranks are ranked by ("late ms"), "" before any has a measure
    bar_s: float  # from this measure on a rank is a straggler
    slowest: list[WatchedRank]  # up to TOP_K, slowest first
    failed: list[WatchedRank]  # up to FAILED_SHOWN, in the order that explains the job
    failed_total: int


@dataclass
class Histogram:
    """How many running ranks fall in each of `counts` equal bins from `lo` to `hi`."""

    title: str
    lo: float  # in display units (ms)
    hi: float
    counts: list[int]
    bar: float  # the straggler bar, in display units: bins past it hold stragglers

    def edges(self) -> list[float]:
        """The bins' edges, len(counts) + 1 of them."""
        width = (self.hi - self.lo) / len(self.counts)
        return [self.lo + i * width for i in range(len(self.counts) + 1)]


@dataclass
class NodeView:
    """The node overview: every node in table order, the rows asked for, the watch list and
    the histogram."""

    hosts: list[str | None]  # every node, in table order (trouble first)
    rows: list[NodeRow]  # the rows at the positions asked for
    watch: Watch
    histogram: Histogram | None  # None before any rank has a straggler measure


def rank_status(v: RankView, straggler: bool, stuck_after_s: float) -> str:
    """The `NODE_STATES` entry of one rank (the rank table's row style, in words)."""
    m = v.metrics
    return policy.rank_status(v.state, v.exit_code, m["phase"], m["phase_since_s"], straggler,
                              stuck_after_s)


def node_totals(data: DashboardData, now: float) -> RankTotals:
    """A big job's `RankTotals` with its ranks by node, the watch list and the histogram made
    (call under the data's lock): what a redraw of the node overview reads."""
    totals = rank_totals(data, now, with_nodes=True)
    _watch_of(data, totals)
    return totals


def node_view(data: DashboardData, totals: RankTotals,
              values_of: Callable[[RankView], Mapping[str, Any]],
              visible: tuple[int, int] | None = None) -> NodeView:
    """The node overview (call under the data's lock) from `totals` (`node_totals`, or
    `rank_totals` with its nodes): `values_of` gives a rank's metric values by name; rows
    only for the nodes at positions `visible` (all when None)."""
    if totals.nodes is None or totals.hosts is None:
        raise ValueError("the totals were made without the ranks by node")
    watch, hist = _watch_of(data, totals)
    hosts = totals.hosts
    rows = []
    for host in hosts if visible is None else hosts[visible[0]:visible[1]]:
        node = totals.nodes[host]
        members = node.members
        cells = display.node_cells(NODE_COLUMNS, host, [policy.rank_kind(v.state, v.exit_code)
                                                        for v in members], node.worst,
                                   [v.step for v in members], [values_of(v) for v in members])
        rows.append(NodeRow(host, cells, WORST_STYLES[node.worst]))
    return NodeView(hosts, rows, watch, hist)


def _watch_of(data: DashboardData, totals: RankTotals) -> tuple[Watch, Histogram | None]:
    """The watch list and the histogram of `totals`, made once (kept in them)."""
    if totals.watch is None:
        bar = policy.straggler_bar(totals.median_step)
        first = totals.failure["rank"] if totals.failure else None
        totals.watch = _watch(data, totals.measure, totals.measure_name, bar, first)
        totals.histogram = histogram(totals.measure, totals.measure_name, bar)
    return totals.watch, totals.histogram


def _watch(data: DashboardData, measure: dict[int, float], what: str, bar: float,
           first_failed: int | None) -> Watch:
    ranks = data.state.ranks
    top = sorted(heapq.nlargest(TOP_K, measure.items(), key=itemgetter(1)),
                 key=lambda rv: (-rv[1], rv[0]))
    ms = display.unit(LATE)
    slowest = [WatchedRank(r, ranks[r].host or NO_HOST, f"{display.shown(LATE, value):+.1f} {ms}",
                           value > bar) for r, value in top]
    # frozen ranks first (the job hangs on them: alive, not ended), then the failed ones (own
    # failures first, each kind earliest first)
    frozen = sorted((v for v in ranks.values() if v.state == "frozen"), key=lambda v: v.rank)
    failed = frozen + data.state.failed()
    shown = []
    for v in failed[:FAILED_SHOWN]:
        if v.state == "exited":
            code = display.NA if v.exit_code is None else v.exit_code
            text = f"exited {code}" + (", peer lost" if v.peer_loss else
                                       ", failed 1st" if v.rank == first_failed else "")
        else:
            text = silent_rank_text(v)
        shown.append(WatchedRank(v.rank, v.host or NO_HOST, text, not v.peer_loss))
    return Watch(what if measure else "", bar, slowest, shown, len(failed))


def process_text(process: Mapping[str, Any] | None) -> str:
    """What was read of a silent rank's process, in words: "sleeping, CPU not moving" (its
    state word and whether its CPU time advanced between two reads); "" when nothing was
    read. The facts come from a peer (the hub or a relay): any of them may be missing."""
    if not isinstance(process, Mapping):
        return ""
    parts = []
    if process.get("exists") is False:
        parts.append("no process")
    word = process.get("state_word")
    if isinstance(word, str) and word:
        parts.append(word)
    moving = process.get("cpu_moving")
    if moving is True:
        parts.append("CPU moving")
    elif moving is False:
        parts.append("CPU not moving")
    return ", ".join(parts)


def silent_rank_text(v: RankView) -> str:
    """A rank's state word with what the hub knows of it: "frozen (sleeping, CPU not moving):
    frozen in native code holding the GIL: sleep <- ..." (what its process is doing, where its
    stacks read from outside say it is stuck), "gone (process 101 ended without reporting an
    exit)" (the hub's reason)."""
    said = process_text(v.process) if v.state == "frozen" else ""
    text = v.state + (f" ({said or v.state_reason})" if said or v.state_reason else "")
    if v.state == "frozen" and v.where:
        text += f": {v.where}"
    return text


def histogram(measure: dict[int, float], what: str, bar_s: float,
              bins: int = BINS) -> Histogram | None:
    """The straggler measure (`what`) of the running ranks in `bins` equal bins (in the
    lateness metric's display unit, ms), from the lowest (at most 0) to the highest value;
    None without values."""
    values = [v for v in (display.shown(LATE, float(m)) for m in measure.values())
              if math.isfinite(v)]
    if not values:
        return None
    lo, hi = min(0.0, min(values)), max(values)
    if hi <= lo:
        hi = lo + 1.0
    return Histogram(f"{what}, {len(values)} ranks", lo, hi, bin_counts(values, bins, lo, hi),
                     display.shown(LATE, bar_s))


def bin_counts(values: list[float], bins: int, lo: float, hi: float) -> list[int]:
    """How many of `values` fall in each of `bins` equal bins from `lo` to `hi` (lo < hi),
    counted as `numpy.histogram(values, bins, (lo, hi))` does: a bin holds its left edge, the
    last one its right edge too, values outside are left out."""
    step = (hi - lo) / bins
    if step == 0:
        edges = [i / bins * (hi - lo) + lo for i in range(bins)]
    else:
        edges = [i * step + lo for i in range(bins)]
    edges.append(hi)
    counts = [0] * bins
    span = hi - lo
    for v in values:
        if not lo <= v <= hi:
            continue
        i = int((v - lo) / span * bins)
        if i == bins:
            i -= 1
        if v < edges[i]:  # the division can miss an edge by an ulp
            i -= 1
        if v >= edges[i + 1] and i != bins - 1:
            i += 1
        counts[i] += 1
    return counts


def node_ranks(data: DashboardData, host: str | None) -> list[int]:
    """The ranks of node `host` (None: those whose host is not known yet), in order."""
    with data.lock:
        kept = data.totals
        if data.digest_followed and kept is not None and kept.nodes is not None:
            node = kept.nodes.get(host)  # a big job's, as of the hub's last digest
            if node is not None:
                return [v.rank for v in node.members]
        return sorted(r for r, v in data.state.ranks.items() if (v.host or None) == host)
