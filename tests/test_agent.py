"""The agent inside a training process: identity, non-blocking sending, values, failures."""

from __future__ import annotations

import contextlib
import logging
import signal
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


def test_agent_package_does_not_import_textual():
    code = ("import sys, scalemon.agent, scalemon.agent.run; "
            "assert 'textual' not in sys.modules, 'agent imported textual'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_hub_side_does_not_import_torch():
    code = ("import sys, scalemon.hub, scalemon.cli.main, scalemon.link.client; "
            "assert 'torch' not in sys.modules, 'hub imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


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


def test_the_agent_names_its_hub_as_the_reader_of_its_stacks_and_says_max_restarts(
        start_hub, monkeypatch):
    """The agent names the process holding its hub's lock (prctl PR_SET_PTRACER, so the hub
    may read its stacks under Yama scope 1) from its heartbeat thread, and its hello says the
    launcher's restart budget."""
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    hub = start_hub("agentReader")
    run = Run(job="agentReader", hub=hub.address.base)
    try:
        wait_for(lambda: run.stack_reader.named_pid == hub.proc.pid, timeout=10)
        assert run.stack_reader.outcome in ("named", "not needed")
        state = wait_for(lambda: (s := HubClient(hub.address).state()["state"])["ranks"] and s)
        assert state["max_restarts"] == 3
    finally:
        run.finish()


SIGTERM_SCRIPT = """
import ctypes, signal, sys, time
import scalemon.agent as sm
if sys.argv[1] == "own":  # the script's own handler: never replaced
    signal.signal(signal.SIGTERM, lambda *_: (print("own handler", flush=True), sys.exit(7)))
run = sm.init(job=sys.argv[2], hub=sys.argv[3])
run.log(1, loss=1.0)
print("ready", signal.getsignal(signal.SIGTERM).__qualname__, flush=True)
if sys.argv[1] == "native":  # blocked in native code, as in a collective: the main thread
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # runs no Python handler
    ctypes.CDLL(None).sleep(120)
time.sleep(120)
"""


@pytest.mark.parametrize("where", ["python", "native", "own"])
def test_a_rank_ended_by_sigterm_says_so_and_still_dies_by_it(start_hub, where):
    job = f"agentterm{where}"
    hub = start_hub(job)
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, where, job,
                             hub.address.base], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("ready"), ready + proc.stderr.read()
        wait_for(lambda: (r := HubClient(hub.address).state()["state"]["ranks"])
                 and r[0]["step"] == 1, timeout=60)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - started
    finally:
        proc.kill()
    if where == "own":
        assert ready.split()[1] == "<lambda>"  # the agent left the script's handler alone
        assert code == 7 and "own handler" in proc.stdout.read()
        return
    assert code == -signal.SIGTERM and took < 5.0, (code, took)  # died by it, as before
    view = wait_for(lambda: (r := HubClient(hub.address).state()["state"]["ranks"])
                    and r[0]["state"] != "running" and r[0], timeout=60)
    assert (view["state"], view["state_reason"], view["exit_code"]) == (
        "exited", "ended by SIGTERM, exit 143", 143), view
    assert view["step"] == 1


CHAINED_SCRIPT = """
import signal, sys, time
import scalemon.agent as sm
run = sm.init(job=sys.argv[1], hub=sys.argv[2])
run.log(1, loss=1.0)
prev, stop = signal.getsignal(signal.SIGTERM), []
def graceful(signum, frame):  # as Lightning's: note it, call the one it replaced, stop later
    stop.append(signum)
    prev(signum, frame)
signal.signal(signal.SIGTERM, graceful)
print("ready", prev.__qualname__, flush=True)
while not stop:
    time.sleep(0.01)
time.sleep(2)  # a checkpoint on preemption
print("stopped my way", flush=True)
run.finish()
"""


def test_a_handler_chaining_to_the_agents_sigterm_handler_stops_its_own_way(start_hub):
    """A handler installed after init that calls the one it replaced (ours) keeps the rank
    alive: the script stops gracefully and its end reads as its own (finished)."""
    hub = start_hub("agentchain")
    proc = subprocess.Popen([sys.executable, "-c", CHAINED_SCRIPT, "agentchain",
                             hub.address.base], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready = proc.stdout.readline()
        assert ready.split()[1:] == ["SignalExit._on_signal"], ready + proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    assert code == 0 and "stopped my way" in proc.stdout.read(), (code, proc.stderr.read())
    view = wait_for(lambda: (r := HubClient(hub.address).state()["state"]["ranks"])
                    and r[0]["state"] != "running" and r[0], timeout=60)
    assert (view["state"], view["exit_code"]) == ("finished", 0), view


AT_SHUTDOWN_SCRIPT = """
import atexit, signal, sys, threading, time
def at_shutdown():  # SIGTERM in an atexit hook, where no thread can start (Python 3.12+)
    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")
    threading.Thread.start = refuse
    print("ready", flush=True)
    time.sleep(60)
if sys.argv[1] == "finished":  # runs after the agent's own atexit finish()
    atexit.register(at_shutdown)
import scalemon.agent as sm
run = sm.init(job=sys.argv[2], hub=sys.argv[3])
run.log(1, loss=1.0)
if sys.argv[1] == "unfinished":  # runs before it
    atexit.register(at_shutdown)
"""


@pytest.mark.parametrize("when", ["unfinished", "finished"])
def test_sigterm_at_interpreter_shutdown_still_kills(start_hub, when):
    """SIGTERM while atexit hooks run and no thread can start: the rank still dies by it."""
    job = f"agentshut{when}"
    hub = start_hub(job)
    proc = subprocess.Popen([sys.executable, "-c", AT_SHUTDOWN_SCRIPT, when, job,
                             hub.address.base], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("ready"), ready + proc.stderr.read()
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - started
    finally:
        proc.kill()
    assert code == -signal.SIGTERM and took < 5.0, (code, took, proc.stderr.read())


NATIVE_RETURN_SCRIPT = """
import ctypes, signal, sys
import scalemon.agent as sm
run = sm.init(job=sys.argv[1], hub=sys.argv[2])
run.log(1, loss=1.0)
sys.stdin.readline()  # the hub is gone now: the exit cannot leave, its send takes FLUSH_S
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # our reader thread takes it
print("ready", flush=True)
ctypes.CDLL(None).read(0, ctypes.create_string_buffer(1), 1)  # native, as a collective
print("user code ran", flush=True)  # as a DataLoader's SIGCHLD error would
"""


def test_a_main_thread_back_from_native_code_runs_no_user_code_while_the_exit_is_sent(
        start_hub):
    """SIGTERM read by the agent's thread while the main thread is in native code: when
    that returns during the send, the main thread goes no further and the rank dies by it."""
    hub = start_hub("agentnative")
    proc = subprocess.Popen([sys.executable, "-c", NATIVE_RETURN_SCRIPT, "agentnative",
                             hub.address.base], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (r := HubClient(hub.address).state()["state"]["ranks"])
                 and r[0]["step"] == 1, timeout=60)
        hub.kill()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        ready = proc.stdout.readline()
        assert ready.startswith("ready"), ready + proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.03)  # within FLUSH_S: the reader thread is sending
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write("x")
            proc.stdin.flush()  # the native call returns
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    assert code == -signal.SIGTERM, (code, proc.stderr.read())
    assert "user code ran" not in proc.stdout.read()
