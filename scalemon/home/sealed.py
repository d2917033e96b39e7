"""The sealed part of a history as its hub keeps it: chunks appended, records read back.

`Sealed` opens (and repairs) the chunks file and its index when a hub opens the history,
appends a chunk when the hub seals its tail (`History.flush`), and reads records back by
number for late dashboards (`frames`), a decompressed chunk cached at a time.
"""

from __future__ import annotations

import bisect
import logging
import os
import zlib
from array import array
from pathlib import Path

from scalemon.home import chunks
from scalemon.home.chunks import ChunkEntry

log = logging.getLogger("scalemon.hub")


class Sealed:
    """The chunks of the history at `path` (`scalemon.home.chunks`)."""

    def __init__(self, path: Path, damaged_path: Path) -> None:
        self.path = path.with_name(path.name + chunks.CHUNKS_SUFFIX)
        self.history = path
        self.entries, damaged, size = chunks.load_index(path)
        self.set_aside = 0
        if damaged:
            self._set_aside(damaged, damaged_path, size)
        self.size = self.entries[-1].end if self.entries else 0
        if self.entries and (size != self.size or damaged
                             or not _index_file_ok(path, self.entries)):
            chunks.write_index(path, self.entries)
        self._firsts = [e.first for e in self.entries]
        self._cached: tuple[int, list[bytes]] | None = None
        self._reader = open(self.path, "rb") if self.entries else None  # noqa: SIM115

    def _set_aside(self, damaged: list[tuple[int, int]], aside: Path, size: int) -> None:
        """Copy damaged chunk bytes to `.damaged`; cut a torn end off the chunks file."""
        with open(self.path, "rb") as f, open(aside, "ab") as out:
            for start, stop in damaged:
                f.seek(start)
                out.write(f.read(stop - start))
        self.set_aside = sum(stop - start for start, stop in damaged)
        end = self.entries[-1].end if self.entries else 0
        if damaged[-1][1] == size and damaged[-1][0] >= end:
            os.truncate(self.path, damaged[-1][0])
        log.warning("history %s: %d damaged bytes of its chunks in %d stretch(es) copied to %s",
                    self.history, self.set_aside, len(damaged), aside)

    @property
    def count(self) -> int:
        """The number of the first record after the sealed ones."""
        return self.entries[-1].stop if self.entries else 0

    def sealed_start_of(self, tail: bytes) -> int:
        """How many bytes at the start of `tail` the last seal already holds in chunks (a hub
        killed after sealing them and before cutting the tail): 0 when none."""
        starts = [i for i, entry in enumerate(self.entries) if entry.at == 0]
        if not starts:
            return 0
        last = self.entries[starts[-1]:]
        end = 0
        for entry in last:
            if entry.at != end or zlib.crc32(tail[end:end + entry.raw]) != entry.raw_crc:
                return 0
            end += entry.raw
        return end

    def add(self, prepared: list[tuple[bytes, ChunkEntry]]) -> None:
        """Append chunks (`prepare_chunks`, made at this file's present size) and their index
        lines; raises OSError (the chunks file cut back to where it was)."""
        if prepared and prepared[0][1].offset < self.size:
            raise ValueError("chunks prepared for another end of the chunks file")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                         0o600)
            with os.fdopen(fd, "ab") as f:
                f.writelines(blob for blob, _ in prepared)
            index = self.history.with_name(self.history.name + chunks.INDEX_SUFFIX)
            fd = os.open(index, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "ab") as f:
                f.writelines(chunks.index_line(entry) for _, entry in prepared)
        except OSError:
            os.truncate(self.path, self.size)
            raise
        for _, entry in prepared:
            self.entries.append(entry)
            self._firsts.append(entry.first)
            self.size = entry.end
        if self._reader is None:
            self._reader = open(self.path, "rb")  # noqa: SIM115

    def frames(self, since: int, stop: int) -> list[bytes]:
        """Records `since` .. `stop-1` of those sealed (a damaged chunk's are left out)."""
        out: list[bytes] = []
        seq = since
        while seq < min(stop, self.count):
            i = bisect.bisect_right(self._firsts, seq) - 1
            if i < 0:
                seq = self._firsts[0] if self._firsts else stop
                continue
            entry = self.entries[i]
            if seq >= entry.stop:  # a gap left by a damaged chunk
                seq = self._firsts[i + 1] if i + 1 < len(self._firsts) else stop
                continue
            records = self._chunk(entry)
            take = records[seq - entry.first:min(stop, entry.stop) - entry.first]
            out.extend(take)
            seq = min(stop, entry.stop)
        return out

    def _chunk(self, entry: ChunkEntry) -> list[bytes]:
        if self._cached is not None and self._cached[0] == entry.first:
            return self._cached[1]
        assert self._reader is not None
        found, damaged, _ = chunks.read_chunk(self._reader, entry)
        records = [frame for _, frame in found] if not damaged else []
        if damaged:
            log.error("history %s: the chunk of records %d..%d is damaged: not served",
                      self.history, entry.first, entry.stop - 1)
        self._cached = (entry.first, records)
        return records

    def close(self) -> None:
        """Close the chunks file."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def _index_file_ok(path: Path, entries: list[ChunkEntry]) -> bool:
    index = path.with_name(path.name + chunks.INDEX_SUFFIX)
    try:
        return index.stat().st_size == sum(len(chunks.index_line(e)) for e in entries)
    except OSError:
        return not entries


def prepare_chunks(path: Path, end: int, offsets: bytes, covers: list[chunks.Known | None],
                   first: int, seal_bytes: int, chunks_size: int
                   ) -> tuple[list[tuple[bytes, ChunkEntry]], int, int]:
    """The chunks of the tail at `path` up to `end` (its records' `offsets`, numbered from
    `first`, and what each covers where the writer said: `covers`), about `seal_bytes` of
    frames each, to go at `chunks_size` of the chunks file;
    with how many records and bytes of the tail they hold. Runs on the sealing thread (zlib
    lets the hub's thread run meanwhile)."""
    starts = array("Q")
    starts.frombytes(offsets)
    with open(path, "rb") as f:
        raw = os.pread(f.fileno(), end, 0)
    if len(raw) != end:
        raise ValueError(f"the tail holds {len(raw)} bytes, not {end}")
    pieces = max(1, end // seal_bytes)
    out: list[tuple[bytes, ChunkEntry]] = []
    at_record, at_byte = 0, 0
    for piece in range(1, pieces + 1):
        stop = len(starts) if piece == pieces else max(
            at_record + 1, bisect.bisect_left(starts, end * piece // pieces))
        stop_byte = starts[stop] if stop < len(starts) else end
        blob, entry = chunks.seal(raw[at_byte:stop_byte], first + at_record, stop - at_record,
                                  chunks_size, at_byte, covers[at_record:stop],
                                  [start - at_byte for start in starts[at_record:stop]])
        out.append((blob, entry))
        chunks_size += len(blob)
        at_record, at_byte = stop, stop_byte
    return out, len(starts), end
