"""What a demo training run measured: the throughput clock between host sync points, the
summary printed at the end (tokens/s, MFU, measured memory) and rank 0's --stats-json file."""

from __future__ import annotations

import json
from typing import Any

import torch

from scalemon import throughput

from .train_setup import Trainer, print0


class SyncClock:
    """Throughput between host sync points, by scalemon's one definition of tokens/s
    (`scalemon.throughput.tokens_per_s`: tokens over the wall time between step ends, what the
    dashboard, `snapshot` and `summary` show). Without a sync the host runs ahead of the GPU,
    so a step ends for this clock at a logged step's loss read; every second between two of
    them counts, --step-delay sleeps included (the monitor's `step_time_s` has them too)."""

    def __init__(self, step: int, now: float) -> None:
        self.step, self.t = step, now
        self.intervals: list[tuple[int, int, float]] = []  # (logged step, steps, seconds)

    def lap(self, step: int, now: float) -> tuple[int, float]:
        """Close the interval at logged step `step` (right after its sync): (steps, seconds)."""
        steps, seconds = step - self.step, max(1e-9, now - self.t)
        self.intervals.append((step, steps, seconds))
        self.step, self.t = step, now
        return steps, seconds

    def tokens_per_s(self, tokens_per_step: int) -> float | None:
        """Over the whole run, without the first interval (warm-up, compilation; the
        monitor's first step has no step time either) when there are others."""
        measured = self.intervals[1:] or self.intervals
        return throughput.tokens_per_s(tokens_per_step * sum(n for _, n, _ in measured),
                                       sum(s for _, _, s in measured)) if measured else None


def finish(t: Trainer, stats: dict[str, list], clock: SyncClock, code: int) -> None:
    """Throughput summary, measured memory (GPU), stats file, monitor exit."""
    env = t.env
    tokens_per_s = clock.tokens_per_s(t.tokens_per_step)
    stats["intervals"] = [list(interval) for interval in clock.intervals]
    summary: dict[str, Any] = {"tokens_per_s_per_rank": tokens_per_s}
    if tokens_per_s is not None:
        mfu = (f", MFU {100 * t.flops_per_token * tokens_per_s / t.peak_flops:.1f}%"
               if t.peak_flops else ", MFU n/a (device peak unknown)")
        print0(env, f"throughput: {tokens_per_s:,.0f} tokens/s per rank (wall time between "
                    "step ends), "
                    f"{tokens_per_s * t.layout.dp:,.0f} in all (over {t.layout.dp} data-parallel "
                    f"replica(s)){mfu}")
    if env.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(env.device)
        summary["mem_peak_bytes"] = peak
        print0(env, f"memory: estimate {t.memory.total / 2**20:.1f} MiB, measured peak "
                    f"{peak / 2**20:.1f} MiB allocated ({peak / t.memory.total:.2f}x)")
        if t.monitor is not None:
            t.monitor.info("memory_measured", {"peak_allocated": peak,
                                               "estimate": t.memory.total})
    if t.args.stats_json and env.rank == 0:
        write_stats(t, stats, summary)
    if t.monitor is not None:
        t.monitor.finish(code)


def write_stats(t: Trainer, stats: dict[str, list], summary: dict[str, Any]) -> None:
    """Rank 0's per-step record, for tests and bench/ (step_times_s as before)."""
    out: dict[str, Any] = {**stats, **summary}
    out.update(
        world_size=t.env.world_size, tokens_per_step=t.tokens_per_step,
        flops_per_token=t.flops_per_token, peak_flops=t.peak_flops,
        memory_estimate=t.memory.as_dict(), config=t.state.config,
        device=torch.cuda.get_device_name(t.env.device) if t.env.device.type == "cuda" else "cpu",
    )
    if t.monitor is not None:  # the agent's own cost, for bench/agent_overhead.py
        out["agent_time_total_s"] = t.monitor.agent_time_total_s
        out["agent_steps"] = t.monitor.steps_logged
        recorder = getattr(t.monitor, "recorder", None)  # its background thread's reads
        out["recorder_read_s"] = recorder.read_s if recorder is not None else None
        out["recorder_entries"] = recorder.entries if recorder is not None else None
    with open(t.args.stats_json, "w") as f:
        json.dump(out, f)
