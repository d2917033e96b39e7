"""Flight Recorder dumps read by scalemon itself, without torch or optional packages.

A dump is what `torch._C._distributed_c10d._dump_fr_trace` (gloo, CPU) or `_dump_nccl_trace`
writes: a pickle of plain values (the `*_json` variants write the same as JSON), also what torch
writes by itself on a timeout with TORCH_FR_DUMP_TEMP_FILE. Format 2.10 (torch 2.13):

    {"version": "2.10", "comm_lib_version": str,
     "pg_config": {name: {"name", "desc", "ranks": "[0, 1]"}},   # gloo: one empty placeholder
     "pg_status": {pg_id: {"last_enqueued_collective", "last_started_collective",
                           "last_completed_collective"}},         # JSON: the numbers as text
     "entries": [{"record_id", "pg_id", "process_group": (name, desc), "collective_seq_id",
                  "p2p_seq_id", "is_p2p", "op_id", "profiling_name": "gloo:all_reduce",
                  "input_sizes", "input_dtypes", "output_sizes", "output_dtypes",
                  "state": "scheduled" | "started" | "completed", "time_created_ns",
                  "duration_ms" (NCCL, timed), "time_discovered_started_ns",
                  "time_discovered_completed_ns" (null, JSON: 0), "retired", "timeout_ms",
                  "frames", "thread_id", "thread_name"}],
     "nccl_comm_state": {...}}                                     # NCCL only

Older formats lack keys (`pg_status`, `is_p2p`, `collective_seq_id`: `seq_id` before 2.2);
each is read where present. P2P entries (NCCL's; gloo records none) are named "nccl:send 0->1"
(group rank 0 sends to group rank 1) and "nccl:recv 1<-0" (group rank 1 receives from 0): read
as `Entry.op` "send"/"recv" with the peer's group rank. Where a group carries P2P ops, its
`pg_status` counts them (gloo: op ids) while `collective_seq_id` counts collectives only, so
that group's issued and completed collectives are read from its entries. Pickles are read by
an unpickler that builds only containers and scalars: a file that names a callable is refused.

The analysis is in `scalemon/reports/frtrace.py`.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scalemon.collectives import buffer_bytes, op_name, pg_config_ranks

MAX_FILE_BYTES = 256 << 20
"""A dump larger than this is not read (a ring of 2000 entries with stacks is a few MiB)."""
CONTEXT_FILE = "context.json"
"""What the hub knew when it asked for the dump (ranks asked, groups, who is gone)."""
ANALYSIS_FILE = "analysis.json"
"""The hub's analysis of the directory, complete (the history record may be cut)."""
_RANK_FILE = re.compile(r"^(?P<prefix>.*?)(?P<rank>\d+)(?P<ext>\.json|\.pkl|\.pickle)?$")
_OWN_FILES = {CONTEXT_FILE, ANALYSIS_FILE}


class DumpError(ValueError):
    """A file that is not a readable Flight Recorder dump; the text says why."""


class _PlainUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings and numbers; any global (a class, a function)
    is refused, so a file cannot make the reader call anything."""

    def find_class(self, module: str, name: str) -> Any:
        raise DumpError(f"it names {module}.{name}: a Flight Recorder dump holds only plain "
                        "values, so it was not unpickled (refused)")

    def persistent_load(self, pid: Any) -> Any:
        raise DumpError("it refers to persistent objects: not a Flight Recorder dump (refused)")


def load_file(path: Path) -> dict[str, Any]:
    """The dump in `path` as a dict (pickle or JSON); raises DumpError saying what is wrong."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise DumpError(f"{size >> 20} MiB, over the {MAX_FILE_BYTES >> 20} MiB a dump "
                            "may have")
        data = path.read_bytes()
    except OSError as exc:
        raise DumpError(f"cannot read it: {exc.strerror or exc}") from None
    return load_bytes(data)


def load_bytes(data: bytes) -> dict[str, Any]:
    """A dump from its bytes (pickle or JSON); raises DumpError."""
    if not data:
        raise DumpError("the file is empty")
    if data[:1] == b"{":
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise DumpError(f"not valid JSON: {exc}") from None
    elif data[:1] == b"\x80":
        try:
            obj = _PlainUnpickler(io.BytesIO(data)).load()
        except DumpError:
            raise
        except Exception as exc:  # a damaged pickle raises many kinds; each is a bad file
            raise DumpError(f"a damaged pickle ({type(exc).__name__}: {exc})") from None
    else:
        raise DumpError("neither a pickle nor JSON: not a Flight Recorder dump")
    if not isinstance(obj, dict) or not ({"entries", "pg_status", "version"} & set(obj)):
        raise DumpError("no 'entries', 'pg_status' or 'version' in it: not a Flight Recorder "
                        "dump")
    if not isinstance(obj.get("entries", []), list):
        raise DumpError("its 'entries' is not a list")
    return obj


# --- one rank's dump ---------------------------------------------------------------------

@dataclass(slots=True)
class Entry:
    """One recorded collective, normalised across formats (frames and times are not kept:
    thousands of ranks' rings are read at once)."""

    group: str
    seq: int
    is_p2p: bool
    op: str
    input_sizes: list[Any]
    input_dtypes: list[Any]
    output_sizes: list[Any]
    output_dtypes: list[Any]
    state: str
    completed: bool
    op_id: int | None = None
    peer: int | None = None
    """A P2P op's peer, by its rank in the group (from the profiling name)."""
    t: float | None = None
    """When it was created (Unix seconds), for P2P ops only."""
    nbytes: int | None = None
    """Its buffer's bytes, for P2P ops only."""

    def signature(self) -> str:
        """The op with its tensors, for people: "all_reduce in [[4, 3]] Float"."""
        sizes = f" in {self.input_sizes}" if self.input_sizes else ""
        out = f" out {self.output_sizes}" if self.output_sizes != self.input_sizes else ""
        dtypes = sorted({str(d) for d in (*self.input_dtypes, *self.output_dtypes)})
        return f"{self.op}{sizes}{out}" + (f" {','.join(dtypes)}" if dtypes else "")


@dataclass
class GroupSeen:
    """What one rank's dump says about one group."""

    desc: str = ""
    config_ranks: list[int] | None = None
    issued: int = 0
    completed: int = 0


@dataclass
class RankDump:
    """Everything one rank wrote (one file per recorder ring), merged."""

    rank: int
    files: list[str] = field(default_factory=list)
    versions: set[str] = field(default_factory=set)
    groups: dict[str, GroupSeen] = field(default_factory=dict)
    entries: list[Entry] = field(default_factory=list)
    skipped: int = 0  # entries that were not understood
    ops: dict[tuple[str, int], str] = field(default_factory=dict)  # (group, seq) -> op
    mixed: set[str] = field(default_factory=set)
    """Groups whose entries show P2P ops among the collectives: `pg_status` counts those."""

    def add(self, dump: dict[str, Any], name: str) -> None:
        """Merge one file's dump into this rank's."""
        self.files.append(name)
        if dump.get("version") is not None:
            self.versions.add(str(dump["version"]))
        pg_names: dict[str, str] = {}
        for raw in dump.get("entries") or ():
            parsed = _entry(raw)
            if parsed is None:
                self.skipped += 1
                continue
            entry, desc = parsed
            pg_names[str(raw.get("pg_id"))] = entry.group
            seen = self.groups.setdefault(entry.group, GroupSeen())
            seen.desc = seen.desc or desc
            self.entries.append(entry)
            if not entry.is_p2p:
                self.ops[entry.group, entry.seq] = entry.op
            if entry.is_p2p or (entry.op_id is not None and entry.op_id != entry.seq):
                self.mixed.add(entry.group)
        config = dump.get("pg_config")
        for key, value in (config.items() if isinstance(config, dict) else ()):
            ranks = pg_config_ranks(value)
            if not key or not ranks:
                continue  # gloo writes one empty placeholder
            seen = self.groups.setdefault(str(key), GroupSeen())
            seen.config_ranks = ranks
            if isinstance(value, dict) and value.get("desc"):
                seen.desc = seen.desc or str(value["desc"])
        status = dump.get("pg_status")
        for pg_id, item in (status.items() if isinstance(status, dict) else ()):
            issued = _int(item.get("last_enqueued_collective")) if isinstance(item, dict) else None
            completed = _int(item.get("last_completed_collective")) if isinstance(
                item, dict) else None
            if issued is None or completed is None:
                continue
            name_ = pg_names.get(str(pg_id), str(pg_id))
            if issued < 0 and name_ not in self.groups:
                continue  # a group this rank never used
            seen = self.groups.setdefault(name_, GroupSeen())
            seen.issued = max(seen.issued, issued)
            seen.completed = max(seen.completed, completed)
        for group in self.mixed:  # its pg_status counts P2P ops too: the entries tell (a
            own = [e for e in self.entries if e.group == group]  # P2P entry holds the
            before = max((e.seq for e in own if e.is_p2p), default=0)  # last collective's seq)
            seen = self.groups[group]
            seen.issued = before
            seen.completed = 0 if any(not e.is_p2p for e in own) else before
        for e in self.entries:  # formats without pg_status, and what it lags behind (gloo
            seen = self.groups[e.group]  # counts a collective completed after retiring it)
            if not e.is_p2p:
                seen.issued = max(seen.issued, e.seq)
                if e.completed:
                    seen.completed = max(seen.completed, e.seq)

    def op_at(self, group: str, seq: int) -> str | None:
        """The op of collective `seq` of `group`, if the ring still holds it."""
        return self.ops.get((group, seq))

    def p2p_inflight(self, members: dict[str, tuple[int, ...]]) -> list[list[Any]]:
        """The P2P ops it issued that did not complete, as the wait-for graph takes them:
        [group, "send"|"recv", peer global rank, issue time, bytes] (the peer from its rank in
        the group's `members`; ops whose group or peer is unknown are left out)."""
        out = []
        for e in self.entries:
            ranks = members.get(e.group)
            if (e.is_p2p and not e.completed and e.peer is not None and ranks
                    and e.op in ("send", "recv") and 0 <= e.peer < len(ranks)):
                out.append([e.group, e.op, ranks[e.peer], e.t, e.nbytes])
        return out


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _entry(raw: Any) -> tuple[Entry, str] | None:
    """An entry and its group's description; None where it lacks what the analysis needs."""
    if not isinstance(raw, dict):
        return None
    pg = raw.get("process_group")
    if not isinstance(pg, (list, tuple)) or not pg:
        return None
    seq = _int(raw.get("collective_seq_id", raw.get("seq_id")))
    name = raw.get("profiling_name")
    if seq is None or not isinstance(name, str):
        return None
    state = str(raw.get("state") or "")
    is_p2p = raw.get("is_p2p")
    if not isinstance(is_p2p, bool):  # before the key existed: p2p ops by their name
        is_p2p = op_name(name).split(" ")[0] in ("send", "recv", "recv_anysource")
    completed = state == "completed" or bool(raw.get("time_discovered_completed_ns")) or (
        raw.get("retired") is True)

    def listed(key: str) -> list[Any]:
        value = raw.get(key)
        return list(value) if isinstance(value, (list, tuple)) else []

    op, peer = op_name(name), None
    if is_p2p:
        op, peer = _p2p_op(op)
    entry = Entry(str(pg[0]), seq, is_p2p, op, listed("input_sizes"),
                  listed("input_dtypes"), listed("output_sizes"), listed("output_dtypes"),
                  state, completed, _int(raw.get("op_id")))
    if is_p2p:
        created = raw.get("time_created_ns")
        entry.peer = peer
        entry.t = created / 1e9 if type(created) is int and created > 0 else None
        entry.nbytes = buffer_bytes(raw)
    return entry, str(pg[1]) if len(pg) > 1 else ""


_P2P_NAME = re.compile(r"^(?P<op>send|recv)\s+(?P<a>\d+)\s*(?:->|<-)\s*(?P<b>\d+)$")


def _p2p_op(name: str) -> tuple[str, int | None]:
    """("send", 1) from "send 0->1", ("recv", 0) from "recv 1<-0": the op and its peer's rank
    in the group; the name's first word and None for any other form."""
    match = _P2P_NAME.match(name.strip())
    if match is None:
        return name.split(" ")[0], None
    return match["op"], int(match["b"])


# --- a directory ---------------------------------------------------------------------------

def rank_files(directory: Path) -> dict[int, list[Path]]:
    """The dump files of a directory by rank: `<prefix><rank>` (rank_3, nccl_rank_3,
    nccl_trace_rank_3, ...), .json allowed; scalemon's own files and temporaries left out."""
    found: dict[int, list[Path]] = {}
    for path in sorted(directory.iterdir()):
        if path.name in _OWN_FILES or not path.is_file():
            continue
        match = _RANK_FILE.match(path.name)
        if match is None:
            continue
        found.setdefault(int(match["rank"]), []).append(path)
    return found


def read_directory(directory: Path) -> tuple[dict[int, RankDump], dict[int, str]]:
    """Every rank's dump in `directory`, and the ranks whose files could not be read (why)."""
    dumps: dict[int, RankDump] = {}
    problems: dict[int, str] = {}
    for rank, paths in rank_files(directory).items():
        dump = RankDump(rank)
        errors = []
        for path in paths:
            try:
                dump.add(load_file(path), path.name)
            except DumpError as exc:
                errors.append(f"{path.name}: {exc}")
        if dump.files:
            dumps[rank] = dump
        if errors:
            problems[rank] = "; ".join(errors)
    return dumps, problems


def read_context(directory: Path) -> dict[str, Any]:
    """What the hub wrote about the job next to the dumps ({} for a directory torch wrote)."""
    try:
        value = json.loads((directory / CONTEXT_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
