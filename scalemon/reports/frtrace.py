"""Flight Recorder dumps analysed by scalemon itself, without torch or optional packages; the
dump files are read by `scalemon/reports/frread.py` (whose names this module also offers).

`analyse` gives, per process group, each rank's last issued and completed collective, the
collectives whose op, dtypes or sizes differ between ranks at the same sequence number, and the
culprit by the rules of the live hang view (`scalemon.reports.waitfor.find_culprits`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from scalemon.reports.frread import (
    ANALYSIS_FILE,
    CONTEXT_FILE,
    DumpError,
    RankDump,
    load_file,
    read_context,
)
from scalemon.reports.frscan import Progress, scan_directory
from scalemon.reports.frtable import SeqTable
from scalemon.reports.groups import mesh_dim, short_name
from scalemon.reports.waitfor import find_culprits
from scalemon.text.ranks import rank_list, ranks_text, span_text

__all__ = [  # with the reader's names that hub/, the CLI and the tests use
    "ANALYSIS_FILE",
    "CONTEXT_FILE",
    "DumpError",
    "RankDump",
    "analyse",
    "analyse_directory",
    "finding_text",
    "load_file",
    "report_lines",
    "report_text",
]

MAX_MISMATCHES = 8
"""Mismatches listed per group (the first ones: later ones often follow from them)."""


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
    p2p_fallback: dict[int, list[Any]] | None = None,
    directory: str = "",
    table: SeqTable | None = None,
) -> dict[str, Any]:
    """The analysis of the ranks' dumps, as plain JSON-able values.

    `members`/`descs`: the groups' global ranks and descriptions where the dumps lack them
    (gloo's do); `asked`: the ranks asked for a dump; `missing`: rank -> why it gave none;
    `gone`: ranks whose process is gone; `fallback`: rank -> group -> [issued, completed] from
    the rank's last heartbeat, used for a rank without a dump; `p2p_fallback`: rank -> its
    last heartbeat's P2P ops in flight (`p2p_inflight`), used where its dump has no P2P
    entries (gloo's recorder keeps none); `table`: the dumps' collectives (`scan_directory`
    reads it with them), else made of the dumps' cells."""
    table = SeqTable.of(dumps) if table is None else table
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
    p2p = {r: [list(i) for i in items if isinstance(i, (list, tuple))]
           for r, items in (p2p_fallback or {}).items()
           if isinstance(items, list) and r not in gone_set}
    for rank, dump in dumps.items():
        if dump.has_p2p:  # NCCL's recorder saw its P2P ops
            p2p[rank] = dump.p2p_inflight(groups)
    overall = _finding(find_culprits(status, groups, gone_set, p2p=p2p), labels, dumps, table)
    waits_of = {r: w for w in (overall or {}).get("waits", ()) for r in w["ranks"]}
    status_of: dict[str, dict[int, dict[str, list[int]]]] = {}  # each group by itself
    for rank, seen in status.items():
        for name, value in seen.items():
            status_of.setdefault(name, {})[rank] = {name: value}
    p2p_of: dict[str, dict[int, list[Any]]] = {}
    for rank, items in p2p.items():
        for item in items:
            if item and isinstance(item[0], str):
                p2p_of.setdefault(item[0], {}).setdefault(rank, []).append(item)
    out_groups = []
    for name, ranks in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        finding = find_culprits(status_of.get(name, {}), {name: ranks}, gone_set,
                                p2p=p2p_of.get(name, {}))  # the group by itself
        # a rank behind in this group that waits in another: a link of a chain, not its end
        behind = {str(r): f"waits in {w['op'] or 'collective'} #{w['seq']} of {w['label']}"
                  for r in (finding or {}).get("culprits", ())
                  if (w := waits_of.get(r)) is not None and w["group"] != name}
        out_groups.append({
            "behind": behind,
            "name": name, "label": labels[name], "ranks": list(ranks),
            "status": {str(r): _rank_status(dumps.get(r), table, status, source, r, name,
                                            gone_set, missing)
                       for r in ranks},
            "mismatches": table.mismatches(name, MAX_MISMATCHES),
            "finding": _finding(finding, labels, dumps, table),
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
    read: dict[str, list[int]] = {}  # the list each group's ranks were last read from
    defaults: set[str] = set()  # groups described as the default group: all known ranks
    for rank, dump in dumps.items():
        for name, seen in dump.groups.items():
            if seen.config_ranks and read.get(name) is not seen.config_ranks:
                out[name] = set(seen.config_ranks)  # (the ranks' dumps share one list)
                read[name] = seen.config_ranks
            mentioned.setdefault(name, set()).add(rank)
            if seen.desc == "default_pg":
                defaults.add(name)
    for name in defaults:
        mentioned[name] |= known
    for name, ranks in mentioned.items():
        out.setdefault(name, ranks)
    return {name: tuple(sorted(ranks)) for name, ranks in out.items() if ranks}


def _labels(groups: dict[str, Any], desc: dict[str, str]) -> dict[str, str]:
    """A group as people know it, as the live views name it (`groups.group_label`): "tp [2,3]"
    for a mesh dimension's group; its description, with its name where two groups share one,
    "group NAME" without a description, then its ranks: "user_pg [0,1]", "group 1 [0,1]"."""
    counts: dict[tuple[str, tuple[int, ...] | None], int] = {}

    def key(name: str) -> tuple[str, tuple[int, ...] | None]:
        d = desc.get(name, "")
        return d, tuple(groups[name]) if mesh_dim(d) is not None else None

    for name in groups:
        counts[key(name)] = counts.get(key(name), 0) + 1
    out = {}
    for name, ranks in groups.items():
        d = desc.get(name, "")
        short = short_name(d, name, list(ranks), counts[key(name)])
        mesh = mesh_dim(d) is not None
        out[name] = f"{short} {span_text(list(ranks))}" if ranks and not mesh else short
    return out


def _rank_status(dump: RankDump | None, table: SeqTable,
                 status: dict[int, dict[str, list[int]]], source: dict[int, str], rank: int,
                 group: str, gone: set[int], missing: dict[int, str]) -> dict[str, Any]:
    seen = status.get(rank, {}).get(group)
    if seen is None:
        why = missing.get(rank) or ("its process is gone" if rank in gone else
                                    "its dump does not mention the group" if dump else
                                    "no dump")
        return {"last_issued": None, "last_completed": None, "issued_op": None,
                "completed_op": None, "source": None, "note": why}
    issued, completed = seen
    return {"last_issued": issued, "last_completed": completed,
            "issued_op": table.op_at(group, issued, rank) if dump and issued else None,
            "completed_op": table.op_at(group, completed, rank) if dump and completed else None,
            "source": source.get(rank), "note": _note(source.get(rank), missing.get(rank))}


def _note(source: str | None, why: str | None) -> str | None:
    if source == "heartbeat":
        return "from its last heartbeat" + (f"; no dump: {why}" if why else "")
    return why


RANKS_SHOWN = 16
"""Parts of a rank list shown in a finding's text (`text.ranks.rank_list`)."""
CHAINS_SHOWN = 16
"""Wait-for chains kept in a report (each is a path to a culprit; the rest are alike)."""


WAITS_SHOWN = 16
"""Distinct waits (group, collective, awaited ranks) kept in a report's finding."""


def _finding(finding: dict[str, Any] | None, labels: dict[str, str],
             dumps: dict[int, RankDump], table: SeqTable) -> dict[str, Any] | None:
    """`find_culprits`' finding as JSON-ready data, with the group's label and op: each
    culprit's cause, what it never issued, the desyncs, the first wait-for chains, and the
    waits grouped by what they wait in and for whom (at thousands of ranks one line each)."""
    if not finding:
        return None

    def op_of(group: str, seq: int, ranks: Iterable[int]) -> str | None:
        return table.op_of(group, seq, [*ranks, *dumps])

    group, seq = finding["group"], finding["seq"]
    waits: dict[tuple[Any, ...], list[int]] = {}
    for rank, wait in sorted((finding.get("waits") or {}).items()):
        p2p = (wait["op"], wait.get("peer")) if wait["seq"] is None else (None, None)
        waits.setdefault((wait["group"], wait["seq"], tuple(wait["for"]), *p2p),
                         []).append(rank)
    grouped = [{"group": g, "seq": q, "label": labels.get(g, f"group {g}"),
                "op": op if q is None else op_of(g, q, ranks), "ranks": ranks,
                "for": list(awaited), **({"peer": peer} if q is None else {})}
               for (g, q, awaited, op, peer), ranks in waits.items()]
    missed: dict[str, list[str]] = {}
    for wait in grouped:
        for rank in wait["for"]:
            what = _counterpart(wait, rank)
            if what not in missed.setdefault(str(rank), []):
                missed[str(rank)].append(what)
    primary = next((w for w in grouped if (w["group"], w["seq"]) == (group, seq)), None)
    return {"group": group, "seq": seq, "culprits": finding["culprits"],
            "waiting": finding["waiting"], "label": labels.get(group, f"group {group}"),
            "op": (primary or {}).get("op") if seq is None else op_of(
                group, seq, finding["waiting"]),
            **({"peer": primary.get("peer")} if seq is None and primary else {}),
            "causes": {str(r): c for r, c in (finding.get("causes") or {}).items()},
            "never_issued": {r: m for r, m in missed.items()
                             if int(r) in finding["culprits"]},
            "waits": grouped[:WAITS_SHOWN], "waits_count": len(grouped),
            "desync": finding.get("desync") or [],
            "chains": (finding.get("chains") or [])[:CHAINS_SHOWN]}


def _what(wait: dict[str, Any]) -> str:
    """"all_reduce #7 of default_pg [0-3]", or for a P2P wait "recv from rank 0 of pp
    [0,2]"."""
    if wait.get("seq") is None and wait.get("op") in ("send", "recv"):
        way = "from" if wait["op"] == "recv" else "to"
        return f"{wait['op']} {way} rank {wait.get('peer')} of {wait['label']}"
    return f"{wait.get('op') or 'collective'} #{wait['seq']} of {wait['label']}"


def _counterpart(wait: dict[str, Any], rank: int) -> str:
    """What `rank`, awaited in `wait`, never issued: the collective, or the other side of the
    P2P op ("send to rank 2 of pp [0,2]")."""
    if wait.get("seq") is not None or wait.get("op") not in ("send", "recv"):
        return _what(wait)
    waiters = ranks_text(wait["ranks"], limit=RANKS_SHOWN)
    if rank != wait.get("peer"):
        return f"a send or recv with {waiters} of {wait['label']}"
    way = "send to" if wait["op"] == "recv" else "recv from"
    return f"{way} {waiters} of {wait['label']}"


def finding_text(finding: dict[str, Any] | None, gone: set[int]) -> str:
    """The finding in words, as the live hang view says it: each culprit with what it never
    issued (or why it cannot), then what each waiting rank waits in and for whom."""
    if not finding:
        return "no culprit: every rank completed the collectives it issued"
    what = _what(finding)
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
    parts[:0] = [f"{ranks_text(ranks, limit=RANKS_SHOWN)} never issued {missed}"
                 for missed, ranks in alike.items()]
    waits = finding.get("waits")
    if waits is None:  # a report of an older scalemon: no waits of its own
        waits = [{"ranks": finding["waiting"], "for": [], "op": finding["op"],
                  "seq": finding["seq"], "label": finding["label"]}] if finding["waiting"] else []
    for wait in waits:
        ranks = [r for r in wait["ranks"] if r not in culprits]
        if not ranks:
            continue
        verb = "waits" if len(ranks) == 1 else "wait"
        awaited = f" for {ranks_text(wait['for'], limit=RANKS_SHOWN)}" if wait["for"] else ""
        if wait.get("seq") is None and wait["for"] == [wait.get("peer")]:
            awaited = ""  # "recv from rank 0" says it
        parts.append(f"{ranks_text(ranks, limit=RANKS_SHOWN)} {verb} in {_what(wait)}"
                     f"{awaited}")
    more = finding.get("waits_count", 0) - len(waits)
    if more > 0:
        parts.append(f"{more} more waits (scalemon dump --json lists them)")
    if not culprits:
        parts.append("every rank issued it: a network or communication-library problem, not "
                     "a late rank")
    return "; ".join(parts)


def analyse_directory(directory: Path, context: dict[str, Any] | None = None,
                      progress: Progress | None = None,
                      say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The analysis of the dumps in `directory`, with what the hub knew (`context`, else the
    directory's context.json when there is one); `progress` is told (ranks read, ranks),
    `say` how many ranks were read from their summaries (`Scan.summaries_note`; the analysis
    is the same either way)."""
    context = read_context(directory) if context is None else context
    scan = scan_directory(directory, progress)
    note = scan.summaries_note()
    if say is not None and note:
        say(note)
    dumps, problems = scan.dumps, scan.problems
    missing = {int(r): str(why) for r, why in (context.get("missing") or {}).items()}
    for rank, why in problems.items():
        if rank not in dumps:
            missing[rank] = f"its dump could not be read: {why}"
    fallback = {}
    for rank, groups in (context.get("heartbeat") or {}).items():
        if isinstance(groups, dict):
            fallback[int(rank)] = {str(g): list(s) for g, s in groups.items()
                                   if isinstance(s, list) and len(s) == 2}
    p2p_fallback = {int(rank): items for rank, items in (context.get("p2p") or {}).items()
                    if isinstance(items, list)}
    report = analyse(
        dumps, members=context.get("members") or {}, descs=context.get("descs") or {},
        asked=context.get("asked") or (), missing=missing, gone=context.get("gone") or (),
        fallback=fallback, p2p_fallback=p2p_fallback, directory=str(directory),
        table=scan.table)
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
        table.append((rank_list(members, limit=RANKS_SHOWN), issued, completed, role or "-",
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
