"""Regenerate the README screenshot from the real app, fed by a simulated 8-GPU job.

    python -m scalemon.tui.screenshot                      # docs/screenshot.svg, 140x44
    python -m scalemon.tui.screenshot --size 80x24 --out /tmp/small.svg
    python -m scalemon.tui.screenshot --rank 5             # the rank detail screen

The job is `sim.SimJob` (deterministic: 8 ranks with AMP, rank 5 reaching the all-reduce
30 ms late), so the picture only changes when the dashboard does.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from scalemon.tui.app import DashboardApp
from scalemon.tui.model import DashboardData
from scalemon.tui.sim import SimJob

REPO_DOCS = Path(__file__).resolve().parents[1] / "docs"


def simulated_app(ranks: int = 8, gpu: bool = True, steps: int = 300,
                  straggler: int | None = 5, seed: int = 7, job: str = "snap"
                  ) -> DashboardApp:
    """The dashboard on a finished fold of a simulated job, with a fixed clock."""
    sim = SimJob(job=job, ranks=ranks, gpu=gpu, amp=gpu, straggler=straggler, seed=seed)
    data = DashboardData()
    data.apply_messages(sim.run(steps))
    data.set_conn("connected", "ipc:///simulated")
    now = sim.end_t(steps) + 0.4
    return DashboardApp(data=data, clock=lambda: now)


async def settle(pilot: object, app: DashboardApp) -> None:
    """Let the app draw once with its plots."""
    for _ in range(30):
        await pilot.pause(0.1)  # type: ignore[attr-defined]
        if app.redraws and app._plots_version == app.data.version:
            break
    await pilot.pause(0.2)  # type: ignore[attr-defined]


async def capture(app: DashboardApp, size: tuple[int, int], rank: int | None) -> str:
    """The SVG of the overview (or of `rank`'s detail) at `size`."""
    async with app.run_test(size=size) as pilot:
        await settle(pilot, app)
        if rank is not None:
            app.open_rank(rank)
            await settle(pilot, app)
        return app.export_screenshot(title="scalemon attach")


def main(argv: list[str] | None = None) -> int:
    """Write the screenshot; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    default = REPO_DOCS / "screenshot.svg" if REPO_DOCS.is_dir() else Path("screenshot.svg")
    p.add_argument("--out", type=Path, default=default)
    p.add_argument("--size", default="140x44", help="terminal size WxH")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--rank", type=int, help="show this rank's detail screen instead")
    args = p.parse_args(argv)
    width, height = (int(v) for v in args.size.lower().split("x"))
    app = simulated_app(ranks=args.ranks, steps=args.steps, job="llm-pretrain-8gpu")
    svg = asyncio.run(capture(app, (width, height), args.rank))
    args.out.write_text(svg)
    print(f"wrote {args.out} ({width}x{height})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
