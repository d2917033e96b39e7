"""A Flight Recorder dump of every rank, asked for from a dashboard or `scalemon dump`, and our
analysis of it (`scalemon.reports.frtrace`).

The hub queues a `dump_fr` command for each rank (delivered on the agents' next sync); each
agent writes its recorder to `<run dir>/fr/<time>/rank_<rank>` from its own thread and reports
back with an `fr_dump` info. Once every rank answered, or after `WAIT_S`, the hub notes what it
knows of the job (groups, ranks gone, the last heartbeat of each rank that wrote none) in
`context.json`, has `scalemon dump --dir` analyse the directory in a process of its own and
writes the analysis to `analysis.json` and to the history. A rank that wrote no dump is named
with the reason: on a hang, that is a finding.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from scalemon.reports import frtrace
from scalemon.state.jobstate import VANISHED_STATES

from .limits import niced

WAIT_S = 15.0
"""How long the ranks have to write their dumps."""
ANALYSIS_MAX_CHARS = 20_000
ANALYSIS_TIMEOUT_S = 300.0
ANALYSIS_NICE = 10
"""The analysis runs niced: on the hub's node the hub's loop comes first."""
REPORT_MAX_BYTES = 256 << 10
"""The analysis in the history record at most; beyond, the per-rank rows stay in the file."""
SILENT_MEANING = {
    "frozen": "its process exists but sends nothing (its agent's thread cannot run)",
    "gone": "its process ended without reporting an exit",
    "unreachable": "its node's relay is silent too; taken for ended",
    "silent": "nothing on its node can look at its process; taken for ended",
}
"""Why a rank that stopped sending wrote no dump, by the hub's word for it
(`protocol.SILENT_RANK_STATES`)."""


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
        self.report: dict[str, Any] | None = None
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
                context = job_context(state, self.requested, self.written, self.errors)
                self._thread = threading.Thread(target=self._analyse, args=(context,),
                                                daemon=True, name="scalemon-fr-analysis")
                self._thread.start()
        return self.finished

    @property
    def missing(self) -> list[int]:
        """Ranks asked that wrote no dump."""
        return sorted(set(self.requested) - set(self.written))

    def _analyse(self, context: dict[str, Any]) -> None:
        directory = Path(self.directory)
        report = None
        try:
            _write_json(directory / frtrace.CONTEXT_FILE, context)
            report, text = analyse_apart(directory)
            if report is not None:
                _write_json(directory / frtrace.ANALYSIS_FILE, report)
        except OSError as exc:
            text = f"the analysis failed: {exc}; the dumps are in {directory}"
        if len(text) > ANALYSIS_MAX_CHARS:
            text = text[:ANALYSIS_MAX_CHARS] + "\n… (cut; scalemon dump --dir DIR shows it all)"
        self.analysis = text
        self.report = _fitting(report) if report is not None else None
        self.finished = True

    def body(self) -> dict[str, Any]:
        """The `fr_dump` message body of where the dump stands."""
        return {"directory": self.directory,
                "state": "analysed" if self.finished else "requested",
                "requested": self.requested, "written": sorted(self.written),
                "missing": self.missing if self.finished else [],
                "analysis": self.analysis, "exit_code": None, "report": self.report}


def job_context(state: Any, asked: list[int], written: list[int],
                errors: dict[int, str]) -> dict[str, Any]:
    """What the hub knows that the dumps do not say (call on the hub's thread): the groups'
    ranks, who is gone (exited, or gone, unreachable or silent: taken for ended; a frozen
    rank's process exists), why each rank that wrote no dump gave nothing, their last
    heartbeat's status, each rank's P2P ops in flight as its last heartbeat said (gloo's
    recorder keeps none)."""
    gone = sorted(r for r, v in state.ranks.items() if v.state in (*VANISHED_STATES, "exited"))
    missing = {}
    for rank in sorted(set(asked) - set(written)):
        view = state.ranks.get(rank)
        if rank in errors:
            missing[rank] = f"its agent could not write it: {errors[rank]}"
        elif view is not None and view.state in SILENT_MEANING:
            missing[rank] = (f"{view.state} ({view.state_reason or 'no message'}): "
                             f"{SILENT_MEANING[view.state]}")
            if view.state == "frozen" and view.where:
                missing[rank] += f"; {view.where}"
        elif rank in gone:
            missing[rank] = f"its process exited ({view.state_reason or 'no reason given'})"
        else:
            missing[rank] = (f"no answer within {WAIT_S:g} s (stuck in C++ holding the GIL, "
                             "or its agent thread is gone)")
    world = state.world_size or 0
    for rank in range(world):
        if rank not in state.ranks:
            missing[rank] = "never reported to the hub (its agent is off or never started)"
    return {
        "asked": sorted(asked),
        "missing": {str(r): why for r, why in sorted(missing.items())},
        "gone": gone,
        "members": {name: list(g.get("ranks") or []) for name, g in state.groups.items()},
        "descs": {name: str(g.get("desc") or "") for name, g in state.groups.items()},
        "heartbeat": {str(r): v.metrics.get("groups") for r, v in state.ranks.items()
                      if r not in written and isinstance(v.metrics.get("groups"), dict)},
        "p2p": {str(r): v.metrics.get("p2p_inflight") for r, v in state.ranks.items()
                if isinstance(v.metrics.get("p2p_inflight"), list)},
    }


def analyse_apart(directory: Path) -> tuple[dict[str, Any] | None, str]:
    """`scalemon dump --dir DIRECTORY --json` in a process of its own: thousands of ranks'
    rings take seconds of CPU on every core (the analysis reads them in worker processes) that
    the hub's loop must not wait for. Returns the report (None when it failed) and the
    analysis as text (or why there is none); its stderr is no terminal: no progress lines."""
    cmd = niced([sys.executable, "-m", "scalemon.cli", "dump", "--dir", str(directory),
                 "--json"], ANALYSIS_NICE)  # its workers take what the hub's loop leaves
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=ANALYSIS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, (f"the analysis did not finish in {ANALYSIS_TIMEOUT_S:.0f} s; the dumps "
                      f"are in {directory}")
    try:
        report = json.loads(out.stdout)
    except ValueError:
        why = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        return None, f"the analysis failed: {why}; the dumps are in {directory}"
    return report, frtrace.report_text(report)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)


def _fitting(report: dict[str, Any]) -> dict[str, Any]:
    """The report as the history record carries it: without the per-rank rows when too big."""
    if len(json.dumps(report)) <= REPORT_MAX_BYTES:
        return report
    groups = [{k: v for k, v in g.items() if k != "status"} for g in report["groups"]]
    return {**report, "groups": groups,
            "cut": f"per-rank rows left out; {frtrace.ANALYSIS_FILE} in the directory has them"}
