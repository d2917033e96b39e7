"""The recorder's point-to-point part: the gloo P2P ops the wrappers of `p2p.py` recorded and
NCCL's P2P ring entries, as the `collectives` message's `p2p` rows per (group, op, src, dst);
the op ids that turn a gloo group's status into collective sequence numbers; the ops in flight
while the training thread is stuck in a P2P `wait()`. Run from the recorder's thread."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from scalemon.collectives import P2PStats, buffer_bytes, p2p_group_ranks

from . import c10d
from .p2p import OpIds, P2PRecord, P2PTimer

P2P_HELD_S = 5.0
"""A gloo P2P op whose `wait()` has not returned is counted without a duration after this."""
PENDING_KEPT = 50_000
"""gloo P2P ops waiting for their duration, at most (the oldest are counted without one)."""


class P2PReader:
    """Turns what the P2P wrappers (`timer`; None on NCCL) recorded into rows."""

    def __init__(self, timer: P2PTimer | None) -> None:
        self.timer = timer
        self._pending: deque[P2PRecord] = deque()  # gloo P2P ops not counted yet
        self._rank: int | None = None

    def op_ids(self) -> dict[str, OpIds]:
        """The P2P op ids of each gloo group that carries P2P, by group name."""
        if self.timer is None or not self.timer.ids:
            return {}
        return self.timer.by_name(c10d.group_names())

    def inflight(self) -> list[list[Any]] | None:
        """The P2P ops issued and not completed, as `p2p_inflight` rows (None on NCCL)."""
        if self.timer is None:
            return None
        return self.timer.inflight_rows(c10d.group_names())

    def learn_groups(self, group_info: dict[str, dict[str, Any]]) -> None:
        """Describe in `group_info` the gloo groups that carry only P2P (the ring has no entry
        of them)."""
        if self.timer is None or not self.timer.ids:
            return
        for pg, name in list(c10d.group_names().items()):
            name = str(name)
            if (name not in group_info or not group_info[name]["ranks"]) and pg in self.timer.ids:
                group_info[name] = {"desc": str(getattr(pg, "group_desc", "") or ""),
                                    "ranks": c10d.group_ranks(name) or []}

    def take(self, p2p: P2PStats) -> None:
        """The gloo P2P ops the wrappers recorded, into rows, each once its `wait()` timed it
        (or `P2P_HELD_S` after its issue without)."""
        timer = self.timer
        if timer is None:
            return
        pending = self._pending
        while timer.records:
            pending.append(timer.records.popleft())
        if not pending:
            return
        names = c10d.group_names()
        rank = self._own_rank()
        now = time.time()
        kept: deque[P2PRecord] = deque()
        for record in pending:
            waiting = record.work is not None  # first: the training thread sets seconds, then
            seconds = record.seconds  # drops the work
            if seconds is None and waiting and now - record.t < P2P_HELD_S:
                kept.append(record)
                continue
            self._add(p2p, record, names, rank, seconds)
        while len(kept) > PENDING_KEPT:  # counted now, without their durations
            self._add(p2p, kept.popleft(), names, rank, None)
        self._pending = kept

    @staticmethod
    def _add(p2p: P2PStats, record: P2PRecord, names: Any, rank: int,
             seconds: float | None) -> None:
        peer = -1 if record.peer is None else record.peer
        src, dst = (rank, peer) if record.op == "send" else (peer, rank)
        p2p.add(str(names.get(record.group, "?")), record.op, src, dst, record.nbytes, seconds)

    def _own_rank(self) -> int:
        if self._rank is None:
            import torch.distributed as dist

            self._rank = dist.get_rank()
        return self._rank

    @staticmethod
    def take_nccl(e: dict[str, Any], group: str, name: str, seconds: float | None,
                  p2p: P2PStats, group_info: dict[str, dict[str, Any]]) -> bool:
        """An NCCL P2P entry into its `p2p` row; False where its name says no peers."""
        peers = p2p_group_ranks(name)
        if peers is None:
            return False
        op, src, dst = peers
        ranks = (group_info.get(group) or {}).get("ranks") or []
        src, dst = (ranks[r] if 0 <= r < len(ranks) else r for r in (src, dst))
        p2p.add(group, op, src, dst, buffer_bytes(e), seconds)
        return True
