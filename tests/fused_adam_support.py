"""What the FusedAdamW tests share: a counting stand-in for the kernel launch, the torch ops a
call records, and running a script with compiled (not interpreted) Triton kernels.

It imports the optimizer, and so triton: tests/conftest.py sets TRITON_INTERPRET=1 before any
test module imports it (this module sets the same default for a script run without pytest).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import collections
import subprocess
import sys
from collections.abc import Callable

import pytest
from torch.profiler import ProfilerActivity, profile

from scalemon.demo_train import adam_plan


class LaunchStub:
    """Stands in for the kernel launch, counting calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        monkeypatch.setattr(adam_plan.Plan, "launch", self._launch)

    def _launch(self, *args: object) -> None:
        self.calls += 1


def torch_ops_in(fn: Callable[[], object]) -> collections.Counter:
    """torch ops recorded while ``fn`` runs (the step's own record_function left out)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(
        e.name for e in prof.events() if not e.name.startswith("Optimizer.")
    )


def run_compiled(script: str, timeout: float = 600) -> None:
    """Run ``script`` in a fresh interpreter with TRITON_INTERPRET=0; fail the test, showing
    its output, unless it exits 0."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
