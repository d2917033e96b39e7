"""`Run`: the agent inside one training rank.

Per step the training thread calls `log()`, which costs a few microseconds: it notes host
times and which device scalars (loss, loss scale) to read, and leaves the rest to the sender
thread, which queues their copies into pinned host memory and a CUDA event behind them, and
builds the message once the event completed (polled, never waited for by training).
Everything is wrapped so that a failure inside the monitor is logged once and switches the
monitor off instead of reaching the training loop, and the hub hears why (`monitor_off`). A
value it cannot read is left out instead, said once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from time import perf_counter
from typing import Any, TypeVar

import torch

import scalemon
from scalemon import settings
from scalemon.state.failures import clean_error

from .autostart import hub_address
from .cudagraphs import watch_captures
from .env import RankEnv, max_restarts, read_rank_env
from .flags import FlagControl
from .heartbeat import Heartbeat, Phase
from .hosttiming import HostTimer
from .hubwatch import hub_label, watch_hub
from .mesh import MeshWatcher
from .nvml import GpuReader, pci_bus_id_of
from .ptracer import ReaderNaming
from .ranklogs import RankLogs, log_dir
from .recorder import Recorder
from .rings import group_uses_nccl
from .scaler import ScaleReader
from .sigexit import install_end_hooks
from .stepcomm import MARKS_KEPT
from .steps import ScaleTracker, StepFinisher, cuda_memory, new_raw_step
from .timing import (
    AllReduceTimer,
    EventPool,
    OptimizerTimer,
    SpanTimer,
    hookable_optimizer,
    is_compiling,
    optimizer_timing_every_s,
)
from .torchdist import (
    cuda_device,
    direct_calls,
    dist_backend,
    dist_initialized,
    identity_from_group,
    ras_port,
    uses_nccl,
)
from .transport import Sender
from .values import LoggedValues, json_like
from .warn import Warnings

log = logging.getLogger("scalemon.agent")
F = TypeVar("F", bound=Callable[..., Any])
FIRST_ANSWER_WARN_S = 5.0
"""A hub the user named (SCALEMON_HUB) runs already: after this long without its answer, the
rank says nothing is being received (an auto-started hub gets the Sender's longer wait)."""
HUB_START_GRACE_S = 10.0
"""A process ending before the job's own hub (started by rank 0) ever answered waits this long
for it at most, so a short job on a loaded machine still reaches its hub."""
MONITOR_OFF_CHARS = 2000
"""The reason a rank's monitor switched itself off is sent cut to this many characters."""
OWN_DIRS = (Path(__file__).resolve().parent, Path(scalemon.__file__).resolve().parent)
"""scalemon's code: its frames are left out of the error a rank reports as its cause."""


def guarded(method: F) -> F:
    """Run `method`; on any error log once, disable the run and return None."""

    @functools.wraps(method)
    def wrapper(self: Run, *args: Any, **kwargs: Any) -> Any:
        if self.disabled:
            return None
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            self.disable(f"{method.__name__}: {type(exc).__name__}: {exc}")
            return None

    return wrapper  # type: ignore[return-value]


AGENT_PHASES = frozenset({"init", "data", "forward-backward", "allreduce", "optimizer",
                          "after-optimizer"})
"""The phases the agent sets itself; while the rank is stuck they give way to `collective` (it
waits in one) or `python` (it does not: its stack's top user frame tells where)."""


class Run:
    """The monitor of one rank. Create it with `scalemon.agent.init()`."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: Any = None,
        *,
        job: str | None = None,
        hub: str | None = None,
        config: dict[str, Any] | None = None,
        time_collectives: bool = True,
        heartbeat_s: float = 1.0,
        env: RankEnv | None = None,
        checkpoint: Callable[[int], Any] | None = None,
        on_new_communicator: Callable[[list[str]], Any] | None = None,
        mesh: Any = None,
    ) -> None:
        self.disabled = False
        self._disabled_reason: str | None = None
        self.warnings = Warnings()
        self.reader = LoggedValues(self.warnings)  # what log() is given, read on the host
        self.pid = os.getpid()
        self.env = env or identity_from_group(read_rank_env(), self.warnings)
        if job:
            self.env = RankEnv(**{**self.env.__dict__, "job": job})
        self.address = hub_address(self.env, hub)
        self.phase = Phase()
        self.scaler = scaler
        self.device = cuda_device(model, optimizer)  # the model's GPU, None on CPU
        self._cuda = self.device is not None
        events = EventPool(self.device, direct_calls(), self.warnings) if self._cuda else None
        self._opt_timer = SpanTimer(events, optimizer_timing_every_s(self._cuda, self.warnings))
        self._comm_timer = SpanTimer(events)
        self._hooks: list[Any] = []
        self._pending_comm: tuple[AllReduceTimer, Any] | None = None  # installed at 1st forward
        self._last_log_t: float | None = None
        self._step_marks: deque[tuple[int, float]] = deque(maxlen=MARKS_KEPT)  # (step, t0)
        self._scale = ScaleReader(scaler, self.warnings)
        self._read_scale = self._scale.reader()  # None: no scale to read (the common bf16 case)
        self._steps = StepFinisher(
            ScaleTracker(self._scale.init_scale), self.phase, events, self.warnings,
            self._scale, functools.partial(cuda_memory, self.device) if self._cuda else None)
        if self._cuda:
            watch_captures(self._steps.on_graph_capture)
        self.agent_time_total_s = 0.0
        self._previous_log_s = 0.0
        self.steps_logged = 0
        self._finished = False
        configured_by = ("init(hub=...)" if hub else
                         "SCALEMON_HUB" if settings.raw("SCALEMON_HUB") else None)
        self.sender = Sender(self.address.ingest, self.env.job, self.env.rank,
                             rpc_endpoint=self.address.rpc, warnings=self.warnings,
                             configured_by=configured_by,
                             hub_label=hub_label(self.env, self.address, hub),
                             server_key=self.address.server_key,
                             first_answer_warn_s=FIRST_ANSWER_WARN_S if configured_by else None,
                             start_grace_s=0.0 if configured_by else HUB_START_GRACE_S)
        self.sender.on_command = self._on_command
        watch_hub(self.sender, self.env, hub)
        self._nccl = uses_nccl()
        # before the script made its process group, NCCL is a guess (CUDA is there): the first
        # log() after the group exists settles it (`_settle_backend`)
        self._backend_known = dist_initialized() or not self._nccl
        self._backend_check_at = 0.0
        self._time_collectives = time_collectives
        self.host_timer: HostTimer | None = None
        if time_collectives and not self._nccl:  # gloo: the recorder has no durations
            self.host_timer = HostTimer()
            self.host_timer.install()
        if not dist_initialized():  # timing read from the environment at group creation
            os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
        self.recorder = Recorder(
            self.sender.submit, threading.get_ident(), lambda: self._last_log_t,
            lambda: self.phase.step, nccl=self._nccl, rank=self.env.rank,
            ras_port=ras_port() if self._nccl and self.env.local_rank == 0 else None,
            host_calls=self.host_timer.calls if self.host_timer else None,
            host_issuing=self.host_timer.issuing if self.host_timer else None,
            warnings=self.warnings, stuck_after_s=settings.hang_after_s(),
            step_marks=self._step_marks, p2p=self.host_timer.p2p if self.host_timer else None)
        self._hello(model, config)
        self.mesh = MeshWatcher(self.sender.submit)
        if mesh is not None:
            self.watch_mesh(mesh)
        self.recorder.on_status = self.mesh.check  # groups named mesh_<dim>, from its thread
        self.logs = RankLogs(self.sender.submit, self.warnings, self.env.host, self.pid,
                             lambda: self.steps_logged)
        self.flag_control = self.logs.control = FlagControl(
            self.env, self.sender.submit, self.warnings, nccl=self._nccl, checkpoint=checkpoint,
            on_new_communicator=on_new_communicator, log_dir=log_dir(self.env.job),
            on_log_file=self.logs.follow_log, on_nccl_probe=self.logs.nccl_probe)
        self._start_flags()
        if optimizer is not None:
            self.watch_optimizer(optimizer)
        if model is not None:
            self.watch_model(model, time_collectives)
        self.gpu = GpuReader(*self._gpu_ids(), warnings=self.warnings)
        self.stack_reader = ReaderNaming(self.address.ingest)  # may read it (Yama scope 1)
        self.heartbeat = Heartbeat(self.phase, self.gpu, self.sender.submit, self._counters,
                                   heartbeat_s, self.warnings, self.stack_reader.check,
                                   lambda: self.sender.heartbeat_stepping_s, self.sender)
        self.recorder.on_stuck = self.heartbeat.wake  # a hang's stack goes out at once
        self._previous_excepthook, sys.excepthook = sys.excepthook, self._excepthook
        install_end_hooks(self)  # atexit, and SIGTERM's exit (agent/sigexit.py)

    # --- setup -------------------------------------------------------------------------------
    def _gpu_ids(self) -> tuple[str | None, int | None]:
        if not self._cuda:
            return None, None
        return pci_bus_id_of(self.device.index), self.device.index

    def _hello(self, model: torch.nn.Module | None, config: dict[str, Any] | None) -> None:
        backend = dist_backend()
        device = torch.cuda.get_device_name(self.device) if self._cuda else "cpu"
        self.sender.submit("hello", {
            "host": self.env.host,
            "pid": self.pid,
            "world_size": self.env.world_size,
            "local_rank": self.env.local_rank,
            "restart_count": self.env.restart_count,
            **({"max_restarts": restarts} if (restarts := max_restarts()) is not None else {}),
            "agent_version": scalemon.__version__,
            "torch_version": str(torch.__version__),
            "device": device,
            "backend": backend,
            "config": self._plain_config(config),
        })

    def _plain_config(self, config: Any) -> dict[str, Any] | None:
        """`init(config=...)` as the protocol carries it: a script's configuration often holds
        paths, dtypes, enums or tuples (`vars(args)`, `asdict(job_config)`); such values are
        sent as their text (said once), where they would otherwise cost the rank its `hello`."""
        if config is None:
            return None
        changed: list[str] = []
        plain = json_like(config if isinstance(config, dict) else {"config": config}, "",
                          changed)
        if changed:
            self.warnings.once("config", "scalemon: init(config=...) holds values that are not "
                               "JSON-like (%s); they are sent as text", ", ".join(changed[:5]))
        return plain

    def _start_flags(self) -> None:
        """Report the flags; apply a process-group timeout toggled earlier in this run; follow
        the logs a toggle turned on before a restart."""
        from . import overrides
        from .flags import set_pg_timeout

        control = self.flag_control
        if dist_initialized() and (timeout := overrides.pg_timeout_override(self.env.job)):
            with contextlib.suppress(Exception):
                set_pg_timeout(float(timeout))
        if os.environ.get("NCCL_DEBUG"):
            self.logs.follow_nccl("NCCL_DEBUG" in overrides.applied)
        if {"TORCH_CPP_LOG_LEVEL", "TORCH_DISTRIBUTED_DEBUG"} & set(overrides.applied):
            self.logs.capture_stderr()
        control.report()

    @guarded
    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Time every `optimizer.step()` (step hooks; CUDA events on GPU). A wrapper
        (accelerate's, Lightning's, DeepSpeed's) is timed through the optimizer it wraps; one
        that wraps none is said once, and the optimizer's time stays n/a."""
        hookable = hookable_optimizer(optimizer)
        if hookable is None:
            self.warnings.once("optimizer-unhookable",
                               "scalemon: optimizer time n/a: %s is not a torch optimizer and "
                               "wraps none in .optimizer or ._optimizer, so its steps cannot "
                               "be timed (pass the torch optimizer it steps)",
                               type(optimizer).__name__)
            return
        self._hooks.append(OptimizerTimer(hookable, self._opt_timer, self.phase, self.disable))

    @guarded
    def watch_scaler(self, scaler: Any) -> None:
        """Read the AMP loss scale from `scaler` (one made after `init()`), from the next
        step on."""
        reader = ScaleReader(scaler, self.warnings)
        if self._steps.scales.previous is None:
            self._steps.scales.previous = reader.init_scale
        self._scale = self._steps.scaler = reader
        self._read_scale = reader.reader()

    @guarded
    def watch_model(self, model: torch.nn.Module, time_collectives: bool = True) -> None:
        """Track forward/backward phases; on DDP over gloo also time the gradient all-reduce.

        NCCL needs no hook: the Flight Recorder times every collective in C++. On gloo it has
        no durations, so a timing comm hook is installed, at the model's first forward, not
        here: DDP takes one comm hook, so a script that registers its own after `init()` keeps
        it (and the all-reduce goes untimed) instead of getting DDP's "can only be called
        once" error."""
        self._hooks.append(model.register_forward_pre_hook(self._on_forward))
        ddp = getattr(model, "_orig_mod", model)  # torch.compile(DDP(model)): the DDP inside
        if (time_collectives and isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
                and not group_uses_nccl(ddp.process_group)):
            calls = self.host_timer.calls if self.host_timer else None
            self._pending_comm = (AllReduceTimer(self._comm_timer, self.phase, self.warnings,
                                                 calls), ddp)

    def _on_forward(self, *_: Any) -> None:
        # one hook only: "forward" lasts until the all-reduce (DDP) or optimizer phase starts
        if is_compiling():  # traced into a compiled model: leave no trace (fullgraph=True)
            return
        t = perf_counter()
        if self._pending_comm is not None:
            self._install_comm_timer()  # never raises
        phase = self.phase
        if phase.name != "forward-backward":
            phase.name, phase.since = "forward-backward", t
        phase.cost_s += perf_counter() - t

    def _install_comm_timer(self) -> None:
        timer, model = self._pending_comm
        self._pending_comm = None
        if self.disabled:
            return
        try:
            timer.register(model)
        except Exception as exc:  # never into the training loop
            log.warning("scalemon: all-reduce timing off: %s: %s", type(exc).__name__, exc)

    # --- per step ----------------------------------------------------------------------------
    def log(
        self,
        step: int,
        loss: torch.Tensor | float | None = None,
        tokens: int | None = None,
        **extra: float | int | str | torch.Tensor | None,
    ) -> None:
        """Report one finished step. `loss` may be a device tensor: it is never synced.

        Call it after `optimizer.step()` (and `scaler.update()` with AMP). Extra keyword values
        (numbers, strings, one-element tensors such as a CUDA grad norm, read without a sync)
        are sent along under `extra`; any other value is left out with a warning. Never raises.
        """
        if self.disabled or _forked:
            return  # a forked child (DataLoader worker) must not use the parent's sockets
        # The training thread's share of a step message, inline rather than @guarded or a call
        # of ours (each costs a Python frame, with caches cold from the step): read host clocks
        # and values, leave one tuple for the sender thread, which builds the body.
        try:
            t0 = perf_counter()
            if not self._backend_known and t0 >= self._backend_check_at:
                self._settle_backend(t0)
            last, self._last_log_t = self._last_log_t, t0
            phase = self.phase
            if type(step) is not int:
                step = self.reader.step(step, phase.step)
            if tokens is not None and type(tokens) is not int:
                tokens = self.reader.int(tokens, "tokens")
            if step == phase.step and self.steps_logged:
                self._said_repeated_step(step)
            phase.step = step
            self._step_marks.append((step, t0))  # the recorder's step boundary (stepcomm.py)
            hooks_s, phase.cost_s = phase.cost_s, 0.0
            read_scale = self._read_scale
            scale = None if read_scale is None else read_scale()
            if self._cuda:
                staged = self._steps.stage(loss, scale, extra)  # memory: read by the sender
                loss = scale = None
            else:  # host values are read now: the caller may change them in place later
                staged = None
                if loss is not None and type(loss) is not float:
                    loss = self.reader.float(loss, "loss")
                if scale is not None:
                    scale = self.reader.float(scale, "the loss scale")
            opt, comm = self._opt_timer, self._comm_timer
            opt_spans, opt.spans = opt.spans, []
            opt_untimed, opt.untimed, opt.timing = opt.untimed, 0, None
            comm_spans, comm.spans = comm.spans, []
            host_timer = self.host_timer
            self.sender.submit_deferred("step", self._steps.finish, new_raw_step((
                step, tokens, None if last is None else t0 - last,
                hooks_s + self._previous_log_s, extra, loss, scale, opt_spans, opt_untimed,
                comm_spans, staged,
                host_timer.p2p.step.take() if host_timer is not None else None,
            )))
            if self.flag_control.pending:  # a toggle the hub relayed (rare): maybe due now
                self._apply_flags(step)
            phase.name, phase.since = "data", perf_counter()
            self._previous_log_s = log_s = phase.since - t0  # reported with the next step
            self.agent_time_total_s += hooks_s + log_s
            self.steps_logged += 1
        except Exception as exc:
            self.disable(f"log: {type(exc).__name__}: {exc}")

    def _said_repeated_step(self, step: int) -> None:
        """Say once that log() got the same step number twice in a row (a callback that logs
        every micro-batch under gradient accumulation, such as Lightning's
        `on_train_batch_end` with `trainer.global_step`): each call is a step of its own."""
        self.warnings.once(
            "repeated-step", "scalemon: log() got step %s twice in a row: every call counts as "
            "a step, so step time is the time between calls (a micro-batch's under gradient "
            "accumulation); call log() once per optimizer step for the step's own time", step)

    def _settle_backend(self, now: float) -> None:
        """Once the default process group exists (checked at most once a second): where
        `init()` guessed NCCL because CUDA is there and the job runs gloo (a CPU job on a GPU
        machine), monitor it as gloo: host-timed collectives, no NCCL ring, no NCCL RAS."""
        self._backend_check_at = now + 1.0
        if not dist_initialized():
            return
        self._backend_known = True
        if group_uses_nccl():
            return
        try:
            self._nccl = self.flag_control.nccl = False
            self.recorder.use_gloo()
            if self._time_collectives and self.host_timer is None:
                self.host_timer = HostTimer()
                self.host_timer.install()
                self.recorder.host_calls = self.host_timer.calls
                self.recorder.host_issuing = self.host_timer.issuing
                self.recorder.p2p_reader.timer = self.host_timer.p2p
        except Exception as exc:  # collectives may lack durations; training goes on
            self.warnings.once("settle-backend", "scalemon: switching the monitor to gloo "
                               "failed (%s: %s); collectives may have no durations",
                               type(exc).__name__, exc)

    def _apply_flags(self, step: int) -> None:
        """Apply the toggles due at this step boundary (on the training thread)."""
        self.flag_control.apply_due(step, self._stop_for_restart)
        if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF").upper() != "OFF":
            self.logs.capture_stderr()  # torch's debug output goes to stderr: stream it too

    def _stop_for_restart(self, code: int) -> None:
        """End this worker for a restart-tier toggle: torchrun starts it again."""
        self.finish(exit_code=code, reason="restart")
        raise SystemExit(code)

    @guarded
    def info(self, key: str, value: Any) -> None:
        """Send a named fact about the run (configuration, memory estimate, ...)."""
        self.sender.submit("info", {"key": key, "value": value})

    @guarded
    def watch_mesh(self, mesh: Any) -> None:
        """Send this rank's coordinates in `mesh` (a DeviceMesh) as the `mesh` info; the
        process groups are no longer looked at for one."""
        self.mesh.use(mesh)

    @guarded
    def describe_pipeline(self, schedule: str, stages: int, microbatches: int,
                          virtual_stages: int | None = None) -> None:
        """Say how the job pipelines (the `pipeline` info): the schedule ("gpipe", "1f1b",
        "interleaved" or another name), the number of stages, of microbatches per step and,
        for an interleaved schedule, of virtual stages per rank. The hub compares the
        schedule's theoretical bubble with the measured `pipeline_bubble`."""
        value: dict[str, Any] = {"schedule": str(schedule), "stages": int(stages),
                                 "microbatches": int(microbatches)}
        if virtual_stages is not None:
            value["virtual_stages"] = int(virtual_stages)
        if value["stages"] < 1 or value["microbatches"] < 1:
            self.warnings.once("pipeline", "scalemon: describe_pipeline(stages=%s, "
                               "microbatches=%s): both must be at least 1; not sent",
                               stages, microbatches)
            return
        self.sender.submit("info", {"key": "pipeline", "value": value})

    def set_phase(self, name: str) -> None:
        """Say what the training thread is doing now (shown in heartbeats and on hangs)."""
        self.phase.set(name)

    # --- end -------------------------------------------------------------------------------
    def finish(self, exit_code: int | None = 0, reason: str | None = None) -> None:
        """Flush pending steps, report the end of this rank and stop the threads."""
        if self._finished or _forked:
            return
        self._finished = True
        try:
            try:
                self.recorder.stop()  # a last read: what the last steps issued
                if self.host_timer is not None:
                    self.host_timer.remove()
            except Exception as exc:
                self.warnings.once("last-read", "scalemon: the last Flight Recorder read "
                                   "failed: %s: %s", type(exc).__name__, exc)
            try:
                self.logs.stop()
            except Exception as exc:
                self.warnings.once("last-logs", "scalemon: the last log read failed: %s", exc)
            try:
                self.heartbeat.stop()  # sends a last reading
            except Exception as exc:
                self.warnings.once("last-heartbeat", "scalemon: the last heartbeat failed: "
                                   "%s: %s", type(exc).__name__, exc)
            reason = reason or ("finished" if exit_code == 0 else "exit")
            body = {"reason": reason, "exit_code": exit_code, "step": self.phase.step,
                    "error": self._disabled_reason}
            # deferred, so it leaves after the last step; `dropped` is read when it leaves
            self.sender.submit_deferred(
                "exit", lambda _arg, _deadline: {**body, "dropped": self.sender.dropped})
            self.sender.close()
            for hook in self._hooks:
                hook.remove()
        except Exception as exc:
            log.warning("scalemon: finishing the monitor failed: %s", exc)
        finally:
            if sys.excepthook == self._excepthook:
                sys.excepthook = self._previous_excepthook

    def _excepthook(self, etype: type, value: BaseException, tb: Any) -> None:
        try:
            self._previous_excepthook(etype, value, tb)  # the traceback first, at once
        finally:
            if not self._finished:
                self._disabled_reason = clean_error(
                    "".join(traceback.format_exception_only(etype, value)), OWN_DIRS)
                self.finish(exit_code=1, reason="exception")

    def _atexit(self) -> None:
        if not self._finished:
            self.finish(exit_code=None, reason="exit")

    def disable(self, reason: str) -> None:
        """Switch the monitor off after an internal error; training goes on.

        The hub hears why first (a `monitor_off` message, so the rank's row says so), then the
        training thread's side stops: no more steps, and the timers keep no spans. The hooks
        stay until `finish()` (this may run inside one of them, whose registry cannot change
        while it runs) and only say what the training thread is doing; the heartbeat and
        recorder threads go on, so the rank still reads as alive, and its exit is reported."""
        if self.disabled:
            return
        self.disabled = True
        self._disabled_reason = reason = reason[:MONITOR_OFF_CHARS]
        log.warning("scalemon: monitoring disabled on rank %d: %s", self.env.rank, reason)
        with contextlib.suppress(Exception):
            self.sender.submit("monitor_off", {"reason": reason, "step": self.phase.step})
        self._pending_comm = None
        for timer in (self._opt_timer, self._comm_timer):
            with contextlib.suppress(Exception):
                timer.spans = deque(maxlen=0)  # type: ignore[assignment]  # keeps nothing

    def _counters(self) -> dict[str, Any]:
        recorder = self.recorder
        if self.sender.hang_after_s is not None:  # one threshold: the hub's
            recorder.stuck_after_s = self.sender.hang_after_s
        out = {"dropped": self.sender.dropped, "queued": self.sender.queued,
               "clock_offset_s": self.sender.clock_offset_s, **recorder.heartbeat_fields()}
        blocked = recorder.blocked()
        if blocked is not None and self.phase.name in AGENT_PHASES:
            # stuck: say where, not the loop phase it was in (a script's own phase stays)
            out["phase"] = "collective" if blocked else "python"
            if self._last_log_t is not None:
                out["phase_since_s"] = time.perf_counter() - self._last_log_t
        return out

    def _on_command(self, command: dict[str, Any]) -> None:
        """A command the hub relayed (on the sender thread)."""
        if command.get("name") == "dump_fr" and isinstance(command.get("directory"), str):
            self.recorder.request_dump(command["directory"], self.env.rank)
        elif command.get("name") == "set_flag":
            self.flag_control.queue(command)  # applied on the training thread, when due
        else:
            self.warnings.once(f"command:{command.get('name')}", "scalemon: the hub sent an "
                               "unknown command %r; a newer hub? ignored", command.get("name"))


_forked = False


def _mark_forked() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_mark_forked)
