"""The `scalemon` command."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from scalemon import __version__, protocol
from scalemon.jobs import JobLookupError, live_jobs, resolve_hub, run_dir
from scalemon.jobstate import JobState


def _json_safe(value: Any) -> Any:
    """NaN/inf and bytes become strings, keys strings, so the output is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _offline_state(job: str) -> dict[str, Any] | None:
    """The state replayed from a job's history file, when its hub is gone."""
    from scalemon.hub.history import read_messages

    path = run_dir(job) / "history.smlog"
    if not path.exists():
        return None
    state = JobState(job=job)
    for _, msg in read_messages(path)[0]:
        state.apply(msg)
    return {"state": state.to_json(), "hub": None, "source": str(path)}


def cmd_snapshot(args: argparse.Namespace) -> int:
    """Print the job's state (JSON with --json)."""
    from scalemon.client import HubClient, HubUnreachable

    job = args.target
    try:
        job, address = resolve_hub(args.target)
        reply = HubClient(address, timeout_s=args.timeout).state()
        reply["source"] = address.base
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
        print(f"scalemon snapshot: hub not reachable ({problem.split(':')[0]}), "
              f"replaying {reply['source']}", file=sys.stderr)
    out = {**reply["state"], "hub": reply.get("hub"), "source": reply.get("source")}
    if args.json:
        print(json.dumps(_json_safe(out), indent=1))
    else:
        print(format_snapshot(out))
    return 0


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "n/a"
    return format(value, spec) if spec else str(value)


def format_snapshot(state: dict[str, Any]) -> str:
    """A plain-text table of the snapshot for people."""
    lines = [
        f"job {state['job']}  world size {_fmt(state['world_size'])}  state {state['state']}"
        f"  messages {state['messages']}",
        f"{'rank':>4} {'host':<16} {'step':>7} {'loss':>9} {'step s':>8} {'allred s':>9}"
        f" {'opt s':>8} {'cpu%':>6} {'hb age s':>8}  state",
    ]
    for r in state["ranks"]:
        lines.append(
            f"{r['rank']:>4} {_fmt(r['host']):<16.16} {_fmt(r['step']):>7}"
            f" {_fmt(r['loss'], '.4f'):>9} {_fmt(r['step_time_s'], '.4f'):>8}"
            f" {_fmt(r['allreduce_time_s'], '.4f'):>9} {_fmt(r['optimizer_time_s'], '.4f'):>8}"
            f" {_fmt(r['cpu_pct'], '.0f'):>6} {_fmt(r['heartbeat_age_s'], '.1f'):>8}"
            f"  {r['state']}" + (f" ({r['state_reason']})" if r.get("state_reason") else "")
        )
    return "\n".join(lines)


def cmd_jobs(args: argparse.Namespace) -> int:
    """List live hubs."""
    jobs = live_jobs()
    if args.json:
        print(json.dumps([j.__dict__ for j in jobs], indent=1))
        return 0
    if not jobs:
        print("no live scalemon hubs")
    for j in jobs:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.started))
        print(f"{j.job}  world size {_fmt(j.world_size)}  hub pid {j.pid} on {j.host}"
              f"  since {started}  {j.address}")
    return 0


def cmd_hub(args: argparse.Namespace) -> int:
    """Run a hub in the foreground."""
    from scalemon.hub.main import run

    return run(args)


def cmd_attach(args: argparse.Namespace) -> int:
    """Open the dashboard on a job."""
    from scalemon.tui.attach import attach

    return attach(args.target, stats_path=args.stats_json)


def cmd_demo(args: argparse.Namespace) -> int:
    """Start the monitored demo job and open the dashboard on it."""
    from scalemon.tui.demo import demo

    return demo(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `scalemon`."""
    from scalemon.hub.main import add_arguments as add_hub_arguments

    parser = argparse.ArgumentParser(
        prog="scalemon",
        description="Terminal monitor for distributed PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"scalemon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    snap = sub.add_parser("snapshot", help="print the current state of a job")
    snap.add_argument("target", nargs="?", help="job id or hub address (default: the live job)")
    snap.add_argument("--json", action="store_true", help="machine-readable JSON")
    snap.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the hub")
    snap.set_defaults(func=cmd_snapshot)

    jobs = sub.add_parser("jobs", help="list live jobs (hubs) of this user")
    jobs.add_argument("--json", action="store_true")
    jobs.set_defaults(func=cmd_jobs)

    attach = sub.add_parser("attach", help="open the dashboard on a job")
    attach.add_argument("target", nargs="?",
                        help="job id or hub address (default: the live job, or pick from a list)")
    attach.add_argument("--stats-json", type=Path, metavar="PATH",
                        help="on exit, write redraw times and message counts here (benchmarks)")
    attach.set_defaults(func=cmd_attach)

    demo = sub.add_parser("demo", help="run a monitored 2-rank demo job and open the dashboard")
    from scalemon.tui.demo import add_arguments as add_demo_arguments

    add_demo_arguments(demo)
    demo.set_defaults(func=cmd_demo)

    hub = sub.add_parser("hub", help="run a job's hub (ranks start one by themselves)")
    add_hub_arguments(hub)
    hub.set_defaults(func=cmd_hub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `scalemon` console script."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
