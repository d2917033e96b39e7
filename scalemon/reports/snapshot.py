"""A job's state as JSON-ready data: what `scalemon snapshot --json` prints, what the hub's
`state` request answers and what summaries start from (non-finite numbers stay floats here;
`reports.export.strict_json` makes them null)."""

from __future__ import annotations

import time
from dataclasses import fields
from typing import Any

from scalemon import metrics, throughput
from scalemon.reports import groups
from scalemon.reports.hangs import end_text, first_failure, job_hang, last_hang
from scalemon.reports.pipeline import moe_json, p2p_rows, pipeline_json
from scalemon.reports.stragglers import stragglers_json
from scalemon.state import alerts as alerting
from scalemon.state.jobstate import JOB_ENDED_STATES, JobState, RankView

RANK_JSON_FIELDS = tuple(f.name for f in fields(RankView) if f.metadata.get("json", True))
"""The `RankView` fields `to_json` writes as they are, in declaration order."""


def rank_json(view: RankView, now: float | None = None) -> dict[str, Any]:
    """One rank: identity and state, then every metric under its own name, its tokens/s
    (`scalemon.throughput.rank_figure_at`: live as of `now`, and as of its last step) with
    its source."""
    out = {name: getattr(view, name) for name in RANK_JSON_FIELDS}
    out.update(view.metrics)
    figure = throughput.rank_figure_at(view, time.time() if now is None else now)
    out["tokens_per_s"], out["last_tokens_per_s"] = figure.live, figure.last
    out["tokens_per_s_source"] = figure.source
    out["extra"] = dict(view.extra)
    out["alerts"] = alerting.rank_alerts(view.rank, view.alerts)
    for m in metrics.KEPT:
        if m.source == "hub":
            out[m.name] = view.value(m.name, now)
    return out


def snapshot_json(st: JobState, now: float | None = None) -> dict[str, Any]:
    """The whole state as JSON-ready data (what `scalemon snapshot --json` prints)."""
    now = time.time() if now is None else now
    hang = job_hang(st, now)
    tokens = throughput.state_figure(st, now)
    ranks = [{**rank_json(st.ranks[r], now), "mesh": st.mesh(r),
              "flags": st.flags.values_of(r)} for r in sorted(st.ranks)]
    return {
        "job": st.job,
        "world_size": st.world_size,
        "state": "hung" if hang else st.state,
        "tokens_per_s": tokens.live,  # the running ranks' summed, a tp group x pipeline once
        "last_tokens_per_s": tokens.last,  # as of their last steps, whatever their state
        "tokens_per_s_source": tokens.source,
        "alerts": st.alerts(),
        "stop": dict(st.stop) if st.stop else None,
        "end": end_text(st) if st.state in JOB_ENDED_STATES else None,
        "messages": st.messages,
        "started_t": st.started_t,
        "last_t": st.last_t,
        "info": {k: {str(r): v for r, v in d.items()} for k, d in st.info.items()},
        "ranks": ranks,
        "stragglers": stragglers_json(ranks),  # the dashboard's rule (reports.stragglers)
        "flags": st.flags.table(sorted(st.ranks)),
        "toggles": st.flags.toggles_json(),
        "log": {"lines": st.flags.log_total,
                "last": [line.to_json() for line in list(st.flags.log)[-50:]]},
        "groups": {groups.group_desc(st.groups, n): {
            "name": n, "label": groups.group_label(st.groups, n), **g}
            for n, g in st.groups.items()},
        "collectives": [*groups.collectives_table(st.groups, st.ranks.values()),
                        *p2p_rows(st)],
        "mesh": st.job_mesh(),
        "pipeline": pipeline_json(st),
        "moe": moe_json(st),
        "hang": hang,
        "last_hang": None if hang else last_hang(st),  # kept once the job ended hung
        "first_failure": first_failure(st),  # the hang, where the job ended hung
        "attempts": st.attempts_json(),
        "max_restarts": st.max_restarts,
        "hang_after_s": st.hang_after_s,
        "fr_dumps": list(st.fr_dumps),
        "hub_notes": list(st.hub_notes),
        "relays": {node: dict(r) for node, r in sorted(st.relays.items())},
    }
