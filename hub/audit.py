"""The job's audit: `toggles.log` in the run directory, one JSON object a line.

It holds every state of every toggle (also in the history as `toggle` records), every request
that steers the job (stop, Flight Recorder dumps) and every refusal of a peer, wherever the hub
decided it: at the Curve handshake (a key not admitted, or a role the socket does not take), by
role on a request, or by the toggle planner. Each entry names the asker as the hub knows it
(`user`, `client_host`, `role`, `via`: from the key or the uid, never from the request).

Refusals are limited per asker and kind, so that a peer knocking in a loop cannot fill the
disk: the first REFUSALS_IN_FULL are written, then one every REFUSALS_EVERY with the count.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

log = logging.getLogger("scalemon.hub")

AUDIT_FILE = "toggles.log"
REFUSALS_IN_FULL = 10
REFUSALS_EVERY = 1000
MAX_SOURCES = 1024
"""Distinct (asker, kind) pairs counted one by one; more share one count (bounded memory)."""


class Audit:
    """Appends entries to the audit file of a run directory."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / AUDIT_FILE
        self.refusals: Counter[tuple[str, str]] = Counter()
        self.refused = 0

    def write(self, entry: dict[str, Any]) -> None:
        """Append `entry` with the time; a write error is logged (the history has toggles)."""
        line = json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **entry},
                          default=str)
        try:
            with open(self.path, "a") as f:
                f.write(line + "\n")
        except OSError as exc:
            log.error("could not append to %s: %s", self.path, exc)

    def refusal(self, source: str, kind: str, entry: dict[str, Any]) -> bool:
        """Record a refusal of `kind` to `source` (who, as the hub knows it); returns whether
        it was written (see the module text for the limit)."""
        self.refused += 1
        pair = (source, kind)
        if pair not in self.refusals and len(self.refusals) >= MAX_SOURCES:
            pair = ("(others)", kind)
        self.refusals[pair] += 1
        count = self.refusals[pair]
        if count > REFUSALS_IN_FULL and count % REFUSALS_EVERY:
            return False
        self.write({"event": "refused", "kind": kind, **entry,
                    **({"count": count} if count > 1 else {})})
        return True
