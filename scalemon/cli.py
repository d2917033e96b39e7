"""The `scalemon` command."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from scalemon import __version__, display, protocol
from scalemon.jobs import (
    JobFile,
    JobLookupError,
    hub_gone_text,
    node_name,
    resolve_hub,
    serving_jobs,
)
from scalemon.safe_text import clean, clean_output


def _offline_state(job: str) -> dict[str, Any] | None:
    """The state replayed from a job's history file, when its hub is gone."""
    from scalemon.fold import JobFold
    from scalemon.history import earlier_loss_text, history_path, read_messages

    path = history_path(job)
    if not path.exists():
        return None
    fold = JobFold(job=job)  # as the hub folds (compute times for `stragglers` too)
    messages, rejected = read_messages(path, job)
    for seq, msg in messages:
        fold.apply(seq, msg)
    out = fold.state.to_json()
    loss = earlier_loss_text(path)  # what its last hub could not write (a full disk)
    if loss:
        out["hub_notes"] = [*(out.get("hub_notes") or []), {"t": time.time(), "kind": "history",
                                                           "text": loss}]
    return {"state": out, "hub": None, "source": str(path), "rejected": rejected}


def cmd_snapshot(args: argparse.Namespace) -> int:
    """Print the job's state (JSON with --json)."""
    from scalemon.client import HubClient, HubUnreachable, hub_key_problem

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
    if args.json:  # strict JSON: NaN and infinities as null (docs/protocol.md 9.3)
        from scalemon.export import plain

        print(json.dumps(plain(out), indent=1, allow_nan=False))
    else:
        print(format_snapshot(out))
    return 0


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return display.NA
    return format(value, spec) if spec else str(value)


def _frame_cell(key: str, rank: dict[str, Any]) -> str:
    if key == "state":
        reason = rank.get("state_reason")
        text = rank["state"] + (f" ({reason})" if reason and reason != rank["state"] else "")
        text += ", peer lost" if rank.get("peer_loss") else ""
        text += f"; monitor off: {rank['monitor_off']}" if rank.get("monitor_off") else ""
        alerts = rank.get("alerts") or []
        return text + "".join(f"; ALERT: {a['text']}" for a in alerts)
    return _fmt(rank.get(key))


def format_snapshot(state: dict[str, Any], width: int = 60) -> str:
    """A plain-text table of the snapshot for people: a row per rank with the columns of the
    dashboard (but those only a dashboard computes), then each rank's `extra` values and the
    run's `info` facts, one line each, cut at `width` characters of value."""
    lines = [
        f"job {state['job']}  world size {_fmt(state['world_size'])}  state "
        f"{'HUNG' if state.get('hang') else state['state']}"
        f"  messages {state['messages']}",
    ]
    if state.get("stop") and state["state"] in ("stopped", "stopping"):
        stop = state["stop"]
        who = f" by {stop['user']}@{stop['host']}" if stop.get("user") else ""
        lines.append(f"{state['state']}: the user asked{who}"
                     + (f" ({stop['reason']})" if stop.get("reason") else ""))
    if state.get("first_failure"):
        lines.append(state["first_failure"]["text"])
    lines.extend(f"ALERT: {a['text']}" for a in state.get("alerts") or [])
    if len(state["ranks"]) >= display.AGGREGATE_AT:  # a line per node, not per rank
        lines.extend(display.node_snapshot_lines(state["ranks"], width))
    else:
        lines.extend(_rank_lines(state["ranks"], width))
    lines.extend(_info_lines(state, width))
    return "\n".join(lines)


def _rank_lines(ranks: list[dict[str, Any]], width: int) -> list[str]:
    """A row per rank, then each rank's `extra` values."""
    lines: list[str] = []
    columns = display.rank_columns(dashboard=False)
    cells = []
    for rank in ranks:
        values = display.snapshot_values(rank)
        cells.append([clean(display.metric_text(c.metric, values) if c.metric else
                            _frame_cell(c.key, rank), one_line=True) for c in columns])
    widths = [max([len(c.heading)] + [len(row[i]) for row in cells if c.key != "state"])
              for i, c in enumerate(columns)]
    state_at = [c.key for c in columns].index("state")
    widths[state_at] = len("state")  # the state goes last on its row, reasons can be long

    def line(texts: list[str]) -> str:
        out = [t.ljust(w) if c.align_left else t.rjust(w)
               for c, t, w in zip(columns, texts, widths, strict=True) if c.key != "state"]
        return " ".join(out) + "  " + texts[state_at]

    lines.append(line([c.heading for c in columns]))
    lines.extend(line(row) for row in cells)
    for rank in ranks:
        if rank.get("extra"):
            text = _short(display.flat_text(rank["extra"]), width)
            lines.append(f"rank {rank['rank']} extra: {text}")
    return lines


def _info_lines(state: dict[str, Any], width: int) -> list[str]:
    """The run's info facts, hub notes, flag mismatches, toggles, collectives, the hang."""
    lines: list[str] = []
    for key, by_rank in sorted(state.get("info", {}).items()):
        if key in ("fr_dump", "nccl_ras"):
            continue  # shown with the hang
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
        from scalemon.flagstate import toggle_line

        lines.extend("toggle " + toggle_line(t) for t in state["toggles"][-5:])
    lines.extend(_collectives_lines(state.get("collectives") or []))
    lines.extend(_hang_lines(state.get("hang")))
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


def _hang_lines(hang: dict[str, Any] | None) -> list[str]:
    """The hang in words, then each rank's stack (innermost call last)."""
    if not hang:
        return []
    out = [f"HUNG: {hang['text']}"]
    for cause in hang.get("causes") or ():  # culprits with their cause, phase and frame
        out.append(f"  {'culprit' if cause['culprit'] else 'stuck'}  {cause['text']}"
                   f"  [phase {cause['phase'] or display.NA}]")
    for wait in hang.get("waits") or ():
        if not wait["culprit"]:
            out.append(f"  waiting  {wait['text']}")
    for chain in (hang.get("chains") or ())[:8]:
        if len(chain) > 2:
            out.append("  waits for: " + " -> ".join(str(r) for r in chain))
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


def cmd_jobs(args: argparse.Namespace) -> int:
    """List the jobs whose hubs serve: live ones, and ended ones while their hub lingers."""
    if args.connect:
        from scalemon.cli_connect import print_connect

        return print_connect(args.connect)
    try:
        jobs = serving_jobs()
    except JobLookupError as exc:  # job files not to be trusted
        print(f"scalemon jobs: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{**j.__dict__, "live": j.state == "running"} for j in jobs],
                         indent=1))
        return 0
    if not jobs:
        print("no live scalemon hubs")
    width = max((len(j.job) for j in jobs), default=0)
    states = max((len(j.state) for j in jobs), default=0)
    for j in jobs:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.started))
        address = j.hub_address()
        where = address.base + (" (CurveZMQ)" if address.rpc.startswith("tcp://") else "")
        print(f"{j.job:<{width}}  {j.state:<{states}}  world size {_fmt(j.world_size)}  hub pid "
              f"{j.pid} on {j.host}  since {started}{_ended_text(j)}  {where}{_reachability(j)}")
    return 0


def _ended_text(job: JobFile) -> str:
    """"  ended 12:03:04, hub lingers" for an ended job whose hub still serves it."""
    if job.state == "running":
        return ""
    when = time.strftime("%H:%M:%S", time.localtime(job.ended)) if job.ended else "?"
    return f"  ended {when}, hub lingers"


def _reachability(job: JobFile) -> str:
    """"" for a hub of this node or one that answers a ping within a second; else why not."""
    if job.host == node_name():
        return ""
    from scalemon.client import HubClient, HubUnreachable

    client = HubClient(job.hub_address(), timeout_s=1.0)
    try:
        client.request("ping")
        return ""
    except (HubUnreachable, ValueError) as exc:
        return f"\n  unreachable from here: {exc}"
    finally:
        client.close()


def cmd_hub(args: argparse.Namespace) -> int:
    """Run a hub in the foreground."""
    from scalemon.hub.main import run

    return run(args)


def cmd_attach(args: argparse.Namespace) -> int:
    """Open the dashboard on a job."""
    from scalemon.tui.attach import attach

    return attach(args.target, stats_path=args.stats_json, hang_after_s=args.hang_after,
                  wait_s=args.wait)


def cmd_demo(args: argparse.Namespace) -> int:
    """Start the monitored demo job and open the dashboard on it."""
    from scalemon.cli_demo import demo

    return demo(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `scalemon`."""
    from scalemon.hub.main import add_arguments as add_hub_arguments
    from scalemon.options import ENVIRONMENT, Parser, add_query_arguments, job_id, seconds

    parser = Parser(
        prog="scalemon",
        description="Terminal monitor for distributed PyTorch training. "
                    "`scalemon COMMAND --help` tells more about each command.",
        epilog=ENVIRONMENT,
    )
    parser.add_argument("--version", action="version", version=f"scalemon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    snap = sub.add_parser(
        "snapshot", help="print the current state of a job",
        description="Print the current state of a job: a row per rank, its extras, flags, "
                    "collectives and hang. With the job's hub gone, replay its history file.")
    add_query_arguments(snap)
    snap.set_defaults(func=cmd_snapshot)

    jobs = sub.add_parser("jobs", help="list live jobs (hubs) of this user",
                          description="List the jobs of this user under $SCALEMON_HOME whose "
                                      "hubs serve: job id, state (running, or how an ended "
                                      "job ended while its hub lingers), world size, hub pid "
                                      "and address.")
    jobs.add_argument("--json", action="store_true", help="machine-readable JSON")
    jobs.add_argument("--connect", type=job_id, metavar="JOB",
                      help="print one command line that attaches to JOB's hub over tcp from "
                           "another machine (no shared SCALEMON_HOME needed)")
    jobs.set_defaults(func=cmd_jobs)

    attach = sub.add_parser(
        "attach", help="open the dashboard on a job",
        description="Open the dashboard on a job: its live hub, else its history file. A job "
                    "that is not there yet is waited for (--wait), with a countdown.")
    attach.add_argument("target", nargs="?",
                        help="job id or hub address (default: the live job, or pick from a list)")
    attach.add_argument("--wait", type=seconds(0.0), default=30.0, metavar="S",
                        help="wait up to S seconds for the job's hub (without TARGET: for a "
                             "live job) to appear; 0 does not wait")
    attach.add_argument("--hang-after", type=seconds(0.0, above=True), metavar="S",
                        help="call the job hung after S seconds without a completed step "
                             "(default: the hub's; without a hub $SCALEMON_HANG_AFTER, else "
                             "10)")
    attach.add_argument("--stats-json", type=Path, metavar="PATH",
                        help="on exit, write redraw times and message counts here (benchmarks)")
    attach.set_defaults(func=cmd_attach)

    demo = sub.add_parser(
        "demo", help="run a monitored 2-rank demo job and open the dashboard",
        description="Run the demo trainer under torchrun with the monitor on (CPU ranks with "
                    "gloo unless there is a GPU per rank) and open the dashboard on it. q "
                    "stops the job and its hub. Exit status: 0, or the job's when it failed "
                    "by itself (1 when a signal killed it); 2 for bad options.")
    from scalemon.cli_demo import add_arguments as add_demo_arguments

    add_demo_arguments(demo)
    demo.set_defaults(func=cmd_demo)

    from scalemon.cli_flags import add_parsers as add_flag_parsers

    add_flag_parsers(sub)

    from scalemon.cli_dump import add_parser as add_dump_parser

    add_dump_parser(sub)

    from scalemon.cli_export import add_parser as add_export_parser

    add_export_parser(sub)

    from scalemon.cli_keys import add_parsers as add_key_parsers

    add_key_parsers(sub)

    from scalemon.cli_summary import add_parsers as add_summary_parsers

    add_summary_parsers(sub)

    hub = sub.add_parser(
        "hub", help="run a job's hub (ranks start one by themselves)",
        description="Run a job's hub in the foreground: it collects the ranks' messages, keeps "
                    "the history and serves dashboards. Rank 0 starts one by itself unless "
                    "SCALEMON_HUB names one.")
    add_hub_arguments(hub)
    hub.set_defaults(func=cmd_hub)
    return parser


STDOUT_CLOSED = 128 + 13
"""The exit status when whoever read stdout left (`scalemon snapshot | head -1`): what a
shell reports for a command that SIGPIPE ended."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `scalemon` console script."""
    from scalemon.cli_keys import key_last

    try:
        args = build_parser().parse_args(  # --help writes too
            key_last(sys.argv[1:] if argv is None else argv))
        if args.func in (cmd_attach, cmd_demo, cmd_hub):  # the dashboard draws; the hub logs
            return args.func(args)
        with clean_output():  # a rank's text (host, error, value) shows its control characters
            code = args.func(args)
            sys.stdout.flush()  # now, where a reader that left is caught, not at exit
            return code
    except BrokenPipeError:  # the reader of stdout left: stop quietly, as `cat` would
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # what is still buffered goes nowhere at exit
        return STDOUT_CLOSED


if __name__ == "__main__":
    sys.exit(main())
