"""`scalemon dump`: every rank's Flight Recorder, and which rank holds up which group."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from scalemon import protocol
from scalemon.home.lookup import JobLookupError, resolve_hub
from scalemon.link.client import HubUnreachable
from scalemon.link.control import ControlError, Controller
from scalemon.options import seconds
from scalemon.reports import frtrace

EXIT_NO_HUB = 2
EXIT_NO_DUMP = 1
POLL_S = 0.5


def add_parser(sub: Any) -> None:
    """Add the `dump` command to the `scalemon` parser."""
    dump = sub.add_parser(
        "dump", help="ask every rank for its Flight Recorder and say who holds up whom",
        description="Ask every rank of a running job for its Flight Recorder (through the "
                    "job's hub, on this machine), read the dumps and print per process group "
                    "each rank's last issued and completed collective, mismatches between "
                    "ranks (op, dtypes, sizes at the same sequence number) and the culprit, "
                    "by the rules of the dashboard's hang view. A rank that gives no dump is "
                    "named with the reason. --dir analyses a directory of dumps instead "
                    "(scalemon's, or torch's own from TORCH_FR_DUMP_TEMP_FILE). Exit status: "
                    "0 with an analysis, 1 no rank gave a dump, 2 no hub or job.")
    dump.add_argument("target", nargs="?",
                      help="job id or hub address (default: the live job)")
    dump.add_argument("--dir", type=Path, metavar="PATH",
                      help="analyse the dumps in PATH (files <prefix><rank>, e.g. rank_0 or "
                           "nccl_trace_rank_0) instead of asking a job")
    dump.add_argument("--json", action="store_true", help="machine-readable JSON")
    dump.add_argument("--timeout", type=seconds(0.0, above=True), default=60.0, metavar="S",
                      help="seconds to wait for the dumps and their analysis (the hub waits up "
                           "to 15 s for the ranks)")
    dump.set_defaults(func=cmd_dump)


def cmd_dump(args: argparse.Namespace) -> int:
    """Dump and analyse a job's recorders (or a directory of dumps); print the analysis."""
    if args.dir is not None:
        if args.target:
            return _fail("give a job or --dir PATH, not both", EXIT_NO_HUB)
        return _offline(args.dir, args.json)
    try:
        job, address = resolve_hub(args.target)
        control = Controller(address, timeout_s=min(args.timeout, 10.0))
    except (JobLookupError, ValueError, ControlError) as exc:
        return _fail(str(exc), EXIT_NO_HUB)
    try:
        return _ask(control, job, args)
    finally:
        control.close()


def _ask(control: Controller, job: str, args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.timeout
    try:
        reply = control.command("dump_fr")
    except (HubUnreachable, protocol.ProtocolError) as exc:
        return _fail(str(exc), EXIT_NO_HUB)
    directory = str(reply["directory"])
    if reply.get("note"):
        print(f"scalemon dump: {reply['note']}; waiting for it", file=sys.stderr)
    body = None
    while time.monotonic() < deadline:
        try:
            state = control.client.state()["state"]
        except HubUnreachable:  # busy: its deadline decides
            continue
        except protocol.ProtocolError as exc:
            return _fail(str(exc), EXIT_NO_HUB)
        body = next((d for d in reversed(state.get("fr_dumps") or ())
                     if d.get("directory") == directory), None)
        if body is not None and body.get("state") == "analysed":
            break
        time.sleep(POLL_S)
    else:
        return _fail(f"no analysis of {directory} within {args.timeout:g} s "
                     "(--timeout S waits longer)", EXIT_NO_DUMP)
    report = body.get("report")
    if report is None or report.get("cut"):  # the complete one is next to the dumps
        report = _read_analysis(Path(directory)) or report
    if report is None:
        return _fail(body.get("analysis") or f"no analysis of {directory}", EXIT_NO_DUMP)
    return _show({"job": job, **report}, args.json)


def _read_analysis(directory: Path) -> dict[str, Any] | None:
    try:
        value = json.loads((directory / frtrace.ANALYSIS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _offline(directory: Path, as_json: bool) -> int:
    if not directory.is_dir():
        return _fail(f"{directory} is not a directory", EXIT_NO_HUB)
    progress = ReadProgress(sys.stderr) if sys.stderr.isatty() else None
    notes: list[str] = []  # how the ranks were read (their summaries): after the progress
    try:
        report = frtrace.analyse_directory(directory, progress=progress, say=notes.append)
    except OSError as exc:
        return _fail(f"cannot read {directory}: {exc.strerror or exc}", EXIT_NO_HUB)
    finally:
        if progress is not None:
            progress.clear()
    for note in notes:
        print(f"scalemon dump: {note}", file=sys.stderr)
    if not report["read"] and not report["missing"]:
        return _fail(f"no Flight Recorder dump in {directory} (files named <prefix><rank>, "
                     "e.g. rank_0)", EXIT_NO_DUMP)
    return _show(report, as_json)


class ReadProgress:
    """How far the reading of a directory's dumps is, on one line of a terminal rewritten in
    place ("read 1024/4096 ranks (25%), 7 s") at most every `EVERY_S`; `clear()` removes it.
    Given to the analysis only where stderr is a terminal: a pipe (the hub) gets nothing."""

    EVERY_S = 0.25

    def __init__(self, out: TextIO) -> None:
        self.out, self.start, self.shown, self.width = out, time.monotonic(), 0.0, 0

    def __call__(self, read: int, total: int) -> None:
        now = time.monotonic()
        if now - self.shown < self.EVERY_S and read < total:
            return
        self.shown = now
        line = (f"scalemon dump: read {read}/{total} ranks ({100 * read // max(total, 1)}%), "
                f"{now - self.start:.0f} s" + (", analysing" if read == total else ""))
        self.out.write("\r" + line.ljust(self.width))
        self.out.flush()
        self.width = len(line)

    def clear(self) -> None:
        if self.width:
            self.out.write("\r" + " " * self.width + "\r")
            self.out.flush()
            self.width = 0


def _show(report: dict[str, Any], as_json: bool) -> int:
    """Print the analysis; each rank that gave nothing also as a line on stderr."""
    for rank, why in (report.get("missing") or {}).items():
        print(f"scalemon dump: rank {rank} gave no dump: {why}", file=sys.stderr)
    for rank, why in (report.get("problems") or {}).items():
        print(f"scalemon dump: rank {rank}: part of its dump was not read: {why}",
              file=sys.stderr)
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        print(frtrace.report_text(report))
    if not report.get("read"):
        return _fail("no rank gave a readable dump", EXIT_NO_DUMP)
    return 0


def _fail(text: str, code: int) -> int:
    print(f"scalemon dump: {text}", file=sys.stderr)
    return code
