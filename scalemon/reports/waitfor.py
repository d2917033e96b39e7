"""Who holds up whom in a hung job: the wait-for graph over the ranks' collectives (what each
rank issued and completed, per group), its culprits at the ends of the chains and why each
holds the others up (`CAUSES`). Pure: plain data in, plain data out; shared by the live
analysis (`reports.hangs`) and the Flight Recorder dumps (`reports.frtrace`)."""

from __future__ import annotations

import bisect
from typing import Any

from scalemon.collectives import P2P_OPS

CAUSES = ("gone", "python", "desync", "teardown", "deadlock", "stuck")
"""Why a rank at the end of a wait-for chain holds the others up: its process is gone; it is
alive and waits in no collective (in Python: a loop, I/O, a sleep, a branch that skips the
collective); it issued another collective (op or size) than the rest of its group at the same
sequence number; it waits in teardown for ranks that finished; it waits in a cycle of ranks
that wait for each other (collectives issued in different orders); or it waits in a
collective every member issued alike (`stuck`: the network or the communication library, not
a rank: not counted as a culprit)."""


def _issued(status: dict[int, dict[str, list[int]]], rank: int, group: str) -> int:
    item = status.get(rank, {}).get(group)
    return item[0] if item else 0


def _inflight_at(inflight: dict[int, list[list[Any]]], rank: int, group: str,
                 seq: int) -> list[Any] | None:
    for item in inflight.get(rank) or ():
        if len(item) >= 3 and item[0] == group and item[1] == seq:
            return item
    return None


class _Laggards:
    """Per group and issued count: the members that issued less (and the dead ones), and the
    first collective those alive did not issue; each computed once, shared by every rank that
    waits there (thousands of ranks wait in one collective)."""

    def __init__(self, status: dict[int, dict[str, list[int]]],
                 members: dict[str, tuple[int, ...]], gone: set[int], finished: set[int]) -> None:
        self.status, self.members, self.gone, self.finished = status, members, gone, finished
        self._order: dict[str, list[tuple[int, int]]] = {}
        self._found: dict[tuple[str, int], tuple[list[int], int | None]] = {}

    def of(self, group: str, issued: int) -> tuple[list[int], int | None]:
        """(ranks that issued less than `issued` of `group` or are gone, the lowest last
        issued + 1 of those alive with a status, or None)."""
        key = (group, issued)
        found = self._found.get(key)
        if found is None:
            order = self._order.get(group)
            if order is None:
                order = self._order[group] = sorted(
                    (_issued(self.status, m, group), m) for m in self.members[group])
            below = order[:bisect.bisect_left(order, (issued, -1))]
            late = sorted({m for _, m in below} | {m for m in self.members[group]
                                                   if m in self.gone})
            alive = [i for i, m in below if m not in self.gone and m not in self.finished
                     and group in self.status.get(m, {})]
            found = self._found[key] = (late, min(alive) + 1 if alive else None)
        return found


def _rank_waits(rank: int, groups: dict[str, list[int]], laggards: _Laggards,
                inflight: dict[int, list[list[Any]]]) -> list[dict[str, Any]]:
    """Every group `rank` waits in: those where it issued more than it completed."""
    waits = []
    for group, item in groups.items():
        if group not in laggards.members or not isinstance(item, (list, tuple)) or len(item) != 2:
            continue
        issued, completed = item
        if issued <= completed:
            continue
        late, first = laggards.of(group, issued)
        if rank in late:  # gone itself: not waiting
            late = [m for m in late if m != rank]
        seq = first if first is not None else completed + 1
        entry = _inflight_at(inflight, rank, group, seq)
        waits.append({"group": group, "seq": seq, "op": entry[2] if entry else None,
                      "t": entry[3] if entry and len(entry) > 3 else None, "for": late})
    # the binding wait: one that waits for ranks, the latest issued of those
    waits.sort(key=lambda w: (not w["for"], -(w["t"] or 0.0),
                              -len(laggards.members[w["group"]]), w["group"]))
    return waits


def _p2p_items(items: Any) -> list[tuple[str, str, int, float | None, Any]]:
    """The well-formed rows of a rank's P2P in flight: (group, op, peer, issue time, bytes)."""
    out = []
    for item in items if isinstance(items, (list, tuple)) else ():
        if not (isinstance(item, (list, tuple)) and len(item) >= 3 and item[1] in P2P_OPS
                and type(item[2]) is int and item[2] >= 0):  # -1: any source, not known
            continue
        t = item[3] if len(item) > 3 and type(item[3]) in (int, float) else None
        out.append((str(item[0]), item[1], item[2], t, item[4] if len(item) > 4 else None))
    return out


def _p2p_wait(rank: int, p2p: dict[int, list[tuple[str, str, int, float | None, Any]]]
              ) -> dict[str, Any] | None:
    """What `rank` waits for in its P2P ops in flight (it is inside a P2P wait): recv(src)
    waits for src, unless src has a send to `rank` in flight; send(dst) for dst, unless dst
    has a recv from `rank` in flight (either way both sides issued it: 1F1B stages exchange a
    send and a recv each way at once). The entry names the oldest op that waits for a rank
    (else the oldest); its `for` is every rank one of them waits for."""
    rows = [row for row in p2p.get(rank, ()) if row[2] != rank]
    if not rows:
        return None
    other = {"send": "recv", "recv": "send"}
    awaited = [(group, op, peer, t, n) for group, op, peer, t, n in rows
               if not any(o == other[op] and p == rank and g == group
                          for g, o, p, _, _ in p2p.get(peer, ()))]
    oldest = min(awaited or rows, key=lambda row: float("inf") if row[3] is None else row[3])
    return {"group": oldest[0], "seq": None, "op": oldest[1], "peer": oldest[2],
            "t": oldest[3], "for": sorted({row[2] for row in awaited})}


def _desync(group: str, seq: int, ranks: tuple[int, ...],
            inflight: dict[int, list[list[Any]]]) -> dict[str, Any] | None:
    """Members of `group` that issued another op or size as #seq than the most did, or None
    (also when too few members sent what they issued)."""
    issued: dict[tuple[Any, Any], list[int]] = {}
    for rank in ranks:
        entry = _inflight_at(inflight, rank, group, seq)
        if entry is not None:
            size = entry[4] if len(entry) > 4 else None
            issued.setdefault((entry[2], size), []).append(rank)
    if len(issued) < 2:
        return None
    kinds = sorted(issued.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    odd = sorted(r for _, rs in kinds[1:] for r in rs)
    return {"group": group, "seq": seq, "ranks": odd, "others": kinds[0][1],
            "issued": [{"op": o, "bytes": b, "ranks": rs} for (o, b), rs in kinds]}


def wait_for_graph(
    status: dict[int, dict[str, list[int]]], members: dict[str, tuple[int, ...]],
    gone: set[int] | frozenset[int] = frozenset(), *,
    finished: set[int] | frozenset[int] = frozenset(),
    inflight: dict[int, list[list[Any]]] | None = None,
    p2p: dict[int, list[list[Any]]] | None = None,
) -> dict[str, Any] | None:
    """Who waits for whom in a hung job, and who is at the end of each chain; pure, from plain
    data, shared by the hub (heartbeats) and the Flight Recorder dump analysis.

    Inputs, all by global rank:
    - `status[rank][group] = [last_issued_seq, last_completed_seq]`, each group the rank
      belongs to (a member without an entry issued nothing in that group);
    - `members[group]`: the group's global ranks (groups not listed are ignored);
    - `gone`: ranks whose process is gone (lost, or exited with an error);
    - `finished`: ranks that ended normally (they will issue nothing more);
    - `inflight[rank]`: collectives the rank issued and has not completed, as lists
      `[group, seq, op, issue_time, nbytes]` (the last two optional): names each op, and tells
      a desync (another op or size at the same sequence number);
    - `p2p[rank]`: the point-to-point ops in flight of a rank inside a P2P wait, as lists
      `[group, "send"|"recv", peer global rank, issue_time, nbytes]`.

    A living rank waits in group G when it issued more of G than it completed; it waits for
    the members of G that issued less than it did and for G's gone members, in collective
    #(first the laggards did not issue). A rank inside a P2P wait waits for its peers
    (`_p2p_wait`: recv(src) for src, send(dst) for dst unless dst has the matching recv in
    flight); that wait binds before its collectives' unless it waits for nobody, and its
    entry is {"group", "seq": None, "op": "send"|"recv", "peer", "t", "for"}. A P2P wait whose
    peers all issued their side is `stuck`. Following these edges from every waiting rank ends
    at ranks that wait for nobody: the culprits, each with a cause of `CAUSES` (`stuck`
    ranks are not counted as culprits). A rank that only waits for finished ranks is itself
    the end (`teardown`); ranks that only wait for each other are a `deadlock`.

    Returns None when no rank waits, else {"group", "seq" (the collective that names the
    first culprit), "culprits", "waiting" (the waiting ranks that are not culprits),
    "waits" {rank: {"group", "seq", "op", "t", "for"}}, "causes" {rank: {"cause", ...}},
    "chains" (paths from ranks nobody waits for to a culprit), "desync" (list)}."""
    inflight = inflight or {}
    p2p_rows = {r: rows for r, items in (p2p or {}).items() if (rows := _p2p_items(items))}
    gone, finished = set(gone), set(finished)
    waits: dict[int, dict[str, Any]] = {}
    laggards = _Laggards(status, members, gone, finished)
    for rank in sorted(set(status) | set(p2p_rows)):
        groups = status.get(rank, {})
        if rank in gone or rank in finished or not isinstance(groups, dict):
            continue
        found = _rank_waits(rank, groups, laggards, inflight)
        point = _p2p_wait(rank, p2p_rows)
        if point is not None:  # inside a P2P wait: it binds unless it waits for nobody
            found = sorted([point, *found], key=lambda w: not w["for"])
        if found:
            waits[rank] = found[0]
    if not waits:
        return None
    causes: dict[int, dict[str, Any]] = {}
    desyncs: list[dict[str, Any]] = []
    checked: dict[tuple[str, int], dict[str, Any] | None] = {}
    alive_of: dict[int, list[int]] = {}  # per list of awaited ranks (shared): the unfinished
    for rank, wait in sorted(waits.items()):
        awaited = alive_of.get(id(wait["for"]))
        seen = awaited is not None
        if awaited is None:
            awaited = alive_of[id(wait["for"])] = [r for r in wait["for"] if r not in finished]
        if wait["for"] and not awaited:
            causes[rank] = {"cause": "teardown", "for": wait["for"]}
        elif not wait["for"] and wait["seq"] is None:  # both sides issued the P2P op
            causes[rank] = {"cause": "stuck"}
        elif not wait["for"]:
            key = (wait["group"], wait["seq"])
            if key not in checked:
                checked[key] = _desync(*key, members[wait["group"]], inflight)
                if checked[key] is not None:
                    desyncs.append(checked[key])
                    for odd in checked[key]["ranks"]:
                        causes[odd] = {"cause": "desync", "group": key[0], "seq": key[1]}
            if checked[key] is None:
                causes[rank] = {"cause": "stuck"}
        for r in () if seen else awaited:
            if r in gone:
                causes[r] = {"cause": "gone"}
            elif r not in waits:
                causes[r] = {"cause": "python"}
    for rank in _cycles(waits, causes, finished):
        causes[rank] = {"cause": "deadlock", "for": waits[rank]["for"]}
    for desync in desyncs:  # ranks of the majority wait for the odd ones
        for other in desync["others"]:
            if other in waits and other not in causes:
                waits[other]["for"] = sorted(set(waits[other]["for"]) | set(desync["ranks"]))
    culprits = sorted(r for r, c in causes.items() if c["cause"] != "stuck")
    group, seq = _primary(waits, culprits)
    blamed = set(culprits)
    return {
        "group": group, "seq": seq, "culprits": culprits,
        "waiting": sorted(r for r in waits if r not in blamed),
        "waits": waits, "causes": causes, "desync": desyncs,
        "chains": _chains(waits, causes),
    }


def _cycles(waits: dict[int, dict[str, Any]], causes: dict[int, dict[str, Any]],
            finished: set[int]) -> list[int]:
    """Waiting ranks that reach no culprit: those on cycles of ranks waiting for each other
    (and those that only wait for them)."""
    ends = set(causes)
    reach: dict[int, bool] = dict.fromkeys(ends, True)
    changed = True
    while changed:  # a fixed point: at most one pass per link of the longest chain
        changed = False
        for rank, wait in waits.items():
            if not reach.get(rank) and any(reach.get(r) for r in wait["for"]
                                           if r not in finished):
                reach[rank] = changed = True
    stuck = {r for r in waits if not reach.get(r)}
    if not stuck:
        return []
    # peel the ranks nobody in `stuck` waits for: what remains lies on cycles
    remaining = set(stuck)
    while True:
        awaited = {r for rank in remaining for r in waits[rank]["for"]}
        peel = {r for r in remaining if r not in awaited}
        if not peel:
            return sorted(remaining)
        remaining -= peel


def _primary(waits: dict[int, dict[str, Any]], culprits: list[int]) -> tuple[Any, Any]:
    """The collective that names the first culprit: the one most ranks wait in directly for
    it (or that it waits in itself), larger groups first."""
    if not culprits:
        wait = waits[min(waits)]
        return wait["group"], wait["seq"]
    first = culprits[0]
    counts: dict[tuple[str, int | None], int] = {}
    has_first: dict[int, bool] = {}  # per shared list of awaited ranks
    for rank, wait in waits.items():
        key = id(wait["for"])
        if key not in has_first:
            has_first[key] = first in wait["for"]
        if has_first[key] or rank == first:
            key = (wait["group"], wait["seq"])
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        return None, None
    group, seq = min(counts, key=lambda k: (-counts[k], k[0], -1 if k[1] is None else k[1]))
    return group, seq


CHAINS_MAX = 32


def _chains(waits: dict[int, dict[str, Any]], causes: dict[int, dict[str, Any]]) -> list[list[int]]:
    """One path per rank nobody waits for, from it through the ranks it waits for (those that
    wait themselves first) to where the path ends (a culprit, or a rank met before), at most
    `CHAINS_MAX`."""
    lists = {id(w["for"]): w["for"] for w in waits.values()}  # shared: each once
    awaited = {r for ranks in lists.values() for r in ranks}
    roots = sorted(r for r in waits if r not in awaited)
    if not roots:  # every waiting rank is awaited: a cycle; start at the smallest rank
        roots = [min(waits)]
    chains = []
    for root in roots[:CHAINS_MAX]:
        path = [root]
        while path[-1] in waits and (path[-1] not in causes or len(path) == 1):
            nxt = waits[path[-1]]["for"]
            # the longest way: through ranks that wait themselves, then to a culprit
            step = next((r for r in nxt if r in waits and r not in causes and r not in path),
                        next((r for r in nxt if r in causes), nxt[0])) if nxt else None
            if step is None or step in path:
                break
            path.append(step)
        chains.append(path)
    return chains


def find_culprits(
    status: dict[int, dict[str, list[int]]], members: dict[str, tuple[int, ...]],
    gone: set[int], **options: Any,
) -> dict[str, Any] | None:
    """Who holds up whom, from each rank's last issued and completed collective per group
    (`status[rank][group] = [last_issued_seq, last_completed_seq]`): `wait_for_graph`
    (`options`: its `finished` and `inflight`). The culprits are the ranks at the ends of the
    wait-for chains, not every rank missing from some group; when every rank issued what it
    waits in (alike), there is none and the waiting ranks are all named. Returns
    {"group", "seq", "culprits", "waiting", ...} or None when no rank waits."""
    return wait_for_graph(status, members, gone, **options)
