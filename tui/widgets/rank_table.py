"""`RankTable`: one row per rank (a `LineTable`).

Only the visible rows are drawn, each from a strip cached until that rank's cells change, so a
redraw of a 512-rank table costs about as much as one of 8 ranks. The header row stays at the
top and the rank column stays at the left while the rest scrolls. Up/down/PgUp/PgDn/Home/End
move the cursor, left/right scroll sideways, Enter or a click on the highlighted row (or a
double click) posts `RankTable.Selected`. Grouped by a mesh axis, a heading row (a negative
key) stands over each coordinate's ranks; it selects nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from textual.binding import Binding
from textual.message import Message

from scalemon.text.display import Column

from ..views.rows import COLUMNS, Row
from .line_table import LineTable


class RankTable(LineTable[int]):
    """The per-rank table of the overview (and of a node's ranks)."""

    BINDINGS = [Binding("enter", "select", "Rank detail")]
    COMPONENT_CLASSES = {"ranktable--header", "ranktable--cursor"}
    HEADER, CURSOR = "ranktable--header", "ranktable--cursor"
    DEFAULT_CSS = """
    RankTable { height: auto; max-height: 45%; }
    RankTable > .ranktable--header { text-style: bold; background: $panel; }
    RankTable > .ranktable--cursor { background: $block-cursor-background;
                                     color: $block-cursor-foreground; }
    """

    class Selected(Message):
        """Enter or click on a rank's row."""

        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank

    class Scrolled(LineTable.Scrolled):
        """The visible rows changed."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(COLUMNS, id=id)

    @property
    def rank_ids(self) -> list[int]:
        """Every rank shown, in order (not the headings of a grouped table)."""
        return [k for k in self.keys if k >= 0]

    def show_rows(self, rank_ids: list[int], rows: list[Row],
                  columns: tuple[Column, ...] | None = None) -> int:
        """Show every rank of `rank_ids` (and heading, negative keys), with new text for
        `rows`, in `columns` when given (the mesh column comes and goes); returns rows
        changed."""
        if columns is not None:
            self.set_columns(columns)
        return self.show_keys(rank_ids, {row.rank: row for row in rows})

    def cells_by_rank(self, keys: Sequence[str] | None = None) -> dict[int, tuple[str, ...]]:
        """The table as text (tests); with `keys`, each row's cells in the order of those
        column keys ("" for a column the table does not show now)."""
        if keys is None:
            return {rank: row.cells for rank, row in self.rows.items()}
        at = {c.key: i for i, c in enumerate(self.columns)}
        return {rank: tuple(row.cells[at[k]] if k in at else "" for k in keys)
                for rank, row in self.rows.items() if rank >= 0}

    def rank_at_cursor(self) -> int | None:
        """The rank of the highlighted row (None on a heading)."""
        key = self.key_at_cursor()
        return key if key is not None and key >= 0 else None

    def selected(self, key: int) -> None:
        """Open the rank (a heading opens nothing)."""
        if key >= 0:
            self.post_message(self.Selected(key))
