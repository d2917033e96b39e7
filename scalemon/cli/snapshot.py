"""`scalemon snapshot`: a job's state from its hub, or replayed from its history once the hub
is gone; JSON with --json (`reports.snapshot`), else text (`reports.snapshot_text`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from scalemon import __version__, protocol
from scalemon.home.lookup import JobLookupError, ended_jobs_text, hub_gone_text, resolve_hub
from scalemon.reports.snapshot_text import format_snapshot, group_by_problem


def _offline_state(job: str) -> dict[str, Any] | None:
    """The state replayed from a job's history file, when its hub is gone."""
    from scalemon.home.history import earlier_loss_text, history_path, read_messages
    from scalemon.home.history_read import ReadStats, sealed_count
    from scalemon.reports.snapshot import snapshot_json
    from scalemon.state.fold import JobFold

    path = history_path(job)
    if not path.exists():
        return None
    if sealed_count(path):  # a long history: from its checkpoint on (`link.checkpoint`)
        from scalemon.link.checkpoint import catch_up

        stats = ReadStats()
        fold, rejected = catch_up(path, job, stats=stats).fold, stats.rejected
    else:
        fold = JobFold(job=job)  # as the hub folds (compute times for `stragglers` too)
        messages, rejected = read_messages(path, job)
        for seq, msg in messages:
            fold.apply(seq, msg)
    out = snapshot_json(fold.state)
    loss = earlier_loss_text(path)  # what its last hub could not write (a full disk)
    if loss:
        out["hub_notes"] = [*(out.get("hub_notes") or []), {"t": time.time(), "kind": "history",
                                                           "text": loss}]
    return {"state": out, "hub": None, "source": str(path), "rejected": rejected}


def no_history_text(job: str, problem: str) -> str:
    """`problem` (no live hub for `job`), with no history file to replay either: where to look
    for the right id (`scalemon jobs`, the jobs that ended last)."""
    from scalemon.home.history import history_path

    ended = ended_jobs_text()
    return (f"{problem}, and no history file at {history_path(job)}: is the job id right? "
            "(`scalemon jobs` lists live jobs)" + (f"; {ended}" if ended else ""))


def cmd_snapshot(args: argparse.Namespace) -> int:
    """Print the job's state (JSON with --json)."""
    from scalemon.link.client import HubClient, HubUnreachable, hub_key_problem

    job = args.target
    try:
        job, address = resolve_hub(args.target)
        if missing := hub_key_problem(address):
            print(f"scalemon snapshot: {missing}", file=sys.stderr)
            return 2
        reply = HubClient(address, timeout_s=args.timeout).state()
        reply["source"] = address.base
    except protocol.VersionMismatch as exc:
        print(f"scalemon snapshot: the hub of {job} speaks scalemon protocol "
              f"{protocol.version_text(exc.theirs)}, this scalemon ({__version__}) speaks "
              f"{protocol.version_text(exc.ours)}: use the scalemon version the job runs",
              file=sys.stderr)
        return 2
    except (JobLookupError, HubUnreachable, ValueError, protocol.ProtocolError) as exc:
        problem, reply = str(exc), None
        if job and "://" not in job:  # a job id: its history file may still be there
            try:
                reply = _offline_state(job)
                if reply is None and isinstance(exc, JobLookupError):  # no such live job
                    problem = no_history_text(job, problem)
            except ValueError as bad_id:
                problem = str(bad_id)
        if reply is None:
            print(f"scalemon snapshot: {problem}", file=sys.stderr)
            return 2
        skipped = (f"; {reply['rejected']} damaged stretch(es) or invalid records skipped"
                   if reply["rejected"] else "")
        why = hub_gone_text(job) or problem  # whole: a cut at ':' lost addresses and names
        print(f"scalemon snapshot: {why}; replaying {reply['source']}{skipped}",
              file=sys.stderr)
    out = {**reply["state"], "hub": reply.get("hub"), "source": reply.get("source")}
    axis = getattr(args, "group_by", None)
    if axis is not None and (problem := group_by_problem(out, axis)):
        print(f"scalemon snapshot: --group-by {problem}", file=sys.stderr)
        return 2
    if args.json:  # strict JSON: NaN and infinities as null (docs/protocol.md 9.3)
        from scalemon.reports.export import strict_json

        print(json.dumps(strict_json(out), indent=1, allow_nan=False))
    else:
        print(format_snapshot(out, group_by=axis))
    return 0
