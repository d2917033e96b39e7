"""`scalemon jobs`: the jobs whose hubs serve; `--connect JOB`: one command line that reaches a
job's hub from a machine without this SCALEMON_HOME (the hub's tcp endpoints and public key,
from the job file)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.home.keys import HUB_KEY_ENV
from scalemon.home.lookup import JobLookupError, serving_jobs
from scalemon.settings import node_name
from scalemon.text import display


def cmd_jobs(args: argparse.Namespace) -> int:
    """List the jobs whose hubs serve: live ones, and ended ones while their hub lingers."""
    if args.connect:
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
        print(f"{j.job:<{width}}  {j.state:<{states}}  world size "
              f"{display.text_of(j.world_size)}  hub pid {j.pid} on {j.host}  since {started}"
              f"{_ended_text(j)}  {where}{_reachability(j)}")
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
    from scalemon.link.client import HubClient, HubUnreachable

    client = HubClient(job.hub_address(), timeout_s=1.0)
    try:
        client.request("ping")
        return ""
    except (HubUnreachable, ValueError) as exc:
        return f"\n  unreachable from here: {exc}"
    finally:
        client.close()


def connect_line(jf: JobFile, command: str = "attach") -> str | None:
    """`SCALEMON_HUB_KEY=KEY scalemon attach tcp://HOST:I,F,R` for a hub with tcp endpoints
    (quoted for a POSIX shell: a z85 key holds `>`, `*`, `?`...); None for an ipc-only hub."""
    if not jf.tcp or not jf.server_key:
        return None
    address = HubAddress(jf.tcp["ingest"], jf.tcp["feed"], jf.tcp["rpc"])
    return (f"{HUB_KEY_ENV}={shlex.quote(jf.server_key)} scalemon {command} "
            f"{shlex.quote(address.base)}")


def print_connect(job: str) -> int:
    """Print job `job`'s connect line on stdout (exit 0), or say on stderr why there is none
    and how to get one (exit 2)."""
    try:
        serving = serving_jobs()
    except JobLookupError as exc:  # job files not to be trusted
        print(f"scalemon jobs: {exc}", file=sys.stderr)
        return 2
    found = [jf for jf in serving if jf.job == job]
    if not found:
        names = ", ".join(j.job for j in serving) or "none"
        print(f"scalemon jobs: no hub serves job {job!r} here (serving: {names})",
              file=sys.stderr)
        return 2
    jf = found[0]
    line = connect_line(jf)
    if line is None:
        print(f"scalemon jobs: the hub of job {job} listens only on ipc ({jf.address}), which "
              "no other machine reaches: start the job with SCALEMON_LISTEN=tcp://*:0 in its "
              "environment (or its hub with `scalemon hub --listen tcp://*:0`), then ask again",
              file=sys.stderr)
        return 2
    print(line)
    print("scalemon jobs: the hub admits only the keys of `scalemon keys list`: admit the "
          "public key of whoever pastes this (`scalemon keys show` on that machine) first, "
          "with `scalemon keys add KEY --role watch --name NAME` (control to steer too)",
          file=sys.stderr)
    return 0
