"""Applying flag toggles inside a rank, on the training thread, at the planned step boundary.

The hub relays a `set_flag` command on the agent's sync (sender thread); it is only queued
there. `Run.log()` checks the queue (one attribute read) and, once the step before the planned
one is done, applies the change here, on the training thread: `os.environ` is never changed
from a background thread (setenv is not thread-safe in glibc), and every rank changes at the same
step boundary. What each tier does:

- live: set the variable and make the running process take it (NCCL: `ncclResetDebugInit()`
  through ctypes on the loaded libnccl, with NCCL_DEBUG_SUBSYS made to include COLL where the
  user set none, and a count of NCCL's lines after 3 s; torch: `set_debug_level_from_env()`,
  `_set_pg_timeout()`, `_enable_collectives_timing()`).
- new communicator: set the variable; where the script registered `on_new_communicator`, call it
  so it moves its work to new groups now; otherwise it holds for groups created later.
- restart: write the override file, have the script checkpoint (`checkpoint`), report, and end
  the worker with `RESTART_EXIT_CODE` so torchrun starts it again with the value.

After each change the rank reports its values (`flags` message) and the outcome
(`toggle_result`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scalemon import flags as catalogue
from scalemon.flags import (
    FLAGS,
    NCCL_NO_CACHE_FLAGS,
    NEW_COMMUNICATOR,
    PG_TIMEOUT,
    RESTART,
    RESTART_EXIT_CODE,
    FlagError,
)

from . import c10d, nccllog, overrides
from .env import RankEnv
from .env import max_restarts as env_max_restarts
from .libs import mapped_libraries
from .warn import Warnings

log = logging.getLogger("scalemon.agent")
Submit = Callable[[str, dict[str, Any]], bool]


class FlagControl:
    """The flags of one rank: report them, apply toggles when due."""

    def __init__(self, env: RankEnv, submit: Submit, warnings: Warnings, *, nccl: bool,
                 checkpoint: Callable[[int], Any] | None = None,
                 on_new_communicator: Callable[[list[str]], Any] | None = None,
                 log_dir: Path | None = None,
                 on_log_file: Callable[[Path, str, int | None], bool] | None = None,
                 on_nccl_probe: Callable[[dict[str, Any], int, str], bool] | None = None,
                 ) -> None:
        self.env = env
        self.submit = submit
        self.warnings = warnings
        self.nccl = nccl
        self.checkpoint = checkpoint
        self.on_new_communicator = on_new_communicator
        self.log_dir = log_dir
        self.on_log_file = on_log_file
        self.on_nccl_probe = on_nccl_probe
        """`fn(command, step, text)`: count NCCL's lines after an applied toggle and report the
        count later; True when a count will come."""
        self.redirected: str | None = None  # NCCL_DEBUG_FILE as the agent set it
        self.nccl_path: Path | None = None  # the NCCL log file followed, if any
        self.auto_subsys: str | None = None  # NCCL_DEBUG_SUBSYS as a toggle set it (not the user)
        self.pending: list[dict[str, Any]] = []  # appended by the sender thread
        self.applied_ids: set[int] = set()

    # --- reporting ---------------------------------------------------------------------------
    def values(self) -> dict[str, str | None]:
        """Every flag of the panel as in effect in this process (None: unset)."""
        out: dict[str, str | None] = {}
        for name, flag in FLAGS.items():
            if flag.tier == RESTART:
                out[name] = overrides.start_env.get(name, os.environ.get(name))
            else:
                out[name] = os.environ.get(name) or None
        out["TORCH_DISTRIBUTED_DEBUG"] = torch_debug_level() or out["TORCH_DISTRIBUTED_DEBUG"]
        out[PG_TIMEOUT] = pg_timeout_text()
        return out

    def notes(self) -> dict[str, list[str]]:
        """Where a flag's tier on this rank differs from the table's, and why."""
        notes: dict[str, list[str]] = {}
        nccl_lib, reset = loaded_reset()
        if nccl_lib is not None and reset is None:
            for name in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS"):
                notes[name] = [RESTART, no_reset_why(nccl_lib)]
        no_cache = os.environ.get("NCCL_NO_CACHE", "")
        for name in NCCL_NO_CACHE_FLAGS:
            if no_cache.upper() != "ALL" and name not in no_cache.split(","):
                notes[name] = [RESTART, f"launched without NCCL_NO_CACHE={name} (or ALL): NCCL "
                                        "cached it at its first read"]
        if overrides.torch_imported_first and "TORCH_CPP_LOG_LEVEL" in overrides.applied:
            notes["TORCH_CPP_LOG_LEVEL"] = [RESTART, "torch was imported before scalemon.agent,"
                                                     " so the override came too late for it"]
        if self.on_new_communicator is None:
            for name, flag in FLAGS.items():
                if flag.tier == NEW_COMMUNICATOR and name not in notes:
                    notes[name] = [NEW_COMMUNICATOR, "the script moves no work to new groups: "
                                   "only groups created after the change get it (--restart "
                                   "changes every group)"]
        return notes

    def restart_status(self) -> dict[str, Any]:
        """Whether a restart-tier change can restart this worker, and if not why."""
        if self.env.launcher != "torchrun":
            return {"ok": False, "reason": "not started by torchrun, so nothing would start it "
                                           "again"}
        if self.checkpoint is None:
            return {"ok": False, "reason": "the script registered no checkpoint callback "
                                           "(demo trainer: start it with --ckpt-dir)"}
        max_restarts = env_max_restarts() or 0
        if self.env.restart_count >= max_restarts:
            return {"ok": False, "reason": f"torchrun restarts used up ({self.env.restart_count}"
                                           f" of --max-restarts {max_restarts})"}
        return {"ok": True, "reason": f"{max_restarts - self.env.restart_count} torchrun "
                                      "restart(s) left; checkpoints before stopping"}

    def report(self) -> None:
        """Send this rank's flags to the hub."""
        self.submit("flags", {"values": self.values(), "notes": self.notes(),
                              "restart": self.restart_status(),
                              "rebuild": self.on_new_communicator is not None})

    # --- commands (sender thread) ------------------------------------------------------------
    def queue(self, command: dict[str, Any]) -> None:
        """A `set_flag` command from the hub; applied later by `apply_due` (training thread)."""
        if isinstance(command.get("id"), int) and command["id"] not in self.applied_ids:
            self.pending.append(command)

    # --- applying (training thread) ----------------------------------------------------------
    def apply_due(self, step: int, stop_worker: Callable[[int], None]) -> None:
        """Apply every queued change planned for the boundary after `step` (or overdue)."""
        for command in [c for c in self.pending if _planned(c) <= step + 1]:
            self.pending.remove(command)
            self.applied_ids.add(command["id"])
            self._apply(command, step, stop_worker)

    def _apply(self, command: dict[str, Any], step: int,
               stop_worker: Callable[[int], None]) -> None:
        name, value = str(command.get("flag")), str(command.get("value", ""))
        tier = command.get("tier") if command.get("tier") in catalogue.TIERS else RESTART
        effective = step + 1
        late = effective - _planned(command)
        try:
            catalogue.check(name, value)  # never trust a relayed command
            if tier == RESTART:
                self._restart(command, name, value, step, stop_worker)
                return
            text = self._change(name, value, tier)
            if late > 0:
                text += f" (the command arrived {late} step(s) after the planned one)"
            outcome = "applied"
        except FlagError as exc:
            outcome, text = "failed", str(exc)
        except Exception as exc:  # a failed toggle never stops training
            outcome, text = "failed", f"{type(exc).__name__}: {exc}"
        probe = (outcome == "applied" and self.on_nccl_probe is not None
                 and name in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS")
                 and nccllog.verbose(os.environ.get("NCCL_DEBUG")))
        if probe and self.on_nccl_probe(command, effective, text):
            self._result(command, name, value, outcome, effective, text,
                         log_window_s=nccllog.PROBE_S)
        else:
            self._result(command, name, value, outcome, effective, text)
        if outcome == "applied":
            self._persist({name: value or None})
        self.report()

    def _change(self, name: str, value: str, tier: str) -> str:
        """Make a live or new-communicator change; returns what was done, in words."""
        if name == PG_TIMEOUT:
            return set_pg_timeout(float(value))
        _setenv(name, value)
        if name in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS"):
            said = self._subsys(name)
            return self._nccl_debug(value) + said
        if name == "TORCH_DISTRIBUTED_DEBUG":
            import torch.distributed as dist

            dist.set_debug_level_from_env()
            return "torch debug level now " + (torch_debug_level() or "?") + \
                self._new_groups([name])
        if name == "TORCH_NCCL_ENABLE_TIMING":
            return enable_collectives_timing()
        if tier == NEW_COMMUNICATOR:
            return self._new_groups([name])
        return "set"

    def _new_groups(self, names: list[str]) -> str:
        if self.on_new_communicator is None:
            return ("; in effect for process groups created from now on (existing groups "
                    "keep their value: `scalemon toggle --restart` changes them too)")
        said = self.on_new_communicator(names)
        return "; " + (said if isinstance(said, str) and said else
                       "the script moved its work to new process groups")

    def _subsys(self, name: str) -> str:
        """Where NCCL_DEBUG turns INFO lines on and the user set no NCCL_DEBUG_SUBSYS, ask for
        COLL too (NCCL's default subsystems print nothing for a running communicator); returns
        what was done or what to know, in words ("" for nothing)."""
        level, subsys = os.environ.get("NCCL_DEBUG"), os.environ.get("NCCL_DEBUG_SUBSYS")
        if name == "NCCL_DEBUG_SUBSYS":
            self.auto_subsys = None  # the user's own from now on
        elif nccllog.verbose(level) and subsys is None:
            os.environ["NCCL_DEBUG_SUBSYS"] = self.auto_subsys = nccllog.LIVE_SUBSYS
            return (f"; NCCL_DEBUG_SUBSYS was unset, so scalemon set it to "
                    f"{nccllog.LIVE_SUBSYS}: NCCL's default subsystems "
                    f"({nccllog.DEFAULT_SUBSYS}) print nothing for a communicator that is "
                    "already running, COLL prints a line per collective")
        elif not nccllog.verbose(level) and self.auto_subsys is not None:
            if subsys == self.auto_subsys:
                os.environ.pop("NCCL_DEBUG_SUBSYS", None)
            self.auto_subsys = None
            return "; NCCL_DEBUG_SUBSYS unset again (scalemon had set it)"
        if nccllog.verbose(level) and not nccllog.prints_when_running(subsys):
            return (f"; note: NCCL_DEBUG_SUBSYS={subsys} has no COLL or P2P, so a running "
                    "communicator may print nothing (new communicators print their INIT lines)")
        return ""

    def _nccl_debug(self, value: str) -> str:
        self.nccl_file()
        lib, reset = loaded_reset()
        if lib is None:
            return ("NCCL is not loaded in this process (gloo job or CPU build): set for any "
                    "NCCL communicator it creates")
        if reset is None:
            raise FlagError(no_reset_why(lib))
        reset()
        symbol = getattr(reset, "__name__", RESET_SYMBOLS[0])
        said = f"NCCL re-read its debug settings ({symbol} in {Path(lib).name})"
        user_file = os.environ.get("NCCL_DEBUG_FILE")
        if user_file and user_file != self.redirected and nccllog.opens_file(
                os.environ.get("NCCL_DEBUG")):
            said += (f"; note: NCCL opens NCCL_DEBUG_FILE again with mode \"w\" at its next "
                     f"line, which empties {self.nccl_path or user_file} (the hub's log keeps "
                     "the lines streamed from it)")
        return said

    def nccl_file(self, tee_fd: int | None = None) -> Path | None:
        """With NCCL_DEBUG set, the file NCCL writes its lines to, followed (as source "nccl"):
        the user's NCCL_DEBUG_FILE (%h, %p expanded), else one this sets in the job's run
        directory, whose lines also go to `tee_fd` when given. None when NCCL writes to stdout
        (no run directory) or to a file that is no log of its own (/dev/stderr, a FIFO)."""
        if not os.environ.get("NCCL_DEBUG"):
            return None
        template = os.environ.get("NCCL_DEBUG_FILE")
        if template:
            path = nccllog.expand_debug_file(template)
            tee_fd = None  # the user chose the file: their stdout never had these lines
            if not nccllog.followable(path):
                self.nccl_path = None
                return None
        elif self.log_dir is not None:
            # %p: NCCL puts its pid there, so a child process never truncates this one's file
            host = re.sub(r"[^A-Za-z0-9._-]", "-", self.env.host)  # NCCL expands only %p here
            template = str(self.log_dir).replace("%", "%%") + f"/nccl.{host}.%p.log"
            path = nccllog.expand_debug_file(template)
            os.environ["NCCL_DEBUG_FILE"] = self.redirected = template
        else:
            return None
        self.nccl_path = path
        if self.on_log_file is not None:
            self.on_log_file(path, "nccl", tee_fd)
        return path

    def _restart(self, command: dict[str, Any], name: str, value: str, step: int,
                 stop_worker: Callable[[int], None]) -> None:
        status = self.restart_status()
        if not status["ok"]:
            self._result(command, name, value, "failed", step + 1,
                         f"cannot restart: {status['reason']}")
            return
        self._persist({name: value or None}, restart_at=step)
        self.checkpoint(step)  # every rank at the same boundary: the save's collectives pair
        self._result(command, name, value, "restarting", step,
                     f"checkpointed after step {step}; restarting for {name}={value}")
        stop_worker(RESTART_EXIT_CODE)

    def _persist(self, values: dict[str, str | None], restart_at: int | None = None) -> None:
        try:
            overrides.write(self.env.job, values, restart_at)
        except OSError as exc:
            self.warnings.once("override-file", "scalemon: could not write the flag override "
                               "file (a restarted worker will not keep the toggled flags): %s",
                               exc)

    def _result(self, command: dict[str, Any], name: str, value: str, outcome: str,
                step: int, text: str, **extra: Any) -> None:
        self.submit("toggle_result", {"id": command["id"], "name": name, "value": value,
                                      "outcome": outcome, "step": step, "text": text[:700],
                                      **extra})


def _planned(command: dict[str, Any]) -> int:
    at = command.get("at_step")
    return at if isinstance(at, int) else 0


def _setenv(name: str, value: str) -> None:
    if value:
        os.environ[name] = value
    else:
        os.environ.pop(name, None)


def nccl_library() -> str | None:
    """Path of the libnccl loaded in this process (from /proc/self/maps), or None. NCCL's own
    plugins (libnccl-net.so, libnccl-tuner.so, libnccl-profiler.so, libnccl-env.so: NCCL
    src/plugin/plugin_open.cc) are mapped later, usually below it, and export no reset."""
    return next((path for path in mapped_libraries("libnccl")
                 if Path(path).name.startswith("libnccl.so")), None)


def loaded_reset() -> tuple[str | None, Callable[[], Any] | None]:
    """The libnccl loaded in this process and its debug-settings reset (each None where
    there is none)."""
    lib = nccl_library()
    return lib, reset_debug_symbol(lib) if lib is not None else None


RESET_SYMBOLS = ("ncclResetDebugInit", "ncclResetDebugInitInternal")
"""What makes NCCL read its debug settings again: the exported function (deprecated since NCCL
2.28.3) and the internal one it calls, exported with default visibility since 2.28.3."""


def reset_debug_symbol(path: str) -> Callable[[], Any] | None:
    """NCCL's `ncclResetDebugInit` (or `ncclResetDebugInitInternal`) in the library at `path`,
    or None."""
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    for name in RESET_SYMBOLS:
        try:
            return getattr(lib, name)
        except AttributeError:
            continue
    return None


def no_reset_why(lib: str) -> str:
    """Why NCCL_DEBUG needs a restart with a libnccl that cannot be told to read it again."""
    return (f"{Path(lib).name} exports no ncclResetDebugInit(): NCCL reads NCCL_DEBUG once, at "
            "its first log line, and a new communicator does not read it again (NCCL "
            "src/debug.cc), so only a restart changes it")


def torch_debug_level() -> str | None:
    """torch.distributed's debug level (OFF, INFO, DETAIL), or None without torch.distributed."""
    try:
        import torch.distributed as dist

        return str(dist.get_debug_level()).rsplit(".", 1)[-1] if dist.is_available() else None
    except Exception:
        return None


def pg_timeout_text() -> str | None:
    """The default process group's timeout in seconds, as text (None outside a job)."""
    seconds = c10d.default_group_timeout_s()
    return None if seconds is None else f"{seconds:g}"


def set_pg_timeout(seconds: float) -> str:
    """Set the timeout of every process group (later operations); returns what was done."""
    groups = c10d.set_timeouts(seconds)
    return f"timeout {seconds:g} s on {groups} process group(s), for their next operations"


def enable_collectives_timing() -> str:
    """Turn collective timing on in every NCCL group; returns what was done."""
    timed = sum(c10d.enable_backend_timing(pg) for pg in c10d.process_groups())
    if timed:
        return f"timing on in {timed} NCCL group(s)"
    return "no NCCL group here (gloo: the agent times collectives on the host already)"
