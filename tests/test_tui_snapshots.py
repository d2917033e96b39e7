"""Snapshots of the overview, rank detail, collectives and hang screens at fixed terminal
sizes.

Each snapshot is stored twice under tests/snapshots/: `.txt` (the screen as text: readable
diffs) and `.svg` (colours and styles too; open it in a browser to review). Both must match.
After a deliberate change, regenerate with `SCALEMON_UPDATE_SNAPSHOTS=1 pytest
tests/test_tui_snapshots.py`, then look at every changed `.svg` before committing it.
The data is a deterministic simulated job and the clock is fixed.
"""

from __future__ import annotations

import asyncio
import difflib
import io
import os
from pathlib import Path

import pytest
from rich.console import Console

from scalemon.tui.app import DashboardApp
from scalemon.tui.screens.collectives import CollectivesScreen
from scalemon.tui.screens.hang import HangScreen
from scalemon.tui.screens.rank_detail import RankDetailScreen
from scalemon.tui.screenshot import settle, simulated_app

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("SCALEMON_UPDATE_SNAPSHOTS") == "1"


def sim_app(ranks: int, gpu: bool, straggler: int | None = None, hang: int | None = None,
            wrapped: int | None = None) -> DashboardApp:
    return simulated_app(ranks=ranks, gpu=gpu, steps=300, straggler=straggler, seed=7,
                         hang=hang, wrapped=wrapped)


def screen_text(app: DashboardApp) -> str:
    """The current screen as plain text, one line per terminal row."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True,
                      color_system=None, record=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(
        full=True, screen_stack=app._background_screens))
    return console.export_text()


def compare(name: str, text: str, svg: str) -> None:
    txt_path, svg_path = SNAPSHOTS / f"{name}.txt", SNAPSHOTS / f"{name}.svg"
    if UPDATE or not txt_path.exists():
        SNAPSHOTS.mkdir(exist_ok=True)
        txt_path.write_text(text)
        svg_path.write_text(svg)
        if not UPDATE:
            pytest.fail(f"new snapshot {txt_path.name} written: review {svg_path} and re-run")
        return
    expected = txt_path.read_text()
    if text != expected:
        (SNAPSHOTS / f"{name}.new.svg").write_text(svg)
        diff = "\n".join(difflib.unified_diff(expected.splitlines(), text.splitlines(),
                                              "expected", "actual", lineterm=""))
        pytest.fail(f"{name}: screen text differs (new SVG: {name}.new.svg)\n{diff}")
    if svg != svg_path.read_text():
        (SNAPSHOTS / f"{name}.new.svg").write_text(svg)
        pytest.fail(f"{name}: same text, different colours or styles: compare {svg_path.name}"
                    f" with {name}.new.svg")


def test_overview_gpu_job_with_a_straggler_120x40():
    app = sim_app(ranks=8, gpu=True, straggler=5)

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot, app)
            compare("overview_gpu_120x40", screen_text(app), app.export_screenshot())

    asyncio.run(run())


def test_overview_cpu_job_80x24():
    app = sim_app(ranks=2, gpu=False)

    async def run() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await settle(pilot, app)
            compare("overview_cpu_80x24", screen_text(app), app.export_screenshot())

    asyncio.run(run())


def test_rank_detail_120x40():
    app = sim_app(ranks=8, gpu=True, straggler=5)

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot, app)
            app.open_rank(5)
            await pilot.pause(0.1)
            assert isinstance(app.screen, RankDetailScreen)
            await settle(pilot, app)
            compare("rank_detail_120x40", screen_text(app), app.export_screenshot())

    asyncio.run(run())


def test_collectives_120x40():
    app = sim_app(ranks=8, gpu=True, straggler=5, wrapped=2)

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot, app)
            await pilot.press("c")
            await pilot.pause(0.1)
            assert isinstance(app.screen, CollectivesScreen)
            await settle(pilot, app)
            compare("collectives_120x40", screen_text(app), app.export_screenshot())

    asyncio.run(run())


def test_hang_120x40():
    """The job hangs (rank 3 never issues the next all-reduce): the hang screen by itself."""
    app = sim_app(ranks=8, gpu=True, straggler=5, hang=3)

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot, app)
            assert isinstance(app.screen, HangScreen)
            await settle(pilot, app)
            compare("hang_120x40", screen_text(app), app.export_screenshot())

    asyncio.run(run())
