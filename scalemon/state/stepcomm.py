"""The recorder's per-step all-reduce rows (`collectives.steps`): checked, and written into a
rank's `allreduce_*` metrics as a step message of its own would."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scalemon.protocol import STEP_COMM_FIELDS

if TYPE_CHECKING:
    pass


# --- the recorder's per-step all-reduce rows (`collectives.steps`) ----------------------------

def check_step_comm(row: Any) -> None:
    """Raise ValueError unless `row` is a well-formed `collectives.steps` row."""
    number = (int, float)
    if not (type(row) is list and len(row) >= len(STEP_COMM_FIELDS) and type(row[0]) is int
            and type(row[1]) is int and type(row[2]) is int and type(row[4]) is int
            and (row[3] is None or type(row[3]) in number)
            and (row[5] is None or type(row[5]) in number)):
        raise ValueError(f"bad collectives.steps row {row!r}")


def step_comm_values(row: list[Any]) -> dict[str, Any]:
    """A `collectives.steps` row as the step's `allreduce_*` metrics."""
    return {"allreduce_time_s": row[3], "allreduce_count": row[1], "allreduce_bytes": row[4],
            "allreduce_issue_t": row[5]}


def set_step_comm(values: dict[str, Any], row: list[Any]) -> None:
    """Write a `collectives.steps` row into a rank's metrics."""
    values.update(step_comm_values(row))
