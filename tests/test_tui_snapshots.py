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
import re
from pathlib import Path

import pytest
from rich.console import Console
from textual.pilot import Pilot

from scalemon.flags import FLAGS, check
from scalemon.tui.app import DashboardApp
from scalemon.tui.model import DashboardData
from scalemon.tui.screens.collectives import CollectivesScreen
from scalemon.tui.screens.hang import HangScreen
from scalemon.tui.screens.log import LogScreen
from scalemon.tui.screens.overview import OverviewScreen
from scalemon.tui.screens.rank_detail import RankDetailScreen
from scalemon.tui.screenshot import settle, simulated_app
from scalemon.tui.sim import SimJob
from scalemon.tui.views import rows

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


# ---- every main screen at 120x35, 80x24 and 60x20 (issue 38: narrow terminals) -------------

SIZES = ((120, 35), (80, 24), (60, 20))
SCREENS = ("overview", "collectives", "rank_detail", "hang", "log")
NCCL_LINES = ("node0:100:110 [{r}] NCCL INFO Channel 00/02 : 0 1 2 3 4 5 6 7",
              "node0:100:110 [{r}] NCCL INFO AllReduce: opCount 4d2 sendbuff 0x7f3a2c000000 "
              "recvbuff 0x7f3a2c000000 count 6553600 datatype 7 op 0 root 0 comm 0x55d1 "
              "[nranks=8] stream 0x55e2")


def job_app(screen: str, gpu: bool = True) -> DashboardApp:
    """The simulated job of the snapshots for `screen` (the hang: rank 3 never issues the
    next all-reduce; the log: two NCCL lines per rank)."""
    if screen != "log":
        return sim_app(ranks=8 if gpu else 2, gpu=gpu, straggler=5 if gpu else None,
                       hang=3 if screen == "hang" else None,
                       wrapped=2 if screen == "collectives" else None)
    sim = SimJob(job="snap", ranks=8 if gpu else 2, gpu=gpu, amp=gpu, seed=7)
    data = DashboardData()
    data.apply_messages(sim.run(300))
    now = sim.end_t(300) + 0.4
    if gpu:
        data.apply_messages([sim.message(r, "log_lines", {"source": "nccl", "lines": [
            line.format(r=r) for line in NCCL_LINES]}, now - 0.2) for r in range(sim.ranks)])
    data.set_conn("connected", "ipc:///simulated")
    return DashboardApp(data=data, clock=lambda: now)


async def open_screen(pilot: Pilot[None], app: DashboardApp, screen: str) -> None:
    """Show `screen` (a hung job shows the hang screen by itself) and let it draw."""
    await settle(pilot, app)
    if screen == "rank_detail":
        app.open_rank(1)
    elif screen in ("collectives", "log"):
        await pilot.press("c" if screen == "collectives" else "L")
    await pilot.pause(0.1)
    await settle(pilot, app)
    expected = {"overview": OverviewScreen, "collectives": CollectivesScreen,
                "rank_detail": RankDetailScreen, "hang": HangScreen, "log": LogScreen}
    assert isinstance(app.screen, expected[screen])


def footer_line(text: str) -> str:
    """The footer: the last line of the screen."""
    return text.rstrip("\n").splitlines()[-1]


def assert_footer_whole(app: DashboardApp, text: str) -> None:
    """Every key the footer shows is whole (key, space, description) and the palette's key
    is there: none is cut by the edge or by the palette's key."""
    line = footer_line(text)
    assert line.rstrip().endswith("▏^p palette")
    shown = line.split("▏")[0].strip()
    described = [f"{app.get_key_display(b)} {b.description}"
                 for _, b, _, _ in app.screen.active_bindings.values() if b.show]
    for item in shown.split("  "):
        assert item.strip() in described, (item, line)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("screen", SCREENS)
def test_main_screens_fit_the_terminal(screen: str, size: tuple[int, int]):
    """Each main screen at 120x35, 80x24 and 60x20: as committed; no table heading cut to
    "…"; the footer's keys whole; the rank detail never a character per line."""
    app = job_app(screen)

    async def run() -> None:
        async with app.run_test(size=size) as pilot:
            await open_screen(pilot, app, screen)
            text = screen_text(app)
            assert_footer_whole(app, text)
            lines = text.splitlines()
            if screen == "overview":
                at = next(i for i, line in enumerate(lines) if line.startswith(" rank  state"))
                headings = {w for c in rows.columns() for w in c.heading.split()} | {"→"}
                assert set(lines[at].split()) <= headings, lines[at]  # whole headings only
                assert "→" in lines[at]  # more columns to the right (host at least)
                after = next(line for line in lines[at + 1:] if not re.match(r" +\d+  ", line))
                assert after.startswith("loss"), after  # the rows, then the plots: no stray
                #                                         scroll bar between them
            else:
                assert "…" not in text, text
            if screen == "rank_detail":
                facts = lines[1:next(i for i, line in enumerate(lines)
                                     if line.startswith("loss"))]
                assert all(len(line.strip()) != 1 for line in facts), "\n".join(facts)
                assert any("preset=gpt2-124m" in line for line in facts)  # not folded
            compare(f"{screen}_{size[0]}x{size[1]}", text, app.export_screenshot())

    asyncio.run(run())


def test_the_rank_table_scrolls_a_whole_column_at_a_time():
    """80 columns: the columns that do not fit are left out whole, an arrow says so; → brings
    them in, ← goes back."""
    app = job_app("overview")

    async def run() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await settle(pilot, app)

            def heading() -> str:
                return next(line for line in screen_text(app).splitlines()
                            if line.startswith(" rank"))

            first = heading()
            assert first.rstrip().endswith("→") and "←" not in first
            assert "tok/s" not in first
            for _ in range(3):
                await pilot.press("right")
            await pilot.pause(0.2)
            scrolled = heading()
            assert "tok/s" in scrolled and "←" in scrolled and "state" not in scrolled
            words = scrolled.replace("←", " ").replace("→", " ").split()
            assert set(words) <= {w for c in rows.columns() for w in c.heading.split()}
            for _ in range(3):
                await pilot.press("left")
            await pilot.pause(0.2)
            assert heading() == first

    asyncio.run(run())


def test_a_gloo_job_says_why_its_durations_are_missing_once():
    """gloo records no duration: the collectives screen says so once, not on every row."""
    app = job_app("collectives", gpu=False)

    async def run() -> None:
        async with app.run_test(size=(120, 35)) as pilot:
            await open_screen(pilot, app, "collectives")
            text = screen_text(app)
            assert text.count("gloo records no duration") == 1, text
            assert text.count("n/a") >= 4  # the cells still say n/a

    asyncio.run(run())


@pytest.mark.parametrize("gpu", (False, True), ids=("gloo", "nccl"))
def test_the_log_pane_suggests_what_the_backend_has(gpu: bool):
    """No line yet: a gloo-only job is pointed at torch's flags (from the flags panel's
    table), not at NCCL_DEBUG; an NCCL job at NCCL_DEBUG=INFO."""
    sim = SimJob(job="snap", ranks=2, gpu=gpu, amp=gpu, seed=7)
    data = DashboardData()
    data.apply_messages(sim.run(20))
    now = sim.end_t(20) + 0.4
    app = DashboardApp(data=data, clock=lambda: now)

    async def run() -> None:
        async with app.run_test(size=(120, 35)) as pilot:
            await open_screen(pilot, app, "log")
            text = " ".join(screen_text(app).split())
            if gpu:
                assert "toggle NCCL_DEBUG=INFO" in text
                return
            assert "NCCL_DEBUG" not in text and "gloo" in text
            for name, value in (("TORCH_DISTRIBUTED_DEBUG", "DETAIL"),
                                ("TORCH_CPP_LOG_LEVEL", "INFO")):
                assert f"{name}={value} (f: {FLAGS[name].tier})" in text
                assert check(name, value).name == name  # the flags panel can set it

    asyncio.run(run())
