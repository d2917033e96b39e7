"""A job's history as files other tools read: a Chrome trace (Perfetto) and JSON lines.

Pure: records in, a trace dict or text lines out (`scalemon.cli.export` fetches the records
and writes the files). The trace follows the Trace Event Format (`traceEvents`, `ph` X complete
events and `M` metadata, `ts`/`dur` in microseconds) with a process per rank, named
"rank N (host)", and in it a thread per kind of slice:

* `steps`: one slice per `step` message with a `step_time_s`, from `t - step_time_s` to `t`
  (the rank's `log()` times; the first step of a process has no step time and no slice);
* `optimizer`: the step's `optimizer_time_s`, placed at the end of its step (the message gives
  the duration, not the start), for the steps that were timed (`optimizer_timed_step`), not
  those that carry an earlier step's figure;
* `all-reduce (sum per step)`: the step's all-reduce time (the step message's, else the
  recorder's `collectives.steps` row) from its first all-reduce's issue time; a sum of
  durations that may overlap, so an upper bound of the wall time;
* `collectives <group>`: one slice per collective the Flight Recorder saw (`collectives.issues`:
  group, sequence number, issue time), from this rank's issue to the last rank's issue of the
  same collective (the earliest it could complete; at least 1 µs), and flow arrows (`ph` s/f)
  linking the same collective (group, seq) across ranks in issue order.

Times are the ranks' clocks corrected by their host's `clock_offset_s` (heartbeats) when the job
spans several hosts, as the hub corrects arrival times, and relative to the earliest time in the
trace (`otherData.origin_unix_s`). Slices of one thread never overlap (Perfetto drops
misnested ones): a slice that would is clipped at the next one's start.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Iterator
from typing import Any

from scalemon.protocol import HUB_RANK, Message, version_text

LANE_STEPS, LANE_OPTIMIZER, LANE_ALLREDUCE, LANE_GROUPS = 1, 2, 3, 10
LANE_NAMES = {LANE_STEPS: "steps", LANE_OPTIMIZER: "optimizer",
              LANE_ALLREDUCE: "all-reduce (sum per step)"}
TIDS_PER_RANK = 1000
"""Thread ids are (rank + 1) * 1000 + lane: unique over the trace, never 0 (Perfetto's idle
thread); a rank's process id is rank + 1 for the same reason."""
MIN_COLLECTIVE_US = 1.0

JSONL_FIELDS = ("record", "type", "job", "rank", "seq", "t", "v", "body")
"""The keys of every `--jsonl` line (docs/protocol.md, "scalemon export")."""


def pid_of(rank: int) -> int:
    """The trace process id of a rank."""
    return rank + 1


def tid_of(rank: int, lane: int) -> int:
    """The trace thread id of one of a rank's lanes."""
    return (rank + 1) * TIDS_PER_RANK + lane


# --- JSON lines -----------------------------------------------------------------------------
def strict_json(value: Any) -> Any:
    """`value` as strict JSON data: non-finite floats (NaN, ±inf) null, bytes hex strings,
    map keys strings, tuples lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def jsonl_lines(records: Iterable[tuple[int, Message]]) -> Iterator[str]:
    """One JSON object per history record (keys `JSONL_FIELDS`), without the newline."""
    for number, msg in records:
        yield json.dumps({"record": number, "type": msg.type, "job": msg.job, "rank": msg.rank,
                          "seq": msg.seq, "t": strict_json(msg.t), "v": version_text(msg.version),
                          "body": strict_json(msg.body)}, allow_nan=False, separators=(",", ":"))


# --- the trace ------------------------------------------------------------------------------
class _Clocks:
    """Each rank's host and clock correction, from hellos and heartbeats (`JobState`'s rule:
    no correction while one host; else the median of the host's ranks' latest offsets)."""

    def __init__(self, messages: list[Message]) -> None:
        self.hosts: dict[int, str] = {}
        offsets: dict[int, float] = {}
        for msg in messages:
            if msg.type == "hello":
                self.hosts[msg.rank] = str(msg.body.get("host"))
            elif msg.type == "heartbeat":
                offset = msg.body.get("clock_offset_s")
                if isinstance(offset, (int, float)) and math.isfinite(offset):
                    offsets[msg.rank] = float(offset)
        by_host: dict[str, list[float]] = {}
        for rank, offset in offsets.items():
            by_host.setdefault(self.hosts.get(rank, ""), []).append(offset)
        several = len(set(self.hosts.values())) > 1
        self._host_offset = {h: statistics.median(v) for h, v in by_host.items()} if several \
            else {}

    def offset(self, rank: int) -> float:
        """Seconds to add to a time of `rank`'s clock."""
        return self._host_offset.get(self.hosts.get(rank, ""), 0.0)


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


class _Slices:
    """Slices of the trace before placement: per (rank, lane), [start_s, end_s, name, args,
    flow key] with times in corrected Unix seconds."""

    def __init__(self) -> None:
        self.lanes: dict[tuple[int, int], list[list[Any]]] = {}

    def add(self, rank: int, lane: int, start: float, end: float, name: str,
            args: dict[str, Any], flow: tuple[str, int] | None = None) -> None:
        self.lanes.setdefault((rank, lane), []).append([start, end, name, args, flow])

    def earliest(self) -> float | None:
        return min((s[0] for items in self.lanes.values() for s in items), default=None)


def _steps(msg: Message, off: float, slices: _Slices, comm_hook: set[int]) -> None:
    b = msg.body
    end = msg.t + off
    args = {k: strict_json(b.get(k)) for k in ("step", "loss", "tokens", "step_time_s",
                                         "optimizer_time_s", "allreduce_time_s",
                                         "allreduce_count", "allreduce_bytes")}
    step_time = _number(b.get("step_time_s"))
    if step_time is not None and step_time >= 0:
        slices.add(msg.rank, LANE_STEPS, end - step_time, end, f"step {b['step']}", args)
    opt = _number(b.get("optimizer_time_s"))
    timed_at = b.get("optimizer_timed_step", b["step"])  # absent: a 1.9 agent times every step
    if opt is not None and opt >= 0 and timed_at == b["step"]:
        slices.add(msg.rank, LANE_OPTIMIZER, end - opt, end, "optimizer",
                   {"step": b["step"], "optimizer_time_s": opt})
    comm, issue = _number(b.get("allreduce_time_s")), _number(b.get("allreduce_issue_t"))
    if comm is not None and issue is not None and comm >= 0:
        comm_hook.add(msg.rank)
        slices.add(msg.rank, LANE_ALLREDUCE, issue + off, issue + off + comm,
                   f"all-reduce step {b['step']}",
                   {"step": b["step"], "count": b.get("allreduce_count"),
                    "bytes": b.get("allreduce_bytes"), "time_sum_s": comm,
                    "source": "step message (comm hook)"})


def _step_comm_rows(msg: Message, off: float, slices: _Slices) -> None:
    """The recorder's per-step all-reduce rows [step, count, timed, time_s, bytes, issue_t]."""
    for row in msg.body.get("steps") or ():
        if not isinstance(row, list) or len(row) < 6:
            continue
        step, count, _, time_s, nbytes, issue = row[:6]
        time_s, issue = _number(time_s), _number(issue)
        if time_s is None or issue is None or time_s < 0:
            continue
        slices.add(msg.rank, LANE_ALLREDUCE, issue + off, issue + off + time_s,
                   f"all-reduce step {step}",
                   {"step": step, "count": count, "bytes": nbytes, "time_sum_s": time_s,
                    "source": "Flight Recorder"})


def trace(records: Iterable[tuple[int, Message]], job: str | None = None) -> dict[str, Any]:
    """The Chrome trace (Trace Event Format) of a job's history records."""
    messages = [msg for _, msg in records]
    clocks = _Clocks(messages)
    slices = _Slices()
    groups: dict[str, str] = {}  # name -> description
    issued: dict[tuple[str, int], dict[int, float]] = {}  # (group, seq) -> rank -> time
    comm_hook: set[int] = set()
    recorder_rows: list[tuple[Message, float]] = []
    ranks: set[int] = set()
    instants: list[tuple[int, float, str, dict[str, Any]]] = []
    for msg in messages:
        if msg.rank == HUB_RANK:
            if msg.type == "rank_state":
                target = msg.body["target"]
                instants.append((target, msg.t, f"rank {msg.body['state']}",
                                 {"reason": msg.body.get("reason")}))
            continue
        ranks.add(msg.rank)
        off = clocks.offset(msg.rank)
        if msg.type == "step":
            _steps(msg, off, slices, comm_hook)
        elif msg.type == "collectives":
            for name, group in (msg.body.get("groups") or {}).items():
                if isinstance(group, dict):
                    groups.setdefault(str(name), str(group.get("desc") or ""))
            for item in msg.body.get("issues") or ():
                if isinstance(item, list) and len(item) == 3 and _number(item[2]) is not None:
                    key = (str(item[0]), int(item[1]))
                    issued.setdefault(key, {})[msg.rank] = item[2] + off
            recorder_rows.append((msg, off))
        elif msg.type == "exit":
            instants.append((msg.rank, msg.t + off, f"exit ({msg.body.get('reason')})",
                             {"exit_code": msg.body.get("exit_code"),
                              "error": msg.body.get("error")}))
    for msg, off in recorder_rows:
        if msg.rank not in comm_hook:  # else the step messages have the same all-reduces
            _step_comm_rows(msg, off, slices)
    group_lanes = {name: LANE_GROUPS + i for i, name in enumerate(sorted(
        {g for g, _ in issued}))}
    for (group, seq), by_rank in issued.items():
        last = max(by_rank.values())
        first = min(by_rank.values())
        label = groups.get(group) or f"group {group}"
        for rank, t in by_rank.items():
            slices.add(rank, group_lanes[group], t, last, f"{label} #{seq}",
                       {"group": group, "seq": seq, "ranks_seen": len(by_rank),
                        "lateness_s": t - first}, flow=(group, seq))
    times = [t for _, t, _, _ in instants]
    earliest = slices.earliest()
    origin = min([*times, *([earliest] if earliest is not None else [])], default=0.0)
    events = _metadata(ranks, clocks, groups, group_lanes, slices)
    placed = _place(slices, origin, events)
    events.extend(_flows(issued, placed))
    for rank, t, name, args in instants:
        events.append({"ph": "i", "s": "t", "name": name, "cat": "rank", "pid": pid_of(rank),
                       "tid": tid_of(rank, LANE_STEPS), "ts": _us(t - origin),
                       "args": strict_json(args)})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"job": job or next((m.job for m in messages), None),
                          "origin_unix_s": origin, "generator": "scalemon export"}}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _metadata(ranks: set[int], clocks: _Clocks, groups: dict[str, str],
              group_lanes: dict[str, int], slices: _Slices) -> list[dict[str, Any]]:
    """Process and thread names (and their order) for every rank and lane that has slices."""
    events: list[dict[str, Any]] = []
    lanes_of: dict[int, set[int]] = {}
    for rank, lane in slices.lanes:
        lanes_of.setdefault(rank, set()).add(lane)
    names = {**LANE_NAMES, **{lane: f"collectives {groups.get(g) or g}"
                              for g, lane in group_lanes.items()}}
    for rank in sorted(ranks | set(lanes_of)):
        pid = pid_of(rank)
        host = clocks.hosts.get(rank, "?")
        main = tid_of(rank, LANE_STEPS)
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": main, "ts": 0,
                       "args": {"name": f"rank {rank} ({host})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": main,
                       "ts": 0, "args": {"sort_index": rank}})
        for lane in sorted(lanes_of.get(rank, ()) | {LANE_STEPS}):
            tid = tid_of(rank, lane)
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0,
                           "args": {"name": names.get(lane, f"lane {lane}")}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                           "ts": 0, "args": {"sort_index": lane}})
    return events


def _place(slices: _Slices, origin: float, events: list[dict[str, Any]]
           ) -> dict[tuple[str, int], dict[int, tuple[float, float, int]]]:
    """Append the X events, each thread's slices in order and clipped so that none overlaps
    the next; returns each collective's placed (ts, dur) per rank, for its flows."""
    placed: dict[tuple[str, int], dict[int, tuple[float, float, int]]] = {}
    for (rank, lane), items in sorted(slices.lanes.items()):
        items.sort(key=lambda s: (s[0], s[1]))
        least = MIN_COLLECTIVE_US if lane >= LANE_GROUPS else 0.0
        prev_end = -math.inf
        for i, (start, end, name, args, flow) in enumerate(items):
            ts = max(_us(start - origin), prev_end)
            stop = _us(end - origin)
            if i + 1 < len(items):
                after = _us(items[i + 1][0] - origin)
                if after > ts:
                    stop = min(stop, after)
            dur = round(max(stop - ts, least), 3)
            prev_end = ts + dur
            events.append({"ph": "X", "name": name, "cat": LANE_NAMES.get(lane, "collective"),
                           "pid": pid_of(rank), "tid": tid_of(rank, lane), "ts": ts,
                           "dur": dur, "args": strict_json(args)})
            if flow is not None:
                placed.setdefault(flow, {})[rank] = (ts, dur, tid_of(rank, lane))
    return placed


def _flows(issued: dict[tuple[str, int], dict[int, float]],
           placed: dict[tuple[str, int], dict[int, tuple[float, float, int]]]
           ) -> list[dict[str, Any]]:
    """Flow arrows (`s` then `f`, one id each) from rank to rank of each collective, in the
    order they issued it; each end sits inside its slice, so it binds to it."""
    events: list[dict[str, Any]] = []
    flow_id = 0
    for key in sorted(issued):
        by_rank = placed.get(key, {})
        order = sorted(by_rank, key=lambda r: (issued[key][r], r))
        for a, b in zip(order, order[1:], strict=False):
            flow_id += 1
            for ph, rank in (("s", a), ("f", b)):
                ts, dur, tid = by_rank[rank]
                event = {"ph": ph, "id": flow_id, "name": "collective", "cat": "collective",
                         "pid": pid_of(rank), "tid": tid, "ts": round(ts + dur / 2, 3),
                         "args": {"group": key[0], "seq": key[1]}}
                if ph == "f":
                    event["bp"] = "e"
                events.append(event)
    return events
