"""Every rank's collectives of a set of Flight Recorder dumps by group and sequence number: what
the mismatch rule (`mismatches`) and a report's ops (`op_at`, `op_of`) need from the rings,
without an object per entry.

Per (group, seq) the table keeps each distinct shape of what ranks issued there (a `Cell`: op,
dtypes, sizes) with the ranks that issued it, as compact arrays: thousands of ranks that issued
the same all_reduce share one cell. Tables of parts of the ranks (read in other processes)
merge into one.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from typing import Any

from scalemon.reports.frread import Cell, RankDump

SIZES_VARY = {"all_to_all", "alltoall", "alltoall_base", "all_to_all_single", "gather",
              "scatter", "coalesced", "send", "recv"}
"""Ops whose tensors may differ between ranks by design: only their op is compared."""
_FIELDS = ("op", "dtypes", "sizes")


_INT64 = (-(1 << 63), 1 << 63)
"""The ranks an array of the table holds (a list holds any other: any digits in a file name
are a rank)."""


def _extend(ranks: Any, more: Iterable[int]) -> Any:
    """`ranks` with `more` appended (made a list where an array cannot hold them)."""
    more = list(more)
    had = len(ranks)
    try:
        ranks.extend(more)
        return ranks
    except OverflowError:  # an array: what it took before the one it cannot hold, undone
        del ranks[had:]
        return [*ranks, *more]


class SeqTable:
    """group -> seq -> {cell: ranks that issued it}."""

    def __init__(self) -> None:
        self.groups: dict[str, dict[int, dict[Cell, Any]]] = {}
        self._cells: dict[Cell, Cell] = {}  # one object per distinct cell
        self._owners: dict[tuple[str, int], dict[int, str]] = {}

    @classmethod
    def of(cls, dumps: Mapping[int, RankDump]) -> SeqTable:
        """The table of ranks' dumps that still hold their cells (not `compact`ed)."""
        table = cls()
        for rank, dump in dumps.items():
            table.add(rank, dump.cells)
        return table

    def add(self, rank: int, cells: Mapping[tuple[str, int], Cell]) -> None:
        """Take one rank's cells in (`RankDump.compact()`)."""
        if not _INT64[0] <= rank < _INT64[1]:
            self._add_any(rank, cells)
            return
        interned, groups = self._cells, self.groups
        for (group, seq), cell in cells.items():
            cell = interned.setdefault(cell, cell)
            seqs = groups.get(group)
            if seqs is None:
                seqs = groups[group] = {}
            by_cell = seqs.get(seq)
            if by_cell is None:
                seqs[seq] = {cell: array("q", (rank,))}
                continue
            ranks = by_cell.get(cell)
            if ranks is None:
                by_cell[cell] = array("q", (rank,))
            else:
                ranks.append(rank)

    def _add_any(self, rank: int, cells: Mapping[tuple[str, int], Cell]) -> None:
        for (group, seq), cell in cells.items():
            by_cell = self.groups.setdefault(group, {}).setdefault(seq, {})
            cell = self._cells.setdefault(cell, cell)
            by_cell[cell] = _extend(by_cell[cell], (rank,)) if cell in by_cell else [rank]

    def merge(self, other: SeqTable) -> None:
        """Take another table's ranks in (read apart: no rank in both)."""
        interned = self._cells
        for group, seqs in other.groups.items():
            mine = self.groups.get(group)
            if mine is None:
                mine = self.groups[group] = {}
            for seq, by_cell in seqs.items():
                have = mine.get(seq)
                if have is None:
                    have = mine[seq] = {}
                for cell, ranks in by_cell.items():
                    cell = interned.setdefault(cell, cell)
                    old = have.get(cell)
                    have[cell] = ranks if old is None else _extend(old, ranks)

    def _owner(self, group: str, seq: int) -> dict[int, str]:
        """rank -> the op of its last collective at (group, seq) (built once per cell)."""
        key = (group, seq)
        owner = self._owners.get(key)
        if owner is None:
            by_cell = self.groups.get(group, {}).get(seq) or {}
            owner = self._owners[key] = {r: cell[-1].op for cell, ranks in by_cell.items()
                                         for r in ranks}
        return owner

    def op_at(self, group: str, seq: int, rank: int) -> str | None:
        """The op of `rank`'s collective `seq` of `group`, if its ring still holds it."""
        return self._owner(group, seq).get(rank)

    def op_of(self, group: str, seq: int, order: Iterable[int]) -> str | None:
        """The op of collective `seq` of `group` as the first rank of `order` whose ring holds
        it says (a rank with an empty op name skipped)."""
        by_cell = self.groups.get(group, {}).get(seq)
        if not by_cell:
            return None
        ops = {cell[-1].op for cell in by_cell}
        if len(ops) == 1:  # they agree: any rank that holds it says so
            return ops.pop() or None
        owner = self._owner(group, seq)
        for rank in order:
            op = owner.get(rank)
            if op:
                return op
        return None

    def mismatches(self, group: str, limit: int) -> dict[str, Any]:
        """Collectives of `group` that differ between ranks at the same sequence number: the
        op, else the dtypes, else the sizes (only the op for ops whose tensors may differ):
        {"count", "first": the first `limit`, each {"seq", "field", "by_rank"}}."""
        found = 0
        first = []
        seqs = self.groups.get(group) or {}
        for seq in sorted(seqs):
            by_cell = seqs[seq]
            if len(by_cell) < 2:  # every rank that holds it issued the same
                continue
            what = _differs(by_cell)
            if what is None:
                continue
            found += 1
            if len(first) < limit:
                rows = sorted(((r, cell) for cell, ranks in by_cell.items() for r in ranks),
                              key=lambda row: row[0])
                first.append({"seq": seq, "field": what, "by_rank": {
                    str(r): "; ".join(s.signature for s in cell) for r, cell in rows}})
        return {"count": found, "first": first}


def _differs(by_cell: dict[Cell, Any]) -> str | None:
    """Which field differs between the cells: "op", else "dtypes" or "sizes" (not compared
    where an op's tensors may differ by design), else None."""
    for name in _FIELDS:
        if name != "op" and any(s.op in SIZES_VARY for cell in by_cell for s in cell):
            return None
        if len({tuple(getattr(s, name) for s in cell) for cell in by_cell}) > 1:
            return name
    return None
