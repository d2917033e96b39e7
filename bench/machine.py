"""What machine a benchmark ran on, for its results file (bench scripts import this module from
their own directory)."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name, or what platform knows."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        return re.search(r"model name\s*:\s*(.+)", text).group(1).strip()
    except (OSError, AttributeError):
        return platform.processor() or "unknown CPU"


def cpu_name() -> str:
    """`<model> (<n> CPUs)`."""
    return f"{cpu_model()} ({os.cpu_count()} CPUs)"
