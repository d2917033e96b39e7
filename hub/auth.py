"""The hub's CurveZMQ gatekeeper: a ZAP handler (pyzmq's ThreadAuthenticator) that admits the
public keys of `$SCALEMON_HOME/keys/authorized` and counts and logs (once per key) the rest.
The file is read again when a key it did not admit knocks and the file changed since, so a key
added to it gets in on its next try, without restarting the hub."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from scalemon.keys import ZAP_DOMAIN, KeyFileError, authorized_file, load_authorized

log = logging.getLogger("scalemon.hub")


class KeyGate:
    """Credentials provider for `configure_curve_callback`: admitted keys, refusal counts."""

    RELOAD_EVERY_S = 1.0

    def __init__(self, authorized: set[bytes], home: Path | None = None) -> None:
        self.authorized = frozenset(authorized)
        self.home = home
        self.refused: Counter[bytes] = Counter()
        self._lock = threading.Lock()
        self._stamp = self._file_stamp()
        self._checked = time.monotonic()

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            info = authorized_file(self.home).stat()
        except OSError:
            return None
        return info.st_mtime_ns, info.st_size

    def _reload_if_changed(self) -> None:
        """Read the authorized file again when it changed (checked at most once a second)."""
        now = time.monotonic()
        if now - self._checked < self.RELOAD_EVERY_S:
            return
        self._checked = now
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            keys = load_authorized(self.home)
        except (KeyFileError, OSError, ValueError) as exc:
            log.error("the authorized keys changed but cannot be read (%s); still admitting "
                      "the %d keys read before", exc, len(self.authorized))
            return
        log.info("authorized keys read again: %d admitted (were %d)", len(keys),
                 len(self.authorized))
        self.authorized = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        """True for an admitted key; else count (and log the first time) the refusal."""
        if domain == ZAP_DOMAIN and key in self.authorized:
            return True
        if domain == ZAP_DOMAIN:
            self._reload_if_changed()
            if key in self.authorized:
                return True
        with self._lock:
            self.refused[key] += 1
            first = self.refused[key] == 1
        if first:
            log.warning("refused a TCP connection with a key not in authorized: %s (domain "
                        "%r); add it to $SCALEMON_HOME/keys/authorized to admit it (read "
                        "again on the key's next try)", key.decode(errors="replace"), domain)
        return False

    def counts(self) -> dict[str, int]:
        """{"refused": total refusals, "refused_keys": distinct keys refused}."""
        with self._lock:
            return {"refused": sum(self.refused.values()), "refused_keys": len(self.refused)}


def start_gate(ctx: zmq.Context, home: Path | None) -> tuple[ThreadAuthenticator, KeyGate]:
    """Start the ZAP handler of `ctx` admitting the authorized keys of `home`."""
    gate = KeyGate(load_authorized(home), home)
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("scalemon.hub.zap"))
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=gate)
    auth.configure_curve_callback("*", credentials_provider=gate)
    return auth, gate
