"""The hub's per-message fast paths give what the general paths give: the decode of a rank's
step or heartbeat (`protocol.decode`'s one-go envelope check and quick nested check), a step's
cross-rank band (`fold.StepAcc`), and a sealed chunk's cover and lanes (`chunks.seal` from
the writer's covers)."""

from __future__ import annotations

import math

import msgpack
import pytest

from scalemon import protocol
from scalemon.home import chunks
from scalemon.protocol import Message, ProtocolError
from scalemon.state.fold import JobFold
from scalemon.tui.sim import SimJob

JOB = "hot"


def _frame(**envelope: object) -> bytes:
    obj = {"v": list(protocol.PROTOCOL_VERSION), "type": "step", "job": JOB, "rank": 3,
           "seq": 7, "t": 1000.5, "body": {"step": 2, "loss": 1.5, "extra": {"lr": 0.1}}}
    obj.update(envelope)
    return msgpack.packb(obj, use_bin_type=True)


def _outcome(decode, frame: bytes) -> object:
    try:
        return decode(frame)
    except ProtocolError as exc:
        return f"{type(exc).__name__}: {exc}"


def _checked(frame: bytes) -> Message:
    """The general path alone: every envelope check in turn."""
    obj, version = protocol._map_of(frame)
    return protocol._decode_checked(obj, version)


deep: dict = {}
_inner = deep
for _ in range(40):
    _inner["a"] = {}
    _inner = _inner["a"]

CASES = [
    {}, {"t": 1000}, {"t": math.inf}, {"t": math.nan}, {"t": True}, {"rank": -1},
    {"rank": -2}, {"rank": 1 << 20}, {"rank": True}, {"seq": -1}, {"seq": 1 << 53},
    {"seq": 1.0}, {"job": 5}, {"type": "hello"}, {"type": "rank_state"}, {"type": "nope"},
    {"body": []}, {"body": {"loss": 1.0}}, {"body": {"step": 2, "loss": "x"}},
    {"body": {"step": 2, "loss": True}}, {"body": {"step": 2, "extra": {"lr": b"x"}}},
    {"body": {"step": 2, "extra": {"lr": [1, {"k": object.__name__}]}}},
    {"body": {"step": 2, "extra": deep}}, {"body": {"step": 2, "new_field": [b"kept"]}},
    {"type": "heartbeat", "body": {"phase": "x", "groups": {"0": [1, 2]}}},
    {"type": "heartbeat", "body": {"phase": "x", "groups": {"0": [1, b"2"]}}},
]


@pytest.mark.parametrize("envelope", CASES, ids=[str(c)[:40] for c in CASES])
def test_decode_accepts_and_refuses_as_each_check_in_turn(envelope: dict) -> None:
    frame = _frame(**envelope)
    for _ in range(2):  # the second time the body's shape is cached
        assert _outcome(protocol.decode, frame) == _outcome(_checked, frame)


def test_a_cached_shape_still_checks_nested_values() -> None:
    protocol.decode(_frame(body={"step": 1, "extra": {"lr": 0.1}}))
    with pytest.raises(ProtocolError, match="step.extra.lr holds a bytes"):
        protocol.decode(_frame(body={"step": 1, "extra": {"lr": b"\x00"}}))


def _band(fold: JobFold, name: str) -> list[float]:
    """(step, min, max, mean) of metric `name`'s band at the last step folded."""
    return [a[-1] for a in fold.agg[name].arrays()] if len(fold.agg[name]) else []


def test_a_steps_band_takes_finite_numbers_only() -> None:
    fold = JobFold(job=JOB, world_size=4)
    for rank in range(4):
        fold.apply(rank, protocol.decode(protocol.encode(
            "hello", JOB, rank, 0, {"host": "h", "pid": 10 + rank, "world_size": 4,
                                    "local_rank": rank}, 1.0)))
    for rank in range(4):  # the first step closes with the first rank: every rank starts
        fold.apply(4 + rank, Message("step", JOB, rank, 1, 2.0, {"step": 1}))
    losses = [2, 1.5, math.inf, True]  # an int counts; inf, and a bool, do not
    memory = [None, 3, math.nan, 5]
    for rank in range(4):
        body = {"step": 2, "loss": losses[rank], "step_time_s": 0.5, "optimizer_time_s": 0.25}
        if memory[rank] is not None:
            body["mem_allocated_bytes"] = memory[rank]
        fold.apply(8 + rank, Message("step", JOB, rank, 2, 3.0, body))  # not decoded: any type
    assert _band(fold, "loss") == [2.0, 1.5, 2.0, 1.75]
    assert _band(fold, "mem_allocated_bytes") == [2.0, 3.0, 5.0, 4.0]
    assert _band(fold, "compute_s") == [2.0, 0.25, 0.25, 0.25]
    assert _band(fold, "allreduce_time_s") == []


def _tail(frames: list[bytes]) -> tuple[bytes, list[int]]:
    raw, starts = b"", []
    for frame in frames:
        starts.append(len(raw))
        raw += len(frame).to_bytes(4, "big") + frame
    return raw, starts


def test_a_chunk_sealed_from_the_writers_covers_is_the_one_read_from_its_records() -> None:
    sim = SimJob(job=JOB, ranks=8)
    frames, known = [], []
    for step in range(1, 40):
        for rank, body in enumerate(sim.step_bodies(step, 1000.0 + step)):
            frames.append(protocol.encode("step", JOB, 7 - rank, step, body, 1000.0 + step))
            known.append(("step", 7 - rank, step, 1000.0 + step))
        frames.append(protocol.encode("heartbeat", JOB, step % 8, step, sim.heartbeat(0, step),
                                      1000.5 + step))
        known.append(("heartbeat", step % 8, None, 1000.5 + step))
        frames.append(protocol.encode("rank_state", JOB, -1, step, {"target": 1,
                                                                     "state": "silent"}, 1.0))
        known.append(("rank_state", -1, None, 1.0))
    raw, starts = _tail(frames)
    some = [k if i % 5 else None for i, k in enumerate(known)]
    read = chunks.seal(raw, 10, len(frames), 100, 0, None)
    assert chunks.seal(raw, 10, len(frames), 100, 0, known, starts) == read
    assert chunks.seal(raw, 10, len(frames), 100, 0, some) == read
    blob, entry = read
    assert entry.types == {"step": 312, "heartbeat": 39, "rank_state": 39}
    assert entry.ranks == [-1, 7] and entry.steps == [1, 39]
    with open_chunk(blob) as f:
        records, damaged, _ = chunks.read_chunk(f, entry)
    assert damaged == 0 and [frame for _, frame in records] == frames


def open_chunk(blob: bytes):
    """The chunk's bytes as the chunks file at offset 100 (as sealed above)."""
    import io

    return io.BytesIO(b"\x00" * 100 + blob)
