"""A directory of Flight Recorder dumps read for the analysis, at thousands of ranks: each
rank is summed up on its own (`frsummary.summarise`: `RankDump` without its entries, its
collectives put in a `SeqTable`), by several processes where there are many ranks, so that
memory grows with what the analysis keeps (per rank its groups' counts, per group and sequence
number each distinct shape once), not with ranks x entries; `progress` is told as ranks are
read. A rank whose agent wrote its summary beside its dump (`rank_<N>.summary`) is read from
it while it matches the dump; otherwise (none, stale, damaged) from the dump, to the same
result.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

from scalemon.collector import collector_paused
from scalemon.reports.frread import RankDump, rank_files
from scalemon.reports.frsummary import (
    RankSummary,
    SummaryError,
    read_summary,
    summarise,
    summary_files,
)
from scalemon.reports.frtable import SeqTable

PARALLEL_FROM = 64
"""Ranks from which the files are read by worker processes (fewer: in this process)."""
CHUNK_RANKS = (16, 128)
"""Ranks a worker reads per task, at least and at most (consecutive ranks: a tensor-parallel
group stays in one); about 16 tasks per worker, for the progress."""
Progress = Callable[[int, int], None]
"""Told (ranks read, ranks in all) as the reading goes on."""


SUMMARIES_NAMED = 3
"""Ignored summaries named with their reason in `Scan.summaries_note` (then a count)."""


@dataclass
class Scan:
    """What a directory's dumps say: each rank's dump (without its entries), the ranks whose
    files could not be read (why), the collectives of them all by group and seq; how many
    ranks were read from their summaries, and the summaries ignored (why)."""

    dumps: dict[int, RankDump] = field(default_factory=dict)
    problems: dict[int, str] = field(default_factory=dict)
    table: SeqTable = field(default_factory=SeqTable)
    seconds: float = 0.0
    from_summaries: int = 0
    summaries_ignored: dict[int, str] = field(default_factory=dict)

    def summaries_note(self) -> str | None:
        """How the ranks were read, for people, where any rank had a summary: "4095 of 4096
        ranks read from their summaries; 1 summary ignored, its dump read (rank 7: stale: ...)"
        (None where no rank had one)."""
        ignored = self.summaries_ignored
        if not self.from_summaries and not ignored:
            return None
        ranks = len(self.dumps.keys() | self.problems.keys())
        text = f"{self.from_summaries} of {ranks} ranks read from their summaries"
        if ignored:
            named = "; ".join(f"rank {r}: {why}" for r, why in
                              sorted(ignored.items())[:SUMMARIES_NAMED])
            more = f"; {len(ignored) - SUMMARIES_NAMED} more" if len(
                ignored) > SUMMARIES_NAMED else ""
            text += (f"; {len(ignored)} {'summary' if len(ignored) == 1 else 'summaries'} "
                     f"ignored, the dump read instead ({named}{more})")
        return text


Chunk = list[tuple[int, list[str], str | None]]
"""Ranks to read: each with its dump files and its summary (None: no summary)."""


@dataclass
class ChunkRead:
    """What reading a chunk gave: per rank its dump (None if no file could be read) and why
    files could not be read; their collectives in one table; how many came from summaries and
    the summaries ignored."""

    rows: list[tuple[int, RankDump | None, str | None]]
    table: SeqTable
    from_summaries: int = 0
    ignored: dict[int, str] = field(default_factory=dict)


def read_ranks(chunk: Chunk) -> ChunkRead:
    """Read some ranks: each from its summary where it has one that matches its files, else
    from its files."""
    read = ChunkRead([], SeqTable())
    with collector_paused():
        for rank, names, summary in chunk:
            paths = [Path(p) for p in names]
            found: RankSummary | None = None
            if summary is not None:
                try:
                    found = read_summary(Path(summary), rank, paths)
                    read.from_summaries += 1
                except SummaryError as exc:
                    read.ignored[rank] = str(exc)
            if found is None:
                found = summarise(rank, paths)
            if found.dump is not None:
                read.table.add(rank, found.cells)
            read.rows.append((rank, found.dump, found.why))
    return read


def scan_directory(directory: Path, progress: Progress | None = None,
                   workers: int | None = None) -> Scan:
    """Every rank's dump in `directory` (`rank_files`; from its summary where it has one),
    read by up to `workers` processes (default: one per CPU) when there are `PARALLEL_FROM`
    ranks or more."""
    start = time.monotonic()
    files = rank_files(directory)
    summaries = summary_files(directory)
    ordered = sorted(files.items())  # consecutive ranks per chunk
    workers = workers or os.cpu_count() or 1
    size = min(max(len(ordered) // (workers * 16), CHUNK_RANKS[0]), CHUNK_RANKS[1])
    chunks = [[(rank, [str(p) for p in paths],
                str(summaries[rank]) if rank in summaries else None)
               for rank, paths in ordered[i:i + size]]
              for i in range(0, len(ordered), size)]
    results: dict[int, tuple[RankDump | None, str | None]] = {}
    scan = Scan()
    done = 0

    def take(read: ChunkRead) -> None:
        nonlocal done
        for rank, dump, why in read.rows:
            results[rank] = (dump, why)
        scan.table.merge(read.table)
        scan.from_summaries += read.from_summaries
        scan.summaries_ignored.update(read.ignored)
        done += len(read.rows)
        if progress is not None:
            progress(done, len(ordered))

    with collector_paused():
        if progress is not None:
            progress(0, len(ordered))
        left = chunks
        if len(ordered) >= PARALLEL_FROM and workers > 1 and len(chunks) > 1:
            left = _in_workers(chunks, min(workers, len(chunks)), take)
        for chunk in left:
            take(read_ranks(chunk))
    for rank in files:  # in the order of the files' names, as the analysis reads them
        dump, why = results[rank]
        if dump is not None:
            scan.dumps[rank] = dump
        if why:
            scan.problems[rank] = why
    scan.seconds = time.monotonic() - start
    return scan


def _in_workers(chunks: list[Chunk], workers: int,
                take: Callable[[ChunkRead], None]) -> list[Chunk]:
    """Read the chunks in worker processes; returns those left unread (a worker died)."""
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    pending: dict[Future[ChunkRead], Chunk] = {}
    try:
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            pending = {pool.submit(read_ranks, chunk): chunk for chunk in chunks}
            for future in as_completed(pending):
                take(future.result())
                del pending[future]
    except BrokenProcessPool:  # killed (out of memory?): what is left is read here
        return list(pending.values())
    return []

