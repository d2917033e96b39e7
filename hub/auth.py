"""The hub's CurveZMQ gatekeeper: a ZAP handler (pyzmq's ThreadAuthenticator) that admits the
public keys of `$SCALEMON_HOME/keys/authorized` and counts and logs (once per key) the rest."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from scalemon.keys import ZAP_DOMAIN, load_authorized

log = logging.getLogger("scalemon.hub")


class KeyGate:
    """Credentials provider for `configure_curve_callback`: admitted keys, refusal counts."""

    def __init__(self, authorized: set[bytes]) -> None:
        self.authorized = frozenset(authorized)
        self.refused: Counter[bytes] = Counter()
        self._lock = threading.Lock()

    def callback(self, domain: str, key: bytes) -> bool:
        """True for an admitted key; else count (and log the first time) the refusal."""
        if domain == ZAP_DOMAIN and key in self.authorized:
            return True
        with self._lock:
            self.refused[key] += 1
            first = self.refused[key] == 1
        if first:
            log.warning("refused a TCP connection with a key not in authorized: %s (domain "
                        "%r); add it to $SCALEMON_HOME/keys/authorized to admit it (the hub "
                        "reads the file when it starts)", key.decode(errors="replace"), domain)
        return False

    def counts(self) -> dict[str, int]:
        """{"refused": total refusals, "refused_keys": distinct keys refused}."""
        with self._lock:
            return {"refused": sum(self.refused.values()), "refused_keys": len(self.refused)}


def start_gate(ctx: zmq.Context, home: Path | None) -> tuple[ThreadAuthenticator, KeyGate]:
    """Start the ZAP handler of `ctx` admitting the authorized keys of `home`."""
    gate = KeyGate(load_authorized(home))
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("scalemon.hub.zap"))
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=gate)
    auth.configure_curve_callback("*", credentials_provider=gate)
    return auth, gate
