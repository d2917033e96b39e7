"""`scalemon export`: a job's history as a Perfetto (Chrome JSON) trace and as JSON lines."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from scalemon import protocol
from scalemon.home.lookup import JobLookupError, resolve_hub
from scalemon.options import seconds
from scalemon.protocol import Message
from scalemon.reports import export

EXIT_NO_JOB = 2


def add_parser(sub: Any) -> None:
    """Add the `export` command to the `scalemon` parser."""
    cmd = sub.add_parser(
        "export", help="write a job's history as a Perfetto trace or JSON lines",
        description="Write the whole history of a job (live: from its hub; ended: from its "
                    "history file) as a trace for Perfetto (ui.perfetto.dev, chrome://tracing: "
                    "a process per rank with its steps, optimizer, all-reduce and collective "
                    "slices, and arrows linking each collective across ranks) and/or as JSON "
                    "lines, one history record a line (docs/protocol.md, 'scalemon export'). "
                    "FILE - writes to stdout. Exit status: 0, 2 no such job or a file that "
                    "cannot be written.")
    cmd.add_argument("target", help="job id or hub address")
    cmd.add_argument("--perfetto", type=Path, metavar="FILE",
                     help="write the Chrome trace JSON (Trace Event Format) here")
    cmd.add_argument("--jsonl", type=Path, metavar="FILE",
                     help="write every history record as one JSON object a line here")
    cmd.add_argument("--timeout", type=seconds(0.0, above=True), default=10.0, metavar="S",
                     help="seconds to wait for each page of the history from a live hub")
    cmd.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """Fetch the job's records and write the files asked for."""
    if args.perfetto is None and args.jsonl is None:
        return _fail("say what to write: --perfetto FILE and/or --jsonl FILE")
    if args.perfetto is not None and args.jsonl is not None and \
            str(args.perfetto) == str(args.jsonl):
        return _fail("--perfetto and --jsonl name the same file; give two")
    try:
        job, records, source = load_records(args.target, args.timeout)
    except (JobLookupError, ValueError, OSError) as exc:
        return _fail(str(exc))
    steps = sum(1 for _, m in records if m.type == "step")
    ranks = len({m.rank for _, m in records if m.rank != protocol.HUB_RANK})
    target = args.perfetto
    try:
        if args.perfetto is not None:
            doc = export.trace(records, job)
            _write(args.perfetto, [json.dumps(doc, allow_nan=False, separators=(",", ":"))])
            _say(f"wrote the trace of {ranks} rank(s), {steps} step message(s) to "
                 f"{_name(args.perfetto)}")
        target = args.jsonl
        if args.jsonl is not None:
            _write(args.jsonl, export.jsonl_lines(records))
            _say(f"wrote {len(records)} record(s) to {_name(args.jsonl)}")
    except BrokenPipeError:
        raise  # the reader of stdout left: `scalemon` ends quietly
    except OSError as exc:
        return _fail(f"cannot write {target}: {exc.strerror or exc}")
    _say(f"(from {source})")
    return 0


def load_records(target: str, timeout_s: float
                 ) -> tuple[str, list[tuple[int, Message]], str]:
    """(job, every history record as (number, message), where they came from): from the
    job's live hub, else (a job id whose hub is gone) from its history file. Raises
    JobLookupError, ValueError or OSError with what is wrong."""
    from scalemon.link.client import HubClient, HubUnreachable, hub_key_problem

    problem = ""
    try:
        job, address = resolve_hub(target)
        if missing := hub_key_problem(address):
            raise JobLookupError(missing)
        client = HubClient(address, timeout_s=timeout_s)
        try:
            return job, fetch_all(client), address.base
        finally:
            client.close()
    except (JobLookupError, HubUnreachable, protocol.ProtocolError) as exc:
        if "://" in target:
            raise JobLookupError(str(exc)) from None
        problem = str(exc)
    from scalemon.home.history import history_path, read_messages

    path = history_path(target)  # ValueError for a bad job id
    if not path.exists():
        raise JobLookupError(f"{problem}; and no history file {path}")
    messages, rejected = read_messages(path, target)
    if rejected:
        _say(f"{rejected} damaged stretch(es) or invalid records of {path} skipped")
    return target, messages, str(path)


def fetch_all(client: Any) -> list[tuple[int, Message]]:
    """Page the hub's whole history in (`HubClient.fetch`), as it stands now."""
    out: list[tuple[int, Message]] = []
    since = 0
    while True:
        records, head = client.fetch(since)
        for i, frame in enumerate(records):
            try:
                out.append((since + i, protocol.decode_stored(frame)))
            except protocol.ProtocolError:
                continue
        since += len(records)
        if not records or since >= head:
            return out


def _write(path: Path, chunks: Iterable[str]) -> None:
    """Write `chunks` one a line, to stdout for -, else through a temporary file renamed
    into place (a reader never sees half a file)."""
    if str(path) == "-":
        for chunk in chunks:
            sys.stdout.write(chunk + "\n")
        return
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            for chunk in chunks:
                f.write(chunk + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _name(path: Path) -> str:
    return "stdout" if str(path) == "-" else str(path)


def _say(text: str) -> None:
    print(f"scalemon export: {text}", file=sys.stderr)


def _fail(text: str) -> int:
    _say(text)
    return EXIT_NO_JOB
