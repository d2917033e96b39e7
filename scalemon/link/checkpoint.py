"""A history's checkpoint for summaries: its fold and digest as of a record, kept beside it.

`catch_up` loads the history's last checkpoint (`history.smlog.digest`), folds the records
after it into its `JobFold` and `RunDigest` (`scalemon.state.digest`), and saves a new one at
the end of the sealed records (`scalemon.home.chunks`: those a reopening hub never renumbers),
so `scalemon summary` of a 100M-record history reads the checkpoint and the unsealed tail
only. A hub may call it after each seal (on a thread of its own) so that even the first
summary is fast; without that, the first summary of a history folds it all, once.

Like a seed (`scalemon.link.seed`), a checkpoint is a pickle read back by an unpickler that
builds only the fold's and the digest's classes; one of another format, scalemon version or
history (its id) is not used.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import scalemon
from scalemon.home import history_read
from scalemon.home.history import ID_SUFFIX
from scalemon.home.history_read import ReadStats, Selection
from scalemon.link import seed
from scalemon.protocol import Message
from scalemon.state.digest import DIGEST_CLASSES, RunDigest
from scalemon.state.fold import JobFold

FORMAT = 1
ALLOWED: dict[tuple[str, str], Any] = {
    **seed.ALLOWED, **{(cls.__module__, cls.__qualname__): cls for cls in DIGEST_CLASSES}}
"""Everything a checkpoint may build, by (module, name)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the text says why."""


@dataclass
class Checkpoint:
    """A history's fold and digest of its records before `next_seq`."""

    history_id: str | None
    next_seq: int
    rejected: int
    fold: JobFold
    digest: RunDigest

    def take(self, seq: int, msg: Message) -> None:
        """Fold record `seq` in (history order)."""
        state = self.fold.state
        self.fold.apply(seq, msg)
        if msg.type != "step" and msg.type != "heartbeat":
            mesh = (len(state.groups), len(state.info.get("mesh") or ()))
            if mesh != self.digest.mesh_seen:  # what `JobState.mesh` reads changed
                self.digest.mesh_seen = mesh
                self.digest.mesh_changed(state.mesh)
        self.digest.add(msg, state.mesh)
        self.next_seq = seq + 1

    def dump(self) -> bytes:
        """The checkpoint as bytes (`load`)."""
        return pickle.dumps({"format": FORMAT, "scalemon": scalemon.__version__,
                             "history_id": self.history_id, "next_seq": self.next_seq,
                             "rejected": self.rejected, "fold": self.fold,
                             "digest": self.digest}, protocol=5)


def load(blob: bytes) -> Checkpoint:
    """The checkpoint `blob` holds; raises CheckpointError (never another error)."""
    payload = seed.unpickle_only(blob, ALLOWED, CheckpointError, "checkpoint")
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError("another checkpoint format")
    if payload.get("scalemon") != scalemon.__version__:
        raise CheckpointError(f"written by scalemon {payload.get('scalemon')}")
    fold, digest = payload.get("fold"), payload.get("digest")
    if not isinstance(fold, JobFold) or not isinstance(digest, RunDigest):
        raise CheckpointError("it holds no fold and digest")
    return Checkpoint(payload.get("history_id"), int(payload.get("next_seq") or 0),
                      int(payload.get("rejected") or 0), fold, digest)


def history_id(path: Path) -> str | None:
    """The random id of the history at `path` (None without one)."""
    try:
        return path.with_name(path.name + ID_SUFFIX).read_text().strip() or None
    except OSError:
        return None


def last_checkpoint(path: Path, job: str) -> tuple[Checkpoint, str | None]:
    """The history's checkpoint, or a new empty one, and why the saved one is not used."""
    fresh = Checkpoint(history_id(path), 0, 0, JobFold(job=job), RunDigest())
    blob = history_read.read_checkpoint(path)
    if blob is None:
        return fresh, None
    try:
        found = load(blob)
    except CheckpointError as exc:
        return fresh, str(exc)
    if found.history_id != fresh.history_id or found.fold.state.job not in (job, None):
        return fresh, "it is of another history"
    if found.next_seq > history_read.sealed_count(path):
        return fresh, "it is ahead of the history's sealed records"
    return found, None


def catch_up(path: Path, job: str, save: bool = True, stats: ReadStats | None = None,
             upto: int | None = None) -> Checkpoint:
    """The fold and digest of the history at `path` (records of `job`), from its last
    checkpoint on through its end (or record `upto`); with `save`, a new checkpoint is written
    at the end of its sealed records when it gets past the saved one. `stats.rejected`: the
    records skipped before and since the checkpoint."""
    stats = stats if stats is not None else ReadStats()
    checkpoint, _ = last_checkpoint(path, job)
    stats.rejected += checkpoint.rejected
    sealed = history_read.sealed_count(path)
    from_seq = checkpoint.next_seq
    saved = not save or sealed <= from_seq
    select = Selection(seqs=(from_seq, upto - 1 if upto is not None else None))
    for seq, msg in history_read.iter_messages(path, job, stats, select, stored=True):
        if not saved and seq >= sealed:
            _save(path, checkpoint, sealed, stats)
            saved = True
        checkpoint.take(seq, msg)
    if not saved and (upto is None or upto >= sealed):  # every sealed record taken
        _save(path, checkpoint, sealed, stats)
    return checkpoint


def _save(path: Path, checkpoint: Checkpoint, sealed: int, stats: ReadStats) -> None:
    checkpoint.next_seq = max(checkpoint.next_seq, sealed)  # the records skipped at its end
    checkpoint.rejected = stats.rejected
    history_read.write_checkpoint(path, checkpoint.dump())


def main(argv: list[str] | None = None) -> int:
    """`python -m scalemon.link.checkpoint HISTORY JOB`: bring the checkpoint of a history up
    to its sealed records (what a hub may run, as a process of its own, after a seal)."""
    import argparse

    parser = argparse.ArgumentParser(allow_abbrev=False, description=main.__doc__)
    parser.add_argument("history", type=Path, help="the history file (history.smlog)")
    parser.add_argument("job", help="the job id")
    args = parser.parse_args(argv)
    catch_up(args.history, args.job, upto=history_read.sealed_count(args.history))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
