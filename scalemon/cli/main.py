"""The `scalemon` command: its parser, one subcommand per module of this package, and `main`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from scalemon import __version__, settings
from scalemon.cli.jobs import cmd_jobs
from scalemon.cli.snapshot import cmd_snapshot
from scalemon.text.safe import clean_output


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
    from scalemon.cli.demo import demo

    return demo(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `scalemon`."""
    from scalemon.hub.main import add_arguments as add_hub_arguments
    from scalemon.options import Parser, add_query_arguments, job_id, seconds

    parser = Parser(
        prog="scalemon",
        description="Terminal monitor for distributed PyTorch training. "
                    "`scalemon COMMAND --help` tells more about each command.",
        epilog=settings.help_text(),
    )
    parser.add_argument("--version", action="version", version=f"scalemon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    snap = sub.add_parser(
        "snapshot", help="print the current state of a job",
        description="Print the current state of a job: a row per rank, its extras, flags, "
                    "collectives and hang. With the job's hub gone, replay its history file.")
    add_query_arguments(snap)
    snap.add_argument("--group-by", metavar="AXIS",
                      help="group the rank table by this axis of the job's device mesh (pp, "
                           "dp, tp, ... as the script named them): a heading per coordinate, "
                           "its ranks under it")
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
                             "live job) to appear; 0 does not wait, nor does a dashboard "
                             "that is refused (no terminal, or in its background)")
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
                    "by itself (1 when a signal killed it); 2 for bad options, or without a "
                    "terminal (stdin and stderr; stdout may be redirected) for the dashboard. "
                    "Ctrl-C while it stops the job says how long is left instead of "
                    "cutting the stop short.")
    from scalemon.cli.demo import add_arguments as add_demo_arguments

    add_demo_arguments(demo)
    demo.set_defaults(func=cmd_demo)

    from scalemon.cli.flags import add_parsers as add_flag_parsers

    add_flag_parsers(sub)

    from scalemon.cli.dump import add_parser as add_dump_parser

    add_dump_parser(sub)

    from scalemon.cli.stacks import add_parser as add_stacks_parser

    add_stacks_parser(sub)

    from scalemon.cli.export import add_parser as add_export_parser

    add_export_parser(sub)

    from scalemon.cli.keys import add_parsers as add_key_parsers

    add_key_parsers(sub)

    from scalemon.cli.summary import add_parsers as add_summary_parsers

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
    from scalemon.cli.keys import key_last

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
