"""`scalemon summary` and `scalemon compare`: a run in a few lines, two runs side by side.

A job is read from its live hub (its state, and every record of its history over the `fetch`
request) or, with its hub gone, from its history file; the figures come from
`scalemon.reports.summary`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from scalemon import __version__, protocol
from scalemon.home.lookup import JobLookupError, hub_gone_text, resolve_hub
from scalemon.options import add_hub_timeout
from scalemon.protocol import Message
from scalemon.reports.export import strict_json
from scalemon.reports.snapshot import snapshot_json
from scalemon.reports.summary import RunRecords, compare, loss_series, run_records, summarize
from scalemon.reports.summary_text import compare_text, summary_text
from scalemon.state.runfigures import RunFigures

EXIT_NO_JOB = 2
JSON_NOTE = ("--json prints strict JSON (schema in docs/summary.md); a number that is not "
             "finite (a NaN loss) is null, and so is one that is not known")


class RunUnavailable(Exception):
    """Neither the job's hub nor its history can be read; the text (one line) says why."""


@dataclass
class Run:
    """A job as read for a summary."""

    job: str
    state: dict[str, Any]
    records: RunRecords | RunFigures
    source: dict[str, Any]
    """{"kind": "hub" | "history", "where": address or file, "skipped": records not read}."""

    def summary(self) -> dict[str, Any]:
        """The run's summary (`scalemon.reports.summary.summarize`)."""
        return summarize(self.state, self.records, self.source)


def add_parsers(sub: Any) -> None:
    """Add `summary` and `compare` to the `scalemon` parser."""
    summary = sub.add_parser(
        "summary", help="summarize a live or finished job",
        description="Summarize a job from every step of its history: steps, wall time, loss "
                    "(first, last, least), tokens/s and MFU (median, p10 over steps), step "
                    "time per rank (median, p90) and the slowest ranks, stragglers, hangs "
                    "and the first failure, flag toggles, collectives, peak memory per rank. "
                    "A live job is asked through its hub; with its hub gone, its history file "
                    f"is replayed. {JSON_NOTE}. Exit status: 0, or 2 for a job that cannot "
                    "be found or read.")
    summary.add_argument("target", nargs="?",
                         help="job id or hub address (default: the live job)")
    summary.add_argument("--json", action="store_true", help="machine-readable JSON")
    add_hub_timeout(summary)
    summary.set_defaults(func=cmd_summary)

    comp = sub.add_parser(
        "compare", help="compare two jobs side by side",
        description="Compare two jobs (live or finished): their summaries side by side with "
                    "the ratio B/A of tokens/s, MFU, step time, peak memory and wall time; the "
                    "loss at the same steps (10%%, 50%% and 100%% of the steps both logged, "
                    "and the last common one); what differs in config (the ranks' "
                    f"init(config=...)), flags and versions. {JSON_NOTE}. Exit status: 0, or "
                    "2 for a job that cannot be found or read.")
    comp.add_argument("job_a", metavar="JOB_A", help="job id or hub address (A)")
    comp.add_argument("job_b", metavar="JOB_B", help="job id or hub address (B)")
    comp.add_argument("--json", action="store_true", help="machine-readable JSON")
    add_hub_timeout(comp)
    comp.set_defaults(func=cmd_compare)


def cmd_summary(args: argparse.Namespace) -> int:
    """Print the summary of one job."""
    try:
        run = load_run(args.target, args.timeout, "summary")
    except RunUnavailable as exc:
        return _fail("summary", str(exc))
    summary = run.summary()
    if args.json:
        _print_json(summary)
    else:
        print(summary_text(summary))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Print two jobs side by side."""
    try:
        a = load_run(args.job_a, args.timeout, "compare")
        b = load_run(args.job_b, args.timeout, "compare")
    except RunUnavailable as exc:
        return _fail("compare", str(exc))
    out = compare(a.summary(), b.summary(), loss_series(a.records), loss_series(b.records))
    if args.json:
        _print_json(out)
    else:
        print(compare_text(out))
    return 0


def _print_json(value: Any) -> None:
    print(json.dumps(strict_json(value), indent=1, allow_nan=False))


def _fail(command: str, text: str) -> int:
    print(f"scalemon {command}: {text}", file=sys.stderr)
    return EXIT_NO_JOB


def load_run(target: str | None, timeout_s: float, command: str) -> Run:
    """The job `target` names (job id or hub address; None: the live job), from its hub, else
    from its history file (said on stderr). RunUnavailable when neither can be read."""
    job = target
    try:
        job, address = resolve_hub(target)
        return _from_hub(job, address, timeout_s)
    except protocol.VersionMismatch as exc:
        raise RunUnavailable(
            f"the hub of {job} speaks scalemon protocol {protocol.version_text(exc.theirs)}, "
            f"this scalemon ({__version__}) speaks {protocol.version_text(exc.ours)}: use the "
            "scalemon version the job runs") from None
    except (JobLookupError, ConnectionError, ValueError, protocol.ProtocolError) as exc:
        problem = " ".join(str(exc).split())  # one line ("several live jobs; name one: ...")
        if not job or "://" in job:
            raise RunUnavailable(problem) from None
        run = _from_history(job, problem)
        why = hub_gone_text(job) or problem
        skipped = run.source["skipped"]
        print(f"scalemon {command}: {why}; replaying {run.source['where']}"
              + (f"; {skipped} damaged stretch(es) or invalid records skipped" if skipped
                 else ""), file=sys.stderr)
        return run


def _from_hub(job: str, address: Any, timeout_s: float) -> Run:
    """The job's records over `fetch` (every page up to the hub's head), then its state."""
    from scalemon.link.client import PAGE, HubClient, hub_key_problem

    if missing := hub_key_problem(address):
        raise RunUnavailable(missing)
    client = HubClient(address, timeout_s=timeout_s)
    try:
        messages: list[Message] = []
        skipped = 0
        since = 0
        while True:
            frames, head = client.fetch(since, PAGE)
            for frame in frames:
                try:
                    messages.append(protocol.decode_stored(frame))
                except protocol.ProtocolError:
                    skipped += 1
            since += len(frames)
            if not frames or since >= head:
                break
        state = client.state()["state"]
    finally:
        client.close()
    return Run(job=state.get("job") or job, state=state, records=run_records(messages),
               source={"kind": "hub", "where": address.base, "skipped": skipped})


def _from_history(job: str, problem: str) -> Run:
    """The job replayed from its history file, as `scalemon snapshot` does with no hub."""
    from scalemon.home.history import history_path, read_messages
    from scalemon.home.history_read import read_checkpoint, sealed_count
    from scalemon.state.fold import JobFold

    try:
        path = history_path(job)
    except ValueError as exc:  # not a job id
        raise RunUnavailable(str(exc)) from None
    if not path.exists():
        raise RunUnavailable(f"{problem}, and no history file at {path}: is the job id right? "
                             "(`scalemon jobs` lists live jobs)")
    try:
        if sealed_count(path) or read_checkpoint(path) is not None:  # a long history
            return _digested(job, path)
        messages, rejected = read_messages(path, job)
    except OSError as exc:
        raise RunUnavailable(f"{problem}, and its history {path} cannot be read: "
                             f"{exc.strerror or exc}") from None
    fold = JobFold(job=job)  # as the hub folds (compute times for stragglers too)
    for seq, msg in messages:
        fold.apply(seq, msg)
    return Run(job=job, state=snapshot_json(fold.state),
               records=run_records(m for _, m in messages),
               source={"kind": "history", "where": str(path), "skipped": rejected})


def _digested(job: str, path: Any) -> Run:
    """A history with sealed chunks, from its checkpoint (`scalemon.link.checkpoint`: the fold
    and digest of its sealed records, saved beside it) and the records after it."""
    from scalemon.home.history_read import ReadStats
    from scalemon.link.checkpoint import catch_up

    stats = ReadStats()
    checkpoint = catch_up(path, job, stats=stats)
    figures = checkpoint.digest.figures()
    return Run(job=job, state=snapshot_json(checkpoint.fold.state), records=figures,
               source={"kind": "history", "where": str(path), "skipped": stats.rejected,
                       "digest": {"exact": figures.exact, "records_folded": stats.records}})
