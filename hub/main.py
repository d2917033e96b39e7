"""`scalemon hub`: run a job's hub in the foreground (the agent starts one by itself)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from scalemon import settings
from scalemon.options import Parser, int_at_least, job_id, seconds
from scalemon.protocol import check_job_id
from scalemon.text.safe import CleanStream, clean

from . import METRICS_ENV, METRICS_FILE_ENV


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `scalemon hub`."""
    parser.add_argument("--job", required=True, type=job_id, metavar="ID",
                        help="job id (what the ranks report)")
    parser.add_argument("--home", type=Path, metavar="DIR",
                        help="scalemon home (default: $SCALEMON_HOME)")
    parser.add_argument(
        "--address",
        help="bind here instead of the job's private ipc directory (ipc:///dir or tcp://host:port)",
    )
    parser.add_argument(
        "--listen", metavar="tcp://HOST:PORT", default=settings.raw("SCALEMON_LISTEN"),
        help="also listen on TCP, always with CurveZMQ, admitting the keys in "
             "$SCALEMON_HOME/keys/authorized (port 0: free ports; default: $SCALEMON_LISTEN)",
    )
    parser.add_argument("--world-size", type=int_at_least(1), metavar="N",
                        help="expected number of ranks")
    parser.add_argument(
        "--lost-after", type=seconds(0.0, above=True), default=5.0, metavar="S",
        help="after S seconds without a message from a rank, find out why: frozen (its "
             "process exists; its stacks are read), gone, unreachable or silent",
    )
    parser.add_argument(
        "--hang-after", type=seconds(0.0, above=True), default=settings.hang_after_s(),
        metavar="S", help="the job is hung when no rank completed a step for S seconds "
        "(default: $SCALEMON_HANG_AFTER, else 10); the ranks' agents use the same (they send "
        "their stacks once stuck that long)",
    )
    parser.add_argument(
        "--linger", type=seconds(0.0), default=600.0, metavar="S",
        help="stay up S seconds after the job ended so its final state can be read",
    )
    parser.add_argument(
        "--memory-limit", type=int_at_least(1), default=1_000_000, metavar="N",
        help="records kept in memory; older ones are read back from the history file",
    )
    parser.add_argument(
        "--metrics", metavar="HOST:PORT",
        help="serve OpenMetrics (Prometheus) on http://HOST:PORT/metrics; :PORT alone is "
             "127.0.0.1, port 0 any free port (the URL is in the job file); default: "
             f"${METRICS_ENV}, else off",
    )
    parser.add_argument(
        "--metrics-file", metavar="PATH",
        help="write the same metrics to PATH every 5 s, atomically, for node_exporter's "
             f"textfile collector (name it *.prom); default: ${METRICS_FILE_ENV}, else off",
    )


def run(args: argparse.Namespace) -> int:
    """Run the hub until the job ended and lingered, or SIGTERM/SIGINT."""
    from .openmetrics import start_exporter
    from .server import Hub, HubAlreadyRunning, install_signal_handlers

    logging.basicConfig(  # log lines can quote a rank's text: its control characters shown
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=CleanStream(sys.stderr),
    )
    try:
        check_job_id(args.job)
        hub = Hub(
            job=args.job, home=args.home, address=args.address, world_size=args.world_size,
            lost_after_s=args.lost_after, linger_s=args.linger, memory_limit=args.memory_limit,
            hang_after_s=args.hang_after, listen=args.listen,
        )
        # from the options: an error stops the hub; from the environment (an auto-started
        # hub): logged, and the hub serves on without metrics
        hub.exporter = start_exporter(args.job, args.metrics, args.metrics_file)
    except (HubAlreadyRunning, ValueError, OSError) as exc:
        print(f"scalemon hub: {clean(str(exc))}", file=sys.stderr)
        return 2
    if hub.exporter is not None:  # served from the first scrape on, before the loop runs
        hub.exporter.update(hub.state, time.monotonic(), force=True)
    install_signal_handlers(hub)
    hub.serve_forever()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m scalemon.hub`."""
    parser = Parser(prog="scalemon hub", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
