"""What the hang screen draws, built from `DashboardData` under its lock: the sentence naming the
culprit, each rank's whereabouts, each rank's Python stack and the latest Flight Recorder dump.

A hang is judged at the time of the last record while the records are old (a history being
replayed, or caught up with): an old history must not read as a hang of now.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from scalemon.reports import parallel_text
from scalemon.reports.frtrace import report_lines
from scalemon.reports.groups import group_desc
from scalemon.reports.hangs import job_hang, last_hang
from scalemon.text import display
from scalemon.text.display import NA

from ..model import DashboardData

MAX_GROUP_COLUMNS = 4
NO_DUMP = "a rank that writes no dump is a finding in itself"


@dataclass
class HangRow:
    """One rank's line of the table, cells in `HangView.headings` order."""

    rank: int
    role: str  # "culprit", "waiting" or ""
    cells: tuple[str, ...]


@dataclass
class HangView:
    """What the hang screen draws; `hung` False: no hang now (rows and stacks are empty);
    `ended`: the hang is the one the job ended in (`reports.hangs.last_hang`), kept after."""

    hung: bool
    text: str
    headings: tuple[str, ...]
    rows: list[HangRow]  # culprits, then the waiting ranks, then the others
    stacks: list[tuple[str, str, str]]  # (heading, role, stack): one per distinct stack
    dump: list[tuple[str, str]]  # (text, style) lines about the latest dump
    ras: list[tuple[str, str]] = field(default_factory=list)  # (heading, NCCL RAS report)
    why: list[tuple[str, str]] = field(default_factory=list)  # (line, role): causes, waits
    ended: bool = False


def judged_at(data: DashboardData, now: float) -> float:
    """`now` while records keep coming; the last record's time once they are older than the
    hang threshold (call under the lock)."""
    st = data.state
    if st.last_t is None or now - st.last_t <= st.hang_after_s:
        return now
    return st.last_t


def current_hang(data: DashboardData, now: float) -> dict[str, Any] | None:
    """`job_hang` at `judged_at` (call under the lock); None at once while a step came within
    the hang threshold (`job_hang` would first work out the job's state from every rank)."""
    st = data.state
    at = judged_at(data, now)
    if st.last_step_t is None or at - st.last_step_t < st.hang_after_s:
        return None
    return job_hang(st, at)


def hang_view(data: DashboardData, now: float | None = None) -> HangView:
    """The hang (or that there is none) and the latest dump."""
    now = time.time() if now is None else now
    with data.lock:
        st = data.state
        at = judged_at(data, now)
        hang = job_hang(st, at)
        ended = last_hang(st) if hang is None else None
        if ended is not None:  # the job ended hung: that hang, as it stood then
            hang, at = ended, ended["ended_t"]
        dump = _dump_lines(st.fr_dumps[-1] if st.fr_dumps else None)
        if hang is None:
            return HangView(False, _no_hang_text(data, at), (), [], [], dump)
        offsets = {r: st.clock_offset(v) for r, v in st.ranks.items()}
        labels = {name: group_desc(st.groups, name) for name in st.groups}  # the heading has ranks
        hosts = {str(r): v.host for r, v in st.ranks.items()}
        ends = {r: end_word(v.state, v.exit_code) for r, v in st.ranks.items()}
    groups = _group_columns(hang)
    headings = ("rank", "role", "state", "step", "phase", "stuck s", "frame",
                *(f"{g}\nissued/done" for g in groups), "in flight")
    rows = [_row(int(r), _role(hang, int(r)), info, groups, labels,
                 at - offsets.get(int(r), 0.0)) for r, info in hang["ranks"].items()]
    rows.sort(key=lambda r: (_ORDER[r.role], r.rank))  # the culprits on top, however many
    if ended is not None:  # the analysis as of the hang, each rank's state as of now: its end
        rows = [HangRow(r.rank, r.role, (*r.cells[:2], ends.get(r.rank, NA), *r.cells[3:]))
                for r in rows]
    text = hang["text"] if ended is None else f"{ended['summary']}\n{hang['text']}"
    return HangView(True, text, headings, rows, _stacks(rows, hang), dump,
                    _ras(hang.get("nccl_ras") or {}, hosts), _why(hang), ended is not None)


def end_word(state: str, exit_code: int | None) -> str:
    """A rank's state in the table of a job that ended hung: "exited 143", "stopped", "gone"."""
    return f"{state} {exit_code}" if state == "exited" and exit_code is not None else state


WHY_LINES = 24
"""Lines about culprits and waiting ranks at most (the table has every rank)."""


def _why(hang: dict[str, Any]) -> list[tuple[str, str]]:
    """Each culprit with its cause, then each waiting rank with what it waits in and for whom
    (ranks alike together), then the wait-for chains with the op on each edge ("2 -recv-> 1
    -recv-> 0 (in Python: train.py:40 in step())")."""
    lines = [(c["text"], "culprit" if c["culprit"] else "waiting")
             for c in hang.get("causes") or ()]
    alike: dict[str, list[int]] = {}
    for w in hang.get("waits") or ():
        if not w["culprit"]:
            alike.setdefault(w["text"].split(": ", 1)[1], []).append(w["rank"])
    lines += [(f"{_ranks(ranks)}: {text}", "waiting") for text, ranks in alike.items()]
    if len(lines) > WHY_LINES:
        lines = [*lines[:WHY_LINES], (f"(+{len(lines) - WHY_LINES} more)", "")]
    lines += [(f"waits for: {chain}", "") for chain in parallel_text.shown_chains(hang)]
    return lines


_ORDER = {"culprit": 0, "waiting": 1, "": 2}


def _role(hang: dict[str, Any], rank: int) -> str:
    if rank in hang["culprits"]:
        return "culprit"
    return "waiting" if rank in hang["waiting"] else ""


def _no_hang_text(data: DashboardData, at: float) -> str:
    st = data.state
    limit = f"a job is hung after {st.hang_after_s:g} s without a completed step"
    if st.last_step_t is None:
        return f"no hang: no step completed yet ({limit})"
    return f"no hang: the last step completed {at - st.last_step_t:.0f} s ago ({limit})"


def _group_columns(hang: dict[str, Any]) -> list[str]:
    """Group labels for the table: the hung group first, then by name, at most a few."""
    labels = sorted({g for info in hang["ranks"].values() for g in info["groups"]})
    if hang["group"] in labels:
        labels.remove(hang["group"])
        labels.insert(0, hang["group"])
    return labels[:MAX_GROUP_COLUMNS]


def _row(rank: int, role: str, info: dict[str, Any], groups: list[str],
         labels: dict[str, str], local_now: float) -> HangRow:
    """A rank's cells; in-flight ages on the rank's host clock (`local_now`)."""
    stuck = info["stuck_s"]
    cells = [str(rank), role or "-", info["state"], display.text_of(info["step"]),
             info["phase"] or NA, NA if stuck is None else f"{stuck:.0f}", info.get("frame") or NA]
    for label in groups:
        g = info["groups"].get(label)
        cells.append(f"{g['last_issued']}/{g['last_completed']}" if g else NA)
    inflight = _inflight(info["inflight"], labels, local_now)
    p2p = _p2p_inflight(info.get("p2p_inflight") or [], labels, local_now)
    cells.append("; ".join(p for p in (inflight, p2p) if p != "-") or "-")
    return HangRow(rank, role, tuple(cells))


def _p2p_inflight(items: list[Any], labels: dict[str, str], local_now: float) -> str:
    """"recv from 0 of stage_0_1 37 s" per P2P op in flight, or "-"."""
    parts = []
    for item in items[:3]:
        if not isinstance(item, list) or len(item) < 3:
            continue
        group, op, peer = item[:3]
        t = item[3] if len(item) > 3 else None
        age = f" {local_now - t:.0f} s" if isinstance(t, (int, float)) else ""
        way = "from" if op == "recv" else "to"
        parts.append(f"{op} {way} {peer} of {labels.get(str(group), f'group {group}')}{age}")
    more = f" (+{len(items) - 3})" if len(items) > 3 else ""
    return "; ".join(parts) + more if parts else "-"


def _inflight(items: list[Any], labels: dict[str, str], local_now: float) -> str:
    """"default_pg #412 all_reduce 37 s" per collective in flight, or "-"."""
    parts = []
    for item in items[:3]:
        if not isinstance(item, list) or len(item) < 4:
            continue
        group, seq, op, t = item[:4]
        age = f" {local_now - t:.0f} s" if isinstance(t, (int, float)) else ""
        parts.append(f"{labels.get(str(group), f'group {group}')} #{seq} {op}{age}")
    more = f" (+{len(items) - 3})" if len(items) > 3 else ""
    return "; ".join(parts) + more if parts else "-"


def _stacks(rows: list[HangRow], hang: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Each distinct (role, stack) once, naming every rank that has it: culprits first, then
    the waiting ranks, then the others (hundreds of ranks waiting in one collective share one
    stack)."""
    ranks: dict[tuple[str, str], list[int]] = {}
    for row in rows:
        ranks.setdefault((row.role, hang["stacks"].get(str(row.rank), "")), []).append(row.rank)
    out = []
    for (role, stack), members in ranks.items():
        what = {"culprit": "culprit", "waiting": "waiting", "": ""}[role]
        parts = [_ranks(members), what]
        if len(members) == 1:
            info = hang["ranks"][str(members[0])]
            parts += [info["state"], f"step {display.text_of(info['step'])}",
                      f"phase {info['phase'] or NA}"]
        else:
            parts.append("the same stack")
        out.append(("  ·  ".join(p for p in parts if p), role, stack))
    return out


def _ras(reports: dict[str, Any], hosts: dict[str, str | None]) -> list[tuple[str, str]]:
    """NCCL RAS's status of each node (sent by its local rank 0 once per stuck spell)."""
    out = []
    for rank, value in sorted(reports.items(), key=lambda kv: int(kv[0])):
        if not isinstance(value, dict):
            continue
        heading = f"NCCL RAS on {hosts.get(rank) or '?'} (via rank {rank})"
        text = value.get("status") or f"no report: {value.get('error') or 'unknown'}"
        out.append((heading, str(text)))
    return out


_DUMP_STYLES = {"heading": "bold", "finding": "bold red", "problem": "red", "": ""}


def _dump_lines(dump: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The latest Flight Recorder dump and scalemon's analysis of it, as lines of (text,
    style): the finding, the ranks that gave nothing, a table per group."""
    if dump is None:
        return [("no Flight Recorder dump yet: d asks every rank to write one, and scalemon "
                 "tells from them who holds up whom", "dim")]
    lines = [(f"Flight Recorder dump {dump['directory']} ({dump['state']})", "bold")]
    asked = dump.get("requested") or []
    if dump["state"] != "analysed":
        lines.append((f"asked {_ranks(asked)}; waiting for their dumps (up to 15 s), then "
                      "the analysis", ""))
        return lines
    written, missing = dump.get("written") or [], dump.get("missing") or []
    lines.append((f"asked {_ranks(asked)}; wrote a dump: {_ranks(written)}", ""))
    if missing:
        lines.append((f"no dump from {_ranks(missing)}: {NO_DUMP} (a rank stuck in C++ with "
                      "the GIL held, or whose process is gone, cannot write one)", "bold red"))
    report = dump.get("report")
    if isinstance(report, dict):
        try:
            lines.extend((text, _DUMP_STYLES.get(kind, "")) for text, kind in
                         report_lines(report))
            return lines
        except (KeyError, TypeError, ValueError, AttributeError):  # another scalemon's
            pass
    lines.append((dump.get("analysis") or "(no analysis)", ""))
    return lines


def _ranks(ranks: list[int], limit: int = 16) -> str:
    """"rank 1", "ranks 0,2,3", "ranks 0,1,...,15 (+496)"."""
    if not ranks:
        return "none"
    text = ",".join(str(r) for r in ranks[:limit])
    more = f" (+{len(ranks) - limit})" if len(ranks) > limit else ""
    return ("rank " if len(ranks) == 1 else "ranks ") + text + more
