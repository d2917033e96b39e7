"""Attack a real hub on loopback as anyone who reaches its ports could (issue #26), and print
what it did to the hub: connections held, hub alive, snapshot latency, RSS before and after.

1. idle TCP connections (no handshake) held open against the hub's three tcp ports;
2. distinct malformed frames (each with its own text) on ingest;
3. relay reports with huge node names, and (as the owner) a toggle with a huge flag name.

    .venv/bin/python bench/attack.py [--connections 3000] [--sources 250] [--frames 100000]
                                     [--fd-limit N]

The connections come from `--sources` loopback addresses (127.0.0.2 and up), so that each
source stays under the hub's per-source share and the global cap is what is attacked. A rank
sends a step every 10 ms over ipc all along: `steps_in_history` says whether it went on.

`--fd-limit N` starts the hub with an open-files limit of N (soft and hard), as on a node
whose hard limit is low; by default the hub runs with this shell's limits (it raises its soft
limit to the hard one). The default run takes well under a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

from scalemon import protocol
from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.link.client import HubClient

JOB = "attack"


def rss_mib(pid: int) -> float:
    """Resident set size of `pid` in MiB (0 once gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def latency_ms(client: HubClient, n: int = 5) -> float | None:
    """Median `state` round trip in ms; None when the hub does not answer."""
    times = []
    for _ in range(n):
        started = time.perf_counter()
        try:
            client.state()
        except Exception:  # noqa: BLE001 - an attack result, reported as such
            return None
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def start_hub(home: Path, fd_limit: int | None) -> subprocess.Popen:
    def limit() -> None:
        if fd_limit:
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

    log = open(home / "hub.log", "wb")  # noqa: SIM115 - the hub's for its life
    proc = subprocess.Popen([sys.executable, "-m", "scalemon.hub", "--job", JOB, "--home",
                             str(home), "--listen", "tcp://127.0.0.1:0"], stdout=log,
                            stderr=subprocess.STDOUT, preexec_fn=limit)
    path = home / "jobs" / f"{JOB}.json"
    deadline = time.monotonic() + 30
    while not (path.exists() and JobFile.read(path).pid == proc.pid):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"hub did not start:\n{(home / 'hub.log').read_text()}")
        time.sleep(0.05)
    return proc


def hold_connections(ports: list[int], n: int, sources: int,
                     budget_s: float = 15.0) -> list[socket.socket]:
    """Open `n` idle connections spread over `ports` and `sources` loopback source addresses
    (for at most `budget_s`); returns those that connected."""
    held = []
    deadline = time.monotonic() + budget_s
    for i in range(n):
        if time.monotonic() > deadline:
            break
        s = socket.socket()
        s.settimeout(1.0)
        try:
            k = 2 + i % sources  # 127.0.0.2 and up: all loopback (127/8)
            s.bind((f"127.0.{k >> 8}.{k & 255}", 0))
            s.connect(("127.0.0.1", ports[i % len(ports)]))
        except OSError:
            s.close()
            continue
        held.append(s)
    return held


class Rank(threading.Thread):
    """A rank sending a step every 10 ms to the hub's ipc ingest until stopped."""

    def __init__(self, ctx: zmq.Context, address: HubAddress) -> None:
        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.connect(address.ingest)
        self.sent = 0
        self.halt = threading.Event()

    def run(self) -> None:
        self.sock.send(protocol.encode("hello", JOB, 0, 0, {
            "host": "bench", "pid": os.getpid(), "world_size": 1, "local_rank": 0}))
        while not self.halt.wait(0.01):
            self.sent += 1
            self.sock.send(protocol.encode("step", JOB, 0, self.sent, {
                "step": self.sent, "loss": 1.0, "tokens": 1, "step_time_s": 0.01}))
        self.sock.close(linger=5000)


def removal_cut_s(ctx: zmq.Context, jf: JobFile, home: Path) -> dict:
    """Admit a `watch` key, have it follow the feed and make a request, ask for a toggle (to
    be refused), then `keys remove` it: the seconds until both its connections were cut."""
    from zmq.utils.monitor import parse_monitor_message

    from scalemon.home.keys import add_key, remove_key

    bob_home = Path(tempfile.mkdtemp(prefix="smb", dir="/tmp"))
    try:
        os.environ["SCALEMON_HOME"] = str(bob_home)
        from scalemon.home.keys import user_keypair

        bob = user_keypair(bob_home)
        os.environ["SCALEMON_HOME"] = str(home)
        add_key(bob.public.decode(), "watch", "bob", home)
        socks, monitors = [], []
        for kind, endpoint in ((zmq.SUB, jf.tcp["feed"]), (zmq.DEALER, jf.tcp["rpc"])):
            sock = ctx.socket(kind)
            sock.curve_publickey, sock.curve_secretkey = bob.public, bob.secret
            sock.curve_serverkey = jf.server_key.encode()
            sock.setsockopt(zmq.LINGER, 0)
            if kind == zmq.SUB:
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            monitors.append(sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))
            sock.connect(endpoint)
            socks.append(sock)
        dealer = socks[1]
        dealer.send(protocol.encode_request("toggle", name="NCCL_DEBUG", value="INFO",
                                            restart=False, user="root", host="hub"))
        refused = dealer.recv() if dealer.poll(5000) else None
        reply = msgpack_reply(refused) if refused else {}
        time.sleep(0.5)
        started = time.monotonic()
        remove_key("bob", home)
        cut = [None, None]
        while time.monotonic() - started < 10 and None in cut:
            for i, monitor in enumerate(monitors):
                if cut[i] is None and monitor.poll(10) and parse_monitor_message(
                        monitor.recv_multipart())["event"] == zmq.EVENT_DISCONNECTED:
                    cut[i] = round(time.monotonic() - started, 3)
        for sock in socks:
            sock.close(linger=0)
        return {"watch_toggle_reply": reply.get("error", "")[:90],
                "cut_after_remove_s": {"feed": cut[0], "rpc": cut[1]}}
    finally:
        shutil.rmtree(bob_home, ignore_errors=True)


def msgpack_reply(frame: bytes) -> dict:
    """A reply's map, refused or not."""
    import msgpack

    return msgpack.unpackb(frame, raw=False)


def flood(ctx: zmq.Context, address: HubAddress, control: str, frames: int) -> None:
    """Distinct malformed frames, huge relay names, a huge flag name."""
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(address.ingest)
    for i in range(frames):
        push.send(protocol.encode("step", f"job-{i}", 0, 0, {"step": 1}))
    for endpoint, op, args in (
            [(address.rpc, "relay", {"node": f"{i}" + "n" * 600_000, "pid": 1,
                                     "t": time.time(), "stats": {}}) for i in range(20)]
            + [(control, "toggle", {"name": "F" * 1_000_000, "value": "1", "restart": False,
                                    "user": "me", "host": "here"})]):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send(protocol.encode_request(op, **args))
        sock.poll(5000)
        sock.close()
    push.close(linger=5000)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=3000)
    parser.add_argument("--sources", type=int, default=250,
                        help="loopback source addresses the connections come from")
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--fd-limit", type=int, default=None)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the attacker's own sockets
    n = min(args.connections, hard - 200)
    home = Path(tempfile.mkdtemp(prefix="sma", dir="/tmp"))
    os.environ["SCALEMON_HOME"] = str(home)  # the hub's keys admit this user's key
    ctx = zmq.Context()
    proc = start_hub(home, args.fd_limit)
    figures: dict = {"fd_limit": args.fd_limit or f"this shell's ({soft} soft, {hard} hard)"}
    try:
        jf = JobFile.read(home / "jobs" / f"{JOB}.json")
        ipc_address = HubAddress.for_directory(home / "run" / JOB)
        tcp_address = HubAddress(jf.tcp["ingest"], jf.tcp["feed"], jf.tcp["rpc"],
                                 server_key=jf.server_key)
        ports = [int(ep.rpartition(":")[2]) for ep in jf.tcp.values()]
        ipc, tcp = HubClient(ipc_address, ctx=ctx), HubClient(tcp_address, ctx=ctx)
        figures["rss_before_mib"] = round(rss_mib(proc.pid), 1)
        figures["snapshot_ms_before"] = {"ipc": latency_ms(ipc), "tcp": latency_ms(tcp)}
        rank = Rank(ctx, ipc_address)
        rank.start()
        started = time.monotonic()
        held = hold_connections(ports, n, max(1, args.sources))
        figures["connections_opened"] = len(held)
        figures["open_s"] = round(time.monotonic() - started, 2)
        time.sleep(1.0)
        # new clients during the attack: a new connection is what runs out of descriptors
        figures["snapshot_ms_while_held"] = {
            "ipc": latency_ms(HubClient(ipc_address, ctx=ctx)),
            "tcp": latency_ms(HubClient(tcp_address, ctx=ctx))}
        try:
            hub = ipc.state()["hub"]
            figures["hub_tcp"] = {k: hub[k] for k in (
                "tcp_connections", "tcp_cap", "tcp_shed", "tcp_source_cap", "tcp_shed_by_source")}
        except Exception as exc:  # noqa: BLE001
            figures["hub_tcp"] = f"no answer: {exc}"
        for s in held:
            s.close()
        rank.halt.set()
        rank.join()
        figures["hub_alive_after_connections"] = proc.poll() is None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            got = ipc.state()["state"]["ranks"]
            if got and got[0]["step"] == rank.sent:
                break
            time.sleep(0.2)
        figures["steps_sent"] = rank.sent
        figures["steps_in_history"] = got[0]["step"] if got else 0
        flood(ctx, ipc_address, ipc_address.control, args.frames)
        deadline = time.monotonic() + 30
        hub = {}
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                hub = ipc.state()["hub"]
            except Exception:  # noqa: BLE001
                break
            if hub["rejected"] >= args.frames + 20:  # the huge toggle is refused, audited
                break
            time.sleep(0.2)
        figures["rejected"] = hub.get("rejected")
        figures["reject_reason_keys"] = len(hub.get("reject_reasons") or {})
        figures["reject_reasons"] = hub.get("reject_reasons")
        figures["snapshot_ms_after"] = {"ipc": latency_ms(ipc), "tcp": latency_ms(tcp)}
        figures.update(removal_cut_s(ctx, jf, home))
        figures["rss_after_mib"] = round(rss_mib(proc.pid), 1)
        figures["hub_alive"] = proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
        tail = (home / "hub.log").read_text()[-600:]
        shutil.rmtree(home, ignore_errors=True)
        ctx.destroy(linger=0)
    for key, value in figures.items():
        print(f"{key:24} {value}")
    if not figures.get("hub_alive"):
        print(f"hub log tail:\n{tail}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0 if figures.get("hub_alive") else 1


if __name__ == "__main__":
    sys.exit(main())
