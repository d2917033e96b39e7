"""`scalemon attach [JOB|ENDPOINT]`: open the dashboard on a job."""

from __future__ import annotations

import sys
from pathlib import Path

from scalemon.history import history_path
from scalemon.jobs import HubAddress, live_jobs
from scalemon.jobstate import HANG_AFTER_S
from scalemon.tui.app import DashboardApp, run_app
from scalemon.tui.feed import HubFeed


def make_app(target: str | None, home: Path | None = None, stats_path: Path | None = None,
             hang_after_s: float = HANG_AFTER_S) -> DashboardApp | str:
    """The app for what the user typed, or an error text: an address attaches to that hub; a job
    id to its hub (its history file while it has none); nothing to the only live job, or
    offers a list when there are several. The job is hung after `hang_after_s` without a
    completed step."""
    if target and "://" in target:
        try:
            address = HubAddress.parse(target)
        except ValueError as exc:
            return str(exc)
        return DashboardApp(HubFeed(address=address), stats_path=stats_path,
                            hang_after_s=hang_after_s)
    jobs = live_jobs(home)
    if target:
        known = any(j.job == target for j in jobs)
        try:
            has_history = history_path(target, home).exists()
        except ValueError as exc:
            return str(exc)
        if not known and not has_history:
            names = ", ".join(j.job for j in jobs) or "none"
            return f"no live hub and no history for job {target!r} (live jobs: {names})"
        return DashboardApp(HubFeed(job=target, home=home), home=home, stats_path=stats_path,
                            hang_after_s=hang_after_s)
    if not jobs:
        return ("no live scalemon job found: start one with --monitor (or `scalemon demo`), "
                "or pass a job id or a hub address (ipc:///dir, tcp://host:port)")
    if len(jobs) == 1:
        return DashboardApp(HubFeed(job=jobs[0].job, home=home), home=home,
                            stats_path=stats_path, hang_after_s=hang_after_s)
    return DashboardApp(jobs=jobs, home=home, stats_path=stats_path, hang_after_s=hang_after_s)


def attach(target: str | None, stats_path: Path | None = None,
           hang_after_s: float = HANG_AFTER_S) -> int:
    """Run the dashboard; returns the exit code."""
    app = make_app(target, stats_path=stats_path, hang_after_s=hang_after_s)
    if isinstance(app, str):
        print(f"scalemon attach: {app}", file=sys.stderr)
        return 2
    run_app(app)
    return 0
