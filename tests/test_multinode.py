"""Two torchrun node agents on one machine stand for two nodes (c10d rendezvous on loopback,
each with its own node name, SCALEMON_HOME and node-local runtime directory; they share only
`jobs/` and `keys/`, as a cluster's home would). Rank 0's hub listens on CurveZMQ tcp, the other
node's ranks reach it through their relay, and a third environment standing for the login node
reads the job through the shared job file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
from cluster import NODES, make_cluster
from cluster import node_env as cluster_env
from cluster import relay_pid as node_relay_pid

from conftest import REPO, free_port, kill_tree, wait_for
from scalemon.home.jobfile import JobFile

pytestmark = pytest.mark.integration

RDZV_ID = "twonode"
JOB = "tr-" + RDZV_ID  # what the agent derives from torchrun's run id


@pytest.fixture
def cluster() -> dict[str, Path]:
    """Homes of node0, node1 and the login node, sharing jobs/ and keys/ only."""
    root = Path(tempfile.mkdtemp(prefix="smc", dir="/tmp"))
    places = make_cluster(root)
    yield places
    for job_file in (root / "shared" / "jobs").glob("*.json"):
        with contextlib.suppress(ValueError, psutil.Error):
            psutil.Process(JobFile.read(job_file).pid).kill()
    for proc in psutil.process_iter():  # relays left lingering
        try:
            if str(root) in " ".join(proc.cmdline()):
                proc.kill()
        except psutil.Error:
            continue


def node_env(home: Path, node: str) -> dict[str, str]:
    env = cluster_env(home, node, linger_s=60)
    if "SCALEMON_UPDATE_SNAPSHOTS" in os.environ:
        env["SCALEMON_UPDATE_SNAPSHOTS"] = os.environ["SCALEMON_UPDATE_SNAPSHOTS"]
    return env


def start_nodes(cluster: dict[str, Path], *train_args: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for node_rank, node in enumerate(NODES):
        out = open(cluster[node].parent / "torchrun.out", "w")  # noqa: SIM115
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--node-rank", str(node_rank), "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", RDZV_ID, "--", str(REPO / "demo_train" / "train.py"),
               "--device", "cpu", "--monitor", *train_args]
        procs.append(subprocess.Popen(cmd, env=node_env(cluster[node], node), stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def login_snapshot(cluster: dict[str, Path]) -> dict | None:
    """`scalemon snapshot --json` on the login node (None until the job's hub is listed)."""
    out = subprocess.run([sys.executable, "-m", "scalemon", "snapshot", "--json", JOB],
                         env=node_env(cluster["login"], "login"), capture_output=True,
                         text=True, timeout=60)
    if out.returncode != 0:
        assert "no live hub" in out.stderr, out.stderr
        return None
    return json.loads(out.stdout)


def outputs(cluster: dict[str, Path]) -> str:
    return "\n".join(f"--- {n}:\n" + (cluster[n].parent / "torchrun.out").read_text()
                     for n in NODES)


def relay_pid(cluster: dict[str, Path], node: str) -> int | None:
    return node_relay_pid(cluster[node])


def test_two_nodes_one_hub_on_tcp_the_other_through_its_relay_seen_from_the_login_node(
        cluster: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    procs = start_nodes(cluster, "--max-steps", "150", "--step-delay", "0.2")
    try:
        state = wait_for(lambda: (s := login_snapshot(cluster)) and len(s["ranks"]) == 4
                         and all(r["step"] for r in s["ranks"]) and s, timeout=120,
                         interval=1.0)
        hosts = {r["rank"]: r["host"] for r in state["ranks"]}
        assert sorted(set(hosts.values())) == list(NODES)
        job_file = JobFile.read(cluster["login"] / "jobs" / f"{JOB}.json")
        hub_node = job_file.host
        relay_node = next(n for n in NODES if n != hub_node)
        assert hosts[0] == hub_node  # the hub runs on rank 0's node
        assert job_file.tcp and job_file.server_key and "127.0.0.1" in job_file.tcp["rpc"]
        assert relay_pid(cluster, relay_node) and not relay_pid(cluster, hub_node)
        assert not (cluster["login"] / "run" / JOB).exists()  # read over tcp, not a file
        listed = subprocess.run([sys.executable, "-m", "scalemon", "jobs"], capture_output=True,
                                text=True, env=node_env(cluster["login"], "login"), timeout=60)
        assert f"on {hub_node}" in listed.stdout and "(CurveZMQ)" in listed.stdout
        assert job_file.tcp["ingest"] in listed.stdout and "unreachable" not in listed.stdout
        check_login_dashboard(cluster, monkeypatch)

        assert [p.wait(timeout=180) for p in procs] == [0, 0], outputs(cluster)
        final = wait_for(lambda: (s := login_snapshot(cluster)) and s["state"] == "finished"
                         and s, timeout=30)
        assert all(r["step"] == 150 and r["state"] == "finished" for r in final["ranks"])
        assert all(r["seq_gaps"] == 0 and r["dropped"] == 0 for r in final["ranks"])
        relay = final["relays"][relay_node]
        assert relay["dropped"] == 0 and relay["forwarded"] > 0 and relay["gaps"] == 0
        assert relay["clock_offset_s"] is not None and abs(relay["clock_offset_s"]) < 0.05
    finally:
        for proc in procs:
            kill_tree(proc)


def check_login_dashboard(cluster: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """`scalemon attach` on the login node (the real app, driven by Pilot) shows every rank
    with its node, live: the steps it shows move on."""
    from test_tui_app import until
    from test_tui_snapshots import screen_text

    from scalemon.tui.attach import make_app

    for key, value in node_env(cluster["login"], "login").items():
        if key.startswith("SCALEMON_"):
            monkeypatch.setenv(key, value)
    app = make_app(None, home=cluster["login"])
    assert not isinstance(app, str), app

    def steps_shown(text: str) -> list[int]:
        return [int(m) for m in re.findall(r"^\s*[0-3]\s+running\s+(\d+)\s", text, re.M)]

    async def scenario() -> None:
        async with app.run_test(size=(230, 50)) as pilot:
            first: list[int] = []

            def all_ranks_on_both_nodes() -> bool:
                text = screen_text(app)
                first[:] = steps_shown(text)
                return "node0" in text and "node1" in text and len(first) == 4

            await until(pilot, all_ranks_on_both_nodes, timeout=30)
            await until(pilot, lambda: sum(steps_shown(screen_text(app))) > sum(first),
                        timeout=30)

    asyncio.run(scenario())


def test_killing_the_relay_leaves_training_alone_a_new_one_picks_up_and_the_gap_is_counted(
        cluster: dict[str, Path]) -> None:
    # 0.5 s a step: the ranks must outlive the relay's replacement (3-4 s of silence, then
    # a start), which took over 30 s on a loaded 2-core machine (the test failed there)
    procs = start_nodes(cluster, "--max-steps", "100", "--step-delay", "0.5")
    try:
        state = wait_for(lambda: (s := login_snapshot(cluster)) and len(s["ranks"]) == 4
                         and all((r["step"] or 0) >= 5 for r in s["ranks"])
                         and s["relays"] and s, timeout=120, interval=1.0)
        relay_node = next(iter(state["relays"]))
        old = relay_pid(cluster, relay_node)
        assert old == state["relays"][relay_node]["pid"]
        psutil.Process(old).kill()
        new = wait_for(lambda: (p := relay_pid(cluster, relay_node)) and p != old and p,
                       timeout=60)
        replaced = wait_for(lambda: (s := login_snapshot(cluster))
                            and s["relays"][relay_node]["pid"] == new and s, timeout=60)
        relay = replaced["relays"][relay_node]
        assert relay["gaps"] == 1 and relay["gap_s"] > 0 and "replaced" in relay["text"]
        gap_s = relay["gap_s"]
        text = subprocess.run([sys.executable, "-m", "scalemon", "snapshot", JOB],
                              capture_output=True, text=True, timeout=60,
                              env=node_env(cluster["login"], "login")).stdout
        assert "relays: 1 nodes, 1 in trouble" in text
        assert re.search(rf"relay {relay_node} \(pid {new}\): up, 0 dropped, replaced 1x, "
                         r"\d+\.\d s without a relay", text)
        assert [p.wait(timeout=180) for p in procs] == [0, 0], outputs(cluster)
        final = wait_for(lambda: (s := login_snapshot(cluster)) and s["state"] == "finished"
                         and s, timeout=30)
        on_relay = [r for r in final["ranks"] if r["host"] == relay_node]
        assert len(on_relay) == 2 and all(r["step"] == 100 for r in on_relay)
        print(f"relay replaced after a gap of {gap_s:.1f} s")
        for node in NODES:  # every step of every rank ran: training was never held up
            text = (cluster[node].parent / "torchrun.out").read_text()
            assert "Traceback" not in text
    finally:
        for proc in procs:
            kill_tree(proc)


def test_the_login_node_says_which_hub_is_unreachable_and_what_to_check(
        cluster: dict[str, Path]) -> None:
    from scalemon.home.keys import hub_keypair

    env = node_env(cluster["login"], "login")
    port = free_port()  # nothing listens there: the hub's node went away
    JobFile(job="gone", address="ipc:///elsewhere/run/gone", host="node7", pid=1,
            started=0.0, world_size=8, run_dir="/elsewhere/run/gone", protocol=[1, 3],
            tcp={k: f"tcp://127.0.0.1:{port + i}" for i, k in enumerate(("ingest", "feed",
                                                                          "rpc"))},
            server_key=hub_keypair(cluster["login"]).public.decode()).write(cluster["login"])
    listed = subprocess.run([sys.executable, "-m", "scalemon", "jobs"], capture_output=True,
                            text=True, env=env, timeout=60)
    assert "gone  running  world size 8  hub pid 1 on node7" in listed.stdout
    assert re.search(r"unreachable from here: no answer from the hub at tcp://127.0.0.1:\d+ "
                     r".*check that the hub still runs on 127.0.0.1 .*authorized", listed.stdout)
    snap = subprocess.run([sys.executable, "-m", "scalemon", "snapshot", "gone"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert snap.returncode != 0 and f"port {port + 2}" in snap.stderr
    assert "firewall" in snap.stderr and "Traceback" not in snap.stderr
