"""The agent on a GPU: device values read without a sync (staged copies, CUDA graphs, values
changed in place), the device it takes, steps whose GPU values never become ready, NVML and
heartbeat failures."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import hub_messages, wait_for
from scalemon.agent.run import Run
from scalemon.agent.transport import Sender


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
        return [(0, t, t._version, t.data_ptr()) for t in tensors]

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


class HostEventPool:
    """An event pool whose "device" is the host (index -1, a CPU tensor's `get_device()`), so
    the step finisher's device path runs here: streams are None (torch.cuda.stream(None) does
    nothing) and every event has completed."""

    index = -1
    direct = None  # torch's copies

    def stream_of(self, key: object) -> None:
        return None

    def record_on(self, stream: object) -> ReadyEvent:
        return ReadyEvent()

    def put(self, *events: object) -> None:
        pass


def test_the_common_step_is_only_noted_at_log_and_read_by_the_sender(monkeypatch, caplog):
    """`StepFinisher.stage`'s common step (a one-element loss on the model's device, no extra
    values): log() leaves a tuple and no copy, the sender reads the value it had at log(),
    detached; a loss the script changes in place after log() is left out, not misread, and
    from then on values are copied at log(); a loss of several elements is left out, said
    once. The device here is the host (`HostEventPool`)."""
    from scalemon.agent import steps
    from scalemon.agent.heartbeat import Phase
    from scalemon.agent.steps import ScaleTracker, StepFinisher, new_raw_step

    monkeypatch.setattr(steps, "_pinned_slots", lambda n: (lambda b: (b, list(b.unbind())))(
        torch.zeros(n)))  # no pinned memory without CUDA
    monkeypatch.setattr(steps, "current_stream_key", lambda index: ("stream", index))
    finisher = StepFinisher(ScaleTracker(None), Phase(), HostEventPool())

    def step(n: int, loss: torch.Tensor) -> tuple:
        noted = finisher.stage(loss, None, {})
        return new_raw_step((n, 8, 0.1, 1e-5, {}, None, None, [], 0, [], noted, None))

    weights = torch.tensor([3.0], requires_grad=True)
    first = step(1, (weights * 2).sum())  # requires grad: the sender detaches it
    assert type(first.staged) is tuple and first.staged[0] == ("stream", -1)
    body = finisher.finish(first, None)
    assert body["loss"] == 6.0 and finisher.defer
    assert not any(buf.requires_grad for buf, _ in finisher.pinned[2])  # joined no graph
    assert finisher.finish(first, None)["loss"] == 6.0  # asked again: the same step's value
    wide = step(2, torch.ones(3))
    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        assert finisher.finish(wide, None)["loss"] is None
        total = torch.tensor(5.0)
        changed = step(3, total)
        total.zero_()  # the script resets what it logged before the sender read it
        assert finisher.finish(changed, None)["loss"] is None
    assert caplog.text.count("loss given to log() cannot be read (a tensor of 3 elements)") == 1
    assert "the loss of step 3 could not be read" in caplog.text
    assert not finisher.defer  # copied at log() from now on: right although reset after
    total.fill_(7.0)
    late = step(4, total)
    total.zero_()
    assert type(late.staged) is not tuple and finisher.finish(late, None)["loss"] == 7.0


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


def test_a_stepping_rank_beats_at_the_hubs_stepping_interval_and_every_beat_once_it_stops():
    """A big job's hub asks for fewer heartbeats while steps flow (`heartbeat_stepping_s`);
    a rank that stops stepping beats every interval again once the stepping interval since
    its last reading has passed, and a stuck rank's wake-up always sends at once."""
    import time

    from scalemon.agent.heartbeat import Heartbeat, Phase
    from scalemon.agent.nvml import GpuReader

    phase, sent = Phase(), []
    stepping: list[float | None] = [None]
    beat = Heartbeat(phase, GpuReader(), lambda mtype, body: sent.append(body) or True,
                     lambda: {"dropped": 0}, interval_s=0.05, stepping_s=lambda: stepping[0])
    try:
        def sends_over(seconds: float, step_every: float | None) -> int:
            before, end = len(sent), time.monotonic() + seconds
            while time.monotonic() < end:
                if step_every is not None:
                    phase.step = (phase.step or 0) + 1
                time.sleep(step_every or 0.01)
            return len(sent) - before

        stepping[0] = 0.5
        assert sends_over(1.0, 0.01) <= 4  # every ~0.5 s, not every 0.05 s (20)
        # no step: every interval again once the stepping interval since the last reading
        # has passed (which may take up to 0.5 s of the window), then ~10 readings
        assert sends_over(1.2, None) >= 5
        stepping[0] = None  # a small job's hub (or an older one): every interval
        assert sends_over(0.6, 0.01) >= 5
        stepping[0] = 5.0
        sends_over(0.3, 0.01)
        before = len(sent)
        beat.wake()  # stuck: its stack goes out at once, whatever the interval
        wait_for(lambda: len(sent) > before, timeout=2)
    finally:
        beat.stop()
