"""Live flag toggles end to end: real torchrun jobs (2 gloo ranks on the CPU), the real hub the
ranks start, and `scalemon toggle` / `scalemon flags` as a person runs them."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from test_collectives_jobs import job_env, snapshot

from conftest import HubProcess, kill_tree, torchrun_cmd, wait_for
from scalemon import protocol
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir
from scalemon.link.client import HubClient
from scalemon.link.control import ControlError, Controller, check_reachable

REFUSED = 3


def scalemon(home: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run the `scalemon` CLI against the test's SCALEMON_HOME."""
    return subprocess.run([sys.executable, "-m", "scalemon.cli", *args], env=job_env(home),
                          capture_output=True, text=True, timeout=timeout)


def start_job(home: Path, out: Path, *train_args: str,
              extra: tuple[str, ...] = ()) -> subprocess.Popen:
    with open(out, "w") as log:
        return subprocess.Popen(
            torchrun_cmd("--preset", "tiny", "--batch-size", "2", "--monitor", *train_args,
                         extra=extra),
            env=job_env(home), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def running_at(home: Path, step: int) -> dict:
    """The snapshot once both ranks ran `step` and reported their flags."""
    return wait_for(lambda: (s := snapshot(home)) and len(s["ranks"]) == 2 and all(
        (r["step"] or 0) >= step and r["flags"]["pg_timeout_s"] for r in s["ranks"]) and s,
        timeout=120, interval=0.5)


def toggle_record(state: dict, toggle_id: int) -> dict:
    return next(t for t in state["toggles"] if t["id"] == toggle_id)


DESYNC_STEP = 600
"""Far enough ahead: the refusals checked first take ~10 CLI runs (20 steps a second go by;
at 150 a loaded machine got there before DETAIL was in effect)."""


@pytest.mark.integration
def test_detail_goes_live_on_both_ranks_at_one_step_and_back(home, tmp_path):
    out = tmp_path / "job.out"
    proc = start_job(home, out, "--max-steps", "100000", "--step-delay", "0.05",
                     "--inject-desync", f"1:{DESYNC_STEP}")
    try:
        before = running_at(home, 3)
        assert [r["flags"]["TORCH_DISTRIBUTED_DEBUG"] for r in before["ranks"]] == ["OFF"] * 2
        check_refusals(home, before)

        done = scalemon(home, "toggle", home.name, "TORCH_DISTRIBUTED_DEBUG=DETAIL")
        assert done.returncode == 0, done.stderr
        state = snapshot(home)
        on = toggle_record(state, int(done.stdout.split("#")[1].split(":")[0]))
        assert on["state"] == "applied" and on["tier"] == "live"
        steps = {r["step"] for r in on["results"].values()}
        assert len(on["results"]) == 2 and steps == {on["at_step"]}, on  # one boundary
        assert [r["flags"]["TORCH_DISTRIBUTED_DEBUG"] for r in state["ranks"]] == ["DETAIL"] * 2
        assert on["at_step"] < DESYNC_STEP, "the planted desync must come after DETAIL"
        # torch's own check (the DETAIL wrapper) names the mismatch, in the job's output and
        # in the log lines the agents stream to the hub
        wait_for(lambda: out.read_text().count("Detected mismatch between collectives") >= 2,
                 timeout=120)
        assert "_ProcessGroupWrapper" in out.read_text()
        wait_for(lambda: any("Detected mismatch" in line["text"]
                             for line in snapshot(home)["log"]["last"]), timeout=20)

        back = scalemon(home, "toggle", home.name, "TORCH_DISTRIBUTED_DEBUG=OFF")
        assert back.returncode == 0, back.stderr
        state = snapshot(home)
        assert [r["flags"]["TORCH_DISTRIBUTED_DEBUG"] for r in state["ranks"]] == ["OFF"] * 2
        assert "DDP rebuilt on a new group" in state["toggles"][-1]["text"]
        step_back = state["toggles"][-1]["step"]
        wait_for(lambda: all(r["step"] >= step_back + 5 for r in snapshot(home)["ranks"]),
                 timeout=60)  # training goes on, on the new groups
        assert proc.poll() is None, out.read_text()[-3000:]
        audit = [json.loads(line) for line in
                 (home / "run" / home.name / "toggles.log").read_text().splitlines()]
        assert [a["state"] for a in audit if a["name"] == "TORCH_DISTRIBUTED_DEBUG"] == [
            "requested", "applied", "requested", "applied"]
        assert all(a["user"] == pwd.getpwuid(os.getuid()).pw_name for a in audit
                   if a["state"] in ("requested", "refused"))
    finally:
        kill_tree(proc)


def check_refusals(home: Path, before: dict) -> None:
    """Bad toggles are refused with a non-zero exit, by the CLI and by the hub itself, and
    change nothing."""
    for assignment, words in (("LD_PRELOAD=x", "not a flag scalemon changes"),
                              ("NCCL_ALGO=Ring;rm -rf", "characters no valid value has"),
                              ("NCCL_FOO=1", "not among the flags"),
                              ("NCCL_DEBUG=INFO\nLD_PRELOAD=x", "control character")):
        done = scalemon(home, "toggle", home.name, assignment)
        assert done.returncode == REFUSED and words in done.stderr, (assignment, done.stderr)
    # the hub refuses them too, when a client skips the CLI's check
    job_file = JobFile.read(jobs_dir(home) / f"{home.name}.json")
    control = Controller(job_file.hub_address())
    try:
        for name, value in (("LD_PRELOAD", "x"), ("NCCL_ALGO", "Ring;rm -rf"),
                            ("NCCL_FOO", "1"), ("PATH", "/tmp")):
            with pytest.raises(protocol.ProtocolError, match="refused"):
                control.toggle(name, value)
    finally:
        control.close()
    # on the ipc rpc socket the asker is the owner (its uid, from the kernel): a request that
    # claims to be someone else is audited as who sent it
    client = HubClient(job_file.hub_address())
    try:
        with pytest.raises(protocol.ProtocolError, match="not among the flags"):
            client.request("toggle", name="NCCL_FOO", value="1", restart=False,
                           user="mallory", host="elsewhere")
    finally:
        client.close()
    forged = [json.loads(line) for line in
              (home / "run" / home.name / "toggles.log").read_text().splitlines()
              if "NCCL_FOO" in line][-1]
    assert forged["state"] == "refused" and forged["role"] == "control"
    assert forged["user"] == pwd.getpwuid(os.getuid()).pw_name, forged
    assert forged["via"].startswith(f"uid {os.getuid()} (") and "over ipc" in forged["via"]
    assert "mallory" not in json.dumps(forged) and "elsewhere" not in json.dumps(forged)
    # a restart-tier flag on a job without checkpoints: refused, with the reason
    done = scalemon(home, "toggle", home.name, "TORCH_CPP_LOG_LEVEL=INFO")
    assert done.returncode == REFUSED and "--ckpt-dir" in done.stderr, done.stderr
    state = snapshot(home)
    assert [r["flags"] for r in state["ranks"]] == [r["flags"] for r in before["ranks"]]
    assert {t["state"] for t in state["toggles"]} == {"refused"}
    assert not (home / "run" / home.name / "flags.json").exists()


def hub_log(home: Path) -> str:
    path = home / "run" / home.name / "hub.log"
    return "\nhub.log:\n" + (path.read_text()[-2000:] if path.exists() else "(none)")


def hub_losses(home: Path) -> dict[int, list[tuple[int, float]]]:
    """Every `step` message of the job's history as (step, loss) per rank, in history order."""
    client = HubClient(JobFile.read(jobs_dir(home) / f"{home.name}.json").hub_address())
    try:
        records, _ = client.fetch(0, 100_000)
    finally:
        client.close()
    out: dict[int, list[tuple[int, float]]] = {}
    for record in records:
        msg = protocol.decode(record)
        if msg.type == "step":
            out.setdefault(msg.rank, []).append((msg.body["step"], msg.body["loss"]))
    return out


@pytest.mark.integration
def test_a_restart_tier_flag_restarts_from_a_checkpoint_without_losing_a_step(home, tmp_path):
    steps = 100  # a toggle is planned ~4 s (40 steps) ahead: room for a slow start under load
    reference = tmp_path / "reference.json"
    ran = subprocess.run(torchrun_cmd("--preset", "tiny", "--batch-size", "2", "--max-steps",
                                      str(steps), "--stats-json", str(reference)),
                         env={**job_env(home), "SCALEMON_JOB_ID": "reference"},
                         capture_output=True, text=True, timeout=240)
    assert ran.returncode == 0, ran.stderr[-3000:]
    expected = json.loads(reference.read_text())
    assert expected["steps"] == list(range(1, steps + 1))

    out = tmp_path / "job.out"
    proc = start_job(home, out, "--max-steps", str(steps), "--step-delay", "0.1",
                     "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "1000",
                     extra=("--max-restarts", "1"))
    try:
        running_at(home, 3)
        done = scalemon(home, "toggle", home.name, "TORCH_CPP_LOG_LEVEL=INFO")
        assert done.returncode == 0, (done.stdout + done.stderr + hub_log(home)
                                      + out.read_text()[-2000:])
        assert "restarted at step" in done.stdout
        assert proc.wait(timeout=240) == 0, out.read_text()[-3000:]
    finally:
        kill_tree(proc)
    state = snapshot(home)
    toggle = state["toggles"][-1]
    assert (toggle["tier"], toggle["state"]) == ("restart", "restarted")
    assert [r["flags"]["TORCH_CPP_LOG_LEVEL"] for r in state["ranks"]] == ["INFO"] * 2
    assert [r["restart_count"] for r in state["ranks"]] == [1, 1]
    text = out.read_text()
    assert f"restarted by torchrun for a flag toggle after step {toggle['step']}" in text
    after = text.split("restarted by torchrun for a flag toggle")[1]
    assert "[I" in after and "reducer.cpp" in after  # torch's C++ INFO logging is on now
    for rank, seen in hub_losses(home).items():
        assert [s for s, _ in seen] == list(range(1, steps + 1)), f"rank {rank}: {seen}"
    losses = [loss for _, loss in hub_losses(home)[0]]
    assert losses == pytest.approx(expected["losses"], rel=1e-6, abs=1e-7)


SYSTEM_PYTHON = "/usr/bin/python3"


def test_another_user_cannot_reach_the_control_socket(tmp_path):
    """A second user (uid 65534) cannot connect to the hub's control socket: the run directory
    is 0700. The probe is the system Python (the venv may sit under a directory that user
    cannot read) doing what ZeroMQ's ipc transport does, a unix-socket connect."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as a second user (uid 65534); not root here")
    if not os.path.exists(SYSTEM_PYTHON):
        pytest.skip(f"no {SYSTEM_PYTHON} to run as the second user")
    home = Path(tempfile.mkdtemp(prefix="smu", dir="/tmp"))
    hub = None
    try:
        os.chmod(home, 0o755)  # the home is visible to others; the run directory is not (0700)
        hub = HubProcess(home, "other")
        job_file = JobFile.read(jobs_dir(home) / "other.json")
        socket_path = f"{job_file.run_dir}/control.sock"
        probe = ("import socket, sys\n"
                 "s = socket.socket(socket.AF_UNIX)\n"
                 "try:\n"
                 f"    s.connect({socket_path!r})\n"
                 "except PermissionError as exc:\n"
                 "    print('DENIED', exc)\n"
                 "    sys.exit(0)\n"
                 "print('CONNECTED')\n")

        def run_probe(as_nobody: bool) -> str:
            return subprocess.run([SYSTEM_PYTHON, "-c", probe], capture_output=True, text=True,
                                  timeout=60, cwd="/",
                                  preexec_fn=_become_nobody if as_nobody else None).stdout

        assert run_probe(as_nobody=False).strip() == "CONNECTED"  # the owner can
        other = run_probe(as_nobody=True)
        if not other:
            pytest.skip(f"uid 65534 cannot run {SYSTEM_PYTHON} here")
        assert other.startswith("DENIED"), other
        # scalemon's own client says why instead of timing out, for a directory not yours
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        (foreign / "control.sock").touch()
        os.chown(foreign, 65534, 65534)
        with pytest.raises(ControlError, match="belongs to uid 65534, not to you"):
            check_reachable(f"ipc://{foreign}/control.sock")
        client = HubClient(job_file.hub_address())
        try:
            assert client.state()["state"]["toggles"] == []  # nothing reached the hub
        finally:
            client.close()
    finally:
        if hub is not None:
            hub.kill()
        shutil.rmtree(home, ignore_errors=True)


def _become_nobody() -> None:
    os.setgid(65534)
    os.setuid(65534)


def test_flags_panel_lists_every_flag_with_its_tier(home, start_hub, zctx):
    """`scalemon flags` on a hub fed by two fake ranks that disagree on NCCL_ALGO. The fake
    ranks heartbeat as agents do, on a thread, until the end: the refusal below is for a
    running job, and a rank that says nothing for `--lost-after` is no longer running (it
    failed under load with "no rank of the job is running" while they sent nothing)."""
    from conftest import FakeRank

    hub = start_hub(home.name, "--lost-after", "600")
    ranks = [FakeRank(zctx, hub.address, home.name, r) for r in range(2)]
    for rank, algo in zip(ranks, ("Ring", "Tree"), strict=True):
        rank.hello()
        rank.send("flags", {"values": {"NCCL_ALGO": algo, "NCCL_DEBUG": None},
                            "notes": {}, "restart": {"ok": False, "reason": "no checkpoint"},
                            "rebuild": False})
    done = threading.Event()

    def beat() -> None:  # the sockets are this thread's alone from here on
        while not done.wait(0.5):
            for rank in ranks:
                rank.heartbeat()

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        shown = wait_for(lambda: (r := scalemon(home, "flags", home.name)).returncode == 0
                         and "MISMATCH" in r.stdout and r.stdout, timeout=20)
        assert "NCCL_ALGO" in shown and "0:Ring 1:Tree  MISMATCH" in shown
        assert "NCCL_P2P_DISABLE" in shown and "restart" in shown
        assert "why: read when a communicator is created" in shown
        text = scalemon(home, "snapshot", home.name).stdout
        assert "flag MISMATCH NCCL_ALGO: 0:Ring 1:Tree" in text
        state = snapshot(home)
        assert state is not None and [r["state"] for r in state["ranks"]] == [
            "running", "running"], state and [(r["state"], r["state_reason"])
                                              for r in state["ranks"]]
        refused = scalemon(home, "toggle", home.name, "NCCL_P2P_DISABLE=1")
        assert refused.returncode == REFUSED and "no checkpoint" in refused.stderr, \
            refused.stderr
    finally:
        done.set()
        beating.join(timeout=10)
