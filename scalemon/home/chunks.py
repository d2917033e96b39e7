"""A history's sealed records: compressed chunks, each described by a header (its index entry).

The history's live tail (`history.smlog`) is sealed, every `SEAL_BYTES` of frames, into one
chunk appended to `history.smlog.chunks`: `MAGIC`, the header's length (4 bytes, big-endian),
the header (JSON: `ChunkEntry` less its offset), then its lanes. A lane holds the records of a
stretch of ranks (about `LANE_BYTES` of them), each as its number less the chunk's first (4
bytes), its length (4 bytes) and its frame, compressed with zlib on its own: one rank's
records are read by decompressing its lane of each chunk only. The chunks file is the truth;
`history.smlog.index` holds the same headers with their offsets, one JSON line a chunk, so a
reader finds the chunks of a rank, a step range or a record range without reading the others.
A missing, short or damaged index is rebuilt by walking the chunks file (`load_index`).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import zlib
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from scalemon.home.safefs import write_private

CHUNKS_SUFFIX = ".chunks"
"""`history.smlog.chunks`: the sealed chunks, one after another."""
INDEX_SUFFIX = ".index"
"""`history.smlog.index`: one JSON line per chunk (its header and offset)."""
MAGIC = b"SMC1"
LEVEL = 3
"""zlib's level: 8.7x on a simulated 512-rank job's steps in ~4 ms per MiB (level 6: 9.3x in
~16 ms per MiB)."""
SEAL_BYTES = 8 << 20
"""The tail is sealed into a chunk once it holds this many bytes of frames (~1 MiB compressed)."""
LANE_BYTES = 256 << 10
"""About how many bytes of frames a lane of a chunk holds (at least a rank's)."""
_HEAD = len(MAGIC) + 4
_MAX_HEADER = 1 << 16


Known = tuple[str, int | None, int | None, float | None]
"""What a record covers as its writer knows it: (type, rank, step of a `step`, t)."""


@dataclass
class Cover:
    """Which ranks and steps the records of a stretch cover (None: no record says)."""

    ranks: list[int] | None = None
    steps: list[int] | None = None
    types: dict[str, int] = field(default_factory=dict)
    t: list[float] | None = None

    def add(self, frame: bytes, known: Known | None = None) -> tuple[int, int] | None:
        """Widen the cover by one record's (`known`, else `record_cover`); returns its
        ranks."""
        if known is None:
            mtype, ranks, steps, t = record_cover(frame)
        else:
            mtype, rank, step, t = known
            ranks = (rank, rank) if rank is not None else None
            steps = (step, step) if step is not None else None
        self.types[mtype] = self.types.get(mtype, 0) + 1
        if ranks is not None:
            self.ranks = _widen(self.ranks, ranks)
        if steps is not None:
            self.steps = _widen(self.steps, steps)
        if t is not None:
            self.t = _widen(self.t, (t, t))
        return ranks


def _widen(span: list | None, lo_hi: tuple) -> list:
    lo, hi = lo_hi
    return [lo, hi] if span is None else [min(span[0], lo), max(span[1], hi)]


def record_cover(frame: bytes) -> tuple[str, tuple[int, int] | None, tuple[int, int] | None,
                                        float | None]:
    """(type, (lowest, highest rank), (lowest, highest step), t) of one stored frame: the one
    rule for which ranks and steps a record covers (a record of several ranks' steps, as a
    relay may batch them one day, widens here). Anything unreadable covers nothing."""
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException):
        return "?", None, None, None
    if not isinstance(msg, dict):
        return "?", None, None, None
    rank, body, t = msg.get("rank"), msg.get("body"), msg.get("t")
    ranks = (rank, rank) if type(rank) is int else None
    step = body.get("step") if isinstance(body, dict) else None
    steps = (step, step) if type(step) is int and msg.get("type") == "step" else None
    return (str(msg.get("type")), ranks, steps,
            float(t) if type(t) in (int, float) else None)


def covers(span: list | None, lo: int | None, hi: int | None) -> bool:
    """Whether `span` ([lo, hi], None: unknown) meets [lo, hi] (None: unbounded)."""
    if lo is None and hi is None:
        return True
    if span is None:
        return False
    return (hi is None or span[0] <= hi) and (lo is None or span[1] >= lo)


@dataclass
class ChunkEntry:
    """One sealed chunk: records `first` .. `first+count-1`, `length` compressed bytes of
    lanes at `offset` in the chunks file (its header before it), sealed from `raw` bytes of
    the tail whose crc32 is `raw_crc`, and what they cover."""

    first: int
    count: int
    offset: int
    length: int
    raw: int
    raw_crc: int
    lanes: list[list[int]] = field(default_factory=list)
    """[lowest rank, highest rank, offset from the chunk's, length, records, crc32] of each
    lane (-1 as a rank: records without one)."""
    ranks: list[int] | None = None
    steps: list[int] | None = None
    types: dict[str, int] = field(default_factory=dict)
    t: list[float] | None = None
    at: int = 0
    """Where the chunk's frames started in the tail it was sealed from (0: the first chunk of
    a seal)."""

    @property
    def stop(self) -> int:
        """The number of the record after the chunk's last."""
        return self.first + self.count

    @property
    def end(self) -> int:
        """Where the chunk's bytes end in the chunks file."""
        return self.offset + self.length


def seal(raw: bytes, first: int, count: int, offset: int, at: int = 0,
         known: list[Known | None] | None = None,
         starts: Sequence[int] | None = None) -> tuple[bytes, ChunkEntry]:
    """The bytes of a chunk of the tail's frames `raw` (records `first` .., `count` of them,
    from offset `at` of the tail, each at its offset in `starts` when the caller knows them;
    `known`: what each covers, where its writer said), to be appended at `offset` of the
    chunks file, and its entry. Runs on the history's sealing thread: the work per record is
    done by builtins over whole lists, so that the hub's thread keeps the GIL."""
    if starts is None:
        starts = record_starts(raw)
    ends = [*starts[1:], len(raw)]
    cover, lane_ranks = _cover_of(raw, starts, ends, known)
    order = sorted(range(len(starts)), key=lane_ranks.__getitem__)  # by rank, stable
    ranked = [lane_ranks[i] for i in order]
    distinct = sorted(set(lane_ranks))
    per_lane = max(1, len(distinct) * LANE_BYTES // max(1, len(raw)))
    view = memoryview(raw)
    parts, lanes, at_lane = [], [], 0
    for start in range(0, len(distinct), per_lane):
        ranks_here = distinct[start:start + per_lane]
        lo = bisect.bisect_left(ranked, ranks_here[0])
        hi = bisect.bisect_right(ranked, ranks_here[-1])
        part = zlib.compress(_lane_bytes(view, starts, ends, order[lo:hi]), LEVEL)
        lanes.append([ranks_here[0], ranks_here[-1], at_lane, len(part), hi - lo,
                      zlib.crc32(part)])
        parts.append(part)
        at_lane += len(part)
    header_fields = {"first": first, "count": count, "length": at_lane, "raw": len(raw),
                     "raw_crc": zlib.crc32(raw), "lanes": lanes, "ranks": cover.ranks,
                     "steps": cover.steps, "types": cover.types, "t": cover.t, "at": at}
    header = json.dumps(header_fields, separators=(",", ":")).encode()
    entry = ChunkEntry(offset=offset + _HEAD + len(header), **header_fields)  # type: ignore[arg-type]
    return MAGIC + len(header).to_bytes(4, "big") + header + b"".join(parts), entry


def _lane_bytes(view: memoryview, starts: Sequence[int], ends: Sequence[int],
                records: list[int]) -> bytes:
    """A lane's records before compression: each one's number in the chunk (4 bytes), then its
    length and frame as the tail holds them."""
    return b"".join([part for i in records
                     for part in (i.to_bytes(4, "big"), view[starts[i]:ends[i]])])


def _cover_of(raw: bytes, starts: Sequence[int], ends: Sequence[int],
              known: list[Known | None] | None) -> tuple[Cover, list[int]]:
    """What the records cover together, and the rank each one's lane is chosen by (its lowest
    rank; -1 without one). Where the writer said what every record covers (the hub does),
    counted by builtins over the columns; else record by record (`Cover.add`)."""
    n = len(starts)
    if known is not None and len(known) >= n and None not in known[:n]:
        types, ranks, steps, times = zip(*known[:n], strict=True) if n else ((), (), (), ())
        return (Cover(ranks=_span(ranks), steps=_span(steps), types=dict(Counter(types)),
                      t=_span(times)),
                [-1 if rank is None else rank for rank in ranks])
    cover = Cover()
    lane_ranks = []
    for i in range(n):
        frame = raw[starts[i] + 4:ends[i]]
        ranks = cover.add(frame, known[i] if known is not None and i < len(known) else None)
        lane_ranks.append(ranks[0] if ranks is not None else -1)
    return cover, lane_ranks


def _span(values: Sequence[Any]) -> list | None:
    """[lowest, highest] of `values` that are not None; None when all are."""
    present = [v for v in values if v is not None]
    return [min(present), max(present)] if present else None


def index_line(entry: ChunkEntry) -> bytes:
    """The entry as a line of the index file."""
    return json.dumps(asdict(entry), separators=(",", ":")).encode() + b"\n"


def _entry(fields: Any, offset: int | None = None) -> ChunkEntry | None:
    """A ChunkEntry from parsed JSON, None when it is not one."""
    if not isinstance(fields, dict):
        return None
    if offset is not None:
        fields = {**fields, "offset": offset}
    try:
        entry = ChunkEntry(**fields)
    except TypeError:
        return None
    ints = (entry.first, entry.count, entry.offset, entry.length, entry.raw, entry.raw_crc)
    if not all(type(v) is int and v >= 0 for v in ints) or entry.count == 0:
        return None
    lanes = entry.lanes
    if not isinstance(lanes, list) or not all(
            isinstance(lane, list) and len(lane) == 6 and all(type(v) is int for v in lane)
            and lane[2] >= 0 and lane[3] >= 0 and lane[2] + lane[3] <= entry.length
            for lane in lanes):
        return None
    return entry


def walk(data: bytes | memoryview, start: int = 0, first: int = 0
         ) -> tuple[list[ChunkEntry], list[tuple[int, int]]]:
    """The intact chunk headers of a chunks file's bytes from `start` (the first numbered
    `first`), and the damaged stretches (start, stop): a header that does not parse, a payload
    cut short, records not numbered on from the previous chunk. After damage the next `MAGIC`
    whose header parses starts again. Payloads are not checked here (`read_chunk` does)."""
    entries: list[ChunkEntry] = []
    damaged: list[tuple[int, int]] = []
    offset, size = start, len(data)
    view = memoryview(data)
    while offset < size:
        entry = _header_at(view, offset)
        if entry is not None and entry.first >= first:  # after damage: a gap
            entries.append(entry)
            first, offset = entry.stop, entry.end
            continue
        bad = offset
        offset = _next_magic(view, offset + 1)
        while offset < size and _header_at(view, offset) is None:
            offset = _next_magic(view, offset + 1)
        damaged.append((bad, offset))
    return entries, damaged


def _header_at(view: memoryview, offset: int) -> ChunkEntry | None:
    size = len(view)
    if offset + _HEAD > size or bytes(view[offset:offset + 4]) != MAGIC:
        return None
    n = int.from_bytes(view[offset + 4:offset + _HEAD], "big")
    if not 0 < n <= _MAX_HEADER or offset + _HEAD + n > size:
        return None
    try:
        fields = json.loads(bytes(view[offset + _HEAD:offset + _HEAD + n]))
    except ValueError:
        return None
    entry = _entry(fields, offset + _HEAD + n)
    if entry is None or entry.end > size:
        return None
    return entry


def _next_magic(view: memoryview, start: int) -> int:
    found = view.obj.find(MAGIC, start) if isinstance(view.obj, bytes) else -1
    return len(view) if found < 0 else found


def load_index(path: Path) -> tuple[list[ChunkEntry], list[tuple[int, int]], int]:
    """The chunks of the history at `path`: (entries, damaged stretches of the chunks file,
    the chunks file's size). From the index file when it agrees with the chunks file (its last
    entry ends where the file does); else by walking the chunks file (every header read)."""
    chunks = path.with_name(path.name + CHUNKS_SUFFIX)
    try:
        size = chunks.stat().st_size
    except FileNotFoundError:
        return [], [], 0
    entries = _read_index_file(path.with_name(path.name + INDEX_SUFFIX))
    if entries and entries[-1].end == size:
        return entries, [], size
    with open(chunks, "rb") as f:
        data = f.read()
    found, damaged = walk(data)
    return found, damaged, size


def _read_index_file(path: Path) -> list[ChunkEntry]:
    """The index file's entries, numbered upwards (a gap where a damaged chunk was); [] when
    any line is bad."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        return []
    out: list[ChunkEntry] = []
    for line in lines:
        try:
            entry = _entry(json.loads(line))
        except ValueError:
            return []
        if entry is None or entry.first < (out[-1].stop if out else 0):
            return []
        out.append(entry)
    return out


def write_index(path: Path, entries: list[ChunkEntry]) -> None:
    """Write the index file of the history at `path` anew (temporary file, then rename)."""
    write_private(path.with_name(path.name + INDEX_SUFFIX),
                  b"".join(index_line(e) for e in entries))


def read_chunk(f: Any, entry: ChunkEntry, ranks: Collection[int] | None = None
               ) -> tuple[list[tuple[int, bytes]], int, int]:
    """(record number, frame) of a chunk's records in order, read from the open chunks file
    `f`: every lane, or with `ranks` only the lanes that may hold theirs; then how many lanes
    were damaged (their intact records before the damage are still given) and how many bytes
    were read."""
    out: list[tuple[int, bytes]] = []
    damaged = read = 0
    for lo, hi, at, length, count, crc in entry.lanes:
        if ranks is not None and not any(lo <= r <= hi for r in ranks):
            continue
        f.seek(entry.offset + at)
        part = f.read(length)
        read += len(part)
        records, whole = _lane_records(part, crc, count, entry.first)
        out.extend(records)
        damaged += not whole
    out.sort(key=lambda pair: pair[0])
    return out, damaged, read


def _lane_records(part: bytes, crc: int, count: int, first: int
                  ) -> tuple[list[tuple[int, bytes]], bool]:
    """A lane's records; a damaged lane gives those before the damage (and False)."""
    whole = zlib.crc32(part) == crc
    if whole:
        raw = zlib.decompress(part)
    else:
        raw = b""
        with contextlib.suppress(zlib.error):
            raw = zlib.decompressobj().decompress(part)
    out = []
    offset, size = 0, len(raw)
    while offset + 8 <= size:
        n = int.from_bytes(raw[offset + 4:offset + 8], "big")
        if offset + 8 + n > size:
            break
        out.append((first + int.from_bytes(raw[offset:offset + 4], "big"),
                    raw[offset + 8:offset + 8 + n]))
        offset += 8 + n
    return out, whole and offset == size and len(out) == count


def frames_of(raw: bytes) -> Iterator[bytes]:
    """The frames of whole tail bytes (a 4-byte length then the frame, repeated)."""
    offset, size = 0, len(raw)
    while offset + 4 <= size:
        n = int.from_bytes(raw[offset:offset + 4], "big")
        yield raw[offset + 4:offset + 4 + n]
        offset += 4 + n


def record_starts(raw: bytes) -> list[int]:
    """The offsets of the whole records in tail bytes `raw` (a 4-byte length then the frame);
    a torn last one is left out."""
    out = []
    offset, size = 0, len(raw)
    while offset + 4 <= size:
        n = int.from_bytes(raw[offset:offset + 4], "big")
        if offset + 4 + n > size:
            break
        out.append(offset)
        offset += 4 + n
    return out
