"""Streaming new lines of log files to the hub: NCCL's debug log and this process's stderr.

When someone turns NCCL_DEBUG on, the agent points NCCL_DEBUG_FILE at a file in the job's run
directory; torch's TORCH_DISTRIBUTED_DEBUG / TORCH_CPP_LOG_LEVEL output goes to file descriptor 2,
which `StderrCapture` points at a file too. A `LogFollower` reads the new lines of those files
from one daemon thread ("scalemon-logtail") every `interval_s` and hands them to the agent's
non-blocking sender as `log_lines` messages:

    {"source": "nccl" | "stderr", "lines": [str, ...], "dropped": int}

where `dropped` counts the lines of that source left out since its previous message.

A debug log can pour out far more than a monitor should carry, so everything is bounded and
nothing waits: at most `max_lines_per_s * interval_s` lines per source per wake are sent, the
rest are counted and left out; a burst of more than `max_read_bytes` in one file is skipped to
near its end, its lines counted, without being held in memory; a line is cut at
`max_line_chars`; a message the sender refused is counted in the next one. The training thread
never calls into this module on its hot path; the files are only written by NCCL and by the
process's own stderr, and writes to a regular file never block, so even a stalled or dead
follower thread cannot slow, block or kill training. The lines always stay in the files.

`probe(source, after_s, report)` counts the lines of a source read in the next `after_s`
seconds and calls `report(n)` from the follower thread (the count a NCCL_DEBUG toggle reports).
A followed file can be copied to any fd: NCCL's log the agent redirected at start goes back to
the original stdout that way.

A file rewritten in place is read again from its start: NCCL opens NCCL_DEBUG_FILE with
fopen(path, "w") at its first line after every `ncclResetDebugInit()` (src/debug.cc), which
truncates the same inode, and by the next read the new lines may already be longer than the old
file. So besides a file that shrank or was replaced, each read checks that the last bytes read
before are still where they were (`TAIL_BYTES` of them).

The person watching the job still sees its stderr: the follower copies the raw new bytes of the
captured file to the original stderr ("tee"), in order, a fraction of a second later. If the
follower thread dies, the process keeps running and its stderr lands in the file only.
"""

from __future__ import annotations

import contextlib
import os
import select
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .warn import Warnings

Submit = Callable[[str, dict[str, Any]], bool]

_PIPE_BUF = getattr(select, "PIPE_BUF", 512)
_CHUNK = 1 << 20  # bytes read at a time while skipping a burst
TAIL_BYTES = 256
"""How many of the last bytes read a followed file keeps, to see that it was rewritten in place."""


@dataclass
class _Followed:
    """One followed file and how far it was read."""

    path: Path
    source: str
    tee_fd: int | None = None
    offset: int = 0
    ident: tuple[int, int] | None = None  # (st_dev, st_ino) of the file last read
    tail: bytes = b""  # the last bytes before `offset`, as read (b"": none or not known)
    pending: bytes = b""  # an incomplete last line, kept until its newline comes
    discard: int = 0  # skip to the next newline: 1 the line was sent cut, 2 it is dropped
    removed: bool = False


@dataclass
class _Probe:
    """A count of the lines of `source` to report once `due` (monotonic) has come."""

    due: float
    source: str
    start: int
    report: Callable[[int], None]


@dataclass
class _Batch:
    """What one read of one source gave: lines dropped before `lines`, then after them."""

    before: int = 0
    lines: list[str] = field(default_factory=list)
    after: int = 0


class LogFollower:
    """Follows log files from one daemon thread and sends their new lines as `log_lines`
    messages through `submit` (bounded; lines over the budget are counted as dropped)."""

    max_read_bytes = 1 << 20  # more new bytes than this in one file per wake: skip ahead
    keep_bytes = 64 << 10  # how much of the end of such a burst is still read
    tee_timeout_s = 10.0  # how long the thread waits for a stalled reader of the original stderr

    def __init__(
        self,
        submit: Submit,
        warnings: Warnings | None = None,
        *,
        interval_s: float = 0.5,
        max_lines_per_s: int = 200,
        max_line_chars: int = 1000,
        max_lines_per_message: int = 100,
    ) -> None:
        self.submit = submit
        self.warnings = warnings or Warnings()
        self.interval_s = interval_s
        self.max_lines_per_s = max_lines_per_s
        self.max_line_chars = max_line_chars
        self.max_lines_per_message = max(1, max_lines_per_message)
        self.lines_sent = 0
        self.lines_dropped = 0
        self.lines_read: dict[str, int] = {}  # per source: lines read (sent or dropped)
        self._probes: list[_Probe] = []
        self._files: dict[str, _Followed] = {}
        self._carry: dict[str, int] = {}  # per source: dropped lines not yet reported
        self._lock = threading.Lock()  # guards _files, _thread, _stopping
        self._io = threading.Lock()  # held while reading and sending
        self._wake = threading.Event()
        self._stopping = False
        self._final_deadline = 0.0
        self._thread: threading.Thread | None = None

    @property
    def budget(self) -> int:
        """Lines sent per source per wake at most."""
        return max(1, int(self.max_lines_per_s * self.interval_s))

    def follow(
        self, path: Path, source: str, from_start: bool = True, tee_fd: int | None = None,
    ) -> bool:
        """Follow `path` (it may not exist yet) as `source`; with `from_start=False` from the
        current end of an existing file. `tee_fd`: also copy the raw new bytes there. False
        when it was followed already or the follower is stopped."""
        entry = _Followed(Path(path), source, tee_fd)
        if not from_start:
            with contextlib.suppress(OSError):
                st = os.stat(entry.path)
                entry.offset, entry.ident = st.st_size, (st.st_dev, st.st_ino)
                if stat.S_ISREG(st.st_mode):  # never open a FIFO (it would block) or a tty
                    with open(entry.path, "rb") as f:
                        f.seek(max(0, entry.offset - TAIL_BYTES))
                        entry.tail = f.read(max(0, entry.offset - f.tell()))
        key = str(entry.path.absolute())
        with self._lock:
            if self._stopping or key in self._files:
                return False
            self._files[key] = entry
            self._start_thread()
        return True

    def following(self, path: Path) -> bool:
        """True while `path` is followed."""
        return bool(self._entries(path))

    def probe(self, source: str, after_s: float, report: Callable[[int], None],
              catch_up_s: float = 0.2) -> bool:
        """In about `after_s` seconds, call `report(n)` on the follower thread with the number
        of lines of `source` read since now (sent or dropped). What is in the files already
        is read first (waiting at most `catch_up_s`), so it is not counted. False when the
        follower is stopped."""
        if self._io.acquire(timeout=catch_up_s):
            try:
                self._read_and_send(
                    [e for e in self._entries(None) if e.source == source], False,
                    time.monotonic() + catch_up_s)
            finally:
                self._io.release()
        with self._lock:
            if self._stopping:
                return False
            self._probes.append(_Probe(time.monotonic() + after_s, source,
                                       self.lines_read.get(source, 0), report))
            self._start_thread()
        return True

    def _start_thread(self) -> None:
        """Start the follower thread if it is not yet (with `_lock` held)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="scalemon-logtail", daemon=True)
            self._thread.start()

    def _fire_probes(self) -> None:
        """Report the probes whose time has come."""
        now = time.monotonic()
        with self._lock:
            due = [p for p in self._probes if p.due <= now]
            self._probes = [p for p in self._probes if p.due > now]
        for p in due:
            try:
                p.report(self.lines_read.get(p.source, 0) - p.start)
            except Exception as exc:
                self.warnings.once("logtail: probe", "scalemon: reporting a log count: %r", exc)

    def read_now(self, path: Path | None = None, timeout_s: float = 2.0) -> bool:
        """Read (one followed file, or all) and send now, on the calling thread, instead of at
        the next wake; waits at most about `timeout_s`. False when the thread held on."""
        entries = self._entries(path)
        if not self._io.acquire(timeout=timeout_s):
            return False
        try:
            self._read_and_send(entries, False, time.monotonic() + timeout_s)
        finally:
            self._io.release()
        return True

    def unfollow(self, path: Path, timeout_s: float = 2.0) -> bool:
        """A last read of `path` (an incomplete last line is sent too), then stop following it.
        False when the thread held on past `timeout_s`: it may still touch the file's tee fd."""
        entries = self._entries(path)
        got = self._io.acquire(timeout=timeout_s)
        try:
            if got:
                self._read_and_send(entries, True, time.monotonic() + timeout_s)
        finally:
            with self._lock:
                for entry in entries:
                    entry.removed = True
                    self._files.pop(str(entry.path.absolute()), None)
            if got:
                self._io.release()
        return got

    def stop(self, timeout_s: float = 2.0) -> None:
        """A last read of every file, send what is pending, and end the thread (waiting at most
        about `timeout_s`). The files stay followed for `unfollow`."""
        with self._lock:
            self._final_deadline = time.monotonic() + timeout_s
            self._stopping = True
            thread = self._thread
        if thread is None:
            return
        self._wake.set()
        thread.join(timeout_s + 0.5)

    def _entries(self, path: Path | None) -> list[_Followed]:
        with self._lock:
            if path is None:
                return [e for e in self._files.values() if not e.removed]
            entry = self._files.get(str(Path(path).absolute()))
            return [entry] if entry is not None and not entry.removed else []

    def _run(self) -> None:
        try:
            while True:
                self._wake.wait(self.interval_s)
                with self._lock:
                    final = self._stopping
                    deadline = self._final_deadline if final else \
                        time.monotonic() + self.tee_timeout_s
                with self._io:
                    self._read_and_send(self._entries(None), final, deadline)
                if final:
                    return
                self._fire_probes()
        except Exception as exc:  # never let the monitor take the rank down
            self.warnings.once("logtail", "scalemon: following the logs stopped: %r", exc)

    def _read_and_send(self, entries: list[_Followed], final: bool, deadline: float) -> None:
        """Read the new lines of `entries` within the per-source budget and send them."""
        batches: dict[str, _Batch] = {}
        for entry in entries:
            if entry.removed:
                continue
            batch = batches.setdefault(entry.source, _Batch())
            try:
                self._read(entry, batch, final, deadline)
            except Exception as exc:  # give the file up, keep the others
                entry.removed = True
                with self._lock:
                    self._files.pop(str(entry.path.absolute()), None)
                self.warnings.once(
                    f"logtail: {entry.path}", "scalemon: stopped following %s (%s): %r",
                    entry.path, entry.source, exc)
        for source, batch in batches.items():
            read = len(batch.lines) + batch.before + batch.after
            self.lines_read[source] = self.lines_read.get(source, 0) + read
        for source in set(batches) | {s for s, n in self._carry.items() if n}:
            self._send(source, batches.get(source, _Batch()))

    def _read(self, entry: _Followed, batch: _Batch, final: bool, deadline: float) -> None:
        """Read what `entry`'s file got since the last read into `batch`."""
        try:
            st = os.stat(entry.path)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):  # a FIFO, tty, device: reading
            raise OSError(f"{entry.path} is not a regular file")  # would block or take input
        if st is not None:
            ident = (st.st_dev, st.st_ino)
            if entry.ident is not None and (ident != entry.ident or st.st_size < entry.offset):
                self._restart(entry, batch)  # truncated or replaced: read it again from 0
            entry.ident = ident
        raw: list[bytes] = []
        if st is not None and st.st_size > entry.offset:
            with open(entry.path, "rb") as f:
                if not _still_there(f, entry):  # rewritten in place, already past the old end
                    self._restart(entry, batch)
                f.seek(entry.offset)
                size = st.st_size
                if size - entry.offset > self.max_read_bytes:
                    self._skip(entry, f, batch, size - self.keep_bytes, deadline)
                data = f.read(size - entry.offset)
            entry.offset += len(data)
            entry.tail = _last(entry.tail, data)
            self._tee(entry, data, deadline)
            raw = self._split(entry, data, batch)
        if final:
            if entry.pending:
                raw.append(entry.pending)
            elif entry.discard == 2:
                self._drop_before(batch, 1)
            entry.pending, entry.discard = b"", 0
        self._take(raw, batch)

    def _restart(self, entry: _Followed, batch: _Batch) -> None:
        """The file was truncated or replaced: what is pending of the old one is its last line."""
        if entry.pending:
            self._take([entry.pending], batch)
        elif entry.discard == 2:
            self._drop_before(batch, 1)
        entry.offset, entry.pending, entry.discard, entry.tail = 0, b"", 0, b""

    def _skip(self, entry: _Followed, f: Any, batch: _Batch, to: int, deadline: float) -> None:
        """Skip a burst up to about `to`, counting its lines as dropped (and teeing it)."""
        newlines, last = 0, b"\n"
        while entry.offset < to:
            chunk = f.read(min(_CHUNK, to - entry.offset))
            if not chunk:
                break
            entry.offset += len(chunk)
            entry.tail = _last(entry.tail, chunk)
            self._tee(entry, chunk, deadline)
            newlines += chunk.count(b"\n")
            last = chunk[-1:]
        dropped = 0
        if newlines:  # each newline ends a dropped line, but for one already sent cut
            dropped = newlines - (entry.discard == 1)
            entry.discard = 0 if last == b"\n" else 2
        elif entry.discard != 1:  # the line in progress goes on past the burst: dropped
            entry.discard = 2
        entry.pending = b""
        self._drop_before(batch, dropped)

    def _split(self, entry: _Followed, data: bytes, batch: _Batch) -> list[bytes]:
        """Complete lines of `entry.pending + data`; keeps an incomplete last line pending."""
        buf = entry.pending + data
        if entry.discard:
            end = buf.find(b"\n")
            if end < 0:
                entry.pending = b""
                return []
            if entry.discard == 2:
                self._drop_before(batch, 1)
            entry.discard, buf = 0, buf[end + 1:]
        lines = buf.split(b"\n")
        rest = lines.pop()
        if len(rest) > self.max_line_chars and self._too_long(rest):
            lines.append(rest)  # flush it cut; the rest of that line is left out
            rest, entry.discard = b"", 1
        entry.pending = rest
        return lines

    def _too_long(self, raw: bytes) -> bool:
        limit = self.max_line_chars
        return len(raw) > 4 * limit or len(raw.decode("utf-8", "replace")) > limit

    def _text(self, raw: bytes) -> str:
        """One line as text: UTF-8 (bad bytes replaced), no trailing CR/LF, cut with '…'."""
        limit = self.max_line_chars
        cut = len(raw) > 4 * limit
        text = raw[: 4 * limit].decode("utf-8", "replace").rstrip("\r\n")
        if cut or len(text) > limit:
            text = text[:limit] + "…"
        return text

    def _drop_before(self, batch: _Batch, n: int) -> None:
        """`n` lines left out before the batch's lines (or after them, once it has some)."""
        if batch.lines:
            batch.after += n
        else:
            batch.before += n
        self.lines_dropped += n

    def _take(self, raw: list[bytes], batch: _Batch) -> None:
        """Add lines to the batch within the budget; count the others as dropped."""
        room = max(0, self.budget - len(batch.lines))
        for line in raw[:room]:
            batch.lines.append(self._text(line))
        over = len(raw) - min(room, len(raw))
        batch.after += over
        self.lines_dropped += over

    def _send(self, source: str, batch: _Batch) -> None:
        """Send the batch in messages of at most `max_lines_per_message` lines; a refused
        message's lines (and its dropped count) go into the next message's `dropped`."""
        carry = self._carry.get(source, 0) + batch.before
        step = self.max_lines_per_message
        chunks = [batch.lines[i:i + step] for i in range(0, len(batch.lines), step)]
        if not chunks and carry:
            chunks = [[]]  # only a count to report
        for lines in chunks:
            try:
                ok = bool(self.submit(
                    "log_lines", {"source": source, "lines": lines, "dropped": carry}))
            except Exception as exc:
                ok = False
                self.warnings.once("logtail: submit", "scalemon: sending log lines: %r", exc)
            if ok:
                self.lines_sent += len(lines)
                carry = 0
            else:
                self.lines_dropped += len(lines)
                carry += len(lines)
        self._carry[source] = carry + batch.after

    def _tee(self, entry: _Followed, data: bytes, deadline: float) -> None:
        """Copy `data` to the entry's tee fd, in pieces the fd takes without blocking; a reader
        stalled past `deadline` loses the rest of this copy (it stays in the file)."""
        fd = entry.tee_fd
        if fd is None or not data:
            return
        view = memoryview(data)
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        try:
            while view:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.warnings.once(
                        f"logtail tee: {entry.path}", "scalemon: the original output (fd %d) "
                        "does not take output; some of it is only in %s", fd, entry.path)
                    return
                events = poller.poll(min(left, 0.1) * 1000)
                if not events:
                    continue
                if events[0][1] & (select.POLLERR | select.POLLNVAL):
                    raise OSError(f"poll events {events[0][1]:#x} on fd {fd}")
                try:
                    view = view[os.write(fd, view[:_PIPE_BUF]):]
                except BlockingIOError:
                    continue
        except OSError as exc:  # e.g. the reader went away: stop copying, keep sending
            entry.tee_fd = None
            self.warnings.once(
                f"logtail tee: {entry.path}", "scalemon: stopped copying %s to the original "
                "output: %r", entry.path, exc)


class StderrCapture:
    """Points file descriptor 2 at a file whose new lines a `LogFollower` sends (source
    "stderr") and copies to the original stderr, so the console still shows everything.

    Writes to a regular file never block: if the follower thread dies, the process keeps
    running and its stderr lands in the file only."""

    def __init__(self, warnings: Warnings | None = None) -> None:
        self.warnings = warnings
        self.path: Path | None = None
        self._saved: int | None = None  # a dup of the original fd 2
        self._follower: LogFollower | None = None
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """True while fd 2 points at the file."""
        return self._saved is not None

    def start(self, path: Path, follower: LogFollower) -> bool:
        """Send fd 2 into `path` (appended, mode 0o600) and have `follower` stream and tee it.
        True when capturing (a second start changes nothing); False when it could not."""
        with self._lock:
            if self._saved is not None:
                return True
            warnings = self.warnings or follower.warnings
            fd = saved = None
            followed = False
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                saved = os.dup(2)
                followed = follower.follow(Path(path), "stderr", from_start=False, tee_fd=saved)
                if not followed:
                    raise RuntimeError(f"{path} is followed already or the follower stopped")
                _flush_stderr()
                os.dup2(fd, 2)
            except Exception as exc:
                if saved is not None and (not followed or follower.unfollow(Path(path), 0.5)):
                    os.close(saved)
                warnings.once("logtail: stderr", "scalemon: not capturing stderr: %r", exc)
                return False
            finally:
                if fd is not None:
                    os.close(fd)
            self.path, self._saved, self._follower = Path(path), saved, follower
            return True

    def stop(self, timeout_s: float = 2.0) -> None:
        """Point fd 2 back at the original stderr; copy and send what was not yet."""
        with self._lock:
            saved, follower, path = self._saved, self._follower, self.path
            if saved is None or follower is None or path is None:
                return
            self._saved = self._follower = None
            follower.read_now(path, timeout_s / 2)  # catch up while fd 2 still goes there
            _flush_stderr()
            try:
                os.dup2(saved, 2)
            finally:
                # the rest; the fd is closed only when the thread surely no longer uses it
                if follower.unfollow(path, timeout_s / 2):
                    os.close(saved)


def _last(tail: bytes, data: bytes) -> bytes:
    """The last TAIL_BYTES of `tail + data`."""
    return (tail + data[-TAIL_BYTES:])[-TAIL_BYTES:]


def _still_there(f: Any, entry: _Followed) -> bool:
    """True when the bytes last read before `entry.offset` are still there in `f` (or none
    are known): the file grew, rather than being truncated and written again past that point."""
    if not entry.tail or entry.offset < len(entry.tail):
        return True
    f.seek(entry.offset - len(entry.tail))
    return f.read(len(entry.tail)) == entry.tail


def _flush_stderr() -> None:
    for stream in (sys.stderr, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
