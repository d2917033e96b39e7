"""What a node's batch in columns would save the hub, per record (issue #40, item 1; no torch).

The question: should a node's relay decode and check its ranks' frames and send the hub one
batch a flush in columns (per message type: ranks, seqs, times and one column per field),
so that the hub no longer unpacks and checks every record? This measures, on one core and per
record, what the hub pays today and what it would pay with such a batch, for batches of the
sizes a relay makes (a node of 8 ranks at 1 step/s flushes some 8 steps and a few heartbeats
every 20 ms) and larger ones:

- `decode`: today, `protocol.decode` of each rank's frame (unpack, then the body checked);
- `unpack`: its msgpack part alone;
- `batch`: the batch unpacked and checked column by column, each record made a Message (the
  prototype `decode_batch` below, with the same checks as `protocol.decode`);
- `build`: of `batch`, only each record's Message made from the columns (no checks), what
  any fold that takes a body per record needs;
- `repack`: each record packed again as its rank had, which the hub must do to keep writing
  one record per message into the history and the feed (what every reader takes);
- `fold`: `JobFold.apply` of each record (16,384 ranks, the hub's fold), which no wire format
  changes;
- `relay`: what the relay pays to build the batch (its own decode included);
- `merge`: a lower bound for a hub that no longer folds each record but takes each rank's
  values as its relay folded them: the batch unpacked, and per record its rank's view given
  the step, its time and the step's values from the columns (no checks, no alerts, no
  per-step aggregates: a sketch of the next design, not a design).

The hub saves `decode - batch - repack` keeping today's history, and `decode - batch`
storing the batch as one record (then every reader of the history must expand it). Each
figure is the best of `--repeats` runs (process CPU time), so a busy machine inflates it
less; the machine's load before the run is in the results (`machine_busy_pct`).

    python bench/node_batch_cost.py                    # batches of 8, 12, 64 and 256 records
    python bench/node_batch_cost.py --sizes 8 --repeats 9
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
from machine import cpu_name, machine_busy_pct

from scalemon import protocol
from scalemon.protocol import MAX_SEQ, MAX_WORLD_SIZE, MESSAGE_FIELDS, Message, ProtocolError
from scalemon.state.fold import JobFold
from scalemon.state.jobstate import RankView
from scalemon.tui.sim import SimJob

RESULTS = Path(__file__).resolve().parent / "results"
JOB = "bench"
BATCHED = ("step", "heartbeat")
_ALLOWED = {mtype: {name: frozenset(types) | ({int} if float in types else set())
                    for name, (types, _) in MESSAGE_FIELDS[mtype].items()} for mtype in BATCHED}
_REQUIRED = {mtype: frozenset(name for name, (_, required) in MESSAGE_FIELDS[mtype].items()
                              if required) for mtype in BATCHED}


# --- the prototype batch: what a relay would send, what the hub would take -----------------
def encode_batch(frames: list[bytes]) -> bytes:
    """A relay's batch of its ranks' `frames`: each decoded and checked; steps and heartbeats
    in columns grouped by (type, version, fields), in arrival order (`order`)."""
    groups: dict[tuple[Any, ...], list[Any]] = {}
    order = []
    for frame in frames:
        msg = protocol.decode(frame)  # the relay checks what it batches
        key = (msg.type, msg.version, *msg.body)
        group = groups.get(key)
        if group is None:
            group = groups[key] = [len(groups), msg.type, list(msg.version), list(msg.body),
                                   [], [], [], [[] for _ in msg.body]]
        group[4].append(msg.rank)
        group[5].append(msg.seq)
        group[6].append(msg.t)
        for column, value in zip(group[7], msg.body.values(), strict=True):
            column.append(value)
        order.append(group[0])
    return msgpack.packb({"v": list(protocol.PROTOCOL_VERSION), "job": JOB,
                          "groups": [g[1:] for g in groups.values()], "order": order},
                         use_bin_type=True)


def decode_batch(frame: bytes) -> list[Message]:
    """The hub's side: the batch's records as Messages in arrival order, every column checked
    as `protocol.decode` checks a body; raises ProtocolError."""
    obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    rows = [_group(obj["job"], group) for group in obj["groups"]]
    taken = [iter(r) for r in rows]
    return [next(taken[i]) for i in obj["order"]]


_SCHEMAS: dict[tuple[Any, ...], tuple[list[frozenset[type] | None], list[int]]] = {}
"""(type, fields) -> each column's accepted value types (None: a field of a newer minor
version, kept as it is) and the columns that may hold nested values."""
_NESTED = frozenset((dict, list))


def _schema(mtype: str, fields: list[str]) -> tuple[list[frozenset[type] | None], list[int]]:
    key = (mtype, *fields)
    schema = _SCHEMAS.get(key)
    if schema is None:
        if mtype not in _ALLOWED or _REQUIRED[mtype].difference(fields):
            raise ProtocolError(f"a {mtype!r} group lacks a required field, or is not batched")
        accepted = [_ALLOWED[mtype].get(name) for name in fields]
        nested = [i for i, a in enumerate(accepted) if a is not None and a & _NESTED]
        schema = _SCHEMAS[key] = (accepted, nested)
    return schema


def _group(job: str, group: list[Any]) -> list[Message]:
    mtype, version, fields, ranks, seqs, times, columns = group
    version = protocol.check_version(version)
    n = len(ranks)
    if (len(seqs) != n or len(times) != n or len(columns) != len(fields)
            or any(len(c) != n for c in columns)):
        raise ProtocolError("columns differ in length")
    if not set(map(type, ranks)) <= {int} or not 0 <= min(ranks) <= max(ranks) < MAX_WORLD_SIZE:
        raise ProtocolError("ranks out of range")
    if not set(map(type, seqs)) <= {int} or not 0 <= min(seqs) <= max(seqs) < MAX_SEQ:
        raise ProtocolError("seqs out of range")
    if not set(map(type, times)) <= {int, float} or not all(map(math.isfinite, times)):
        raise ProtocolError("times not finite")
    accepted, nested = _schema(mtype, fields)
    kinds = [set(map(type, column)) for column in columns]
    for name, kind, ok in zip(fields, kinds, accepted, strict=False):  # lengths checked
        if ok is not None and not kind <= ok:
            raise ProtocolError(f"{mtype}.{name} of another type")
    for i in nested:
        if kinds[i] & _NESTED:
            for value in columns[i]:
                protocol._check_plain(value, f"{mtype}.{fields[i]}")
    rows = zip(ranks, seqs, times, zip(*columns, strict=False), strict=False)
    return [Message(mtype, job, rank, seq, float(t), dict(zip(fields, values, strict=False)),
                    version) for rank, seq, t, values in rows]


def build_batch(frame: bytes) -> list[Message]:
    """The `build` part of `decode_batch`: the batch unpacked and each record made a Message
    from its columns, without the checks (in group order)."""
    obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    out = []
    for mtype, version, fields, ranks, seqs, times, columns in obj["groups"]:
        rows = zip(ranks, seqs, times, zip(*columns, strict=False), strict=False)
        out.extend(Message(mtype, JOB, rank, seq, float(t), dict(zip(fields, values,
                                                                     strict=False)),
                           tuple(version)) for rank, seq, t, values in rows)
    return out


def repack(msg: Message) -> bytes:
    """A batched record packed again as its rank had packed it (one history record)."""
    return msgpack.packb({"v": list(msg.version), "type": msg.type, "job": msg.job,
                          "rank": msg.rank, "seq": msg.seq, "t": msg.t, "body": msg.body},
                         use_bin_type=True)


# --- the records: a node's flush of steps and heartbeats ---------------------------------
def node_frames(ranks: int, heartbeat_every: int) -> list[bytes]:
    """`ranks` ranks' frames of one step, and a heartbeat from one rank in `heartbeat_every`
    (bench/sim_nodes.py's bodies; a big job's stepping rank beats every 5 s)."""
    sim = SimJob(job=JOB, ranks=8)
    bodies = sim.step_bodies(5, 1000.0)
    frames = []
    for r in range(ranks):
        frames.append(protocol.encode("step", JOB, r, 10, bodies[r % 8], 1000.5))
        if heartbeat_every and r % heartbeat_every == 0:
            frames.append(protocol.encode("heartbeat", JOB, r, 11, sim.heartbeat(r % 8, 5),
                                          1000.6))
    return frames


def merge_batch(frame: bytes, views: dict[int, RankView]) -> None:
    """The `merge` sketch: each step record's values set on its rank's view from the columns."""
    obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    for mtype, _, fields, ranks, _, times, columns in obj["groups"]:
        if mtype != "step":
            continue
        at = fields.index("step")
        for rank, t, values in zip(ranks, times, zip(*columns, strict=True), strict=True):
            view = views[rank]
            view.step = values[at]
            view.steps_received += 1
            view.last_step_t = t
            view.metrics.update(zip(fields, values, strict=True))


def best_us(work: Callable[[], object], records: int, repeats: int) -> float:
    """The best of `repeats` runs of `work`, in microseconds of CPU per record."""
    runs = []
    for _ in range(repeats):
        t0 = time.process_time()
        work()
        runs.append(time.process_time() - t0)
    return min(runs) / records * 1e6


def fold_us(frames: list[bytes], repeats: int, world: int = 16384) -> float:
    """`JobFold.apply` per step record in a job of `world` ranks (the hub's fold)."""
    fold = JobFold(job=JOB, world_size=world)
    for r in range(world):
        fold.apply(r, protocol.decode(protocol.encode(
            "hello", JOB, r, 0, {"host": f"n{r // 8}", "pid": 100 + r, "world_size": world,
                                 "local_rank": r % 8})))
    body = protocol.decode(frames[0]).body
    runs = []
    for step in range(1, repeats + 1):
        messages = [Message("step", JOB, r, step, 1000.0 + step, {**body, "step": step})
                    for r in range(world)]
        t0 = time.process_time()
        for msg in messages:
            fold.apply(0, msg)
        runs.append(time.process_time() - t0)
    return min(runs) / world * 1e6


def measure(size: int, repeats: int, total: int = 6144) -> dict[str, Any]:
    """Per-record costs with batches of `size` records (8 steps to 1 heartbeat, as a big job's
    ranks send them at 1 step/s)."""
    frames = node_frames(total, heartbeat_every=8)
    batches = [encode_batch(frames[i:i + size]) for i in range(0, len(frames), size)]
    records = [m for b in batches for m in decode_batch(b)]
    assert [repack(m) for m in records] == frames  # the same history either way
    n = len(frames)
    row = {
        "batch_records": size, "records": n,
        "batch_bytes_per_record": round(sum(map(len, batches)) / n, 1),
        "frame_bytes_per_record": round(sum(map(len, frames)) / n, 1),
        "decode_us": best_us(lambda: [protocol.decode(f) for f in frames], n, repeats),
        "unpack_us": best_us(lambda: [msgpack.unpackb(f) for f in frames], n, repeats),
        "batch_us": best_us(lambda: [decode_batch(b) for b in batches], n, repeats),
        "build_us": best_us(lambda: [build_batch(b) for b in batches], n, repeats),
        "repack_us": best_us(lambda: [repack(m) for m in records], n, repeats),
        "relay_us": best_us(lambda: [encode_batch(frames[i:i + size])
                                     for i in range(0, n, size)], n, repeats),
    }
    views = {r: RankView(r) for r in range(total)}
    row["merge_us"] = best_us(lambda: [merge_batch(b, views) for b in batches], n, repeats)
    row["hub_saves_keeping_history_us"] = row["decode_us"] - row["batch_us"] - row["repack_us"]
    row["hub_saves_storing_batches_us"] = row["decode_us"] - row["batch_us"]
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}


COLUMNS = (("batch_records", "batch", "{:>5}"), ("decode_us", "decode", "{:>6.1f}"),
           ("unpack_us", "unpack", "{:>6.1f}"), ("batch_us", "batch", "{:>6.1f}"),
           ("build_us", "build", "{:>6.1f}"), ("repack_us", "repack", "{:>6.1f}"),
           ("hub_saves_keeping_history_us", "saves", "{:>6.1f}"),
           ("hub_saves_storing_batches_us", "saves*", "{:>6.1f}"),
           ("relay_us", "relay", "{:>6.1f}"), ("merge_us", "merge", "{:>6.1f}"),
           ("batch_bytes_per_record", "B/rec", "{:>6.0f}"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 12, 64, 256],
                   help="records per batch")
    p.add_argument("--repeats", type=int, default=7, help="runs per figure; the best is kept")
    p.add_argument("--out", type=Path, help="results file (default "
                                             "bench/results/node_batch_cost-cpu.json)")
    args = p.parse_args(argv)
    busy = machine_busy_pct(1.0)
    rows = [measure(size, args.repeats) for size in args.sizes]
    fold = fold_us(node_frames(8, 0), max(3, args.repeats // 2))
    print(f"us of CPU per record, best of {args.repeats}; machine busy {busy:.0f}% of a core "
          f"before the run; {cpu_name()}")
    print("  ".join(f"{title:>{len(fmt.format(0)) if 'f' in fmt else 5}}"
                    for _, title, fmt in COLUMNS))
    for row in rows:
        print("  ".join(fmt.format(row[key]) for key, _, fmt in COLUMNS))
    print(f"saves: decode - batch - repack (one record per message in the history, as today); "
          f"saves*: decode - batch (the batch stored as one record); merge: a lower bound for "
          f"taking a relay's folded values per record\nthe hub's fold of a step record "
          f"(16,384 ranks), the same with or without batches: {fold:.1f} us")
    out = args.out or RESULTS / "node_batch_cost-cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_name(),
                               "python": sys.version.split()[0], "machine_busy_pct": busy,
                               "repeats": args.repeats, "fold_us_per_step_record": fold,
                               "runs": rows}, indent=1))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
