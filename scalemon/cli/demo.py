"""`scalemon demo`: start a monitored 2-rank run of the demo trainer and watch it.

The job runs under torchrun in its own session (`--device auto`, NCCL, when NVML counts a GPU
per rank, else `--device cpu` with gloo), its output goes to a log file, and the dashboard
attaches to it by job id. Quitting the dashboard stops the job and its hub, first telling the
hub that its user stops it, so that the ranks' end reads "stopped by user" (live and in the
history); `scalemon snapshot <job>` can still replay the history afterwards. A job that ends
by itself with an error shows the last lines of its log on the dashboard, and `scalemon demo`
then exits with its code.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from scalemon import settings
from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.home.lookup import serving_jobs
from scalemon.home.paths import jobs_dir, run_dir
from scalemon.home.safefs import private_dir
from scalemon.options import LazyChoices, int_at_least, job_id, seconds
from scalemon.text.display import exit_text
from scalemon.text.safe import clean
from scalemon.text.terminal import in_background, not_a_terminal

MAX_RANKS = 64
"""More ranks than this on one machine is a typo, not a demo."""
QUIT_REASON = "scalemon demo: q"
"""How the demo's user stopped the job, as the hub records it (`job_stop`)."""


DEMO_EXTRA = ("torch", "triton", "numpy")
"""What the demo trainer needs beyond the base install (pyproject.toml's `demo` extra)."""


def missing_extra() -> str | None:
    """What this install lacks for `scalemon demo`, said with the command that adds it; None
    when it has everything (the packages are looked up, not imported)."""
    missing = [name for name in DEMO_EXTRA if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (f"the demo trainer needs {', '.join(missing)}, which this install of scalemon "
            "lacks: pip install 'scalemon[demo]'")


def _stop_without_extra() -> None:
    """Exit with status 2 and the message when the demo extra is missing."""
    problem = missing_extra()
    if problem:
        print(f"scalemon demo: {problem}", file=sys.stderr)
        raise SystemExit(2)


def terminal_refusal(args: argparse.Namespace, job: str) -> str | None:
    """Why the demo will not start here, with what to run instead (the job as the demo would
    run it, with the user's options): its dashboard needs a terminal on stdin and stderr
    (drawn into a pipe or a file it only spins), in the foreground (in the background the
    terminal stops it at its first draw, and it never quits: a job left behind); None there."""
    missing = not_a_terminal()
    background = missing is None and in_background()
    if missing is None and not background:
        return None
    device = demo_device(args.ranks, gpu_count())
    run = shlex.join([f"SCALEMON_JOB_ID={job}", sys.executable, "-m", "torch.distributed.run",
                      *torchrun_arguments(args, device)])
    headless = (f"run the job without a dashboard (`{run}`) and read it with "
                f"`scalemon snapshot {job}`")
    if background:
        return ("scalemon demo: it runs in the background of its terminal (`timeout` without "
                "--foreground, or `&`), where the terminal would stop its dashboard: run it in "
                f"the foreground (`timeout --foreground S scalemon demo`), or {headless}")
    verb = "are" if " and " in missing else "is"
    return (f"scalemon demo: its dashboard needs a terminal, and {missing} {verb} not one: run "
            f"it in a terminal, or {headless}")


def preset_names() -> list[str]:
    """The trainer's model presets (importing them imports torch; without the demo extra,
    `scalemon demo --preset`/`--help` stop here with the message)."""
    _stop_without_extra()
    from scalemon.demo_train.model import PRESETS

    return sorted(PRESETS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `scalemon demo`, checked before anything starts."""
    parser.add_argument("--ranks", type=int_at_least(1, MAX_RANKS), default=2, metavar="N",
                        help=f"number of ranks, 1 to {MAX_RANKS}")
    parser.add_argument("--max-steps", type=int_at_least(1), default=100_000, metavar="N",
                        help="steps to train; the default lasts until you quit")
    parser.add_argument("--step-delay", type=seconds(0.0), default=0.05, metavar="S",
                        help="sleep S seconds per step so it is easy to watch")
    parser.add_argument("--preset", default="tiny", metavar="NAME",
                        choices=LazyChoices(preset_names),
                        help="the trainer's model size preset: %(choices)s")
    parser.add_argument("--batch-size", type=int_at_least(1), default=8, metavar="N",
                        help="sequences per rank per step")
    parser.add_argument("--job", type=job_id, metavar="ID",
                        help="job id (default: demo-<host>-<pid>)")


def free_port() -> int:
    """A free TCP port for torchrun's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count() -> int:
    """Number of NVIDIA GPUs the job's ranks can use: NVML's count, narrowed by
    CUDA_VISIBLE_DEVICES as CUDA narrows it (0 without NVML or a driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            installed = int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0
    return visible_gpus(installed, os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible_gpus(installed: int, cuda_visible_devices: str | None) -> int:
    """How many of `installed` GPUs CUDA shows under CUDA_VISIBLE_DEVICES, read as torch
    reads it (``torch.cuda._parse_visible_devices``): unset, all of them; else the entries up
    to the first CUDA rejects (a negative or out-of-range index, or not a number: an empty
    value hides every GPU), none at all when an entry repeats; a ``GPU-``/``MIG-`` UUID list
    up to the first entry without that prefix (UUIDs are not resolved against NVML)."""
    if cuda_visible_devices is None:
        return installed
    entries = cuda_visible_devices.split(",")
    prefix = next((p for p in ("GPU-", "MIG-") if cuda_visible_devices.startswith(p)), None)
    seen: list[object] = []
    for entry in entries:
        key: object
        if prefix is not None:
            if not entry.startswith(prefix):
                break
            key = entry
        else:
            digits = re.match(r"\+?\d+", entry.strip())
            if digits is None or int(digits.group()) >= installed:
                break
            key = int(digits.group())
        if key in seen:
            return 0
        seen.append(key)
    return min(len(seen), installed)


def trainer_path() -> str:
    """The installed demo trainer script (works from any directory)."""
    spec = importlib.util.find_spec("scalemon.demo_train.train")
    if spec is None or spec.origin is None:
        raise RuntimeError("scalemon.demo_train.train is not installed")
    return spec.origin


def demo_device(ranks: int, gpus: int) -> str:
    """`cpu` unless NVML counts a GPU for every rank (NCCL needs one each); then `auto`, so a
    torch that cannot use them (a CPU build) still trains, on the CPU."""
    return "auto" if 0 < ranks <= gpus else "cpu"


LAUNCHER = "from scalemon.cli.demo import run_torchrun; run_torchrun()"
"""`python -c LAUNCHER ARGS` is `python -m torch.distributed.run ARGS` stopped cleanly."""


def run_torchrun() -> None:
    """torchrun with the arguments in sys.argv; stopped by a signal (the demo's quit), it ends
    with status 128 + the signal's number instead of a traceback: its workers are shut down
    by then, and the log says so in its warnings."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    try:
        main()
    except SignalException as exc:
        sys.exit(128 + int(exc.sigval))


def torchrun_arguments(args: argparse.Namespace, device: str) -> list[str]:
    """torchrun's arguments for the demo job but its rendezvous port: the ranks, the trainer
    and the user's options (the job's command, and the one the no-terminal refusal offers)."""
    return [
        "--nproc-per-node", str(args.ranks), "--", trainer_path(), "--monitor",
        "--device", device, "--max-steps", str(args.max_steps),
        "--step-delay", str(args.step_delay), "--preset", args.preset,
        "--batch-size", str(args.batch_size),
    ]


def job_command(args: argparse.Namespace, device: str) -> list[str]:
    """The torchrun command line of the demo job."""
    return [sys.executable, "-c", LAUNCHER, "--master-port", str(free_port()),
            *torchrun_arguments(args, device)]


def job_env(job: str) -> dict[str, str]:
    """Environment of the job: its id and a short hub linger."""
    env = os.environ.copy()
    env.update(SCALEMON_JOB_ID=job,
               SCALEMON_HUB_ARGS=settings.raw("SCALEMON_HUB_ARGS", env) or "--linger 30")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start_job(args: argparse.Namespace, job: str) -> tuple[subprocess.Popen, Path]:
    """Start torchrun in a new session; returns the process and its log file."""
    log_path = private_dir(settings.scalemon_home() / "demo") / f"{job}.log"
    with open(log_path, "wb") as log:
        device = demo_device(args.ranks, gpu_count())
        proc = subprocess.Popen(job_command(args, device), env=job_env(job),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, log_path


def tell_hub_stopping(job: str, reason: str = QUIT_REASON, timeout_s: float = 3.0) -> bool:
    """Tell the live job's hub (on its control socket) that its user stops the job, so the
    ranks' end reads "stopped by user" instead of lost or failed; False when there was no
    live hub to tell or it did not answer (the job is stopped all the same)."""
    from scalemon.link.control import ControlError, Controller, HubUnreachable
    from scalemon.protocol import ProtocolError

    try:
        jf = JobFile.read(jobs_dir() / f"{job}.json")
    except (ValueError, OSError):  # unreadable, or not trusted
        return False
    if not jf.is_alive():
        return False
    try:
        controller = Controller(jf.hub_address(), timeout_s=timeout_s)
    except ControlError:
        return False
    try:
        controller.stop(reason)
        return True
    except (HubUnreachable, ProtocolError):
        return False
    finally:
        controller.close()


def stop_job(proc: subprocess.Popen, job: str, grace_s: float = 10.0,
             log_path: Path | None = None, reason: str = QUIT_REASON) -> None:
    """Stop the job: tell its hub that the user stops it (`reason`), then stop its process
    group (SIGTERM, then SIGKILL), then any rank left (torchrun starts each in a session of its
    own: out of the group's reach, orphaned where torchrun died first), then its hub. torchrun
    shuts its workers down on SIGTERM; the log (when given) then ends with a line that says the
    demo stopped the job."""
    running = proc.poll() is None
    ranks = job_children(proc.pid, job) if running else []
    if running:
        tell_hub_stopping(job, reason)
    sent = []
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
            sent.append(sig.name)
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    end = time.monotonic() + 5.0  # stragglers of the group, if torchrun died first
    while time.monotonic() < end:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.1)
    end_processes(ranks)
    if running and log_path is not None and proc.returncode is not None:
        with contextlib.suppress(OSError), open(log_path, "a") as log:
            how = "quit" if reason == QUIT_REASON else reason.removeprefix("scalemon demo: ")
            log.write(f"scalemon demo: stopped job {job} on {how} ({', then '.join(sent)}); "
                      f"torchrun ended: {exit_text(proc.returncode)}\n")
    stop_hub(job)


def stop_budget_s(grace_s: float = 10.0) -> float:
    """The longest `stop_job` takes: the hub told (3 s), torchrun's grace, the wait after
    SIGKILL (10 s), the group's stragglers (5 s), then the ranks left (5 s, 5 s more after
    SIGKILL)."""
    return 3.0 + grace_s + 10.0 + 5.0 + 5.0 + 5.0


def say(text: str) -> None:
    """One line to stderr, now; lost quietly where the terminal has gone (SIGHUP)."""
    with contextlib.suppress(OSError, ValueError):
        print(text, file=sys.stderr, flush=True)


class PatientStop:
    """While the demo stops its job: Ctrl-C is answered with the time left, not obeyed (a
    KeyboardInterrupt inside `stop_job` would skip the ranks and the hub: orphans)."""

    def __init__(self, job: str, budget_s: float) -> None:
        self.job, self.budget_s = job, budget_s
        self.end = time.monotonic() + budget_s
        self._previous: Any = None

    def __enter__(self) -> PatientStop:
        self.end = time.monotonic() + self.budget_s
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *_exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, _signum: int, _frame: object) -> None:
        left = max(1, int(self.end - time.monotonic() + 0.999))
        say(f"scalemon demo: still stopping job {self.job}, up to {left} s left "
            "(stopped halfway, its ranks and hub would run on)")


def job_children(pid: int, job: str) -> list[psutil.Process]:
    """The processes under torchrun `pid` but the job's hub (rank 0 starts it; `stop_hub`
    stops it once the ranks are gone, so that it records their end)."""
    try:
        hub = JobFile.read(jobs_dir() / f"{job}.json").pid
    except (ValueError, OSError):
        hub = None
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    return [c for c in children if c.pid != hub]


def end_processes(procs: list[psutil.Process], grace_s: float = 5.0) -> None:
    """SIGTERM the processes still running, then SIGKILL those left after `grace_s`."""
    alive = [p for p in procs if p.is_running()]
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, left = psutil.wait_procs(alive, timeout=grace_s)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=grace_s)


def stop_hub(job: str) -> None:
    """SIGTERM the job's hub (it flushes its history and removes its job file)."""
    path = jobs_dir() / f"{job}.json"
    try:
        jf = JobFile.read(path)
    except (ValueError, OSError):  # unreadable, or not trusted
        return
    if jf.job == job and jf.host == settings.node_name():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(jf.pid, signal.SIGTERM)


class SignalStop:
    """SIGTERM and SIGHUP (its terminal went away) stop the demo as `q` does: the dashboard
    quits, then `demo` stops the job (telling its hub first: its ranks read `stopped`) and its
    hub, and exits with 128 + the signal's number. Without this a signal would kill the demo
    alone, leaving torchrun, the ranks and the hub running (their own session: no terminal
    signal reaches them). A handler only records the signal; a thread asks the app to exit.
    Where the app does not exit within `APP_EXIT_S` (its terminal went away: Textual's output
    thread dies on the write error and the app then blocks on its full queue), that thread
    stops the job itself (`fallback`) and ends the process."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)
    APP_EXIT_S = 5.0

    def __init__(self) -> None:
        self.signum: int | None = None
        self.app: Any = None  # the dashboard, once made
        self.done = False
        self._asked = threading.Event()
        self.app_ended = threading.Event()
        """Set once the dashboard returned (or never started)."""
        self.fallback: Any = None
        """Stops the job where the app cannot exit: set once the job started."""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalStop:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        threading.Thread(target=self._quit_app, name="demo-signals", daemon=True).start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.done = True
        self._asked.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def reason(self) -> str:
        """How the user stopped the job, as its hub records it."""
        if self.signum is None:  # the dashboard's q or Ctrl-C
            return f"scalemon demo: {getattr(self.app, 'quit_key', 'q')}"
        return f"scalemon demo: {signal.Signals(self.signum).name}"

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        self._asked.set()

    def _quit_app(self) -> None:
        """Once a signal came: make the app exit, as soon as it runs (and while it does); where
        it does not within `APP_EXIT_S`, stop the job from here (`fallback`) and end."""
        self._asked.wait()
        while not self.done and not self.app_ended.is_set():
            app = self.app
            if app is not None and app.is_running:
                # in a thread of its own: call_from_thread waits for an app that may be stuck
                threading.Thread(target=self._exit_app, args=(app,), daemon=True).start()
                break
            time.sleep(0.05)
        if self.done or self.app_ended.wait(self.APP_EXIT_S) or self.fallback is None:
            return
        with contextlib.suppress(Exception):
            self.fallback()
        os._exit(128 + (self.signum or signal.SIGTERM))

    @staticmethod
    def _exit_app(app: Any) -> None:
        with contextlib.suppress(RuntimeError):  # it ended meanwhile
            app.call_from_thread(app.exit)


def default_job_id() -> str:
    """`demo-<host>-<pid>`."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0])
    return f"demo-{host}-{os.getpid()}"


def job_problem(job: str) -> str | None:
    """Why the demo cannot run as `job` here, or None: a live job of that id, or ipc socket
    paths too long for the OS under $SCALEMON_HOME."""
    try:
        HubAddress.for_directory(run_dir(job))
    except ValueError as exc:
        return str(exc)
    if any(j.job == job for j in serving_jobs()):
        return (f"a live job is named {job} already (see `scalemon jobs`): pass another --job, "
                "or leave it out")
    return None


def demo(args: argparse.Namespace) -> int:
    """Run the demo job and the dashboard on it; returns the exit code: the job's when it
    ended by itself with an error, else 0."""
    _stop_without_extra()  # before the dashboard's imports: a base install lacks numpy today
    from scalemon.home.history import history_path
    from scalemon.tui.app import DashboardApp, run_app
    from scalemon.tui.feed import HubFeed
    from scalemon.tui.screens.job_exit import last_lines

    job = args.job or default_job_id()
    problem = job_problem(job)
    if problem:
        print(f"scalemon demo: {problem}", file=sys.stderr)
        return 2
    if refusal := terminal_refusal(args, job):  # before anything starts
        print(refusal, file=sys.stderr)
        return 2
    code: int | None = None
    app_code = 1
    with SignalStop() as stopper:
        proc, log_path = start_job(args, job)
        stopper.fallback = lambda: stop_job(proc, job, log_path=log_path, reason=stopper.reason)
        try:
            if stopper.signum is None:
                stopper.app = DashboardApp(HubFeed(job=job), job_process=proc, job_log=log_path)
                app_code = run_app(stopper.app)
            else:  # stopped before its dashboard started
                app_code = 0
        finally:
            stopper.app_ended.set()
            with PatientStop(job, stop_budget_s()) as patient:  # Ctrl-C: told to wait
                code = proc.poll()  # None while it runs: the quit stops it
                if code is None:
                    say(f"scalemon demo: stopping job {job}: torchrun, its {args.ranks} "
                        f"rank{'s' if args.ranks != 1 else ''} and its hub (up to "
                        f"{patient.budget_s:g} s)...")
                stop_job(proc, job, log_path=log_path, reason=stopper.reason)
    replay = (f"; `scalemon snapshot {job}` replays its history"
              if history_path(job).exists() else "")
    if stopper.signum is not None and code is None:
        print(f"scalemon demo: stopped job {job} on {signal.Signals(stopper.signum).name} (log: "
              f"{log_path}){replay}", file=sys.stderr)
        return 128 + stopper.signum
    if app_code:
        print(f"scalemon demo: the dashboard failed (exit code {app_code}); stopped job {job} "
              f"(log: {log_path}){replay}", file=sys.stderr)
        return app_code
    if code is None:
        print(f"scalemon demo: stopped job {job} (log: {log_path}){replay}")
        return 0
    if code == 0:
        print(f"scalemon demo: job {job} finished (log: {log_path}){replay}")
        return 0
    lines = last_lines(log_path)
    print(f"scalemon demo: job {job} failed: {exit_text(code)}{replay}; "
          + (f"the last {len(lines)} lines of its log, {log_path}:" if lines else
             f"its log, {log_path}, is empty"), file=sys.stderr)
    for line in lines:
        print(f"  {clean(line, one_line=True)}", file=sys.stderr)  # the ranks' own output
    return code if 0 < code < 256 else 1
