"""The scalemon agent: embed it in each training rank.

    import scalemon.agent as sm
    sm.init(model=model, optimizer=optimizer, scaler=scaler)   # after init_process_group
    sm.log(step=step, loss=loss, tokens=tokens)                # once per optimizer step
    sm.finish()                                                # at the end

torch is imported only when `init` is called, so the protocol-level pieces stay light; it must be
installed though (`pip install 'scalemon[agent]'`): without it this import says so.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Any

MISSING_TORCH = ("scalemon.agent needs torch, which this install of scalemon lacks: "
                 "pip install 'scalemon[agent]' (torch and nvidia-ml-py) where the job trains")
"""What `import scalemon.agent` says without torch (the base install is the login node's)."""

if importlib.util.find_spec("torch") is None:  # looked up, not imported: init imports it
    raise ImportError(MISSING_TORCH, name="torch")

from . import overrides  # noqa: E402 (after the check: a broken install stops at its cause)

if TYPE_CHECKING:
    from .run import Run

overrides.apply_at_import()  # before the script imports torch, where it imports us first

_logger = logging.getLogger("scalemon.agent")
_run: Run | None = None


def init(
    model: Any = None, optimizer: Any = None, scaler: Any = None, **options: Any
) -> Run | None:
    """Start monitoring this rank; returns the `Run` (None if the monitor could not start).

    Options: job, hub (address), config (dict), time_collectives, heartbeat_s,
    checkpoint (`fn(step)` saving the state after `step`: lets a restart-tier flag toggle
    restart the job without losing a step), on_new_communicator (`fn(flag_names)` moving the
    script's work to new process groups at a step boundary, returning what it did in words),
    mesh (the job's DeviceMesh: this rank's coordinates in it; without it they are found
    from the process groups a DeviceMesh makes).
    """
    global _run
    if _run is not None:
        return _run
    try:
        from .run import Run

        _run = Run(model, optimizer, scaler, **options)
    except Exception as exc:  # a broken monitor never stops training
        _logger.warning("scalemon: monitor not started: %s: %s", type(exc).__name__, exc)
        _run = None
    return _run


def log(step: int, loss: Any = None, tokens: int | None = None, **extra: Any) -> None:
    """Report one step through the current run (no-op without `init`)."""
    if _run is not None:
        _run.log(step, loss, tokens, **extra)


def info(key: str, value: Any) -> None:
    """Send a named fact about the run (no-op without `init`)."""
    if _run is not None:
        _run.info(key, value)


def describe_pipeline(schedule: str, stages: int, microbatches: int,
                      virtual_stages: int | None = None) -> None:
    """Say how the job pipelines: `Run.describe_pipeline` of the current run (no-op without
    `init`)."""
    if _run is not None:
        _run.describe_pipeline(schedule, stages, microbatches, virtual_stages)


def finish(exit_code: int = 0) -> None:
    """Flush and close the current run (no-op without `init`)."""
    global _run
    if _run is not None:
        _run.finish(exit_code)
        _run = None


def restart_step() -> int | None:
    """The step a flag toggle's restart checkpointed at, when this worker is the restart after
    it (the script resumes from that checkpoint); None otherwise."""
    return overrides.restart_step


def current() -> Run | None:
    """The active run, if any."""
    return _run
