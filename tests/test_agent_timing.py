"""The agent's timing of a step's parts: the optimizer (sampled, closures, wrapped
optimizers) and the all-reduces of DDP buckets, with what the user is told when it cannot."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from conftest import hub_messages
from scalemon.agent.run import Run


def scaled_run_messages(start_hub, job: str, steps: int, inf_at: int) -> list:
    """Train a Linear model with AdamW and a CPU GradScaler for `steps` steps under a Run
    (an inf gradient at step `inf_at`: that step is skipped); returns the hub's messages."""
    hub = start_hub(job)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    run = Run(model, opt, scaler, job=job, hub=hub.address.base, heartbeat_s=0.2)
    x = torch.randn(16, 4)
    for step in range(1, steps + 1):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        if step == inf_at:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        run.log(step, loss=loss.detach(), tokens=16)
    run.finish()
    return hub_messages(hub)


def test_run_reports_steps_optimizer_time_loss_scale_and_skipped_steps(start_hub, zctx):
    msgs = scaled_run_messages(start_hub, "agentA", steps=6, inf_at=3)
    steps = [m.body for m in msgs if m.type == "step"]
    assert [b["step"] for b in steps] == [1, 2, 3, 4, 5, 6]
    assert [b["skipped"] for b in steps] == [False, False, True, False, False, False]
    assert [b["loss_scale"] for b in steps][2:4] == [512.0, 512.0]
    assert steps[-1]["skipped_steps"] == 1
    assert steps[2]["optimizer_time_s"] is None  # GradScaler skipped optimizer.step()
    assert all(b["optimizer_time_s"] > 0 for i, b in enumerate(steps) if i != 2)
    assert steps[1]["step_time_s"] > 0 and steps[0]["tokens"] == 16
    assert all(b["mem_allocated_bytes"] is None for b in steps)  # no GPU: n/a, not 0
    beats = [m.body for m in msgs if m.type == "heartbeat"]
    assert beats and beats[-1]["rss_bytes"] > 0 and beats[-1]["gpu_util_pct"] is None
    assert msgs[0].type == "hello" and msgs[-1].type == "exit"
    assert msgs[-1].body["reason"] == "finished" and msgs[-1].body["exit_code"] == 0
    # nothing dropped; a heartbeat may overtake steps (they wait for their device values on
    # their own queue, so that a stuck GPU cannot hold heartbeats back)
    assert sorted(m.seq for m in msgs) == list(range(len(msgs)))
    assert [m.seq for m in msgs if m.type == "step"] == sorted(
        m.seq for m in msgs if m.type == "step")


def run_ddp_script(hub, tmp_path, job: str, after_init: str = "") -> tuple[str, list, str]:
    """Train a 1-rank gloo DDP Linear model for 5 steps under a Run in a subprocess, with
    `after_init` run right after the Run exists; returns stdout, step bodies, stderr."""

    script = textwrap.dedent(f"""
        import os, time, torch, torch.distributed as dist
        from scalemon.agent.run import Run
        torch.distributed.init_process_group(
            "gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 32))
        opt = torch.optim.AdamW(model.parameters())
        run = Run(model, opt, job={job!r}, hub={hub.address.base!r})
        {after_init}
        x = torch.randn(8, 64)
        for step in range(1, 6):
            t0 = time.time()
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            print("window", step, t0, time.time(), flush=True)
            run.log(step, loss=loss.detach(), tokens=8)
        run.finish()
        dist.destroy_process_group()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    steps = [m.body for m in hub_messages(hub) if m.type == "step"]
    assert [b["step"] for b in steps] == [1, 2, 3, 4, 5]
    return proc.stdout, steps, proc.stderr


def test_ddp_all_reduce_spans_carry_bytes_issue_time_and_duration(start_hub, tmp_path):
    """A 1-rank gloo DDP job: each step reports its all-reduce with the bucket's bytes, a wall
    clock issue time inside the step, and durations that fit inside the step time."""
    out, steps, _ = run_ddp_script(start_hub("agentDDP"), tmp_path, "agentDDP")
    windows = {int(s): (float(a), float(b)) for _, s, a, b in
               (line.split() for line in out.splitlines() if line.startswith("window"))}
    for b in steps:
        start, end = windows[b["step"]]
        assert b["allreduce_count"] == 1  # one bucket for a model this small
        assert b["allreduce_bytes"] == (64 * 32 + 32) * 4
        assert start <= b["allreduce_issue_t"] <= end
        assert 0 < b["allreduce_time_s"] < end - start
        assert 0 < b["optimizer_time_s"] < end - start
        assert 0 < b["agent_time_s"] < 0.01
    assert all(b["step_time_s"] > 0 for b in steps[1:])


def test_a_comm_hook_registered_after_init_is_kept_and_timing_steps_aside(start_hub, tmp_path):
    """DDP takes one comm hook: the script's own, registered after init(), wins; the agent
    says so and goes on without all-reduce timing."""
    register = ("from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import "
                "allreduce_hook; model.register_comm_hook(None, allreduce_hook)")
    _, steps, err = run_ddp_script(start_hub("agentHook"), tmp_path, "agentHook", register)
    assert "all-reduce timing off: the script registered its own DDP comm hook" in err
    assert all(b["allreduce_count"] == 0 and b["allreduce_time_s"] is None for b in steps)
    assert all(b["optimizer_time_s"] > 0 and b["loss"] > 0 for b in steps)


def test_a_failing_all_reduce_timer_is_said_once_and_the_all_reduce_still_runs(start_hub,
                                                                                tmp_path):
    breaks_timing = ("run._comm_timer.events = type('NoEvents', (), "
                     "{'record': lambda self: 1 / 0})()")
    _, steps, err = run_ddp_script(start_hub("agentBrokenHook"), tmp_path, "agentBrokenHook",
                                   breaks_timing)
    assert err.count("timing a DDP bucket's all-reduce failed (ZeroDivisionError") == 1
    assert all(b["allreduce_count"] == 0 and b["loss"] > 0 for b in steps)  # untimed, trained
    assert [b["step"] for b in steps] == [1, 2, 3, 4, 5]


def test_sampled_optimizer_timing_carries_the_last_timed_figure_and_says_from_which_step(
        start_hub, monkeypatch):
    """SCALEMON_OPTIMIZER_TIMING_S (on CUDA 0.5 s by default): only the first step falls in
    the window here, so every later step carries its figure and names it; a step whose
    optimizer did not run (GradScaler skipped it) carries nothing. The hub's rank shows the
    carried figure; the trace export draws the one timed step only."""
    from scalemon.reports import export
    from scalemon.state.jobstate import JobState

    monkeypatch.setenv("SCALEMON_OPTIMIZER_TIMING_S", "1000")
    msgs = scaled_run_messages(start_hub, "agentSample", steps=5, inf_at=3)
    steps = [m.body for m in msgs if m.type == "step"]
    first = steps[0]["optimizer_time_s"]
    assert first > 0 and steps[0]["optimizer_timed_step"] == 1
    assert steps[2]["optimizer_time_s"] is steps[2]["optimizer_timed_step"] is None  # skipped
    for b in (steps[1], steps[3], steps[4]):
        assert (b["optimizer_time_s"], b["optimizer_timed_step"]) == (first, 1)
    state = JobState()
    for m in msgs:
        state.apply(m)
    assert state.ranks[0].value("optimizer_time_s") == first
    doc = export.trace(list(enumerate(msgs)), "agentSample")
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "optimizer"]
    assert [e["args"]["step"] for e in slices] == [1]


def test_a_step_given_a_closure_times_the_update_not_the_forward_and_backward_inside_it(
        start_hub):
    """`optimizer.step(closure)` (Lightning's automatic optimization, LBFGS) runs forward and
    backward inside the step: the optimizer's figure must be the update's, not the closure's
    0.2 s, and while the closure runs the rank's phase says forward-backward. A closure that
    raises leaves no span open, and the next step is timed."""
    hub = start_hub("agentClosure")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = Run(model, opt, job="agentClosure", hub=hub.address.base, heartbeat_s=0.2)
    phases = []

    def closure() -> torch.Tensor:
        phases.append(run.phase.name)
        opt.zero_grad()
        loss = model(torch.randn(2, 4)).pow(2).mean()
        loss.backward()
        time.sleep(0.2)  # a heavy forward and backward
        return loss

    def failing() -> torch.Tensor:
        raise RuntimeError("out of memory in forward")

    t0 = time.perf_counter()
    loss = opt.step(closure=closure)  # as Lightning calls it
    run.log(1, loss=loss.detach())
    with pytest.raises(RuntimeError, match="out of memory"):
        opt.step(failing)
    loss = opt.step(closure)  # positional, as LBFGS examples do
    run.log(2, loss=loss.detach())
    lbfgs = torch.optim.LBFGS(model.parameters(), max_iter=3)
    at_update_end = []  # registered first: runs before the agent's post-hook
    lbfgs.register_step_post_hook(lambda *_: at_update_end.append(run.phase.name))
    run.watch_optimizer(lbfgs)
    lbfgs.step(closure)  # three closure calls: the figure is what followed the last one
    assert at_update_end == ["optimizer"]  # not the last closure's forward-backward
    run.log(3)
    opt.step()  # no closure: the whole step
    run.log(4)
    took = time.perf_counter() - t0
    run.finish()
    steps = [m.body for m in hub_messages(hub) if m.type == "step"]
    assert [b["step"] for b in steps] == [1, 2, 3, 4]
    assert phases and set(phases) == {"forward-backward"}
    for b in steps:
        assert 0 < b["optimizer_time_s"] < 0.1, b
    assert steps[0]["step_time_s"] is None or steps[1]["step_time_s"] >= 0.2
    assert took >= 0.2 * len(phases)  # the closures did run, and took their time


class LightningLikeOptimizer:
    """A wrapper that is no torch optimizer, the real one in `_optimizer` (Lightning's)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def step(self, closure: object = None) -> object:
        return self._optimizer.step(closure)


class Unsteppable:
    """Something passed as an optimizer that wraps none; `optimizer` points at itself."""

    def __init__(self) -> None:
        self.optimizer = self


def test_a_wrapped_optimizer_is_timed_through_the_one_it_wraps_and_none_turns_nothing_off(
        start_hub, caplog):
    """accelerate's, Lightning's and DeepSpeed's wrappers have no step hooks of their own:
    the optimizer inside is timed. Something that wraps none leaves the optimizer's time n/a,
    said once, and the monitor on (it used to switch the whole monitor off)."""
    from scalemon.agent.timing import hookable_optimizer

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped = LightningLikeOptimizer(LightningLikeOptimizer(opt))
    assert hookable_optimizer(wrapped) is opt and hookable_optimizer(opt) is opt
    assert hookable_optimizer(Unsteppable()) is None and hookable_optimizer("adam") is None
    hub = start_hub("agentWrapped")
    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        run = Run(model, wrapped, job="agentWrapped", hub=hub.address.base, heartbeat_s=0.2)
        run.watch_optimizer(Unsteppable())
        run.watch_optimizer(Unsteppable())
        for step in (1, 2):
            model(torch.randn(2, 4)).sum().backward()
            wrapped.step()
            run.log(step)
        run.finish()
    assert not run.disabled
    assert caplog.text.count("Unsteppable is not a torch optimizer") == 1
    steps = [m.body for m in hub_messages(hub) if m.type == "step"]
    assert [b["step"] for b in steps] == [1, 2]
    assert all(b["optimizer_time_s"] > 0 for b in steps)


def test_a_step_number_logged_twice_in_a_row_is_said_once_and_each_call_still_arrives(
        start_hub, caplog):
    """Lightning's `on_train_batch_end` with `trainer.global_step` under gradient accumulation
    logs every step number twice: the user is told once that each call is a step (its step
    time is a micro-batch's), and nothing is dropped."""
    hub = start_hub("agentRepeat")
    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        run = Run(job="agentRepeat", hub=hub.address.base)
        for step in (0, 1, 1, 2, 2, 3):
            run.log(step, loss=float(step))
        run.finish()
    assert caplog.text.count("log() got step 1 twice in a row") == 1
    assert "step 2 twice" not in caplog.text
    steps = [m.body["step"] for m in hub_messages(hub) if m.type == "step"]
    assert steps == [0, 1, 1, 2, 2, 3]


def test_a_bad_optimizer_timing_setting_is_said_and_the_default_kept(monkeypatch, caplog):
    from scalemon.agent.timing import optimizer_timing_every_s
    from scalemon.agent.warn import Warnings

    monkeypatch.setenv("SCALEMON_OPTIMIZER_TIMING_S", "often")
    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        assert optimizer_timing_every_s(True, Warnings()) == 0.5
        assert optimizer_timing_every_s(False, Warnings()) == 0.0
    assert "SCALEMON_OPTIMIZER_TIMING_S='often' is not a number of seconds >= 0" in caplog.text
    monkeypatch.setenv("SCALEMON_OPTIMIZER_TIMING_S", "0")
    assert optimizer_timing_every_s(True, Warnings()) == 0.0
