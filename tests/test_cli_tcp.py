"""The CLI over tcp as a new user meets it: a hub address without the hub's key, ports that
cannot be, and the connect line a login node without a shared home pastes (real hubs and
`scalemon` processes on loopback)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import zmq

from conftest import SCALEMON, FakeRank, free_port, wait_for
from scalemon.home.jobfile import JobFile
from scalemon.home.keys import user_keypair
from scalemon.home.paths import jobs_dir


def scalemon(*args: str, home: Path, env: dict[str, str] | None = None,
             timeout: float = 60) -> subprocess.CompletedProcess:
    """`scalemon ARGS` with SCALEMON_HOME at `home` and no SCALEMON_HUB_KEY unless `env`
    gives one; stdin is not a terminal."""
    base = {k: v for k, v in os.environ.items() if k != "SCALEMON_HUB_KEY"}
    return subprocess.run([SCALEMON, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL,
                          env={**base, "SCALEMON_HOME": str(home), **(env or {})})


def _says_how_to_get_the_key(err: str, command: str, address: str) -> None:
    assert err.startswith(f"scalemon {command}: the hub's public key is missing for {address}")
    assert "`scalemon keys show --hub`" in err and "SCALEMON_HUB_KEY=KEY" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_snapshot_of_a_tcp_hub_without_its_key_says_how_to_get_it(home: Path):
    address = f"tcp://127.0.0.1:{free_port()}"
    out = scalemon("snapshot", address, home=home)
    assert out.returncode == 2 and out.stdout == ""
    _says_how_to_get_the_key(out.stderr, "snapshot", address)


def test_attach_to_a_tcp_hub_without_its_key_exits_before_drawing(home: Path):
    address = f"tcp://127.0.0.1:{free_port()}"
    out = scalemon("attach", "--wait", "0", address, home=home)
    assert out.returncode == 2
    assert out.stdout == ""  # no dashboard was started: nothing drawn
    _says_how_to_get_the_key(out.stderr, "attach", address)


def test_a_key_that_is_no_key_is_named(home: Path):
    out = scalemon("snapshot", f"tcp://127.0.0.1:{free_port()}", home=home,
                   env={"SCALEMON_HUB_KEY": "not-a-key"})
    assert out.returncode == 2
    assert out.stderr.startswith("scalemon snapshot: SCALEMON_HUB_KEY 'not-a-key' is not a "
                                 "Curve public key")


def test_the_free_ports_of_a_hub_elsewhere_are_said_as_they_are(home: Path):
    # a hub on another node that bound free ports: ingest above feed above rpc
    rpc, feed, ingest = sorted({free_port() for _ in range(3)} | {1024, 1025, 1026})[-3:]
    tcp = {"ingest": f"tcp://127.0.0.1:{ingest}", "feed": f"tcp://127.0.0.1:{feed}",
           "rpc": f"tcp://127.0.0.1:{rpc}"}
    JobFile(job="far", address="ipc:///elsewhere/run/far", host="another-node", pid=1,
            started=time.time(), world_size=2, run_dir="/elsewhere/run/far", protocol=[1, 7],
            tcp=tcp, server_key=zmq.curve_keypair()[0].decode()).write(home)
    out = scalemon("snapshot", "far", "--timeout", "0.5", home=home)
    assert out.returncode == 2
    where = f"tcp://127.0.0.1:{ingest},{feed},{rpc}"
    assert f"no answer from the hub at {where} (requests go to its port {rpc})" in out.stderr
    assert f"{ingest}-{rpc}" not in out.stderr  # once printed as a range, backwards
    listed = scalemon("jobs", home=home)
    assert where in listed.stdout  # the address to paste, every port of it


def test_ports_past_65535_are_refused_with_the_range(home: Path):
    out = scalemon("snapshot", "tcp://127.0.0.1:65534", home=home,
                   env={"SCALEMON_HUB_KEY": zmq.curve_keypair()[0].decode()})
    assert out.returncode == 2
    assert out.stderr == ("scalemon snapshot: 'tcp://127.0.0.1:65534': a tcp hub uses ports "
                          "PORT to PORT+2, so PORT must be from 0 to 65533, not 65534\n")
    hub = scalemon("hub", "--job", "j", "--listen", "tcp://127.0.0.1:65534", home=home)
    assert hub.returncode == 2 and "Traceback" not in hub.stderr
    assert "PORT must be from 0 to 65533, not 65534" in hub.stderr


def test_jobs_connect_prints_a_line_that_works_from_another_home(
        home: Path, start_hub, zctx: zmq.Context):
    hub = start_hub("far1", "--listen", "tcp://127.0.0.1:0")
    rank = FakeRank(zctx, hub.address, "far1", 0)
    rank.hello(world_size=1)
    rank.step(7, loss=2.5)
    out = scalemon("jobs", "--connect", "far1", home=home)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 1
    words = shlex.split(out.stdout)
    assert words[0].startswith("SCALEMON_HUB_KEY=") and words[1:3] == ["scalemon", "attach"]
    jf = JobFile.read(jobs_dir(home) / "far1.json")
    assert words[0] == f"SCALEMON_HUB_KEY={jf.server_key}"
    assert "scalemon keys add KEY --role watch" in out.stderr  # who pastes it: admitted first

    elsewhere = Path(tempfile.mkdtemp(prefix="smo", dir="/tmp"))  # a login node's own home
    try:
        _snapshot_from(elsewhere, out.stdout.strip(), home)
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)


def _snapshot_from(elsewhere: Path, line: str, home: Path) -> None:
    """The connect line pasted into a shell on a machine whose SCALEMON_HOME is `elsewhere`
    (`snapshot --json` for `attach`), once that machine's key is admitted."""
    own = user_keypair(elsewhere).public.decode()
    added = subprocess.run([SCALEMON, "keys", "add", own, "--role", "watch", "--name", "login"],
                           env={**os.environ, "SCALEMON_HOME": str(home)}, capture_output=True,
                           text=True, timeout=60)  # what the owner admits
    assert added.returncode == 0, added.stderr
    pasted = line.replace(" scalemon attach ", f" {SCALEMON} snapshot --json --timeout 2 ")
    env = {k: v for k, v in os.environ.items() if k != "SCALEMON_HUB_KEY"}

    def snapshot() -> dict | None:  # the hub reads its authorized file again within 1 s
        got = subprocess.run(["sh", "-c", pasted], capture_output=True, text=True, timeout=60,
                             env={**env, "SCALEMON_HOME": str(elsewhere)})
        if got.returncode != 0:
            assert "no answer from the hub" in got.stderr, got.stderr
            return None
        state = json.loads(got.stdout)
        return state if state["ranks"] and state["ranks"][0]["step"] == 7 else None

    state = wait_for(snapshot, timeout=30, interval=0.2)
    assert state["job"] == "far1" and state["ranks"][0]["loss"] == 2.5
    assert not (elsewhere / "jobs").exists()  # nothing but the line told it where to go


def test_jobs_connect_of_an_ipc_only_hub_says_how_to_listen_on_tcp(home: Path, start_hub):
    start_hub("near1")
    out = scalemon("jobs", "--connect", "near1", home=home)
    assert out.returncode == 2 and out.stdout == ""
    assert "listens only on ipc" in out.stderr
    assert "SCALEMON_LISTEN=tcp://*:0" in out.stderr and "--listen tcp://*:0" in out.stderr
    missing = scalemon("jobs", "--connect", "nosuch", home=home)
    assert missing.returncode == 2
    assert missing.stderr == "scalemon jobs: no hub serves job 'nosuch' here (serving: near1)\n"
