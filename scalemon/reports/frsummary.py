"""One rank's Flight Recorder dump summed up as the analysis takes it (`summarise`: what
`frscan` does per rank), and that summary as a small file beside the dump.

The rank's agent writes `rank_<N>.summary` when it writes its dump (`write_summary`, on its
recorder thread): thousands of ranks sum up their own rings at once, and the analysis reads a
small file per rank instead of unpickling each ring (about 16 ms of CPU per 2000 entries).
The file is msgpack, written to a temporary then renamed; it names the dump files it sums up
with the size and modification time (ns) each had before it read them. The analysis takes it
(`read_summary`) only while these match the rank's files; a summary that is stale, damaged or
of another format raises `SummaryError` with the reason, and the dump is read instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from scalemon.reports.frread import (
    SHAPES_KEPT,
    Cell,
    DumpError,
    GroupSeen,
    RankDump,
    Shape,
    load_file,
)

FORMAT = 1
"""The summary's layout; a file of another is ignored (bump it when `RankDump` changes)."""
SUFFIX = ".summary"
MAX_SUMMARY_BYTES = 64 << 20
_NAME = re.compile(r"^rank_(?P<rank>\d+)\.summary$")


class SummaryError(ValueError):
    """A summary that cannot stand for its rank's dump; the text says why."""


@dataclass
class RankSummary:
    """One rank's dump files summed up: its dump without entries or cells (None when no file
    could be read), its collectives by (group, seq) for a `SeqTable`, why files could not be
    read."""

    dump: RankDump | None
    cells: dict[tuple[str, int], Cell] = field(default_factory=dict)
    why: str | None = None


def summarise(rank: int, paths: Iterable[Path]) -> RankSummary:
    """Read `rank`'s dump files (in the order given) and sum them up."""
    dump = RankDump(rank, keep_entries=False)
    errors = []
    for path in paths:
        try:
            dump.add(load_file(path), path.name)
        except DumpError as exc:
            errors.append(f"{path.name}: {exc}")
    if not dump.files:
        return RankSummary(None, {}, "; ".join(errors) or None)
    return RankSummary(dump, dump.compact(), "; ".join(errors) or None)


def summary_path(directory: Path, rank: int) -> Path:
    """Where `rank`'s summary lies in a dump directory."""
    return directory / f"rank_{rank}{SUFFIX}"


def summary_files(directory: Path) -> dict[int, Path]:
    """The summaries in a dump directory, by rank."""
    found = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            match = _NAME.match(entry.name)
            if match is not None:
                found[int(match["rank"])] = Path(entry.path)
    return found


def write_summary(directory: Path, rank: int, paths: Iterable[Path]) -> Path:
    """Sum up `rank`'s dump files (read in the order of their names, as the analysis reads a
    directory) and write the summary beside them, atomically; raises OSError (or ValueError
    for values msgpack cannot hold)."""
    ordered = sorted(paths, key=lambda p: p.name)
    files = [[p.name, st.st_size, st.st_mtime_ns] for p in ordered for st in (p.stat(),)]
    data = _encode(rank, files, summarise(rank, ordered))  # stat first: a later change shows
    path = summary_path(directory, rank)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path


def read_summary(path: Path, rank: int, paths: list[Path]) -> RankSummary:
    """`rank`'s summary in `path` when it stands for exactly `paths` as they are now (names,
    sizes, modification times); raises SummaryError saying why not."""
    try:
        if path.stat().st_size > MAX_SUMMARY_BYTES:
            raise SummaryError(f"over the {MAX_SUMMARY_BYTES >> 20} MiB a summary may have")
        data = path.read_bytes()
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except OSError as exc:
        raise SummaryError(f"cannot read it: {exc.strerror or exc}") from None
    except SummaryError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise SummaryError(f"damaged ({type(exc).__name__})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise SummaryError("not a summary of this scalemon's format")
    if body.get("rank") != rank:
        raise SummaryError(f"it sums up rank {body.get('rank')!r}, not {rank}")
    try:
        now = [[p.name, st.st_size, st.st_mtime_ns] for p in paths for st in (p.stat(),)]
    except OSError as exc:
        raise SummaryError(f"cannot stat the dump: {exc.strerror or exc}") from None
    if body.get("files") != now:
        raise SummaryError("stale: the dump files differ (names, sizes or times) from those "
                           "it sums up")
    try:
        return _decode(rank, body)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise SummaryError(f"damaged ({type(exc).__name__}: {exc})") from None


# --- the file's layout ---------------------------------------------------------------------
# {"format", "rank", "files": [[name, size, mtime_ns]], "why": str|None,
#  "dump": None | {"files", "versions", "groups": [[name, desc, ranks|None, issued, completed]],
#                  "skipped", "mixed", "has_p2p", "p2p_pending": [[group, op, peer, t, bytes]]},
#  "shapes": [[op, dtypes, sizes, signature]], "cells": [[shape index, ...]],
#  "keys": [group names, group index per key, seq per key, cell index per key]}
# (the keys in the order of the rank's cells: the analysis reads them in that order)

def _encode(rank: int, files: list[list[Any]], summary: RankSummary) -> bytes:
    shapes: dict[Shape, int] = {}
    cell_index: dict[Cell, int] = {}
    cells: list[list[int]] = []
    names: dict[str, int] = {}
    by_group, seqs, by_cell = [], [], []
    for (group, seq), cell in summary.cells.items():
        by_group.append(names.setdefault(group, len(names)))
        seqs.append(seq)
        index = cell_index.get(cell)
        if index is None:
            index = cell_index[cell] = len(cells)
            cells.append([shapes.setdefault(shape, len(shapes)) for shape in cell])
        by_cell.append(index)
    dump = summary.dump
    body = {"format": FORMAT, "rank": rank, "files": files, "why": summary.why,
            "dump": None if dump is None else {
                "files": dump.files, "versions": sorted(dump.versions),
                "groups": [[name, g.desc, g.config_ranks, g.issued, g.completed]
                           for name, g in dump.groups.items()],
                "skipped": dump.skipped, "mixed": sorted(dump.mixed), "has_p2p": dump.has_p2p,
                "p2p_pending": [list(p) for p in dump.p2p_pending]},
            "shapes": [list(s) for s in shapes], "cells": cells,
            "keys": [list(names), by_group, seqs, by_cell]}
    return msgpack.packb(body, use_bin_type=True)


def _decode(rank: int, body: dict[str, Any]) -> RankSummary:
    why = body["why"]
    if why is not None and type(why) is not str:
        raise TypeError("why")
    raw = body["dump"]
    if raw is None:
        return RankSummary(None, {}, why)
    dump = RankDump(rank, keep_entries=False)
    dump.files = _all(raw["files"], str)
    dump.versions = set(_all(raw["versions"], str))
    for name, desc, ranks, issued, completed in raw["groups"]:
        _all([name, desc], str)
        _all([issued, completed], int)
        dump.groups[name] = GroupSeen(desc, None if ranks is None else _shared(ranks),
                                      issued, completed)
    dump.skipped = _all([raw["skipped"]], int)[0]
    dump.mixed = set(_all(raw["mixed"], str))
    dump.has_p2p = _all([raw["has_p2p"]], bool)[0]
    for group, op, peer, t, nbytes in raw["p2p_pending"]:
        _all([group, op], str)
        _all([peer], int)
        if not (t is None or type(t) is float) or not (nbytes is None or type(nbytes) is int):
            raise TypeError("p2p_pending")
        dump.p2p_pending.append((group, op, peer, t, nbytes))
    shapes = [Shape(*_all(s, str)) for s in body["shapes"]]
    cells = [tuple(shapes[_index(i)] for i in row) for row in body["cells"]]
    names, by_group, seqs, by_cell = body["keys"]
    _all(names, str)
    _all(by_group, int)
    _all(seqs, int)
    _all(by_cell, int)
    out = {(names[g], seq): cells[c] for g, seq, c in zip(by_group, seqs, by_cell, strict=True)}
    return RankSummary(dump, out, why)


def _all(values: Any, kind: type) -> list[Any]:
    """`values` (a list) when each is exactly of `kind`; raises TypeError."""
    if type(values) is not list or not all(type(v) is kind for v in values):
        raise TypeError(f"not a list of {kind.__name__}")
    return values


def _index(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise IndexError("cell")
    return value


_RANKS: dict[tuple[int, ...], list[int]] = {}


def _shared(ranks: Any) -> list[int]:
    """A group's ranks, one list per distinct list in a process (every rank names the default
    group's thousands of ranks: kept once, as `frread` keeps them)."""
    key = tuple(_all(ranks, int))
    found = _RANKS.get(key)
    if found is None:
        if len(_RANKS) >= SHAPES_KEPT:
            _RANKS.clear()
        found = _RANKS[key] = ranks
    return found
