"""The scalemon wire protocol: the one module that agents, the hub and dashboards all import.

Every message is one msgpack map (one ZeroMQ frame)::

    {"v": [major, minor], "type": str, "job": str, "rank": int, "seq": int, "t": float,
     "body": {...}}

`decode` is the only way in: it validates the envelope and the body against `MESSAGE_FIELDS`
(the message tables of `scalemon.messages`, re-exported here)
and raises `ProtocolError` (and nothing else) for anything it cannot accept. A peer with another
major version is refused; another minor version is accepted (unknown fields are kept, unknown
message types of a newer minor are passed through as-is). `docs/protocol.md` documents the same
tables for people writing their own clients.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

# the message tables, re-exported: agents, the hub and dashboards import this module only
from scalemon.messages import HUB_TYPES as HUB_TYPES
from scalemon.messages import MESSAGE_FIELDS as MESSAGE_FIELDS
from scalemon.messages import RANK_STATES as RANK_STATES
from scalemon.messages import SILENT_RANK_STATES as SILENT_RANK_STATES
from scalemon.messages import STEP_COMM_FIELDS as STEP_COMM_FIELDS

PROTOCOL_VERSION: tuple[int, int] = (1, 14)
MAX_MESSAGE_BYTES = 1 << 20
"""Messages larger than this are rejected before they are unpacked."""
MAX_REPLY_BYTES = 64 << 20
"""RPC replies (history pages) may be larger than one message, up to this."""

MAX_WORLD_SIZE = 1 << 20
"""Ranks and world sizes above this are refused (1,048,576 ranks)."""
MAX_SEQ = 1 << 53
"""Sequence numbers at or above this are refused (they would lose precision as JSON numbers)."""

HUB_RANK = -1
"""`rank` of messages the hub itself writes into the history (rank state changes)."""



_JOB_ID_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def check_job_id(job: str) -> str:
    """Return `job` if it is a job id: 1-100 letters, digits, `.`, `_` or `-`, starting with a
    letter or digit (safe in file names: a hub's run directory is named after it); else raise
    ValueError."""
    if not _JOB_ID_OK.match(job):
        raise ValueError(
            f"job id {job!r} must be 1-100 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return job


class ProtocolError(ValueError):
    """A frame that is not a valid scalemon message; the text says what was wrong."""


class VersionMismatch(ProtocolError):
    """The peer speaks another major version of the protocol; the text names both."""

    def __init__(self, theirs: tuple[int, int]) -> None:
        self.theirs = theirs
        self.ours = PROTOCOL_VERSION
        super().__init__(
            f"protocol version {version_text(theirs)} is not compatible with this side's "
            f"{version_text(PROTOCOL_VERSION)}: install the same scalemon major version on the "
            "ranks, hub and dashboard"
        )


def version_text(version: tuple[int, int] | list[int]) -> str:
    """A version as people write it: 1.0."""
    return "{}.{}".format(*version)


@dataclass(slots=True)
class Message:
    """A decoded, validated message."""

    type: str
    job: str
    rank: int
    seq: int
    t: float
    body: dict[str, Any] = field(default_factory=dict)
    version: tuple[int, int] = PROTOCOL_VERSION


def encode(
    type: str, job: str, rank: int, seq: int, body: dict[str, Any], t: float | None = None
) -> bytes:
    """Pack one message; `t` defaults to now (Unix seconds)."""
    return msgpack.packb(
        {
            "v": list(PROTOCOL_VERSION),
            "type": type,
            "job": job,
            "rank": rank,
            "seq": seq,
            "t": time.time() if t is None else t,
            "body": body,
        },
        use_bin_type=True,
    )


def _unpack(frame: bytes, limit: int = MAX_MESSAGE_BYTES) -> Any:
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame is {type(frame).__name__}, expected bytes")
    if len(frame) > limit:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {limit} limit")
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"not msgpack: {type(exc).__name__}: {exc}") from None


def check_version(v: Any) -> tuple[int, int]:
    """Return the (major, minor) of a peer, or raise if its major version differs from ours."""
    if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(type(x) is int for x in v)):
        raise ProtocolError(f"bad protocol version field {v!r}: expected [major, minor]")
    major, minor = v
    if major != PROTOCOL_VERSION[0]:
        raise VersionMismatch((major, minor))
    return major, minor


_ENVELOPE = {"type": str, "job": str, "rank": int, "seq": int}
_OUR_VERSION = list(PROTOCOL_VERSION)


def _map_of(frame: bytes) -> tuple[dict[str, Any], tuple[int, int]]:
    """The frame's map and its sender's version; raises ProtocolError."""
    obj = _unpack(frame)
    if type(obj) is not dict:
        raise ProtocolError(f"message is a {type(obj).__name__}, expected a map")
    v = obj.get("v")
    # fast path; [1.0, 1] and [True, 1] compare equal to [1, 1], so the types are checked too
    if v == _OUR_VERSION and type(v[0]) is int and type(v[1]) is int:
        return obj, PROTOCOL_VERSION
    return obj, check_version(v)


def decode(frame: bytes) -> Message:
    """Unpack and validate one frame; raises `ProtocolError` with the reason."""
    obj, version = _map_of(frame)
    get = obj.get
    mtype, rank, seq, t, body = get("type"), get("rank"), get("seq"), get("t"), get("body")
    if (mtype in _RANK_TYPES and type(mtype) is str and type(rank) is int and type(seq) is int
            and type(t) is float and type(body) is dict and type(get("job")) is str
            and 0 <= rank < MAX_WORLD_SIZE and 0 <= seq < MAX_SEQ and t - t == 0.0):
        # the common case, a rank's step or heartbeat: its envelope passes every check below
        _check_body(mtype, body, version)
        return Message(mtype, obj["job"], rank, seq, t, body, version)
    return _decode_checked(obj, version)


def _decode_checked(obj: dict[str, Any], version: tuple[int, int]) -> Message:
    """`decode` of any map: each envelope check in turn, saying which failed."""
    get = obj.get
    if not (type(get("type")) is str and type(get("job")) is str
            and type(get("rank")) is int and type(get("seq")) is int):
        for key, typ in _ENVELOPE.items():
            value = get(key)
            if type(value) is not typ:
                raise ProtocolError(f"header field {key!r} is {value!r}, expected {typ.__name__}")
    t = obj.get("t")
    if type(t) not in (int, float) or not math.isfinite(t):
        raise ProtocolError(f"header field 't' is {t!r}, expected a finite number of seconds")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ProtocolError(f"'body' is {type(body).__name__}, expected a map")
    mtype = obj["type"]
    if not 0 <= obj["seq"] < MAX_SEQ:
        raise ProtocolError(f"header field 'seq' is {obj['seq']}, expected 0 <= seq < 2^53")
    if obj["rank"] >= MAX_WORLD_SIZE:
        raise ProtocolError(f"rank {obj['rank']} is beyond the largest world size "
                            f"{MAX_WORLD_SIZE}")
    _check_sender(mtype, obj["rank"])
    _check_body(mtype, body, version)
    if mtype == "hello":
        _check_hello(body, obj["rank"])
    if mtype == "rank_state" and body["state"] not in RANK_STATES:
        raise ProtocolError(f"rank_state.state {body['state']!r} is not one of {RANK_STATES}")
    return Message(mtype, obj["job"], obj["rank"], obj["seq"], float(t), body, version)


def decode_stored(frame: bytes) -> Message:
    """Unpack a record of a hub's history as the hub serves it: the hub validated every field
    when it took the message in, so only the envelope is checked here (a third of `decode`'s
    cost at thousands of ranks). Raises `ProtocolError`; use `decode` for anything else."""
    obj, version = _map_of(frame)
    get = obj.get
    mtype, job, rank, seq, t, body = (get("type"), get("job"), get("rank"), get("seq"),
                                      get("t"), get("body"))
    if not (type(mtype) is str and type(job) is str and type(rank) is int
            and type(seq) is int and type(t) in (int, float) and type(body) is dict):
        return decode(frame)  # says what is wrong
    return Message(mtype, job, rank, seq, float(t), body, version)


def check_body(mtype: str, body: dict[str, Any]) -> None:
    """Validate a body before sending it (what `decode` would refuse); raises ProtocolError."""
    _check_body(mtype, body, PROTOCOL_VERSION)


def _check_hello(body: dict[str, Any], rank: int) -> None:
    world = body["world_size"]
    if not 1 <= world <= MAX_WORLD_SIZE:
        raise ProtocolError(f"hello.world_size is {world}, expected 1 .. {MAX_WORLD_SIZE}")
    if rank >= world:
        raise ProtocolError(f"hello from rank {rank} of a world of {world} ranks")
    if body["local_rank"] < 0 or body["pid"] <= 0:
        raise ProtocolError(f"hello.local_rank {body['local_rank']} / hello.pid {body['pid']}: "
                            "expected local_rank >= 0 and pid > 0")


_RANK_TYPES = frozenset(MESSAGE_FIELDS).difference(HUB_TYPES, ("hello",))
"""Message types a rank sends whose envelope `decode` checks in one go (a hello has checks of
its own)."""


def _check_sender(mtype: str, rank: int) -> None:
    if (mtype in HUB_TYPES) != (rank == HUB_RANK):
        raise ProtocolError(
            f"{mtype} message from rank {rank}: only the hub writes {' and '.join(HUB_TYPES)}, "
            f"always as rank {HUB_RANK}"
        )
    if rank < HUB_RANK:
        raise ProtocolError(f"rank {rank} is negative")


_SHAPES: dict[tuple[Any, ...], tuple[str, ...]] = {}
"""Body shapes found valid: (type, field names, value types) -> the names of nested values,
which are checked every time. A step or heartbeat body has the same shape message after
message, so most bodies are checked by one lookup (a third of `decode`'s cost)."""
MAX_SHAPES = 4096


def _check_body(mtype: str, body: dict[str, Any], version: tuple[int, int]) -> None:
    shape = (mtype, version, *body, *map(type, body.values()))
    nested = _SHAPES.get(shape)
    if nested is not None:
        for name in nested:
            if not _plain(body[name]):
                _check_plain(body[name], f"{mtype}.{name}")  # says what is wrong
        return
    _check_new_body(mtype, body, version)
    if len(_SHAPES) < MAX_SHAPES:
        _SHAPES[shape] = tuple(name for name, value in body.items()
                               if type(value) in (dict, list, tuple)
                               and name in MESSAGE_FIELDS.get(mtype, ()))


def _check_new_body(mtype: str, body: dict[str, Any], version: tuple[int, int]) -> None:
    spec = MESSAGE_FIELDS.get(mtype)
    if spec is None:
        if version[1] > PROTOCOL_VERSION[1]:
            return  # a newer minor version may add message types; pass them through
        raise ProtocolError(f"unknown message type {mtype!r}")
    for name in _REQUIRED[mtype]:
        if name not in body:
            raise ProtocolError(f"{mtype} message lacks required field {name!r}")
    for name, value in body.items():
        field_spec = spec.get(name)
        if field_spec is None:
            continue  # an unknown field (newer minor version) is kept as it is
        types = field_spec[0]
        # bool is an int subclass: accept it only where bool is listed
        if type(value) not in types and not (type(value) is int and float in types):
            expected = "/".join(t.__name__ for t in types)
            raise ProtocolError(f"{mtype}.{name} is {value!r}, expected {expected}")
        if type(value) in (dict, list, tuple):
            _check_plain(value, f"{mtype}.{name}")


_PLAIN = frozenset((str, int, float, bool, type(None)))


def _plain(value: Any, depth: int = 0) -> bool:
    """True when `value` is surely what `_check_plain` accepts (plain dicts and lists of JSON
    values): the quick test of every nested value; False sends it to `_check_plain`."""
    kind = type(value)
    if kind is dict:
        if depth >= 32:
            return False
        for key, item in value.items():
            if type(key) is not str or (type(item) not in _PLAIN and not _plain(item, depth + 1)):
                return False
        return True
    if kind is list:
        if depth >= 32:
            return False
        for item in value:  # noqa: SIM110 - a loop: no generator on the decode path
            if type(item) not in _PLAIN and not _plain(item, depth + 1):
                return False
        return True
    return kind in _PLAIN


def _check_plain(value: Any, where: str, depth: int = 0) -> None:
    """Nested values (`info.value`, `config`, `extra`): string keys, no bytes, bounded depth."""
    if depth > 32:
        raise ProtocolError(f"{where} is nested more than 32 levels deep")
    if isinstance(value, dict):
        for key, item in value.items():
            if type(key) is not str:
                raise ProtocolError(f"{where} has a non-string key {key!r}")
            _check_plain(item, f"{where}.{key}", depth + 1)
    elif isinstance(value, (list, tuple)):  # a tuple packs as a list
        for item in value:
            _check_plain(item, where, depth + 1)
    elif type(value) not in (str, int, float, bool, type(None)):
        raise ProtocolError(f"{where} holds a {type(value).__name__}; only JSON-like values")


_REQUIRED = {
    mtype: tuple(name for name, (_, required) in spec.items() if required)
    for mtype, spec in MESSAGE_FIELDS.items()
}


# --- requests and replies on the hub's RPC socket -----------------------------------------
# A request is a msgpack map {"v": [..], "op": str, ...args}; a reply is
# {"v": [..], "ok": bool, "error": str | None, ...results}.

RPC_OPS = {
    "ping": {},
    # an agent's periodic round trip: its clock `t` (Unix s); the reply carries the hub's `t`
    # (clock offset) and the commands queued for that rank
    "sync": {"rank": int, "t": float},
    # a node's relay reports itself (its clock `t`, and `stats`: received, forwarded and
    # dropped message counts since it started); the reply carries the hub's `t`, as for sync
    "relay": {"node": str, "pid": int, "t": float, "stats": dict,
              # 1.12: what the relay read of the processes the hub asked it to look at (the
              # reply's `probe`: [{"rank", "pid", "native"}]), as [{"rank", "pid", "process",
              # "reading"}]
              "probes": (list, False),
              # 1.13: the ranks whose syncs the relay answered itself; the reply hands over
              # their queued `commands` as [[rank, [command]]], with `hang_after_s` and
              # `answers_syncs` (true: the relay may answer its ranks' syncs)
              "ranks": (list, False)},
    # a dashboard asks the hub to have every rank do something (see hub.COMMANDS)
    "command": {"name": str},
    # change a flag on every rank (`scalemon.flags`); `control` peers only (OP_ROLES).
    # `value` "" unsets; `restart` asks for the restart tier whatever the flag's
    # tier; `user` and `host` are ignored since 1.8 (the hub audits who it knows asked)
    "toggle": {"name": str, "value": str, "restart": bool, "user": str, "host": str},
    # the job's user stops the job (1.5; `control` peers only): the hub records a
    # `job_stop` before whoever asked signals the ranks, so their end reads "stopped by user"
    "stop": {"reason": str, "user": str, "host": str},
    "state": {},
    "fetch": {"since": int, "limit": int},
    # the hub's fold of its whole history (`scalemon.link.seed`), for a dashboard that attaches:
    # {"seed": bytes, "seq": the record to follow from} or {"seed": null, "why": str}
    "seed": {},
    # rank `rank`'s latest records numbered below `before`, at most `limit`, oldest first
    # (a big job's rank detail): {"records": [bytes], "head": int, "complete": bool}
    "rank_records": {"rank": int, "before": int, "limit": int},
    # 1.14: a dashboard following a big job's digest says it still does (every
    # DIGEST_WANTED_S / 3 s; a `seed` request says so too): the hub builds and publishes
    # digests only while one did within DIGEST_WANTED_S. The reply is empty
    "digest": {},
    # 1.12: read ranks' stacks from outside their processes (all ranks when `ranks` is empty;
    # `native` frames too). `id` 0 starts a reading, whose id the reply gives; asked again with
    # that id, the reply has what came so far: {"id", "done", "ranks": {rank: {"reading",
    # "process", "reader"} or {"error"}}}
    "stacks": {"ranks": list, "native": bool, "id": int},
}
RANK_RECORDS_KEPT = 4096
"""The hub serves `rank_records` from each rank's latest this many record numbers."""


CONTROL_OPS = ("command", "toggle", "stop")
"""Requests that steer the job: only a `control` peer's (see OP_ROLES)."""

OP_ROLES: dict[str, tuple[str, ...]] = {
    "ping": ("rank", "watch", "control"),
    "sync": ("rank", "control"),
    "relay": ("rank", "control"),
    "state": ("watch", "control"),
    "fetch": ("watch", "control"),
    "seed": ("watch", "control"),
    "rank_records": ("watch", "control"),
    "digest": ("watch", "control"),
    "stacks": ("control",),  # reading a stack stops the process for a moment
    **{op: ("control",) for op in CONTROL_OPS},
}
"""The roles (`scalemon.home.keys.ROLES`) that may make each request (1.8). The hub knows a peer's
role from its Curve key over tcp (`keys/authorized`), and from its uid over ipc (the owner's
sockets: `control`); never from what the request says. `user` and `host` of `toggle` and
`stop` are kept for older hubs and ignored."""
SOCKET_ROLES = {"ingest": ("rank", "control"), "feed": ("watch", "control"),
                "rpc": ("rank", "watch", "control")}
"""The roles a tcp socket admits at its Curve handshake (1.8)."""


def encode_request(op: str, **args: Any) -> bytes:
    """Pack an RPC request to the hub."""
    return msgpack.packb({"v": list(PROTOCOL_VERSION), "op": op, **args}, use_bin_type=True)


def decode_request(frame: bytes) -> tuple[str, dict[str, Any]]:
    """Validate an RPC request; returns (op, args)."""
    obj = _unpack(frame)
    if not isinstance(obj, dict):
        raise ProtocolError("request is not a map")
    check_version(obj.get("v"))
    op = obj.get("op")
    if type(op) is not str or op not in RPC_OPS:
        raise ProtocolError(f"unknown request op {op!r}; known: {sorted(RPC_OPS)}")
    args = {}
    for name, spec in RPC_OPS[op].items():
        typ, required = spec if isinstance(spec, tuple) else (spec, True)
        value = obj.get(name)
        if value is None and not required:
            continue
        if type(value) is not typ:
            raise ProtocolError(f"request {op}.{name} is {value!r}, expected {typ.__name__}")
        args[name] = value
    return op, args


def encode_reply(ok: bool = True, error: str | None = None, *,
                 version: tuple[int, int] | None = None, **results: Any) -> bytes:
    """Pack an RPC reply (`version`: the one it speaks for, ours by default; a relay answering
    for an older hub gives the hub's, so that its ranks send what that hub reads)."""
    return msgpack.packb(
        {"v": list(version or PROTOCOL_VERSION), "ok": ok, "error": error, **results},
        use_bin_type=True,
    )


def decode_reply(frame: bytes) -> dict[str, Any]:
    """Unpack an RPC reply; raises `ProtocolError` for a malformed or failed one."""
    obj = _unpack(frame, MAX_REPLY_BYTES)
    if not isinstance(obj, dict):
        raise ProtocolError("reply is not a map")
    check_version(obj.get("v"))
    if not obj.get("ok"):
        raise ProtocolError(f"hub refused the request: {obj.get('error')}")
    return obj


# --- the live feed (hub PUB -> dashboards) -------------------------------------------------
# Multipart: [b"rec", first_seq (8 bytes, big-endian), record, record, ...]; record i has
# history sequence number first_seq + i. Records are message frames exactly as `encode` makes.

FEED_TOPIC = b"rec"
"""Prefix of the first frame of every feed message; the full frame is `feed_topic(identity)`."""


def feed_topic(identity: dict[str, Any]) -> bytes:
    """The feed's first frame: `rec <history id> <base>` (a subscriber of `rec` gets it)."""
    return b"rec %s %d" % (str(identity["id"]).encode(), int(identity["base"]))


def parse_feed_topic(frame: bytes) -> dict[str, Any] | None:
    """The history identity in a feed message's first frame (None for a bare `rec`)."""
    parts = frame.split(b" ")
    if len(parts) != 3 or parts[0] != FEED_TOPIC:
        return None
    try:
        return {"id": parts[1].decode(), "base": int(parts[2])}
    except (UnicodeDecodeError, ValueError):
        return None


def pack_seq(seq: int) -> bytes:
    """A history sequence number as the 8-byte big-endian frame used on the feed."""
    return seq.to_bytes(8, "big")


def unpack_seq(frame: bytes) -> int:
    """Inverse of `pack_seq`."""
    if len(frame) != 8:
        raise ProtocolError(f"sequence frame has {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big")
