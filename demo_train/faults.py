"""Faults injected on purpose, for demonstrations and tests of the monitor and of recovery.

    --inject-hang RANK:STEP    that rank stops before the collectives of step STEP (it sleeps
                               forever in phase "injected-hang"); the others wait in the
                               gradient all-reduce until the job is killed. A pipeline stage
                               stops before its sends of that step: its neighbours wait in
                               recv, and the stages beyond them in theirs
    --inject-crash RANK:STEP   that rank raises before step STEP, in the first attempt only
                               (TORCHELASTIC_RESTART_COUNT == 0), so a job restarted by
                               `torchrun --max-restarts N` resumes and goes on
    --inject-freeze RANK:STEP  that rank, before step STEP and in the first attempt only,
                               blocks for ever in native code HOLDING THE GIL
                               (`freeze_holding_the_gil`: libc's sleep() through
                               ctypes.PyDLL, which keeps the GIL): no other Python thread of
                               the process runs, the monitor's heartbeat and sender included,
                               so the rank goes silent as a process stuck in a C extension
                               does, and only a reader from outside the process (py-spy,
                               ptrace) sees where it is; the others wait in the all-reduce
    --slow-rank RANK:SECONDS   that rank sleeps SECONDS before every backward (after its
                               forward): it computes slowly, reaches each gradient all-reduce
                               last, and the others wait for it there (a straggler); a
                               pipeline stage sleeps before the step's schedule, so its
                               neighbours wait for its sends and receives
    --inject-desync RANK:STEP  at step STEP that rank all-reduces a tensor of another shape
                               than the others on the trainer's CPU group: where
                               TORCH_DISTRIBUTED_DEBUG=DETAIL wraps that group, torch's
                               fingerprint check names the mismatch on every rank and the
                               trainer goes on; otherwise it is skipped (it would hang)
    --inject-overflow STEP     rank 0's backward of step STEP yields inf gradients (all ranks
                               see them after the all-reduce): with --amp fp16 the loss scaler
                               skips that step and halves the scale (train.py refuses it
                               without --amp fp16: the weights would turn NaN)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

HANG_PHASE = "injected-hang"


class InjectedCrash(RuntimeError):
    """Raised by --inject-crash."""


def freeze_holding_the_gil() -> NoReturn:
    """Block for ever in native code without releasing the GIL (--inject-freeze).

    libc's sleep() is called through `ctypes.PyDLL`, which, unlike `ctypes.CDLL`, keeps the
    GIL during the call: no other Python thread of this process runs again. A signal ends a
    sleep early; the loop sleeps again (a Python signal handler may run in between, and the
    freeze goes on: SIGKILL ends it)."""
    libc = ctypes.PyDLL(None)  # the process's own symbols: libc's among them
    libc.sleep.argtypes = [ctypes.c_uint]
    libc.sleep.restype = ctypes.c_uint
    while True:
        libc.sleep(3600)


@dataclass(frozen=True)
class RankDelay:
    """A (rank, seconds) pair given as `RANK:SECONDS`."""

    rank: int
    seconds: float

    def __str__(self) -> str:
        return f"{self.rank}:{self.seconds:g}"


def rank_delay(text: str) -> RankDelay:
    """argparse type for `RANK:SECONDS`."""
    try:
        rank_text, seconds_text = text.split(":")
        rank, seconds = int(rank_text), float(seconds_text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:SECONDS, e.g. 1:0.05; got {text!r}"
                                         ) from None
    if rank < 0 or not 0 < seconds < 3600:
        raise argparse.ArgumentTypeError(f"need RANK >= 0 and 0 < SECONDS < 3600; got {text!r}")
    return RankDelay(rank, seconds)


@dataclass(frozen=True)
class RankStep:
    """A (rank, step) pair given as `RANK:STEP`."""

    rank: int
    step: int

    def __str__(self) -> str:
        return f"{self.rank}:{self.step}"


def rank_step(text: str) -> RankStep:
    """argparse type for `RANK:STEP`."""
    try:
        rank, step = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:STEP, e.g. 1:5; got {text!r}") from None
    if rank < 0 or step < 1:
        raise argparse.ArgumentTypeError(f"need RANK >= 0 and STEP >= 1; got {text!r}")
    return RankStep(rank, step)


def restart_count() -> int:
    """How many times torchrun restarted this job's workers (0 in the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Faults:
    """The faults planned for this rank."""

    def __init__(
        self,
        rank: int,
        hang: RankStep | None = None,
        crash: RankStep | None = None,
        overflow_step: int | None = None,
        slow: RankDelay | None = None,
        desync: RankStep | None = None,
        freeze: RankStep | None = None,
    ) -> None:
        self.rank = rank
        self.desync_at = desync
        self.slow_s = slow.seconds if slow and slow.rank == rank else None
        self.hang_step = hang.step if hang and hang.rank == rank else None
        first_attempt = restart_count() == 0
        self.crash_step = crash.step if crash and crash.rank == rank and first_attempt else None
        self.freeze_step = (freeze.step if freeze and freeze.rank == rank and first_attempt
                            else None)
        self.overflow_step = overflow_step if rank == 0 else None

    def before_step(self, step: int, monitor: Any = None) -> None:
        """Crash, freeze or hang here if planned for this step (before any of its
        collectives)."""
        if step == self.crash_step:
            print(f"rank {self.rank}: injected crash before step {step}", file=sys.stderr,
                  flush=True)
            raise InjectedCrash(f"--inject-crash {self.rank}:{step}")
        if step == self.freeze_step:
            print(f"rank {self.rank}: injected freeze before step {step} (native code "
                  "holding the GIL)", file=sys.stderr, flush=True)
            freeze_holding_the_gil()
        if step == self.hang_step:
            print(f"rank {self.rank}: injected hang before step {step}", file=sys.stderr,
                  flush=True)
            if monitor is not None:
                monitor.set_phase(HANG_PHASE)
            while True:
                time.sleep(3600)

    def desync(self, step: int, group: Any, rank: int) -> None:
        """At the planted step every rank all-reduces on `group`, the planted rank a tensor of
        another shape; only where torch's DETAIL wrapper checks the group (else it would hang
        or corrupt memory), which then raises on every rank: printed, and training goes on."""
        if self.desync_at is None or step != self.desync_at.step:
            return
        import torch.distributed as dist

        pg = group or dist.group.WORLD
        kind = type(pg._get_backend(torch.device("cpu"))).__name__
        if kind != "_ProcessGroupWrapper":
            if rank == 0:
                print(f"inject-desync at step {step} skipped: the group is not checked "
                      f"({kind}; toggle TORCH_DISTRIBUTED_DEBUG=DETAIL first)", flush=True)
            return
        size = 2 if rank == self.desync_at.rank else 1
        try:
            dist.all_reduce(torch.ones(size), group=pg)
            print(f"rank {rank}: inject-desync at step {step}: no mismatch reported",
                  flush=True)
        except RuntimeError as exc:
            print(f"rank {rank}: desync caught at step {step}: {str(exc)[:300]}",
                  file=sys.stderr, flush=True)

    def before_backward(self) -> None:
        """Sleep here when this rank is the planted straggler."""
        if self.slow_s is not None:
            time.sleep(self.slow_s)

    def overflow(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """The tensor to call backward on: `loss`, or `loss * inf` at the planted step."""
        if step == self.overflow_step:
            return loss * float("inf")
        return loss
