"""A hung job in words: the wait-for graph of `reports.waitfor` over a `JobState`'s ranks,
each culprit with its cause, phase and top user frame, each waiting rank with what it waits in
and for whom, groups by name and ranks (`job_hang`)."""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import time
from typing import TYPE_CHECKING, Any

from scalemon.policy import HEARTBEAT_S
from scalemon.proc.stacks import StackReading, format_stacks
from scalemon.reports.groups import group_label
from scalemon.reports.waitfor import wait_for_graph
from scalemon.state.ending import ranks_end_text
from scalemon.state.jobstate import VANISHED_STATES
from scalemon.text.ranks import ranks_text

if TYPE_CHECKING:
    from scalemon.state.jobstate import JobState, RankView


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)', re.M)


def _agent_dirs() -> tuple[str, ...]:
    """Where this install's agent lives (`scalemon.agent` is the repo's agent/ in a checkout),
    found without importing it: its wrappers sit in a waiting rank's stack (the timed
    `Work.wait`) but are not the user's code."""
    try:
        spec = importlib.util.find_spec("scalemon.agent")
    except (ImportError, ValueError):
        return ()
    places = spec.submodule_search_locations if spec is not None else None
    return tuple(os.path.realpath(d) + os.sep for d in places or ())


_NOT_USER = ("/site-packages/", "/dist-packages/", "<frozen ", "/lib/python3", "scalemon/agent/",
             "/torch/", *_agent_dirs())


def user_frame(stack: str | None) -> str | None:
    """The innermost frame of a Python stack (as `traceback.format_stack` writes it) in the
    user's own code, not torch's, the standard library's or the agent's: "train.py:42 in
    step()"; None without one."""
    if not stack:
        return None
    frames = list(_FRAME.finditer(stack))
    for m in reversed(frames):
        path = m["file"]
        if not any(part in path for part in _NOT_USER):
            return f"{path.rsplit('/', 1)[-1]}:{m['line']} in {m['fn']}()"
    return None


FOR_SHOWN = 64
"""Awaited ranks listed per waiting rank in the JSON at most (`for_count` has them all): half
of 4096 ranks waiting for the other half must not make a snapshot of millions of numbers."""


class HangReport:
    """The hang of `st` at `now` from its ranks' latest heartbeats (`groups`, `inflight`,
    `stack`, `phase`) and states."""

    def __init__(self, st: JobState, now: float) -> None:
        self.st = st
        self.now = now
        self._labels: dict[str, str] = {}
        self._whoms: dict[int, str] = {}
        self._frames: dict[int, str | None] = {}
        views = st.ranks
        self.finished = {r for r, v in views.items() if v.state == "finished"
                         or (v.state == "exited" and v.exit_code == 0)}
        self.gone = {r for r, v in views.items()
                     if v.state in (*VANISHED_STATES, "exited") and r not in self.finished}
        status = {r: _status(v) for r, v in views.items()}
        members = {name: tuple(g["ranks"]) for name, g in st.groups.items()}
        inflight = {r: [i for i in v.metrics.get("inflight") or () if isinstance(i, list)]
                    for r, v in views.items()}
        p2p = {r: items for r, v in views.items()
               if isinstance(items := v.metrics.get("p2p_inflight"), list) and items}
        self.finding = wait_for_graph(status, members, self.gone, finished=self.finished,
                                      inflight=inflight, p2p=p2p) or {}
        self.waits: dict[int, dict[str, Any]] = self.finding.get("waits", {})
        self.causes: dict[int, dict[str, Any]] = self.finding.get("causes", {})
        for rank, cause in self.causes.items():  # in Python as far as its last message said
            if cause["cause"] == "python" and rank not in views:
                cause["cause"] = "unheard"
        frozen = {r for r, v in views.items() if v.state == "frozen"}
        if frozen and self.finding:
            self._blame_frozen(frozen, members)
        self._missed = self._never_issued()

    def _blame_frozen(self, frozen: set[int], members: dict[str, tuple[int, ...]]) -> None:
        """A frozen rank (its process exists, sends nothing; the hub read where it is) is a
        culprit whatever its last message said, also from inside a collective every member
        issued: the ranks `stuck` in a group with a frozen member wait for it, not for the
        network."""
        for rank in frozen:
            self.causes[rank] = {"cause": "frozen"}
            self.waits.pop(rank, None)
        for rank, cause in list(self.causes.items()):
            wait = self.waits.get(rank)
            if cause["cause"] != "stuck" or wait is None:
                continue
            blamed = sorted(frozen.intersection(members.get(wait["group"], ())))
            if blamed:
                wait["for"] = blamed
                del self.causes[rank]
        culprits = sorted(r for r, c in self.causes.items() if c["cause"] != "stuck")
        self.finding["culprits"] = culprits
        self.finding["waiting"] = sorted(r for r in self.waits if r not in culprits)

    # --- pieces ----------------------------------------------------------------------------
    def label(self, group: str) -> str:
        """`JobState.group_label`, once per group (thousands of ranks name the same)."""
        text = self._labels.get(group)
        if text is None:
            text = self._labels[group] = group_label(self.st.groups, group)
        return text

    def what(self, group: str, seq: int | None, op: str | None) -> str:
        """"all_reduce #16 of default_pg [0,1,2]"."""
        return f"{op or 'collective'} #{seq} of {self.label(group)}"

    def wait_what(self, wait: dict[str, Any]) -> str:
        """What a wait is in: "all_reduce #16 of default_pg [0,1,2]", "recv from rank 0 of pp
        [0,2]" (a P2P wait)."""
        if wait["seq"] is None and wait["op"] in ("send", "recv"):
            way = "from" if wait["op"] == "recv" else "to"
            return f"{wait['op']} {way} rank {wait.get('peer')} of {self.label(wait['group'])}"
        return self.what(wait["group"], wait["seq"], wait["op"])

    def counterpart(self, waiter: int, wait: dict[str, Any], rank: int) -> str:
        """What `rank`, awaited by `waiter`, never issued: the collective they wait in, or the
        other side of a P2P op ("send to rank 2 of pp [0,2]")."""
        if wait["seq"] is not None or wait["op"] not in ("send", "recv"):
            return self.wait_what(wait)
        label = self.label(wait["group"])
        if rank != wait.get("peer"):
            return f"a send or recv with rank {waiter} of {label}"
        way = "send to" if wait["op"] == "recv" else "recv from"
        return f"{way} rank {waiter} of {label}"

    def waited_s(self, rank: int) -> float | None:
        """How long `rank` has waited in its collective (its issue time, on the hub's clock)."""
        t = self.waits[rank].get("t")
        if not isinstance(t, (int, float)):
            return None
        return self.now - (t + self.st.clock_offset(self.st.ranks[rank]))

    def frame(self, rank: int) -> str | None:
        """The rank's top user frame, from its stack (once per rank)."""
        if rank not in self._frames:
            view = self.st.ranks.get(rank)
            self._frames[rank] = user_frame(view.metrics.get("stack")) if view else None
        return self._frames[rank]

    def never_issued(self, rank: int) -> list[str]:
        """The collectives others wait in for `rank`, each once."""
        return self._missed.get(rank, [])

    def _never_issued(self) -> dict[int, list[str]]:
        """Rank -> the collectives others wait in for it; one pass over the waits (the ranks
        that wait in one collective share one list of whom they wait for)."""
        missed: dict[int, list[str]] = {}
        seen: set[tuple[Any, ...]] = set()
        for waiter in sorted(self.waits):
            w = self.waits[waiter]
            key = (w["group"], w["seq"], w["op"], id(w["for"]))
            if key in seen:
                continue
            seen.add(key)
            text = self.wait_what(w)
            for rank in w["for"]:
                if w["seq"] is None:
                    text = self.counterpart(waiter, w, rank)
                texts = missed.setdefault(rank, [])
                if text not in texts:
                    texts.append(text)
        return missed

    def wait_text(self, rank: int) -> str:
        """"waiting in all_gather #3 of user_pg [0,1] for rank 1 (12 s)", "waiting in recv from
        rank 0 of pp [0,2] (12 s)"."""
        w = self.waits[rank]
        waited = self.waited_s(rank)
        text = f"waiting in {self.wait_what(w)}"
        if w["for"] and w["for"] != [w.get("peer")]:
            text += f" for {self._whom(w['for'])}"
        return text + (f" ({waited:.0f} s)" if waited is not None else "")

    def _whom(self, ranks: list[int]) -> str:
        """`ranks_text` of a list of awaited ranks, once per list (waiting ranks share one)."""
        key = id(ranks)
        text = self._whoms.get(key)
        if text is None:
            text = self._whoms[key] = ranks_text(ranks)
        return text

    def cause_text(self, rank: int) -> str:
        """Why `rank` holds the others up, in words (without "rank N: ")."""
        cause = self.causes[rank]
        kind = cause["cause"]
        missed = " nor ".join(self.never_issued(rank))
        if kind == "gone":
            view = self.st.ranks[rank]
            why = view.state_reason or "no exit reported"
            return f"{view.state}: {why}" + (
                f"; never issued {missed}" if missed else "")
        if kind == "python":
            frame = self.frame(rank)
            where = f"python, {frame}" if frame else "python (no stack yet)"
            return where + (f"; never issued {missed}" if missed else "")
        if kind == "frozen":
            return frozen_text(self.st.ranks[rank]) + self._frozen_in(rank)
        if kind == "unheard":
            return ("never reported to the hub: its process did not start, or ended before "
                    "its agent's first message" + (f"; never issued {missed}" if missed else ""))
        if kind == "desync":
            return self.desync_text(cause["group"], cause["seq"])
        if kind == "teardown":
            return (f"stuck in teardown: {self.wait_text(rank)}, which "
                    f"{'has' if len(cause['for']) == 1 else 'have'} finished")
        if kind == "deadlock":
            verb = "waits" if len(cause["for"]) == 1 else "wait"
            how = ("sends and receives that wait for each other" if self.waits[rank]["seq"]
                   is None else "collectives of different groups issued in different orders")
            return f"{self.wait_text(rank)}, which {verb} for it in turn: a deadlock ({how})"
        return (f"{self.wait_text(rank)}: every member issued it: a network or "
                "communication-library problem, not a late rank")

    def _frozen_in(self, rank: int) -> str:
        """"; never issued all_reduce #10 of ...", or "; inside all_reduce #10 of ..." when
        its last message said it had issued the collective the others wait in."""
        status = _status(self.st.ranks[rank])
        inside, never = [], []
        for wait in self.waits.values():
            if rank not in wait["for"] or wait["seq"] is None:
                continue
            text = self.wait_what(wait)
            issued = (status.get(wait["group"]) or [None])[0]
            into = inside if isinstance(issued, int) and issued >= wait["seq"] else never
            if text not in into:
                into.append(text)
        return (f"; inside {' and '.join(inside)}" if inside else "") + (
            f"; never issued {' nor '.join(never)}" if never else "")

    def desync_text(self, group: str, seq: int) -> str:
        """"rank 2 issued all_gather #5 of default_pg [0,1,2] while ranks 0,1 issued all_reduce
        #5"."""
        found = next(d for d in self.finding["desync"] if (d["group"], d["seq"]) == (group, seq))
        kinds = found["issued"]
        same_op = len({k["op"] for k in kinds}) == 1

        def issued(k: dict[str, Any]) -> str:
            size = f" of {k['bytes']} B" if same_op and k["bytes"] is not None else ""
            return f"{k['op']}{size} #{seq}"

        odd = "; ".join(f"{ranks_text(k['ranks'])} issued {issued(k)}"
                        + (f" of {self.label(group)}" if i == 0 else "")
                        for i, k in enumerate(kinds[1:]))
        return f"{odd} while {ranks_text(kinds[0]['ranks'])} issued {issued(kinds[0])}"

    # --- the whole ---------------------------------------------------------------------------
    def text(self, since: float) -> str:
        """The finding in one paragraph: culprits first, then who waits in what."""
        if not self.finding:
            return (f"no rank completed a step for {since:.0f} s; every rank completed the "
                    "collectives it issued: look at the stacks")
        parts: list[str] = []
        alike: dict[tuple[str, str], list[int]] = {}  # python culprits that missed the same
        for rank in self.finding["culprits"]:
            kind = self.causes[rank]["cause"]
            if kind == "desync":
                text = self.desync_text(self.causes[rank]["group"], self.causes[rank]["seq"])
            elif kind == "python":
                alike.setdefault((kind, " nor ".join(self.never_issued(rank))), []).append(rank)
                continue
            else:
                text = f"rank {rank}: {self.cause_text(rank)}"
            if text not in parts:
                parts.append(text)
        parts[:0] = [self._python_sentence(ranks, missed) for (_, missed), ranks in alike.items()]
        stuck = [r for r, c in self.causes.items() if c["cause"] == "stuck"]
        if stuck:
            w = self.waits[stuck[0]]
            who = "both sides" if w["seq"] is None else "every rank"
            parts.append(f"{who} issued {self.wait_what(w)}: a network or "
                         "communication-library problem, not a late rank")
        waiting = [r for r in self.finding["waiting"] if r not in stuck]
        parts.extend(self._waiting_sentences(waiting))
        return "; ".join(parts)

    def _python_sentence(self, ranks: list[int], missed: str) -> str:
        """"rank 1 never issued all_reduce #7 of default_pg [0,1,2] (in Python: train.py:42
        in step())"; the frame where every one of `ranks` is at the same."""
        frames = {self.frame(r) for r in ranks}
        frame = frames.pop() if len(frames) == 1 else None
        where = f"in Python: {frame}" if frame else "in Python"
        if missed:
            return f"{ranks_text(ranks)} never issued {missed} ({where})"
        return f"{ranks_text(ranks)} {'is' if len(ranks) == 1 else 'are'} {where}"

    def _waiting_sentences(self, waiting: list[int]) -> list[str]:
        """"ranks 0,2 wait in all_reduce #10 of default_pg [0,1,2] for rank 1 (37 s)", ranks
        that wait in the same collective for the same ranks together."""
        together: dict[tuple[Any, ...], list[int]] = {}
        for rank in waiting:
            w = self.waits[rank]
            p2p = (w["op"], w.get("peer")) if w["seq"] is None else ()
            together.setdefault((w["group"], w["seq"], tuple(w["for"]), *p2p), []).append(rank)
        out = []
        for key, ranks in together.items():
            w, awaited = self.waits[ranks[0]], key[2]
            waited = [s for s in (self.waited_s(r) for r in ranks) if s is not None]
            verb = "waits" if len(ranks) == 1 else "wait"
            text = f"{ranks_text(ranks)} {verb} in {self.wait_what(w)}"
            if awaited and list(awaited) != [w.get("peer")]:
                text += f" for {ranks_text(list(awaited))}"
            out.append(text + (f" ({max(waited):.0f} s)" if waited else ""))
        return out

    def causes_json(self) -> list[dict[str, Any]]:
        """Each culprit (and each rank stuck with everyone) with its cause in words."""
        out = []
        for rank in sorted(self.causes):
            cause = self.causes[rank]
            view = self.st.ranks.get(rank)
            out.append({"rank": rank, "cause": cause["cause"],
                        "culprit": cause["cause"] != "stuck",
                        "phase": view.metrics.get("phase") if view else None,
                        "frame": self.frame(rank),
                        "text": f"rank {rank}: {self.cause_text(rank)}"})
        return out

    def waits_json(self) -> list[dict[str, Any]]:
        """What each waiting rank waits in and for whom."""
        out = []
        for rank in sorted(self.waits):
            w = self.waits[rank]
            out.append({"rank": rank, "group": self.label(w["group"]),
                        "group_name": w["group"],
                        "seq": w["seq"], "op": w["op"], "peer": w.get("peer"),
                        "for": w["for"][:FOR_SHOWN],
                        "for_count": len(w["for"]),
                        "waited_s": self.waited_s(rank),
                        "culprit": rank in self.finding["culprits"],
                        "text": f"rank {rank}: {self.wait_text(rank)}"})
        return out

    def desync_json(self) -> list[dict[str, Any]]:
        return [{**d, "group": self.label(d["group"]), "group_name": d["group"],
                 "text": self.desync_text(d["group"], d["seq"])}
                for d in self.finding.get("desync", [])]

    def rank_json(self, view: RankView) -> dict[str, Any]:
        """A rank's whereabouts: state, step, phase, top user frame, groups, in flight."""
        rank = view.rank
        role = ("culprit" if rank in self.finding.get("culprits", ()) else
                "waiting" if rank in self.waits else "")
        if rank in self.causes and rank not in self.waits:
            doing = self.cause_text(rank)
        elif rank in self.waits:
            doing = self.wait_text(rank)
        else:
            doing = None
        groups = view.metrics.get("groups") or {}
        return {
            "state": view.state, "step": view.step, "phase": view.metrics.get("phase"),
            "frame": self.frame(rank), "role": role, "doing": doing,
            "stuck_s": self.now - view.last_step_t if view.last_step_t is not None else None,
            "groups": {self.label(g): {"last_issued": s[0], "last_completed": s[1]}
                       for g, s in groups.items() if isinstance(s, list) and len(s) == 2},
            "inflight": view.metrics.get("inflight") or [],
            "p2p_inflight": view.metrics.get("p2p_inflight") or [],
        }


def _status(view: RankView) -> dict[str, list[int]]:
    groups = view.metrics.get("groups") or {}
    return {g: s for g, s in groups.items() if isinstance(s, list) and len(s) == 2}


def _analyse(st: JobState, now: float) -> dict[str, Any] | None:
    """The hang of a running job `st` at `now`, or None: no rank completed a step for its
    `hang_after_s` (`job_hang` checks first that the job runs). The wait-for graph: the
    culprits at the ends of the chains (in Python, gone, desynchronised, stuck in teardown)
    with their cause, phase and top user frame, what each waiting rank waits in and for whom,
    each rank's stack."""
    if st.last_step_t is None:
        return None
    since = now - st.last_step_t
    if since < st.hang_after_s:
        return None
    running = [v for v in st.ranks.values() if v.state == "running"]
    if running and all(v.monitor_off for v in running):
        return None  # no rank reports steps any more: silence is no sign of a hang
    report = HangReport(st, now)
    finding = report.finding
    unheard = unheard_since_hang(st)
    text = report.text(since)
    if unheard:
        text = f"provisional, {_ranks_count(len(unheard))} not heard since the hang began: {text}"
    group, seq = finding.get("group"), finding.get("seq")
    first = [r for r, w in sorted(report.waits.items())
             if (w["group"], w["seq"]) == (group, seq)]
    op = next((report.waits[r]["op"] for r in first if report.waits[r]["op"]), None)
    waited = [s for s in (report.waited_s(r) for r in first) if s is not None]
    return {
        "since_s": since,
        "culprits": finding.get("culprits", []),
        "waiting": finding.get("waiting", []),
        "group": report.label(group) if group is not None else None,
        "group_name": group,
        "op": op, "seq": seq, "waited_s": max(waited) if waited else None,
        "gone": sorted(report.gone),
        "text": text,
        "provisional": bool(unheard),
        "not_heard": len(unheard),
        "not_heard_ranks": unheard[:FOR_SHOWN],
        "causes": report.causes_json(),
        "waits": report.waits_json(),
        "chains": finding.get("chains", []),
        "wait_for": {str(r): w["for"][:FOR_SHOWN] for r, w in sorted(report.waits.items())},
        "desync": report.desync_json(),
        "stacks": {str(r): stack_text(v) for r, v in sorted(st.ranks.items())},
        "nccl_ras": {str(r): v for r, v in st.info.get("nccl_ras", {}).items()},
        "ranks": {str(r): report.rank_json(v) for r, v in sorted(st.ranks.items())},
    }


def unheard_since_hang(st: JobState) -> list[int]:
    """The running ranks of `st` not heard from since the hang began for them: nothing they
    sent came a heartbeat interval or more after their last step (or the job's), so the
    report's word on them is a guess from before the hang (a hub behind, late heartbeats)."""
    out = []
    for rank, view in st.ranks.items():
        if view.state != "running":
            continue
        last_step = view.last_step_t if view.last_step_t is not None else st.last_step_t
        seen = view.last_seen_t
        if seen is not None and last_step is not None and seen < last_step + HEARTBEAT_S:
            out.append(rank)
    return sorted(out)


def _ranks_count(count: int) -> str:
    return f"{count:,} rank" + ("" if count == 1 else "s")


def frozen_text(view: RankView) -> str:
    """"frozen in native code holding the GIL: sleep <- freeze_holding_the_gil() at
    faults.py:11": a frozen rank where its stacks read from outside say, else why not."""
    if view.where:
        return view.where
    return f"frozen: {view.state_reason}" if view.state_reason else "frozen"


def stack_text(view: RankView) -> str:
    """A rank's stack as the hang shows it: read from outside its process when the hub had
    to (every thread, native frames too), else its agent's Python stack; or why none."""
    outside = view.outside_stacks
    if outside and isinstance(outside.get("reading"), dict):
        reading = StackReading.from_wire(outside["reading"])
        if not reading.error:
            head = f"(read from outside the process by {outside.get('reader') or 'the hub'})\n"
            return head + format_stacks(reading, native=True)
    if view.state in (*VANISHED_STATES, "exited"):
        return f"(no stack: the rank is {view.state}: {view.state_reason or ''})"
    if view.state == "frozen":
        return f"(no stack: {frozen_text(view)})"
    return view.metrics.get("stack") or "(no stack yet: the rank's agent sends it once "  \
        "its training thread is stuck for a few seconds)"


def job_hang(st: JobState, now: float | None = None) -> dict[str, Any] | None:
    """The job's hang, or None: no rank completed a step for `hang_after_s` while the job
    runs (`JobState.hang_possible`); who holds up whom, and why."""
    if not st.hang_possible():
        return None
    return _analyse(st, time.time() if now is None else now)


def last_hang(st: JobState) -> dict[str, Any] | None:
    """The hang the job was in as it ended (its first rank killed, failed or gone, or its user's
    stop: `state.hangend`), as `job_hang` told it then, with `step` (the last step completed),
    `ended_t`, `end` (how the job ended, in words) and `summary` ("hung after step 40 in
    all_reduce #41 of default_pg [0,1] (culprit rank 1) for 35 s, then ended by SIGTERM (ranks
    0,1, exit 143)"); None when it did not end hung, or every rank finished after all."""
    end = st.hang_end
    if end is None or st.state == "finished":
        return None
    if "report" not in end:  # the kept ranks never change: told once
        kept = copy.copy(st)
        kept.ranks, kept.last_step_t = end["ranks"], end["last_step_t"]
        end["report"] = _analyse(kept, end["t"])
    if end["report"] is None:
        return None
    hang = {**end["report"], "step": end["step"], "ended_t": end["t"], "end": end_text(st)}
    where = (f" in {hang['op'] or 'collective'} #{hang['seq']} of {hang['group']}"
             if hang.get("group") is not None else "")
    culprits = f" (culprit {ranks_text(hang['culprits'])})" if hang["culprits"] else ""
    after = f" after step {end['step']}" if end["step"] is not None else ""
    hang["summary"] = (f"hung{after}{where}{culprits} for {hang['since_s']:.0f} s, "
                       f"then {hang['end']}")
    return hang


def end_text(st: JobState) -> str:
    """How the job's ranks ended, in words: "stopped by the user (scalemon demo: q,
    ann@node1)", "ended by SIGTERM (ranks 0,1, exit 143)", "rank 1 gone without reporting an
    exit" (`state.ending`)."""
    return st.stop_text() if st.stop is not None else ranks_end_text(st.ranks)


def first_failure(st: JobState) -> dict[str, Any] | None:
    """`JobState.first_failure`, but where the job ended hung (`last_hang`): then the hang is
    the first failure, named by its culprit, unless a rank failed before the hang began (its
    cause: a rank killed -9 or OOM-killed, the others then wait for it) or the first rank to
    fail is a culprit that failed with an error of its own (the hang's cause, told). None for
    a job that finished."""
    failure = st.first_failure()
    hang = last_hang(st)
    if hang is None or (failure is not None and _failed_before_hang(st, failure)):
        return failure
    culprits = hang["culprits"]
    if (failure is not None and failure["rank"] in culprits and failure["state"] == "exited"
            and not str(failure["error"]).startswith("ended by ")):
        return failure
    rank = culprits[0] if culprits else (failure["rank"] if failure else None)
    return {"rank": rank, "state": "hung", "exit_code": None, "step": hang["step"],
            "t": hang["ended_t"], "error": hang["summary"], "peer_loss": [],
            "text": f"the job {hang['summary']}"}


def _failed_before_hang(st: JobState, failure: dict[str, Any]) -> bool:
    """True when the `failure` of `st` happened before its kept hang began (`hang_after_s`
    after the last step): a rank vanished when it was last heard of, another when it ended."""
    view, end = st.ranks.get(failure["rank"]), st.hang_end
    when = view.last_seen_t if view is not None and view.state in VANISHED_STATES else None
    when = failure["t"] if when is None else when
    return (end is not None and when is not None and end["last_step_t"] is not None
            and when < end["last_step_t"] + st.hang_after_s)
