"""The wire protocol: one decode path that validates and raises ProtocolError for bad input."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import msgpack
import pytest

from scalemon import protocol
from scalemon.protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, ProtocolError


def raw(**overrides):
    msg = {"v": list(PROTOCOL_VERSION), "type": "step", "job": "j", "rank": 1, "seq": 5,
           "t": 1.5, "body": {"step": 3, "loss": 2.5}}
    msg.update(overrides)
    return msgpack.packb(msg, use_bin_type=True)


def test_round_trip_keeps_header_and_body():
    frame = protocol.encode("step", "job-a", 3, 42, {"step": 7, "loss": 1.25, "tokens": 512})
    msg = protocol.decode(frame)
    assert (msg.type, msg.job, msg.rank, msg.seq) == ("step", "job-a", 3, 42)
    assert msg.body == {"step": 7, "loss": 1.25, "tokens": 512}
    assert msg.t > 1e9 and msg.version == PROTOCOL_VERSION


def test_other_major_version_is_refused_with_advice():
    with pytest.raises(ProtocolError, match="not compatible.*same scalemon major version"):
        protocol.decode(raw(v=[PROTOCOL_VERSION[0] + 1, 0]))


def test_newer_minor_version_is_accepted_with_unknown_fields_and_types():
    newer = [PROTOCOL_VERSION[0], PROTOCOL_VERSION[1] + 1]
    msg = protocol.decode(raw(v=newer, body={"step": 1, "new_field": [1, 2]}))
    assert msg.body["new_field"] == [1, 2] and msg.version == tuple(newer)
    assert protocol.decode(raw(v=newer, type="future_thing", body={})).type == "future_thing"


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"", "not msgpack"),
        (b"\x93\x01", "not msgpack"),  # truncated array
        (msgpack.packb([1, 2, 3]), "expected a map"),
        (raw(v="1.0"), "protocol version"),
        (raw(type=7), "'type'"),
        (raw(rank="0"), "'rank'"),
        (raw(t="now"), "'t'"),
        (raw(body=[1]), "'body'"),
        (raw(type="nonsense"), "unknown message type"),
        (raw(body={"loss": 1.0}), "lacks required field 'step'"),
        (raw(body={"step": 1.5}), r"step.step is 1.5"),
        (raw(body={"step": True}), r"step.step is True"),
        (raw(body={"step": 1, "loss": "low"}), r"step.loss is 'low'"),
        (b"\x00" * (MAX_MESSAGE_BYTES + 1), "exceeds"),
        (raw(type="rank_state", body={"target": 0, "state": "lost"}), "only the hub writes"),
        (raw(rank=-1), "only the hub writes"),
        (raw(rank=-5), "negative"),
        (raw(t=float("nan")), "finite"),
        (raw(type="info", body={"key": "k", "value": {b"k": "x"}}), "non-string key"),
        (raw(type="info", body={"key": "k", "value": [b"raw"]}), "only JSON-like"),
        (raw(type="rank_state", rank=-1, body={"target": 0, "state": "sleepy"}), "not one of"),
    ],
)
def test_malformed_frames_raise_protocol_error_naming_the_problem(frame, reason):
    with pytest.raises(ProtocolError, match=reason):
        protocol.decode(frame)


def test_int_is_accepted_where_a_float_is_expected():
    assert protocol.decode(raw(body={"step": 1, "loss": 3})).body["loss"] == 3


def test_random_bytes_only_ever_raise_protocol_error():
    rng = random.Random(1234)
    good = raw()
    for i in range(3000):
        if i % 2:
            frame = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        else:  # flip bytes of a valid frame: exercises the validation, not only msgpack
            data = bytearray(good)
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            frame = bytes(data[: rng.randrange(1, len(data) + 1)])
        with contextlib.suppress(ProtocolError):
            protocol.decode(frame)


def test_requests_and_replies():
    op, args = protocol.decode_request(protocol.encode_request("fetch", since=3, limit=10))
    assert (op, args) == ("fetch", {"since": 3, "limit": 10})
    with pytest.raises(ProtocolError, match="unknown request op"):
        protocol.decode_request(protocol.encode_request("drop_tables"))
    with pytest.raises(ProtocolError, match="unknown request op"):
        protocol.decode_request(msgpack.packb({"v": [1, 0], "op": ["state"]}))
    with pytest.raises(ProtocolError, match="fetch.since"):
        protocol.decode_request(protocol.encode_request("fetch", since="0", limit=1))
    assert protocol.decode_reply(protocol.encode_reply(head=4))["head"] == 4
    big = protocol.encode_reply(records=[b"x" * 1000] * 3000)  # a history page over 1 MiB
    assert len(protocol.decode_reply(big)["records"]) == 3000
    with pytest.raises(ProtocolError, match="hub refused the request: nope"):
        protocol.decode_reply(protocol.encode_reply(ok=False, error="nope"))


def test_every_message_type_is_documented():
    text = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
    for mtype, fields in protocol.MESSAGE_FIELDS.items():
        assert f"`{mtype}`" in text, mtype
        for name in fields:
            assert f"`{name}`" in text, f"{mtype}.{name}"
