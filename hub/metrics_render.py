"""The OpenMetrics text of a hub's state, made off the hub's loop.

Building the families and writing their text is pure Python (at 16,384 ranks, per rank,
seconds of it). In a thread it would hold the GIL against the loop's ingest; so the loop
forks (`ForkedRender`): the child is a copy of the state as it stood at that instant, with
nothing changing it, and renders every variant asked for, writes the metrics file, and sends
the texts back through a pipe, which a thread of the hub reads (the GIL free while it
waits). The loop pays only for the fork. Where `os.fork` does not exist, `ForkedRender`
renders in a thread instead.

The child runs only the calling thread's code: it disables the garbage collector (nothing of
the hub's, a ZeroMQ socket say, is finalized in it), logs nothing, touches no socket, and ends
with `os._exit`; an alarm ends a child that runs too long. It runs niced (`CHILD_NICE`): on a
node short of cores the hub's loop is served first.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest as text_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.utils import floatToGoString

from .metrics_families import Family, GaugeRows, family_parts

if TYPE_CHECKING:
    from scalemon.state.jobstate import JobState

CHILD_LIMIT_S = 300
"""A render child still running after this long is ended by its alarm."""
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


class ForkedRender:
    """One render in a forked child of the hub (`render`); `on_done(self)` is called from the
    reading thread once `result` or `error` is set."""

    def __init__(self, state: JobState, job: str, variants: list[Variant], now: float,
                 file: Path | None, on_done: Callable[[ForkedRender], None]) -> None:
        self.result: Rendered | None = None
        self.error: str | None = None
        self.done = threading.Event()
        self.killed = False
        self._on_done = on_done
        self.pid: int | None = None
        started = time.perf_counter()
        if not hasattr(os, "fork"):  # no fork here: a thread (it holds the GIL meanwhile)
            self.fork_s = 0.0
            threading.Thread(target=self._in_thread, args=(state, job, variants, now, file),
                             name="openmetrics-render", daemon=True).start()
            return
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(read)
            _child(write, state, job, variants, now, file)
        os.close(write)
        self.pid = pid
        self.fork_s = time.perf_counter() - started
        """How long the hub's loop stood still for this render."""
        threading.Thread(target=self._read, args=(read,), name="openmetrics-render",
                         daemon=True).start()

    def _in_thread(self, state: JobState, job: str, variants: list[Variant], now: float,
                   file: Path | None) -> None:
        try:
            self.result = render(state, job, variants, now, file)
        except Exception as exc:  # a bug here must not take the hub down
            self.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        self._finish()

    def _read(self, fd: int) -> None:
        chunks = []
        try:
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(fd)
        assert self.pid is not None
        _, status = os.waitpid(self.pid, 0)
        try:
            outcome = pickle.loads(b"".join(chunks)) if chunks else None
        except Exception as exc:  # a child killed mid-write
            outcome = ("error", f"unreadable reply ({type(exc).__name__})")
        if isinstance(outcome, Rendered):
            self.result = outcome
        elif outcome is not None:
            self.error = str(outcome[1])
        else:
            self.error = f"the render process ended without a reply ({_status_text(status)})"
        self._finish()

    def _finish(self) -> None:
        self.done.set()
        self._on_done(self)

    def kill(self) -> None:
        """End the child (the reading thread still reaps it)."""
        self.killed = True
        if self.pid is not None and not self.done.is_set():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _child(fd: int, state: JobState, job: str, variants: list[Variant], now: float,
           file: Path | None) -> None:
    """The forked child: render, send the outcome, exit without running anything of the
    hub's (atexit, finalizers)."""
    code = 0
    try:
        gc.disable()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
            signal.signal(sig, signal.SIG_DFL)
        signal.alarm(CHILD_LIMIT_S)
        with contextlib.suppress(OSError):
            os.nice(CHILD_NICE)
        try:
            reply: object = render(state, job, variants, now, file)
        except Exception as exc:
            reply = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        data = memoryview(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        while data:
            data = data[os.write(fd, data):]
    except BaseException:  # the hub gone (a broken pipe): nothing to tell
        code = 1
    finally:
        os._exit(code)


def _status_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"
