"""The command line's edges a new user meets (issue #38): dashboards started without a terminal,
abbreviated and mistyped options and flag names, and pointers to jobs that ended. Real `scalemon`
processes against real hubs; the job picker in the real app (Pilot)."""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import fcntl
import os
import pty
import re
import select
import shlex
import signal
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import zmq
from test_tui_app import header, until
from test_tui_snapshots import screen_text

from conftest import SCALEMON, FakeRank, HubProcess, job_processes, wait_for
from scalemon.cli.main import build_parser
from scalemon.home.history import history_path
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir
from scalemon.tui.app import DashboardApp
from scalemon.tui.attach import make_app
from scalemon.tui.feed import HubFeed
from scalemon.tui.screens.pick_job import PickJobScreen

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("scalemon", "agent", "hub", "relay", "tui", "demo_train", "bench", "contrib")
"""Every folder of the product with Python that parses a command line."""


def scalemon(*args: str, home: Path, timeout: float = 20) -> subprocess.CompletedProcess:
    """`scalemon ARGS` as from a script: stdin /dev/null, stdout a pipe (no terminal). A run
    past `timeout` (a dashboard drawing into the pipe) is killed, and fails the test."""
    proc = subprocess.Popen([SCALEMON, *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SCALEMON_HOME": str(home)},
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"`scalemon {' '.join(args)}` still ran after {timeout} s") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# ---- item 2: a dashboard needs a terminal ----------------------------------------------------

def test_attach_without_a_terminal_refuses_at_once_naming_snapshot(
        home: Path, start_hub: Callable[..., HubProcess]):
    start_hub("ttyjob")
    began = time.monotonic()
    out = scalemon("attach", "ttyjob", home=home)
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""  # nothing drawn into the pipe
    assert out.stderr == ("scalemon attach: the dashboard needs a terminal, and stdin and "
                          "stderr are not one: `scalemon snapshot ttyjob` prints the job's "
                          "state instead\n")
    assert time.monotonic() - began < 20


def test_the_demo_without_a_terminal_refuses_before_starting_a_job(home: Path):
    out = scalemon("demo", "--job", "ttydemo", "--ranks", "3", "--max-steps", "7",
                   "--step-delay", "0.25", "--preset", "small", "--batch-size", "5", home=home)
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith("scalemon demo: its dashboard needs a terminal, and stdin and "
                           "stderr are not one: ")
    assert line.endswith("read it with `scalemon snapshot ttydemo`")
    run = shlex.split(line.split("(`", 1)[1].split("`)", 1)[0])  # the job without a dashboard
    assert run[0] == "SCALEMON_JOB_ID=ttydemo"
    assert run[run.index("--nproc-per-node") + 1] == "3"
    trainer = run[run.index("--") + 1:]  # the user's options, as the demo would run them
    assert trainer[0].endswith("train.py") and trainer[1:] == [
        "--monitor", "--device", "cpu", "--max-steps", "7", "--step-delay", "0.25",
        "--preset", "small", "--batch-size", "5"]
    assert not (home / "demo").exists() and not (home / "run").exists()  # no job, no log


class OnAPty:
    """`scalemon ARGS` with stdin, stdout and stderr on a 100x30 pseudo-terminal but those
    given as files; a thread reads what it draws there (a full pty would block it)."""

    def __init__(self, *args: str, home: Path, **streams: object) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        self.master, self.drawn = master, bytearray()
        std = {name: streams.get(name, slave) for name in ("stdin", "stdout", "stderr")}
        self.proc = subprocess.Popen([SCALEMON, *args], **std,  # type: ignore[call-overload]
                                     env={**os.environ, "SCALEMON_HOME": str(home)},
                                     start_new_session=True)
        os.close(slave)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with contextlib.suppress(OSError):  # EIO once the process closed its side
            while chunk := os.read(self.master, 65536):
                self.drawn += chunk

    def exit_code(self, timeout: float) -> int:
        """The exit status; a run past `timeout` is killed, and fails the test."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still ran after {timeout} s") from None

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        os.close(self.master)


def test_attach_refuses_when_only_stderr_is_not_a_terminal(
        home: Path, tmp_path: Path, start_hub: Callable[..., HubProcess]):
    """Textual draws on stderr: `attach 2>err.log` on a terminal would draw into the file."""
    start_hub("ttyjob")
    with open(tmp_path / "err.log", "w") as err:
        run = OnAPty("attach", "ttyjob", home=home, stderr=err)
    try:
        assert run.exit_code(timeout=20) == 2
        assert (tmp_path / "err.log").read_text() == (
            "scalemon attach: the dashboard needs a terminal, and stderr is not one: "
            "`scalemon snapshot ttyjob` prints the job's state instead\n")
    finally:
        run.close()


def test_attach_with_only_stdout_redirected_runs_the_dashboard(
        home: Path, tmp_path: Path, start_hub: Callable[..., HubProcess]):
    """stdout is not the dashboard's: `attach > out.txt` or `| tee` draws on the terminal."""
    start_hub("ttyjob")
    with open(tmp_path / "out.txt", "w") as out:
        run = OnAPty("attach", "ttyjob", home=home, stdout=out)
    try:
        wait_for(lambda: b"ttyjob" in run.drawn or run.proc.poll() is not None, timeout=60,
                 interval=0.2)
        time.sleep(1.0)  # a refusal would have ended it by now
        assert run.proc.poll() is None, bytes(run.drawn)  # drawing: not refused
        os.write(run.master, b"q")
        assert run.exit_code(timeout=30) == 0, bytes(run.drawn)
        assert (tmp_path / "out.txt").read_text() == ""  # nothing drawn into stdout
    finally:
        run.close()


def typed_into_a_shell(command: str, home: Path, timeout: float) -> tuple[str, float]:
    """`command` as typed at a shell prompt in a terminal (a pty that the shell's session
    controls, as in a tmux pane), then `echo RC=$?`: what the terminal showed and the seconds
    it took. A run past `timeout` fails the test (what is left of it is killed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    began = time.monotonic()
    shell = subprocess.Popen(
        ["sh", "-c", f"{command}; echo RC=$?"], stdin=slave, stdout=slave, stderr=slave,
        env={**os.environ, "SCALEMON_HOME": str(home)}, start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))  # the shell's terminal
    os.close(slave)
    shown = bytearray()
    try:
        while b"RC=" not in shown or not shown.endswith(b"\n"):
            left = timeout - (time.monotonic() - began)
            if left <= 0:
                raise AssertionError(f"`{command}` still ran after {timeout} s: {bytes(shown)!r}")
            with contextlib.suppress(OSError):  # EIO: every process left the terminal
                if select.select([master], [], [], min(left, 0.2))[0]:
                    shown += os.read(master, 65536)
        return shown.decode(errors="replace"), time.monotonic() - began
    finally:
        for proc in [shell, *psutil.Process(shell.pid).children(recursive=True)]:
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        shell.wait()
        os.close(master)


def test_the_demo_in_the_background_of_its_terminal_refuses_at_once_and_starts_no_job(
        home: Path):
    """`timeout 5 scalemon demo` at a prompt: timeout runs it in a process group of its own,
    in the terminal's background, where the terminal stopped it at its first draw: a blank
    screen, and timeout's SIGTERM never ended it (nor its job)."""
    job = f"bgdemo{os.getpid()}"
    try:
        shown, took = typed_into_a_shell(f"timeout 20 {SCALEMON} demo --job {job} --ranks 3",
                                         home, timeout=40)
        assert shown.endswith("RC=2\r\n"), shown
        (line,) = shown.splitlines()[:-1]
        assert line.startswith(
            "scalemon demo: it runs in the background of its terminal (`timeout` without "
            "--foreground, or `&`), where the terminal would stop its dashboard: run it in the "
            "foreground (`timeout --foreground S scalemon demo`), or run the job without a "
            f"dashboard (`SCALEMON_JOB_ID={job} "), line
        assert "--nproc-per-node 3 " in line
        assert line.endswith(f"read it with `scalemon snapshot {job}`")
        assert took < 20  # at once, not when timeout gave up
        assert not job_processes(job)
        assert not (home / "demo").exists() and not (home / "run").exists()  # no job, no log
    finally:
        for proc in job_processes(job):
            proc.kill()


def test_attach_in_the_background_of_its_terminal_refuses_at_once(
        home: Path, start_hub: Callable[..., HubProcess]):
    start_hub("bgjob")
    shown, took = typed_into_a_shell(f"timeout 20 {SCALEMON} attach bgjob", home, timeout=40)
    assert shown == (
        "scalemon attach: it runs in the background of its terminal (`timeout` without "
        "--foreground, or `&`), where the terminal would stop the dashboard: run it in the "
        "foreground (`timeout --foreground S scalemon attach`), or `scalemon snapshot bgjob` "
        "prints the job's state instead\r\nRC=2\r\n")
    assert took < 20


def test_attach_without_a_terminal_looks_the_job_up_once_without_waiting(
        home: Path, start_hub: Callable[..., HubProcess], zctx: zmq.Context):
    began = time.monotonic()
    out = scalemon("attach", "nonexist", home=home)  # the default --wait is 30 s
    assert out.returncode == 2
    assert out.stderr == ("scalemon attach: no live hub and no history for job 'nonexist' "
                          "(live jobs: none)\n")
    none = scalemon("attach", home=home)
    assert none.returncode == 2 and "no live scalemon job found" in none.stderr
    assert time.monotonic() - began < 20
    hub = start_hub("endedjob", "--linger", "0.5")
    _end_job(hub, zctx, crash=True)
    assert hub.proc.wait(timeout=30) == 0
    typo = scalemon("attach", "endedjb", home=home)  # the job that ended is named
    assert typo.returncode == 2
    assert "no live hub and no history for job 'endedjb' (live jobs: none); the last job to " \
           "end: endedjob (crashed at " in typo.stderr


# ---- item 7: no abbreviations; the closest option or flag named ------------------------------

def _parser_calls(tree: ast.AST) -> Iterator[ast.Call]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("ArgumentParser", "add_parser"):
                yield node


def _refuses_abbreviations(call: ast.Call) -> bool:
    return any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant)
               and k.value.value is False for k in call.keywords)


def test_every_argument_parser_of_the_product_refuses_abbreviations():
    """Each `argparse.ArgumentParser(...)` of the product says allow_abbrev=False, and so does
    each `add_parser` of such a parser (a subparser does not inherit it); scalemon's own
    parsers (`options.Parser`, the demo trainer's `FlagParser`) and every subcommand of
    `scalemon`, nested ones too, refuse abbreviations by themselves."""
    plain, without = 0, []
    for folder in PRODUCT:
        for path in (REPO / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            calls = list(_parser_calls(tree))
            own = not any(isinstance(c.func, ast.Attribute) and c.func.attr == "ArgumentParser"
                          or getattr(c.func, "id", "") == "ArgumentParser" for c in calls)
            for call in calls:
                is_sub = isinstance(call.func, ast.Attribute) and call.func.attr == "add_parser"
                if is_sub and own:
                    continue  # a subcommand of options.Parser: checked below, as built
                plain += 1
                if not _refuses_abbreviations(call):
                    without.append(f"{path.relative_to(REPO)}:{call.lineno}")
    assert plain >= 15 and without == []

    from scalemon.demo_train.train_flags import FlagParser

    assert FlagParser(prog="train.py").allow_abbrev is False
    seen = 0
    todo = [build_parser()]
    while todo:
        parser = todo.pop()
        assert parser.allow_abbrev is False, parser.prog
        seen += 1
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    assert seen > 15  # scalemon, its commands, `keys`' actions


def test_an_abbreviated_option_is_refused_with_the_closest_named(home: Path):
    demo = scalemon("demo", "--rank", "3", home=home)
    assert demo.returncode == 2
    assert demo.stderr.startswith("usage: scalemon demo")
    assert "scalemon demo: error: unrecognized arguments: --rank (did you mean --ranks?) 3" \
        in demo.stderr
    assert not (home / "demo").exists()
    toggle = scalemon("toggle", "somejob", "--restrat", "NCCL_DEBUG=INFO", home=home)
    assert toggle.returncode == 2
    assert toggle.stderr.startswith("usage: scalemon toggle")  # the command's, not the top's
    assert ("scalemon toggle: error: unrecognized arguments: --restrat (did you mean "
            "--restart?) NCCL_DEBUG=INFO") in toggle.stderr
    nested = scalemon("keys", "list", "--jsn", home=home)
    assert nested.returncode == 2 and nested.stderr.startswith("usage: scalemon keys list")
    assert "--jsn (did you mean --json?)" in nested.stderr


def test_a_mistyped_flag_name_gets_the_closest_and_the_list(home: Path):
    out = scalemon("toggle", "NCCL_DEBG=INFO", home=home)
    assert out.returncode == 3  # refused
    assert ("scalemon toggle: refused: NCCL_DEBG is not among the flags scalemon can change "
            "(unknown or not safe to change in a running job) (did you mean NCCL_DEBUG?); "
            "it changes: NCCL_DEBUG, ") in out.stderr
    far = scalemon("toggle", "NCCL_FOO=1", home=home)
    assert "did you mean" not in far.stderr and "it changes: NCCL_DEBUG" in far.stderr


# ---- item 5: pickers and pointers name each job's state ---------------------------------------

def test_a_mistyped_command_gets_the_closest_named(home: Path):
    out = scalemon("snapsht", "myjob", home=home)
    assert out.returncode == 2 and out.stdout == ""
    assert "scalemon: error: argument COMMAND: invalid choice: 'snapsht' (did you mean " \
           "snapshot?) (choose from 'snapshot', 'jobs', " in out.stderr
    far = scalemon("xyzzy", home=home)  # nothing close: no guess
    assert "invalid choice: 'xyzzy' (choose from 'snapshot', " in far.stderr
    assert "did you mean" not in far.stderr


def _end_job(hub: HubProcess, zctx: zmq.Context, crash: bool) -> None:
    """One rank says hello, steps and exits (finished, or with an error), so the job ends
    while its hub lingers; returns when the job file says so."""
    rank = FakeRank(zctx, hub.address, hub.job, 0)
    rank.hello(world_size=1)
    rank.step(1)
    rank.send("exit", {"reason": "exception", "exit_code": 1, "step": 1, "error": "boom"}
              if crash else {"reason": "finished", "exit_code": 0, "step": 1})
    path = jobs_dir(hub.home) / f"{hub.job}.json"
    wait_for(lambda: JobFile.read(path).state != "running", timeout=20)


def test_the_picker_names_each_ended_jobs_state_and_calls_none_live(
        home: Path, start_hub: Callable[..., HubProcess], zctx: zmq.Context):
    for job, crash in (("pickdone", False), ("pickboom", True)):
        _end_job(start_hub(job, "--linger", "120"), zctx, crash)
    app = make_app(None, home=home)
    assert isinstance(app, DashboardApp)

    async def scenario() -> None:
        async with app.run_test(size=(120, 30)) as pilot:
            await until(pilot, lambda: isinstance(app.screen, PickJobScreen))
            await pilot.pause(0.2)
            text = screen_text(app)
            assert "no live job; 2 ended jobs whose hubs still serve them: pick one" in text
            assert "live jobs" not in text
            assert re.search(r"\bpickdone +finished +world size 1 ", text), text
            assert re.search(r"\bpickboom +crashed +world size 1 ", text), text

    asyncio.run(scenario())


def test_with_no_live_hub_snapshot_and_attach_name_the_last_ended_job(
        home: Path, start_hub: Callable[..., HubProcess], zctx: zmq.Context):
    hub = start_hub("justended", "--linger", "0.5")
    _end_job(hub, zctx, crash=True)
    assert hub.proc.wait(timeout=30) == 0  # its hub lingered, then exited
    snap = scalemon("snapshot", home=home)
    assert snap.returncode == 2
    assert "no live scalemon hub found" in snap.stderr
    assert ("the last job to end: justended (crashed at ") in snap.stderr
    assert ("`scalemon summary justended` or `scalemon snapshot justended` replays its "
            "history") in snap.stderr
    attach = scalemon("attach", "--wait", "0", home=home)
    assert attach.returncode == 2
    assert "no live scalemon job found" in attach.stderr
    assert "the last job to end: justended (crashed at " in attach.stderr
    summary = scalemon("summary", "justended", home=home)  # what the pointer says works
    assert summary.returncode == 0, summary.stderr


def test_snapshot_of_an_unknown_job_points_to_jobs_and_the_last_ended_job(
        home: Path, start_hub: Callable[..., HubProcess], zctx: zmq.Context):
    alone = scalemon("snapshot", "nosuchjob", home=home)
    assert alone.returncode == 2
    assert alone.stderr == (
        "scalemon snapshot: no live hub for job 'nosuchjob' (live jobs: none), and no history "
        f"file at {history_path('nosuchjob', home)}: is the job id right? (`scalemon jobs` lists "
        "live jobs)\n")
    hub = start_hub("ended1", "--linger", "0.5")
    _end_job(hub, zctx, crash=False)
    assert hub.proc.wait(timeout=30) == 0
    typo = scalemon("snapshot", "endd1", home=home)
    assert typo.returncode == 2
    assert "(`scalemon jobs` lists live jobs); the last job to end: ended1 (finished at " \
           in typo.stderr
    assert "`scalemon summary ended1` or `scalemon snapshot ended1` replays its history" \
           in typo.stderr


def test_a_mistyped_job_id_names_the_closest_and_jobs_ended_whose_hubs_linger(
        home: Path, start_hub: Callable[..., HubProcess], zctx: zmq.Context):
    """A repeat of the new-user pass: `snapshot nu-hng` named older jobs and not nu-hang,
    which had just ended and whose hub still lingered to serve it."""
    hub = start_hub("nu-hang", "--linger", "60")
    _end_job(hub, zctx, crash=False)
    typo = scalemon("snapshot", "nu-hng", home=home)
    assert typo.returncode == 2
    assert "no live hub for job 'nu-hng' (did you mean nu-hang?)" in typo.stderr
    assert "the last job to end: nu-hang (finished at " in typo.stderr
    assert ", its hub lingers)" in typo.stderr
    far = scalemon("snapshot", "zzz", home=home)
    assert "did you mean" not in far.stderr


# ---- item 9: the wait for ranks says what is going on ------------------------------------------

def test_the_demos_header_tells_its_start_up_then_how_many_ranks_connected(
        home: Path, zctx: zmq.Context, start_hub: Callable[..., HubProcess]):
    launcher = subprocess.Popen(["sleep", "60"])  # stands for the demo's torchrun
    app = DashboardApp(HubFeed(job="slowstart", home=home), home=home, job_process=launcher)
    plain = DashboardApp(HubFeed(job="slowstart", home=home), home=home)

    async def scenario() -> None:
        async with plain.run_test(size=(160, 30)) as pilot:
            await until(pilot, lambda: "waiting for ranks: none has reported yet"
                        in header(plain))
        async with app.run_test(size=(160, 30)) as pilot:
            await until(pilot, lambda: "starting: the ranks import torch (torchrun launched"
                        in header(app))
            assert "the first run takes ~10 s" in header(app)
            hub = start_hub("slowstart")
            FakeRank(zctx, hub.address, "slowstart", 0).hello(world_size=2)
            await until(pilot, lambda: "starting: 1 of 2 ranks connected, waiting for the "
                                       "first step" in header(app), timeout=20)

    try:
        asyncio.run(scenario())
    finally:
        launcher.kill()
        launcher.wait()
