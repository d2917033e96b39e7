"""A Flight Recorder dump of every rank, asked for from a dashboard, and torch's analysis of it.

The hub queues a `dump_fr` command for each rank (delivered on the agents' next sync); each
agent writes its recorder to `<run dir>/fr/<time>/rank_<rank>` from its own thread and reports
back with an `fr_dump` info. Once every rank answered, or after `WAIT_S`, the hub runs torch's
analyzer (`python -m torch.distributed.flight_recorder.fr_trace`) on the directory in a
subprocess: it is a command-line tool that asserts and calls `sys.exit`, so it cannot take the
hub down. A rank that wrote no dump is named: on a hang, that is a finding in itself.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

WAIT_S = 15.0
"""How long the ranks have to write their dumps."""
ANALYSIS_TIMEOUT_S = 120.0
ANALYSIS_MAX_CHARS = 20_000


class FrDump:
    """One dump: which ranks were asked, which wrote, and the analysis."""

    def __init__(self, run_dir: Path, ranks: list[int]) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = run_dir / "fr" / stamp
        n = 1
        while path.exists():
            n += 1
            path = run_dir / "fr" / f"{stamp}-{n}"
        path.mkdir(parents=True, mode=0o700)
        self.directory = str(path)
        self.requested = ranks
        self.started = time.monotonic()
        self.written: list[int] = []
        self.errors: dict[int, str] = {}
        self.analysis: str | None = None
        self.exit_code: int | None = None
        self.finished = False
        self.recorded = False
        self._thread: threading.Thread | None = None

    def _answers(self, state: Any) -> None:
        for rank_text, value in state.info.get("fr_dump", {}).items():
            rank = int(rank_text)
            if not isinstance(value, dict) or value.get("directory") != self.directory:
                continue
            if value.get("error"):
                self.errors[rank] = str(value["error"])
            elif rank not in self.written:
                self.written.append(rank)

    def advance(self, state: Any) -> bool:
        """Look at the ranks' answers; start the analysis when due. True once it is done."""
        if self.finished:
            return True
        if self._thread is None:
            self._answers(state)
            answered = set(self.written) | set(self.errors)
            if answered >= set(self.requested) or time.monotonic() - self.started >= WAIT_S:
                self._thread = threading.Thread(target=self._analyse, daemon=True,
                                                name="scalemon-fr-analysis")
                self._thread.start()
        return self.finished

    @property
    def missing(self) -> list[int]:
        """Ranks asked that wrote no dump."""
        return sorted(set(self.requested) - set(self.written))

    def _analyse(self) -> None:
        lines = []
        if self.missing:
            lines.append(f"ranks that wrote no dump: {','.join(map(str, self.missing))}"
                         + "".join(f"\n  rank {r}: {e}" for r, e in sorted(self.errors.items())))
        if not self.written:
            lines.append("no rank wrote a dump: nothing to analyse")
        else:
            cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                   self.directory, "--prefix", "rank_"]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True,
                                     timeout=ANALYSIS_TIMEOUT_S)
                self.exit_code = out.returncode
                text = (out.stdout + out.stderr).strip()
                lines.append(f"$ python -m torch.distributed.flight_recorder.fr_trace "
                             f"{self.directory} --prefix rank_   (exit {out.returncode})")
                lines.append(text or "(no output)")
            except subprocess.TimeoutExpired:
                lines.append(f"torch's analyzer did not finish in {ANALYSIS_TIMEOUT_S:.0f} s")
            except OSError as exc:
                lines.append(f"could not run torch's analyzer: {exc}")
        text = "\n".join(lines)
        if len(text) > ANALYSIS_MAX_CHARS:
            text = text[:ANALYSIS_MAX_CHARS] + "\n… (cut; the dumps are in the directory)"
        self.analysis = text
        self.finished = True

    def body(self) -> dict[str, Any]:
        """The `fr_dump` message body of where the dump stands."""
        return {"directory": self.directory,
                "state": "analysed" if self.finished else "requested",
                "requested": self.requested, "written": sorted(self.written),
                "missing": self.missing if self.finished else [],
                "analysis": self.analysis, "exit_code": self.exit_code}
