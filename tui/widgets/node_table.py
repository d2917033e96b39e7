"""`NodeTable`: one row per node (host) of a big job (a `LineTable`), trouble first.

Two heading lines: each metric's heading over its sub-columns (min, med, max, or only the
node's worst value), then the sub-columns. The cursor stays on its node when the rows are
reordered. Enter or a click on the highlighted row posts `NodeTable.Selected` (that node's
ranks); `n` (the screen's binding, shown here) goes back to a row per rank.
"""

from __future__ import annotations

from textual.binding import Binding
from textual.message import Message

from scalemon.text.display import NO_HOST

from ..views.nodes import NODE_COLUMNS, NodeRow
from .line_table import PAD, LineTable


class NodeTable(LineTable["str | None"]):
    """The per-node table of the overview."""

    BINDINGS = [Binding("enter", "select", "Node's ranks"),
                Binding("n", "screen.toggle_nodes", "Per rank")]
    COMPONENT_CLASSES = {"nodetable--header", "nodetable--cursor"}
    HEADER, CURSOR = "nodetable--header", "nodetable--cursor"
    FOLLOW = True
    DEFAULT_CSS = """
    NodeTable { height: auto; max-height: 45%; }
    NodeTable > .nodetable--header { text-style: bold; background: $panel; }
    NodeTable > .nodetable--cursor { background: $block-cursor-background;
                                     color: $block-cursor-foreground; }
    """

    class Selected(Message):
        """Enter or click on a node's row: show its ranks."""

        def __init__(self, host: str | None) -> None:
            super().__init__()
            self.host = host

    class Scrolled(LineTable.Scrolled):
        """The visible rows changed."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(NODE_COLUMNS, id=id)

    def header_texts(self) -> list[str]:
        """Metric headings centred over their sub-columns, then the sub-columns."""
        groups = []
        i = 0
        while i < len(self.columns):
            j = i
            group = self.columns[i].group
            while group and j + 1 < len(self.columns) and self.columns[j + 1].group == group:
                j += 1
            span = sum(self.columns[k].width + 2 * PAD for k in range(i, j + 1))
            if not group:
                groups.append(" " * span)
            elif span >= len(group) + 6:  # "─ step ms ─" over the sub-columns
                groups.append(" " + f" {group} ".center(span - 2, "─") + " ")
            else:
                groups.append(group[:span].center(span))
            i = j + 1
        return ["".join(groups), *super().header_texts()]

    def visible(self) -> tuple[int, int]:
        """(start, stop) positions of the rows on screen: the rows the table has room for
        once laid out (a node row costs more to build than a rank's)."""
        top = self.scroll_offset.y
        return top, top + (self.size.height or self.app.size.height)

    def on_resize(self) -> None:
        """A new height may hide the cursor row or show rows not built yet."""
        super().on_resize()
        self.post_message(self.Scrolled())

    def placeholder(self, key: str | None) -> tuple[str, ...]:
        """The node's name, the rest blank until the next redraw."""
        return (key or NO_HOST,) + ("",) * (len(self.columns) - 1)

    def show_nodes(self, hosts: list[str | None], rows: list[NodeRow]) -> int:
        """Show every node of `hosts` in that order, with new text for `rows`."""
        return self.show_keys(hosts, {row.host: row for row in rows})

    def selected(self, key: str | None) -> None:
        """Show the node's ranks."""
        self.post_message(self.Selected(key))
