"""TCP is CurveZMQ only: admitted keys get through, unknown keys and plain sockets get nothing
and put nothing into the history (real hub processes on loopback)."""

from __future__ import annotations

import os
import stat
import tempfile
import time
from pathlib import Path

import pytest
import zmq

from conftest import send_unless_refused, wait_for
from scalemon import protocol
from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.home.keys import (
    KeyFileError,
    NoServerKey,
    authorized_file,
    hub_keypair,
    keys_dir,
    load_authorized,
    parse_authorized,
    user_keypair,
)
from scalemon.home.paths import jobs_dir
from scalemon.link.client import HubClient, HubStream

QUIET_S = 1.5  # how long a refused peer is watched for an answer that must not come


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_are_made_private_on_first_use(home: Path) -> None:
    own = user_keypair(home)
    hub = hub_keypair(home)
    directory = keys_dir(home)
    assert _mode(directory) == 0o700
    for name in ("user.key_secret", "hub.key_secret"):
        assert _mode(directory / name) == 0o600
    assert own != hub and len(own.public) == len(own.secret) == 40
    assert user_keypair(home) == own  # loaded, not made anew
    admitted = load_authorized(home)  # the user's own key, ssh-style, as control
    assert list(admitted) == [own.public] and admitted[own.public].role == "control"
    assert _mode(authorized_file(home)) == 0o600


def test_a_secret_key_others_can_read_is_refused(home: Path) -> None:
    user_keypair(home)
    secret = keys_dir(home) / "user.key_secret"
    os.chmod(secret, 0o644)
    with pytest.raises(KeyFileError, match=r"readable by others .*chmod 600"):
        user_keypair(home)


def test_a_malformed_authorized_line_is_named() -> None:
    good = zmq.curve_keypair()[0].decode()
    text = f"# mine\n{good}  # laptop\n\nnot-a-key\n"
    with pytest.raises(KeyFileError, match=r"authorized line 4: 'not-a-key' is not a Curve"):
        parse_authorized(text)
    assert list(parse_authorized(f"{good}\n")) == [good.encode()]


def test_a_tcp_address_without_a_server_key_is_never_connected(home: Path) -> None:
    client = HubClient(HubAddress.parse("tcp://127.0.0.1:9"), timeout_s=0.5)
    with pytest.raises(NoServerKey, match=r"no server key for tcp://127.0.0.1:11: .*"
                                          r"SCALEMON_HUB_KEY"):
        client.state()


def _tcp_hub(start_hub, job: str) -> tuple[HubAddress, JobFile]:
    hub = start_hub(job, "--listen", "tcp://127.0.0.1:0")
    jf = JobFile.read(jobs_dir(hub.home) / f"{job}.json")
    assert jf.tcp and jf.server_key and jf.address.startswith("ipc://")
    address = HubAddress(jf.tcp["ingest"], jf.tcp["feed"], jf.tcp["rpc"],
                         server_key=jf.server_key)
    return address, jf


def _curve(sock: zmq.Socket, server_key: str, keys: tuple[bytes, bytes] | None) -> zmq.Socket:
    """A Curve client with `keys` (public, secret), or a plain socket for None."""
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.curve_serverkey = server_key.encode()
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def _losses(client: HubClient) -> list[float]:
    records, _ = client.fetch(0)
    return [m.body["loss"] for m in map(protocol.decode, records) if m.type == "step"]


def test_only_admitted_keys_get_in_over_tcp(start_hub, zctx: zmq.Context) -> None:
    address, jf = _tcp_hub(start_hub, "jobC")
    client = HubClient(address, timeout_s=5.0)  # the user's own key, admitted by default
    state = client.state()
    assert state["hub"]["tcp"] == jf.tcp and state["hub"]["auth_refused"] == 0
    stream = HubStream(address)  # the feed over tcp carries records too

    def push(keys: tuple[bytes, bytes] | None, rank: int, loss: float) -> None:
        sock = _curve(zctx.socket(zmq.PUSH), jf.server_key, keys)
        sock.connect(address.ingest)
        send_unless_refused(sock, protocol.encode("step", "jobC", rank, 0, {
            "step": 1, "loss": loss, "tokens": 1, "step_time_s": 0.01}))
        time.sleep(0.3)
        sock.close(linger=0)

    stranger = zmq.curve_keypair()
    push(stranger, 5, 777.0)  # an unknown key
    push(None, 6, 888.0)  # no Curve at all
    dealer = _curve(zctx.socket(zmq.DEALER), jf.server_key, stranger)
    dealer.connect(address.rpc)
    send_unless_refused(dealer, protocol.encode_request("state"))
    plain = _curve(zctx.socket(zmq.DEALER), jf.server_key, None)
    plain.connect(address.rpc)
    send_unless_refused(plain, protocol.encode_request("state"))
    sub = _curve(zctx.socket(zmq.SUB), jf.server_key, None)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(address.feed)
    own = user_keypair()
    push((own.public, own.secret), 0, 1.0)  # the admitted rank, after the others
    wait_for(lambda: _losses(client) == [1.0])
    got = []
    wait_for(lambda: got.extend(s.body["loss"] for _, s in stream.poll() if s.type == "step")
             or got == [1.0])
    assert not dealer.poll(int(QUIET_S * 1000)) and not plain.poll(0) and not sub.poll(0)
    hub = wait_for(lambda: (h := client.state()["hub"])["auth_refused"] >= 2 and h)
    assert hub["auth_refused_keys"] == 1  # the stranger's key, on ingest and on rpc
    state = client.state()["state"]
    assert [r["rank"] for r in state["ranks"]] == [0]  # nothing of ranks 5 and 6
    assert _losses(client) == [1.0]
    stream.close()
    client.close()


def test_an_agent_with_a_key_the_hub_does_not_admit_changes_nothing(
        start_hub, monkeypatch: pytest.MonkeyPatch) -> None:
    from scalemon.agent.transport import Sender

    address, jf = _tcp_hub(start_hub, "jobA")
    client = HubClient(address)
    other = Path(tempfile.mkdtemp(prefix="smo", dir="/tmp"))  # another user's home and keys
    monkeypatch.setenv("SCALEMON_HOME", str(other))
    sender = Sender(address.ingest, "jobA", 3, rpc_endpoint=address.rpc,
                    server_key=jf.server_key, close_timeout_s=0.5)
    sender.submit("step", {"step": 1, "loss": 555.0, "tokens": 1, "step_time_s": 0.01})
    time.sleep(QUIET_S)
    assert sender.hub_version is None  # its sync was never answered
    sender.close()
    monkeypatch.setenv("SCALEMON_HOME", str(jf.run_dir).rsplit("/run/", 1)[0])
    wait_for(lambda: client.state()["hub"]["auth_refused"] >= 1)
    reply = client.state()
    assert reply["head"] == 0 and not reply["state"]["ranks"]
    client.close()


def test_a_key_added_to_authorized_gets_in_on_its_next_try(start_hub, zctx: zmq.Context,
                                                           home: Path) -> None:
    address, jf = _tcp_hub(start_hub, "jobK")
    colleague = zmq.curve_keypair()

    def ping() -> bool:
        dealer = _curve(zctx.socket(zmq.DEALER), jf.server_key, colleague)
        dealer.connect(address.rpc)
        answered = (send_unless_refused(dealer, protocol.encode_request("ping"))
                    and bool(dealer.poll(int(QUIET_S * 1000))))
        dealer.close(linger=0)
        return answered

    assert not ping()
    with open(authorized_file(home), "a") as f:  # no hub restart
        f.write(f"{colleague[0].decode()}  # a colleague\n")
    wait_for(ping, timeout=15)
    client = HubClient(address)
    assert client.state()["hub"]["auth_refused_keys"] == 1
    client.close()
