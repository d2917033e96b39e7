"""The log follower: new lines of NCCL's debug log and of the process's stderr go to the hub,
bounded and counted, and the console still sees stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, wait_for
from scalemon.agent.logtail import LogFollower
from scalemon.agent.warn import Warnings


class Inbox:
    """A fake `Sender.submit`: keeps the messages it accepts; `refuse` refuses the next ones."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.refused: list[dict[str, Any]] = []
        self.refuse = 0
        self.lock = threading.Lock()

    def __call__(self, mtype: str, body: dict[str, Any]) -> bool:
        assert mtype == "log_lines"
        with self.lock:
            if self.refuse:
                self.refuse -= 1
                self.refused.append(body)
                return False
            self.messages.append(body)
            return True

    def lines(self, source: str | None = None) -> list[str]:
        with self.lock:
            return [line for m in self.messages if source in (None, m["source"])
                    for line in m["lines"]]

    def dropped(self) -> int:
        with self.lock:
            return sum(m["dropped"] for m in self.messages)


@pytest.fixture
def inbox() -> Inbox:
    return Inbox()


@pytest.fixture
def follower(inbox: Inbox):
    made: list[LogFollower] = []

    def make(**kw: Any) -> LogFollower:
        kw.setdefault("interval_s", 0.02)
        f = LogFollower(inbox, Warnings(), **kw)
        made.append(f)
        return f

    yield make
    for f in made:
        f.stop()


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def test_follows_a_file_that_appears_later(tmp_path: Path, inbox: Inbox, follower) -> None:
    path = tmp_path / "nccl.log"
    f = follower()
    assert f.follow(path, "nccl")
    assert not f.follow(path, "nccl")  # the same path twice: once
    assert [t.name for t in threading.enumerate()].count("scalemon-logtail") >= 1
    append(path, b"host:1:2 NCCL INFO Bootstrap\nhost:1:2 NCCL INFO ring 0\n")
    wait_for(lambda: len(inbox.lines()) == 2)
    assert inbox.lines("nccl") == ["host:1:2 NCCL INFO Bootstrap", "host:1:2 NCCL INFO ring 0"]
    assert inbox.messages[0]["dropped"] == 0
    assert f.lines_sent == 2 and f.lines_dropped == 0


def test_from_start_false_skips_what_is_there(tmp_path: Path, inbox: Inbox, follower) -> None:
    path = tmp_path / "old.log"
    path.write_bytes(b"old 1\nold 2\n")
    f = follower()
    f.follow(path, "nccl", from_start=False)
    append(path, b"new\n")
    wait_for(lambda: inbox.lines())
    f.stop()
    assert inbox.lines() == ["new"]


def test_incomplete_lines_arrive_whole_and_in_order(
    tmp_path: Path, inbox: Inbox, follower,
) -> None:
    path = tmp_path / "x.log"
    f = follower(interval_s=3600)  # only read_now reads: each chunk is read on its own
    f.follow(path, "nccl")
    for chunk in [b"hel", b"lo wor", b"ld\r\nsec", b"ond\nthi", b"rd"]:
        append(path, chunk)
        assert f.read_now()
    assert inbox.lines() == ["hello world", "second"]  # "third" waits for its newline
    append(path, b" line\n")
    f.read_now()
    assert inbox.lines() == ["hello world", "second", "third line"]


def test_long_lines_are_cut(tmp_path: Path, inbox: Inbox, follower) -> None:
    path = tmp_path / "x.log"
    f = follower(max_line_chars=50)
    f.follow(path, "nccl")
    append(path, b"x" * 200 + b"\n" + "é".encode() * 60 + b"\nshort\n")
    wait_for(lambda: len(inbox.lines()) == 3)
    assert inbox.lines() == ["x" * 50 + "…", "é" * 50 + "…", "short"]
    # an incomplete line already too long is sent cut; its rest is left out
    append(path, b"y" * 200)
    wait_for(lambda: len(inbox.lines()) == 4)
    append(path, b"yyy\nnext\n")
    wait_for(lambda: len(inbox.lines()) == 5)
    assert inbox.lines()[3:] == ["y" * 50 + "…", "next"]
    assert f.lines_dropped == 0


def test_bad_utf8_is_replaced(tmp_path: Path, inbox: Inbox, follower) -> None:
    path = tmp_path / "x.log"
    follower().follow(path, "nccl")
    append(path, b"bad \xff byte\n")
    wait_for(lambda: inbox.lines())
    assert inbox.lines() == ["bad \ufffd byte"]


def test_truncation_and_replacement_restart(tmp_path: Path, inbox: Inbox, follower) -> None:
    path = tmp_path / "x.log"
    follower().follow(path, "nccl")
    append(path, b"first line\nsecond line\n")
    wait_for(lambda: len(inbox.lines()) == 2)
    path.write_bytes(b"again\n")  # truncated, shorter than what was read
    wait_for(lambda: len(inbox.lines()) == 3)
    new = tmp_path / "new.log"
    new.write_bytes(b"replaced, and longer than everything before it was\n")
    os.replace(new, path)  # a new file, larger than the offset: told by its inode
    wait_for(lambda: len(inbox.lines()) == 4)
    assert inbox.lines() == ["first line", "second line", "again",
                             "replaced, and longer than everything before it was"]


def test_budget_drops_and_counts(tmp_path: Path, inbox: Inbox, follower) -> None:
    path = tmp_path / "x.log"
    f = follower(max_lines_per_s=100, interval_s=0.1, max_lines_per_message=4)
    assert f.budget == 10
    f.follow(path, "nccl")
    t0 = time.monotonic()
    append(path, b"".join(b"line %04d\n" % i for i in range(5000)))
    wait_for(lambda: f.lines_sent + f.lines_dropped == 5000)
    elapsed = time.monotonic() - t0
    f.stop()
    assert f.lines_sent + f.lines_dropped == 5000
    assert 1 <= f.lines_sent <= 10 * (elapsed / 0.1 + 3)  # 10 a wake at most
    assert f.lines_dropped > 0
    assert len(inbox.lines()) == f.lines_sent
    assert inbox.dropped() == f.lines_dropped  # every dropped line was reported
    assert all(len(m["lines"]) <= 4 for m in inbox.messages)
    lines = inbox.lines()
    assert lines[0] == "line 0000" and lines == sorted(lines)


def test_a_burst_is_skipped_to_its_end(tmp_path: Path, inbox: Inbox, follower) -> None:
    path = tmp_path / "x.log"
    f = follower(interval_s=3600, max_lines_per_s=20_000)  # 72M lines a wake: no budget cut
    f.follow(path, "nccl")
    n = 300_000  # ~3.3 MiB, over max_read_bytes
    append(path, b"".join(b"burst %06d\n" % i for i in range(n)))
    f.read_now()
    f.stop()
    assert f.lines_sent + f.lines_dropped == n
    lines = inbox.lines()
    assert 0 < len(lines) <= f.keep_bytes // len(b"burst 000000\n") + 1
    assert lines[-1] == f"burst {n - 1:06d}"  # the end of the burst was read
    assert inbox.dropped() == f.lines_dropped
    assert all(line.startswith("burst ") and len(line) == 12 for line in lines)


def test_a_refused_message_is_counted_in_the_next(
    tmp_path: Path, inbox: Inbox, follower,
) -> None:
    path = tmp_path / "x.log"
    f = follower()
    inbox.refuse = 1
    f.follow(path, "nccl")
    append(path, b"a\nb\n")
    wait_for(lambda: inbox.refused)
    assert inbox.refused[0]["lines"] == ["a", "b"]
    append(path, b"c\n")
    wait_for(lambda: "c" in inbox.lines())
    assert inbox.messages[0]["dropped"] == 2  # the two refused lines
    assert inbox.lines() == ["c"]
    assert f.lines_sent == 1 and f.lines_dropped == 2
    assert inbox.dropped() == 2


def test_a_failing_file_is_given_up_quietly(tmp_path: Path, inbox: Inbox) -> None:
    warned: list[str] = []

    class Recording(Warnings):
        def once(self, key: str, message: str, *args: object) -> bool:
            warned.append(key)
            return super().once(key, message, *args)

    f = LogFollower(inbox, Recording(), interval_s=0.02)
    try:
        f.follow(tmp_path, "nccl")  # a directory: reading it fails
        good = tmp_path / "good.log"
        f.follow(good, "nccl")
        append(good, b"fine\n")
        wait_for(lambda: inbox.lines() == ["fine"])
        assert warned == [f"logtail: {tmp_path}"]
        append(good, b"still\n")
        wait_for(lambda: inbox.lines() == ["fine", "still"])
        assert warned == [f"logtail: {tmp_path}"]  # said once
    finally:
        f.stop()


def test_stop_sends_what_is_pending(tmp_path: Path, inbox: Inbox) -> None:
    path = tmp_path / "x.log"
    f = LogFollower(inbox, Warnings(), interval_s=3600)
    f.follow(path, "nccl")
    append(path, b"one\nno newline yet")
    f.stop()
    assert inbox.lines() == ["one", "no newline yet"]
    assert f._thread is not None and not f._thread.is_alive()
    assert not f.follow(tmp_path / "other.log", "nccl")  # stopped


CAPTURE = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from scalemon.agent.logtail import LogFollower, StderrCapture

    messages = []
    def submit(mtype, body):
        messages.append(body)
        return True

    def lines():
        return [line for m in messages for line in m["lines"]]

    follower = LogFollower(submit, interval_s=0.05)
    capture = StderrCapture()
    assert capture.start(Path(sys.argv[1]), follower)
    assert capture.start(Path(sys.argv[1]), follower)  # twice: once
    print("from python 1", file=sys.stderr)
    end = time.monotonic() + 10  # this one is copied by the thread
    while "from python 1" not in lines() and time.monotonic() < end:
        time.sleep(0.01)
    os.write(2, b"from fd 2\\n")
    print("from python 2", file=sys.stderr)
    os.write(2, b"no newline")
    capture.stop()  # the rest is copied here
    capture.stop()
    os.write(2, b"\\nafter stop\\n")
    follower.stop()
    print(json.dumps(messages))
""")


def test_stderr_capture_sends_and_tees(tmp_path: Path) -> None:
    script = tmp_path / "capture.py"
    script.write_text(CAPTURE)
    log = tmp_path / "stderr.log"
    proc = subprocess.run(
        [sys.executable, str(script), str(log)], cwd=REPO, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    messages = json.loads(proc.stdout)
    assert {m["source"] for m in messages} == {"stderr"}
    lines = [line for m in messages for line in m["lines"]]
    assert lines == ["from python 1", "from fd 2", "from python 2", "no newline"]
    # the console saw everything once, in order, and fd 2 is its own again after stop()
    assert proc.stderr == b"from python 1\nfrom fd 2\nfrom python 2\nno newline\nafter stop\n"
    assert log.read_bytes() == b"from python 1\nfrom fd 2\nfrom python 2\nno newline"
    assert log.stat().st_mode & 0o777 == 0o600
