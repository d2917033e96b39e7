"""Where a job's hub lives: `$SCALEMON_HOME`, run directories, endpoints and job files.

Layout (all directories mode 0700, since ipc sockets are reachable by whoever can open them)::

    $SCALEMON_HOME/                       default ~/.scalemon (often on the cluster's shared home)
        jobs/<job>.json                   one per hub: endpoints, host, pid, world size, state
        keys/                             CurveZMQ keys (scalemon.keys)
        run/<job>/ingest.sock  feed.sock  rpc.sock  hub.lock  history.smlog  hub.log
    $SCALEMON_RUNTIME_DIR/                default /tmp/scalemon-<uid>: on the node's own disk
        relay/<node>/<job>/ingest.sock  rpc.sock  relay.lock  relay.log
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from scalemon.safefs import (  # noqa: F401 - NotOwnedError, private_dir: used from here too
    NotOwnedError,
    UnsafePathError,
    check_dir,
    private_dir,
    read_private,
    write_private,
)

log = logging.getLogger("scalemon")

_JOB_ID_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_IPC_PATH_MAX = 100  # sun_path is 108 bytes on Linux; keep a margin
_PORT_MAX = 65535


class JobLookupError(RuntimeError):
    """No hub (or more than one) matches what the user asked for; the text says what to do."""


def scalemon_home() -> Path:
    """`$SCALEMON_HOME`, default `~/.scalemon`."""
    return Path(os.environ.get("SCALEMON_HOME") or Path.home() / ".scalemon")


def node_name() -> str:
    """This node's name as ranks, hubs and relays report it: `$SCALEMON_NODE` (to stand for
    several nodes on one machine: tests, the simulator), else the host name."""
    return os.environ.get("SCALEMON_NODE") or socket.gethostname()


def runtime_dir() -> Path:
    """The node-local directory of relays' sockets, `$SCALEMON_RUNTIME_DIR` (default
    /tmp/scalemon-<uid>): ipc sockets belong on the node's own disk, not on a shared home."""
    return Path(os.environ.get("SCALEMON_RUNTIME_DIR") or f"/tmp/scalemon-{os.getuid()}")


def relay_dir(job: str, node: str | None = None) -> Path:
    """The private node-local directory of job `job`'s relay on `node` (default: this one),
    made short enough for ipc socket paths."""
    node = re.sub(r"[^A-Za-z0-9._-]", "-", node or node_name())[:64] or "node"
    path = runtime_dir() / "relay" / node / check_job_id(job)
    if len(str(path / "control.sock")) > _IPC_PATH_MAX:
        digest = hashlib.sha1(f"{node}/{job}".encode()).hexdigest()[:16]
        path = runtime_dir() / "r" / digest
    return private_dir(path)


def check_job_id(job: str) -> str:
    """Return `job` if it is safe to use in file names, else raise ValueError."""
    if not _JOB_ID_OK.match(job):
        raise ValueError(
            f"job id {job!r} must be 1-100 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return job


@dataclass(frozen=True)
class HubAddress:
    """The endpoints of one hub: ranks PUSH to `ingest`, dashboards SUB to `feed` and send
    requests to `rpc`; commands that steer the job go to `control`, an ipc socket in the hub's
    private run directory (None where that directory is not known, e.g. a bare tcp address)."""

    ingest: str
    feed: str
    rpc: str
    control: str | None = None
    server_key: str | None = None
    """The hub's Curve public key for tcp endpoints (from its job file), where known."""

    @classmethod
    def parse(cls, address: str) -> HubAddress:
        """From `ipc:///dir` (sockets inside dir), `tcp://host:port` (ports port..port+2;
        port 0 stays 0 for all three: each binds a free port) or `tcp://host:I,F,R` (the
        ingest, feed and rpc ports of a hub that bound free ones: what `base` says for it)."""
        if address.startswith("ipc://"):
            base = address[len("ipc://") :].rstrip("/")
            if not base:
                raise ValueError(f"{address!r}: ipc address needs a directory")
            return cls.for_directory(Path(base))
        if address.startswith("tcp://"):
            host, _, port = address[len("tcp://") :].rpartition(":")
            ports = port.split(",")
            if not host or len(ports) not in (1, 3) or not all(p.isdigit() for p in ports):
                raise ValueError(f"{address!r}: expected tcp://HOST:PORT (or "
                                 "tcp://HOST:INGEST,FEED,RPC, as `scalemon jobs` prints it)")
            numbers = [int(p) for p in ports]
            if len(numbers) == 1:
                first = numbers[0]
                if first > _PORT_MAX - 2:
                    raise ValueError(f"{address!r}: a tcp hub uses ports PORT to PORT+2, so "
                                     f"PORT must be from 0 to {_PORT_MAX - 2}, not {first}")
                numbers = [first + i if first else 0 for i in range(3)]
            elif max(numbers) > _PORT_MAX:
                raise ValueError(f"{address!r}: ports must be from 0 to {_PORT_MAX}")
            return cls(*(f"tcp://{host}:{p}" for p in numbers))
        raise ValueError(f"hub address {address!r} must start with ipc:// or tcp://")

    @classmethod
    def for_directory(cls, run_dir: Path) -> HubAddress:
        """ipc endpoints inside `run_dir`."""
        paths = [run_dir / name
                 for name in ("ingest.sock", "feed.sock", "rpc.sock", "control.sock")]
        longest = max(len(str(p)) for p in paths)
        if longest > _IPC_PATH_MAX:
            raise ValueError(
                f"ipc socket path under {run_dir} is {longest} bytes, over the {_IPC_PATH_MAX} "
                "the OS allows: set SCALEMON_HOME to a shorter directory"
            )
        return cls(*(f"ipc://{p}" for p in paths))

    @property
    def base(self) -> str:
        """The address string `parse` accepts."""
        if self.ingest.startswith("ipc://"):
            return "ipc://" + str(Path(self.ingest[len("ipc://") :]).parent)
        hosts, ports = zip(*(e.rpartition(":")[::2] for e in (self.ingest, self.feed, self.rpc)),
                           strict=True)
        if len(set(hosts)) > 1 or not all(p.isdigit() for p in ports):
            return self.ingest  # not one hub's: nothing `parse` would give back
        first, feed, rpc = (int(p) for p in ports)
        if (feed, rpc) in ((first + 1, first + 2), (0, 0)):
            return self.ingest
        return f"{hosts[0]}:{first},{feed},{rpc}"  # free ports the hub bound


def run_dir(job: str, home: Path | None = None) -> Path:
    """The private directory holding a job's sockets and history."""
    return (home or scalemon_home()) / "run" / check_job_id(job)


def jobs_dir(home: Path | None = None) -> Path:
    """Directory of job files."""
    return (home or scalemon_home()) / "jobs"


@dataclass
class JobFile:
    """What a live hub writes about itself to `$SCALEMON_HOME/jobs/<job>.json`."""

    job: str
    address: str
    host: str
    pid: int
    started: float
    world_size: int | None
    run_dir: str
    protocol: list[int]
    state: str = "running"
    """"running" while the job runs; from the moment it ended, its final state (`ENDED_STATES`:
    "finished", "stopped", "crashed", "lost", "abandoned"), also while the hub lingers to serve
    it, so readers never count an ended job as live. A hub that died leaves "running" with a
    pid that is gone."""
    ended: float | None = None
    """When the job ended (files of older hubs: when the hub exited after it)."""
    hub_stopped: float | None = None
    """When the hub exited after the job ended; None while it serves (lingering included)."""
    tcp: dict[str, str] | None = None
    """The hub's CurveZMQ tcp endpoints {"ingest", "feed", "rpc"} with a host name other nodes
    resolve; None for an ipc-only hub."""
    server_key: str | None = None
    """The hub's Curve public key (z85), which tcp clients must know; None without tcp."""
    metrics_url: str | None = None
    """Where the hub serves OpenMetrics (`http://HOST:PORT/metrics`); None when it does not."""

    def write(self, home: Path | None = None) -> Path:
        """Atomically (re)write the job file."""
        home = home or scalemon_home()
        # jobs/ may be a link of this user's (shared between nodes' homes): its own top
        path = private_dir(jobs_dir(home), top=jobs_dir(home)) / f"{self.job}.json"
        write_private(path, json.dumps(asdict(self), indent=1).encode())
        return path

    @classmethod
    def read(cls, path: Path) -> JobFile:
        """Parse a job file; raises ValueError naming the file when it is unreadable, and
        UnsafePathError when it is not to be trusted (a link, another user's, writable by
        others)."""
        try:
            data = json.loads(read_private(path))
            optional = {"state", "ended", "hub_stopped", "tcp", "server_key",
                        "metrics_url"}  # older hubs
            jf = cls(**{k: data[k] for k in cls.__dataclass_fields__
                        if k not in optional or k in data})
        except UnsafePathError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"unreadable job file {path}: {exc}") from None
        if "hub_stopped" not in data and jf.state != "running":  # older hubs: only at exit
            jf.hub_stopped = jf.ended or jf.started
        return jf

    def hub_address(self) -> HubAddress:
        """The hub's endpoints: ipc on the hub's host, else its Curve tcp ones; its control
        socket where the hub runs on this host."""
        address = HubAddress.parse(self.address)
        local = self.host == node_name()
        if self.tcp and (not local or not address.ingest.startswith("ipc://")):
            address = HubAddress(self.tcp["ingest"], self.tcp["feed"], self.tcp["rpc"])
        control = address.control
        if control is None and local:
            control = f"ipc://{Path(self.run_dir) / 'control.sock'}"
        return HubAddress(address.ingest, address.feed, address.rpc, control, self.server_key)

    def check_trusted(self) -> None:
        """Raise UnsafePathError when this job's hub is on this host and its ipc sockets are in
        a directory that is not safely this user's: whoever owns it could impersonate the
        hub."""
        if self.host != node_name():
            return
        for address in (self.address, f"ipc://{self.run_dir}"):
            if address.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):  # gone with its hub
                    check_dir(Path(address[len("ipc://"):].rstrip("/")))

    def serving(self) -> bool:
        """True when the hub process still runs, lingering after the job ended included
        (always assumed for another host until the file says the hub exited)."""
        if self.hub_stopped is not None:
            return False
        return self.host != node_name() or pid_alive(self.pid)

    def is_alive(self) -> bool:
        """True when the job is live: it runs, and its hub serves."""
        return self.state == "running" and self.serving()


ENDED_STATES = ("finished", "stopped", "crashed", "lost", "abandoned")
"""A job file's `state` once its job ended (older hubs also wrote "ended")."""
STATE_WORDS = {"finished": "finished", "stopped": "was stopped by its user",
               "crashed": "crashed", "lost": "lost a rank", "abandoned": "was abandoned",
               "ended": "ended"}
"""A job file's final `state` in a sentence: "the job was stopped by its user"."""


def pid_alive(pid: int) -> bool:
    """True when process `pid` of this machine exists and is not a zombie."""
    try:
        proc = psutil.Process(pid)
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


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
        from scalemon.safefs import check_stat

        check_stat(home, info)
        check_dir(directory, own_link=True)
    except UnsafePathError as exc:
        raise JobLookupError(f"not reading job files: {exc}") from None


def live_jobs(home: Path | None = None, clean: bool = True) -> list[JobFile]:
    """Job files of live jobs (running, their hub serving), newest first; a hub that lingers
    after its job ended is not live (`serving_jobs` has it)."""
    return [jf for jf in serving_jobs(home, clean) if jf.state == "running"]


def default_jobs(home: Path | None = None, clean: bool = True) -> list[JobFile]:
    """What to attach to when the user names no job: the live jobs; with none, the ended
    jobs whose hubs still serve them."""
    serving = serving_jobs(home, clean)
    return [jf for jf in serving if jf.state == "running"] or serving


STALE_JOB_FILE_S = 7 * 24 * 3600.0


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
        raise JobLookupError(f"no live hub for job {target!r} (live jobs: {names})")
    jobs = default_jobs(home, clean=False)
    if not jobs:
        where = jobs_dir(home)
        raise JobLookupError(
            f"no live scalemon hub found in {where}: start a job with --monitor, "
            "or pass a job id or an address (ipc:///dir, tcp://host:port)"
        )
    if len(jobs) > 1:
        lines = "\n".join(f"  {j.job}  ({j.state}, pid {j.pid}, world size {j.world_size})"
                          for j in jobs)
        what = ("several live jobs" if jobs[0].state == "running" else
                "no live job, and several ended jobs whose hubs still serve them")
        raise JobLookupError(f"{what}; name one:\n{lines}")
    return jobs[0].job, jobs[0].hub_address()
