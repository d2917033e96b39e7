"""`python -m scalemon.relay --job ID`: run this node's relay in the foreground (the agent of
the node's local rank 0 starts it in the background)."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

from scalemon import settings
from scalemon.home.paths import relay_dir
from scalemon.options import Parser, job_id, seconds
from scalemon.text.safe import CleanStream

from . import __doc__ as ABOUT
from .forward import Relay, RelayAlreadyRunning


def install_signal_handlers(relay: Relay) -> None:
    """SIGTERM/SIGINT stop the relay cleanly."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: relay.stop())


def main(argv: list[str] | None = None) -> int:
    """Run this node's relay for `--job` until its ranks went silent, or SIGTERM/SIGINT."""
    parser = Parser(prog="scalemon relay", description=ABOUT)
    parser.add_argument("--job", required=True, type=job_id, metavar="ID", help="job id")
    parser.add_argument("--home", type=Path, metavar="DIR",
                        help="scalemon home holding jobs/ and keys/ (default: $SCALEMON_HOME)")
    parser.add_argument("--hub", default=settings.raw("SCALEMON_HUB"),
                        metavar="tcp://HOST:PORT",
                        help="the hub's address (default: $SCALEMON_HUB, else the job file)")
    parser.add_argument("--linger", type=seconds(0.0, above=True), default=60.0, metavar="S",
                        help="exit once no rank of this node spoke for S seconds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,  # control characters of ranks' text shown
                        format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=CleanStream(sys.stderr))
    try:
        relay = Relay(args.job, relay_dir(args.job), home=args.home, hub=args.hub,
                      linger_s=args.linger)
    except (RelayAlreadyRunning, ValueError, OSError) as exc:
        print(f"scalemon relay: {exc}", file=sys.stderr)
        return 2
    install_signal_handlers(relay)
    relay.serve_forever()
    return 0
