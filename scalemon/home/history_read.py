"""Reading a history without its hub: the sealed chunks through their index, then the tail.

`read_messages` decodes every record as a hub replaying it would (damage skipped, counted);
`iter_messages` does the same lazily, from a record number on; `read_selected` reads the
records of some ranks, a step range or a record range, reading only the chunks whose index
entries cover them (`scalemon.home.chunks`). `scan` finds the intact records of a file of
length-prefixed frames (the tail, or a damaged chunk's bytes) and the damaged stretches.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from scalemon import protocol
from scalemon.home import chunks
from scalemon.home.chunks import ChunkEntry, covers, record_cover
from scalemon.home.safefs import write_private
from scalemon.protocol import Message, ProtocolError

_LEN = 4


def _valid_at(data: bytes | memoryview, offset: int) -> tuple[int, Message] | None:
    """The length and message of the record at `offset` when a whole, decodable message is
    there (at most `MAX_MESSAGE_BYTES`: nothing larger is ever stored)."""
    size = len(data)
    if offset + _LEN > size:
        return None
    n = int.from_bytes(data[offset:offset + _LEN], "big")
    if not 0 < n <= protocol.MAX_MESSAGE_BYTES or offset + _LEN + n > size:
        return None
    if data[offset + _LEN] not in _MAP_MARKERS:
        return None
    try:
        return n, protocol.decode(bytes(data[offset + _LEN:offset + _LEN + n]))
    except ProtocolError:
        return None


_MAP_MARKERS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}  # msgpack maps: every message


def scan(data: bytes, messages: list[Message] | None = None,
         ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The intact records of a history file's bytes as (offset, length), and the damaged
    stretches as (start, stop); with `messages`, the intact records decoded are appended
    there. After damage, the next intact record is found by trying every offset: one that
    holds a decodable message followed by another one (or the end of the file) starts the
    next intact stretch."""
    good: list[tuple[int, int]] = []
    damaged: list[tuple[int, int]] = []
    offset, size = 0, len(data)
    view = memoryview(data)
    while offset < size:
        found = _valid_at(view, offset)
        if found is not None:
            good.append((offset, found[0]))
            if messages is not None:
                messages.append(found[1])
            offset += _LEN + found[0]
            continue
        start = offset
        offset = _resync(view, offset + 1)
        damaged.append((start, offset))
    return good, damaged


def _resync(view: memoryview, start: int) -> int:
    """The first offset from `start` where intact records start again (the end if none)."""
    size = len(view)
    for offset in range(start, size):
        if view[offset] != 0 or offset + _LEN >= size or view[offset + _LEN] not in _MAP_MARKERS:
            continue  # lengths are at most 1 MiB: the first byte of a length prefix is 0
        found = _valid_at(view, offset)
        if found is None:
            continue
        after = offset + _LEN + found[0]
        if after == size or _valid_at(view, after) is not None:
            return offset
    return size


@dataclass
class ReadStats:
    """What a read did: records rejected (each damaged stretch, damaged chunk or record of
    another job counts one), records read, chunks decompressed and chunks skipped by their
    index entry."""

    rejected: int = 0
    records: int = 0
    chunks_read: int = 0
    chunks_skipped: int = 0
    bytes_read: int = 0
    """Compressed bytes of chunks read (the lanes decompressed)."""
    tail_bytes: int = 0
    """Bytes of the tail read (all of it, every time)."""
    damaged: list[str] = field(default_factory=list)


@dataclass
class Selection:
    """Which records to read: some ranks, a step range, a record range (None: all). Records
    are chosen by `chunks.record_cover`, so a record of several ranks or steps is read when
    it covers any chosen one."""

    ranks: Collection[int] | None = None
    steps: tuple[int | None, int | None] | None = None
    seqs: tuple[int | None, int | None] | None = None

    def wants_chunk(self, entry: ChunkEntry) -> bool:
        """Whether a chunk may hold a chosen record, by its index entry alone."""
        if self.seqs is not None and not covers([entry.first, entry.stop - 1], *self.seqs):
            return False
        if self.steps is not None and not covers(entry.steps, *self.steps):
            return False
        if self.ranks is not None:
            if entry.ranks is None:
                return False
            lo, hi = entry.ranks
            return any(lo <= r <= hi for r in self.ranks)
        return True

    def wants(self, seq: int, frame: bytes) -> bool:
        """Whether one record is chosen."""
        if self.seqs is not None and not covers([seq, seq], *self.seqs):
            return False
        if self.ranks is None and self.steps is None:
            return True
        _, ranks, steps, _ = record_cover(frame)
        if self.steps is not None and not covers(list(steps) if steps else None, *self.steps):
            return False
        if self.ranks is not None:
            return ranks is not None and any(ranks[0] <= r <= ranks[1] for r in self.ranks)
        return True


def iter_frames(path: Path, stats: ReadStats | None = None, select: Selection | None = None,
                decode: bool = True, stored: bool = False
                ) -> Iterator[tuple[int, bytes, Message | None]]:
    """(record number, frame, message) of every intact record of the history at `path`: its
    chunks in order (a damaged chunk's intact records salvaged), then its tail (damaged
    stretches skipped; the records after them numbered as a reopening hub numbers them).
    `message` is the frame decoded and validated (None with `decode` False); with `stored`,
    a chunk's records are decoded as a hub serves them (`protocol.decode_stored`: the hub
    validated them when it took them in)."""
    stats = stats if stats is not None else ReadStats()
    entries, damaged, _ = chunks.load_index(path)
    stats.rejected += len(damaged)
    stats.damaged += [f"chunks file bytes {a}..{b}" for a, b in damaged]
    if entries:
        with open(path.with_name(path.name + chunks.CHUNKS_SUFFIX), "rb") as f:
            for entry in entries:
                if select is not None and not select.wants_chunk(entry):
                    stats.chunks_skipped += 1
                    continue
                yield from _chunk_records(f, entry, stats, select, decode, stored)
    base = entries[-1].stop if entries else 0
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return
    stats.tail_bytes += len(data)
    decoded: list[Message] = []
    good, bad = scan(data, decoded)
    stats.rejected += len(bad)
    stats.damaged += [f"tail bytes {a}..{b}" for a, b in bad]
    for i, ((offset, n), msg) in enumerate(zip(good, decoded, strict=True)):
        frame = data[offset + _LEN:offset + _LEN + n]
        if select is None or select.wants(base + i, frame):
            stats.records += 1
            yield base + i, frame, msg


def _chunk_records(f, entry: ChunkEntry, stats: ReadStats, select: Selection | None,
                   decode: bool, stored: bool) -> Iterator[tuple[int, bytes, Message | None]]:
    unpack = protocol.decode_stored if stored else protocol.decode
    pairs, damaged, read = chunks.read_chunk(f, entry, select.ranks if select else None)
    stats.chunks_read += 1
    stats.bytes_read += read
    if damaged:  # the intact records of its damaged lanes are given still
        stats.rejected += damaged
        stats.damaged.append(f"chunk of records {entry.first}..{entry.stop - 1}: "
                             f"{damaged} damaged lane(s)")
    for seq, frame in pairs:
        if select is not None and not select.wants(seq, frame):
            continue
        stats.records += 1
        if not decode:
            yield seq, frame, None
            continue
        try:
            yield seq, frame, unpack(frame)
        except ProtocolError:
            stats.rejected += 1


def read_records(path: Path) -> Iterator[bytes]:
    """Every intact record of a history (chunks, then the tail) without modifying it (a torn
    last record is ignored)."""
    for _, frame, _ in iter_frames(path, decode=False):
        yield frame


def iter_messages(path: Path, job: str | None = None, stats: ReadStats | None = None,
                  select: Selection | None = None, stored: bool = False
                  ) -> Iterator[tuple[int, Message]]:
    """(record number, message) of a history, validated like a hub replaying it (`stored`:
    see `iter_frames`); with `job`, records of another job are left out (and counted
    rejected in `stats`)."""
    stats = stats if stats is not None else ReadStats()
    for seq, _, msg in iter_frames(path, stats, select, stored=stored):
        if msg is None or (job is not None and msg.job != job):
            stats.rejected += 1
            continue
        yield seq, msg


def read_messages(path: Path, job: str | None = None) -> tuple[list[tuple[int, Message]], int]:
    """Decode a history without a hub: ([(record number, message)], rejected count).

    Validates like a hub replaying it: damaged stretches are skipped (the intact records after
    them are still read, numbered as a reopening hub would number them), and with `job`,
    records of another job are left out. Each damaged stretch and each record left out counts
    as one rejected."""
    stats = ReadStats()
    messages = list(iter_messages(path, job, stats))
    return messages, stats.rejected


def read_selected(path: Path, select: Selection, job: str | None = None,
                  stats: ReadStats | None = None) -> list[tuple[int, Message]]:
    """The records of `select` (some ranks, a step range, a record range), reading only the
    chunks whose index entries may hold them."""
    return list(iter_messages(path, job, stats, select))


CHECKPOINT_SUFFIX = ".digest"
"""`history.smlog.digest`: the summary's checkpoint of the history (`link.checkpoint`)."""


def sealed_count(path: Path) -> int:
    """How many records of the history at `path` are sealed in chunks (never renumbered)."""
    entries, _, _ = chunks.load_index(path)
    return entries[-1].stop if entries else 0


def read_checkpoint(path: Path) -> bytes | None:
    """The checkpoint beside the history at `path`, None without one (or unreadable)."""
    try:
        return path.with_name(path.name + CHECKPOINT_SUFFIX).read_bytes()
    except OSError:
        return None


def write_checkpoint(path: Path, blob: bytes) -> str | None:
    """Write the checkpoint beside the history at `path` (a temporary file, then rename);
    returns why it could not be written (a read-only run directory, a full disk), else None."""
    try:
        write_private(path.with_name(path.name + CHECKPOINT_SUFFIX), blob)
    except OSError as exc:
        return f"{exc.strerror or exc}"
    return None
