"""`scalemon jobs --connect JOB`: one command line that reaches a job's hub from a machine
without this SCALEMON_HOME (a login node without a shared home): the hub's tcp endpoints and
its public key, from the job file."""

from __future__ import annotations

import shlex
import sys

from scalemon.jobs import HubAddress, JobFile, JobLookupError, serving_jobs
from scalemon.keys import HUB_KEY_ENV


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
