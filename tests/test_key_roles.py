"""Keys have roles, the hub knows who asks from the connection, and removing a key cuts it:
`scalemon keys` and real hub processes on loopback tcp, with keys of other homes as other users
would hold them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from conftest import FakeRank, free_port, send_unless_refused, wait_for
from scalemon import protocol
from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.home.keys import KeyFileError, hub_keypair, parse_authorized, user_keypair
from scalemon.home.paths import jobs_dir
from scalemon.link.client import HubClient

QUIET_S = 1.5  # how long a refused peer is watched for an answer that must not come


def cli(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The real `scalemon` command with SCALEMON_HOME=`home` (and `env`)."""
    full = {**os.environ, "SCALEMON_HOME": str(home), **env}
    full.pop("SCALEMON_HUB", None)
    return subprocess.run([sys.executable, "-m", "scalemon.cli", *args], env=full,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def other_homes() -> Iterator[callable]:
    """Homes of other people (each with its own keypair), removed at the end."""
    made: list[Path] = []

    def make() -> Path:
        path = Path(tempfile.mkdtemp(prefix="smo", dir="/tmp"))
        made.append(path)
        user_keypair(path)
        return path

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def test_authorized_lines_carry_roles_names_and_the_owner_is_control() -> None:
    own, bob, old = (zmq.curve_keypair()[0].decode() for _ in range(3))
    text = (f"{own} role=watch\n{bob} role=rank name=node7  # a node\n"
            f"{old}  # laptop, from before keys had roles\n")
    keys = parse_authorized(text, own=own.encode())
    assert keys[own.encode()].role == "control" and keys[own.encode()].own  # whatever it says
    assert (keys[bob.encode()].role, keys[bob.encode()].name) == ("rank", "node7")
    legacy = keys[old.encode()]
    assert legacy.role == "watch" and legacy.legacy and legacy.name.startswith("key-")
    with pytest.raises(KeyFileError, match=r"line 2: role 'admin' is not one of rank, watch"):
        parse_authorized(f"{own}\n{bob} role=admin name=x\n")
    with pytest.raises(KeyFileError, match=r"line 1: name 'a\$b' is not a key name"):
        parse_authorized(f"{bob} role=rank name=a$b\n")


def test_a_commented_out_key_is_not_admitted() -> None:
    key = zmq.curve_keypair()[0].decode()
    assert parse_authorized(f"#{key} role=rank name=n\n# {key}\n") == {}
    assert list(parse_authorized(f"{key} role=rank name=n # #x\n")) == [key.encode()]


def test_keys_show_add_list_remove(home: Path, other_homes) -> None:
    shown = cli(home, "keys", "show")
    assert shown.returncode == 0 and shown.stdout.strip() == user_keypair(home).public.decode()
    assert cli(home, "keys", "show", "--hub").stdout.strip() == hub_keypair(home).public.decode()
    bob = cli(other_homes(), "keys", "show").stdout.strip()
    done = cli(home, "keys", "add", bob, "--role", "watch", "--name", "bob")
    assert done.returncode == 0 and "admitted bob (role watch" in done.stdout, done.stderr
    again = cli(home, "keys", "add", bob, "--role", "control", "--name", "bob2")
    assert again.returncode == 2 and "already admitted as 'bob'" in again.stderr
    bad = cli(home, "keys", "add", "not-a-key", "--role", "watch", "--name", "x")
    assert bad.returncode == 2 and "is not a Curve public key" in bad.stderr
    assert "Traceback" not in bad.stderr + again.stderr
    listed = json.loads(cli(home, "keys", "list", "--json").stdout)
    assert [(k["name"], k["role"], k["own"]) for k in listed] == [
        (os.environ.get("USER") or listed[0]["name"], "control", True), ("bob", "watch", False)]
    own = cli(home, "keys", "remove", listed[0]["name"])
    assert own.returncode == 2 and "is your own key" in own.stderr
    unknown = cli(home, "keys", "remove", "carol")
    assert unknown.returncode == 2 and "no admitted key is named 'carol'" in unknown.stderr
    assert cli(home, "keys", "remove", "bob").returncode == 0
    assert [k["name"] for k in json.loads(cli(home, "keys", "list", "--json").stdout)] == [
        listed[0]["name"]]


def _tcp_hub(start_hub, job: str) -> tuple[str, JobFile]:
    """A hub listening on loopback tcp at consecutive ports (a tcp:// base the CLI takes)."""
    port = free_port(3)
    hub = start_hub(job, "--listen", f"tcp://127.0.0.1:{port}")
    jf = JobFile.read(jobs_dir(hub.home) / f"{job}.json")
    assert jf.tcp == {"ingest": f"tcp://127.0.0.1:{port}", "feed": f"tcp://127.0.0.1:{port + 1}",
                      "rpc": f"tcp://127.0.0.1:{port + 2}"}
    return f"tcp://127.0.0.1:{port}", jf


def _audit(jf: JobFile) -> list[dict]:
    path = Path(jf.run_dir) / "toggles.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_watch_key_reads_the_job_and_its_steering_is_refused_naming_the_role(
        start_hub, home: Path, zctx: zmq.Context, other_homes) -> None:
    base, jf = _tcp_hub(start_hub, "jobW")
    rank = FakeRank(zctx, HubAddress.parse(jf.address), "jobW", 0)
    rank.hello(world_size=1)
    rank.step(1, loss=2.5)
    watcher = other_homes()
    key = user_keypair(watcher).public.decode()
    assert cli(home, "keys", "add", key, "--role", "watch", "--name", "bob").returncode == 0
    as_bob = {"SCALEMON_HUB_KEY": jf.server_key}
    snap = wait_for(lambda: (d := cli(watcher, "snapshot", base, "--json", **as_bob))
                    .returncode == 0 and json.loads(d.stdout)["ranks"] and d)
    assert json.loads(snap.stdout)["ranks"][0]["loss"] == 2.5  # it reads the job

    toggle = cli(watcher, "toggle", base, "NCCL_DEBUG=INFO", **as_bob)
    assert toggle.returncode == 3, toggle.stderr
    assert "toggle needs role control; key bob from 127.0.0.1 has role watch" in toggle.stderr
    dump = cli(watcher, "dump", base, **as_bob)
    assert dump.returncode == 2 and "command needs role control" in dump.stderr, dump.stderr
    assert "Traceback" not in toggle.stderr + dump.stderr
    # the audit and the history say who asked, as the hub knows it (not what a client says)
    refused = [a for a in _audit(jf) if a.get("state") == "refused" or a.get("event") ==
               "refused"]
    assert [(a["user"], a["role"], a["via"]) for a in refused] == [
        ("bob", "watch", "key bob from 127.0.0.1")] * 2, refused
    client = HubClient(HubAddress.parse(jf.address))
    toggles = wait_for(lambda: client.state()["state"]["toggles"])  # the hub's next round
    assert [(t["name"], t["state"], t["user"], t["client_host"]) for t in toggles] == [
        ("NCCL_DEBUG", "refused", "bob", "127.0.0.1")]
    client.close()


def test_each_role_gets_only_its_sockets_and_requests(start_hub, home: Path,
                                                      zctx: zmq.Context, other_homes,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    base, jf = _tcp_hub(start_hub, "jobR")
    tcp = HubAddress(jf.tcp["ingest"], jf.tcp["feed"], jf.tcp["rpc"], server_key=jf.server_key)
    homes = {role: other_homes() for role in ("rank", "watch", "control")}
    for role, where in homes.items():
        assert cli(home, "keys", "add", user_keypair(where).public.decode(), "--role", role,
                   "--name", f"the-{role}").returncode == 0
    owner = HubClient(HubAddress.parse(jf.address))

    def push(role: str, loss: float) -> None:
        keys = user_keypair(homes[role])
        sock = zctx.socket(zmq.PUSH)
        sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret
        sock.curve_serverkey = jf.server_key.encode()
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(tcp.ingest)
        sock.send(protocol.encode("step", "jobR", 0, int(loss), {
            "step": int(loss), "loss": loss, "tokens": 1, "step_time_s": 0.01}))
        time.sleep(0.5)
        sock.close()

    def losses() -> list[float]:
        records, _ = owner.fetch(0)
        return [m.body["loss"] for m in map(protocol.decode, records) if m.type == "step"]

    push("watch", 2.0)  # a watch key may not send
    push("rank", 1.0)
    wait_for(lambda: losses() == [1.0])
    for role, allowed in (("rank", False), ("watch", True), ("control", True)):
        monkeypatch.setenv("SCALEMON_HOME", str(homes[role]))
        client = HubClient(tcp, timeout_s=3.0)
        if allowed:
            assert client.state()["state"]["job"] == "jobR"
        else:
            with pytest.raises(protocol.ProtocolError,
                               match="state needs role watch or control; key the-rank from "
                                     "127.0.0.1 has role rank"):
                client.state()
        client.close()
    # a control key steers from elsewhere: past the role check, the flag table decides
    monkeypatch.setenv("SCALEMON_HOME", str(homes["control"]))
    client = HubClient(tcp, timeout_s=3.0)
    with pytest.raises(protocol.ProtocolError, match="not among the flags"):
        client.request("toggle", name="NCCL_FOO", value="1", restart=False, user="root",
                       host="hub")
    client.close()
    monkeypatch.setenv("SCALEMON_HOME", str(home))
    assert losses() == [1.0]
    hub = owner.state()["hub"]
    assert hub["auth_refused"] >= 1 and hub["keys_admitted"] == 4
    audit = wait_for(lambda: (a := _audit(jf)) and any(  # written on the hub's next round
        e.get("kind") == "handshake on ingest" and e["name"] == "the-watch"
        and e["client_host"] == "127.0.0.1" for e in a) and a)
    forged = next(a for a in audit if a.get("name") == "NCCL_FOO")
    assert (forged["user"], forged["role"]) == ("the-control", "control")  # not "root"
    owner.close()


def _watched(sock: zmq.Socket) -> zmq.Socket:
    return sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)


def _events(monitor: zmq.Socket) -> list[int]:
    got = []
    while monitor.poll(0):
        got.append(parse_monitor_message(monitor.recv_multipart())["event"])
    return got


def test_removing_a_key_cuts_its_live_connections(start_hub, home: Path, zctx: zmq.Context,
                                                  other_homes) -> None:
    base, jf = _tcp_hub(start_hub, "jobX")
    rank = FakeRank(zctx, HubAddress.parse(jf.address), "jobX", 0)
    rank.hello(world_size=1)
    bob = user_keypair(other_homes())
    assert cli(home, "keys", "add", bob.public.decode(), "--role", "watch",
               "--name", "bob").returncode == 0

    def curve(kind: int, endpoint: str) -> zmq.Socket:
        sock = zctx.socket(kind)
        sock.curve_publickey, sock.curve_secretkey = bob.public, bob.secret
        sock.curve_serverkey = jf.server_key.encode()
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 200)
        return sock

    sub = curve(zmq.SUB, jf.tcp["feed"])
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    dealer = curve(zmq.DEALER, jf.tcp["rpc"])
    monitors = [_watched(sub), _watched(dealer)]
    sub.connect(jf.tcp["feed"])
    dealer.connect(jf.tcp["rpc"])
    dealer.send(protocol.encode_request("command", name="dump_fr"))  # refused: still cut
    assert dealer.poll(5000)
    with pytest.raises(protocol.ProtocolError, match="command needs role control"):
        protocol.decode_reply(dealer.recv())
    time.sleep(0.5)  # the subscription reached the hub
    step = 1
    wait_for(lambda: (rank.step(step), sub.poll(200))[1])  # bob follows the job
    while sub.poll(100):
        sub.recv_multipart()
    seen = [set(_events(m)) for m in monitors]
    assert all(zmq.EVENT_HANDSHAKE_SUCCEEDED in s for s in seen), seen

    started = time.monotonic()
    assert cli(home, "keys", "remove", "bob").returncode == 0
    cut = [False, False]

    def both_cut() -> bool:
        for i, monitor in enumerate(monitors):
            cut[i] = cut[i] or zmq.EVENT_DISCONNECTED in _events(monitor)
        return all(cut)

    wait_for(both_cut, timeout=5.0)  # within 5 s of `keys remove`, both connections end
    took = time.monotonic() - started
    for n in range(2, 6):  # and nothing reaches bob any more: reconnecting is refused
        rank.step(n)
    send_unless_refused(dealer, protocol.encode_request("state"))  # reconnects are refused
    assert not dealer.poll(int(QUIET_S * 1000)) and not sub.poll(0)
    client = HubClient(HubAddress.parse(jf.address))  # the owner is unaffected
    hub = client.state()["hub"]
    assert hub["access_cut"] >= 2 and hub["auth_refused"] >= 1
    client.close()
    cut_entry = next(a for a in _audit(jf) if a.get("event") == "access cut")
    assert (cut_entry["user"], cut_entry["role"]) == ("bob", "watch")
    assert cut_entry["connections"] >= 2
    assert took < 5.0


def test_refused_handshakes_are_audited_with_the_peer_and_bounded(start_hub, home: Path,
                                                                 zctx: zmq.Context) -> None:
    base, jf = _tcp_hub(start_hub, "jobH")
    stranger = zmq.curve_keypair()
    for _ in range(30):
        sock = zctx.socket(zmq.DEALER)
        sock.curve_publickey, sock.curve_secretkey = stranger
        sock.curve_serverkey = jf.server_key.encode()
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(jf.tcp["rpc"])
        send_unless_refused(sock, protocol.encode_request("state"))  # refused: may not queue
        assert not sock.poll(100)
        sock.close()
    client = HubClient(HubAddress.parse(jf.address))
    wait_for(lambda: client.state()["hub"]["auth_refused"] >= 30)
    client.close()
    entries = wait_for(lambda: [a for a in _audit(jf) if a.get("kind") == "handshake on rpc"])
    time.sleep(0.5)
    entries = [a for a in _audit(jf) if a.get("kind") == "handshake on rpc"]
    assert 1 <= len(entries) <= 10  # the first ten in full; then one in a thousand
    assert entries[0]["key"] == stranger[0].decode() and entries[0]["client_host"] == "127.0.0.1"
    assert "not in authorized" in entries[0]["text"]


def test_a_rank_speaks_only_with_the_key_its_hello_came_with(start_hub, home: Path,
                                                             zctx: zmq.Context,
                                                             other_homes) -> None:
    """Two rank keys: node-b cannot send steps or answer a toggle in rank 0's name while rank
    0 (node-a) runs, nor take it over with a hello; once rank 0 ended, a new hello may."""
    base, jf = _tcp_hub(start_hub, "jobK")
    keys = {}
    for name in ("node-a", "node-b"):
        keys[name] = user_keypair(other_homes())
        assert cli(home, "keys", "add", keys[name].public.decode(), "--role", "rank",
                   "--name", name).returncode == 0

    def pusher(name: str) -> zmq.Socket:
        sock = zctx.socket(zmq.PUSH)
        sock.curve_publickey, sock.curve_secretkey = keys[name].public, keys[name].secret
        sock.curve_serverkey = jf.server_key.encode()
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(jf.tcp["ingest"])
        return sock

    a, b = pusher("node-a"), pusher("node-b")
    owner = HubClient(HubAddress.parse(jf.address))

    def send(sock: zmq.Socket, mtype: str, seq: int, body: dict) -> None:
        sock.send(protocol.encode(mtype, "jobK", 0, seq, body))

    hello = {"host": "a", "pid": 1, "world_size": 1, "local_rank": 0}
    send(a, "hello", 0, hello)
    send(a, "step", 1, {"step": 1, "loss": 1.0, "tokens": 1, "step_time_s": 0.01})
    wait_for(lambda: owner.state()["state"]["ranks"][:1] and
             owner.state()["state"]["ranks"][0]["step"] == 1)
    send(b, "step", 2, {"step": 2, "loss": 9.0, "tokens": 1, "step_time_s": 0.01})
    send(b, "toggle_result", 3, {"id": 1, "name": "NCCL_DEBUG", "value": "INFO",
                                 "outcome": "applied", "step": 2})
    send(b, "hello", 4, {**hello, "host": "b"})
    hub = wait_for(lambda: (h := owner.state()["hub"])["rejected"] >= 3 and h)
    assert hub["reject_reasons"].get("not the rank's key", 0) + hub["reject_reasons"].get(
        "bad hello", 0) == 3, hub["reject_reasons"]
    assert any("step for rank 0 from key node-b, not from node-a" in r["detail"]
               for r in hub["reject_recent"])
    state = owner.state()["state"]
    assert state["ranks"][0]["step"] == 1 and state["ranks"][0]["host"] == "a"
    assert not state["toggles"]  # no forged answer reached the audit
    send(a, "exit", 5, {"exit_code": 0, "reason": "finished"})
    wait_for(lambda: owner.state()["state"]["ranks"][0]["state"] != "running")
    send(b, "hello", 6, {**hello, "host": "b"})  # a restart on node b takes rank 0 over
    wait_for(lambda: owner.state()["state"]["ranks"][0]["host"] == "b")
    owner.close()
