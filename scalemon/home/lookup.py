"""Finding a job's hub from what the user typed (nothing, a job id or an address): the job
files of hubs that serve, checked before they are trusted, and why a job has no hub."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from pathlib import Path

from scalemon.home.address import HubAddress
from scalemon.home.jobfile import STATE_WORDS, JobFile, pid_alive
from scalemon.home.paths import jobs_dir
from scalemon.home.safefs import (
    NotOwnedError,
    UnsafePathError,
    check_dir,
)
from scalemon.options import did_you_mean
from scalemon.settings import node_name

log = logging.getLogger("scalemon")


class JobLookupError(RuntimeError):
    """No hub (or more than one) matches what the user asked for; the text says what to do."""


def serving_jobs(home: Path | None = None, clean: bool = True) -> list[JobFile]:
    """Job files of hubs that serve, newest first: live jobs, and ended jobs whose hub still
    lingers (`state` says which); stale files are removed when `clean`."""
    found = []
    directory = jobs_dir(home)
    if not os.path.lexists(directory):
        return []
    trusted_dirs(directory)
    for path in sorted(directory.glob("*.json")):
        try:
            jf = JobFile.read(path)
            jf.check_trusted()
        except UnsafePathError as exc:  # said, never used, never removed
            log.warning("scalemon: not trusting a job file: %s", exc)
            continue
        except ValueError:  # half-written, or removed by its hub while we looked
            with contextlib.suppress(OSError):
                if clean and time.time() - path.stat().st_mtime > 60:
                    path.unlink(missing_ok=True)
            continue
        if jf.serving():
            found.append(jf)
        elif clean:  # an ended job, or a hub that died: kept a week, so readers can tell
            with contextlib.suppress(OSError):
                if time.time() - path.stat().st_mtime > STALE_JOB_FILE_S:
                    path.unlink(missing_ok=True)
    return sorted(found, key=lambda j: j.started, reverse=True)


def trusted_dirs(directory: Path) -> None:
    """Raise JobLookupError unless `directory` (the job files') and the home above it are
    this user's, not links (the home may be a link of this user's) and not writable by
    others: job files there could point at another user's sockets."""
    try:
        home = directory.parent
        info = os.lstat(home)
        if stat.S_ISLNK(info.st_mode):
            if info.st_uid != os.getuid():
                raise NotOwnedError(f"{home} is a symbolic link of another user's "
                                    f"({info.st_uid}): remove it, or set SCALEMON_HOME to a "
                                    "private directory of yours")
            info = os.stat(home)
        from scalemon.home.safefs import check_stat

        check_stat(home, info)
        check_dir(directory, own_link=True)
    except UnsafePathError as exc:
        raise JobLookupError(f"not reading job files: {exc}") from None


def default_jobs(home: Path | None = None, clean: bool = True) -> list[JobFile]:
    """What to attach to when the user names no job: the live jobs; with none, the ended
    jobs whose hubs still serve them."""
    serving = serving_jobs(home, clean)
    return [jf for jf in serving if jf.state == "running"] or serving


STALE_JOB_FILE_S = 7 * 24 * 3600.0


def ended_jobs(home: Path | None = None) -> list[JobFile]:
    """Job files of jobs that ended (whether or not their hub still lingers to serve them)
    or whose hub no longer serves (it died while the job ran), the most recent end first;
    files not to be trusted or unreadable are left out."""
    directory = jobs_dir(home)
    if not os.path.lexists(directory):
        return []
    trusted_dirs(directory)
    found = []
    for path in directory.glob("*.json"):
        try:
            jf = JobFile.read(path)
            jf.check_trusted()
        except (ValueError, OSError):  # UnsafePathError (an OSError): said by serving_jobs
            continue
        if jf.state != "running" or not jf.serving():
            found.append(jf)
    return sorted(found, key=lambda j: j.hub_stopped or j.ended or j.started, reverse=True)


def ended_jobs_text(home: Path | None = None, count: int = 3) -> str:
    """The most recent jobs that ended, each with how (and when), and how to read one: ""
    when there are none."""
    from scalemon.home.history import history_path

    try:
        jobs = ended_jobs(home)[:count]
    except JobLookupError:
        return ""
    if not jobs:
        return ""
    said = []
    for jf in jobs:
        when = time.strftime("%Y-%m-%d %H:%M:%S",
                             time.localtime(jf.ended or jf.hub_stopped or jf.started))
        how = (f"{jf.state} at {when}" if jf.state != "running" else
               f"its hub exited or died while it ran, started {when}")
        if jf.state != "running" and jf.serving():
            how += ", its hub lingers"
        said.append(f"{jf.job} ({how})")
    first = jobs[0].job
    try:
        has_history = history_path(first, home).exists()
    except ValueError:
        has_history = False
    read = (f"`scalemon summary {first}` or `scalemon snapshot {first}` replays its history"
            if has_history else f"no history file of {first} is left to replay")
    latest = "the last job to end" if len(jobs) == 1 else "the last jobs to end"
    return f"{latest}: {', '.join(said)}; {read}"


def hub_gone_text(job: str, home: Path | None = None) -> str | None:
    """Why a job has no live hub, from its job file: the job ended (and when), or its hub
    died while the job ran; None without a job file."""
    path = jobs_dir(home) / f"{job}.json"
    try:
        jf = JobFile.read(path)
    except UnsafePathError as exc:
        return f"its job file is not trusted: {exc}"
    except ValueError:
        return None
    if jf.state != "running":
        when = time.strftime("%Y-%m-%d %H:%M:%S",
                             time.localtime(jf.hub_stopped or jf.ended or jf.started))
        words = STATE_WORDS.get(jf.state, jf.state)
        if jf.serving():
            return f"the job {words}; its hub still serves it"
        return f"the job {words} (its hub exited at {when})"
    if jf.host == node_name() and not pid_alive(jf.pid):
        return (f"its hub (pid {jf.pid}) died while the job was running: the job may still be "
                "running unmonitored, or have ended since")
    return None


def closest_job(target: str, home: Path | None = None) -> str:
    """" (did you mean ID?)" naming the known job (a job file's id) closest to a mistyped
    `target`; "" when none is close."""
    directory = jobs_dir(home)
    try:
        ids = [path.stem for path in directory.glob("*.json")] if directory.is_dir() else []
    except OSError:
        return ""
    return did_you_mean(target, [i for i in ids if i != target], cutoff=0.7)


def resolve_hub(target: str | None, home: Path | None = None) -> tuple[str, HubAddress]:
    """Turn what the user typed (nothing, a job id or an address) into (job, address)."""
    if target and ("://" in target):
        return target, HubAddress.parse(target)
    serving = serving_jobs(home)
    if target:
        for jf in serving:
            if jf.job == target:
                return jf.job, jf.hub_address()
        names = ", ".join(j.job for j in serving if j.state == "running") or "none"
        raise JobLookupError(f"no live hub for job {target!r}{closest_job(target, home)} "
                             f"(live jobs: {names})")
    jobs = default_jobs(home, clean=False)
    if not jobs:
        where = jobs_dir(home)
        ended = ended_jobs_text(home)
        raise JobLookupError(
            f"no live scalemon hub found in {where}: start a job with --monitor, "
            "or pass a job id or an address (ipc:///dir, tcp://host:port)"
            + (f"; {ended}" if ended else "")
        )
    if len(jobs) > 1:
        lines = "\n".join(f"  {j.job}  ({j.state}, pid {j.pid}, world size {j.world_size})"
                          for j in jobs)
        what = ("several live jobs" if jobs[0].state == "running" else
                "no live job, and several ended jobs whose hubs still serve them")
        raise JobLookupError(f"{what}; name one:\n{lines}")
    return jobs[0].job, jobs[0].hub_address()
