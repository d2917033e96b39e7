"""The summary of this rank's Flight Recorder dump, written beside it (`rank_<N>.summary`) so
that `scalemon dump` reads a small file per rank instead of unpickling thousands of rings
(`scalemon.reports.frsummary`: the analysis's own function sums the dump up, here, in
parallel across the job).

Called by `Recorder.write_dump` on the recorder's thread, never the training thread: it reads
back the files just written and sums them up (about 16 ms of CPU for a ring of 2000 entries,
bench/frdump_scale.py's "summary ms"). A failure costs only the summary: the analysis then
reads the dump itself.
"""

from __future__ import annotations

from pathlib import Path

from scalemon.reports.frsummary import write_summary

from .warn import Warnings


def write_beside(directory: str, rank: int, files: list[str], warnings: Warnings) -> None:
    """Write the summary of `rank`'s dump `files` into `directory`; a failure is warned once."""
    if not files:
        return
    try:
        write_summary(Path(directory), rank, [Path(f) for f in files])
    except Exception as exc:  # (OSError, a value msgpack cannot hold): the dump stands alone
        warnings.once("fr-summary", "scalemon: the summary of the Flight Recorder dump was "
                      "not written (%s: %s); the analysis reads the dump itself",
                      type(exc).__name__, exc)
