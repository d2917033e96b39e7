"""Who sent a message to the hub, and what that peer may do.

The identity comes from the connection, never from what a peer says: over tcp the Curve key the
ZAP handler admitted (libzmq's `User-Id` message property; its name and role come from
`keys/authorized`), over ipc the peer's uid (libzmq reads `SO_PEERCRED` into `Peer-Address`:
`localhost:UID:GID:PID`). The hub's ipc sockets sit in a 0700 directory, so an ipc peer is the
owner (or root): role `control`. What each role may ask is `protocol.OP_ROLES`.
"""

from __future__ import annotations

import functools
import os
import pwd
from dataclasses import dataclass
from typing import Any

import zmq

from scalemon.home.keys import AuthorizedKey
from scalemon.protocol import OP_ROLES, SOCKET_ROLES

from .tcpguard import TcpGuard, shutdown_connection


@dataclass(frozen=True)
class Peer:
    """The sender of one message, as the hub knows it."""

    role: str | None  # one of keys.ROLES; None: a key no longer admitted
    user: str  # the key's name (tcp) or the uid's user name (ipc)
    host: str  # the peer's address (tcp) or the hub's host (ipc)
    via: str  # how the hub knows: "key NAME from ADDR" or "uid UID (USER) pid PID over ipc"
    key: bytes | None = None  # the Curve public key (z85), tcp only
    fd: int | None = None  # the connection's descriptor (tcp), to cut it
    asker: str = ""  # `via` without what changes from one process to the next (the pid)

    def who(self) -> dict[str, Any]:
        """The audit's fields naming this peer."""
        return {"user": self.user, "client_host": self.host, "role": self.role,
                "via": self.via}


def _property(frame: zmq.Frame, name: str | int) -> str | int | None:
    try:
        return frame.get(name)
    except (zmq.ZMQError, ValueError, TypeError, UnicodeDecodeError):
        return None


def tcp_peer(frame: zmq.Frame, keys: dict[bytes, AuthorizedKey]) -> Peer:
    """The peer behind a message that came over a Curve socket (its key as admitted now)."""
    raw = _property(frame, "User-Id")
    key = raw.encode() if isinstance(raw, str) else None
    address = str(_property(frame, "Peer-Address") or "?")
    fd = _property(frame, zmq.SRCFD)
    known = keys.get(key) if key else None
    fd = fd if isinstance(fd, int) else None
    if known is None:
        shown = key.decode()[:12] + "…" if key else "no key"
        via = f"key {shown} (not admitted now) from {address}"
        return Peer(None, f"key {shown}", address, via, key, fd, via)
    via = f"key {known.name} from {address}"
    return Peer(known.role, known.name, address, via, key, fd, via)


def ipc_peer(frame: zmq.Frame, hub_host: str) -> Peer:
    """The peer behind a message on one of the hub's ipc sockets (its uid, from the kernel)."""
    address = str(_property(frame, "Peer-Address") or "")
    parts = address.rsplit(":", 3)
    try:
        uid, pid = int(parts[1]), int(parts[3])
    except (IndexError, ValueError):  # no SO_PEERCRED here: the 0700 directory still holds
        via = "ipc (peer uid not known on this platform)"
        return Peer("control", _user_name(os.getuid()), hub_host, via, asker=via)
    name = _user_name(uid)
    role = "control" if uid in (os.getuid(), 0) else None
    asker = f"uid {uid} ({name})"
    return Peer(role, name, hub_host, f"{asker} pid {pid} over ipc", asker=asker)


def may(peer: Peer, op: str) -> bool:
    """Whether `peer` may make request `op`."""
    return peer.role is not None and peer.role in OP_ROLES.get(op, ())


def refusal(peer: Peer, op: str) -> str:
    """Why `peer` may not make request `op`, and what to do about it."""
    if peer.role is None:
        return (f"refused: {peer.via} is not admitted (its key was removed from "
                "keys/authorized, or the uid is not the job's owner)")
    needed = OP_ROLES.get(op) or SOCKET_ROLES.get(op) or ("control",)
    roles = " or ".join(needed)
    return (f"refused: {op} needs role {roles}; {peer.via} has role {peer.role}. The job's "
            f"owner can give a key another role: `scalemon keys remove {peer.user}`, then "
            f"`scalemon keys add KEY --role {needed[-1]} --name "
            f"{peer.user}`")


@functools.lru_cache(maxsize=64)
def _user_name(uid: int) -> str:
    """The user name of `uid` (looked up once: every ipc request asks, and on a cluster the
    password database may be LDAP)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid{uid}"


class PeerBook:
    """Which admitted key each live tcp connection belongs to (learnt from its messages), so
    that the connections of a key that loses access can be cut. An entry names the
    connection's accept time too: a descriptor number reused by a later connection is never
    cut in its place."""

    def __init__(self, guard: TcpGuard) -> None:
        self.guard = guard
        self.conns: dict[int, tuple[bytes, int, float | None]] = {}  # fd -> key, port, accepted
        self.cut_total = 0

    def learn(self, peer: Peer, port: int) -> None:
        """Note the connection `peer` sent on (tcp socket bound at `port`)."""
        if peer.fd is None or peer.key is None:
            return
        accepted = self.guard.accepted_at(port, peer.fd)
        entry = self.conns.get(peer.fd)
        if entry is None or entry[0] != peer.key or (accepted is not None and entry[2] != accepted):
            self.conns[peer.fd] = (peer.key, port, accepted)
        if len(self.conns) > 4 * max(64, self.guard.connections()):  # closed ones linger
            self.prune()

    def prune(self) -> None:
        """Forget the connections the guard no longer counts."""
        self.conns = {fd: entry for fd, entry in self.conns.items()
                      if self._same(fd, entry[1], entry[2])}

    def _same(self, fd: int, port: int, accepted: float | None) -> bool:
        """Whether `fd` is still the connection noted (accepted then; None: not known)."""
        now = self.guard.accepted_at(port, fd)
        return now is not None and (accepted is None or now == accepted)

    def cut(self, keys: set[bytes]) -> int:
        """Shut down every live connection of `keys`; returns how many."""
        cut = 0
        for fd, (key, port, accepted) in list(self.conns.items()):
            if key not in keys:
                continue
            del self.conns[fd]
            if self._same(fd, port, accepted) and shutdown_connection(fd, port):
                cut += 1
        self.cut_total += cut
        return cut

    def cut_one(self, peer: Peer, port: int) -> bool:
        """Shut down the connection `peer` sent on (a key no longer admitted)."""
        if peer.fd is None:
            return False
        self.conns.pop(peer.fd, None)
        done = shutdown_connection(peer.fd, port)
        self.cut_total += done
        return done
