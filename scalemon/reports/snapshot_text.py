"""`scalemon snapshot` for people: the snapshot JSON (`reports.snapshot`) as a table of ranks
(a row per node from `AGGREGATE_AT` ranks on), the run's facts, relays, flags, collectives and
the hang with every rank's stack."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from scalemon import metrics, throughput
from scalemon.policy import (
    NODE_STATES,
    TROUBLE_KINDS,
    rank_kind,
    rank_status,
    straggler_bar,
    stuck_after_s,
)
from scalemon.reports import parallel_text
from scalemon.reports.stragglers import ARRIVAL_BASIS, json_measure
from scalemon.state.ending import with_reason
from scalemon.text import display
from scalemon.text.display import (
    AGGREGATE_AT,
    LATE,
    NO_HOST,
    flat_text,
    node_cells,
    node_columns,
    node_order_key,
    shown,
    spread,
    unit,
)
from scalemon.text.safe import clean

# --- the `scalemon snapshot` text of a big job ------------------------------------------------

TOP_STRAGGLERS = 8
"""Slowest ranks listed above a node table (by the straggler measure: arrival lateness, or
before any collective compute time over the median rank's)."""
FAILED_LISTED = 12
"""Failed ranks and ranks that stopped sending, listed above a node table; the others are
counted."""


def node_snapshot_lines(ranks: list[dict[str, Any]], width: int = 60) -> list[str]:
    """The ranks of a `scalemon snapshot` (`snapshot_json(state)["ranks"]`) as people read a
    big job: the slowest ranks by the straggler measure (`stragglers.json_measure`, the
    dashboard's), the failed ranks and those that stopped sending, a row per node
    (trouble first: `node_order_key`) and each `log()` extra's spread over the ranks."""
    late, basis, median_step = json_measure(ranks)  # the dashboard's measure and bar
    bar = straggler_bar(median_step)
    hosts = {r["rank"]: r.get("host") or NO_HOST for r in ranks}
    by_node: dict[str | None, list[dict[str, Any]]] = {}
    for r in ranks:
        by_node.setdefault(r.get("host") or None, []).append(r)
    lines = [f"ranks: {len(ranks)} on {len(by_node)} nodes, a row per node from "
             f"{AGGREGATE_AT} ranks on (--json has every rank)"]
    slowest = sorted(late.items(), key=lambda rv: (-rv[1], rv[0]))[:TOP_STRAGGLERS]
    ms = unit(LATE)
    by = (f"arrival at collectives ({ms} after the first rank" if basis == ARRIVAL_BASIS else
          f"compute time, no collective seen by every rank yet ({ms} over the median rank")
    lines.append(f"slowest ranks by {by}; a straggler from {shown(LATE, bar):.3g} {ms}):"
                 if slowest else "slowest ranks: n/a (no collective seen by every rank yet)")
    lines.extend(f"  rank {r:<6} {hosts[r]:<14} {shown(LATE, v):+8.1f} {ms}"
                 + ("  straggler" if v > bar else "") for r, v in slowest)
    failed = sorted((r for r in ranks if rank_kind(r["state"], r.get("exit_code"))
                     in TROUBLE_KINDS),
                    key=lambda r: (bool(r.get("peer_loss")), r.get("ended_t") or math.inf,
                                   r["rank"]))
    lines.append(f"failed or stopped sending: {len(failed) or 'none'}")
    for r in failed[:FAILED_LISTED]:
        reason = r.get("state_reason")
        code = "" if r.get("exit_code") is None else f" exit code {r['exit_code']}"
        why = f" ({reason})" if reason and reason != r["state"] else ""
        peer = ", peer lost" if r.get("peer_loss") else ""
        lines.append(f"  rank {r['rank']:<6} {hosts[r['rank']]:<14} {r['state']}{code}{why}"
                     f"{peer}")
    if len(failed) > FAILED_LISTED:
        lines.append(f"  +{len(failed) - FAILED_LISTED} more (--json has them all)")
    lines.extend(_node_table_lines(by_node, late, bar, median_step))
    lines.extend(_extra_lines(ranks, width))
    return lines


def _snapshot_worst(rank: dict[str, Any], late: dict[int, float], bar: float,
                    stuck_after: float) -> str:
    """The `NODE_STATES` entry of one rank of a snapshot (`policy.rank_status`)."""
    since = rank.get("phase_since_s")
    return rank_status(rank["state"], rank.get("exit_code"), rank.get("phase"),
                       since if isinstance(since, (int, float)) else None,
                       late.get(rank["rank"], 0.0) > bar, stuck_after)


def snapshot_values(rank: Mapping[str, Any]) -> dict[str, Any]:
    """A snapshot rank's values by metric name, as the dashboard reads them: its messages'
    fields and its `extra`, its `tokens_per_s` (the state's: `scalemon.throughput`) and the
    derived metrics by the state's rule (`metrics.derived_values`)."""
    values = {**rank, **(rank.get("extra") or {})}
    if "tokens_per_s" in rank:
        values["tokens_per_s"] = rank["tokens_per_s"]
    derived = metrics.derived_values(values)
    values.update((name, v) for name, v in derived.items() if values.get(name) is None)
    return values


def _node_table_lines(by_node: dict[str | None, list[dict[str, Any]]], late: dict[int, float],
                      bar: float, median_step: float | None) -> list[str]:
    """A row per node, trouble first, under a two-line heading (metric, then min/med/max)."""
    columns = node_columns(dashboard=False)
    stuck_after = stuck_after_s(median_step)
    keyed = []
    for host, members in by_node.items():
        worsts = [_snapshot_worst(r, late, bar, stuck_after) for r in members]
        worst = min(worsts, key=NODE_STATES.index)
        values = [snapshot_values(r) for r in members]
        cells = node_cells(columns, host, [rank_kind(r["state"], r.get("exit_code"))
                                           for r in members], worst,
                           [r.get("step") for r in members], values)
        s = spread(r.get("step_time_s") for r in members if r["state"] == "running")
        node_late = [late[r["rank"]] for r in members if r["rank"] in late]
        slow = s is not None and median_step is not None and s[1] > median_step + bar
        key = node_order_key(worst, s[1] if s else None, slow,
                             max(node_late) if node_late else None,
                             min(r["rank"] for r in members))
        keyed.append((key, cells))
    keyed.sort(key=lambda kc: kc[0])
    rows = [cells for _, cells in keyed]
    widths = [max([len(c.heading)] + [len(row[i]) for row in rows])
              for i, c in enumerate(columns)]
    for group in {c.group for c in columns if c.group}:  # a group heading fits its columns
        at = [i for i, c in enumerate(columns) if c.group == group]
        short = len(group) - (sum(widths[i] for i in at) + len(at) - 1)
        if short > 0:
            widths[at[-1]] += short

    def line(texts: list[str] | tuple[str, ...]) -> str:
        return " ".join(t.ljust(w) if c.align_left else t.rjust(w)
                        for c, t, w in zip(columns, texts, widths, strict=True)).rstrip()

    groups, i = [], 0
    while i < len(columns):
        j = i
        while j + 1 < len(columns) and columns[j + 1].group and \
                columns[j + 1].group == columns[i].group:
            j += 1
        span = sum(widths[i:j + 1]) + (j - i)
        groups.append(columns[i].group.center(span) if columns[i].group else " " * span)
        i = j + 1
    return [" ".join(groups).rstrip(), line([c.heading for c in columns])] + \
        [line(row) for row in rows]


def _extra_lines(ranks: list[dict[str, Any]], width: int) -> list[str]:
    """Each `log()` extra's spread over the ranks that log it (numbers), or its values."""
    by_name: dict[str, list[Any]] = {}
    for r in ranks:
        for name, value in (r.get("extra") or {}).items():
            by_name.setdefault(name, []).append(value)
    lines = []
    for name in sorted(by_name):
        values = by_name[name]
        s = spread(values)
        if s is not None:
            text = " / ".join(flat_text(float(v)) for v in s) + " (min / median / max)"
        else:
            distinct = {flat_text(v) for v in values}
            text = distinct.pop() if len(distinct) == 1 else f"{len(distinct)} distinct values"
        text = text if len(text) <= width else text[: width - 1] + "…"
        lines.append(f"extra {name} ({len(values)} ranks): {text}")
    return lines


def _frame_cell(key: str, rank: dict[str, Any]) -> str:
    if key == "state":
        reason = rank.get("state_reason")
        text = with_reason(rank["state"], reason)
        text += ", peer lost" if rank.get("peer_loss") else ""
        text += f"; monitor off: {rank['monitor_off']}" if rank.get("monitor_off") else ""
        alerts = rank.get("alerts") or []
        return text + "".join(f"; ALERT: {a['text']}" for a in alerts)
    return display.text_of(rank.get(key))


def mesh_axes(state: Mapping[str, Any]) -> list[str]:
    """The axes of the job's device mesh (`snapshot --json`'s "mesh" "dims", else those its
    ranks' coordinates name), outermost first; none without a mesh."""
    dims = (state.get("mesh") or {}).get("dims")
    if isinstance(dims, list) and dims:
        return [str(d) for d in dims]
    return parallel_text.mesh_dims(parallel_text.mesh_coords(r.get("mesh"))
                                   for r in state.get("ranks") or ())


def group_by_problem(state: Mapping[str, Any], axis: str) -> str | None:
    """Why the snapshot's rank table cannot be grouped by mesh axis `axis` (naming the axes
    there are), None when it can."""
    axes = mesh_axes(state)
    return None if axis in axes else parallel_text.unknown_axis_text(axis, axes)


def format_snapshot(state: dict[str, Any], width: int = 60, group_by: str | None = None) -> str:
    """A plain-text table of the snapshot for people: a row per rank with the columns of the
    dashboard (but those only a dashboard computes; a mesh column where the ranks reported
    their place in a device mesh, grouped by its axis `group_by` when given: ValueError
    naming the axes when it is none of them), then each rank's `extra` values and the run's
    `info` facts, one line each, cut at `width` characters of value."""
    if group_by is not None and (problem := group_by_problem(state, group_by)):
        raise ValueError(problem)
    lines = [
        f"job {state['job']}  world size {display.text_of(state['world_size'])}  state "
        f"{'HUNG' if state.get('hang') else state['state']}"
        f"  messages {state['messages']}{tokens_text(state)}",
    ]
    if state.get("stop") and state["state"] in ("stopped", "stopping"):
        stop = state["stop"]
        who = f"{stop['user']}@{stop['host']}" if stop.get("user") else "its user"
        words = "stopped by" if state["state"] == "stopped" else "stopping: asked by"
        lines.append(f"{words} {who}" + (f" ({stop['reason']})" if stop.get("reason") else ""))
    elif state["state"] == "stopped" and state.get("end"):  # by a signal: how the ranks ended
        lines.append(f"stopped: {state['end']}")
    if state.get("first_failure"):
        lines.append(state["first_failure"]["text"])
    lines.extend(attempt_lines(state.get("attempts") or [], state.get("max_restarts")))
    lines.extend(f"ALERT: {a['text']}" for a in state.get("alerts") or [])
    lines.extend(parallel_lines(state))
    if len(state["ranks"]) >= display.AGGREGATE_AT:  # a line per node, not per rank
        lines.extend(node_snapshot_lines(state["ranks"], width))
    else:
        lines.extend(_rank_lines(state["ranks"], width, mesh_axes(state), group_by))
    lines.extend(_info_lines(state, width))
    return "\n".join(lines)


def tokens_text(state: Mapping[str, Any]) -> str:
    """"  tokens/s 15.0k" (the job's, `scalemon.throughput`; "tokens/s (script)" where a rank's
    figure is its script's own), or "" without one."""
    rate = state.get("tokens_per_s")
    if not isinstance(rate, (int, float)):
        return ""
    return f"  {throughput.LABELS[state.get('tokens_per_s_source') or throughput.STEPS]} " \
           f"{display.si(rate)}"


def attempt_lines(attempts: list[dict[str, Any]], max_restarts: int | None) -> list[str]:
    """The launcher's attempts once it restarted the job (one attempt says nothing):
    "attempt 1 of 2: crashed at step 5: rank 1 failed first ..."."""
    if len(attempts) < 2:
        return []
    total = f" of {max_restarts + 1}" if isinstance(max_restarts, int) else ""
    lines = [f"attempts: {len(attempts)} (the launcher restarted the job)"]
    for a in attempts:
        step = f" at step {a['last_step']}" if a.get("last_step") is not None else ""
        why = f": {a['first_failure']}" if a.get("first_failure") else ""
        lines.append(f"  attempt {a['attempt'] + 1}{total}: {a.get('how') or '?'}{step}{why}")
    return lines


def parallel_lines(state: Mapping[str, Any]) -> list[str]:
    """The mesh's shape, the pipeline's bubble and the MoE balance, a line each where the job
    has them ("pipeline 1f1b, 2 stages x 4 microbatches: bubble measured 31% (median), theory
    20%")."""
    lines = []
    mesh = state.get("mesh") or {}
    shape = mesh.get("shape") if isinstance(mesh, Mapping) else None
    if isinstance(shape, Mapping) and shape:
        lines.append("mesh " + " x ".join(f"{d} {n}" for d, n in shape.items()))
    lines.extend(line for line in (parallel_text.pipeline_line(state.get("pipeline")),
                                   parallel_text.moe_line(state.get("moe"))) if line)
    return lines


def _rank_lines(ranks: list[dict[str, Any]], width: int, axes: list[str] | None = None,
                group_by: str | None = None) -> list[str]:
    """A row per rank (with a mesh column where the job has a mesh, grouped by the mesh axis
    `group_by` under a heading per coordinate when given), then each rank's `extra`
    values."""
    lines: list[str] = []
    columns = display.rank_columns(dashboard=False, seen=ranks)
    if any(r.get("tokens_per_s_source") == throughput.SCRIPT for r in ranks):
        columns = script_rate_columns(columns)
    coords = {r["rank"]: parallel_text.mesh_coords(r.get("mesh")) for r in ranks}
    if axes:
        mesh_width = parallel_text.mesh_width(coords.values(), axes)
        columns = (*columns[:1], display.Column("mesh", "mesh", mesh_width, align_left=True),
                   *columns[1:])
    cells = []
    for rank in ranks:
        values = snapshot_values(rank)
        frame = {**rank, "mesh": parallel_text.mesh_text(coords[rank["rank"]], axes or [])}
        cells.append([clean(display.metric_text(c.metric, values) if c.metric else
                            _frame_cell(c.key, frame), one_line=True) for c in columns])
    widths = [max([len(c.heading)] + [len(row[i]) for row in cells if c.key != "state"])
              for i, c in enumerate(columns)]
    state_at = [c.key for c in columns].index("state")
    widths[state_at] = len("state")  # the state goes last on its row, reasons can be long

    def line(texts: list[str]) -> str:
        out = [t.ljust(w) if c.align_left else t.rjust(w)
               for c, t, w in zip(columns, texts, widths, strict=True) if c.key != "state"]
        return " ".join(out) + "  " + texts[state_at]

    lines.append(line([c.heading for c in columns]))
    if group_by is None:
        lines.extend(line(row) for row in cells)
    else:
        row_of = {r["rank"]: row for r, row in zip(ranks, cells, strict=True)}
        for value, members in parallel_text.grouped(row_of, coords, group_by):
            lines.append("── " + parallel_text.group_heading(group_by, value, members))
            lines.extend(line(row_of[r]) for r in members)
    for rank in ranks:
        if rank.get("extra"):
            text = _short(display.flat_text(rank["extra"]), width)
            lines.append(f"rank {rank['rank']} extra: {text}")
    return lines


def script_rate_columns(columns: tuple[display.Column, ...]) -> tuple[display.Column, ...]:
    """`columns` with the tokens/s heading saying the figures are the script's own."""
    heading = SCRIPT_RATE_HEADING
    return tuple(dataclasses.replace(c, heading=heading, width=max(c.width, len(heading)))
                 if c.key == "tokens_per_s" else c for c in columns)


SCRIPT_RATE_HEADING = "tok/s (script)"
"""The rank tables' tokens/s heading where a rank's figure is its script's own."""


def _info_lines(state: dict[str, Any], width: int) -> list[str]:
    """The run's info facts, hub notes, flag mismatches, toggles, collectives, the hang."""
    lines: list[str] = []
    for key, by_rank in sorted(state.get("info", {}).items()):
        if key in ("fr_dump", "nccl_ras", "mesh", "pipeline"):
            continue  # shown with the hang; the mesh column, the pipeline's line
        for text, ranks in _group_equal(by_rank).items():
            lines.append(f"info {key} (rank {ranks}): {_short(text, width)}")
    for note in state.get("hub_notes") or []:
        lines.append(f"hub: {note['text']}")
    hub = state.get("hub") or {}
    if hub.get("history_unwritten"):
        lines.append(f"hub: {hub['history_unwritten']} records not yet written to the history "
                     f"({hub.get('history_error')}): kept in memory, lost if the hub exits "
                     "before there is room")
    lines.extend(_relay_lines(state.get("relays") or {}))
    for row in state.get("flags") or []:
        if row["mismatch"]:
            values = " ".join(f"{r}:{v}" for r, v in row["values"].items())
            lines.append(f"flag MISMATCH {row['name']}: {values}")
    if state.get("toggles"):
        from scalemon.state.flagstate import toggle_line

        lines.extend("toggle " + toggle_line(t) for t in state["toggles"][-5:])
    rows = state.get("collectives") or []
    lines.extend(_collectives_lines([r for r in rows if not parallel_text.is_p2p(r)]))
    lines.extend(p2p_lines([r for r in rows if parallel_text.is_p2p(r)]))
    lines.extend(_hang_lines(state.get("hang") or state.get("last_hang")))
    return lines


def _relay_lines(relays: dict[str, dict[str, Any]], most: int = 8) -> list[str]:
    """One line for the nodes' relays, then one per relay in trouble (lost, dropping or
    replaced), the worst first."""
    if not relays:
        return []
    trouble = sorted(((r["state"] == "lost", r.get("dropped") or 0, r.get("gaps") or 0, node)
                      for node, r in relays.items()
                      if r["state"] == "lost" or r.get("dropped") or r.get("gaps")),
                     reverse=True)
    offsets = [abs(r["clock_offset_s"]) for r in relays.values()
               if r.get("clock_offset_s") is not None]
    clock = f", clock offsets up to {max(offsets) * 1e3:.1f} ms" if offsets else ""
    lines = [f"relays: {len(relays)} nodes, {len(trouble)} in trouble{clock}"]
    for lost, dropped, gaps, node in trouble[:most]:
        r = relays[node]
        what = ["lost" if lost else "up", f"{dropped} dropped"]
        if gaps:
            what.append(f"replaced {gaps}x, {r.get('gap_total_s', 0.0):.1f} s without a relay")
        lines.append(f"  relay {node} (pid {r.get('pid')}): {', '.join(what)}")
    if len(trouble) > most:
        lines.append(f"  +{len(trouble) - most} more")
    return lines


def _collectives_lines(rows: list[dict[str, Any]], most: int = 8) -> list[str]:
    """The job's collectives, largest total time first (busbw as nccl-tests defines it)."""
    if not rows:
        return []
    out = ["collectives (count and bytes per rank; busbw = S/t x nccl-tests factor, GB/s):"]
    for r in rows[:most]:
        p50 = display.NA if r["time_p50_s"] is None else f"{r['time_p50_s'] * 1e3:.3g} ms"
        bw = display.NA if r["busbw_gbps"] is None else f"{r['busbw_gbps']:.3g}"
        out.append(f"  {r['group']} {r['op']}: {r['count']} x, {r['bytes']} bytes, "
                   f"p50 {p50}, busbw {bw}")
    if len(rows) > most:
        out.append(f"  ... {len(rows) - most} more (--json has them all)")
    return out


def p2p_lines(rows: list[dict[str, Any]], most: int = 16) -> list[str]:
    """The job's sends and receives, a line per (group, src -> dst), largest total time
    first."""
    if not rows:
        return []
    out = ["point to point (global ranks; count, bytes, summed time, bytes per op over the "
           "mean time):"]
    out.extend(f"  {parallel_text.p2p_text(r)}" for r in rows[:most])
    if len(rows) > most:
        out.append(f"  ... {len(rows) - most} more (--json has them all)")
    return out


def _hang_lines(hang: dict[str, Any] | None) -> list[str]:
    """The hang in words, then each rank's stack (innermost call last)."""
    if not hang:
        return []
    out = [f"HUNG: {hang['text']}"] if not hang.get("summary") else [  # the job ended hung
        f"HUNG until the end: {hang['summary']}", f"  {hang['text']}"]
    for cause in hang.get("causes") or ():  # culprits with their cause, phase and frame
        out.append(f"  {'culprit' if cause['culprit'] else 'stuck'}  {cause['text']}"
                   f"  [phase {cause['phase'] or display.NA}]")
    for wait in hang.get("waits") or ():
        if not wait["culprit"]:
            out.append(f"  waiting  {wait['text']}")
    out.extend(f"  waits for: {chain}" for chain in parallel_text.shown_chains(hang, most=8))
    for rank, stack in hang["stacks"].items():
        out.append(f"rank {rank} stack:")
        out.extend("  " + line for line in stack.rstrip().splitlines())
    return out


def _short(text: str, width: int) -> str:
    """`text` on one line, cut at `width` characters."""
    text = clean(text, one_line=True)
    return text if len(text) <= width else text[: width - 1] + "…"


def _group_equal(by_rank: dict[str, Any]) -> dict[str, str]:
    """Flattened value -> the ranks (as text) that hold it."""
    groups: dict[str, list[str]] = {}
    for rank, value in sorted(by_rank.items(), key=lambda kv: int(kv[0])):
        groups.setdefault(display.flat_text(value), []).append(rank)
    return {text: ",".join(ranks) for text, ranks in groups.items()}
