"""A job's history: every accepted message in arrival order, numbered from 0.

Records live in an append-only file (`history.smlog` in the job's run directory: a 4-byte
big-endian length then the message frame, repeated) and the newest `memory_limit` of them also
in memory. The hub writes it (`History`); a hub restarted on the same run directory reopens the
file, drops a torn last record and carries on numbering. `scalemon snapshot` and the dashboard
read it when the hub is gone (`read_messages`, `history_path`).
"""

from __future__ import annotations

import logging
import os
import secrets
from array import array
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from scalemon import protocol
from scalemon.jobs import run_dir
from scalemon.protocol import Message, ProtocolError

log = logging.getLogger("scalemon.hub")

HISTORY_FILE = "history.smlog"
"""The history's file name inside a job's run directory."""
ID_SUFFIX = ".id"
"""`history.smlog.id`: the random id made when the history file was created."""
_LEN = 4


def history_path(job: str, home: Path | None = None) -> Path:
    """Where the history of `job` is (whether or not it exists); ValueError for a bad job id."""
    return run_dir(job, home) / HISTORY_FILE


class History:
    """Numbered, persistent, bounded-in-memory record store."""

    def __init__(self, path: Path, memory_limit: int = 1_000_000) -> None:
        self.path = path
        self.memory_limit = memory_limit
        self._offsets = array("Q")  # file offset of record i
        self._memory: deque[bytes] = deque()
        self._memory_base = 0  # sequence number of self._memory[0]
        created = not path.exists()
        self._end = self._recover()
        self.id = _history_id(path, created)
        self.base = len(self._offsets)
        self._writer = open(path, "ab", buffering=1 << 16)  # noqa: SIM115 - lives with self
        self._reader = open(path, "rb")  # noqa: SIM115

    @property
    def identity(self) -> dict[str, object]:
        """What tells this history apart from another under the same name: the file's random
        id, and how many records it held when this hub opened it (`base`). Records below
        `base` are the same for every hub of this file; above it, a hub that died before
        writing them may have lost them, and its successor numbers new records from `base`."""
        return {"id": self.id, "base": self.base}

    def _recover(self) -> int:
        """Index an existing file, truncating a torn tail; returns the end offset."""
        if not self.path.exists():
            self.path.touch(mode=0o600)
            return 0
        size = self.path.stat().st_size
        offset = 0
        with open(self.path, "rb") as f:
            while offset + _LEN <= size:
                n = int.from_bytes(f.read(_LEN), "big")
                if offset + _LEN + n > size:
                    break
                self._offsets.append(offset)
                self._remember(f.read(n))
                offset += _LEN + n
        if offset != size:
            log.warning("history %s: dropping a torn record of %d bytes", self.path, size - offset)
            os.truncate(self.path, offset)
        return offset

    def _remember(self, record: bytes) -> None:
        self._memory.append(record)
        if len(self._memory) > self.memory_limit:
            self._memory.popleft()
            self._memory_base += 1

    def __len__(self) -> int:
        return len(self._offsets)

    def append(self, record: bytes) -> int:
        """Store one record; returns its sequence number."""
        seq = len(self._offsets)
        self._offsets.append(self._end)
        self._writer.write(len(record).to_bytes(_LEN, "big"))
        self._writer.write(record)
        self._end += _LEN + len(record)
        self._remember(record)
        return seq

    def flush(self) -> None:
        """Push buffered records to the OS (they survive a hub crash from then on)."""
        self._writer.flush()

    def get(self, since: int, limit: int) -> list[bytes]:
        """Records `since` .. `since+limit-1` (fewer at the end of history)."""
        stop = min(len(self._offsets), since + max(0, limit))
        if since >= stop:
            return []
        if since >= self._memory_base:
            start = since - self._memory_base
            return [self._memory[i] for i in range(start, start + stop - since)]
        self.flush()
        return list(self._read_file(since, stop))

    def _read_file(self, since: int, stop: int) -> Iterator[bytes]:
        self._reader.seek(self._offsets[since])
        for _ in range(since, stop):
            n = int.from_bytes(self._reader.read(_LEN), "big")
            yield self._reader.read(n)

    def close(self) -> None:
        """Flush and close the files."""
        self._writer.close()
        self._reader.close()


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
    tmp.write_text(new + "\n")
    os.replace(tmp, id_path)
    return new


def read_records(path: Path) -> Iterator[bytes]:
    """Read a history file without modifying it (a torn last record is ignored)."""
    with open(path, "rb") as f:
        while True:
            head = f.read(_LEN)
            if len(head) < _LEN:
                return
            record = f.read(int.from_bytes(head, "big"))
            if len(record) < int.from_bytes(head, "big"):
                return
            yield record


def read_messages(path: Path) -> tuple[list[tuple[int, Message]], int]:
    """Decode a history file without a hub: ([(record number, message)], rejected count)."""
    messages: list[tuple[int, Message]] = []
    rejected = 0
    for seq, record in enumerate(read_records(path)):
        try:
            messages.append((seq, protocol.decode(record)))
        except ProtocolError:
            rejected += 1
    return messages, rejected
