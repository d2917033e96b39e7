"""Training-health alerts, folded from each rank's `step` messages: a NaN or infinite loss, an
AMP loss scale collapsed to its floor, optimizer steps skipped in a row.

An alert is raised by the very step message that shows the condition, with that step as
`since_step`, and stays while the condition lasts: a finite loss, a scale back at or above the
floor, a step that was not skipped clears its alert. A rank's alerts live in
`RankView.alerts` (kind -> plain dict, so the hub's seed needs no new class); `job_alerts`
groups them per kind over the ranks for the job-level list of `scalemon snapshot --json`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

LOSS_NOT_FINITE = "loss_not_finite"
LOSS_SCALE_FLOOR = "loss_scale_floor"
SKIPPED_STEPS = "skipped_steps"
KINDS = (LOSS_NOT_FINITE, LOSS_SCALE_FLOOR, SKIPPED_STEPS)
"""Alert kinds, the most serious first."""

SCALE_FLOOR = 1.0
"""A GradScaler scale below this has halved itself past any useful range: fp16 gradients
overflow on (nearly) every step, so training no longer moves."""
SKIPPED_IN_A_ROW = 3
"""This many optimizer steps skipped one after the other (inf/NaN gradients) is an alert;
one skipped step now and then is how AMP finds its scale."""

_INF = math.inf
SHORT = {LOSS_NOT_FINITE: "{value} loss", LOSS_SCALE_FLOOR: "scale<1", SKIPPED_STEPS: "skipping"}
"""What a rank table's state cell says, before `@<since step>`."""


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def value_text(value: Any) -> str:
    """A non-finite float as people write it: NaN, inf, -inf."""
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return str(value)


def fold_step(alerts: dict[str, dict[str, Any]], streak: list[int] | None, step: int,
              body: dict[str, Any], t: float) -> list[int] | None:
    """Update a rank's `alerts` with one step message (`body`, at envelope time `t`); returns
    the rank's run of skipped steps ([first step, count], None when the last step was not
    skipped), which the caller keeps for the next step. A healthy step of a healthy rank (the
    hub folds every step of every rank) costs a few comparisons."""
    loss = body.get("loss")
    scale = body.get("loss_scale")
    skipped = body.get("skipped")
    if (not alerts and streak is None and skipped is not True
            and (loss is None or (type(loss) is float and -_INF < loss < _INF))
            and (scale is None or (type(scale) is float and scale >= SCALE_FLOOR))):
        return None
    _set(alerts, LOSS_NOT_FINITE, _number(loss) and not math.isfinite(loss), step, t, loss)
    _set(alerts, LOSS_SCALE_FLOOR, _number(scale) and scale < SCALE_FLOOR, step, t, scale)
    streak = ([streak[0], streak[1] + 1] if streak else [step, 1]) if skipped is True else None
    count = streak[1] if streak else 0
    if count >= SKIPPED_IN_A_ROW:
        alerts.setdefault(SKIPPED_STEPS, {"kind": SKIPPED_STEPS, "since_step": streak[0],
                                          "since_t": t})["value"] = count
    else:
        alerts.pop(SKIPPED_STEPS, None)
    return streak


def _set(alerts: dict[str, dict[str, Any]], kind: str, on: bool, step: int, t: float,
         value: Any) -> None:
    if not on:
        alerts.pop(kind, None)
        return
    alert = alerts.get(kind)
    if alert is None:
        alert = alerts[kind] = {"kind": kind, "since_step": step, "since_t": t}
    alert["value"] = value


def alert_text(kind: str, ranks: list[int], since_step: int | None, value: Any) -> str:
    """"loss is NaN on rank 0 since step 7" and the like."""
    who = ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)
    since = f" since step {since_step}" if since_step is not None else ""
    if kind == LOSS_NOT_FINITE:
        return f"loss is {value_text(value)} on {who}{since}"
    if kind == LOSS_SCALE_FLOOR:
        shown = f"{value:.3g}" if _number(value) else str(value)
        return (f"AMP loss scale collapsed to {shown} (below {SCALE_FLOOR:g}) on {who}{since}: "
                "gradients overflow on every step")
    if kind == SKIPPED_STEPS:
        return (f"{value} optimizer steps skipped in a row (inf/NaN gradients) on {who}{since}")
    return f"{kind} on {who}{since}"


def short_text(alert: dict[str, Any]) -> str:
    """A rank table's state cell: `NaN loss@7`, `scale<1@12`, `skipping@30`."""
    label = SHORT.get(alert["kind"], alert["kind"]).format(value=value_text(alert.get("value")))
    return f"{label}@{alert['since_step']}"


def rank_alerts(rank: int, alerts: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """A rank's alerts as JSON-ready dicts with their text, the most serious first."""
    return [{**alerts[k], "text": alert_text(k, [rank], alerts[k]["since_step"],
                                             alerts[k].get("value"))}
            for k in KINDS if k in alerts]


def worst(alerts: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """A rank's most serious alert, or None."""
    return next((alerts[k] for k in KINDS if k in alerts), None)


def job_alerts(ranks: Iterable[tuple[int, dict[str, dict[str, Any]]]]) -> list[dict[str, Any]]:
    """The job's alerts: one per kind that some rank has, with every such rank, the earliest
    `since_step` and `since_t` among them and the value of the rank where it began; ordered
    by when they began."""
    by_kind: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for rank, alerts in ranks:
        for kind, alert in alerts.items():
            by_kind.setdefault(kind, []).append((rank, alert))
    out = []
    for kind, found in by_kind.items():
        _, first = min(found, key=lambda ra: (ra[1]["since_t"], ra[1]["since_step"],
                                                       ra[0]))
        ranks_of = sorted(r for r, _ in found)
        since = min(a["since_step"] for _, a in found)
        out.append({"kind": kind, "ranks": ranks_of, "since_step": since,
                    "since_t": first["since_t"], "value": first.get("value"),
                    "text": alert_text(kind, ranks_of, since, first.get("value"))})
    out.sort(key=lambda a: (a["since_t"], KINDS.index(a["kind"]) if a["kind"] in KINDS else 9))
    return out
