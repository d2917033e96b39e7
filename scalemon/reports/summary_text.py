"""A run's summary and two runs compared, written for people (`scalemon summary` and
`scalemon compare` without --json); the numbers come from `scalemon.reports.summary`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from scalemon import metrics
from scalemon.reports import stragglers
from scalemon.reports.snapshot_text import p2p_lines, parallel_lines
from scalemon.reports.summary import RANK_LINES_MAX, finite
from scalemon.state.flagstate import toggle_line
from scalemon.text import display
from scalemon.throughput import LABELS, STEPS


def _num(value: Any, spec: str = ".4g", scale: float = 1.0, unit: str = "") -> str:
    v = finite(value)
    if v is None:
        return "nan" if isinstance(value, float) and math.isnan(value) else display.NA
    return f"{v * scale:{spec}}{unit}"


def _as(name: str, value: Any) -> str:
    """`value` in the display unit, scale and digits of metric `name` (the table's `Show`)."""
    show = metrics.BY_NAME[name].show
    assert show is not None
    space = " " if show.unit and show.unit != "%" else ""
    return _num(value, f".{show.digits}f", show.scale, f"{space}{show.unit}")


def _ms(value: Any) -> str:
    return _as("step_time_s", value)


def _gib(value: Any) -> str:
    return _as("mem_peak_bytes", value)


def _pct(value: Any) -> str:
    return _as("mfu", value)


def _point(point: Mapping[str, Any] | None) -> str:
    if not point:
        return display.NA
    return f"{_num(point['value'], '.4f')} (step {point['step']})"


def summary_text(s: Mapping[str, Any]) -> str:
    """The summary for people, a few lines per section."""
    steps, wall, loss = s["steps"], s["wall_time"], s["loss"]
    tps, mfu, st = s["tokens_per_s"], s["mfu"], s["step_time"]
    lines = [
        f"job {s['job']}  state {s['state']}  world size {s['world_size']}"
        f"  ({s['source'].get('kind', '?')}: {s['source'].get('where', '?')})",
        f"steps {steps['first']}..{steps['last']} ({steps['count']} logged; every rank reached "
        f"{steps['last_on_every_rank']})  wall time {_num(wall['seconds'], '.1f', unit=' s')}"
        f" (steps {_num(wall['steps_seconds'], '.1f', unit=' s')})",
        f"loss (rank {loss['rank']}): first {_point(loss['first'])}  last {_point(loss['last'])}"
        f"  min {_point(loss['min'])}"
        + (f"  ({loss['nonfinite']} NaN/inf)" if loss["nonfinite"] else ""),
        f"{LABELS[tps.get('source') or STEPS]}: job median {_num(tps['job']['median'], ',.0f')}"
        f" p10 "
        f"{_num(tps['job']['p10'], ',.0f')}; per rank median "
        f"{_num(tps['per_rank']['median'], ',.0f')} p10 {_num(tps['per_rank']['p10'], ',.0f')}",
        f"MFU: median {_pct(mfu['median'])} p10 {_pct(mfu['p10'])}" if mfu["samples"] else
        "MFU: n/a (no rank logs it: the device's peak FLOP/s is unknown)",
        f"step time: median {_ms(st['median'])} p90 {_ms(st['p90'])}",
    ]
    for rank, row in _shown(st["per_rank"], lambda r: r["median"]):
        lines.append(f"  rank {rank}: median {_ms(row['median'])} p90 {_ms(row['p90'])} "
                     f"({row['samples']} steps)")
    lines.extend(_more(st["per_rank"], "the slowest"))
    if st["slowest"]:
        lines.append("  slowest: " + ", ".join(f"rank {r['rank']} ({_ms(r['median'])})"
                                                 for r in st["slowest"]))
    lines.extend(_parallel_lines(s))
    lines.extend(_straggler_lines(s["stragglers"]))
    lines.extend(_hang_lines(s["hangs"], s["first_failure"]))
    if s["toggles"]:
        lines.extend("toggle " + toggle_line(t) for t in s["toggles"])
    if s["collectives"]:
        lines.append("collectives (count and bytes per rank; busbw GB/s):")
        lines.extend(f"  {c['group']} {c['op']}: {c['count']} x, {c['bytes']} bytes, busbw "
                     f"{_num(c['busbw_gbps'], '.3g')}" for c in s["collectives"])
    lines.extend(p2p_lines(s.get("p2p") or []))
    mem = s["memory"]
    lines.append(f"peak memory: torch {_gib(mem['peak_bytes'])}, process RSS "
                 f"{_gib(mem['rss_bytes'])}")
    for rank, row in _shown(mem["per_rank"], lambda r: r["peak_bytes"] or r["rss_bytes"]):
        lines.append(f"  rank {rank}: torch {_gib(row['peak_bytes'])}, RSS "
                     f"{_gib(row['rss_bytes'])}")
    lines.extend(_more(mem["per_rank"], "those with the most memory"))
    versions = "; ".join(f"{what} {v} (ranks {','.join(map(str, r))})"
                         for what, by in s["versions"].items() for v, r in by.items())
    if versions:
        lines.append(f"versions: {versions}")
    return "\n".join(lines)


def _parallel_lines(s: Mapping[str, Any]) -> list[str]:
    """The mesh, the pipeline's bubble (and over the run) and the MoE balance: the lines of
    `scalemon snapshot` (`snapshot_text.parallel_lines`)."""
    lines = parallel_lines(s)
    run = (s.get("pipeline") or {}).get("measured_bubble_run") or {}
    if run.get("samples"):
        at = next((i for i, line in enumerate(lines) if line.startswith("pipeline ")), None)
        text = (f"bubble over the run: median {_pct(run['median'])} p90 {_pct(run['p90'])} "
                f"({run['samples']} rank-steps)")
        if at is None:
            lines.append(text)
        else:
            lines[at] += f"; {text}"
    return lines


def _shown(per_rank: Mapping[str, Any], key: Any) -> list[tuple[str, Any]]:
    """Every rank's row up to `RANK_LINES_MAX` ranks; beyond, the largest by `key` (the
    slowest, the most memory)."""
    rows = list(per_rank.items())
    if len(rows) <= RANK_LINES_MAX:
        return rows
    top = sorted(rows, key=lambda kv: -(finite(key(kv[1])) or 0.0))[:RANK_LINES_MAX // 2]
    return top


def _more(per_rank: Mapping[str, Any], which: str) -> list[str]:
    """"  (8 of 64 ranks shown, the slowest; --json has every rank)" where `_shown` left
    ranks out."""
    if len(per_rank) <= RANK_LINES_MAX:
        return []
    return [f"  ({RANK_LINES_MAX // 2} of {len(per_rank)} ranks shown, {which}; --json has "
            "every rank)"]


def _straggler_lines(st: Mapping[str, Any]) -> list[str]:
    def names(rows: list[dict[str, Any]]) -> str:
        return ", ".join(f"rank {r['rank']} (+{_ms(r['value_s'])})" for r in rows) or "none"

    basis = {v: k for k, v in stragglers.MEASURE_FIELDS.items()}
    rows = st["over_run"]
    by = f" by {basis.get(rows[0]['measure'], rows[0]['measure'])}" if rows else ""
    return [f"stragglers over the run{by}: {names(rows)}; now: {names(st['now'])}"]


def _hang_lines(hangs: Mapping[str, Any], failure: Mapping[str, Any] | None) -> list[str]:
    lines = []
    if hangs["now"]:
        lines.append(f"HUNG now: {hangs['now']['text']}")
    if hangs.get("last"):  # the job ended hung: its culprit, and how it ended
        lines.append(f"HUNG until the end: {hangs['last']['summary']}")
    if hangs["stall_count"]:
        worst = hangs["stalls"][0]
        lines.append(f"stalls: {hangs['stall_count']} (no step for "
                     f"{_num(hangs['stall_after_s'], 'g')} s or more); longest "
                     f"{worst['seconds']:.1f} s after step {worst['after_step']}")
    lines.extend(f"alert: {a['text']}" for a in hangs["alerts"])
    lines.append(f"first failure: {failure['text']}" if failure else "first failure: none")
    return lines


def _loss_text(loss: Mapping[str, Any] | None) -> str:
    if not loss or loss.get("rank") is None:
        return "no loss logged"
    return f"last {_point(loss['last'])} (rank {loss['rank']})"


def compare_text(c: Mapping[str, Any]) -> str:
    """The comparison for people: a row per figure (A, B, B/A), losses at equal steps, then
    what differs."""
    a, b = c["a"], c["b"]
    lines = [f"A: {a['job']} ({a['state']}, world size {a['world_size']})",
             f"B: {b['job']} ({b['state']}, world size {b['world_size']})",
             f"{'':<20} {'A':>14} {'B':>14} {'B/A':>7}"]
    shown = {"tokens_per_s": ("tokens/s", lambda v: _num(v, ",.0f")),
             "tokens_per_s_p10": ("tokens/s p10", lambda v: _num(v, ",.0f")),
             "mfu": ("MFU", _pct), "step_time_s": ("step time", _ms),
             "step_time_p90_s": ("step time p90", _ms),
             "peak_memory_bytes": ("peak memory", _gib), "rss_bytes": ("process RSS", _gib),
             "wall_time_s": ("wall time", lambda v: _num(v, ".1f", unit=" s")),
             "steps": ("last step", lambda v: display.NA if v is None else str(v))}
    for name, row in c["figures"].items():
        label, fmt = shown.get(name, (name, _num))
        lines.append(f"{label:<20} {fmt(row['a']):>14} {fmt(row['b']):>14} "
                     f"{_num(row['ratio'], '.3f'):>7}")
    lines.append(f"loss A: {_loss_text(c['loss']['a'])}; B: {_loss_text(c['loss']['b'])}")
    for row in c["loss"]["at_steps"]:
        lines.append(f"  loss at step {row['step']}: A {_num(row['a'], '.4f')}  B "
                     f"{_num(row['b'], '.4f')}  B-A {_num(row['b_minus_a'], '+.4f')}")
    if not c["loss"]["at_steps"]:
        lines.append("  no step where both runs logged a loss")
    for what in ("config", "flags", "versions"):
        diffs = c[what]
        if not diffs:
            lines.append(f"{what}: the same")
            continue
        lines.append(f"{what} differs:")
        lines.extend(f"  {d['key']}: A {display.flat_text(d['a'])}  B "
                     f"{display.flat_text(d['b'])}" for d in diffs)
    return "\n".join(lines)
