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
from scalemon.home.jobfile import JobFile
from scalemon.tui.app import DashboardApp
from scalemon.tui.feed import HubFeed
from scalemon.tui.model import DashboardData
from scalemon.tui.screens.collectives import CollectivesScreen
from scalemon.tui.screens.flags import FlagsScreen
from scalemon.tui.screens.hang import HangScreen
from scalemon.tui.screens.log import LogScreen
from scalemon.tui.screens.overview import OverviewScreen
from scalemon.tui.screens.pick_job import PickJobScreen
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
SCREENS = ("overview", "collectives", "rank_detail", "hang", "log", "flags", "hung_overview")
"""hung_overview: the overview of a hung job (Esc from its hang screen): the header's long
hang line."""
NCCL_LINES = ("node0:100:110 [{r}] NCCL INFO Channel 00/02 : 0 1 2 3 4 5 6 7",
              "node0:100:110 [{r}] NCCL INFO AllReduce: opCount 4d2 sendbuff 0x7f3a2c000000 "
              "recvbuff 0x7f3a2c000000 count 6553600 datatype 7 op 0 root 0 comm 0x55d1 "
              "[nranks=8] stream 0x55e2")


def job_app(screen: str, gpu: bool = True) -> DashboardApp:
    """The simulated job of the snapshots for `screen` (the hang: rank 3 never issues the
    next all-reduce; the log: two NCCL lines per rank)."""
    if screen != "log":
        return sim_app(ranks=8 if gpu else 2, gpu=gpu, straggler=5 if gpu else None,
                       hang=3 if screen in ("hang", "hung_overview") else None,
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
    elif screen in ("collectives", "log", "flags", "hung_overview"):
        await pilot.press({"collectives": "c", "log": "L", "flags": "f",
                           "hung_overview": "escape"}[screen])
    await pilot.pause(0.1)
    await settle(pilot, app)
    expected = {"overview": OverviewScreen, "collectives": CollectivesScreen,
                "rank_detail": RankDetailScreen, "hang": HangScreen, "log": LogScreen,
                "flags": FlagsScreen, "hung_overview": OverviewScreen}
    assert isinstance(app.screen, expected[screen])


BLOCKS = "▁▂▃▄▅▆▇█▉▊▋▌▍▎▏"
"""Block glyphs: a plot's or heat map's, a scroll bar's, a border's."""


def graphic(line: str) -> bool:
    """A line of a plot (braille, its legend) or a heat map (its cells, its legend)."""
    return bool(re.search(r"[\u2800-\u28ff]|min\.\.max|███|█ [\d.]+", line))


THUMB = re.compile(f"([{BLOCKS}])\\1? {{0,3}}$")
"""A scrolling widget's vertical thumb at the right edge of a line."""


def assert_no_stray_blocks(lines: list[str], strict: set[int]) -> None:
    """No block glyph outside plots and heat maps: none in the footer (its one separator
    apart), none in the `strict` rows (headers, table headings) and none elsewhere but a
    scrolling widget's thumb at its right edge (a horizontal scroll bar, a screen's thumb
    over the footer are strays)."""
    footer = lines[-1]
    assert [c for c in footer if c in BLOCKS] == ["▏"], footer
    for i, line in enumerate(lines[:-1]):
        if graphic(line):
            continue
        body = line if i in strict else THUMB.sub("", line)
        assert not any(c in BLOCKS for c in body), (i, line)


def assert_no_cut_words(lines: list[str]) -> None:
    """No line cut mid-word ("…" right after a letter or digit), anywhere on the screen."""
    for line in lines:
        assert not re.search(r"\w…", line), line


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
    """Each main screen at 120x35, 80x24 and 60x20: as committed; no word cut to "…" on
    the whole screen, header included; no table heading cut; no stray block glyph; the
    footer's keys whole; the header's facts (state, a hang's culprit, step, stragglers)
    whole; the rank detail never a character per line."""
    app = job_app(screen)

    async def run() -> None:
        async with app.run_test(size=size) as pilot:
            await open_screen(pilot, app, screen)
            text = screen_text(app)
            assert_footer_whole(app, text)
            lines = text.splitlines()
            assert_no_cut_words(lines)
            strict = {0}  # a title or the header's first line
            if screen in ("overview", "hung_overview"):
                at = next(i for i, line in enumerate(lines) if line.startswith(" rank  state"))
                strict |= set(range(at + 1))
                header = " ".join(" ".join(lines[:at]).split())
                assert "job snap  world 8" in lines[0] and "step 300" in header, header
                if screen == "overview":
                    assert "…" not in text, text
                    assert ("stragglers rank 5 +24 ms (arrival at collectives, vs the first "
                            "rank)") in header
                else:  # the state and the culprit first; only what is spared cut, at a word
                    assert "HUNG (h: details): rank 3 never issued all_reduce" in header
                    assert all(line.rstrip().endswith(" …") for line in lines[:at] if "…" in line)
                headings = {w for c in rows.columns() for w in c.heading.split()} | {"→"}
                assert set(lines[at].split()) <= headings, lines[at]  # whole headings only
                assert "→" in lines[at]  # more columns to the right (host at least)
                after = next(line for line in lines[at + 1:] if not re.match(r" +\d+  ", line))
                assert after.startswith("loss"), after  # the rows, then the plots: no stray
                #                                         scroll bar between them
            else:
                assert "…" not in text, text
            if screen == "flags":
                at = next(i for i, line in enumerate(lines) if line.startswith("  flag "))
                strict.add(at)
                assert lines[at].split() == ["flag", "tier", "value"], lines[at]
                assert "not reported" in lines[at + 1]  # the values whole too
            if screen == "hang":
                strict |= {i for i, line in enumerate(lines) if " role " in line}  # a table
                if size[0] >= 120:  # what a rank waits in, on one line
                    assert "default_pg #1234 all_reduce 20 s" in text, text
            if screen == "log":
                hint = next(line for line in lines if line.startswith(" filter:"))
                assert hint.rstrip().endswith("words: text"), hint  # the filter's hint whole
            assert_no_stray_blocks(lines, strict)
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


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_job_picker_fits_and_offers_its_own_keys(size: tuple[int, int], home):
    """The picker at 120x35, 80x24 and 60x20: as committed; its states in one column; its
    footer offers its own keys only (not the job's l c h f L); no border of block glyphs."""
    jobs = [JobFile(job=job, address=f"ipc:///tmp/none{i}", host="node0", pid=100 + i,
                    started=1_700_000_000.0, world_size=2, run_dir="/tmp", protocol=[1, 0],
                    state=state)
            for i, (job, state) in enumerate((("nuend", "finished"), ("nuhang", "crashed"),
                                              ("x", "running")))]
    app = DashboardApp(jobs=jobs, home=home)

    async def run() -> None:
        async with app.run_test(size=size) as pilot:
            await pilot.pause(0.2)
            assert isinstance(app.screen, PickJobScreen)
            text = screen_text(app)
            lines = text.splitlines()
            assert_footer_whole(app, text)
            keys = footer_line(text).split("▏")[0].split()
            assert keys == ["q", "Quit"], footer_line(text)
            at = [next(line.index(state) for line in lines if f" {job} " in line)
                  for job, state in (("nuend", "finished"), ("nuhang", "crashed"),
                                     ("x", "running"))]
            assert len(set(at)) == 1, at
            assert_no_cut_words(lines)
            assert_no_stray_blocks(lines, set(range(len(lines))))
            for key in ("c", "f", "L"):  # nothing of a job's opens over the picker
                await pilot.press(key)
            await pilot.pause(0.1)
            assert isinstance(app.screen, PickJobScreen)
            compare(f"pick_job_{size[0]}x{size[1]}", text, app.export_screenshot())

    asyncio.run(run())


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_starting_job_names_its_id_and_says_torch_imports(size: tuple[int, int], home):
    """A job launched by this dashboard (`scalemon demo`), no hub yet: the header names the
    job and says its ranks import torch, whole, at every width."""
    app = DashboardApp(HubFeed(job="nu4", home=home, retry_s=0.2), clock=lambda: 1000.0)
    app.data.launched_t = 997.0  # as `job_process` sets it

    async def run() -> None:
        async with app.run_test(size=size) as pilot:
            await pilot.pause(0.5)
            await settle(pilot, app)
            lines = screen_text(app).splitlines()
            at = next(i for i, line in enumerate(lines) if line.startswith(" rank"))
            header = " ".join(" ".join(lines[:at]).split())
            assert header.startswith("job nu4 "), header
            assert "starting: the ranks import torch (torchrun launched 3 s ago; the first " \
                   "run takes ~10 s)..." in header, header
            assert_no_cut_words(lines)

    asyncio.run(run())
