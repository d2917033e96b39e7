"""The docs point only at what the repository holds: every relative link of README.md and
docs/*.md resolves, and nothing names the project's private notes outside it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
OUTSIDE = ("../shared", "shared/REFERENCE", "REFERENCE.md", "STYLE.md", "shared/seeds")


def _texts() -> dict[Path, str]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("scalemon", "hub", "agent", "tui", "demo_train", "bench", "tests"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return {f: f.read_text() for f in files if f != Path(__file__)}


def test_relative_links_in_the_docs_resolve() -> None:
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            where = (path.parent / target.split("#")[0]).resolve()
            assert where.exists(), f"{path.relative_to(ROOT)} links to {target}: not found"
            assert ROOT in where.parents or where == ROOT, f"{target} is outside the repo"


def test_nothing_names_files_outside_the_repository() -> None:
    for path, text in _texts().items():
        for name in OUTSIDE:
            assert name not in text, f"{path.relative_to(ROOT)} names {name!r}, not in the repo"
