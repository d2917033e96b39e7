"""The OpenMetrics text of a hub's state, made off the hub's loop.

Building the families and writing their text is pure Python (at 16,384 ranks, per rank,
seconds of it). In a thread it would hold the GIL against the loop's ingest; so the loop
forks (`ForkedRender`): the child is a copy of the state as it stood at that instant, with
nothing changing it, and renders every variant asked for, writes the metrics file, and sends
the texts back through a pipe, which a thread of the hub reads (the GIL free while it
waits). The loop pays only for the fork. Where `os.fork` does not exist, `ForkedRender`
renders in a thread instead.

The child (hub/forked.py) runs niced (`CHILD_NICE`): on a node short of cores the hub's
loop is served first.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest as text_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.utils import floatToGoString

from .forked import ForkedCall
from .metrics_families import Family, GaugeRows, family_parts

if TYPE_CHECKING:
    from scalemon.state.jobstate import JobState

CHILD_NICE = 10
"""The render child's niceness over the hub's: where cores are short, the loop comes first."""


@dataclass(frozen=True)
class Variant:
    """What one scrape asks for: the per-rank series too, and the OpenMetrics format (else
    Prometheus's text format 0.0.4)."""

    per_rank: bool = False
    openmetrics: bool = False


@dataclass
class Rendered:
    """The texts of one render, and what it cost."""

    texts: dict[Variant, bytes]
    file_error: str | None = None
    """Why the metrics file could not be written (None: written, or not asked)."""
    seconds: float = 0.0
    """The render's own time (the child's, when forked)."""


class _Families:
    """What `generate_latest` reads: a fixed list of families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def render(state: JobState, job: str, variants: Iterable[Variant], now: float,
           file: Path | None = None) -> Rendered:
    """Every variant's text of `state`, the families built once; with `file`, the first
    variant's text written to it."""
    started = time.perf_counter()
    wanted = list(dict.fromkeys(variants))
    shared, rank_only = family_parts(state, job, now, any(v.per_rank for v in wanted))
    texts = {}
    for variant in wanted:
        texts[variant] = exposition(shared + rank_only if variant.per_rank else shared,
                                    variant.openmetrics)
    error = None
    if file is not None and wanted:
        error = write_file(file, texts[wanted[0]])
    return Rendered(texts, error, time.perf_counter() - started)


def exposition(families: list[Family], openmetrics: bool = False) -> bytes:
    """The text of `families`: `prometheus_client` writes the `Metric`s, `_gauge_text` the
    `GaugeRows` (the same lines, without an object per sample)."""
    metrics = [f for f in families if not isinstance(f, GaugeRows)]
    write = openmetrics_latest if openmetrics else text_latest
    head = write(_Families(metrics))  # type: ignore[arg-type]
    eof = b"# EOF\n"
    if openmetrics:
        assert head.endswith(eof)
        head = head[:-len(eof)]
    label_texts: dict[tuple[tuple[str, ...], tuple[str, ...]], str] = {}
    rows = "".join(_gauge_text(f, openmetrics, label_texts) for f in families
                   if isinstance(f, GaugeRows))
    return head + rows.encode() + (eof if openmetrics else b"")


def _escape(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _gauge_text(family: GaugeRows, openmetrics: bool,
                label_texts: dict[tuple[tuple[str, ...], tuple[str, ...]], str]) -> str:
    """A gauge family's lines as `prometheus_client` writes them (labels sorted by name; in
    the text format 0.0.4 a HELP line escapes no quote); `label_texts` keeps each label set's
    text for the next families."""
    doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
    if openmetrics:
        doc = doc.replace('"', r'\"')
    order = sorted(range(len(family.labelnames)), key=lambda i: family.labelnames[i])
    names = [family.labelnames[i] for i in order]
    lines = [f"# HELP {family.name} {doc}\n# TYPE {family.name} gauge\n"]
    for labels, value in family.rows:
        key = (family.labelnames, labels)
        text = label_texts.get(key)
        if text is None:
            text = label_texts[key] = "{" + ",".join(
                f'{name}="{_escape(labels[i])}"' for name, i in zip(names, order, strict=True)
            ) + "} "
        lines.append(f"{family.name}{text}{floatToGoString(value)}\n")
    return "".join(lines)


def temporary_file(path: Path, pid: int) -> Path:
    """Where process `pid` writes `path`'s next text before renaming it over `path`."""
    return path.with_name(f".{path.name}.{pid}.tmp")


def write_file(path: Path, text: bytes) -> str | None:
    """`text` into `path` atomically (a temporary in the same directory, renamed); the error
    in words when it could not."""
    tmp = temporary_file(path, os.getpid())
    try:
        tmp.write_bytes(text)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return f"{type(exc).__name__}: {exc}"
    return None


class ForkedRender(ForkedCall):
    """One render in a forked child of the hub (`render`, niced); `on_done(self)` is called
    from the reading thread once `result` (a `Rendered`) or `error` is set."""

    def __init__(self, state: JobState, job: str, variants: list[Variant], now: float,
                 file: Path | None, on_done: Callable[[ForkedRender], None]) -> None:
        super().__init__(lambda: render(state, job, variants, now, file), on_done,
                         "openmetrics-render", nice=CHILD_NICE)
