"""The agent inside a training process: identity, non-blocking sending, metrics, failures."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from conftest import hub_messages, wait_for
from scalemon.agent.env import read_rank_env
from scalemon.agent.run import Run
from scalemon.agent.transport import Sender
from scalemon.link.client import HubClient


def test_rank_env_from_torchrun_slurm_and_single():
    tr = read_rank_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                        "TORCHELASTIC_RUN_ID": "5f0c-aa11-22", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert (tr.rank, tr.world_size, tr.local_rank, tr.restart_count) == (3, 4, 1, 2)
    assert tr.job == "tr-5f0caa1122" and tr.launcher == "torchrun"
    slurm = read_rank_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                           "SLURM_JOB_ID": "991", "SLURM_STEP_ID": "0"})
    assert (slurm.rank, slurm.world_size, slurm.job) == (5, 8, "slurm-991.0")
    single = read_rank_env({})
    assert (single.rank, single.world_size, single.launcher) == (0, 1, "single")
    assert read_rank_env({"SCALEMON_JOB_ID": "mine", "RANK": "0", "WORLD_SIZE": "1"}).job == "mine"


def test_rank_env_knows_its_node_and_how_many_nodes_the_job_spans():
    one = read_rank_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert (one.node_rank, one.nodes, one.multi_node) == (0, 1, False)
    tr = read_rank_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "GROUP_RANK": "2",
                        "GROUP_WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                        "TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "gpu-a01.cluster",
                        "MASTER_PORT": "29500", "SCALEMON_NODE": "gpu-a03"})
    assert (tr.node_rank, tr.nodes, tr.multi_node, tr.host) == (2, 4, True, "gpu-a03")
    assert tr.job == "gpua01-29500"  # the same on every node, without a --rdzv-id
    no_group = read_rank_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert no_group.nodes == 2
    slurm = read_rank_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_NODEID": "1",
                           "SLURM_NNODES": "2", "SLURM_JOB_ID": "7"})
    assert (slurm.node_rank, slurm.nodes, slurm.job) == (1, 2, "slurm-7")


def test_a_spawned_rank_takes_its_identity_from_its_process_group(monkeypatch, caplog):
    """mp.spawn children have no RANK/WORLD_SIZE: once their group exists, rank and world
    size come from it and every rank of the node derives one job id (parent pid and port);
    before it, the process is monitored as a single one and told once what to change."""
    from scalemon.agent.env import rank_env_from_group
    from scalemon.agent.torchdist import identity_from_group
    from scalemon.agent.warn import Warnings

    single = read_rank_env({"SCALEMON_NODE": "gpu-a01.cluster"})
    ranks = [rank_env_from_group(single, r, 4, 777, {"MASTER_PORT": "29500"}) for r in range(4)]
    assert [(e.rank, e.world_size, e.local_rank) for e in ranks] == [(r, 4, r) for r in range(4)]
    assert {e.job for e in ranks} == {"gpu-a01-777-29500"} and ranks[0].launcher == "spawn"
    assert not ranks[0].multi_node
    named = rank_env_from_group(single, 1, 2, 777, {"SCALEMON_JOB_ID": "mine", "LOCAL_RANK": "0"})
    assert (named.job, named.local_rank) == ("mine", 0)
    with pytest.raises(ValueError, match="rank 2 is outside its world size 2"):
        rank_env_from_group(single, 2, 2, 777, {})
    # the imagenet example under SLURM: one srun task per node spawns a process per GPU, and
    # each inherits its task's SLURM_PROCID/SLURM_NTASKS (rank 1 of 2 on node 1)
    task = read_rank_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NODEID": "1",
                          "SLURM_NNODES": "2", "SLURM_JOB_ID": "7", "SLURM_LOCALID": "0"})
    gpu2 = rank_env_from_group(task, 6, 8, 777, {"SLURM_JOB_ID": "7"})
    assert (gpu2.rank, gpu2.world_size, gpu2.local_rank) == (6, 8, 2)
    assert (gpu2.job, gpu2.node_rank, gpu2.nodes, gpu2.multi_node) == ("slurm-7", 1, 2, True)
    torchrun = read_rank_env({"RANK": "1", "WORLD_SIZE": "2"})
    assert identity_from_group(torchrun, Warnings()) is torchrun  # the environment wins
    import multiprocessing

    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())
    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        warnings = Warnings()
        assert identity_from_group(single, warnings) is single  # no group in this process
        assert identity_from_group(single, warnings) is single
        assert identity_from_group(torchrun, warnings) is torchrun  # a world of 2: no word
    assert caplog.text.count("call scalemon.agent.init() after init_process_group()") == 1


def test_rank_env_rejects_nonsense_with_a_clear_message():
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        read_rank_env({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="rank 4 is outside world size 2"):
        read_rank_env({"RANK": "4", "WORLD_SIZE": "2"})


def test_sender_without_hub_drops_and_counts_instead_of_waiting(home):
    sender = Sender(f"ipc://{home}/nobody.sock", "j", 0, max_queue=50, socket_hwm=20,
                    close_timeout_s=0.2)
    accepted = sum(sender.submit("heartbeat", {"phase": "x", "dropped": 0}) for _ in range(20000))
    refused = 20000 - accepted
    assert refused > 0  # the bounded queue said no instead of growing
    wait_for(lambda: sender.queued == 0, timeout=5)
    # no peer: the socket holds at most its high-water mark; everything else is counted
    assert 0 < sender.sent <= 2 * 20
    assert sender.dropped >= refused
    assert sender.sent + sender.dropped == 20000  # every message is either sent or counted
    start = time.monotonic()
    sender.close()
    assert time.monotonic() - start < 3


def train_steps(run: Run, model, opt, scaler, steps: int, inf_at: int | None = None) -> None:
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


def test_run_reports_steps_optimizer_time_loss_scale_and_skipped_steps(start_hub, zctx):
    hub = start_hub("agentA")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    run = Run(model, opt, scaler, job="agentA", hub=hub.address.base, heartbeat_s=0.2)
    train_steps(run, model, opt, scaler, steps=6, inf_at=3)
    run.finish()
    msgs = hub_messages(hub)
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


def test_loss_values_arrive_exactly(start_hub):
    hub = start_hub("agentB")
    run = Run(job="agentB", hub=hub.address.base)
    losses = [torch.tensor(v) for v in (2.5, float("nan"), 1e-30)]
    for i, loss in enumerate(losses, 1):
        run.log(i, loss=loss)
    run.log(4, loss=None)
    run.finish()
    state = wait_for(lambda: (s := HubClient(hub.address).state()["state"])["ranks"]
                     and s["ranks"][0]["state"] == "finished" and s)
    from scalemon import protocol

    records, _ = HubClient(hub.address).fetch(0)
    got = [protocol.decode(r).body.get("loss") for r in records]
    got = [g for g, r in zip(got, records, strict=True) if protocol.decode(r).type == "step"]
    assert got[0] == 2.5 and got[1] != got[1] and got[2] == pytest.approx(1e-30)
    assert got[3] is None
    assert state["ranks"][0]["step"] == 4


def test_numpy_and_tensor_values_are_sent_and_bad_ones_dropped_with_a_warning(start_hub, caplog):
    """Plain-able values go through; an extra value that cannot be sent is left out of its
    step (said once), and an invalid info message is dropped and counted."""
    import numpy as np


    hub = start_hub("agentD")
    run = Run(job="agentD", hub=hub.address.base)
    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        run.log(np.int64(1), loss=torch.tensor(2.0), tokens=np.int32(64),
                grad_norm=torch.tensor(0.5), lr=np.float32(0.25), weights=torch.ones(3),
                one=torch.ones(1, 1), thing=object())
        run.info("bad", {1: "int key"})  # the hub would refuse it: dropped here, said why
        run.log(2, loss=1.5, tokens=64)
        run.finish()
    assert not run.disabled
    assert "invalid info message" in caplog.text and "non-string key" in caplog.text
    assert "log(weights=...) is of type Tensor" in caplog.text
    assert "log(thing=...) is of type object" in caplog.text
    msgs = hub_messages(hub)
    steps = [m.body for m in msgs if m.type == "step"]
    assert [b["step"] for b in steps] == [1, 2]
    assert steps[0]["tokens"] == 64
    assert steps[0]["extra"] == {"grad_norm": 0.5, "lr": 0.25, "one": 1.0}
    assert [m.type for m in msgs].count("info") == 0
    assert run.sender.dropped == 1


class ExplodingOptimizer(torch.optim.SGD):
    def register_step_pre_hook(self, hook):
        raise RuntimeError("hook registry is broken")


def test_a_broken_monitor_switches_itself_off_and_training_goes_on(home, caplog):
    model = torch.nn.Linear(2, 2)
    opt = ExplodingOptimizer(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        run = Run(model, opt, job="broken", hub=f"ipc://{home}/nohub")
        for step in range(3):
            loss = model(torch.ones(1, 2)).sum()
            loss.backward()
            opt.step()
            run.log(step, loss=loss)
        run.finish()
    assert run.disabled
    warnings = [r for r in caplog.records if "monitoring disabled" in r.getMessage()]
    assert len(warnings) == 1 and "hook registry is broken" in warnings[0].getMessage()


def test_init_with_unusable_settings_returns_none_and_does_not_raise(home, monkeypatch, caplog):
    import scalemon.agent as sm

    monkeypatch.setenv("SCALEMON_HUB", "carrier-pigeon://nowhere")
    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        assert sm.init() is None
    sm.log(1, loss=1.0)  # no-ops without a run
    sm.finish()
    assert "must start with ipc:// or tcp://" in caplog.text


def test_uncaught_exception_reports_exited_with_the_error(start_hub):
    hub = start_hub("agentC")
    script = textwrap.dedent(f"""
        import scalemon.agent as sm
        run = sm.init(job="agentC", hub={hub.address.base!r})
        run.log(1, loss=1.0)
        raise RuntimeError("out of patience")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and "out of patience" in proc.stderr
    view = wait_for(lambda: (r := HubClient(hub.address).state()["state"]["ranks"])
                    and r[0]["state"] == "exited" and r[0])
    assert view["exit_code"] == 1 and "out of patience" in view["error"]
    assert view["step"] == 1


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


def test_sampled_optimizer_timing_carries_the_last_timed_figure_and_says_from_which_step(
        start_hub, monkeypatch):
    """SCALEMON_OPTIMIZER_TIMING_S (on CUDA 0.5 s by default): only the first step falls in
    the window here, so every later step carries its figure and names it; a step whose
    optimizer did not run (GradScaler skipped it) carries nothing. The hub's rank shows the
    carried figure; the trace export draws the one timed step only."""
    from scalemon.reports import export
    from scalemon.state.jobstate import JobState

    monkeypatch.setenv("SCALEMON_OPTIMIZER_TIMING_S", "1000")
    hub = start_hub("agentSample")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    run = Run(model, opt, scaler, job="agentSample", hub=hub.address.base, heartbeat_s=0.2)
    train_steps(run, model, opt, scaler, steps=5, inf_at=3)
    run.finish()
    msgs = hub_messages(hub)
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
    from scalemon.agent.run import optimizer_timing_every_s
    from scalemon.agent.warn import Warnings

    monkeypatch.setenv("SCALEMON_OPTIMIZER_TIMING_S", "often")
    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        assert optimizer_timing_every_s(True, Warnings()) == 0.5
        assert optimizer_timing_every_s(False, Warnings()) == 0.0
    assert "SCALEMON_OPTIMIZER_TIMING_S='often' is not a number of seconds >= 0" in caplog.text
    monkeypatch.setenv("SCALEMON_OPTIMIZER_TIMING_S", "0")
    assert optimizer_timing_every_s(True, Warnings()) == 0.0


def test_a_value_changed_in_place_after_log_is_not_read_by_the_deferred_copy():
    """The sender's copy of a device value noted at log() (steps.copy_if_unchanged, the same
    code on any device): copied while the tensor is as it was; refused, with the reason, once
    an in-place operation moved its version, before the copy or while it was queued."""
    from scalemon.agent.steps import copy_if_unchanged

    slot = torch.zeros(())
    loss = torch.tensor([2.5])
    assert copy_if_unchanged(slot, loss, loss._version) is None
    assert slot.item() == 2.5
    version = loss._version
    loss.zero_()  # an accumulator the script resets after logging it
    slot.fill_(-1.0)
    assert copy_if_unchanged(slot, loss, version) == "the script changed it in place after log()"
    assert slot.item() == -1.0  # not copied

    moving = torch.tensor(1.0)  # its version moves while its copy is queued (as when the
    version = moving._version  # training thread queues an in-place operation at that moment)
    original_copy = torch.Tensor.copy_

    def copy_then_change(dst, src, non_blocking=False):
        out = original_copy(dst, src, non_blocking=non_blocking)
        src.add_(1)
        return out

    slot.copy_ = copy_then_change.__get__(slot)
    assert copy_if_unchanged(slot, moving, version) == ("the script changed it in place after "
                                                        "log()")
    with torch.inference_mode():
        frozen = torch.tensor(3.0)
    why = copy_if_unchanged(torch.zeros(()), frozen, 0)
    assert why is not None and why.startswith("RuntimeError")


def test_a_cuda_graph_capture_is_seen_by_the_agent_before_it_starts():
    """Every capture goes through torch.cuda.CUDAGraph.capture_begin: the wrapper tells the
    step finisher first (values are then copied at log()) and counts the capture while it
    lasts, also when the capture fails (here: no CUDA to capture with)."""
    from scalemon.agent.cudagraphs import CAPTURE, watch_captures
    from scalemon.agent.heartbeat import Phase
    from scalemon.agent.steps import ScaleTracker, StepFinisher

    finisher = StepFinisher(ScaleTracker(None), Phase(), None)
    watch_captures(finisher.on_graph_capture)
    seen = []
    watch_captures(lambda: seen.append(CAPTURE.active))
    assert finisher.defer
    with pytest.raises((TypeError, RuntimeError, AttributeError)):
        torch.cuda.CUDAGraph.capture_begin(object())  # not a graph: torch's own call refuses
    assert seen == [0] and not finisher.defer and CAPTURE.active == 0
    with pytest.raises((TypeError, RuntimeError, AttributeError)):
        torch.cuda.CUDAGraph.capture_end(object())
    assert CAPTURE.active == 0


def test_log_sees_a_script_that_reuses_the_tensors_it_logs():
    """StepFinisher._reused on the previous step's noted tensors: fresh tensors each step are
    not reuse; a tensor changed in place since, or the same storage logged again (a CUDA
    graph's static output), is."""
    from scalemon.agent.heartbeat import Phase
    from scalemon.agent.steps import ScaleTracker, StepFinisher

    finisher = StepFinisher(ScaleTracker(None), Phase(), None)

    def noted(*tensors):
        return [(0, t, t._version) for t in tensors]

    first, second = torch.tensor(1.0), torch.tensor(2.0)
    finisher._last_later = noted(first)
    assert not finisher._reused(noted(second))
    finisher._last_later = noted(first)
    first.add_(1)
    assert finisher._reused(noted(second))
    static = torch.tensor(3.0)
    finisher._last_later = noted(static)
    assert finisher._reused(noted(static))


def test_without_a_model_the_agent_takes_the_optimizers_device_not_the_current_gpu(
        monkeypatch):
    """A CPU job on a machine where CUDA was initialised (by a library, say) and an init()
    given only the optimizer: its params are on the CPU, so the agent must not time the CPU
    optimizer with CUDA events (it would report kernel time the job never spent)."""
    from scalemon.agent.torchdist import cuda_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert cuda_device(None, optimizer) is None
    assert cuda_device(model, None) is None
    assert cuda_device(None, None) == torch.device("cuda", 3)  # nothing else to go by
    assert cuda_device("not a model", object()) == torch.device("cuda", 3)
    empty = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    empty.param_groups[0]["params"].clear()
    assert cuda_device(None, empty) == torch.device("cuda", 3)


def test_agent_package_does_not_import_textual():
    code = ("import sys, scalemon.agent, scalemon.agent.run; "
            "assert 'textual' not in sys.modules, 'agent imported textual'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_hub_side_does_not_import_torch():
    code = ("import sys, scalemon.hub, scalemon.cli.main, scalemon.link.client; "
            "assert 'torch' not in sys.modules, 'hub imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_run_logs_device_values_without_syncing(start_hub):
    """On a GPU: loss, loss scale, optimizer and memory figures arrive, and `log()` never syncs
    (torch raises inside log if it does, which would disable the run)."""

    hub = start_hub("agentCuda")
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    run = Run(model, opt, scaler, job="agentCuda", hub=hub.address.base, heartbeat_s=0.2)
    x = torch.randn(64, 256, device="cuda")
    losses = []
    for step in range(1, 6):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run.log(step, loss=loss.detach(), tokens=64, loss_x2=2 * loss.detach(),
                    lr=1e-3)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        losses.append(loss.item())
    assert not run.disabled, run._disabled_reason
    # the loss and scale went through the GIL-keeping direct calls (cudart.py), not torch's
    assert run._steps.events.direct is not None, "libcudart not found: the direct path untested"
    run.finish()
    msgs = hub_messages(hub)
    steps = [m.body for m in msgs if m.type == "step"]
    assert [b["step"] for b in steps] == [1, 2, 3, 4, 5]
    assert [b["loss"] for b in steps] == pytest.approx(losses, rel=1e-6)
    assert [b["extra"]["loss_x2"] for b in steps] == pytest.approx([2 * v for v in losses],
                                                                  rel=1e-6)
    assert all(b["extra"]["lr"] == 1e-3 for b in steps)
    assert all(b["loss_scale"] == 1024.0 for b in steps)
    assert all(b["optimizer_time_s"] > 0 for b in steps)
    # sampled (0.5 s): the first step timed, the quick ones after it carry its figure
    assert steps[0]["optimizer_timed_step"] == 1
    assert all(b["optimizer_timed_step"] <= b["step"] for b in steps)
    assert all(b["mem_allocated_bytes"] > 0 and b["mem_peak_bytes"] > 0 for b in steps)
    assert run._steps.defer  # the loss and loss_x2 were copied by the sender thread
    beats = [m.body for m in msgs if m.type == "heartbeat"]
    from scalemon.agent import nvml

    # NVML reading through the wrapper: nvidia-ml-py comes with scalemon[agent] (a --no-deps
    # install into a cluster image must bring it), and the reader says why it has no GPU
    assert nvml.pynvml is not None, "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    assert beats[-1]["gpu_mem_total_bytes"] > 0, run.gpu.reason


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_log_each_steps_own_loss_and_the_capture_is_left_alone(start_hub):
    """A script that captures its whole step in a CUDA graph (torch's docs' pattern, global
    capture mode) and logs the graph's static loss after each replay: the capture succeeds
    although the agent's threads query events and copy meanwhile, and every step's loss is
    that step's own, never the next replay's."""
    hub = start_hub("agentGraph")
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run = Run(model, opt, job="agentGraph", hub=hub.address.base, heartbeat_s=0.05)
    x = torch.randn(32, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, logged (deferred copies: the sender is busy)
        for step in range(1, 4):
            opt.zero_grad(set_to_none=False)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            run.log(step, loss=loss.detach())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        static_loss = model(x).pow(2).mean()
        static_loss.backward()
        opt.step()
    values = []
    for step in range(4, 12):
        graph.replay()
        run.log(step, loss=static_loss)
        values.append(static_loss.item())
    assert not run.disabled, run._disabled_reason
    assert not run._steps.defer  # the capture switched to copies at log()
    run.finish()
    steps = [m.body for m in hub_messages(hub) if m.type == "step"]
    assert [b["step"] for b in steps] == list(range(1, 12))
    assert [b["loss"] for b in steps[3:]] == pytest.approx(values, rel=1e-6)
    assert len(set(values)) > 1  # the loss moves, so a value of another step would show


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_loss_changed_in_place_after_log_is_left_out_not_misread(start_hub, caplog):
    """A script that logs a device accumulator and then resets it in place: the deferred copy
    sees the version move and leaves that step's loss out (said once) instead of sending the
    reset value; from then on the values are copied at log() and are right."""
    hub = start_hub("agentInplace")
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    run = Run(model, opt, job="agentInplace", hub=hub.address.base, heartbeat_s=0.2)
    x = torch.randn(64, 256, device="cuda")
    total = torch.zeros((), device="cuda")
    sums = []
    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        for step in range(1, 6):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.detach()
            sums.append(total.item())
            run.log(step, loss=total)
            total.zero_()  # queued before the sender copies the first step's value
        run.finish()
    steps = [m.body for m in hub_messages(hub) if m.type == "step"]
    # step 1's copy is queued by the sender (it wakes every 50 ms), almost always after the
    # reset: then it is left out and said, never the zero; from step 2 on log() saw the reuse
    # and copied at once
    lost = "the loss of step 1 could not be read (the script changed it in place after log())"
    if steps[0]["loss"] is None:
        assert caplog.text.count(lost) == 1
    else:  # the sender came first
        assert steps[0]["loss"] == pytest.approx(sums[0], rel=1e-6) and lost not in caplog.text
    assert [b["loss"] for b in steps[1:]] == pytest.approx(sums[1:], rel=1e-6)
    assert not run._steps.defer


class ReadyEvent:
    """A CUDA event stand-in whose work has completed."""

    def query(self) -> bool:
        return True


class NeverReadyEvent:
    """A CUDA event stand-in on a GPU that never gets there (a hung kernel)."""

    def query(self) -> bool:
        return False


class FakeEventPool:
    def put(self, *events: object) -> None:
        pass


def test_a_step_whose_gpu_values_never_become_ready_is_dropped_and_said_once(zctx, caplog,
                                                                            tmp_path):
    """Steps leave in order behind a step still waiting for the GPU, heartbeats do not wait for
    it, and at the end the stuck step is dropped (counted, said once) and the rest is sent."""
    import zmq

    from scalemon import protocol
    from scalemon.agent.heartbeat import Phase
    from scalemon.agent.steps import ScaleTracker, Staged, StepFinisher
    from scalemon.agent.warn import Warnings

    pull = zctx.socket(zmq.PULL)
    endpoint = f"ipc://{tmp_path}/ingest.sock"  # tcp would need Curve keys: not the point here
    pull.bind(endpoint)
    warnings = Warnings()
    sender = Sender(endpoint, "j", 0, close_timeout_s=0.3, warnings=warnings)
    finisher = StepFinisher(ScaleTracker(None), Phase(), FakeEventPool(), warnings)

    def raw(step: int, event: object) -> tuple:
        buf = torch.tensor([float(step), 0.0])  # loss on "device"
        staged = Staged(None, (buf, list(buf.unbind())), [], [], True, False, [])
        staged.event = event  # as if the sender had queued the copies already
        return (step, 8, 0.1, 1e-5, None, None, None, [], 0, [], staged)

    def received(timeout_ms: int = 5000) -> protocol.Message:
        assert pull.poll(timeout_ms), "nothing arrived"
        return protocol.decode(pull.recv())

    for step, event in ((1, ReadyEvent()), (2, NeverReadyEvent()), (3, ReadyEvent())):
        assert sender.submit_deferred("step", finisher.finish, raw(step, event))
    first = received()
    assert (first.type, first.body["step"], first.body["loss"]) == ("step", 1, 1.0)
    sender.submit("heartbeat", {"phase": "forward", "dropped": 0})
    beat = received()
    assert beat.type == "heartbeat"  # not held back by step 2
    assert not pull.poll(300)  # step 3 waits behind step 2, in order
    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        sender.close()
    last = received()
    assert (last.type, last.body["step"], last.body["loss"]) == ("step", 3, 3.0)
    assert sender.dropped == 1 and sender.sent == 3
    assert caplog.text.count("device values never became ready (GPU stuck?)") == 1
    assert (first.seq, beat.seq, last.seq) == (0, 3, 2)  # seq 1 is the gap the hub will see


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakePynvml:
    """pynvml on a GPU where utilisation is not supported, power fails with a driver error,
    and this version lacks the temperature function altogether."""

    NVMLError = FakeNVMLError
    NVML_ERROR_NOT_SUPPORTED = 3

    def __init__(self) -> None:
        self.calls = 0

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        pass

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> str:  # noqa: N802
        return "gpu0"

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> None:  # noqa: N802
        raise FakeNVMLError(3)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> object:  # noqa: N802
        self.calls += 1
        return type("Mem", (), {"used": 5 << 30, "total": 80 << 30})()

    def nvmlDeviceGetPowerUsage(self, handle: str) -> None:  # noqa: N802
        raise FakeNVMLError(999)


def test_nvml_failures_read_na_and_each_is_said_once_with_its_reason(monkeypatch, caplog):
    from scalemon.agent import nvml

    fake = FakePynvml()
    monkeypatch.setattr(nvml, "pynvml", fake)
    monkeypatch.setattr(nvml, "_not_supported",
                        lambda exc: isinstance(exc, FakeNVMLError) and exc.value == 3)
    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        reader = nvml.GpuReader("0000:01:00.0")
        readings = [reader.read() for _ in range(3)]
    assert fake.calls == 3 and all(r == readings[0] for r in readings)
    assert readings[0] == {"gpu_util_pct": None, "gpu_mem_used_bytes": 5 << 30,
                           "gpu_mem_total_bytes": 80 << 30, "gpu_power_w": None,
                           "gpu_temp_c": None}
    text = caplog.text
    assert "nvmlDeviceGetUtilizationRates" not in text  # not supported: n/a without a word
    assert text.count("NVML nvmlDeviceGetPowerUsage failed (FakeNVMLError: NVML error 999)") == 1
    assert text.count("NVML nvmlDeviceGetTemperature failed (AttributeError") == 1


def test_a_failing_heartbeat_is_said_once_and_the_beating_goes_on(caplog):
    from scalemon.agent.heartbeat import Heartbeat, Phase
    from scalemon.agent.warn import Warnings

    class BrokenGpu:
        reads = 0

        def read(self) -> dict:
            BrokenGpu.reads += 1
            raise OSError("driver gone")

    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        beat = Heartbeat(Phase(), BrokenGpu(), lambda *_: True, lambda: {"dropped": 0},
                         interval_s=0.02, warnings=Warnings())
        wait_for(lambda: BrokenGpu.reads >= 5)
        beat.stop()  # the last reading fails too, and says nothing more
    assert caplog.text.count("a heartbeat failed (OSError: driver gone)") == 1


def test_a_failing_all_reduce_timer_is_said_once_and_the_all_reduce_still_runs(start_hub,
                                                                                tmp_path):
    breaks_timing = ("run._comm_timer.events = type('NoEvents', (), "
                     "{'record': lambda self: 1 / 0})()")
    _, steps, err = run_ddp_script(start_hub("agentBrokenHook"), tmp_path, "agentBrokenHook",
                                   breaks_timing)
    assert err.count("timing a DDP bucket's all-reduce failed (ZeroDivisionError") == 1
    assert all(b["allreduce_count"] == 0 and b["loss"] > 0 for b in steps)  # untimed, trained
    assert [b["step"] for b in steps] == [1, 2, 3, 4, 5]


@pytest.mark.integration
def test_the_hubs_hang_threshold_reaches_the_agent_and_a_stuck_rank_says_where(start_hub):
    """One threshold: the agent adopts the hub's `--hang-after` from its sync replies, and once
    its training thread has not logged for that long it sends its stack at once, with the
    phase `python` (it waits in no collective); a phase the script set stays."""
    hub = start_hub("agentStuck", "--hang-after", "1.5")
    run = Run(job="agentStuck", hub=hub.address.base, heartbeat_s=5.0)  # slow beats: woken
    client = HubClient(hub.address)
    try:
        wait_for(lambda: run.recorder.stuck_after_s == 1.5, timeout=30)
        run.log(1, loss=1.0)
        logged = time.monotonic()
        beat = wait_for(lambda: next((m.body for m in records(client) if m.type == "heartbeat"
                                      and m.body.get("stack")), None), timeout=30)
        assert time.monotonic() - logged < 4.5  # at the threshold, not at the next 5 s beat
        assert beat["phase"] == "python" and beat["phase_since_s"] >= 1.5
        assert "test_the_hubs_hang_threshold_reaches_the_agent" in beat["stack"]
        run.log(2, loss=1.0)
        run.set_phase("eval")
        wait_for(lambda: any(m.type == "heartbeat" and m.body["phase"] == "eval"
                             and m.body.get("stack") for m in records(client)), timeout=30)
    finally:
        run.finish()
        client.close()


def records(client: HubClient) -> list:
    """Every record of the hub so far, decoded."""
    from scalemon import protocol

    return [protocol.decode(r) for r in client.fetch(0)[0]]
