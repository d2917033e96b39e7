"""`scalemon stacks`: every rank's stacks, read from outside its process (py-spy, by the job's
hub for the ranks on its host and by each node's relay for the others), live ranks included."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from scalemon import protocol
from scalemon.home.lookup import JobLookupError, resolve_hub
from scalemon.link.client import HubUnreachable
from scalemon.link.control import ControlError, Controller
from scalemon.options import seconds
from scalemon.proc.stacks import StackReading, format_stacks

EXIT_NO_HUB = 2
EXIT_NO_STACKS = 1
POLL_S = 0.3


def add_parser(sub: Any) -> None:
    """Add the `stacks` command to the `scalemon` parser."""
    stacks = sub.add_parser(
        "stacks", help="print every rank's stacks, read from outside its process",
        description="Ask the job's hub to read the stacks of its ranks from outside their "
                    "processes (py-spy; the hub reads those on its host, each node's relay "
                    "those on its node), every thread, and print them, innermost call first. "
                    "Works for a rank frozen in native code holding the GIL, where no Python "
                    "thread of the rank can answer. Each rank is paused while it is read "
                    "(some 0.1 s; --native takes longer). Exit status: 0 stacks of every rank "
                    "asked, 1 some rank's stacks could not be read (the reason is printed), 2 "
                    "no hub or job.")
    stacks.add_argument("target", nargs="?", help="job id or hub address (default: the live job)")
    stacks.add_argument("--rank", type=int, action="append", metavar="R",
                        help="only rank R (repeat for more; default: every rank)")
    stacks.add_argument("--native", action="store_true",
                        help="show native (C/C++) frames too, not only Python's")
    stacks.add_argument("--json", action="store_true", help="machine-readable JSON")
    stacks.add_argument("--timeout", type=seconds(0.0, above=True), default=60.0, metavar="S",
                        help="seconds to wait for the readings (default 60)")
    stacks.set_defaults(func=cmd_stacks)


def cmd_stacks(args: argparse.Namespace) -> int:
    """Read and print the job's ranks' stacks."""
    try:
        job, address = resolve_hub(args.target)
        control = Controller(address, timeout_s=min(args.timeout, 10.0))
    except (JobLookupError, ValueError, ControlError) as exc:
        return _fail(str(exc), EXIT_NO_HUB)
    try:
        reply = _read(control, args.rank or [], args.native, args.timeout)
    except (HubUnreachable, protocol.ProtocolError) as exc:
        return _fail(str(exc), EXIT_NO_HUB)
    finally:
        control.close()
    if reply.get("note"):
        print(f"scalemon stacks: {reply['note']}", file=sys.stderr)
    ranks = reply.get("ranks") or {}
    if args.json:
        print(json.dumps({"job": job, "ranks": ranks}, indent=1))
    else:
        print(stacks_text(ranks, args.native))
    failed = [r for r, got in ranks.items() if not _readable(got)]
    if not ranks:
        return _fail("the hub knows no rank of this job yet", EXIT_NO_STACKS)
    return EXIT_NO_STACKS if failed else 0


def _read(control: Controller, ranks: list[int], native: bool,
          timeout_s: float) -> dict[str, Any]:
    """Start the reading and ask for its progress until it is done or `timeout_s` ran out;
    each answer brings the ranks read since the one before."""
    deadline = time.monotonic() + timeout_s
    reply = control.client.request("stacks", ranks=ranks, native=native, id=0)
    note, got = reply.get("note"), dict(reply.get("ranks") or {})
    while not reply.get("done") and time.monotonic() < deadline:
        if not reply.get("ranks"):
            time.sleep(POLL_S)
        reply = control.client.request("stacks", ranks=ranks, native=native, id=reply["id"])
        got.update(reply.get("ranks") or {})
    if not reply.get("done"):
        for rank in reply.get("pending") or ():
            got[str(rank)] = {"error": f"not read within {timeout_s:g} s (--timeout S "
                                       "waits longer)"}
    return {"ranks": got, "note": note}


def _readable(got: dict[str, Any]) -> bool:
    reading = got.get("reading")
    return isinstance(reading, dict) and not StackReading.from_wire(reading).error


def stacks_text(ranks: dict[str, dict[str, Any]], native: bool) -> str:
    """Each rank's stacks under a heading line with who read them and what its process does,
    or the reason it has none; ranks in order."""
    out = []
    for key in sorted(ranks, key=lambda k: int(k) if k.lstrip("-").isdigit() else 0):
        got = ranks[key]
        process = got.get("process") or {}
        how = process.get("state_word")
        head = f"rank {key}"
        if got.get("pid"):
            head += f" (pid {got['pid']}"
            head += f", {how})" if how else ")"
        if got.get("reader"):
            head += f", read by the {got['reader']}"
        out.append(head)
        if got.get("error"):
            out.append(f"  no stacks: {got['error']}")
        elif isinstance(got.get("reading"), dict):
            reading = StackReading.from_wire(got["reading"])
            if reading.error:
                out.append(f"  no stacks: {reading.error}")
            else:
                if got.get("where"):
                    out.append(f"  {got['where']}")
                out.extend("  " + line for line in format_stacks(reading, native).splitlines())
        elif process and not process.get("exists", True):
            out.append("  no stacks: its process has ended")
        out.append("")
    return "\n".join(out).rstrip("\n")


def _fail(text: str, code: int) -> int:
    print(f"scalemon stacks: {text}", file=sys.stderr)
    return code
