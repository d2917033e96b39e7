"""Which ranks are stragglers: the one rule of the dashboard and of `snapshot --json`.

A running rank's straggler measure is how much later than the first rank it issues its
collectives (`arrival_lateness_s`, the median over its last 100, fewer in a big job); before
any running rank has that, how much longer than the median rank's its compute time is
(`compute_over_median_s`, smoothed). A rank is a straggler when its measure is over
`policy.straggler_bar`: 10 ms, and 10% of the median step time of the running ranks.

In a pipeline, a stage its neighbours wait for is a straggler too: per rank, the sum over the
running ranks of their latest step's `p2p_waits[rank]` (seconds per step they waited in P2P
ops with it), when it is over the bar above the median of the other pipeline ranks'.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from scalemon.policy import straggler_bar  # the bar: one rule with the others (policy.py)

ARRIVAL_BASIS = "arrival at collectives, vs the first rank"
COMPUTE_BASIS = "compute time, vs the median rank"
MEASURE_NAMES = {ARRIVAL_BASIS: "late ms", COMPUTE_BASIS: "compute ms over the median"}
"""The straggler measure of each basis, as the node overview names it."""
MEASURE_FIELDS = {ARRIVAL_BASIS: "arrival_lateness_s", COMPUTE_BASIS: "compute_over_median_s"}
"""The rank field (`snapshot --json`) each basis measures with."""
PIPELINE_FIELD = "p2p_waits"
"""The rank field a pipeline straggler is measured with (its neighbours' waits for it)."""


def median_step_s(step_times: Iterable[float | None]) -> float | None:
    """The median of the running ranks' step times (None where none has one)."""
    times = [t for t in step_times if t is not None]
    return statistics.median(times) if times else None


def measure(running: Iterable[int], lateness: Mapping[int, float | None],
            compute: Mapping[int, float | None]) -> tuple[dict[int, float], str]:
    """Each running rank's straggler measure in seconds and its basis (`ARRIVAL_BASIS`,
    `COMPUTE_BASIS`, or "" while no rank has either): arrival lateness where a running rank
    has one, else compute time over the median rank's."""
    running = list(running)
    values = {r: v for r in running if (v := lateness.get(r)) is not None}
    if values:
        return values, ARRIVAL_BASIS
    values = {r: v for r in running if (v := compute.get(r)) is not None}
    return values, COMPUTE_BASIS if values else ""


def stragglers(values: Mapping[int, float], median_step: float | None
               ) -> list[tuple[int, float]]:
    """(rank, measure) of the ranks whose measure is over `straggler_bar`, largest first."""
    bar = straggler_bar(median_step)
    return sorted(((r, v) for r, v in values.items() if v > bar), key=lambda rv: (-rv[1], rv[0]))


def json_measure(ranks: list[dict[str, Any]]
                 ) -> tuple[dict[int, float], str, float | None]:
    """The straggler `measure` of the running ranks of `snapshot --json`'s `ranks`
    (`RankView.to_json`), its basis and the running ranks' median step time."""
    running = [r for r in ranks if r["state"] == "running"]
    number = (int, float)
    field_of = {r["rank"]: r for r in running}
    values, basis = measure(
        field_of,
        {n: v if isinstance(v := r.get("arrival_lateness_s"), number) else None
         for n, r in field_of.items()},
        {n: v if isinstance(v := r.get("compute_over_median_s"), number) else None
         for n, r in field_of.items()})
    median = median_step_s(t if isinstance(t := r.get("step_time_s"), number) else None
                           for r in running)
    return values, basis, median


def pipeline_waited(ranks: list[dict[str, Any]]) -> dict[int, float]:
    """Seconds per step the running ranks of `snapshot --json`'s `ranks` waited in P2P ops
    with each rank in their latest step (the sum of their `p2p_waits[rank]`), for every rank
    of the pipeline (0.0 for one nobody waits for)."""
    waited: dict[int, float] = {}
    for r in ranks:
        waits = r.get(PIPELINE_FIELD)
        if r["state"] != "running" or not isinstance(waits, dict):
            continue
        waited.setdefault(r["rank"], 0.0)
        for peer, seconds in waits.items():
            try:
                peer_rank = int(peer)
            except (TypeError, ValueError):
                continue
            if type(seconds) in (int, float) and seconds > 0 and peer_rank != r["rank"]:
                waited[peer_rank] = waited.get(peer_rank, 0.0) + seconds
    return waited


def pipeline_stragglers(waited: Mapping[int, float], median_step: float | None
                        ) -> list[tuple[int, float]]:
    """(rank, seconds per step its neighbours wait for it) of the pipeline ranks waited for
    more than `straggler_bar` over the median of the other pipeline ranks, largest first."""
    bar = straggler_bar(median_step)
    out = []
    for rank, value in waited.items():
        others = [v for r, v in waited.items() if r != rank]
        if others and value - statistics.median(others) > bar:
            out.append((rank, value))
    return sorted(out, key=lambda rv: (-rv[1], rv[0]))


def straggler_reason(measure_field: str, value: float) -> str:
    """Why a rank is a straggler, in words, by the field it is measured with."""
    if measure_field == PIPELINE_FIELD:
        return f"its pipeline neighbours wait {value:.3g} s/step for it"
    if measure_field == MEASURE_FIELDS[COMPUTE_BASIS]:
        return f"computes {value * 1e3:.3g} ms longer than the median rank"
    return f"issues its collectives {value * 1e3:.3g} ms after the first rank"


def stragglers_json(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `stragglers` of `snapshot --json`, from its `ranks` (`RankView.to_json`): one map
    per straggler, largest first: `rank`, `measure` (the rank field measured:
    `arrival_lateness_s` or `compute_over_median_s`), `value_s`, `bar_s` (the bar it is
    over) and `reason` (in words); then the pipeline stages their neighbours wait for
    (`measure` "p2p_waits", `value_s` seconds per step) that are not named already."""
    values, basis, median = json_measure(ranks)
    bar = straggler_bar(median)
    out = [{"rank": rank, "measure": MEASURE_FIELDS[basis], "value_s": value, "bar_s": bar,
            "reason": straggler_reason(MEASURE_FIELDS[basis], value)}
           for rank, value in stragglers(values, median)]
    named = {s["rank"] for s in out}
    out += [{"rank": rank, "measure": PIPELINE_FIELD, "value_s": value, "bar_s": bar,
             "reason": straggler_reason(PIPELINE_FIELD, value)}
            for rank, value in pipeline_stragglers(pipeline_waited(ranks), median)
            if rank not in named]
    return out
