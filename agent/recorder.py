"""Every collective of every process group, from PyTorch's Flight Recorder, read off the
training thread.

torch records each collective in C++ when it is enqueued (on by default in torch 2.11-2.13,
TORCH_FR_BUFFER_SIZE entries in a ring). `Recorder` runs its own daemon thread that

- once a second reads the recorder's cheap per-group status (last issued and completed sequence
  number of every group: the heartbeat's `groups`, and what names a hang's culprit);
- now and then reads the whole ring (a few ms for 2000 entries, holding the GIL: the interval
  is chosen so that this stays under ~0.5 % of wall time), takes the entries it has not seen
  (by `record_id`; a gap means the ring wrapped before the read: counted in `recorder_lost`),
  aggregates them by (group, op, size bucket) and sends one `collectives` message with the
  issue time of every new collective (arrival skew) and the all-reduce time and count of each
  step completed since (`stepcomm.py`, from the training thread's `log()` times);
- while the training thread is stuck (no `log()` for the hang threshold, `HANG_AFTER_S` or
  the hub's `--hang-after`), adds its Python stack and the collectives in flight to the
  heartbeat, and says whether it waits in a collective (`blocked`);
- at `stop()` (the rank's `finish()`, after its last collective was issued) reads the rings a
  last time, once the collectives they hold completed (`FINAL_WAIT_S` at most), and takes
  every entry then, so that none of the job's last collectives is left out.

What each backend records (torch 2.13): NCCL entries carry `duration_ms` once collective timing
is on (the agent turns it on for every group, also groups created later). gloo entries carry
counts, sizes, sequence numbers and issue times but no duration; there the host timer of
`hosttiming.py` supplies durations (the only per-collective work on the training thread, and
only on gloo).

Point-to-point ops: NCCL's ring records them (`is_p2p`, named "nccl:send 0->1" in group
ranks, with `duration_ms`); gloo's records none, and there the P2P wrappers of `p2p.py`
supply them. Both go out as the `collectives` message's `p2p` rows per (group, op, src, dst),
never as `stats` rows. On gloo a group's `pg_status` counts its P2P ops in its sequence numbers
(op ids); they are turned into collective sequence numbers before anything compares them with
the entries' `collective_seq_id`. While the training thread is stuck inside a P2P `wait()`,
the heartbeat lists the P2P ops in flight (`p2p_inflight`) and the rank is `blocked`.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scalemon.collectives import (
    CollectiveStats,
    P2PStats,
    buffer_bytes,
    is_all_reduce,
    op_name,
    pg_config_ranks,
    size_bucket,
)
from scalemon.policy import HANG_AFTER_S

from . import c10d
from .frsummary import write_beside
from .p2p import OpIds, P2PTimer
from .recorder_p2p import P2PReader
from .rings import RecorderSource, find_sources, group_uses_nccl
from .stepcomm import StepComm
from .warn import Warnings

log = logging.getLogger("scalemon.agent")

MAX_ISSUES = 20_000
"""Issue times per `collectives` message at most (the newest are kept)."""
READ_DUTY = 0.005
"""Share of wall time the full reads may take (their own measured cost sets the interval)."""
HELD_BACK_S = 30.0
"""An NCCL entry is taken without a duration once it waited this long to complete."""
MAX_STEP_ROWS = 4096
"""Steps' all-reduce figures per `collectives` message at most (the newest are kept)."""
HOST_CALLS_KEPT = 50_000
"""Host-timed calls, taken entries and untimed entries remembered for matching, at most."""
FINAL_WAIT_S = 2.0
"""At `stop()`, how long the last read waits for collectives still running (NCCL entries not
completed, gloo calls without their duration) before it takes them as they are; under the
join timeout of `stop()`."""


GROUP_LISTED_BY_ALL = 1024
"""A process group of more ranks than this has its members listed by its first rank only; the
others send its size (at 16,384 ranks every rank listing the default group would send the hub
16,384 x 16,384 rank numbers as the job starts)."""


def wire_group(group: dict[str, Any], rank: int | None) -> dict[str, Any]:
    """A group as this rank says it in `collectives.groups`: its members, or for a big group
    of which this rank is not the first, none and its `size`."""
    ranks = group.get("ranks") or []
    if len(ranks) <= GROUP_LISTED_BY_ALL or rank is None or rank == min(ranks):
        return group
    return {"desc": group.get("desc", ""), "ranks": [], "size": len(ranks)}


class Recorder:
    """Reads the Flight Recorder from a daemon thread and sends what it found."""

    def __init__(
        self,
        submit: Callable[[str, dict[str, Any]], bool],
        training_thread: int,
        last_log: Callable[[], float | None],
        current_step: Callable[[], int | None],
        nccl: bool,
        host_calls: deque | None = None,
        warnings: Warnings | None = None,
        status_every_s: float = 1.0,
        min_read_s: float = 1.0,
        max_read_s: float = 10.0,
        stuck_after_s: float = HANG_AFTER_S,
        ras_port: int | None = None,
        sources: list[RecorderSource] | None = None,
        step_marks: deque[tuple[int, float]] | None = None,
        start: bool = True,
        p2p: P2PTimer | None = None,
        host_issuing: set[object] | None = None,
        rank: int | None = None,
    ) -> None:
        self.submit = submit
        self.rank = rank
        """This rank's global rank: a big group's members are sent by its first rank only."""
        self.training_thread = training_thread
        self.last_log = last_log
        self.current_step = current_step
        self.nccl = nccl
        self.host_calls = host_calls  # HostCall lists from the gloo timer (hosttiming.py)
        self.host_issuing = host_issuing  # the timer's calls under way (HostTimer.issuing)
        self.on_status: Callable[[], None] | None = None  # after each read (mesh discovery)
        self.warnings = warnings or Warnings()
        self.status_every_s = status_every_s
        self.min_read_s = min_read_s
        self.max_read_s = max_read_s
        self.stuck_after_s = stuck_after_s  # the hang threshold: the hub's, once it answered
        self.stuck = False
        self.on_stuck: Callable[[], None] | None = None  # called once per stuck spell
        self.ras_port = ras_port  # None: do not ask NCCL RAS (gloo, or not this node's rank 0)
        self._ras_asked = False
        self.sources = find_sources(nccl) if sources is None else sources
        self.read_s = 0.0
        self.entries = 0
        self.lost = 0
        self.fields: dict[str, Any] = {"groups": None, "inflight": None, "stack": None,
                                       "collectives_issued": None,
                                       "collectives_completed": None, "p2p_inflight": None}
        self._groups_sent: set[str] = set()
        self._group_info: dict[str, dict[str, Any]] = {}
        self._names_by_pg_id: dict[str, str] = {}  # pg_id -> group name, from entries
        self._held: dict[int, float] = {}  # NCCL entries read before they completed: issue t
        self._host_calls: dict[tuple[str, int], list] = {}  # (group, seq) -> HostCall (gloo)
        self._taken: dict[tuple, None] = {}  # recent collectives taken, across rings
        self._awaiting: dict[tuple[str, int], tuple[str, str, int]] = {}  # taken, untimed
        self._call_due: dict[tuple[str, int], float] = {}  # taken before their host call: until
        self._awaiting_items: dict[tuple[str, int], Any] = {}  # their StepComm items
        self.p2p_reader = P2PReader(p2p)  # `p2p`: the gloo P2P wrappers (p2p.py); None on NCCL
        self.step_comm = StepComm(step_marks)  # each step's all-reduces (`log()` boundaries)
        self._timed_groups: set[int] = set()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.dump_requests: deque[tuple[str, int]] = deque()
        self._thread = threading.Thread(target=self._run, name="scalemon-recorder", daemon=True)
        if self.sources:
            self.enable_timing()
            if start:
                self._thread.start()
        else:
            self.warnings.once("no-recorder", "scalemon: this torch has no Flight Recorder "
                               "(torch._C._distributed_c10d._dump_fr_trace): collectives are "
                               "not monitored")

    # --- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        if self.nccl:  # its reads query CUDA events: never into a capture of the training's
            from .cudagraphs import capture_mode_thread_local

            capture_mode_thread_local()
        next_full = time.monotonic() + self.min_read_s
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                self.enable_timing()
                self._serve_dumps()
                was_stuck = self.stuck
                stuck = self._stuck()
                if stuck and not was_stuck:
                    self._report_stuck_now()
                    next_full = time.monotonic() + self.min_read_s
                if stuck and not self._ras_asked:
                    self._ras_asked = True
                    self.relay_ras()
                if now >= next_full or (stuck and self.fields["inflight"] is None):
                    cost = self.read_all(stuck)
                    gap = min(self.max_read_s, max(self.min_read_s, cost / READ_DUTY))
                    next_full = time.monotonic() + gap
                else:
                    self.read_status(stuck)
                if self.on_status is not None:
                    self.on_status()
            except Exception as exc:  # keep reading; never into the training loop
                self.warnings.once("recorder", "scalemon: reading the Flight Recorder failed "
                                   "(%s: %s); collectives may be missing", type(exc).__name__, exc)
            self._wake.wait(self._next_wait())
            self._wake.clear()
        try:
            self.last_read()  # what the last steps issued
        except Exception as exc:
            self.warnings.once("recorder-last", "scalemon: the last Flight Recorder read failed: "
                               "%s", exc)

    def last_read(self, wait_s: float = FINAL_WAIT_S) -> None:
        """The reads at `stop()`: again every 50 ms while a collective read is still running
        (`_running`), `wait_s` at most, then one that takes every entry as it is: nothing is
        left for a read that never comes."""
        end = time.monotonic() + wait_s
        self.read_all(False)
        while self._running() and time.monotonic() < end:
            time.sleep(0.05)
            self.read_all(False)
        self.read_all(False, final=True)

    def _running(self) -> bool:
        """True while a collective this recorder read has not completed: an entry held back
        (NCCL, or gloo before its host call), a gloo call without its duration, a group whose
        status has issued more than it completed (gloo says so a moment after the call)."""
        if self._held or any(s[0] > s[1] for s in (self.fields["groups"] or {}).values()):
            return True
        return any(call[3] is None for ident in self._awaiting
                   if (call := self._host_calls.get(ident)) is not None)

    def _next_wait(self) -> float:
        """Until the next status read, or sooner: the moment the training thread becomes
        stuck (the hang threshold), so that its stack goes out with no delay."""
        last = self.last_log()
        if last is None or self.stuck:
            return self.status_every_s
        until_stuck = last + self.stuck_after_s - time.perf_counter()
        return min(self.status_every_s, max(0.05, until_stuck + 0.01))

    def _report_stuck_now(self) -> None:
        """Just stuck: read everything (stack, collectives in flight) and have the heartbeat
        send it now rather than within its next second."""
        self.read_all(True)
        if self.on_stuck is not None:
            self.on_stuck()

    def stop(self) -> None:
        """Read once more, send, and stop the thread."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def blocked(self) -> bool | None:
        """While the training thread is stuck: whether it waits in a collective (a group
        with more issued than completed); None while it is not stuck."""
        if not self.stuck:
            return None
        if self.fields["p2p_inflight"]:  # the last reading found it inside a P2P wait()
            return True
        groups = self.fields["groups"] or {}
        return any(s[0] > s[1] for s in groups.values())

    def heartbeat_fields(self) -> dict[str, Any]:
        """What the heartbeat carries from here (latest readings)."""
        return {**self.fields, "recorder_read_s": self.read_s,
                "recorder_entries": self.entries, "recorder_lost": self.lost}

    def use_gloo(self) -> None:
        """The job turned out to run gloo (`init()` guessed NCCL before its group existed):
        read the generic ring only, and do not ask NCCL RAS."""
        self.nccl = False
        self.ras_port = None
        self.sources = [source for source in self.sources if source.name != "nccl"]

    # --- collective timing ------------------------------------------------------------------
    def enable_timing(self) -> None:
        """NCCL: turn on collective timing (one-way) on every NCCL group, new ones included
        (a job's gloo groups, e.g. for CPU barriers, have no such switch)."""
        if not self.nccl:
            return
        for pg in list(c10d.group_names()):
            if id(pg) in self._timed_groups:
                continue
            self._timed_groups.add(id(pg))
            if not group_uses_nccl(pg, unknown=True):  # unknown: timing is tried
                continue
            try:
                c10d.enable_group_timing(pg)
            except Exception as exc:
                self.warnings.once("fr-timing", "scalemon: could not turn on collective timing "
                                   "of a process group (%s): its collectives have no duration",
                                   exc)

    # --- reading ---------------------------------------------------------------------------
    def _stuck(self) -> bool:
        """True while the training thread has not called `log()` for `stuck_after_s` (a hang
        candidate); when it is not, forgets the last stuck spell's stack and in-flight list."""
        last = self.last_log()
        if last is None:
            return False
        stuck = self.stuck = time.perf_counter() - last >= self.stuck_after_s
        if not stuck:
            self._ras_asked = False
            self.fields["stack"] = self.fields["inflight"] = self.fields["p2p_inflight"] = None
        return stuck

    def read_status(self, stuck: bool) -> None:
        """The cheap read: each group's last issued and completed collective."""
        t0 = time.perf_counter()
        groups: dict[str, list[int]] = {}
        op_ids = self.p2p_reader.op_ids()
        for source in self.sources:
            status = source.read(False).get("pg_status") or {}
            self._merge_status(status, groups, op_ids if source.name == "fr" else None)
        self.read_s += time.perf_counter() - t0
        self._publish_status(groups)
        if stuck:
            self.fields["stack"] = self.training_stack()
            self.fields["p2p_inflight"] = self.p2p_reader.inflight()

    def _merge_status(self, status: dict[str, Any], groups: dict[str, list[int]],
                      op_ids: dict[str, OpIds] | None = None) -> None:
        """Each group's [issued, completed] of `status` into `groups` (the larger of what is
        there); `op_ids`: gloo's, whose status counts P2P ops too, to take out."""
        for pg_id, item in status.items():
            name = self._names_by_pg_id.get(str(pg_id), str(pg_id))
            try:
                issued = int(item.get("last_enqueued_collective", -1))
                completed = int(item.get("last_completed_collective", -1))
            except (TypeError, ValueError, AttributeError):
                continue
            ids = op_ids.get(name) if op_ids else None
            if ids is not None:
                issued = ids.collective_seq(issued) if issued > 0 else issued
                completed = ids.collective_seq(completed) if completed > 0 else completed
            if issued < 0 and name not in groups:
                continue
            old = groups.get(name)
            groups[name] = [max(issued, old[0]), max(completed, old[1])] if old else [
                max(issued, 0), max(completed, 0)]

    def _publish_status(self, groups: dict[str, list[int]]) -> None:
        self.fields["groups"] = groups
        self.fields["collectives_issued"] = sum(s[0] for s in groups.values())
        self.fields["collectives_completed"] = sum(s[1] for s in groups.values())

    def read_all(self, stuck: bool, final: bool = False) -> float:
        """Read every ring, send the new collectives; returns the read's cost in seconds.
        `final`: the last read of the rank, which holds nothing back for a later one.

        On gloo the rings are read before the host timer's calls are collected: an entry read
        without its call is then one that was issued without the timer (no call will come),
        unless a timed call was under way (`host_issuing`), which may be its own: such an
        entry waits for the next read, so that its op is the call's (gloo's recorder names a
        reduce-scatter `all_reduce`)."""
        t0 = time.perf_counter()
        stats = CollectiveStats()
        p2p = P2PStats()
        issues: list[list[Any]] = []
        groups: dict[str, list[int]] = {}
        inflight: list[list[Any]] = []
        op_ids = self.p2p_reader.op_ids()
        dumps = [(source, source.read(True)) for source in self.sources]
        calls_pending = not final and bool(self.host_issuing)  # after the rings were read
        self._collect_host_calls()
        for source, dump in dumps:
            entries = dump.get("entries") or []
            self._learn_groups(dump, entries)
            self._merge_status(dump.get("pg_status") or {}, groups,
                               op_ids if source.name == "fr" else None)
            self._take(source, entries, stats, issues, p2p, final=final,
                       calls_pending=calls_pending)
            if stuck:
                inflight.extend(self._inflight(entries, groups))
        self._time_awaiting(stats)
        self.p2p_reader.take(p2p)
        steps = self.step_comm.rows(t0, min(self._held.values(), default=None))
        cost = time.perf_counter() - t0
        self.read_s += cost
        self._publish_status(groups)
        if stuck:
            self.fields["inflight"] = inflight
            self.fields["stack"] = self.training_stack()
            self.fields["p2p_inflight"] = self.p2p_reader.inflight()
        self.p2p_reader.learn_groups(self._group_info)
        # a group goes once its members are known: the hub keeps the first word on a group
        # that names them, so one sent without them would never be sent again
        new_groups = {n: wire_group(g, self.rank) for n, g in self._group_info.items()
                      if n not in self._groups_sent and g["ranks"]}
        if stats.rows or issues or new_groups or steps or p2p.rows:
            if len(issues) > MAX_ISSUES:
                issues = issues[-MAX_ISSUES:]
            body = {"groups": new_groups, "stats": stats.to_wire(), "issues": issues,
                    "step": self.current_step()}
            if steps:
                body["steps"] = steps[-MAX_STEP_ROWS:]
            if p2p.rows:
                body["p2p"] = p2p.to_wire()
            if self.submit("collectives", body):
                self._groups_sent.update(new_groups)
        return cost

    def _learn_groups(self, dump: dict[str, Any], entries: list[dict[str, Any]]) -> None:
        config = dump.get("pg_config") or {}
        asked: set[str] = set()  # a group whose ranks are not known yet: asked once a read
        for e in entries:
            pg = e.get("process_group") or ("", "")
            name, desc = str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
            self._names_by_pg_id[str(e.get("pg_id"))] = name
            known = self._group_info.get(name)
            if name and (known is None or not known["ranks"]) and name not in asked:
                asked.add(name)
                ranks = pg_config_ranks(config.get(name)) or c10d.group_ranks(name)
                self._group_info[name] = {"desc": desc or (known or {}).get("desc", ""),
                                          "ranks": ranks or []}

    def _take(self, source: RecorderSource, entries: list[dict[str, Any]],
              stats: CollectiveStats, issues: list[list[Any]],
              p2p: P2PStats | None = None, final: bool = False,
              calls_pending: bool = False) -> None:
        """Count the entries not taken yet. Held back for a later read (`_held`), unless
        `final`: an NCCL entry not completed (its duration comes then), and with
        `calls_pending` a host-timed gloo entry whose call is not collected yet."""
        if not entries:
            return
        ids = [e["record_id"] for e in entries]
        oldest = min(ids)
        if source.last_id is not None and oldest > source.last_id + 1:
            self.lost += oldest - source.last_id - 1  # the ring wrapped between reads
        now = time.time()
        for e in entries:
            rid = e["record_id"]
            if rid in source.seen:
                continue
            duration = e.get("duration_ms")
            name = e.get("profiling_name") or ""
            created = e.get("time_created_ns", 0) / 1e9
            group = str((e.get("process_group") or ("?",))[0])
            seq = int(e.get("collective_seq_id", 0))
            if not final and now - created < HELD_BACK_S and (
                    (duration is None and name.startswith("nccl")
                     and e.get("state") != "completed")
                    or (calls_pending and not e.get("is_p2p")
                        and (group, seq) not in self._host_calls)):
                self._held[rid] = created  # read again once it completed, or its call came
                continue
            self._held.pop(rid, None)
            source.seen.add(rid)
            ident = (e.get("pg_id"), e.get("collective_seq_id"), e.get("p2p_seq_id"), name)
            if ident in self._taken:  # the same collective in another ring
                continue
            self._taken[ident] = None
            self.entries += 1
            seconds = float(duration) / 1000.0 if duration is not None else None
            if e.get("is_p2p") and p2p is not None and self.p2p_reader.take_nccl(
                    e, group, name, seconds, p2p, self._group_info):
                continue
            call = self._host_calls.pop((group, seq), None) if not e.get("is_p2p") else None
            op = call[2] if call is not None and call[2] else op_name(name)
            nbytes = buffer_bytes(e)
            key = (group, op, size_bucket(nbytes))
            row = stats.row(*key)
            row.count += 1
            row.bytes += nbytes
            if seconds is not None:
                row.add_time(seconds)
            elif call is not None:
                self._awaiting[(group, seq)] = key
                self._host_calls[(group, seq)] = call  # its duration may come later
            elif self.host_calls is not None and not e.get("is_p2p"):
                # gloo: the entry exists from the enqueue, the host timer's call only once the
                # call returned; read in between, its call comes with a later read
                self._awaiting[(group, seq)] = key
                self._call_due[(group, seq)] = time.monotonic() + HELD_BACK_S
            if not e.get("is_p2p"):
                issues.append([group, seq, created])
                if is_all_reduce(op):
                    item = self.step_comm.add(created, seconds, nbytes, seconds is None
                                              and call is not None)
                    if item is not None and item.waiting:
                        self._awaiting_items[(group, seq)] = item
        source.last_id = max(source.last_id or -1, max(ids))
        source.seen = {rid for rid in source.seen if rid >= oldest}
        self._held = {rid: t for rid, t in self._held.items() if rid >= oldest}
        _trim(self._taken, HOST_CALLS_KEPT)

    def _collect_host_calls(self) -> None:
        """Move the gloo timer's calls into a map by (group name, seq)."""
        calls = self.host_calls
        if not calls:
            return
        names = c10d.group_names()
        default = c10d.default_group()
        while calls:
            call = calls.popleft()
            name = names.get(call[0] if call[0] is not None else default)
            if name is not None:
                self._host_calls[(str(name), call[1])] = call
        _trim(self._host_calls, HOST_CALLS_KEPT)

    def _time_awaiting(self, stats: CollectiveStats) -> None:
        """Durations of taken gloo collectives that completed since, into their rows."""
        items = self._awaiting_items
        due, now = self._call_due, time.monotonic()
        for ident, key in list(self._awaiting.items()):
            call = self._host_calls.get(ident)
            if call is None:
                if due.get(ident, 0.0) > now:
                    continue  # its host call has not come yet
                del self._awaiting[ident]
                due.pop(ident, None)
                if ident in items:
                    items.pop(ident).timed(None)
            elif call[3] is not None:
                stats.row(*key).add_time(call[3])
                del self._awaiting[ident], self._host_calls[ident]
                due.pop(ident, None)
                if ident in items:
                    items.pop(ident).timed(call[3])
        _trim(self._awaiting, HOST_CALLS_KEPT)
        _trim(due, HOST_CALLS_KEPT)
        for ident in list(itertools.islice(items, max(0, len(items) - HOST_CALLS_KEPT))):
            items.pop(ident).timed(None)

    @staticmethod
    def _inflight(entries: list[dict[str, Any]], groups: dict[str, list[int]]) -> list[list]:
        out = []
        for e in entries:
            group = str((e.get("process_group") or ("?",))[0])
            seq = int(e.get("collective_seq_id", 0))
            status = groups.get(group)
            if status is not None and seq > status[1] and not e.get("is_p2p"):
                out.append([group, seq, op_name(e.get("profiling_name") or ""),
                            e.get("time_created_ns", 0) / 1e9, buffer_bytes(e)])
        return out[-32:]

    def training_stack(self) -> str | None:
        """The training thread's Python stack, innermost call last."""
        frame = sys._current_frames().get(self.training_thread)
        if frame is None:
            return None
        return "".join(traceback.format_stack(frame, limit=40))

    def relay_ras(self) -> None:
        """Send NCCL RAS's status of this node as an `nccl_ras` info (once per stuck spell), where
        this process's default group runs NCCL: `init()` guesses NCCL wherever CUDA is, and a
        process that never makes a group stays with that guess, whose RAS port may be another
        job's on the node."""
        if self.ras_port is None or not group_uses_nccl():
            return
        from .ras import RasUnavailable, ras_status

        try:
            value = {"t": time.time(), "status": ras_status(port=self.ras_port), "error": None}
        except RasUnavailable as exc:
            value = {"t": time.time(), "status": None, "error": str(exc)}
        self.submit("info", {"key": "nccl_ras", "value": value})

    # --- dumps for `scalemon dump` (torch's format, so torch's own tools read them too) ----
    def request_dump(self, directory: str, rank: int) -> None:
        """Write this rank's recorder to `directory` soon (from the reader thread)."""
        self.dump_requests.append((directory, rank))
        self._wake.set()

    def _serve_dumps(self) -> None:
        while self.dump_requests:
            self.write_dump(*self.dump_requests.popleft())

    def write_dump(self, directory: str, rank: int) -> dict[str, Any]:
        """Write every ring's dump (pickle, as torch writes them) as `<dir>/rank_<rank>`
        (`nccl_rank_<rank>` for NCCL's); reports the outcome as an `fr_dump` info."""
        written, error = [], None
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            for source in self.sources:
                prefix = "rank_" if source.name == "fr" else "nccl_rank_"
                path = Path(directory) / f"{prefix}{rank}"
                data = source._dump(includeCollectives=True, onlyActive=False)
                tmp = path.with_suffix(".tmp")
                tmp.write_bytes(data)
                tmp.replace(path)
                written.append(str(path))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        write_beside(directory, rank, written, self.warnings)  # the analysis reads it instead
        result = {"directory": directory, "files": written, "error": error}
        self.submit("info", {"key": "fr_dump", "value": result})
        return result


def _trim(mapping: dict, keep: int) -> None:
    """Forget the oldest items of an insertion-ordered map beyond `keep`."""
    for key in list(itertools.islice(mapping, max(0, len(mapping) - keep))):
        del mapping[key]
