"""Reading the AMP loss scale from whatever scaler object a script gave to `init(scaler=...)`.

Scripts write one loop for fp16, bf16 and fp32 by building `GradScaler(enabled=dtype ==
float16)`: a disabled `torch.amp.GradScaler` (and `torch.cuda.amp.GradScaler`, which disables
itself on a machine without CUDA) never gets a `_scale` attribute, an enabled one has `_scale`
None until its first `scale()` call, a `ShardedGradScaler` is a subclass, and other frameworks
bring scaler-like objects of their own. Every read here is defensive: a scaler the agent cannot
read costs its loss scale (said once), never the monitor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .warn import Warnings

ON, OFF = "on", "off"
"""`step.scaler`: a scaler whose scale is read, a scaler that is disabled (no loss scaling)."""


class ScaleReader:
    """The loss scale of one scaler object, read on the training thread each `log()`."""

    def __init__(self, scaler: Any, warnings: Warnings) -> None:
        self.scaler = scaler
        self.warnings = warnings
        self.state: str | None = None
        """ON, OFF, or None (no scaler, or one whose scale cannot be read)."""
        self.init_scale: float | None = None
        """The scale before the first step (to tell whether the first step was skipped)."""
        self._attr: str | None = None  # the attribute holding the scale
        if scaler is None:
            return
        try:
            self._inspect(scaler)
        except Exception as exc:  # an object whose attributes raise: no scale, said once
            self._give_up(f"reading it failed: {type(exc).__name__}: {exc}")

    def _inspect(self, scaler: Any) -> None:
        if not _enabled(scaler):
            self.state = OFF
            return
        for attr in ("_scale", "loss_scale", "cur_scale"):  # torch; DeepSpeed / Apex style
            if hasattr(scaler, attr) and not callable(getattr(scaler, attr)):
                self._attr, self.state = attr, ON
                break
        else:
            self._give_up("it has no `_scale` attribute (torch.amp.GradScaler's)")
            return
        init = getattr(scaler, "_init_scale", None)
        if isinstance(init, (int, float)) and not isinstance(init, bool):
            self.init_scale = float(init)

    def reader(self) -> Callable[[], Any] | None:
        """`read`, or None where there is no scale to read (no scaler, a disabled one, one
        that cannot be read): `log()` then skips the call."""
        return self.read if self._attr is not None else None

    def read(self) -> Any:
        """The current scale: a tensor (possibly on the GPU, not read here), a number, or None
        (disabled, not yet initialised, or unreadable)."""
        attr = self._attr
        if attr is None:
            return None
        try:
            value = getattr(self.scaler, attr)
        except Exception as exc:
            self._attr = None
            self._give_up(f"reading `{attr}` failed: {type(exc).__name__}: {exc}")
            return None
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return value
        if getattr(value, "numel", None) is not None and _one_element(value):
            return value
        self._attr = None
        self._give_up(f"its `{attr}` is a {type(value).__name__}, not a number or a "
                      "one-element tensor")
        return None

    def _give_up(self, why: str) -> None:
        self.state = None
        self.warnings.once("scaler", "scalemon: the scaler given to init() (%s) cannot be read: "
                           "%s; its loss scale is shown as n/a, the rest is monitored",
                           type(self.scaler).__name__, why)


def _enabled(scaler: Any) -> bool:
    """False for a scaler that says it is disabled (`is_enabled()`, else `_enabled`)."""
    is_enabled = getattr(scaler, "is_enabled", None)
    if callable(is_enabled):
        return bool(is_enabled())
    enabled = getattr(scaler, "_enabled", True)
    return enabled is not False


def _one_element(value: Any) -> bool:
    try:
        return int(value.numel()) == 1
    except Exception:
        return False
