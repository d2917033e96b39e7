"""A job's history: every accepted message in arrival order, numbered from 0.

Records live in an append-only file, the tail (`history.smlog` in the job's run directory: a
4-byte big-endian length then the message frame, repeated), sealed every `chunks.SEAL_BYTES`
into a compressed chunk with an index entry (`scalemon.home.chunks`), and the newest
`memory_limit` of them also in memory. A history of an earlier scalemon (the tail alone) reads
as one with no chunks yet. The hub writes it (`History`); a hub restarted on the same run
directory reopens the file, drops a torn last record and carries on numbering. `scalemon
snapshot` and the dashboard read it when the hub is gone (`scalemon.home.history_read`:
`read_messages`, `read_selected`, re-exported here, and `history_path`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import secrets
import time
import zlib
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from scalemon.home import chunks
from scalemon.home.chunks import Known
from scalemon.home.history_read import (  # noqa: F401 - the readers, where they always were
    ReadStats,
    Selection,
    iter_messages,
    read_messages,
    read_records,
    read_selected,
    scan,
)
from scalemon.home.paths import run_dir
from scalemon.home.safefs import write_private
from scalemon.home.sealed import Sealed, prepare_chunks

log = logging.getLogger("scalemon.hub")

HISTORY_FILE = "history.smlog"
"""The history's file name inside a job's run directory."""
ID_SUFFIX = ".id"
RETRY_S = 2.0
"""How often a hub that cannot write its history tries again."""
"""`history.smlog.id`: the random id made when the history file was created."""
DAMAGED_SUFFIX = ".damaged"
"""`history.smlog.damaged`: bytes a reopening hub found damaged, kept aside."""
LOSS_SUFFIX = ".loss"
"""`history.smlog.loss`: what the hub of the history could not write (`LossMarker`)."""
_LEN = 4


def history_path(job: str, home: Path | None = None) -> Path:
    """Where the history of `job` is (whether or not it exists); ValueError for a bad job id."""
    return run_dir(job, home) / HISTORY_FILE


class History:
    """Numbered, persistent, bounded-in-memory record store."""

    def __init__(self, path: Path, memory_limit: int = 1_000_000,
                 seal_bytes: int = chunks.SEAL_BYTES) -> None:
        self.path = path
        self.memory_limit = memory_limit
        self.seal_bytes = seal_bytes
        self.seal_error: str | None = None  # why the tail is no longer sealed, if so
        self.seal_s = 0.0  # seconds the hub's thread spent sealing (writing chunks, the tail)
        self._sealer: ThreadPoolExecutor | None = None  # compresses sealed records
        self._seal_job: Future | None = None
        self._closing = False
        self.on_sealed: Callable[[int], None] | None = None
        """Called on the hub's thread with the number of sealed records after each seal (a
        hub may start `python -m scalemon.link.checkpoint` then); its errors are logged."""
        self._offsets = array("Q")  # tail file offset of record tail_base + i
        self._covers: list[Known | None] = []  # what each tail record covers, when told
        created = not path.exists() and not path.with_name(path.name + chunks.CHUNKS_SUFFIX
                                                           ).exists()
        self._sealed = Sealed(path, path.with_name(path.name + DAMAGED_SUFFIX))
        self._tail_base = self._sealed.count
        self._memory: deque[bytes] = deque()
        self._memory_base = self._tail_base  # sequence number of self._memory[0]
        self._end = self._recover()
        self.id = _history_id(path, created or self._renumbered)
        self.base = len(self)
        self._writer = open(path, "ab", buffering=1 << 16)  # noqa: SIM115 - lives with self
        self._reader = open(path, "rb")  # noqa: SIM115
        self._on_disk = self._end  # file offset up to which records are written to the OS
        self._unwritten: list[bytes] = []  # appended since, in order
        self.write_error: str | None = None  # why records are not being written, if so
        self.write_error_since: float | None = None
        self._next_retry = 0.0
        self.lost = 0  # records given up at close (the disk stayed full)
        self.earlier_loss = earlier_loss_text(path)  # what earlier hubs could not write
        self._earlier_lost = earlier_lost(path)
        self._earlier_told_at: int | None = None
        self._marker = LossMarker(path.with_name(path.name + LOSS_SUFFIX))
        self._marked_unwritten = -1
        self._mark()

    def _mark(self, closed: bool = False) -> None:
        """Say in the loss marker, in place, what is not written (see `LossMarker`)."""
        self._marked_unwritten = len(self._unwritten)
        self._marker.update({
            "pid": os.getpid(), "closed": closed, "records": len(self),
            "unwritten": len(self._unwritten), "lost": self.lost, "error": self.write_error,
            "since": self.write_error_since, "earlier_lost": self._earlier_lost,
            "t": time.time()})

    def earlier_loss_told(self, seq: int) -> None:
        """Record `seq` tells the earlier loss: once it is written, the marker forgets it."""
        self._earlier_told_at = seq

    @property
    def identity(self) -> dict[str, object]:
        """What tells this history apart from another under the same name: the file's random
        id, and how many records it held when this hub opened it (`base`). Records below
        `base` are the same for every hub of this file; above it, a hub that died before
        writing them may have lost them, and its successor numbers new records from `base`."""
        return {"id": self.id, "base": self.base}

    def _recover(self) -> int:
        """Index an existing file and return its end offset. Nothing intact is destroyed:
        damaged bytes (a torn tail, a corrupt length or record) are moved to the `.damaged`
        file next to the history, and the intact records after a damaged stretch are kept
        (the file is rewritten without the damaged bytes, which renumbers those records, so
        the history gets a new id). What happened is in `self.recovery`."""
        self.recovery: dict[str, object] | None = None
        self._renumbered = False
        if not self.path.exists():
            self.path.touch(mode=0o600)
            return 0
        with open(self.path, "rb") as f:
            data = f.read()
        if sealed := self._sealed.sealed_start_of(data):  # killed between sealing and cutting
            data = data[sealed:]
            write_private(self.path, data)
        good, damaged = scan(data)
        if damaged:
            aside = self.path.with_name(self.path.name + DAMAGED_SUFFIX)
            with open(aside, "ab") as out:
                for start, stop in damaged:
                    out.write(data[start:stop])
            lost = sum(stop - start for start, stop in damaged)
            salvaged = sum(1 for offset, _ in good if offset > damaged[0][0])
            torn_tail_only = len(damaged) == 1 and damaged[0][1] == len(data)
            if torn_tail_only:
                os.truncate(self.path, damaged[0][0])
            else:  # keep every intact record, in order, without the damaged bytes
                tmp = self.path.with_name(self.path.name + ".repair")
                with open(tmp, "wb") as out:
                    for offset, n in good:
                        out.write(data[offset:offset + _LEN + n])
                os.replace(tmp, self.path)
                self._renumbered = salvaged > 0
            self.recovery = {"records": len(good), "salvaged_after_damage": salvaged,
                             "set_aside_bytes": lost, "damaged_stretches": len(damaged),
                             "set_aside_in": str(aside), "torn_tail_only": torn_tail_only}
            log.warning("history %s: %d intact records kept (%d of them after damage), %d "
                        "damaged bytes in %d stretch(es) moved to %s", self.path, len(good),
                        salvaged, lost, len(damaged), aside)
        if self._sealed.set_aside:
            self.recovery = {**(self.recovery or {"records": len(good)}),
                             "chunks_set_aside_bytes": self._sealed.set_aside}
            self._renumbered = True  # records lost among the sealed: a new history id
        offset = 0
        for record_offset, n in good:
            self._offsets.append(offset)
            self._covers.append(None)
            self._remember(data[record_offset + _LEN:record_offset + _LEN + n])
            offset += _LEN + n
        return offset

    def _remember(self, record: bytes) -> None:
        self._memory.append(record)
        if len(self._memory) > self.memory_limit:
            self._memory.popleft()
            self._memory_base += 1

    def __len__(self) -> int:
        return self._tail_base + len(self._offsets)

    def append(self, record: bytes, cover: Known | None = None) -> int:
        """Store one record; returns its sequence number. `cover`: what it covers, as
        `chunks.record_cover` would read it (the hub knows it: sealing then never unpacks
        the record again). Never raises for a write error: while the file cannot be written
        (a full disk) records are kept in memory, and `flush` retries (see `write_error`)."""
        offsets = self._offsets
        seq = self._tail_base + len(offsets)
        offsets.append(self._end)
        self._covers.append(cover)
        self._end += _LEN + len(record)
        memory = self._memory  # _remember(record), inlined: once per message
        memory.append(record)
        if len(memory) > self.memory_limit:
            memory.popleft()
            self._memory_base += 1
        self._unwritten.append(record)
        if self.write_error is None:
            try:
                self._writer.write(len(record).to_bytes(_LEN, "big") + record)
            except OSError as exc:
                self._failed(exc)
        return seq

    def flush(self) -> None:
        """Push buffered records to the OS (they survive a hub crash from then on). After a
        write error, retries at most every `RETRY_S` seconds: the file is cut back to what
        was written and the records since are written again."""
        if self.write_error is not None:
            if time.monotonic() < self._next_retry:
                if len(self._unwritten) != self._marked_unwritten:
                    self._mark()  # a hub killed now leaves the count of what it loses
                return
            self._retry()
            return
        try:
            self._writer.flush()
        except OSError as exc:
            self._failed(exc)
            return
        self._on_disk = self._end
        self._unwritten.clear()
        self._forget_told_loss()
        self._seal_step()

    def _seal_step(self) -> None:
        """Start sealing the tail on the sealing thread once it holds `seal_bytes`; once that
        thread has the chunks ready, write them and cut the tail (`_sealed_now`)."""
        job = self._seal_job
        if self._closing:
            return
        if job is not None:
            if job.done():
                self._seal_job = None
                self._sealed_now(job)
            return
        if self._end >= self.seal_bytes and self.seal_error is None:
            if self._sealer is None:
                self._sealer = ThreadPoolExecutor(1, thread_name_prefix="history-seal")
            self._seal_job = self._sealer.submit(
                prepare_chunks, self.path, self._end, self._offsets.tobytes(), self._covers[:],
                self._tail_base, self.seal_bytes, self._sealed.size)

    def settle(self) -> None:
        """Flush, and wait until the tail holds less than `seal_bytes` (every seal the
        sealing thread has under way written): for tests and tools, never the hub's loop."""
        self.flush()
        while self.write_error is None and self.seal_error is None and (
                self._seal_job is not None or self._end >= self.seal_bytes):
            if self._seal_job is not None:
                wait([self._seal_job])
            self.flush()

    def _sealed_now(self, job: Future) -> None:
        """Write the chunks the sealing thread made of the tail's first records, then cut
        those from the tail (the rest, appended since, rewritten to a new tail file that
        replaces it). A hub killed in between leaves the tail starting with the chunks'
        records: the next opening cuts them (`Sealed.sealed_start_of`)."""
        started = time.perf_counter()
        try:
            prepared, count, cut = job.result()
            self._sealed.add(prepared)
            self._reader.seek(cut)
            rest = self._reader.read(self._end - cut)
            write_private(self.path, rest)
            self._writer.close()
            self._writer = open(self.path, "ab", buffering=1 << 16)  # noqa: SIM115
            self._reader.close()
            self._reader = open(self.path, "rb")  # noqa: SIM115
        except (OSError, ValueError, zlib.error) as exc:  # the tail stays whole
            self.seal_error = (_write_error_text(exc) if isinstance(exc, OSError)
                               else f"{type(exc).__name__}: {exc}")
            log.error("history %s: cannot seal its tail (%s): it grows on, uncompressed",
                      self.path, self.seal_error)
            return
        finally:
            self.seal_s += time.perf_counter() - started
        self._tail_base += count
        self._offsets = array("Q", (offset - cut for offset in self._offsets[count:]))
        del self._covers[:count]
        self._end -= cut
        self._on_disk -= cut
        if self.on_sealed is not None:
            try:
                self.on_sealed(self._tail_base)
            except Exception:  # a hook must not stop the history
                log.exception("history %s: on_sealed failed", self.path)

    def _forget_told_loss(self) -> None:
        if self._earlier_told_at is not None and self._earlier_told_at < self.durable:
            self._earlier_told_at = None
            self._earlier_lost = 0
            self._mark()

    @property
    def durable(self) -> int:
        """How many records are written to the OS."""
        return len(self) - len(self._unwritten)

    def _failed(self, exc: OSError) -> None:
        if self.write_error is None:
            self.write_error_since = time.time()
            log.error("history %s: cannot write (%s): keeping records in memory and retrying "
                      "every %.0f s", self.path, exc, RETRY_S)
        self.write_error = _write_error_text(exc)
        self._next_retry = time.monotonic() + RETRY_S
        self._reopen_writer()
        self._mark()

    def _reopen_writer(self) -> None:
        """Drop what the writer holds and cut the file back to what is known written."""
        with contextlib.suppress(OSError):  # its buffer is in self._unwritten
            self._writer.close()
        try:
            os.truncate(self.path, self._on_disk)
        except OSError as exc:
            log.error("history %s: cannot cut back to %d bytes: %s", self.path, self._on_disk,
                      exc)
        self._writer = open(self.path, "ab", buffering=1 << 16)  # noqa: SIM115

    def _retry(self) -> None:
        try:
            for record in self._unwritten:
                self._writer.write(len(record).to_bytes(_LEN, "big"))
                self._writer.write(record)
            self._writer.flush()
        except OSError as exc:
            self._failed(exc)
            return
        log.warning("history %s: writing again after %s (%d records caught up)", self.path,
                    self.write_error, len(self._unwritten))
        self.write_error = self.write_error_since = None
        self._on_disk = self._end
        self._unwritten.clear()
        self._mark()
        self._forget_told_loss()

    def get(self, since: int, limit: int) -> list[bytes]:
        """Records `since` .. `since+limit-1` (fewer at the end of history)."""
        stop = min(len(self), since + max(0, limit))
        if since >= stop:
            return []
        if since >= self._memory_base:
            start = since - self._memory_base
            return list(itertools.islice(self._memory, start, start + stop - since))
        self.flush()
        stop = min(stop, self.durable)  # older than memory and not on disk: cannot be read
        return list(self._read_file(since, stop)) if since < stop else []

    def pick(self, seqs: list[int]) -> list[bytes]:
        """The records numbered `seqs` (ascending), those that can still be read: in memory,
        or written to the file."""
        out = []
        memory, base = self._memory, self._memory_base
        on_file = [seq for seq in seqs if seq < base]
        if on_file:
            self.flush()
            durable, tail = self.durable, self._tail_base
            for seq in on_file:
                if seq < tail:
                    out.extend(self._sealed.frames(seq, seq + 1))
                elif seq < durable:
                    self._reader.seek(self._offsets[seq - tail])
                    out.append(self._reader.read(
                        int.from_bytes(self._reader.read(_LEN), "big")))
        top = len(self)
        out.extend(memory[seq - base] for seq in seqs if base <= seq < top)
        return out

    def _read_file(self, since: int, stop: int) -> Iterator[bytes]:
        tail = self._tail_base
        if since < tail:
            yield from self._sealed.frames(since, min(stop, tail))
            since = tail
        if since >= stop:
            return
        self._reader.seek(self._offsets[since - tail])
        for _ in range(since, stop):
            n = int.from_bytes(self._reader.read(_LEN), "big")
            yield self._reader.read(n)

    def close(self) -> int:
        """Flush (one last try) and close the files; returns how many records could not be
        written (they are lost), which the loss marker then says to the next opening. A seal
        under way is dropped (the tail stays whole: the next opening seals it)."""
        self._closing = True
        if self._sealer is not None:
            self._sealer.shutdown(wait=True, cancel_futures=True)
            self._seal_job = None
        if self.write_error is None:
            self.flush()
        if self.write_error is not None:
            self._retry()
        with contextlib.suppress(OSError):  # after a failed write it holds nothing
            self._writer.close()
        self.lost = len(self._unwritten)
        if self.lost:
            log.error("history %s: %d records could not be written (%s): they are lost",
                      self.path, self.lost, self.write_error)
        self._mark(closed=True)
        self._marker.close()
        self._reader.close()
        self._sealed.close()
        return self.lost


class LossMarker:
    """A small file next to the history, `history.smlog.loss`, made full size when a hub
    opens the history and from then on rewritten in place (no new blocks: on most file
    systems that works on a full disk too; not on copy-on-write ones such as btrfs or ZFS).
    It holds JSON: the hub's pid, whether it closed the history, how many records it holds
    unwritten (`unwritten`) and gave up at close (`lost`), the write error and since when, and
    the losses of earlier hubs not yet told in the history (`earlier_lost`)."""

    SIZE = 512

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                               0o600)
        except OSError as exc:
            log.error("history loss marker %s: cannot open (%s): a loss will be told only in "
                      "the hub's log", path, exc)

    def update(self, data: dict[str, object]) -> None:
        """Rewrite the marker in place (errors are logged, never raised)."""
        if self._fd is None:
            return
        text = json.dumps(data).encode()[:self.SIZE - 1]
        try:
            os.pwrite(self._fd, text + b" " * (self.SIZE - len(text) - 1) + b"\n", 0)
        except OSError as exc:
            log.error("history loss marker %s: cannot write (%s)", self.path, exc)
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Close the marker's file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_loss_marker(path: Path) -> dict | None:
    """The loss marker of the history at `path`, None when there is none (or unreadable)."""
    try:
        data = json.loads((path.with_name(path.name + LOSS_SUFFIX)).read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def earlier_lost(path: Path) -> int:
    """How many records the hubs of the history at `path` could not write, as far as its
    loss marker knows (records a hub killed while the disk was full held unwritten count)."""
    marker = read_loss_marker(path)
    if not marker:
        return 0
    mine = marker.get("lost", 0) if marker.get("closed") else marker.get("unwritten", 0)
    return int(marker.get("earlier_lost") or 0) + int(mine or 0)


def earlier_loss_text(path: Path) -> str | None:
    """What the loss marker of the history at `path` says was lost, in a sentence, or None
    when nothing is known lost. A hub killed with no write error loses at most the records it
    was taking when killed; those show as gaps in the ranks' sequence numbers only."""
    marker = read_loss_marker(path)
    lost = earlier_lost(path)
    if not marker or not lost:
        return None
    if not marker.get("error"):  # its last hub wrote all it had; earlier ones had not
        return f"{lost} records were never written to the history by earlier hubs: they are lost"
    how = ("exited" if marker.get("closed") else "stopped without closing it (killed?)")
    since = marker.get("since")
    when = f" since {time.strftime('%H:%M:%S', time.localtime(since))}" if since else ""
    return (f"{lost} records were never written to the history (its hub, pid "
            f"{marker.get('pid')}, {how} while it could not write: {marker['error']}{when}): "
            "they are lost")


def _write_error_text(exc: OSError) -> str:
    """A write error as people say it."""
    import errno

    if exc.errno == errno.ENOSPC:
        return "disk full (ENOSPC)"
    if exc.errno == errno.EDQUOT:
        return "disk quota exceeded (EDQUOT)"
    return f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"


def _history_id(path: Path, created: bool) -> str:
    """The id of the history file at `path`, made (and written next to it) when the file is
    new or has none yet."""
    id_path = path.with_name(path.name + ID_SUFFIX)
    if not created:
        try:
            text = id_path.read_text().strip()
            if text:
                return text
        except OSError:
            pass
    new = secrets.token_hex(8)
    tmp = id_path.with_name(id_path.name + ".tmp")
    try:
        tmp.write_text(new + "\n")
        os.replace(tmp, id_path)
    except OSError as exc:  # a full disk: this hub's readers still get an identity
        log.error("history %s: could not write its id (%s); a later hub will make another",
                  path, exc)
    return new


