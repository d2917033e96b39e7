"""Layouts that fit the terminal: `Fit` draws the first of several renderables that fits the
width it is drawn at (a wide table, then a narrower one, then wrapped text), so a table is
never drawn with its headings or cells cut to "…" when a narrower layout of the same
information exists; `KeysFooter` shows the keys that fit whole, never one cut mid-word."""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.measure import Measurement
from rich.text import Text
from textual.events import Resize
from textual.widgets import Footer
from textual.widgets._footer import FooterKey

PALETTE = "-command-palette"
"""The class of the footer's command palette key (docked right)."""


WIDE = 1 << 16
"""A width nothing is as wide as: a renderable measured at it shows its natural width."""


class Fit:
    """The first of `choices` that fits the width it is drawn at; the last one when none
    does (make that one wrap). A choice is a renderable, which fits where its natural width
    (as measured: a table whose columns do not wrap) does, or (needed width, renderable)."""

    def __init__(self, *choices: RenderableType | tuple[int, RenderableType]) -> None:
        if not choices:
            raise ValueError("Fit needs at least one renderable")
        self.choices = choices

    def pick(self, console: Console, width: int) -> RenderableType:
        """The renderable drawn at `width` cells."""
        renderable: RenderableType = ""
        for choice in self.choices:
            if isinstance(choice, tuple):
                need, renderable = choice
            else:
                renderable = choice
                need = Measurement.get(console, console.options.update_width(WIDE),
                                       renderable).maximum
            if need <= width:
                return renderable
        return renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.pick(console, options.max_width)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.pick(console, options.max_width))


def cells_width(widths: Iterable[int], gap: int, edge: int = 0) -> int:
    """The width of a row of columns `widths` wide, `gap` cells apart, with `edge` cells on
    each side."""
    widths = list(widths)
    return sum(widths) + gap * max(0, len(widths) - 1) + 2 * edge


def longest_word(texts: Iterable[str | Text]) -> int:
    """The longest word of `texts`: the narrowest a wrapping column can be without cutting
    a word."""
    return max((len(w) for t in texts for w in str(t).split()), default=0)


def widest(texts: Iterable[str | Text]) -> int:
    """The widest line of `texts`: how wide a column that does not wrap is."""
    return max((Text(line).cell_len for t in texts for line in str(t).split("\n")), default=0)


class KeysFooter(Footer):
    """Textual's footer, compact, showing the keys from the first while they fit whole beside
    the command palette's key; the others are hidden (? lists every key)."""

    DEFAULT_CSS = """
    KeysFooter { padding-left: 1; }
    KeysFooter.-compact FooterKey { margin-right: 2; }
    KeysFooter.-compact FooterKey.-command-palette { margin-right: 0; padding-right: 1; }
    """

    def __init__(self) -> None:
        super().__init__(compact=True)
        self._composed: tuple | None = None  # what the keys shown were composed from

    async def recompose(self) -> None:
        """The keys changed: show those that fit. Textual recomposes the footer at every
        change of focus or screen even when the keys stay the same (five times as the
        dashboard starts: its first paint took 108-155 ms headless at 8 ranks with every
        one, 49-91 ms without): then only the fit is redone."""
        shown = self._keys_shown()
        if shown is None or shown != self._composed:
            await super().recompose()
            self._composed = shown
        self.fit_keys()

    def _keys_shown(self) -> tuple | None:
        """What `Footer.compose` draws from (its bindings, enabled and tooltips, and the
        palette's key), or None before it draws any."""
        if not getattr(self, "_bindings_ready", True) or not self.is_attached:
            return None
        return (self.show_command_palette, self.compact,
                *((binding, enabled, tooltip)
                  for _, binding, enabled, tooltip in self.screen.active_bindings.values()))

    def on_resize(self, event: Resize) -> None:
        """A new width: show those that fit now."""
        self.fit_keys()

    def fit_keys(self) -> None:
        """Hide every key from the first that would be cut by the right edge on."""
        keys = list(self.query_children(FooterKey))
        palette = [k for k in keys if k.has_class(PALETTE)]
        # the palette's key has a border on its left
        room = self.content_size.width - sum(k.render().cell_len + k.styles.padding.right + 1
                                             for k in palette)
        used, fits = 0, True
        for key in keys:
            if key.has_class(PALETTE):
                continue
            width = key.render().cell_len
            fits = fits and used + width < room  # a blank before the palette's key
            used += width + key.styles.margin.right
            key.display = fits
