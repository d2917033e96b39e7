"""The messages of the wire protocol, field by field: what each message type carries (its
fields, their types, which are required), and the words messages use for ranks' states.
`scalemon.protocol` checks every message against these tables and re-exports them; the per-rank
metrics among the fields come from `scalemon.metrics`."""

from __future__ import annotations

from scalemon import metrics

_OPT_INT = (int, type(None))
_OPT_STR = (str, type(None))
_OPT_DICT = (dict, type(None))


def _fields_from_table(message: str) -> dict[str, tuple[tuple[type, ...], bool]]:
    return {m.name: (metrics.wire_types(m), m.required) for m in metrics.fields_of(message)}


# message type -> {field: (accepted python types, required)}
MESSAGE_FIELDS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    # A rank announces itself (first message, and again after a torchrun restart).
    "hello": {
        "host": ((str,), True),
        "pid": ((int,), True),
        "world_size": ((int,), True),
        "local_rank": ((int,), True),
        "restart_count": ((int,), False),
        "max_restarts": ((int,), False),  # 1.12: the launcher's restart budget (torchrun's)
        "agent_version": ((str,), False),
        "torch_version": (_OPT_STR, False),
        "device": (_OPT_STR, False),
        "backend": (_OPT_STR, False),
        "config": (_OPT_DICT, False),
    },
    # One training step, sent when the step's device values are ready; and once a second
    # from the agent's background thread. Both bodies come from the table of metrics.
    "step": _fields_from_table("step"),
    "heartbeat": _fields_from_table("heartbeat"),
    # What the Flight Recorder saw since the agent's previous read: the process groups, rows
    # of `scalemon.collectives.STATS_FIELDS` by (group, op, size bucket), and the issue time of
    # every new collective as [group, seq, Unix s] (arrival skew); and (1.6) per step completed
    # since, its all-reduces as `STEP_COMM_FIELDS` (the step's allreduce_* where the step
    # message has none); and (1.11) the point-to-point ops since, as rows of
    # `scalemon.collectives.P2P_FIELDS` by (group, op, src, dst).
    "collectives": {
        "groups": ((dict,), True),
        "stats": ((list,), True),
        "issues": ((list,), True),
        "step": (_OPT_INT, False),
        "steps": ((list,), False),
        "p2p": ((list,), False),
    },
    # Free-form facts about the run (memory estimate, configuration, ...).
    "info": {
        "key": ((str,), True),
        "value": ((dict, list, str, int, float, bool, type(None)), True),
    },
    # A rank's training loop ended.
    "exit": {
        "reason": ((str,), True),
        "exit_code": (_OPT_INT, False),
        "step": (_OPT_INT, False),
        "error": (_OPT_STR, False),
        "dropped": (_OPT_INT, False),
    },
    # The agent switched itself off after an internal error (1.5): why, at which step. Sent
    # once, before anything else it stops sending; heartbeats go on, the exit comes as usual.
    "monitor_off": {
        "reason": ((str,), True),
        "step": (_OPT_INT, False),
    },
    # Written by the hub: a Flight Recorder dump it asked every rank for, and its analysis
    # (`state`: "requested", then "analysed"; `report`: `reports.frtrace.analyse`'s result).
    "fr_dump": {
        "directory": ((str,), True),
        "state": ((str,), True),
        "requested": ((list,), False),
        "written": ((list,), False),
        "missing": ((list,), False),
        "analysis": (_OPT_STR, False),
        "exit_code": (_OPT_INT, False),
        "report": (_OPT_DICT, False),
    },
    # Written by the hub: something readers of the job should know about the hub itself
    # (`kind` "history": what reopening the history found and kept).
    "hub_note": {
        "kind": ((str,), True),
        "text": ((str,), True),
    },
    # The flags of the panel (`scalemon.flags.FLAGS`) in effect on this rank (None: unset),
    # where this rank's tier differs from the table's and why (`notes`: name -> [tier, why]),
    # whether it can checkpoint and be restarted by torchrun (`restart`: {ok, reason}), and
    # whether its script moves its work to a new group at a step boundary (`rebuild`).
    "flags": {
        "values": ((dict,), True),
        "notes": (_OPT_DICT, False),
        "restart": (_OPT_DICT, False),
        "rebuild": ((bool,), False),
    },
    # What a rank did with a flag change the hub relayed (`outcome`: applied, failed,
    # restarting), at which step boundary (the change is in effect from `step` on). 1.6: an
    # applied NCCL_DEBUG change that turned NCCL's lines on says `log_window_s`; that long after,
    # a second `toggle_result` of the same id brings `log_lines`, the NCCL log lines the agent
    # read in that window (its `text` says what a count of 0 likely means).
    "toggle_result": {
        "id": ((int,), True),
        "name": ((str,), True),
        "value": ((str,), True),
        "outcome": ((str,), True),
        "step": (_OPT_INT, False),
        "text": (_OPT_STR, False),
        "log_window_s": ((float, int, type(None)), False),
        "log_lines": (_OPT_INT, False),
    },
    # New lines of a log the agent follows (`source`: "nccl" for NCCL_DEBUG_FILE, "stderr"
    # for torch's own output), at most a bounded number per second; `dropped` counts lines
    # left out since the previous message.
    "log_lines": {
        "source": ((str,), True),
        "lines": ((list,), True),
        "dropped": (_OPT_INT, False),
    },
    # Written by the hub: a flag change someone asked for, and what became of it (`state`:
    # requested, applied, partial, failed, refused, restarting, restarted); one record per
    # state change, all with the same `id`.
    "toggle": {
        "id": ((int,), True),
        "name": ((str,), True),
        "value": ((str,), True),
        "state": ((str,), True),
        "tier": (_OPT_STR, False),
        "user": (_OPT_STR, False),
        "client_host": (_OPT_STR, False),
        "role": (_OPT_STR, False),  # 1.8: the asker's role, and how the hub knows who it is
        "via": (_OPT_STR, False),
        "at_step": (_OPT_INT, False),
        "step": (_OPT_INT, False),
        "ranks": (_OPT_DICT, False),
        "text": (_OPT_STR, False),
    },
    # Written by the hub: what a node's relay reported (`state`: "up" for a new relay, with
    # `gap_s` since the node's previous relay last reported; "report" for its counts; "lost"
    # when it stopped reporting). `clock_offset_s` is the hub's clock minus the node's.
    "relay": {
        "node": ((str,), True),
        "state": ((str,), True),
        "pid": (_OPT_INT, False),
        "received": (_OPT_INT, False),
        "forwarded": (_OPT_INT, False),
        "dropped": (_OPT_INT, False),
        "clock_offset_s": ((float, int, type(None)), False),
        "gap_s": ((float, int, type(None)), False),
        "text": (_OPT_STR, False),
    },
    # Written by the hub: a rank changed state (`state` is one of RANK_STATES); (1.12)
    # `process`: what the hub or the node's relay read of the rank's process
    # (`scalemon.proc.facts.ProcessFacts.to_wire`), `where`: where a frozen rank is stuck, in
    # words, from its stacks read from outside.
    "rank_state": {
        "target": ((int,), True),
        "state": ((str,), True),
        "reason": (_OPT_STR, False),
        "exit_code": (_OPT_INT, False),
        "process": (_OPT_DICT, False),
        "where": (_OPT_STR, False),
    },
    # Written by the hub (1.12): a silent rank's stacks, read from outside its process by the
    # hub or its node's relay (`scalemon.proc.stacks.StackReading.to_wire`), with the facts of
    # its process read at the same time.
    "rank_stacks": {
        "target": ((int,), True),
        "reading": ((dict,), True),
        "process": (_OPT_DICT, False),
        "reader": (_OPT_STR, False),
    },
    # Written by the hub (1.5): the job's user asked to stop it (RPC `stop` on the control
    # socket, e.g. `scalemon demo`'s quit); ranks that end after it are `stopped`, not failed.
    "job_stop": {
        "reason": (_OPT_STR, False),
        "user": (_OPT_STR, False),
        "host": (_OPT_STR, False),
        "via": (_OPT_STR, False),  # 1.8
    },
}

STEP_COMM_FIELDS = ("step", "count", "timed", "time_s", "bytes", "issue_t")
"""The columns of one row of `collectives.steps` (1.6): the step, its all_reduce-type
collectives (every group, p2p excluded), how many had a duration, their summed duration (s;
null when none had one), their summed bytes, the first one's issue time (Unix s, rank's clock)."""

SILENT_RANK_STATES = ("frozen", "gone", "unreachable", "silent")
"""What the hub says of a running rank that stopped sending (1.12; `lost` before): `frozen`
(its process exists: stacks read from outside say where it is), `gone` (its process ended
without reporting an exit), `unreachable` (its node's relay is silent too), `silent` (nothing
on its node can look at its process). `docs/protocol.md` and the README say the same."""
RANK_STATES = ("running", *SILENT_RANK_STATES, "exited", "finished", "lost")
"""`lost` is read in histories of hubs before 1.12 (the reducer takes it as `silent`)."""
HUB_TYPES = ("rank_state", "fr_dump", "hub_note", "toggle", "relay", "job_stop", "rank_stacks")
"""Message types only the hub writes (as rank `HUB_RANK`)."""

# --- a big job's feed for dashboards (the `seed` reply says `"digest": true`) ------------
DIGEST_FROM_RANKS = 1024
"""From this world size on the hub also publishes a digest of its fold on the feed, once a
second, and a dashboard follows it instead of every record (`hub/digest.py`)."""
DIGEST_WANTED_S = 60.0
"""A dashboard following a big job's digest asks for it (`digest` request) every third of this;
the hub builds digests only while one asked within it (1.14)."""
DIGEST_TOPIC = b"dig"
"""Feed messages [`dig <history id> <base>`, msgpack map `DIGEST_FIELDS`]: a big job's fold
as it stands, each rank that changed since the previous digest as a `DIGEST_RANK_FIELDS` row."""
FEW_TOPIC = b"few"
"""Feed messages [`few <history id> <base>`, record number (8 bytes), record] of a big job:
each record that is neither a `step` nor a `heartbeat` (a dashboard folds them itself)."""
DIGESTED_TYPES = ("step", "heartbeat")
"""The records a digest stands for; the others go on the feed one by one (`FEW_TOPIC`)."""
DIGEST_FIELDS = ("seq", "t", "ranks", "lean", "job", "agg")
"""A digest: the record number it is as of, the hub's clock, whole rows of some ranks (a
`DIGEST_RANK_FIELDS` row each, for up to 4,096 ranks that changed since their last row, in
turns), the `DIGEST_LEAN_FIELDS` of every rank heard from since the previous digest ({"rows":
n, "columns": {field: column}}, `scalemon.link.columns`), the fold's job-wide figures
({"last_t", "last_step_t", "fold_last_step_t", "records", "by_type", "groups": the process
groups first seen since the previous digest}), and the per-step bands closed since the
previous digest ({metric: [[x, lo, hi, mean], ...]})."""
DIGEST_RANK_FIELDS = ("rank", "step", "steps_received", "last_seen_t", "last_step_t",
                      "last_seq", "seq_seen", "seq_gaps", "compute_over_median_s", "metrics",
                      "extra", "derived", "alerts")
"""One rank's row in a digest: its `RankView` fields that its steps and heartbeats change;
`metrics` a list of values in `DIGEST_METRICS` order (null: not known), `extra` a list in
`DIGEST_EXTRAS` order (the table's `log(**extra)` names; empty: none)."""
DIGEST_LEAN_FIELDS = ("rank", "step", "steps_received", "last_seen_t", "last_step_t")
"""The `RankView` fields of every rank heard from that each digest carries (as columns)."""
DIGEST_METRICS = metrics.latest_of("step") + metrics.latest_of("heartbeat")
"""The order of a digest row's `metrics`: a `RankView.metrics`' names."""
DIGEST_EXTRAS = tuple(m.name for m in metrics.METRICS if m.source == "extra")
"""The order of a digest row's `extra`."""
