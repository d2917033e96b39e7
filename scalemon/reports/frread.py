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

A directory is read by `scalemon/reports/frscan.py`; the analysis is in
`scalemon/reports/frtrace.py`.
"""

from __future__ import annotations

import io
import json
import marshal
import operator
import pickle
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from scalemon.collectives import buffer_bytes, op_name, pg_config_ranks
from scalemon.collector import collector_paused

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
        obj = _unpickled(data)
    else:
        raise DumpError("neither a pickle nor JSON: not a Flight Recorder dump")
    if not isinstance(obj, dict) or not ({"entries", "pg_status", "version"} & set(obj)):
        raise DumpError("no 'entries', 'pg_status' or 'version' in it: not a Flight Recorder "
                        "dump")
    if not isinstance(obj.get("entries", []), list):
        raise DumpError("its 'entries' is not a list")
    return obj


def _unpickled(data: bytes) -> Any:
    """The plain values of a pickle. The reader is given a buffered stream (it reads ahead
    from it: 3x faster than a bare BytesIO) and the cyclic garbage collector is paused
    meanwhile (a ring of 2000 entries is tens of thousands of new containers, each of which
    would otherwise count towards a collection of everything the process holds)."""
    try:
        with collector_paused():
            return _PlainUnpickler(
                io.BufferedReader(io.BytesIO(data), min(len(data), 1 << 20))).load()
    except DumpError:
        raise
    except Exception as exc:  # a damaged pickle raises many kinds; each is a bad file
        raise DumpError(f"a damaged pickle ({type(exc).__name__}: {exc})") from None


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


class Shape(NamedTuple):
    """A collective's op and tensors as the mismatch rule compares them between ranks: the op,
    its dtypes and its sizes (each as text, so that values compare by what they print), and
    its signature for people; one object per distinct shape in a process."""

    op: str
    dtypes: str
    sizes: str
    signature: str


Cell = tuple[Shape, ...]
"""One rank's collectives at one sequence number of one group (almost always one)."""


@dataclass
class GroupSeen:
    """What one rank's dump says about one group."""

    desc: str = ""
    config_ranks: list[int] | None = None
    issued: int = 0
    completed: int = 0


@dataclass
class _GroupEntries:
    """What a rank's entries of one group say, summed up as they are read."""

    p2p_last: int = 0  # the highest collective seq a P2P entry holds (the last collective's)
    collectives: bool = False
    issued: int = 0  # the highest seq of its collectives
    completed: int | None = None  # ... of those completed


@dataclass
class RankDump:
    """Everything one rank wrote (one file per recorder ring), merged.

    Per entry only what the analysis needs is kept: its collectives by (group, seq) as
    shapes (`cells`), the P2P ops not completed, and per group the counts; `entries` (an
    `Entry` per entry) only with `keep_entries` (thousands of ranks' rings are not kept so).
    `compact()` drops the cells once they are in a `SeqTable`."""

    rank: int
    keep_entries: bool = True
    files: list[str] = field(default_factory=list)
    versions: set[str] = field(default_factory=set)
    groups: dict[str, GroupSeen] = field(default_factory=dict)
    entries: list[Entry] = field(default_factory=list)
    skipped: int = 0  # entries that were not understood
    cells: dict[tuple[str, int], Cell] = field(default_factory=dict)
    mixed: set[str] = field(default_factory=set)
    """Groups whose entries show P2P ops among the collectives: `pg_status` counts those."""
    has_p2p: bool = False
    p2p_pending: list[tuple[str, str, int, float | None, int | None]] = field(
        default_factory=list)
    """P2P ops not completed whose peer is known: (group, "send"|"recv", peer's group rank,
    issue time, bytes)."""
    _by_group: dict[str, _GroupEntries] = field(default_factory=dict)

    def add(self, dump: dict[str, Any], name: str) -> None:
        """Merge one file's dump into this rank's."""
        self.files.append(name)
        if dump.get("version") is not None:
            self.versions.add(str(dump["version"]))
        pg_names = self._add_entries(dump.get("entries") or ())
        config = dump.get("pg_config")
        for key, value in (config.items() if isinstance(config, dict) else ()):
            ranks = _config_ranks(value)
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
            own = self._by_group[group]  # P2P entry holds the last collective's seq)
            seen = self.groups[group]
            seen.issued = own.p2p_last
            seen.completed = 0 if own.collectives else own.p2p_last
        for group, own in self._by_group.items():  # formats without pg_status, and what it
            seen = self.groups[group]  # lags behind (gloo counts a collective completed
            if own.collectives:  # after retiring it)
                seen.issued = max(seen.issued, own.issued)
            if own.completed is not None:
                seen.completed = max(seen.completed, own.completed)

    def _add_entries(self, entries: Iterable[Any]) -> dict[str, str]:
        """Take each entry in; returns the group names by `pg_id` (as text). (Thousands of
        ranks' rings pass here entry by entry: what is looked up per entry is local.)"""
        pg_names: dict[Any, str] = {}
        slots: dict[str, tuple[GroupSeen, _GroupEntries]] = {}
        cells, mixed = self.cells, self.mixed
        for raw in entries:
            parsed = _fields(raw)
            if parsed is None:
                self.skipped += 1
                continue
            group, desc, seq, is_p2p, completed, op_id, single, peer = parsed
            pg_id = raw.get("pg_id")
            pg_names[pg_id if type(pg_id) in (int, str) else str(pg_id)] = group
            slot = slots.get(group)
            if slot is None:
                slot = slots[group] = (self.groups.setdefault(group, GroupSeen()),
                                       self._by_group.setdefault(group, _GroupEntries()))
            seen, own = slot
            if not seen.desc:
                seen.desc = desc
            if self.keep_entries:
                self.entries.append(_entry(raw)[0])  # type: ignore[index]
            if is_p2p:
                self.has_p2p = True
                own.p2p_last = max(own.p2p_last, seq)
                op = single[0].op
                if not completed and peer is not None and op in ("send", "recv"):
                    created = raw.get("time_created_ns")
                    self.p2p_pending.append((
                        group, op, peer,
                        created / 1e9 if type(created) is int and created > 0 else None,
                        buffer_bytes(raw)))
                mixed.add(group)
                continue
            key = (group, seq)
            cell = cells.get(key)
            cells[key] = single if cell is None else cell + single
            own.collectives = True
            if seq > own.issued:
                own.issued = seq
            if completed and (own.completed is None or seq > own.completed):
                own.completed = seq
            if op_id is not None and op_id != seq:
                mixed.add(group)
        return {str(pg_id): group for pg_id, group in pg_names.items()}

    def op_at(self, group: str, seq: int) -> str | None:
        """The op of collective `seq` of `group`, if the ring still holds it (and the cells
        were not dropped by `compact`)."""
        cell = self.cells.get((group, seq))
        return cell[-1].op if cell else None

    def compact(self) -> dict[tuple[str, int], Cell]:
        """Drop the per-entry data (entries, cells) once taken elsewhere; returns the cells."""
        cells, self.cells, self.entries = self.cells, {}, []
        self._by_group = {}
        return cells

    def p2p_inflight(self, members: dict[str, tuple[int, ...]]) -> list[list[Any]]:
        """The P2P ops it issued that did not complete, as the wait-for graph takes them:
        [group, "send"|"recv", peer global rank, issue time, bytes] (the peer from its rank in
        the group's `members`; ops whose group or peer is unknown are left out)."""
        out = []
        for group, op, peer, t, nbytes in self.p2p_pending:
            ranks = members.get(group)
            if ranks and 0 <= peer < len(ranks):
                out.append([group, op, ranks[peer], t, nbytes])
        return out


_CONFIG_RANKS: dict[str, list[int] | None] = {}


def _config_ranks(config: Any) -> list[int] | None:
    """`pg_config_ranks`, one list per distinct text of ranks in a process: every rank's dump
    names the default group's thousands of ranks, read once and shared (not copied per rank)."""
    text = config.get("ranks") if isinstance(config, dict) else None
    if not isinstance(text, str):
        return pg_config_ranks(config)
    if text not in _CONFIG_RANKS:
        if len(_CONFIG_RANKS) >= SHAPES_KEPT:
            _CONFIG_RANKS.clear()
        _CONFIG_RANKS[text] = pg_config_ranks(config)
    return _CONFIG_RANKS[text]


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


def _listed(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else []


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
    op, peer = op_name(name), None
    if is_p2p:
        op, peer = _p2p_op(op)
    entry = Entry(str(pg[0]), seq, is_p2p, op, _listed(raw.get("input_sizes")),
                  _listed(raw.get("input_dtypes")), _listed(raw.get("output_sizes")),
                  _listed(raw.get("output_dtypes")), state, completed, _int(raw.get("op_id")))
    if is_p2p:
        created = raw.get("time_created_ns")
        entry.peer = peer
        entry.t = created / 1e9 if type(created) is int and created > 0 else None
        entry.nbytes = buffer_bytes(raw)
    return entry, str(pg[1]) if len(pg) > 1 else ""


Fields = tuple[str, str, int, bool, bool, "int | None", Cell, "int | None"]
"""What the analysis takes from an entry: group, its description, seq, is_p2p, completed,
op id, its shape as a cell of one (a P2P op's: its op only), a P2P op's peer (its rank in the
group)."""
_BASIC = operator.itemgetter("process_group", "collective_seq_id", "profiling_name", "is_p2p",
                             "state", "op_id")
_SHAPE_KEYS = ("profiling_name", "input_sizes", "input_dtypes", "output_sizes", "output_dtypes")
_SHAPE = operator.itemgetter(*_SHAPE_KEYS)
_SHAPES: dict[bytes | str, Cell] = {}
_P2P_SHAPES: dict[str, tuple[Cell, int | None]] = {}
SHAPES_KEPT = 1 << 16
"""Distinct shapes remembered per process (a ring has a handful; a hostile file may have
more: the memory is then cleared and the shapes computed again)."""


def _fields(raw: Any) -> Fields | None:
    """`_entry`'s reading of an entry without building one: the common form (torch's since
    2.2) is read at once, a shape computed once per distinct op and tensors; any other form
    goes through `_entry`. None where the entry lacks what the analysis needs."""
    try:
        pg, seq, name, is_p2p, state, op_id = _BASIC(raw)
    except (KeyError, TypeError):
        return _fields_of_entry(raw)
    if (type(seq) is not int or type(is_p2p) is not bool or type(name) is not str
            or type(op_id) is not int or type(state) is not str
            or type(pg) not in (tuple, list) or len(pg) != 2 or type(pg[0]) is not str):
        return _fields_of_entry(raw)
    completed = state == "completed" or bool(raw.get("time_discovered_completed_ns")) or (
        raw.get("retired") is True)
    if is_p2p:
        single, peer = _p2p_shape(name)
        return pg[0], str(pg[1]), seq, True, completed, op_id, single, peer
    return pg[0], str(pg[1]), seq, False, completed, op_id, _shape(raw), None


def _fields_of_entry(raw: Any) -> Fields | None:
    parsed = _entry(raw)
    if parsed is None:
        return None
    e, desc = parsed
    single = (Shape(e.op, "", "", ""),) if e.is_p2p else _shape(raw)
    return e.group, desc, e.seq, e.is_p2p, e.completed, e.op_id, single, e.peer


def _shape(raw: dict[str, Any]) -> Cell:
    """The shape of a collective's entry (`Entry.op`, dtypes, sizes, `Entry.signature`), as a
    cell of one (one object per distinct shape)."""
    try:
        values = _SHAPE(raw)
    except KeyError:
        values = tuple(raw.get(k) for k in _SHAPE_KEYS)
    try:  # marshal (its version 2 writes no references): 3x faster than repr; it writes
        key: bytes | str = marshal.dumps(values, 2)  # bytes and bytearray alike (which no
    except ValueError:  # recorder writes); what it cannot write (too deep: a hostile file)
        key = repr(values)
    single = _SHAPES.get(key)
    if single is None:
        if len(_SHAPES) >= SHAPES_KEPT:
            _SHAPES.clear()
        op = op_name(raw["profiling_name"])
        e = Entry("", 0, False, op, _listed(raw.get("input_sizes")),
                  _listed(raw.get("input_dtypes")), _listed(raw.get("output_sizes")),
                  _listed(raw.get("output_dtypes")), "", False)
        single = _SHAPES[key] = (Shape(op, repr((e.input_dtypes, e.output_dtypes)),
                                       repr((e.input_sizes, e.output_sizes)), e.signature()),)
    return single


def _p2p_shape(name: str) -> tuple[Cell, int | None]:
    """A P2P op's shape (its op only, a cell of one) and peer, from its profiling name."""
    found = _P2P_SHAPES.get(name)
    if found is None:
        if len(_P2P_SHAPES) >= SHAPES_KEPT:
            _P2P_SHAPES.clear()
        op, peer = _p2p_op(op_name(name))
        found = _P2P_SHAPES[name] = ((Shape(op, "", "", ""),), peer)
    return found


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


def read_context(directory: Path) -> dict[str, Any]:
    """What the hub wrote about the job next to the dumps ({} for a directory torch wrote)."""
    try:
        value = json.loads((directory / CONTEXT_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
