"""`pip install scalemon` (CLI, hub, dashboard, relay) needs no numpy, torch or triton: the
modules those commands load must not import them. Checked in a fresh interpreter, since this
test process may have them loaded already."""

from __future__ import annotations

import json
import subprocess
import sys

MODULES = ("scalemon.cli.main", "scalemon.hub.main", "scalemon.hub.server", "scalemon.tui.app",
           "scalemon.tui.attach", "scalemon.state.fold", "scalemon.state.series")
HEAVY = ("numpy", "torch", "triton")

PROBE = f"""
import importlib, json, sys
for name in {MODULES!r}:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))
"""


def test_cli_hub_and_dashboard_modules_import_no_numpy_torch_or_triton():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    heavy = json.loads(out.strip().splitlines()[-1])
    assert heavy == [], f"importing {', '.join(MODULES)} loaded {heavy[:10]}"


def test_the_probe_sees_a_heavy_import():
    """The check can fail: a module that imports numpy is reported."""
    probe = PROBE.replace("print(", "import numpy\nprint(", 1)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "numpy" in json.loads(out.strip().splitlines()[-1])
