"""Shared fixtures: a private SCALEMON_HOME per test and real hub processes.

At import, before any test module imports scalemon or triton, it sets for this test process
(each pytest-xdist worker is one):
- `SCALEMON_HOME` and `SCALEMON_RUNTIME_DIR` to a private temporary directory, so a test that
  does not ask for the `home` fixture still never touches the user's ~/.scalemon or the node's
  /tmp/scalemon-<uid> relays, nor collides with a test running beside it;
- `TRITON_INTERPRET=1`: the fused-AdamW tests run the Triton kernels in the interpreter on CPU
  tensors in this process (compiled kernels run in subprocesses with `TRITON_INTERPRET=0`, see
  fused_adam_support.run_compiled), so they never depend on the caller's environment;
- under pytest-xdist, `OMP_NUM_THREADS=1` and `TORCHINDUCTOR_COMPILE_THREADS=2` unless set:
  four workers (fourteen on the 16-core GPU machine), each with a thread per core, and the jobs
  they start, each with a pool of compile workers per core, would oversubscribe the cores.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import zmq

from scalemon import protocol
from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir

REPO = Path(__file__).resolve().parents[1]

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="smw", dir="/tmp"))
os.environ["SCALEMON_HOME"] = str(_SESSION_DIR / "home")
os.environ["SCALEMON_RUNTIME_DIR"] = str(_SESSION_DIR / "rt")
for _name in ("SCALEMON_HUB", "SCALEMON_JOB_ID"):
    os.environ.pop(_name, None)
os.environ["TRITON_INTERPRET"] = "1"  # before any test module imports triton
if os.environ.get("PYTEST_XDIST_WORKER"):  # one of several test processes sharing the cores:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torch here and in its jobs, one thread
    # and torch.compile with 2 compile workers: with triton installed, inductor otherwise
    # starts a pool of min(32, cores) of them per process at its first compile (each importing
    # torch), 32 more processes for a 2-rank compiled job on a 16-core GPU machine (2 is what
    # a 2-core machine gets by itself; compiling in the process, 1, was slower there)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "2")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which makes "no" into "load"
def pytest_cmdline_main(config: pytest.Config) -> None:
    """`-n N` without `--dist`: whole files per worker, in the order below, as the README's
    command asks (`--dist loadfile --no-loadscope-reorder`). xdist's default, `load`, hands out
    single tests: each worker that gets one test of a file runs that file's module fixtures
    again (the corpus jobs, the trainer's reference runs, a wheel and a fresh venv), so up to
    N copies of them run at once and overrun their timeouts on any number of cores."""
    option = config.option
    if getattr(option, "numprocesses", None) and option.dist == "no" and not option.distload:
        option.dist = "loadfile"
        option.loadscopereorder = False


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop the hubs left in this process's default home and remove its directory."""
    for job_file in (_SESSION_DIR / "home" / "jobs").glob("*.json"):
        with contextlib.suppress(Exception):
            os.kill(JobFile.read(job_file).pid, signal.SIGKILL)
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)


LONGEST_FIRST = ("test_train.py", "test_checkpoint_recovery.py", "test_summary.py",
                 "test_multinode.py", "test_toggle_jobs.py", "test_lifecycle.py",
                 "test_hang_jobs.py", "test_collectives_jobs.py", "test_corpus.py")
"""The files that take a minute or more under the README's command (longest first), run first.
`--no-loadscope-reorder` keeps pytest-xdist from handing out the files with the most tests
first instead."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files in this order: LONGEST_FIRST, then those with integration tests, then the rest
    (each file's tests stay together and in order). Under pytest-xdist (--dist loadfile hands
    out whole files in this order) the long jobs start at once, in parallel, and the run does
    not end waiting on one of them."""
    with_integration = {item.path for item in items if item.get_closest_marker("integration")}

    def rank(item: pytest.Item) -> tuple[int, int]:
        name = item.path.name
        if name in LONGEST_FIRST:
            return 0, LONGEST_FIRST.index(name)
        return (1 if item.path in with_integration else 2), 0

    items.sort(key=rank)


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.05):
    """Poll `predicate` until it returns something truthy; fail after `timeout` seconds."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"condition not met within {timeout} s: {predicate}")
        time.sleep(interval)


def send_unless_refused(sock: zmq.Socket, data: bytes) -> bool:
    """Send on a socket whose Curve handshake the hub may refuse: never blocks. A DEALER or
    PUSH whose handshake was refused before the send has no peer left, and a blocking send
    would wait for ever; False when the message could not be queued."""
    try:
        sock.send(data, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


def hub_messages(hub: HubProcess, exits: int = 1, timeout: float = 20.0) -> list:
    """Every record of `hub`, decoded, once the `exit` messages of `exits` rank processes
    arrived (a rank's exit is its last message: nothing of it can still be on the way)."""
    from scalemon.link.client import HubClient

    client = HubClient(hub.address)

    def arrived() -> list | None:
        records, _ = client.fetch(0)
        messages = [protocol.decode(r) for r in records]
        return messages if sum(m.type == "exit" for m in messages) >= exits else None

    try:
        return wait_for(arrived, timeout=timeout)
    finally:
        client.close()


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short private SCALEMON_HOME (ipc socket paths must stay under ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="smt", dir="/tmp"))
    monkeypatch.setenv("SCALEMON_HOME", str(path))
    monkeypatch.delenv("SCALEMON_HUB", raising=False)
    monkeypatch.delenv("SCALEMON_JOB_ID", raising=False)
    yield path
    for job_file in (path / "jobs").glob("*.json"):  # hubs that ranks started by themselves
        with contextlib.suppress(Exception):
            os.kill(JobFile.read(job_file).pid, signal.SIGKILL)
    shutil.rmtree(path, ignore_errors=True)


# runs the hub as a build of scalemon that speaks another protocol version would
_OTHER_VERSION_HUB = """
import sys
import scalemon.protocol as p
p.PROTOCOL_VERSION = tuple(int(v) for v in sys.argv.pop(1).split("."))
p._OUR_VERSION = list(p.PROTOCOL_VERSION)
for op, since in {"seed": (1, 4), "rank_records": (1, 4), "stop": (1, 5)}.items():
    if p.PROTOCOL_VERSION < since:
        del p.RPC_OPS[op]
from scalemon.hub.main import main
sys.exit(main(sys.argv[1:]))
"""


class HubProcess:
    """A real `python -m scalemon.hub` subprocess (`version`: one that speaks that protocol
    version instead of ours)."""

    def __init__(self, home: Path, job: str, *args: str, version: str | None = None) -> None:
        self.home = home
        self.job = job
        self.log = home / f"hub-{job}-{time.monotonic_ns()}.log"
        hub = ["-m", "scalemon.hub"] if version is None else ["-c", _OTHER_VERSION_HUB, version]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, *hub, "--job", job, "--home", str(home), *args],
                stdout=out, stderr=subprocess.STDOUT,
            )
        self.address = self.wait_ready()

    def wait_ready(self) -> HubAddress:
        path = jobs_dir(self.home) / f"{self.job}.json"

        def ready() -> JobFile | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"hub exited early:\n{self.log.read_text()}")
            if not path.exists():
                return None
            jf = JobFile.read(path)
            return jf if jf.pid == self.proc.pid else None

        return HubAddress.parse(wait_for(ready).address)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)


@pytest.fixture
def start_hub(home: Path) -> Iterator[Callable[..., HubProcess]]:
    """Factory for hub subprocesses, all killed at the end of the test."""
    hubs: list[HubProcess] = []

    def start(job: str = "job1", *args: str, version: str | None = None) -> HubProcess:
        hub = HubProcess(home, job, *args, version=version)
        hubs.append(hub)
        return hub

    yield start
    for hub in hubs:
        hub.kill()


class FakeRank:
    """A PUSH socket that speaks the protocol like an agent, for driving a hub directly."""

    def __init__(self, ctx: zmq.Context, address: HubAddress, job: str, rank: int) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(address.ingest)
        self.job, self.rank, self.seq = job, rank, 0

    def send(self, mtype: str, body: dict) -> None:
        self.sock.send(protocol.encode(mtype, self.job, self.rank, self.seq, body))
        self.seq += 1

    def hello(self, world_size: int = 2, pid: int | None = None) -> None:
        self.send("hello", {"host": os.uname().nodename, "pid": pid or os.getpid(),
                            "world_size": world_size, "local_rank": self.rank})

    def step(self, step: int, loss: float = 1.0) -> None:
        self.send("step", {"step": step, "loss": loss, "tokens": 128, "step_time_s": 0.01})

    def heartbeat(self) -> None:
        self.send("heartbeat", {"phase": "forward", "dropped": 0})


@pytest.fixture
def zctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


TEST_PORTS = range(20000, 32768)
"""Where `free_port` draws from: below Linux's ephemeral range (32768-60999), which the OS
hands out for `bind(port 0)` (the hubs' free ports, rendezvous stores) and for outgoing
connections, so a port given to one test is never also the OS's pick for another process."""
_next_port: list[int] = []


def free_port(count: int = 1) -> int:
    """A loopback tcp port that is free now, with the `count - 1` ports after it (a hub given
    `--listen tcp://HOST:PORT` binds PORT, PORT+1 and PORT+2). Each pytest-xdist worker draws
    from its own slice of `TEST_PORTS`, in turn from a random start, so two workers never pick
    the same port between one's check and its job's bind (a CI run lost a torchrun job that
    way, by all signs: it never reached its first fault)."""
    import random
    import socket

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    size = len(TEST_PORTS) // workers
    low = TEST_PORTS.start + (index % workers) * size
    if not _next_port:
        _next_port.append(random.randrange(size))
    for _ in range(size):
        port = low + _next_port[0] % (size - count)
        _next_port[0] += count
        try:
            with contextlib.ExitStack() as held:
                for extra in range(count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port + extra))
        except OSError:
            continue  # taken (another session's test, a socket in TIME_WAIT): the next
        return port
    raise RuntimeError(f"no {count} free consecutive loopback ports in {low}..{low + size}")


def scalemon_script() -> str:
    """The `scalemon` console script of the install under test: the one beside this Python (a
    venv, as .ci/setup makes), else the one on PATH (`pip install --no-deps .` into a cluster
    image's Python puts it in /usr/local/bin, `--target DIR` in DIR/bin: README, "Run the
    tests"); plain "scalemon" when there is neither, so a test that runs it fails saying the
    command is not found."""
    beside = Path(sys.executable).with_name("scalemon")
    if beside.is_file():
        return str(beside)
    return shutil.which("scalemon") or "scalemon"


SCALEMON = scalemon_script()


def torchrun_cmd(*train_args: str, nproc: int = 2, extra: tuple[str, ...] = (),
                 device: str = "cpu") -> list[str]:
    """`torchrun ... -- demo_train/train.py --device cpu ARGS` with a free rendezvous port.
    The jobs of the tests are about gloo ranks on the CPU: on a machine with fewer GPUs than
    ranks, `--device auto` would (rightly) refuse to start them."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-port", str(free_port()), *extra, "--", str(REPO / "demo_train" / "train.py"),
        "--device", device, *train_args,
    ]


def job_processes(job: str) -> list[psutil.Process]:
    """Processes whose environment names this job (torchrun, ranks, hub)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SCALEMON_JOB_ID") == job:
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill a process started with start_new_session=True, its group and every descendant
    (torchrun puts its workers in sessions of their own, out of the group's reach)."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    proc.wait(timeout=10)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A private directory with a short path, removed after the test: ipc socket paths under it
    must stay under ~100 bytes (pytest's tmp_path is longer, more so under pytest-xdist)."""
    path = Path(tempfile.mkdtemp(prefix="sms", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_disk(short_tmp: Path):
    """A 2 MiB file system of its own (tmpfs; root only)."""
    mount = short_tmp / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill_disk(mount: Path, leave: int) -> Path:
    """Fill `mount` until `leave` bytes are free; returns the filler file."""
    filler = mount / "filler"
    free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler
