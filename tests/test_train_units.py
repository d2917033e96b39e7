"""CPU unit tests of the demo trainer's parts, in this process (one rank, no process group):
the memory formula, gradients of the techniques, the loss scaler, faults, checkpoints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from scalemon.demo_train import train, train_loop, train_setup, train_stats
from scalemon.demo_train.checkpoint import (
    Checkpointer,
    CheckpointError,
    IncompatibleCheckpoint,
    NoCheckpoint,
    list_checkpoints,
)
from scalemon.demo_train.faults import Faults, RankStep, rank_step
from scalemon.demo_train.memory import activation_bytes, estimate_memory
from scalemon.demo_train.model import GPTConfig
from scalemon.demo_train.parallel import DistEnv, compile_scope

CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(Path(json.__file__).read_text() * 4)
    return path


def trainer(corpus: Path, *flags: str) -> train_setup.Trainer:
    args = train.parse_args(["--preset", "tiny", "--data", str(corpus), "--batch-size", "4",
                             "--device", "cpu", *flags])
    return train_setup.build(args, CPU)


def steps(t: train_setup.Trainer, n: int) -> list[float]:
    out = []
    for _ in range(n):
        step = t.data.batches_served + 1
        loss = train_loop.forward_backward(t, step)
        train_loop.optimizer_step(t)
        out.append(loss.item())
    return out


def grads(t: train_setup.Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in t.model.named_parameters()}


# -----------------------------------------------------------------------------
# memory estimate


def test_memory_formula_reproduces_the_seed_example() -> None:
    # seed 001: GPT-1 shapes, 147M params, s=512, mixed precision, attention scores stored
    cfg = GPTConfig(block_size=512, n_layer=12, n_head=12, n_embd=768)
    est = estimate_memory(cfg, 147_000_000, 1, amp="bf16", fused_attention=False)
    assert est.params == 294_000_000  # 2 bytes/param
    assert est.optimizer == 147_000_000 * (4 + 12)
    assert est.gradients == 294_000_000
    assert est.activations == 349_175_808  # 512*768*12*(10 + 24 + 5*12*512/768)
    assert est.total == 2_940_000_000 + 349_175_808
    batch64 = estimate_memory(cfg, 147_000_000, 64, amp="bf16", fused_attention=False)
    assert batch64.total / 1e9 == pytest.approx(25.3, abs=0.05)  # "~25.3G" in the seed


def test_memory_divided_by_zero_stage_and_checkpointing() -> None:
    cfg = GPTConfig.preset("tiny")
    s, b, h, L = cfg.block_size, 4, cfg.n_embd, cfg.n_layer
    n = 100_000
    plain = estimate_memory(cfg, n, b)
    assert (plain.params, plain.gradients, plain.optimizer) == (4 * n, 4 * n, 8 * n)
    assert plain.activations == s * b * h * L * 34 * 2  # fp32: twice the fp16 formula
    z = [estimate_memory(cfg, n, b, zero=k, world_size=2) for k in (1, 2, 3)]
    assert (z[0].params, z[0].gradients, z[0].optimizer) == (4 * n, 4 * n, 4 * n)
    assert (z[1].params, z[1].gradients, z[1].optimizer) == (4 * n, 2 * n, 4 * n)
    assert (z[2].params, z[2].gradients, z[2].optimizer) == (2 * n, 2 * n, 4 * n)
    assert all(e.activations == plain.activations for e in z)
    ckpt = activation_bytes(cfg, b, mixed_precision=True, activation_checkpointing=True,
                            fused_attention=True)
    assert ckpt == 2 * s * b * h * L + s * b * h * 34


def test_printed_estimate_is_the_formula(corpus, capsys) -> None:
    t = trainer(corpus, "--zero", "0")
    out = capsys.readouterr().out
    n = sum(p.numel() for p in t.model.parameters())
    cfg = t.model.config
    s, b, h, L = cfg.block_size, 4, cfg.n_embd, cfg.n_layer
    want = n * (4 + 4 + 8) + s * b * h * L * 34 * 2
    assert t.memory.total == want
    assert f"= {want / 2**20:.2f} MiB ({want} bytes; fp32, ZeRO-0 over 1 rank(s)" in out


# -----------------------------------------------------------------------------
# techniques: same gradients


def test_grad_accum_gives_the_gradients_of_the_full_batch(corpus) -> None:
    full = trainer(corpus)
    accum = trainer(corpus, "--batch-size", "1", "--grad-accum", "4")
    loss_full = train_loop.forward_backward(full, 1)
    loss_accum = train_loop.forward_backward(accum, 1)
    assert loss_accum.item() == pytest.approx(loss_full.item(), rel=1e-6)
    g_full, g_accum = grads(full), grads(accum)
    for name, g in g_full.items():
        torch.testing.assert_close(g_accum[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_activation_checkpointing_gives_the_same_gradients(corpus) -> None:
    plain = trainer(corpus)
    ckpt = trainer(corpus, "--activation-checkpointing")
    assert ckpt.model.activation_checkpointing
    train_loop.forward_backward(plain, 1)
    train_loop.forward_backward(ckpt, 1)
    g_plain, g_ckpt = grads(plain), grads(ckpt)
    for name, g in g_plain.items():
        torch.testing.assert_close(g_ckpt[name], g, rtol=0, atol=0, msg=name)


def test_fp16_overflow_is_skipped_and_halves_the_scale(corpus) -> None:
    t = trainer(corpus, "--amp", "fp16", "--inject-overflow", "2")
    assert isinstance(t.scaler, torch.amp.GradScaler)
    steps(t, 1)
    assert t.scaler.get_scale() == 65536.0
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    adam_steps = [s["step"].item() for s in t.optimizer.state.values()]
    steps(t, 1)  # step 2: inf gradients
    assert t.scaler.get_scale() == 32768.0
    for name, p in t.model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert [s["step"].item() for s in t.optimizer.state.values()] == adam_steps
    steps(t, 1)
    assert t.scaler.get_scale() == 32768.0
    assert not torch.equal(t.model.lm_head.weight, before["transformer.wte.weight"])


# -----------------------------------------------------------------------------
# faults


def test_rank_step_parsing() -> None:
    assert rank_step("1:5") == RankStep(1, 5) and str(RankStep(1, 5)) == "1:5"
    for bad in ("5", "a:b", "1:0", "-1:3"):
        with pytest.raises(Exception, match="RANK:STEP|RANK >= 0"):
            rank_step(bad)


def test_crash_only_in_the_first_attempt(monkeypatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert Faults(1, crash=RankStep(1, 7)).crash_step == 7
    assert Faults(0, crash=RankStep(1, 7)).crash_step is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert Faults(1, crash=RankStep(1, 7)).crash_step is None
    with pytest.raises(RuntimeError, match="inject-crash 1:7"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
        Faults(1, crash=RankStep(1, 7)).before_step(7)


# -----------------------------------------------------------------------------
# checkpoints


@pytest.mark.parametrize("optimizer", ["torch", "fused", "fused-flat"])
def test_checkpoint_round_trip_is_exact(corpus, tmp_path, optimizer) -> None:
    if optimizer.startswith("fused"):
        from scalemon.demo_train import fused_adam

        assert fused_adam.interpreted(), "tests/conftest.py sets TRITON_INTERPRET=1 first"
    flags = ("--optimizer", optimizer, "--amp", "fp16")
    a = trainer(corpus, *flags)
    steps(a, 3)
    Checkpointer(tmp_path, log=lambda _m: None).save(3, a.state)
    want = steps(a, 2)
    b = trainer(corpus, *flags)
    assert Checkpointer(tmp_path, log=lambda _m: None).load_latest(b.state) == 3
    assert b.data.batches_served == 3
    assert b.scaler.get_scale() == a.scaler.get_scale()
    assert steps(b, 2) == want
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_keep_prunes_and_a_half_written_checkpoint_is_ignored(corpus, tmp_path) -> None:
    t = trainer(corpus)
    ck = Checkpointer(tmp_path, keep=2, log=lambda _m: None)
    for step in (1, 2, 3):
        steps(t, 1)
        ck.save(step, t.state)
    (tmp_path / "step_000004.tmp").mkdir()  # a save that crashed half way
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 2]
    meta = json.loads((tmp_path / "step_000003" / "meta.json").read_text())
    assert meta["step"] == 3 and meta["world_size"] == 1 and meta["optimizer_layout"] == "dcp"
    assert set(meta["files"]) == {".metadata", "__0_0.distcp", "rank0.pt"}
    assert meta["config"]["preset"] == "tiny"
    fresh = trainer(corpus)
    assert Checkpointer(tmp_path, log=lambda _m: None).load_latest(fresh.state) == 3
    steps(t, 1)
    ck.save(4, t.state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000004"]


def test_a_corrupt_checkpoint_is_reported_and_the_previous_one_used(corpus, tmp_path) -> None:
    t = trainer(corpus)
    messages: list[str] = []
    ck = Checkpointer(tmp_path, keep=0, log=messages.append)
    for step in (1, 2, 3):
        steps(t, 1)
        ck.save(step, t.state)
    (tmp_path / "step_000003" / "rank0.pt").write_bytes(b"garbage")
    (tmp_path / "step_000002" / "meta.json").unlink()
    fresh = trainer(corpus)
    messages.clear()
    assert Checkpointer(tmp_path, log=messages.append).load_latest(fresh.state) == 1
    assert any("step_000003 is corrupt (rank0.pt has 7 bytes" in m for m in messages)
    assert any("step_000002 is corrupt (meta.json is missing)" in m for m in messages)
    assert (tmp_path / "step_000003.corrupt").is_dir()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]


def test_no_usable_or_incompatible_checkpoints_are_clear_errors(corpus, tmp_path) -> None:
    t = trainer(corpus)
    quiet = Checkpointer(tmp_path, log=lambda _m: None)
    with pytest.raises(NoCheckpoint, match="no checkpoint in"):  # nothing there
        quiet.load_latest(t.state)
    steps(t, 1)
    quiet.save(1, t.state)
    meta_path = tmp_path / "step_000001" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "world_size": 4}))
    with pytest.raises(IncompatibleCheckpoint, match="written by 4 rank"):
        quiet.load_latest(t.state)
    (tmp_path / "step_000001" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        quiet.load_latest(t.state)


# -----------------------------------------------------------------------------
# device choice: a GPU per rank, or a clear stop


@pytest.mark.parametrize(("requested", "local_rank", "ranks", "gpus", "expected"), [
    ("auto", 0, 1, 0, "cpu"),
    ("auto", 1, 2, 0, "cpu"),
    ("auto", 1, 2, 2, "cuda:1"),
    ("auto", 0, 1, 8, "cuda:0"),
    ("cuda", 3, 4, 4, "cuda:3"),
    ("cpu", 1, 2, 8, "cpu"),
])
def test_device_choice_gives_each_rank_its_own_gpu_or_the_cpu(requested, local_rank, ranks,
                                                              gpus, expected) -> None:
    from scalemon.demo_train.parallel import choose_device

    assert str(choose_device(requested, local_rank, ranks, gpus)) == expected


@pytest.mark.parametrize(("requested", "ranks", "gpus", "says"), [
    ("auto", 2, 1, "2 ranks on this node but 1 visible GPU(s)"),
    ("cuda", 8, 4, "torchrun --nproc-per-node 4"),
    ("cuda", 1, 0, "no CUDA GPU is visible: use --device cpu"),
])
def test_device_choice_refuses_what_cannot_work_and_names_the_fix(requested, ranks, gpus,
                                                                  says) -> None:
    from scalemon.demo_train.parallel import DeviceChoiceError, choose_device

    with pytest.raises(DeviceChoiceError, match="--device cpu") as err:
        choose_device(requested, 0, ranks, gpus)
    assert says in str(err.value)


def test_two_ranks_on_one_gpu_stop_with_one_line_instead_of_a_traceback(monkeypatch,
                                                                        capsys) -> None:
    """The 1-GPU machine case: rank 1 would get cuda:1, which does not exist."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *_: pytest.fail("set_device called"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    assert train.main(["--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("train.py: 2 ranks on this node but 1 visible GPU(s)")
    assert "--device cpu" in err and "--nproc-per-node 1" in err


def test_the_other_ranks_wait_quietly_for_local_rank_0_to_say_why(monkeypatch, capsys) -> None:
    """Rank 1 of the same job says nothing and waits (torchrun ends it once rank 0 has said
    why and exited): exiting at once, it could have torchrun stop rank 0 before it printed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    slept: list[float] = []
    monkeypatch.setattr(train.time, "sleep", slept.append)
    assert train.main(["--max-steps", "1"]) == 2
    assert capsys.readouterr().err == ""
    assert slept == [train.FlagParser.QUIET_RANK_WAIT_S]


@pytest.mark.integration
def test_two_ranks_on_fewer_gpus_end_the_job_with_one_line_from_local_rank_0() -> None:
    """For real, under torchrun: two ranks asking for a GPU each where there are fewer (none
    on a CPU machine, one on the 1-GPU machine) end the job, and the reason is said once."""
    import os
    import subprocess

    from conftest import torchrun_cmd

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2:
        pytest.skip(f"{gpus} GPUs here: two ranks get one each")
    says = ("train.py: --device cuda, but no CUDA GPU is visible: use --device cpu" if gpus == 0
            else "train.py: 2 ranks on this node but 1 visible GPU(s), and each rank needs its "
                 "own: use --device cpu (gloo), or start at most 1 rank(s) per node")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    done = subprocess.run(torchrun_cmd("--max-steps", "1", device="cuda"), env=env,
                          capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    assert out.count(says) == 1, out[-3000:]
    assert "]: Traceback" not in out  # no rank's traceback (torchrun's own may follow)


# -----------------------------------------------------------------------------
# --log-every: host reads only on logged steps, throughput between them


class FakeMonitor:
    """What the trainer calls on a monitor run, recorded."""

    agent_time_total_s = 0.0

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []

    def log(self, step: int, loss: object = None, tokens: int | None = None, **extra) -> None:
        self.logged.append((step, extra))

    def set_phase(self, name: str) -> None:
        pass

    def info(self, key: str, value: object) -> None:
        pass

    def finish(self, code: int = 0) -> None:
        pass


def test_host_values_are_read_only_on_logged_steps(corpus, monkeypatch, capsys) -> None:
    t = trainer(corpus, "--max-steps", "10", "--log-every", "4")
    reads: list[float] = []

    def counting_read(loss: torch.Tensor) -> float:
        reads.append(loss.item())
        return reads[-1]

    monkeypatch.setattr(train_loop, "read_loss", counting_read)
    t.monitor = FakeMonitor()
    assert train_loop.train(t) == 0
    printed = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("step ")]
    assert len(reads) == 3  # steps 4, 8 and the last one, 10
    assert printed == [f"step {s} loss {v:.4f}" for s, v in zip((4, 8, 10), reads, strict=True)]
    assert [s for s, _ in t.monitor.logged] == list(range(1, 11))  # the monitor gets every step
    assert all("tokens_per_s" not in e for _, e in t.monitor.logged)  # scalemon's, from tokens
    assert all("mfu" not in e for _, e in t.monitor.logged)  # no known peak on a CPU


def test_log_every_defaults_to_1_on_cpu_and_10_on_cuda(corpus) -> None:
    assert trainer(corpus).log_every == 1
    assert trainer(corpus, "--log-every", "3").log_every == 3
    with pytest.raises(SystemExit):
        train.parse_args(["--log-every", "0"])
    if torch.cuda.is_available():
        args = train.parse_args(["--preset", "tiny", "--data", str(corpus), "--device", "cuda"])
        cuda = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0))
        tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        try:
            assert train_setup.build(args, cuda).log_every == 10
        finally:  # build() turned TF32 on (--tf32 on) for this whole test process
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def test_tokens_per_s_is_timed_between_syncs_so_waiting_for_the_device_counts(
        corpus, monkeypatch, capsys) -> None:
    """A read that waits (as `loss.item()` waits for the GPU) is inside the measured time: the
    printed rate is what the device achieved, not how fast the host queued work."""
    t = trainer(corpus, "--max-steps", "4", "--log-every", "2")
    wait_s = 0.3

    def slow_read(loss: torch.Tensor) -> float:
        import time

        time.sleep(wait_s)
        return loss.item()

    monkeypatch.setattr(train_loop, "read_loss", slow_read)
    t.monitor = FakeMonitor()
    train_loop.train(t)
    printed = re.search(r"^throughput: ([\d,]+) tokens/s per rank \(wall time between step "
                        r"ends\)", capsys.readouterr().out, re.M)
    assert printed
    most = t.tokens_per_step * 2 / wait_s  # 2 steps per interval, each with one wait
    assert float(printed.group(1).replace(",", "")) < most


def test_sync_clock_counts_sleeps_and_leaves_warm_up_out() -> None:
    """scalemon's one tokens/s: wall time between step ends, --step-delay sleeps included (as
    the monitor's step times have them), so the trainer prints what the dashboard shows."""
    clock = train_stats.SyncClock(step=0, now=100.0)
    assert clock.lap(10, 105.0) == (10, 5.0)  # warm-up interval
    assert clock.lap(20, 108.0) == (10, 3.0)  # a second of it asleep: counted
    assert clock.lap(30, 110.0) == (10, 2.0)
    assert clock.tokens_per_s(100) == pytest.approx(100 * 20 / 5.0)  # the first one left out
    assert train_stats.SyncClock(0, 0.0).tokens_per_s(100) is None


# -----------------------------------------------------------------------------
# flag values: checked before torch.distributed starts, argparse's exit code 2


@pytest.mark.parametrize(("flags", "says"), [
    (("--max-steps", "-5"), "argument --max-steps: must be at least 1, not -5"),
    (("--max-steps", "0"), "argument --max-steps: must be at least 1, not 0"),
    (("--batch-size", "0"), "argument --batch-size: must be at least 1, not 0"),
    (("--block-size", "-1"), "argument --block-size: must be at least 1, not -1"),
    (("--grad-accum", "0"), "argument --grad-accum: must be at least 1, not 0"),
    (("--lr", "0"), "argument --lr: must be more than 0, not 0"),
    (("--lr=-1e-3",), "argument --lr: must be more than 0, not -1e-3"),
    (("--lr", "-0.001"), "argument --lr: must be more than 0, not -0.001"),
    (("--lr", "nan"), "argument --lr: must be more than 0, not nan"),
    (("--lr", "fast"), "argument --lr: 'fast' is not a number"),
    (("--weight-decay", "-0.1"), "argument --weight-decay: must be 0 or more, not -0.1"),
    (("--seed", "-1"), "argument --seed: must be from 0 to 9223372036854775807, not -1"),
    (("--seed", str(2**64)), "argument --seed: must be from 0 to 9223372036854775807"),
    (("--ckpt-every", "-1"), "argument --ckpt-every: must be at least 0, not -1"),
    (("--keep", "-2"), "argument --keep: must be at least 0, not -2"),
    (("--log-every", "0"), "argument --log-every: must be at least 1, not 0"),
    (("--inject-overflow", "0"), "argument --inject-overflow: must be at least 1, not 0"),
    (("--inject-overflow", "3"), "--inject-overflow needs --amp fp16 (not auto)"),
    (("--inject-overflow", "3", "--amp", "bf16"), "--inject-overflow needs --amp fp16 (not bf16)"),
    (("--step-delay", "-1"), "argument --step-delay: must be 0 or more, not -1"),
    (("--step-delay", "inf"), "argument --step-delay: must be 0 or more, not inf"),
    (("--batch-size", "2.5"), "argument --batch-size: '2.5' is not a whole number"),
    (("--resume",), "--resume needs --ckpt-dir"),
    (("--resume-or-start",), "--resume-or-start needs --ckpt-dir"),
    (("--inject-crash", "1:3"), "--inject-crash 1:3 names rank 1, and this job has 1 rank(s)"),
    (("--compile", "whole"), "argument --compile: invalid choice: 'whole'"),
])
def test_a_mistaken_flag_value_is_refused_saying_what_is_wrong(flags, says, capsys,
                                                               monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(list(flags))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"train.py: error: {says}" in err, err


@pytest.mark.integration
def test_flag_mistakes_are_said_by_local_rank_0_only(capsys, monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(["--max-steps", "-5"])
    assert exit_.value.code == 2 and capsys.readouterr().err == ""


def test_valid_edge_values_are_accepted(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = train.parse_args(["--max-steps", "1", "--lr", "1e-9", "--weight-decay", "0",
                             "--ckpt-every", "0", "--keep", "0", "--seed", "0",
                             "--step-delay", "0", "--inject-crash", "1:3", "--ckpt-dir", "x",
                             "--resume-or-start"])
    assert (args.max_steps, args.lr, args.ckpt_every, args.resume_or_start) == (1, 1e-9, 0, True)


@pytest.mark.parametrize("flags, world_size, scope", [
    ((), 2, None),
    (("--compile",), 1, "model"),
    (("--compile",), 2, "model"),
    (("--compile", "--zero", "1"), 2, "model"),
    (("--compile", "--zero", "3"), 2, "blocks"),
    (("--compile", "--zero", "3"), 1, "model"),  # one process: nothing is sharded
    (("--compile", "blocks"), 2, "blocks"),
    (("--compile", "model", "--zero", "2"), 1, "model"),
])
def test_compile_scope_is_the_whole_model_unless_fsdp2_shards_it(flags, world_size, scope,
                                                                 monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    args = train.parse_args(list(flags))
    assert compile_scope(args.compile, sharded=args.zero >= 2 and world_size > 1) == scope


def test_compile_model_under_fsdp2_is_refused_naming_the_fix(monkeypatch, capsys) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit):
        train.parse_args(["--compile", "model", "--zero", "2"])
    err = capsys.readouterr().err
    assert "--compile model is not for FSDP2" in err and "use --compile" in err, err


def test_max_steps_minus_5_stops_before_torch_distributed_starts(monkeypatch, capsys) -> None:
    monkeypatch.setattr(train, "setup_distributed",
                        lambda *_: pytest.fail("torch.distributed was started"))
    with pytest.raises(SystemExit) as exit_:
        train.main(["--max-steps", "-5"])
    assert exit_.value.code == 2
    assert "must be at least 1, not -5" in capsys.readouterr().err


def test_tf32_changes_nothing_off_cuda() -> None:
    from scalemon.demo_train.precision import set_tf32

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    assert set_tf32(True, torch.device("cpu")) == "n/a"
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tf32_on_cuda_follows_the_flag() -> None:
    from scalemon.demo_train.precision import set_tf32

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        assert set_tf32(False, torch.device("cuda")) == "off"
        assert not torch.backends.cuda.matmul.allow_tf32
        assert set_tf32(True, torch.device("cuda")) == "on"
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_a_rank_that_never_checkpoints_never_imports_dcp():
    """torch.distributed.checkpoint costs ~0.6 s of CPU at import: the trainer loads it at the
    first save or resume, not at every rank's start."""
    import subprocess
    import sys

    code = ("import sys, scalemon.demo_train.train; "
            "assert 'torch.distributed.checkpoint' not in sys.modules, 'dcp imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
