"""The demo trainer end to end: torchrun with two gloo ranks on CPU, tiny preset.

Every technique is compared with a plain DDP run of the same 12 steps (`straight()`, cached
per configuration): resuming must give the same losses bit for bit, the techniques the same
trajectory within a tolerance. Jobs run in their own session and are killed in `finally`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import kill_tree, torchrun_cmd, wait_for
from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir
from scalemon.link.client import HubClient

pytestmark = [pytest.mark.integration]

STEPS = 12
BASE = ("--preset", "tiny", "--batch-size", "4")
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)$", re.M)


@dataclass
class Job:
    """A finished torchrun job: exit code, combined output, rank 0's stats file."""

    code: int
    out: str
    stats: dict | None

    def printed(self) -> list[tuple[int, str]]:
        """(step, loss as printed) in order, repeats included (a restart re-runs steps)."""
        return [(int(s), v) for s, v in STEP_LINE.findall(self.out)]

    def losses(self) -> dict[int, float]:
        """Full-precision losses by step, from the stats file."""
        assert self.stats is not None, self.out[-3000:]
        return dict(zip(self.stats["steps"], self.stats["losses"], strict=True))


def job_env(home: Path | None = None) -> dict[str, str]:
    env = os.environ.copy()
    env["OMP_NUM_THREADS"] = "1"
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    if home is not None:
        env.update(SCALEMON_HOME=str(home), SCALEMON_JOB_ID=home.name,
                   SCALEMON_HUB_ARGS="--linger 30")
    return env


def start(tmp: Path, tag: str, *args: str, extra: tuple[str, ...] = (),
          home: Path | None = None) -> tuple[subprocess.Popen, Path, Path]:
    """Launch a job in its own session; returns (process, output file, stats file)."""
    out, stats = tmp / f"{tag}.out", tmp / f"{tag}.json"
    stats.unlink(missing_ok=True)
    with open(out, "w") as log:
        proc = subprocess.Popen(
            torchrun_cmd(*BASE, *args, "--stats-json", str(stats), extra=extra),
            env=job_env(home), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out, stats


def run(tmp: Path, tag: str, *args: str, extra: tuple[str, ...] = (), timeout: float = 120,
        home: Path | None = None) -> Job:
    """Launch a job and wait for it."""
    proc, out, stats = start(tmp, tag, *args, extra=extra, home=home)
    try:
        code = proc.wait(timeout=timeout)
    finally:
        kill_tree(proc)
    text = out.read_text()
    return Job(code, text, json.loads(stats.read_text()) if stats.exists() else None)


_STRAIGHT: dict[tuple[str, ...], Job] = {}


def straight_job(tmp: Path, *flags: str) -> Job:
    """The uninterrupted 12-step run of a configuration (run in `tmp` once per session)."""
    if flags not in _STRAIGHT:
        job = run(tmp, f"s{len(_STRAIGHT)}", *flags, "--max-steps", str(STEPS), timeout=300)
        assert job.code == 0, job.out[-3000:]
        assert [s for s, _ in job.printed()] == list(range(1, STEPS + 1))
        _STRAIGHT[flags] = job
    return _STRAIGHT[flags]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory):
    """`straight(*flags)`: the uninterrupted 12-step run of a configuration (cached)."""
    tmp = tmp_path_factory.mktemp("straight")
    return lambda *flags: straight_job(tmp, *flags)


def ckpt_args(ckpt: Path, every: int, *more: str) -> tuple[str, ...]:
    return ("--ckpt-dir", str(ckpt), "--ckpt-every", str(every), *more)


# -----------------------------------------------------------------------------
# checkpoints


def test_resume_is_exact_keeps_k_and_skips_a_corrupt_checkpoint(straight, tmp_path):
    ref = straight().losses()
    ckpt = tmp_path / "ckpt"
    first = run(tmp_path, "a", "--max-steps", "6", *ckpt_args(ckpt, 3, "--keep", "2"))
    assert first.code == 0, first.out[-3000:]
    assert first.losses() == {s: ref[s] for s in range(1, 7)}
    second = run(tmp_path, "b", "--max-steps", str(STEPS), "--resume",
                 *ckpt_args(ckpt, 3, "--keep", "2"))
    assert second.code == 0, second.out[-3000:]
    assert f"resumed from {ckpt / 'step_000006'} (step 6)" in second.out
    assert second.losses() == {s: ref[s] for s in range(7, STEPS + 1)}  # bit for bit
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000009", "step_000012"]

    victim = ckpt / "step_000012" / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    third = run(tmp_path, "c", "--max-steps", str(STEPS), "--resume", *ckpt_args(ckpt, 3))
    assert third.code == 0, third.out[-3000:]
    assert "step_000012 is corrupt (__0_0.distcp does not match its sha256)" in third.out
    assert f"resumed from {ckpt / 'step_000009'} (step 9)" in third.out
    assert third.losses() == {s: ref[s] for s in range(10, STEPS + 1)}
    assert (ckpt / "step_000012.corrupt").is_dir() and (ckpt / "step_000012").is_dir()


@pytest.mark.parametrize("flags", [
    ("--zero", "1", "--optimizer", "fused"),
    ("--zero", "3", "--amp", "fp16", "--inject-overflow", "2"),
], ids=["zero1-fused-adamw", "zero3-fp16-scaler"])
def test_resume_is_exact_with_sharded_state(straight, tmp_path, flags):
    ref = straight(*flags).losses()
    ckpt = tmp_path / "ckpt"
    first = run(tmp_path, "a", *flags, "--max-steps", "6", *ckpt_args(ckpt, 6))
    assert first.code == 0, first.out[-3000:]
    second = run(tmp_path, "b", *flags, "--max-steps", str(STEPS), "--resume",
                 *ckpt_args(ckpt, 6))
    assert second.code == 0, second.out[-3000:]
    assert second.losses() == {s: ref[s] for s in range(7, STEPS + 1)}
    meta = json.loads((ckpt / "step_000006" / "meta.json").read_text())
    layout = "zero1-consolidated" if flags[1] == "1" else "dcp"
    assert meta["optimizer_layout"] == layout and meta["world_size"] == 2


def test_crash_at_step_7_restarts_from_the_last_checkpoint(straight, tmp_path):
    ref = straight()
    job = run(tmp_path, "crash", "--max-steps", str(STEPS), "--resume-or-start",
              *ckpt_args(tmp_path / "ckpt", 5), "--inject-crash", "1:7",
              extra=("--max-restarts", "1"), timeout=180)
    assert job.code == 0, job.out[-3000:]
    assert "rank 1: injected crash before step 7" in job.out
    assert job.out.count("starting from step 0 (--resume-or-start)") == 1  # the 1st attempt
    assert f"resumed from {tmp_path / 'ckpt' / 'step_000005'} (step 5)" in job.out
    want = dict(ref.printed())
    printed = job.printed()
    assert [s for s, _ in printed] == [1, 2, 3, 4, 5, 6, *range(6, STEPS + 1)]
    assert all(loss == want[s] for s, loss in printed)
    assert job.losses() == {s: ref.losses()[s] for s in range(6, STEPS + 1)}  # 2nd attempt


def test_sigterm_saves_a_checkpoint_that_resumes(straight, tmp_path):
    ref = straight().losses()
    ckpt = tmp_path / "ckpt"
    proc, out, _ = start(tmp_path, "term", "--max-steps", "500", "--step-delay", "0.2",
                         *ckpt_args(ckpt, 1000))
    try:
        wait_for(lambda: "step 3 loss" in out.read_text(), timeout=60)
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on to its workers
        proc.wait(timeout=60)
    finally:
        kill_tree(proc)
    text = out.read_text()
    saved = re.search(r"checkpoint: saved \S+step_(\d+) \(SIGTERM", text)
    assert saved, text[-3000:]
    step = int(saved.group(1))
    assert f"SIGTERM: stopped after step {step} with a checkpoint" in text
    assert 3 <= step < STEPS - 1
    resumed = run(tmp_path, "resumed", "--max-steps", str(step + 2), "--resume",
                  *ckpt_args(ckpt, 1000))
    assert resumed.code == 0, resumed.out[-3000:]
    assert resumed.losses() == {s: ref[s] for s in (step + 1, step + 2)}


# -----------------------------------------------------------------------------
# techniques against plain DDP


@pytest.mark.parametrize("flags, rtol", [
    (("--batch-size", "1", "--grad-accum", "4"), 1e-5),
    (("--activation-checkpointing",), 0.0),
    (("--zero", "1"), 1e-5),
    (("--zero", "2"), 1e-5),
    (("--zero", "3"), 1e-5),
    (("--optimizer", "fused-flat", "--batch-size", "2", "--grad-accum", "2"), 1e-5),
], ids=["grad-accum-4x1-vs-batch-4", "activation-checkpointing", "zero1", "zero2", "zero3",
        "fused-flat-adamw-grad-accum-2x2"])
def test_technique_follows_the_ddp_trajectory(straight, flags, rtol):
    ref = straight().losses()
    got = straight(*flags).losses()
    assert got.keys() == ref.keys()
    for step, loss in got.items():
        assert loss == pytest.approx(ref[step], rel=rtol, abs=0), f"step {step}"
    assert got[STEPS] < got[1] - 0.5  # and it trains


@pytest.mark.parametrize("parallel, scope", [((), "model"), (("--zero", "3"), "blocks")],
                         ids=["ddp-whole-model", "fsdp2-per-block"])
def test_compile_follows_the_eager_trajectory(straight, parallel, scope):
    eager = straight(*parallel).losses()
    job = straight(*parallel, "--compile")
    assert f"compile {scope}, " in job.out, job.out[-3000:]
    for step, loss in job.losses().items():
        assert loss == pytest.approx(eager[step], rel=1e-4, abs=0), f"step {step}"


# -----------------------------------------------------------------------------
# with the monitor


def hub_state(home: Path) -> dict | None:
    path = jobs_dir(home) / f"{home.name}.json"
    if not path.exists():
        return None
    try:
        address = HubAddress.parse(JobFile.read(path).address)
        return HubClient(address, timeout_s=2).state()["state"]
    except Exception:
        return None


def test_fp16_planted_overflow_halves_the_scale_and_skips_the_step(home, tmp_path):
    job = run(tmp_path, "fp16", "--monitor", "--amp", "fp16", "--inject-overflow", "3",
              "--max-steps", "5", home=home)
    assert job.code == 0, job.out[-3000:]
    assert "amp: step 3 skipped (inf/NaN gradients), loss scale 65536 -> 32768" in job.out
    assert job.stats["loss_scales"] == [65536.0, 65536.0, 32768.0, 32768.0, 32768.0]
    state = wait_for(lambda: (s := hub_state(home)) and all(
        r["state"] == "finished" for r in s["ranks"]) and len(s["ranks"]) == 2 and s)
    for r in state["ranks"]:  # every rank skipped it: the gradients were all-reduced
        assert r["loss_scale"] == 32768.0 and r["skipped_steps"] == 1, r
    estimate = state["info"]["memory_estimate"]
    assert estimate["0"]["total"] == job.stats["memory_estimate"]["total"]


def test_inject_hang_leaves_the_other_rank_waiting_in_the_allreduce(home, tmp_path):
    proc, out, _ = start(tmp_path, "hang", "--monitor", "--inject-hang", "1:5",
                         "--max-steps", "100", home=home)

    def hung() -> dict | None:
        state = hub_state(home)
        if not state or len(state["ranks"]) < 2:
            return None
        r0, r1 = state["ranks"]
        ok = (r1["phase"] == "injected-hang" and r0["phase"] == "allreduce"
              and r0["collectives_issued"] > r0["collectives_completed"]
              and r0["phase_since_s"] > 1.0)
        return state if ok else None

    try:
        state = wait_for(hung, timeout=90, interval=0.5)
        assert proc.poll() is None
        assert "rank 1: injected hang before step 5" in out.read_text()
        r0, r1 = state["ranks"]
        assert r0["step"] == 4 and r1["step"] == 4
        time.sleep(1.0)
        assert re.findall(r"^step (\d+) ", out.read_text(), re.M)[-1] == "4"
    finally:
        kill_tree(proc)
