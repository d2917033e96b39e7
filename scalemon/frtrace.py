"""Flight Recorder dumps read and analysed by scalemon itself, without torch or optional packages.

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
each is read where present. Pickles are read by an unpickler that builds only containers and
scalars: a file that names a callable is refused.

`analyse` gives, per process group, each rank's last issued and completed collective, the
collectives whose op, dtypes or sizes differ between ranks at the same sequence number, and the
culprit by the rules of the live hang view (`scalemon.collectives.find_culprits`).
"""

from __future__ import annotations

import io
import json
import pickle
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scalemon.collectives import find_culprits, op_name, pg_config_ranks
from scalemon.hangs import span_text

MAX_FILE_BYTES = 256 << 20
"""A dump larger than this is not read (a ring of 2000 entries with stacks is a few MiB)."""
MAX_MISMATCHES = 8
"""Mismatches listed per group (the first ones: later ones often follow from them)."""
CONTEXT_FILE = "context.json"
"""What the hub knew when it asked for the dump (ranks asked, groups, who is gone)."""
ANALYSIS_FILE = "analysis.json"
"""The hub's analysis of the directory, complete (the history record may be cut)."""
_RANK_FILE = re.compile(r"^(?P<prefix>.*?)(?P<rank>\d+)(?P<ext>\.json|\.pkl|\.pickle)?$")
_OWN_FILES = {CONTEXT_FILE, ANALYSIS_FILE}
_SIZES_VARY = {"all_to_all", "alltoall", "alltoall_base", "all_to_all_single", "gather",
               "scatter", "coalesced", "send", "recv"}
"""Ops whose tensors may differ between ranks by design: only their op is compared."""


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
        for e in self.entries:  # formats without pg_status, and what it lags behind (gloo
            seen = self.groups[e.group]  # counts a collective completed after retiring it)
            if not e.is_p2p:
                seen.issued = max(seen.issued, e.seq)
                if e.completed:
                    seen.completed = max(seen.completed, e.seq)

    def op_at(self, group: str, seq: int) -> str | None:
        """The op of collective `seq` of `group`, if the ring still holds it."""
        return self.ops.get((group, seq))


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

    entry = Entry(str(pg[0]), seq, is_p2p, op_name(name), listed("input_sizes"),
                  listed("input_dtypes"), listed("output_sizes"), listed("output_dtypes"),
                  state, completed)
    return entry, str(pg[1]) if len(pg) > 1 else ""


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


# --- the analysis --------------------------------------------------------------------------

def analyse(
    dumps: dict[int, RankDump],
    *,
    members: dict[str, Iterable[int]] | None = None,
    descs: dict[str, str] | None = None,
    asked: Iterable[int] = (),
    missing: dict[int, str] | None = None,
    gone: Iterable[int] = (),
    fallback: dict[int, dict[str, list[int]]] | None = None,
    directory: str = "",
) -> dict[str, Any]:
    """The analysis of the ranks' dumps, as plain JSON-able values.

    `members`/`descs`: the groups' global ranks and descriptions where the dumps lack them
    (gloo's do); `asked`: the ranks asked for a dump; `missing`: rank -> why it gave none;
    `gone`: ranks whose process is gone; `fallback`: rank -> group -> [issued, completed] from
    the rank's last heartbeat, used for a rank without a dump."""
    missing = dict(missing or {})
    gone_set = set(gone)
    groups = _members(dumps, members or {}, set(asked) | set(dumps) | set(missing))
    desc = {**(descs or {}), **{g: s.desc for d in dumps.values()
                                for g, s in d.groups.items() if s.desc}}
    status: dict[int, dict[str, list[int]]] = {}
    source: dict[int, str] = {}
    for rank, dump in dumps.items():
        status[rank] = {g: [s.issued, s.completed] for g, s in dump.groups.items()}
        source[rank] = "dump"
    for rank, seen in (fallback or {}).items():
        if rank not in status and rank not in gone_set and seen:
            status[rank] = {g: list(v) for g, v in seen.items()}
            source[rank] = "heartbeat"
    labels = _labels(groups, desc)
    overall = _finding(find_culprits(status, groups, gone_set), labels, dumps)
    waits_of = {r: w for w in (overall or {}).get("waits", ()) for r in w["ranks"]}
    out_groups = []
    for name, ranks in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        alone = {r: {name: s[name]} for r, s in status.items() if name in s}
        finding = find_culprits(alone, {name: ranks}, gone_set)  # this group by itself
        # a rank behind in this group that waits in another: a link of a chain, not its end
        behind = {str(r): f"waits in {w['op'] or 'collective'} #{w['seq']} of {w['label']}"
                  for r in (finding or {}).get("culprits", ())
                  if (w := waits_of.get(r)) is not None and w["group"] != name}
        out_groups.append({
            "behind": behind,
            "name": name, "label": labels[name], "ranks": list(ranks),
            "status": {str(r): _rank_status(dumps.get(r), status, source, r, name, gone_set,
                                            missing)
                       for r in ranks},
            "mismatches": _mismatches(dumps, name),
            "finding": _finding(finding, labels, dumps),
        })
    versions = sorted({v for d in dumps.values() for v in d.versions})
    return {
        "directory": directory,
        "versions": versions,
        "asked": sorted(set(asked)),
        "read": sorted(dumps),
        "missing": {str(r): why for r, why in sorted(missing.items())},
        "skipped_entries": sum(d.skipped for d in dumps.values()),
        "groups": out_groups,
        "gone": sorted(gone_set),
        "culprit": overall,
        "text": finding_text(overall, gone_set),
    }


def _members(dumps: dict[int, RankDump], given: dict[str, Iterable[int]],
             known: set[int]) -> dict[str, tuple[int, ...]]:
    """Each group's global ranks: from the dumps' pg_config (NCCL), else as given (the hub's
    groups), else the ranks whose dumps mention it (all known ranks for the default group)."""
    out: dict[str, set[int]] = {}
    for name, ranks in given.items():
        if ranks:
            out[str(name)] = set(ranks)
    mentioned: dict[str, set[int]] = {}
    for rank, dump in dumps.items():
        for name, seen in dump.groups.items():
            if seen.config_ranks:
                out[name] = set(seen.config_ranks)
            mentioned.setdefault(name, set()).add(rank)
            if seen.desc == "default_pg":
                mentioned[name] |= known
    for name, ranks in mentioned.items():
        out.setdefault(name, ranks)
    return {name: tuple(sorted(ranks)) for name, ranks in out.items() if ranks}


def _labels(groups: dict[str, Any], desc: dict[str, str]) -> dict[str, str]:
    """A group as people know it, as the live views name it (`JobState.group_label`): its
    description, with its name where two groups share one, "group NAME" without a description,
    then its ranks: "user_pg [0,1]", "group 1 [0,1]"."""
    counts: dict[str, int] = {}
    for name in groups:
        d = desc.get(name, "")
        counts[d] = counts.get(d, 0) + 1
    out = {}
    for name, ranks in groups.items():
        d = desc.get(name, "")
        if not d or d == "undefined":
            short = f"group {name}"
        else:
            short = f"{d} ({name})" if counts[d] > 1 else d
        out[name] = f"{short} {span_text(list(ranks))}" if ranks else short
    return out


def _rank_status(dump: RankDump | None, status: dict[int, dict[str, list[int]]],
                 source: dict[int, str], rank: int, group: str, gone: set[int],
                 missing: dict[int, str]) -> dict[str, Any]:
    seen = status.get(rank, {}).get(group)
    if seen is None:
        why = missing.get(rank) or ("its process is gone" if rank in gone else
                                    "its dump does not mention the group" if dump else
                                    "no dump")
        return {"last_issued": None, "last_completed": None, "issued_op": None,
                "completed_op": None, "source": None, "note": why}
    issued, completed = seen
    return {"last_issued": issued, "last_completed": completed,
            "issued_op": dump.op_at(group, issued) if dump and issued else None,
            "completed_op": dump.op_at(group, completed) if dump and completed else None,
            "source": source.get(rank), "note": _note(source.get(rank), missing.get(rank))}


def _note(source: str | None, why: str | None) -> str | None:
    if source == "heartbeat":
        return "from its last heartbeat" + (f"; no dump: {why}" if why else "")
    return why


def _mismatches(dumps: dict[int, RankDump], group: str) -> dict[str, Any]:
    """Collectives of `group` that differ between ranks at the same sequence number: the op,
    else the dtypes, else the sizes (only the op for ops whose tensors may differ)."""
    by_seq: dict[int, dict[int, list[Entry]]] = {}
    for rank, dump in dumps.items():
        for e in dump.entries:
            if e.group == group and not e.is_p2p:
                by_seq.setdefault(e.seq, {}).setdefault(rank, []).append(e)
    found = []
    for seq in sorted(by_seq):
        ranks = by_seq[seq]
        if len(ranks) < 2:
            continue
        what = None
        for key, get in (("op", lambda es: [e.op for e in es]),
                         ("dtypes", lambda es: [(e.input_dtypes, e.output_dtypes) for e in es]),
                         ("sizes", lambda es: [(e.input_sizes, e.output_sizes) for e in es])):
            if key != "op" and any(e.op in _SIZES_VARY for es in ranks.values() for e in es):
                break
            if len({repr(get(es)) for es in ranks.values()}) > 1:
                what = key
                break
        if what:
            found.append({"seq": seq, "field": what, "by_rank": {
                str(r): "; ".join(e.signature() for e in es) for r, es in sorted(ranks.items())}})
    return {"count": len(found), "first": found[:MAX_MISMATCHES]}


CHAINS_SHOWN = 16
"""Wait-for chains kept in a report (each is a path to a culprit; the rest are alike)."""


WAITS_SHOWN = 16
"""Distinct waits (group, collective, awaited ranks) kept in a report's finding."""


def _finding(finding: dict[str, Any] | None, labels: dict[str, str],
             dumps: dict[int, RankDump]) -> dict[str, Any] | None:
    """`find_culprits`' finding as JSON-ready data, with the group's label and op: each
    culprit's cause, what it never issued, the desyncs, the first wait-for chains, and the
    waits grouped by what they wait in and for whom (at thousands of ranks one line each)."""
    if not finding:
        return None

    def op_of(group: str, seq: int, ranks: Iterable[int]) -> str | None:
        for rank in [*ranks, *dumps]:
            dump = dumps.get(rank)
            op = dump.op_at(group, seq) if dump else None
            if op:
                return op
        return None

    group, seq = finding["group"], finding["seq"]
    waits: dict[tuple[str, int, tuple[int, ...]], list[int]] = {}
    for rank, wait in sorted((finding.get("waits") or {}).items()):
        waits.setdefault((wait["group"], wait["seq"], tuple(wait["for"])), []).append(rank)
    grouped = [{"group": g, "seq": q, "label": labels.get(g, f"group {g}"),
                "op": op_of(g, q, ranks), "ranks": ranks, "for": list(awaited)}
               for (g, q, awaited), ranks in waits.items()]
    missed: dict[str, list[str]] = {}
    for wait in grouped:
        what = f"{wait['op'] or 'collective'} #{wait['seq']} of {wait['label']}"
        for rank in wait["for"]:
            if what not in missed.setdefault(str(rank), []):
                missed[str(rank)].append(what)
    return {"group": group, "seq": seq, "culprits": finding["culprits"],
            "waiting": finding["waiting"], "label": labels.get(group, f"group {group}"),
            "op": op_of(group, seq, finding["waiting"]),
            "causes": {str(r): c for r, c in (finding.get("causes") or {}).items()},
            "never_issued": {r: m for r, m in missed.items()
                             if int(r) in finding["culprits"]},
            "waits": grouped[:WAITS_SHOWN], "waits_count": len(grouped),
            "desync": finding.get("desync") or [],
            "chains": (finding.get("chains") or [])[:CHAINS_SHOWN]}


def finding_text(finding: dict[str, Any] | None, gone: set[int]) -> str:
    """The finding in words, as the live hang view says it: each culprit with what it never
    issued (or why it cannot), then what each waiting rank waits in and for whom."""
    if not finding:
        return "no culprit: every rank completed the collectives it issued"
    what = f"{finding['op'] or 'collective'} #{finding['seq']} of {finding['label']}"
    culprits = finding["culprits"]
    causes, never = finding.get("causes") or {}, finding.get("never_issued") or {}
    parts: list[str] = []
    alike: dict[str, list[int]] = {}  # culprits in Python that missed the same collectives
    for rank in culprits:
        cause = (causes.get(str(rank)) or {}).get("cause")
        if rank in gone or cause == "gone":
            parts.append(f"rank {rank}: process gone")
        elif cause in ("desync", "teardown", "deadlock"):
            parts.append(f"rank {rank}: {cause}")
        else:
            alike.setdefault(" nor ".join(never.get(str(rank)) or [what]), []).append(rank)
    parts[:0] = [f"{ranks_text(ranks)} never issued {missed}" for missed, ranks in alike.items()]
    waits = finding.get("waits")
    if waits is None:  # a report of an older scalemon: no waits of its own
        waits = [{"ranks": finding["waiting"], "for": [], "op": finding["op"],
                  "seq": finding["seq"], "label": finding["label"]}] if finding["waiting"] else []
    for wait in waits:
        ranks = [r for r in wait["ranks"] if r not in culprits]
        if not ranks:
            continue
        verb = "waits" if len(ranks) == 1 else "wait"
        awaited = f" for {ranks_text(wait['for'])}" if wait["for"] else ""
        parts.append(f"{ranks_text(ranks)} {verb} in {wait['op'] or 'collective'} "
                     f"#{wait['seq']} of {wait['label']}{awaited}")
    more = finding.get("waits_count", 0) - len(waits)
    if more > 0:
        parts.append(f"{more} more waits (scalemon dump --json lists them)")
    if not culprits:
        parts.append("every rank issued it: a network or communication-library problem, not "
                     "a late rank")
    return "; ".join(parts)


def ranks_text(ranks: list[int], limit: int = 16) -> str:
    """"rank 1", "ranks 0,2,3", "ranks 0-511" (runs joined), long lists cut."""
    if not ranks:
        return "no rank"
    parts = []
    ordered = sorted(ranks)
    start = prev = ordered[0]
    for r in [*ordered[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else
                     f"{start},{prev}" if prev == start + 1 else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    more = f" (+{len(parts) - limit} more)" if len(parts) > limit else ""
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts[:limit]) + more


def analyse_directory(directory: Path, context: dict[str, Any] | None = None) -> dict[str, Any]:
    """The analysis of the dumps in `directory`, with what the hub knew (`context`, else the
    directory's context.json when there is one)."""
    context = read_context(directory) if context is None else context
    dumps, problems = read_directory(directory)
    missing = {int(r): str(why) for r, why in (context.get("missing") or {}).items()}
    for rank, why in problems.items():
        if rank not in dumps:
            missing[rank] = f"its dump could not be read: {why}"
    fallback = {}
    for rank, groups in (context.get("heartbeat") or {}).items():
        if isinstance(groups, dict):
            fallback[int(rank)] = {str(g): list(s) for g, s in groups.items()
                                   if isinstance(s, list) and len(s) == 2}
    report = analyse(
        dumps, members=context.get("members") or {}, descs=context.get("descs") or {},
        asked=context.get("asked") or (), missing=missing, gone=context.get("gone") or (),
        fallback=fallback, directory=str(directory))
    report["problems"] = {str(r): why for r, why in sorted(problems.items()) if r in dumps}
    return report


# --- the analysis for people ---------------------------------------------------------------

def report_lines(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The analysis as lines of (text, kind), kind "heading", "finding", "problem" or "":
    the finding, the ranks that gave nothing, then a table per group."""
    lines: list[tuple[str, str]] = []
    read, asked = report.get("read") or [], report.get("asked") or []
    versions = report.get("versions") or []
    fmt = f"; format {', '.join(versions)}" if versions else ""
    of = f" of {len(asked)} asked" if asked else ""
    lines.append((f"dumps read from {len(read)} ranks{of}{fmt}", ""))
    culprit = report.get("culprit")
    lines.append((("culprit: " if culprit and culprit.get("culprits") else "") +
                  str(report.get("text") or ""), "finding" if culprit else ""))
    for rank, why in (report.get("missing") or {}).items():
        lines.append((f"rank {rank} gave no dump: {why}", "problem"))
    if report.get("skipped_entries"):
        lines.append((f"{report['skipped_entries']} entries not understood were skipped", ""))
    gone = set(report.get("gone") or ())
    for group in report.get("groups") or ():
        lines.append(("", ""))
        lines.extend(_group_lines(group, gone))
    return lines


def _group_lines(group: dict[str, Any], gone: set[int]) -> list[tuple[str, str]]:
    ranks = group.get("ranks") or []
    finding = group.get("finding")
    culprits = set(finding["culprits"]) if finding else set()
    waiting = set(finding["waiting"]) if finding else set()
    title = f"{group['label']} (group name {group['name']}, {len(ranks)} ranks)"
    lines = [(title, "heading")]
    if finding:
        lines.append(("  " + finding_text(finding, gone), "finding"))
    behind = group.get("behind") or {}
    rows: dict[tuple[str, str, str, str], list[int]] = {}
    for rank_text, s in (group.get("status") or {}).items():
        rank = int(rank_text)
        role = ("behind" if rank_text in behind else "culprit" if rank in culprits
                else "waiting" if rank in waiting else "")
        issued = _seq_text(s["last_issued"], s["issued_op"])
        completed = _seq_text(s["last_completed"], s["completed_op"])
        note = behind.get(rank_text) or s.get("note") or ""
        rows.setdefault((role, issued, completed, note), []).append(rank)
    table = [("ranks", "last issued", "last completed", "role", "note")]
    order = {"culprit": 0, "behind": 1, "waiting": 2, "": 3}
    for (role, issued, completed, note), members in sorted(
            rows.items(), key=lambda kv: (order[kv[0][0]], min(kv[1]))):
        table.append((ranks_text(members).split(" ", 1)[1], issued, completed, role or "-",
                      note))
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for i, row in enumerate(table):
        text = "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False))
        kind = "heading" if i == 0 else "problem" if row[3] == "culprit" else ""
        lines.append(((text + "  " + row[4]).rstrip(), kind))
    mismatches = group.get("mismatches") or {}
    for m in mismatches.get("first") or ():
        values = "; ".join(f"rank {r}: {v}" for r, v in m["by_rank"].items())
        lines.append((f"  MISMATCH of {m['field']} at #{m['seq']}: {values}", "problem"))
    more = (mismatches.get("count") or 0) - len(mismatches.get("first") or ())
    if more > 0:
        lines.append((f"  (+{more} more mismatches)", "problem"))
    return lines


def _seq_text(seq: int | None, op: str | None) -> str:
    if seq is None:
        return "-"
    return f"#{seq}" + (f" {op}" if op else "")


def report_text(report: dict[str, Any]) -> str:
    """The analysis as plain text (the CLI's output, the history record's `analysis`)."""
    return "\n".join(text for text, _ in report_lines(report))
