"""`scalemon attach [JOB|ENDPOINT]`: open the dashboard on a job (waiting for it to appear)."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import TextIO

from scalemon.home.address import HubAddress
from scalemon.home.history import history_path
from scalemon.home.lookup import JobLookupError, default_jobs, ended_jobs_text, serving_jobs
from scalemon.link.client import hub_key_problem
from scalemon.text.safe import clean
from scalemon.text.terminal import in_background, not_a_terminal

from .app import DashboardApp, run_app
from .feed import HubFeed


def make_app(target: str | None, home: Path | None = None, stats_path: Path | None = None,
             hang_after_s: float | None = None) -> DashboardApp | str:
    """The app for what the user typed, or an error text: an address attaches to that hub; a job
    id to its hub (its history file while it has none); nothing to the only live job, or
    offers a list when there are several (with no live job: the ended jobs whose hubs still
    linger). The job is hung after `hang_after_s` without a completed step (None: the hub's
    threshold)."""
    if target and "://" in target:
        try:
            address = HubAddress.parse(target)
        except ValueError as exc:
            return str(exc)
        missing = hub_key_problem(address)  # said here: the dashboard would only crash
        if missing:
            return missing
        return DashboardApp(HubFeed(address=address), stats_path=stats_path,
                            hang_after_s=hang_after_s)
    if target:
        serving = serving_jobs(home)
        known = any(j.job == target for j in serving)
        try:
            has_history = history_path(target, home).exists()
        except ValueError as exc:
            return str(exc)
        if not known and not has_history:
            names = ", ".join(j.job for j in serving if j.state == "running") or "none"
            ended = ended_jobs_text(home)  # a job just ended: name it, and how to read it
            return (f"no live hub and no history for job {target!r} (live jobs: {names})"
                    + (f"; {ended}" if ended else ""))
        return DashboardApp(HubFeed(job=target, home=home), home=home, stats_path=stats_path,
                            hang_after_s=hang_after_s)
    jobs = default_jobs(home)
    if not jobs:
        ended = ended_jobs_text(home)  # just after a job ended: name it, and how to read it
        return ("no live scalemon job found: start one with --monitor (or `scalemon demo`), "
                "or pass a job id or a hub address (ipc:///dir, tcp://host:port)"
                + (f"; {ended}" if ended else ""))
    if len(jobs) == 1:
        return DashboardApp(HubFeed(job=jobs[0].job, home=home), home=home,
                            stats_path=stats_path, hang_after_s=hang_after_s)
    return DashboardApp(jobs=jobs, home=home, stats_path=stats_path, hang_after_s=hang_after_s)


def can_attach(target: str | None, home: Path | None = None) -> bool:
    """True when `make_app` has something to attach to (or an error that waiting cannot
    mend): an address, a job id with a live hub or a history file, or a live job."""
    if target and "://" in target:
        return True  # the dashboard retries an address by itself
    try:
        if not target:
            return bool(default_jobs(home, clean=False))
        return (any(j.job == target for j in serving_jobs(home, clean=False))
                or history_path(target, home).exists())
    except (ValueError, JobLookupError):
        return True  # a bad job id, untrusted job files: say so at once


def wait_for_job(target: str | None, wait_s: float, home: Path | None = None,
                 out: TextIO | None = None, poll_s: float = 0.2) -> bool:
    """Wait up to `wait_s` seconds until `can_attach`, with a countdown on `out` (stderr):
    in place on a terminal, else a line every 5 s. True when there is something to attach
    to. Ctrl-C raises KeyboardInterrupt, after the countdown line was cleared."""
    out = out or sys.stderr
    ready = can_attach(target, home)
    if ready or wait_s <= 0:
        return ready
    what = f"job {target}'s hub" if target else "a live job"
    in_place = out.isatty()
    end = time.monotonic() + wait_s
    shown: int | None = None
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return can_attach(target, home)
            whole = math.ceil(left)
            if whole != shown and (in_place or shown is None or whole % 5 == 0):
                line = f"scalemon attach: waiting for {what}: {whole} s left (Ctrl-C to stop)"
                out.write(f"\r{line}\x1b[K" if in_place else f"{line}\n")
                out.flush()
                shown = whole
            time.sleep(min(poll_s, left))
            if can_attach(target, home):
                return True
    finally:
        if in_place:
            out.write("\r\x1b[K")
            out.flush()


def attach(target: str | None, stats_path: Path | None = None,
           hang_after_s: float | None = None, wait_s: float = 0.0) -> int:
    """Run the dashboard, after waiting up to `wait_s` seconds for the job to appear; returns
    the exit code. Where the dashboard cannot run (no terminal, or in its background) the job
    is looked up once, not waited for: it is refused either way."""
    missing = not_a_terminal()  # drawn into a file or a pipe, the dashboard only spins
    background = missing is None and in_background()  # stopped by the terminal: never ends
    if missing or background:
        wait_s = 0.0
    try:
        found = wait_for_job(target, wait_s)
    except KeyboardInterrupt:
        print("scalemon attach: stopped waiting", file=sys.stderr)
        return 130
    try:
        app = make_app(target, stats_path=stats_path, hang_after_s=hang_after_s)
    except JobLookupError as exc:  # job files not to be trusted
        app = str(exc)
    if isinstance(app, str):
        waited = f" (waited {wait_s:g} s)" if wait_s > 0 and not found else ""
        print(f"scalemon attach: {clean(app)}{waited}", file=sys.stderr)
        return 2
    job = target or getattr(app.feed, "job", None) or "JOB"
    instead = f"`scalemon snapshot {clean(job)}` prints the job's state instead"
    if missing:
        verb = "are" if " and " in missing else "is"
        print(f"scalemon attach: the dashboard needs a terminal, and {missing} {verb} not one: "
              f"{instead}", file=sys.stderr)
        return 2
    if background:
        print("scalemon attach: it runs in the background of its terminal (`timeout` without "
              "--foreground, or `&`), where the terminal would stop the dashboard: run it in "
              f"the foreground (`timeout --foreground S scalemon attach`), or {instead}",
              file=sys.stderr)
        return 2
    return run_app(app)  # 1 when the dashboard crashed
