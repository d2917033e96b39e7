"""The logs a rank streams to the hub: NCCL's (NCCL_DEBUG_FILE, copied to stdout where the
agent pointed NCCL at a file of its own) and, once a toggle asks, the process's stderr. Part of
`Run` (agent/run.py); the followers themselves are in agent/logtail.py."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scalemon.home.paths import run_dir

from . import flags as _flags
from .flags import FlagControl
from .libs import flush_c_stdio
from .warn import Warnings


class RankLogs:
    """Follows this rank's logs; `control` (the rank's FlagControl) is set once it is made,
    as it calls back into `follow_log` and `nccl_probe`."""

    def __init__(self, submit: Callable[[str, dict[str, Any]], Any], warnings: Warnings,
                 host: str, pid: int, steps_logged: Callable[[], int]) -> None:
        self._submit = submit
        self.warnings = warnings
        self.host = host
        self.pid = pid
        self._steps_logged = steps_logged
        self.control: FlagControl = None  # type: ignore[assignment]  # set by Run
        self._logs: Any = None  # a LogFollower, once a log is followed
        self._stderr: Any = None
        self._nccl_tee: int | None = None  # a dup of fd 1 NCCL's redirected lines go to

    def follow_nccl(self, toggled: bool) -> None:
        """NCCL_DEBUG is set at start: follow NCCL's lines from the first. Without a
        NCCL_DEBUG_FILE of the user's, point it at a file in the run directory and copy its
        lines to stdout (fd 1), where the user expects them; `toggled`: NCCL_DEBUG came from a
        toggle before a restart (not copied: the launch did not ask for them on stdout).
        NCCL reads NCCL_DEBUG_FILE at its first log line; where libnccl is loaded and may have
        logged already, ncclResetDebugInit() makes it open the file for its next line."""
        control = self.control
        ours = not os.environ.get("NCCL_DEBUG_FILE")
        tee = None
        try:
            tee = os.dup(1) if ours and not toggled else None
            path = control.nccl_file(tee)
            if path is None or not ours:
                return
            if self._logs is None or not self._logs.following(path):
                os.environ.pop("NCCL_DEBUG_FILE", None)  # nothing would read it: stdout stays
                control.redirected = control.nccl_path = None
                return
            self._nccl_tee, tee = tee, None
            _, reset = _flags.loaded_reset()
            if reset is not None:
                flush_c_stdio()  # NCCL's lines so far, before the copies of the later ones
                reset()
        except Exception as exc:  # NCCL's lines stay where NCCL writes them
            self.warnings.once("nccl-log", "scalemon: not following NCCL's log: %s", exc)
        finally:
            if tee is not None:
                os.close(tee)

    def restore_nccl_stdout(self) -> None:
        """At the end: where the agent pointed NCCL's lines at a file copied to stdout, point
        them back at stdout (the thread that copies them ends)."""
        control = self.control
        path, template = control.nccl_path, control.redirected
        if self._nccl_tee is None or template is None:
            return
        if os.environ.get("NCCL_DEBUG_FILE") != template:
            return
        lib, reset = _flags.loaded_reset()
        if reset is None and lib is not None:
            self.warnings.once("nccl-restore", "scalemon: NCCL's lines after the monitor ended "
                               "go to %s only (%s cannot be told to write to stdout again)",
                               path, Path(lib).name)
            return
        os.environ.pop("NCCL_DEBUG_FILE", None)
        control.redirected = None
        if reset is not None:
            reset()

    def nccl_probe(self, command: dict[str, Any], step: int, text: str) -> bool:
        """After an applied NCCL_DEBUG toggle: in PROBE_S, report how many NCCL lines came
        (a follow-up `toggle_result` with `log_lines`, from the follower thread)."""
        from . import nccllog

        level, subsys = os.environ.get("NCCL_DEBUG"), os.environ.get("NCCL_DEBUG_SUBSYS")
        path, loaded = self.control.nccl_path, _flags.nccl_library() is not None
        steps_before = self._steps_logged() + 1  # the step being logged is counted after this
        body = {"id": command["id"], "name": str(command.get("flag")),
                "value": str(command.get("value", "")), "outcome": "applied", "step": step}

        def report(lines: int) -> None:
            said = nccllog.probe_text(lines, nccllog.PROBE_S,
                                      steps=self._steps_logged() - steps_before, level=level,
                                      subsys=subsys, nccl_loaded=loaded, path=path)
            self._submit("toggle_result", {**body, "text": said, "log_lines": lines,
                                                 "log_window_s": nccllog.PROBE_S})

        return self.follower().probe("nccl", nccllog.PROBE_S, report)

    def follow_log(self, path: Path, source: str, tee_fd: int | None = None) -> bool:
        """Stream new lines of `path` to the hub (NCCL_DEBUG_FILE); copy them to `tee_fd`.
        Called just before NCCL is reset: where `path` is followed already, what NCCL wrote so
        far is read now, as NCCL opens the file again with mode "w" (at once before 2.27, at
        its next line since), emptying it."""
        if self._logs is not None and self._logs.following(path):
            self._logs.read_now(path, 0.2)
            return True
        try:
            fresh = written_since_start(path)  # an older file's lines are another run's
            return self.follower().follow(path, source, from_start=fresh, tee_fd=tee_fd)
        except Exception as exc:  # the log stays in its file; training goes on
            self.warnings.once("follow-log", "scalemon: not streaming %s: %s", path, exc)
            return False

    def close_nccl_tee(self) -> None:
        """Close the copy of fd 1 once the follower surely no longer writes to it."""
        path, tee = self.control.nccl_path, self._nccl_tee
        if tee is not None and path is not None and self._logs.unfollow(path, 1.0):
            self._nccl_tee = None
            os.close(tee)

    def follower(self) -> Any:
        """The LogFollower streaming this rank's logs, made on first use."""
        if self._logs is None:
            from .logtail import LogFollower

            self._logs = LogFollower(self._submit, self.warnings)
        return self._logs

    def capture_stderr(self) -> None:
        """Stream this process's stderr (torch's C++ and debug output) to the hub as well."""
        log_dir = self.control.log_dir
        if self._stderr is not None or log_dir is None:
            return
        try:
            from .logtail import StderrCapture

            self._stderr = StderrCapture()
            self._stderr.start(log_dir / f"stderr.{self.host}.{self.pid}.log",
                               self.follower())
        except Exception as exc:
            self.warnings.once("capture-stderr", "scalemon: not streaming stderr: %s", exc)

    def stop(self) -> None:
        """At the end: a last read of every log; NCCL's lines go back to stdout."""
        if self._stderr is not None:
            self._stderr.stop()
        self.restore_nccl_stdout()
        if self._logs is not None:
            self._logs.stop()  # a last read of the logs
            self.close_nccl_tee()


def log_dir(job: str) -> Path | None:
    """The job's run directory on this node, where NCCL's and torch's logs are written."""
    try:
        from scalemon.home.safefs import private_dir

        return private_dir(run_dir(job))
    except Exception:
        return None


def written_since_start(path: Path) -> bool:
    """True unless `path` exists and was last written before this process started."""
    try:
        import psutil

        return os.stat(path).st_mtime >= psutil.Process().create_time() - 1.0
    except Exception:  # absent, or no psutil: from its start
        return True
