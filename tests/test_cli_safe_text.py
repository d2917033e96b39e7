"""Issue #26, item 7: text from ranks is text. A fake rank over real ZeroMQ sends a real hub
strings holding ESC sequences (a colour, OSC 52: write the user's clipboard) and the one-byte
C1 CSI; the `scalemon` commands that print rank text show them escaped (ESC as the four
characters `\\x1b`) and never pass a raw ESC, BEL or C1 byte to the terminal. A toggle_result
whose id the hub never saw a request for is shown, not a crash (it was `KeyError: 'state'`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from conftest import FakeRank, wait_for
from scalemon.collectives import CollectiveStats, size_bucket

EVIL = "<\x1b[31mred\x1b]52;c;aGVsbG8=\x07\x9b2J>"
"""A colour, an OSC 52 clipboard write (BEL-terminated), and C1 CSI + "2J" (clear screen)."""
SHOWN = "<\\x1b[31mred\\x1b]52;c;aGVsbG8=\\x07\\x9b2J>"
"""How EVIL must read in the output: every control character as its escape."""
RAW = re.compile(rb"[\x00-\x08\x0b-\x1f\x7f]|\xc2[\x80-\x9f]")
"""A control byte (newline and tab aside) or a C1 character in UTF-8, on its way to a terminal."""


def strings(value: object) -> set[str]:
    """Every string in a JSON value (keys too)."""
    if isinstance(value, dict):
        return set(map(str, value)).union(*map(strings, value.values()))
    if isinstance(value, list):
        return set().union(*map(strings, value))
    return {value} if isinstance(value, str) else set()


def scalemon(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scalemon", *args], capture_output=True,
                          timeout=60)


def send_evil_job(zctx, hub, job: str) -> None:
    """Two ranks whose every kind of free text carries EVIL, tagged by where it came from."""
    for r in (0, 1):
        rank = FakeRank(zctx, hub.address, job, r)
        rank.send("hello", {"host": f"host{r}{EVIL}", "pid": 1000 + r, "world_size": 2,
                            "local_rank": r, "config": {"data": f"config{EVIL}"}})
        rank.send("step", {"step": 1, "loss": 1.0, "step_time_s": 0.01,
                           "extra": {"note": f"extra{EVIL}", f"key{EVIL}": 0.5}})
        rank.send("info", {"key": "run", "value": {"path": f"info{EVIL}"}})
        stats = CollectiveStats()
        row = stats.row("0", f"op{EVIL}", size_bucket(1024))
        row.count, row.bytes = 3, 3 * 1024
        row.add_time(0.001)
        rank.send("collectives", {"groups": {"0": {"desc": f"group{EVIL}", "ranks": [0, 1]}},
                                  "stats": stats.to_wire(), "issues": [], "step": 1})
        rank.send("flags", {"values": {"NCCL_DEBUG": f"flag{r}{EVIL}"},
                            "notes": {"NCCL_DEBUG": ["restart", f"why{EVIL}"]},
                            "restart": {"ok": False, "reason": f"reason{EVIL}"}})
        # an id no toggle request of this hub had: once a crash of the snapshot table
        rank.send("toggle_result", {"id": 4242, "name": "NCCL_DEBUG", "value": f"v{EVIL}",
                                    "outcome": "failed", "text": f"toggle{EVIL}"})
        rank.send("log_lines", {"source": "nccl", "lines": [f"log{EVIL}"]})
        if r == 1:
            rank.send("monitor_off", {"reason": f"off{EVIL}", "step": 1})
            rank.send("exit", {"reason": "error", "exit_code": 1, "step": 1,
                               "error": f"error{EVIL}"})
        rank.sock.close()


def test_rank_text_reaches_the_terminal_escaped_and_unknown_toggle_ids_show(start_hub, zctx):
    job = "jobEsc"
    hub = start_hub(job, "--lost-after", "60")
    send_evil_job(zctx, hub, job)

    def snapshot() -> subprocess.CompletedProcess | None:
        out = scalemon("snapshot", job)
        return out if out.returncode != 0 or b"error<" in out.stdout else None

    snap = wait_for(snapshot, timeout=20)
    assert snap.returncode == 0, snap.stderr.decode(errors="replace")
    text = snap.stdout.decode()
    assert not RAW.findall(snap.stdout + snap.stderr), text
    for tag in ("host0", "host1", "config", "extra", "info", "op", "group", "flag0", "v", "off",
                "toggle",
                "error"):
        assert f"{tag}{SHOWN}" in text, (tag, text.splitlines())
    assert re.search(r"toggle #4242 .*unknown", text), text  # the unknown id, shown

    flags = scalemon("flags", job)
    assert flags.returncode == 0, flags.stderr.decode(errors="replace")
    assert not RAW.findall(flags.stdout + flags.stderr), flags.stdout
    for tag in ("flag0", "flag1", "why", "toggle"):
        assert f"{tag}{SHOWN}" in flags.stdout.decode(), (tag, flags.stdout)

    for args in (("snapshot", job, "--json"), ("flags", job, "--json")):
        raw = scalemon(*args)  # JSON: escaped as \u001b by json.dumps, C1 too (ASCII only)
        assert raw.returncode == 0 and not RAW.findall(raw.stdout + raw.stderr), raw.stdout
        assert f"flag0{EVIL}" in strings(json.loads(raw.stdout))  # the data, as sent
