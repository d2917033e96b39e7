"""Every `SCALEMON_*` environment variable in one table: its type, default, meaning and who
reads it. Code reads them only through `raw` and the typed readers here; `scalemon --help`
(`help_text`) and docs/settings.md (`markdown_table`, checked by the tests) are made from the
table, so the three cannot disagree.
"""

from __future__ import annotations

import math
import os
import re
import socket
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from scalemon.policy import HANG_AFTER_S

READERS = ("agent", "hub", "relay", "cli", "dashboard")
"""Who may read a variable: the training ranks, the job's hub, a node's relay, the
`scalemon` commands, the dashboard."""


@dataclass(frozen=True)
class Setting:
    """One environment variable."""

    name: str
    kind: str
    """What its value is, in words: "path", "address", "seconds", ..."""
    default: str
    """The default, as people read it (what an unset or empty variable means)."""
    meaning: str
    readers: tuple[str, ...]


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("SCALEMON_HOME", "path", "~/.scalemon",
            "where hubs keep job files, keys, sockets, histories and the demo's logs; ipc "
            "socket paths under it must fit in 100 bytes", READERS),
    Setting("SCALEMON_HUB", "address", "the job's own hub, which rank 0 starts",
            "the hub address ranks send to (ipc:///dir or tcp://host:port); ranks on other "
            "nodes need it", ("agent", "relay")),
    Setting("SCALEMON_HUB_KEY", "Curve public key (z85)", "the key in the hub's job file",
            "the hub's public key, for tcp addresses when this SCALEMON_HOME has no job file "
            "of the hub (`scalemon keys show --hub` on the hub's side)",
            ("agent", "relay", "cli", "dashboard")),
    Setting("SCALEMON_LISTEN", "tcp://HOST:PORT", "ipc only (a multi-node job: a free port)",
            "where the hub also listens, with CurveZMQ (port 0: free ports; what `scalemon "
            "hub --listen` defaults to)", ("agent", "hub", "relay")),
    Setting("SCALEMON_JOB_ID", "job id", "from SLURM's or torchrun's variables",
            "the job id the ranks report", ("agent", "cli")),
    Setting("SCALEMON_HUB_ARGS", "`scalemon hub` options", "none",
            "extra options for the hub rank 0 starts, e.g. \"--linger 60 --lost-after 10\"",
            ("agent", "cli")),
    Setting("SCALEMON_HANG_AFTER", "seconds > 0", f"{HANG_AFTER_S:g}",
            "seconds without a completed step before a job is called hung (another value is "
            "ignored)", ("agent", "hub", "dashboard")),
    Setting("SCALEMON_NODE", "name", "the host name",
            "the node name ranks, hubs and relays report (to stand for several nodes on one "
            "machine: tests, the simulator)", READERS),
    Setting("SCALEMON_RUNTIME_DIR", "path", "/tmp/scalemon-<uid>",
            "node-local directory of the relays' sockets (ipc sockets belong on the node's "
            "own disk, not on a shared home)", READERS),
    Setting("SCALEMON_METRICS", "HOST:PORT", "off",
            "where the job's hub serves OpenMetrics (/metrics; :PORT alone is 127.0.0.1, port "
            "0 any free port; the URL: `jobs --json`)", ("hub",)),
    Setting("SCALEMON_METRICS_FILE", "path", "off",
            "a file the hub writes the same metrics to every 5 s, for node_exporter's textfile "
            "collector", ("hub",)),
    Setting("SCALEMON_METRICS_PER_RANK", "0 or 1", "0",
            "1: the hub's OpenMetrics carry a series per rank as well as the per-node and job "
            "aggregates (a scrape can ask for them with /metrics?ranks=all)", ("hub",)),
    Setting("SCALEMON_ALERT_CMD", "command line", "off",
            "a command the hub runs with each alert (NaN loss, hang, straggler, memory, a rank "
            "frozen, gone, unreachable or silent) as JSON on stdin; rate-limited, audited",
            ("hub",)),
    Setting("SCALEMON_CUDA_DIRECT", "0 or 1", "1",
            "0: the agent reads CUDA through torch instead of calling the CUDA runtime itself",
            ("agent",)),
    Setting("SCALEMON_OPTIMIZER_TIMING_S", "seconds >= 0", "0.5 on CUDA, 0 on CPU",
            "seconds between the steps whose optimizer time the agent measures (0: every "
            "step); the steps between carry the last measured figure", ("agent",)),
)}


def raw(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The text of variable `name` (from `env`, default the process environment), None when
    it is unset or empty; KeyError for a name that is not in the table."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not a scalemon setting (scalemon.settings.SETTINGS)")
    return (os.environ if env is None else env).get(name) or None


def scalemon_home(env: Mapping[str, str] | None = None) -> Path:
    """`SCALEMON_HOME`, default `~/.scalemon`."""
    return Path(raw("SCALEMON_HOME", env) or Path.home() / ".scalemon")


def runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """`SCALEMON_RUNTIME_DIR`, default /tmp/scalemon-<uid>."""
    return Path(raw("SCALEMON_RUNTIME_DIR", env) or f"/tmp/scalemon-{os.getuid()}")


def node_name(env: Mapping[str, str] | None = None) -> str:
    """`SCALEMON_NODE`, else the host name."""
    return raw("SCALEMON_NODE", env) or socket.gethostname()


def hang_after_s(env: Mapping[str, str] | None = None) -> float:
    """`SCALEMON_HANG_AFTER` seconds when set to a positive number, else
    `policy.HANG_AFTER_S` (a bad value is ignored: the default stands)."""
    try:
        value = float(raw("SCALEMON_HANG_AFTER", env) or "")
    except ValueError:
        return HANG_AFTER_S
    return value if math.isfinite(value) and value > 0 else HANG_AFTER_S


def words(name: str, env: Mapping[str, str] | None = None) -> list[str]:
    """The variable's text split at white space ([] when unset)."""
    return (raw(name, env) or "").split()


def flag_off(name: str, env: Mapping[str, str] | None = None) -> bool:
    """True when the variable says "0" (a switch that is on unless turned off)."""
    return raw(name, env) == "0"


def help_text(width: int = 92) -> str:
    """The epilog of `scalemon --help`: each variable, its meaning and default."""
    lines = ["environment variables:"]
    for s in SETTINGS.values():
        body = f"{s.meaning} (default: {s.default})"
        wrapped = textwrap.wrap(body, width - 24, break_on_hyphens=False)
        head = f"  {s.name}"
        if len(head) <= 22:
            lines.append(f"{head:<24}{wrapped[0]}")
            wrapped = wrapped[1:]
        else:
            lines.append(head)
        lines.extend(" " * 24 + line for line in wrapped)
    return "\n".join(lines) + "\n"


def markdown_table() -> str:
    """The table as Markdown (docs/settings.md)."""
    rows = ["| variable | value | default | meaning | read by |", "| --- | --- | --- | --- | --- |"]
    for s in SETTINGS.values():
        cells = (f"`{s.name}`", s.kind, s.default, s.meaning, ", ".join(s.readers))
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


DOCS = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
_BLOCK = re.compile(r"(<!-- settings begin[^>]*-->\n)(.*?)(<!-- settings end -->)", re.S)


def render_docs(text: str) -> str:
    """docs/settings.md with its generated table made anew from `SETTINGS`."""
    return _BLOCK.sub(lambda m: m.group(1) + markdown_table() + m.group(3), text)


def main() -> int:
    """`python -m scalemon.settings`: write docs/settings.md's table anew from `SETTINGS`."""
    text = DOCS.read_text()
    DOCS.write_text(render_docs(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
