"""The scalemon agent: embed it in each training rank.

    import scalemon.agent as sm
    sm.init(model=model, optimizer=optimizer, scaler=scaler)   # after init_process_group
    sm.log(step=step, loss=loss, tokens=tokens)                # once per optimizer step
    sm.finish()                                                # at the end

torch is imported only when `init` is called, so the protocol-level pieces stay light.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .run import Run

_logger = logging.getLogger("scalemon.agent")
_run: Run | None = None


def init(
    model: Any = None, optimizer: Any = None, scaler: Any = None, **options: Any
) -> Run | None:
    """Start monitoring this rank; returns the `Run` (None if the monitor could not start).

    Options: job, hub (address), config (dict), time_collectives, heartbeat_s.
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


def finish(exit_code: int = 0) -> None:
    """Flush and close the current run (no-op without `init`)."""
    global _run
    if _run is not None:
        _run.finish(exit_code)
        _run = None


def current() -> Run | None:
    """The active run, if any."""
    return _run
