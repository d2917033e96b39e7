"""Regenerate the README screenshot from the real app, fed by a simulated 8-GPU job.

    python -m scalemon.tui.screenshot                      # docs/screenshot.svg, 140x44
    python -m scalemon.tui.screenshot --size 80x24 --out /tmp/small.svg
    python -m scalemon.tui.screenshot --rank 5             # the rank detail screen
    python -m scalemon.tui.screenshot --screen collectives # c: collectives, arrival skew
    python -m scalemon.tui.screenshot --screen hang        # the job hangs: rank 3 never
                                                           # issues the next all-reduce

The job is `sim.SimJob` (deterministic: 8 ranks with AMP, rank 5 reaching the all-reduce
30 ms late), so the picture only changes when the dashboard does.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from textual.pilot import Pilot

from .app import DashboardApp
from .model import DashboardData
from .sim import SimJob

REPO_DOCS = Path(__file__).resolve().parents[1] / "docs"


def simulated_app(ranks: int = 8, gpu: bool = True, steps: int = 300,
                  straggler: int | None = 5, seed: int = 7, job: str = "snap",
                  hang: int | None = None, wrapped: int | None = None) -> DashboardApp:
    """The dashboard on a fold of a simulated job, with a fixed clock; `hang`: the job then
    hangs, that rank never issuing the next all-reduce; `wrapped`: that rank's Flight
    Recorder ring wraps."""
    sim = SimJob(job=job, ranks=ranks, gpu=gpu, amp=gpu, straggler=straggler, seed=seed,
                 wrapped=wrapped)
    data = DashboardData()
    data.apply_messages(sim.run(steps))
    now = sim.end_t(steps) + 0.4
    if hang is not None:
        data.apply_messages(sim.hang(hang, steps, stuck_s=20.0))
        now += 20.0
    data.set_conn("connected", "ipc:///simulated")
    return DashboardApp(data=data, clock=lambda: now)


async def settle(pilot: Pilot[None], app: DashboardApp) -> None:
    """Let the app draw once with its plots."""
    for _ in range(30):
        await pilot.pause(0.1)
        if app.redraws and app.plots_version == app.data.version:
            break
    await pilot.pause(0.2)


async def capture(app: DashboardApp, size: tuple[int, int], rank: int | None,
                  key: str | None = None) -> str:
    """The SVG of the overview (or of `rank`'s detail, or of the screen `key` opens; a hung
    job shows its hang screen by itself) at `size`."""
    async with app.run_test(size=size) as pilot:
        await settle(pilot, app)
        if rank is not None:
            app.open_rank(rank)
            await settle(pilot, app)
        if key is not None:
            await pilot.press(key)
            await settle(pilot, app)
        return app.export_screenshot(title="scalemon attach")


def main(argv: list[str] | None = None) -> int:
    """Write the screenshot; returns the exit code."""
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    default = REPO_DOCS / "screenshot.svg" if REPO_DOCS.is_dir() else Path("screenshot.svg")
    p.add_argument("--out", type=Path, default=default)
    p.add_argument("--size", default="140x44", help="terminal size WxH")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--rank", type=int, help="show this rank's detail screen instead")
    p.add_argument("--screen", choices=("overview", "collectives", "hang"), default="overview",
                   help="collectives: the c screen; hang: a job that hangs (rank 3)")
    args = p.parse_args(argv)
    width, height = (int(v) for v in args.size.lower().split("x"))
    app = simulated_app(ranks=args.ranks, steps=args.steps, job="llm-pretrain-8gpu",
                        hang=3 if args.screen == "hang" else None)
    key = "c" if args.screen == "collectives" else None
    svg = asyncio.run(capture(app, (width, height), args.rank, key))
    args.out.write_text(svg)
    print(f"wrote {args.out} ({width}x{height})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
