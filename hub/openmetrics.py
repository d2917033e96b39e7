"""OpenMetrics export of a hub's job state: `/metrics` over HTTP and/or a textfile for
node_exporter, in the Prometheus text format made by `prometheus_client`.

`scalemon hub --metrics HOST:PORT` (or `$SCALEMON_METRICS`) serves `/metrics`;
`--metrics-file PATH` (or `$SCALEMON_METRICS_FILE`) writes the same text every few seconds,
atomically (a temporary file in the same directory, renamed over the old one).

Cardinality: by default the per-node and job aggregates of every per-rank gauge
(`hub/metrics_families.py`); the series of every rank as well with
`$SCALEMON_METRICS_PER_RANK=1`, or for one scrape with `/metrics?ranks=all`.

Off the loop: the hub's loop only starts a render (`update`: a fork, `hub/metrics_render.py`)
at most every `SNAPSHOT_S` seconds (less often where renders take long); the child builds the
texts from its copy of the state and writes the file; the HTTP server's threads hand out the
latest texts as bytes, never touching the state, so a scrape costs the loop nothing. A variant
no render has made yet (`?ranks=all`, the OpenMetrics format) is asked of the next render, and
its scrape waits for it (its own thread only).
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import socketserver
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_TYPE

from scalemon import settings

from . import METRICS_ENV, METRICS_FILE_ENV
from .metrics_families import RANK_GAUGES, families
from .metrics_render import ForkedRender, Rendered, Variant, render, temporary_file

if TYPE_CHECKING:
    from scalemon.state.jobstate import JobState

__all__ = ["RANK_GAUGES", "Exporter", "families", "parse_address", "start_exporter"]

log = logging.getLogger("scalemon.hub")

SNAPSHOT_S = 1.0
"""A render starts at most this often..."""
FORK_SHARE = 0.05
"""...and less often where the fork stands the hub's loop still for long, so that it takes at
most this share of the loop's time..."""
RENDER_SHARE = 0.5
"""...or where the render itself is long: the renders use at most this share of a core."""
FILE_EVERY_S = 5.0
"""The metrics file is rewritten this often."""
WANTED_S = 600.0
"""A variant a scrape asked for is rendered until no scrape asked for it this long."""
WAIT_S = 30.0
"""The longest a scrape waits for a variant not rendered yet (then: 503)."""
LOOPBACK = "127.0.0.1"
_WILDCARDS = ("", "*", "0.0.0.0", "::")
_T = TypeVar("_T")


class MetricsAddressError(ValueError):
    """A --metrics / $SCALEMON_METRICS value that is not [HOST]:PORT."""


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `[IPv6]:PORT`, `:PORT` or `PORT` -> (host, port); no host: 127.0.0.1.
    Raises MetricsAddressError saying what is expected."""
    value = text.strip()
    if value.startswith("http://"):
        value = value[len("http://"):].split("/", 1)[0]
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "", value
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port.isdigit() or int(port) > 65535:
        raise MetricsAddressError(
            f"metrics address {text!r}: expected HOST:PORT, :PORT (127.0.0.1) or PORT, with a "
            "port of 0 (any free port) to 65535, e.g. 127.0.0.1:9464")
    return (host or LOOPBACK), int(port)


def _per_rank_setting() -> bool:
    """$SCALEMON_METRICS_PER_RANK: "1" on, unset or "0" off; another value is logged (off)."""
    value = settings.raw("SCALEMON_METRICS_PER_RANK")
    if value not in (None, "0", "1"):
        log.error("$SCALEMON_METRICS_PER_RANK=%r: expected 0 or 1; exporting the per-node and "
                  "job aggregates only (a scrape of /metrics?ranks=all has every rank)", value)
    return value == "1"


class Exporter:
    """The export of one hub: an HTTP server (`url`) and/or a file, fed by `update`."""

    def __init__(self, job: str, address: tuple[str, int] | None = None,
                 path: Path | None = None, per_rank: bool | None = None) -> None:
        """Start the HTTP server at `address` (port 0: any free one); raises OSError when it
        cannot bind. The file at `path` is written from the first `update` on. `per_rank`
        (default: `$SCALEMON_METRICS_PER_RANK`): every scrape gets the per-rank series."""
        self.job = job
        self.path = path
        self.per_rank = _per_rank_setting() if per_rank is None else per_rank
        self.default = Variant(per_rank=self.per_rank)
        self.url: str | None = None
        self._server: WSGIServer | None = None
        self._lock = threading.Condition()
        self._texts: dict[Variant, bytes] = {}  # the latest render's, replaced whole
        self._gzipped: dict[Variant, bytes] = {}
        self._wanted: dict[Variant, float] = {}  # variant -> when a scrape last asked
        self._render: ForkedRender | None = None
        self._next_render = -math.inf
        self._written = -math.inf
        self._file_every = FILE_EVERY_S
        self._file_error: str | None = None
        self.renders = 0
        self.fork_s: list[float] = []
        """How long each render stood the hub's loop still (the last 100)."""
        if address is not None:
            host, port = address
            self._server = _serve(self._app, "0.0.0.0" if host == "*" else host, port)
            bound = self._server.server_address[1]
            self.url = f"http://{_url_host(host)}:{bound}/metrics"

    def update(self, state: JobState, now: float, force: bool = False) -> None:
        """From the hub's loop (`now`: monotonic): start a render when one is due (every
        SNAPSHOT_S or longer) or a scrape waits for a variant, unless one runs. `force`
        renders here and now, the file included (start-up, shutdown). Never raises."""
        if force:
            running = self._render
            if running is not None:  # an older state must not overwrite this one's file
                self._end(running)
            try:
                self._take(render(state, self.job, self._variants(now), time.time(),
                                  self.path))
            except Exception:  # a bug here must not take the hub down
                log.exception("could not build the OpenMetrics text")
            self._written = now
            return
        if self._render is not None or (now < self._next_render and not self._missing()):
            return
        file = None
        if self.path is not None and now - self._written >= self._file_every:
            file, self._written = self.path, now
        try:
            self._render = ForkedRender(state, self.job, self._variants(now), time.time(),
                                        file, self._rendered)
        except OSError as exc:  # no fork (out of memory, process limit): try again later
            log.error("could not start the OpenMetrics render: %s", exc)
            self._next_render = now + max(SNAPSHOT_S, FILE_EVERY_S)
            return
        self.renders += 1
        self.fork_s = [*self.fork_s[-99:], self._render.fork_s]
        self._next_render = now + max(SNAPSHOT_S, self._render.fork_s / FORK_SHARE)

    def _end(self, running: ForkedRender) -> None:
        """End a render, and remove the temporary file it may have been writing."""
        running.kill()
        running.done.wait(10)
        if self.path is not None and running.pid is not None:
            with contextlib.suppress(OSError):
                temporary_file(self.path, running.pid).unlink()

    def _variants(self, now: float) -> list[Variant]:
        """The default variant first (the file's), then those scrapes asked for lately."""
        with self._lock:
            for variant, asked in list(self._wanted.items()):
                if now - asked > WANTED_S:
                    del self._wanted[variant]
            return list(dict.fromkeys([self.default, *self._wanted]))

    def _missing(self) -> bool:
        with self._lock:
            return any(v not in self._texts for v in self._wanted)

    def _rendered(self, job: ForkedRender) -> None:
        """From the reading thread: the render ended; its texts replace the last ones."""
        if job.result is not None:
            self._take(job.result)
            seconds = job.result.seconds
            self._next_render = max(self._next_render, time.monotonic() - seconds
                                    + seconds / RENDER_SHARE)
        elif not job.killed:
            log.error("could not build the OpenMetrics text: %s", job.error)
        self._render = None

    def _take(self, result: Rendered) -> None:
        with self._lock:
            self._texts, self._gzipped = result.texts, {}
            self._lock.notify_all()
        if self.path is None or self.default not in result.texts:
            return
        error = result.file_error
        if error is not None and error != self._file_error:  # said once, not every 5 s
            log.error("could not write the metrics file %s: %s (retrying every %.0f s)",
                      self.path, error, FILE_EVERY_S)
        elif error is None and self._file_error is not None:
            log.info("metrics file %s written again", self.path)
        self._file_error = error

    def text(self, variant: Variant | None = None, wait_s: float = WAIT_S) -> bytes | None:
        """The latest text of `variant` (default: what `/metrics` serves); one not rendered
        yet is asked of the next render, and waited for up to `wait_s` (None: not in time)."""
        variant = self.default if variant is None else variant
        deadline = time.monotonic() + wait_s
        with self._lock:
            if variant != self.default:
                self._wanted[variant] = time.monotonic()
            while variant not in self._texts:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._lock.wait(left)
            return self._texts[variant]

    def _gzip(self, variant: Variant, text: bytes) -> bytes:
        """`text` gzipped (zlib lets the GIL go meanwhile), kept until the next render."""
        with self._lock:
            done = self._gzipped.get(variant)
            if done is not None and self._texts.get(variant) is text:
                return done
        packed = zlib.compress(text, 1, wbits=31)
        with self._lock:
            if self._texts.get(variant) is text:
                self._gzipped[variant] = packed
        return packed

    def _app(self, environ: dict[str, Any],
             start_response: Callable[..., Any]) -> Iterable[bytes]:
        """The WSGI application: `/metrics[?ranks=all]`, in the format the Accept header
        asks for, gzipped when the client takes it."""
        if environ.get("PATH_INFO") == "/favicon.ico":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b""]
        query = parse_qs(environ.get("QUERY_STRING", ""))
        ranks = query.get("ranks", [])
        if any(value != "all" for value in ranks):
            start_response("400 Bad Request", [("Content-Type", "text/plain")])
            return [b"ranks: expected ranks=all (every rank's series) or no ranks parameter "
                    b"(the per-node and job aggregates)\n"]
        accept = environ.get("HTTP_ACCEPT", "")
        openmetrics = any(part.split(";")[0].strip() == "application/openmetrics-text"
                          for part in accept.split(","))
        variant = Variant(per_rank=self.per_rank or bool(ranks), openmetrics=openmetrics)
        text = self.text(variant)
        if text is None:
            start_response("503 Service Unavailable", [("Content-Type", "text/plain"),
                                                       ("Retry-After", "5")])
            return [b"the metrics are being built; try again\n"]
        headers = [("Content-Type", OPENMETRICS_TYPE if openmetrics else CONTENT_TYPE_LATEST)]
        if "gzip" in environ.get("HTTP_ACCEPT_ENCODING", ""):
            text = self._gzip(variant, text)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", [*headers, ("Content-Length", str(len(text)))])
        return [text]

    def close(self) -> None:
        """Stop the HTTP server and any render (the file stays, with the last state
        written)."""
        running = self._render
        if running is not None:
            self._end(running)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    """A WSGI server with a daemon thread per request (a slow scraper holds only its own)."""

    daemon_threads = True


class _V6Server(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    """No access log on the hub's stderr (hub.log) for every scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _serve(app: Callable[..., Iterable[bytes]], host: str, port: int) -> WSGIServer:
    """The WSGI `app` served by a daemon thread; raises OSError when it cannot bind."""
    server_class = _V6Server if ":" in host else _Server
    server = make_server(host, port, app, server_class, _Quiet)
    threading.Thread(target=server.serve_forever, name="openmetrics", daemon=True).start()
    return server


def _url_host(host: str) -> str:
    """The host to put in the URL: a wildcard binds every interface, so this host's name."""
    if host in _WILDCARDS:
        fqdn = socket.getfqdn()
        return fqdn if fqdn and fqdn != "localhost" else socket.gethostname()
    return f"[{host}]" if ":" in host else host


def start_exporter(job: str, address: str | None, path: str | None) -> Exporter | None:
    """The exporter the hub's options ask for, each option defaulting to its environment
    variable ($SCALEMON_METRICS, $SCALEMON_METRICS_FILE); None when neither is asked for.

    A bad option value or a port in use raises ValueError/OSError saying which (the hub
    reports it and exits 2). The same from the environment is logged and that export left
    out: an auto-started hub must not fail the job over its metrics."""
    bind = _option(address, METRICS_ENV, "--metrics", parse_address)
    file = _option(path, METRICS_FILE_ENV, "--metrics-file", _metrics_file)
    if bind is None and file is None:
        return None
    try:
        exporter = Exporter(job, bind, file)
    except OSError as exc:
        assert bind is not None
        error = (f"cannot serve metrics on {bind[0]}:{bind[1]}: {exc.strerror or exc} (choose "
                 "another port, or port 0 for any free one)")
        if address is not None:
            raise OSError(f"--metrics: {error}") from None
        log.error("$%s: %s; serving no metrics over HTTP", METRICS_ENV, error)
        if file is None:
            return None
        exporter = Exporter(job, None, file)
    if exporter.url:
        log.info("serving OpenMetrics on %s", exporter.url)
    if exporter.path:
        log.info("writing OpenMetrics to %s every %.0f s", exporter.path, FILE_EVERY_S)
    return exporter


def _option(value: str | None, env: str, option: str,
            parse: Callable[[str], _T]) -> _T | None:
    """`parse(value)`; without a value, `parse($env)`, where an error is logged, not raised."""
    if value is not None:
        try:
            return parse(value)
        except ValueError as exc:
            raise ValueError(f"{option}: {exc}") from None
    from_env = settings.raw(env)
    if not from_env:
        return None
    try:
        return parse(from_env)
    except ValueError as exc:
        log.error("$%s: %s; exporting no metrics that way", env, exc)
        return None


def _metrics_file(text: str) -> Path:
    """The metrics file to write; ValueError when its directory does not exist."""
    path = Path(text).expanduser().absolute()
    if not path.parent.is_dir():
        raise ValueError(f"{text!r}: directory {str(path.parent)!r} does not exist; create it "
                         "or name another file")
    return path
