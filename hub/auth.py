"""The hub's CurveZMQ gatekeeper: a ZAP handler (pyzmq's ThreadAuthenticator) that admits the
keys of `$SCALEMON_HOME/keys/authorized` on the sockets their role may use, and counts, logs
and hands to the audit the rest.

Each tcp socket has its own ZAP domain (`DOMAINS`): `ingest` admits `rank` and `control` keys,
`feed` `watch` and `control`, `rpc` every role (requests are then checked one by one against
`protocol.OP_ROLES`). The file is read again when it changed, at most once a second: by the
hub's housekeeping (`refresh`, which also says which keys lost access, so the hub cuts their
live connections) and when a key it did not admit knocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from scalemon.home.keys import (
    ZAP_DOMAIN,
    AuthorizedKey,
    KeyFileError,
    authorized_file,
    load_authorized,
)
from scalemon.protocol import SOCKET_ROLES

log = logging.getLogger("scalemon.hub")

DOMAINS = {"ingest": f"{ZAP_DOMAIN}.ingest", "feed": f"{ZAP_DOMAIN}.feed", "rpc": ZAP_DOMAIN}
"""The ZAP domain of each tcp socket (the rpc socket keeps the first one, `scalemon`)."""
_SOCKET_OF = {domain: label for label, domain in DOMAINS.items()}
MAX_REFUSED_KEYS = 1024
"""Refused keys counted one by one; further ones share one count (anyone can make keys)."""
MAX_EVENTS = 256
"""Refusals waiting for the hub to audit them; more are counted, not kept."""


class KeyGate:
    """Credentials provider for `configure_curve_callback`: admitted keys and their roles,
    refusal counts, and refusals for the audit."""

    RELOAD_EVERY_S = 1.0

    def __init__(self, keys: dict[bytes, AuthorizedKey], home: Path | None = None) -> None:
        self.keys = dict(keys)
        self.home = home
        self.refused: Counter[bytes] = Counter()
        self.refused_total = 0
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self.address = "?"  # the peer of the ZAP request under way (set by _Authenticator)
        self._lock = threading.Lock()
        self._reload_lock = threading.Lock()
        self._lost: list[AuthorizedKey] = []
        self._stamp = self._file_stamp()
        self._checked = time.monotonic()
        self._warn_legacy(self.keys)

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            info = authorized_file(self.home).stat()
        except (OSError, KeyFileError):
            return None
        return info.st_mtime_ns, info.st_size, info.st_ino

    def refresh(self, force: bool = False) -> None:
        """Read the authorized file again when it changed (checked at most once a second
        unless `force`); the keys removed or given another role since are kept for
        `take_lost` (their connections are to be cut)."""
        with self._reload_lock:  # the hub's loop and the ZAP thread both call it
            now = time.monotonic()
            if not force and now - self._checked < self.RELOAD_EVERY_S:
                return
            self._checked = now
            stamp = self._file_stamp()
            if stamp == self._stamp:
                return
            self._stamp = stamp
            try:
                keys = load_authorized(self.home)
            except (KeyFileError, OSError, ValueError) as exc:
                log.error("the authorized keys changed but cannot be read (%s); still "
                          "admitting the %d keys read before", exc, len(self.keys))
                return
            with self._lock:
                before, self.keys = self.keys, keys
                lost = [old for key, old in before.items()
                        if key not in keys or keys[key].role != old.role]
                self._lost.extend(lost)
        log.info("authorized keys read again: %d admitted (were %d)%s", len(keys), len(before),
                 f"; access cut for {', '.join(k.name for k in lost)}" if lost else "")
        self._warn_legacy({k: v for k, v in keys.items() if k not in before})

    def take_lost(self) -> list[AuthorizedKey]:
        """The keys that lost access since the last call (see `refresh`)."""
        self.refresh()
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def callback(self, domain: str, key: bytes) -> bool:
        """True for an admitted key whose role this socket takes; else count, log (the first
        time) and keep for the audit the refusal."""
        known = self.keys.get(key)
        if known is None:  # maybe just added: a stat, and a read only if the file changed
            self.refresh(force=True)
            known = self.keys.get(key)
        label = _SOCKET_OF.get(domain)
        if known is not None and label is not None and known.role in SOCKET_ROLES[label]:
            return True
        with self._lock:
            self.refused_total += 1
            counted = key if key in self.refused or len(self.refused) < MAX_REFUSED_KEYS \
                else b"(others)"
            self.refused[counted] += 1
            first = self.refused[counted] == 1
        if known is None:
            why = "a key not in authorized"
            hint = "add it with `scalemon keys add KEY --role ROLE --name NAME` to admit it"
        else:
            why = f"key {known.name} (role {known.role}) on the {label} socket"
            hint = f"the {label} socket takes roles {', '.join(SOCKET_ROLES.get(label, ()))}"
        self.events.append({"socket": label or domain, "key": key.decode(errors="replace"),
                            "name": known.name if known else None,
                            "role": known.role if known else None,
                            "client_host": self.address, "text": f"refused {why}"})
        if first:
            log.warning("refused a TCP connection from %s with %s: %s (%s)", self.address, why,
                        key.decode(errors="replace"), hint)
        return False

    def counts(self) -> dict[str, int]:
        """{"refused": total refusals, "refused_keys": distinct keys refused}."""
        with self._lock:
            return {"refused": self.refused_total, "refused_keys": len(self.refused)}

    @staticmethod
    def _warn_legacy(keys: dict[bytes, AuthorizedKey]) -> None:
        for k in keys.values():
            if k.legacy:
                log.warning("keys/authorized line %d has no role: key %s is read as `watch` "
                            "(read only); `scalemon keys remove %s` and `scalemon keys add "
                            "KEY --role rank|watch|control --name NAME` to give it one",
                            k.line, k.name, k.name)


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler, telling the gate the peer address of each request."""

    gate: KeyGate | None = None

    async def handle_zap_message(self, msg: list[bytes]) -> None:  # noqa: D102
        if self.gate is not None and len(msg) >= 4:
            self.gate.address = msg[3].decode("utf-8", "replace")[:64]
        await super().handle_zap_message(msg)


def start_gate(ctx: zmq.Context, home: Path | None) -> tuple[ThreadAuthenticator, KeyGate]:
    """Start the ZAP handler of `ctx` admitting the authorized keys of `home`."""
    gate = KeyGate(load_authorized(home), home)
    auth = _Authenticator(ctx, log=logging.getLogger("scalemon.hub.zap"))
    auth.gate = gate
    auth.start()
    for domain in (*DOMAINS.values(), "*"):
        auth.configure_curve_callback(domain, credentials_provider=gate)
    return auth, gate
