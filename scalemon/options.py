"""What every `scalemon` command's parser shares: the help layout (descriptions as written,
defaults shown) and checks of option values that fail with argparse's exit status 2."""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from scalemon.protocol import check_job_id


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                    argparse.RawDescriptionHelpFormatter):
    """Descriptions wrapped to the terminal, epilogs (text with line breaks) as written;
    `(default: X)` after each option that has a default worth saying (not None, not False)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return argparse.RawDescriptionHelpFormatter._fill_text(self, text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        text = action.help or ""
        if (default is None or default is False or default is argparse.SUPPRESS
                or "%(default)" in text
                or not (action.option_strings or action.nargs in ("?", "*"))):
            return action.help
        shown = format(default, "g") if isinstance(default, float) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def did_you_mean(word: str, choices: Iterable[str], cutoff: float = 0.6,
                 fold: Callable[[str], str] | None = None) -> str:
    """" (did you mean NAME?)" naming the choice closest to a mistyped `word` (both compared
    after `fold`, e.g. `str.upper`, where given); "" when none is closer than `cutoff`. One
    wording for options, commands, flags and job ids."""
    by_key = {(fold(c) if fold else c): c for c in choices}
    close = difflib.get_close_matches(fold(word) if fold else word, by_key, n=1, cutoff=cutoff)
    return f" (did you mean {by_key[close[0]]}?)" if close else ""


def unrecognized_text(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's "unrecognized arguments: ..." with the closest option of `parser` for each
    unknown one ("--restrat (did you mean --restart?)")."""
    known = [s for action in parser._actions for s in action.option_strings]
    words = []
    for word in extras:
        name = word.split("=", 1)[0]
        words.append(word + (did_you_mean(name, known) if name.startswith("-") else ""))
    return "unrecognized arguments: " + " ".join(words)


class _Commands(argparse._SubParsersAction):
    """Subcommands whose `--help` has a description: their one-line help, when they do not
    bring their own; no abbreviated options; an unknown option is the subcommand's error
    (its usage, the closest option), not the top-level parser's."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        text = kwargs.get("help")
        if kwargs.get("description") is None and text:
            kwargs["description"] = text[0].upper() + text[1:] + "."
        kwargs.setdefault("allow_abbrev", False)
        return super().add_parser(name, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        extras = getattr(namespace, argparse._UNRECOGNIZED_ARGS_ATTR, None)
        chosen = self._name_parser_map.get(values[0])
        if extras and chosen is not None:
            chosen.error(unrecognized_text(chosen, extras))


class Parser(argparse.ArgumentParser):
    """An ArgumentParser with scalemon's help layout, for itself and its subcommands; an
    option is never taken for another that it abbreviates (`--rank` is not `--ranks`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Commands)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """As argparse's, with the closest choice named: `scalemon snapsht` is "invalid
        choice: 'snapsht' (did you mean snapshot?)", then the choices."""
        choices = action.choices
        if choices is None or value in choices or not isinstance(value, str):
            return super()._check_value(action, value)
        names = [str(c) for c in choices]
        hint = did_you_mean(value, names)
        raise argparse.ArgumentError(action, f"invalid choice: {value!r}{hint} (choose from "
                                             f"{', '.join(map(repr, names))})")

    def parse_args(self, args: Any = None,  # type: ignore[override]
                   namespace: Any = None) -> argparse.Namespace:
        """As argparse's, with the closest option named for each unknown one."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unrecognized_text(self, extras))
        return parsed


def int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse `type`: an integer in low..high."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            within = f"from {low} to {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {within}, not {value}")
        return value

    parse.__name__ = "int"
    return parse


def number(low: float = 0.0, *, above: bool = False, unit: str = "") -> Callable[[str], float]:
    """An argparse `type`: a finite number, at least `low` (more than it when `above`), in
    `unit` when given ("seconds")."""
    of_unit = f" {unit}" if unit else ""
    bound = f"more than {low:g}{of_unit}" if above else f"{low:g}{of_unit} or more"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            what = f"a number of {unit}" if unit else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(value) or value < low or (above and value == low):
            raise argparse.ArgumentTypeError(f"must be {bound}, not {text}")
        return value

    parse.__name__ = unit or "number"
    return parse


def seconds(low: float = 0.0, *, above: bool = False) -> Callable[[str], float]:
    """An argparse `type`: a finite number of seconds, at least `low` (more than it when
    `above`)."""
    return number(low, above=above, unit="seconds")


def add_hub_timeout(parser: argparse.ArgumentParser) -> None:
    """`--timeout S`: how long a command waits for the hub's answer."""
    parser.add_argument("--timeout", type=seconds(0.0, above=True), default=5.0, metavar="S",
                        help="seconds to wait for the hub")


def add_query_arguments(parser: argparse.ArgumentParser) -> None:
    """`[TARGET] [--json] [--timeout S]` of the commands that ask a job's hub for its state."""
    parser.add_argument("target", nargs="?",
                        help="job id or hub address (default: the live job)")
    parser.add_argument("--json", action="store_true", help="machine-readable JSON")
    add_hub_timeout(parser)


def job_id(text: str) -> str:
    """An argparse `type`: a job id that is safe in file names."""
    try:
        return check_job_id(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class LazyChoices(Sequence[str]):
    """`choices` read when first needed (a check, a help text), so a table that is slow to
    import (the trainer's presets need torch) costs nothing to the other commands."""

    def __init__(self, load: Callable[[], Sequence[str]]) -> None:
        self._load = load
        self._names: list[str] | None = None

    def _all(self) -> list[str]:
        if self._names is None:
            self._names = list(self._load())
        return self._names

    def __getitem__(self, index: Any) -> Any:
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __contains__(self, value: object) -> bool:
        return value in self._all()
