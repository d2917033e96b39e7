"""Steering a job: requests to the hub that change it (flag toggles, Flight Recorder dumps,
stop).

On the hub's host, the job's owner uses the hub's control socket, an ipc socket in its run
directory (mode 0700). From elsewhere the requests go to the hub's tcp rpc socket, where the
hub allows them to a key of role `control` only (`scalemon keys`) and refuses, with the role
named, any other: the hub decides and audits, whoever asks.
"""

from __future__ import annotations

import getpass
import os
import time
from pathlib import Path
from typing import Any

from scalemon.home.address import HubAddress
from scalemon.home.keys import server_key_for
from scalemon.link.client import HubClient, HubUnreachable
from scalemon.settings import node_name
from scalemon.state.flagstate import log_counts_due


class ControlError(RuntimeError):
    """The job cannot be steered from here; the text says why and what to do."""


class Controller:
    """Requests that steer one hub's job."""

    def __init__(self, address: HubAddress, timeout_s: float = 5.0) -> None:
        here = address.control is not None and (
            _local(address.control) or not address.rpc.startswith("tcp://"))
        if here:  # the owner's control socket on the hub's host (check_reachable says why not)
            check_reachable(address.control)
            endpoint = address.control
            self.client = HubClient(HubAddress(endpoint, endpoint, endpoint), timeout_s)
        elif address.rpc.startswith("tcp://"):  # the hub checks this key's role
            server_key_for(address.rpc, address.server_key)  # NoServerKey now, said plainly
            self.client = HubClient(address, timeout_s)
        else:
            raise ControlError(
                f"the hub at {address.rpc} is not on this machine (or its run directory is "
                "unknown): steer the job (flags, Flight Recorder dumps) on the hub's host, or "
                "over tcp with a key of role control (`scalemon keys` on the hub's host)")
        self.address = address

    def toggle(self, name: str, value: str, restart: bool = False) -> dict[str, Any]:
        """Ask the hub to change flag `name` on every rank; the reply names the toggle's id,
        tier and the step it is planned for. Raises ProtocolError (refused) or
        HubUnreachable."""
        return self.client.request("toggle", name=name, value=value, restart=restart,
                                   user=getpass.getuser(), host=node_name())

    def stop(self, reason: str) -> dict[str, Any]:
        """Tell the hub that the job's user is stopping the job (`reason`: how, e.g.
        "scalemon demo: q"), before the ranks are signalled: their end then reads "stopped
        by user". Raises ProtocolError (refused) or HubUnreachable."""
        return self.client.request("stop", reason=reason, user=getpass.getuser(),
                                   host=node_name())

    def command(self, name: str) -> dict[str, Any]:
        """A command for every rank (`dump_fr`)."""
        return self.client.request("command", name=name)

    def wait_toggle(self, toggle_id: int, timeout_s: float,
                    poll_s: float = 0.5) -> dict[str, Any] | None:
        """The toggle's audit record once it reached a final state (applied, partial, failed,
        refused, restarted), or its latest record when `timeout_s` ran out (None: never
        seen)."""
        deadline = time.monotonic() + timeout_s
        latest = None
        while True:
            try:
                state = self.client.state()["state"]
            except HubUnreachable:  # busy (a restart starves the CPU); its deadline decides
                if time.monotonic() >= deadline:
                    raise
                continue
            for toggle in state.get("toggles") or ():
                if toggle.get("id") == toggle_id:
                    latest = toggle
            if latest is not None and latest.get("state") in FINAL_STATES:
                return latest
            if time.monotonic() >= deadline:
                return latest
            time.sleep(poll_s)

    def wait_log_counts(self, toggle: dict[str, Any], timeout_s: float,
                        poll_s: float = 0.5) -> dict[str, Any]:
        """The toggle's record once every rank that promised a count of NCCL log lines
        (`log_window_s`) sent it, or its latest record after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while log_counts_due(toggle) and time.monotonic() < deadline:
            time.sleep(poll_s)
            try:
                state = self.client.state()["state"]
            except HubUnreachable:
                continue
            toggle = next((t for t in state.get("toggles") or () if t.get("id") == toggle["id"]),
                          toggle)
        return toggle

    def close(self) -> None:
        """Close the socket."""
        self.client.close()


FINAL_STATES = ("applied", "partial", "failed", "refused", "restarted")
LOG_COUNT_SLACK_S = 5.0
"""How long past a count's window a client waits for it (the agent's sync, the hub)."""


def log_count_wait(toggle: dict[str, Any]) -> float:
    """Seconds to wait for the NCCL line counts `toggle`'s ranks promised (0: none promised)."""
    windows = [res["log_window_s"] for res in (toggle.get("results") or {}).values()
               if isinstance(res.get("log_window_s"), (int, float))]
    return max(windows) + LOG_COUNT_SLACK_S if windows else 0.0


def _local(endpoint: str) -> bool:
    """Whether an ipc control endpoint's directory exists here (the hub's host)."""
    return endpoint.startswith("ipc://") and Path(endpoint[len("ipc://"):]).parent.exists()


def check_reachable(endpoint: str) -> None:
    """Raise ControlError when an ipc control socket cannot be opened by this user."""
    if not endpoint.startswith("ipc://"):
        return
    path = Path(endpoint[len("ipc://"):])
    directory = path.parent
    try:
        info = directory.stat()
    except PermissionError:
        raise ControlError(f"permission denied on {directory}: the job belongs to another "
                           "user; only its owner can steer it (flags, dumps)") from None
    except FileNotFoundError:
        raise ControlError(f"{directory} does not exist: the job's hub is gone or runs "
                           "elsewhere") from None
    if info.st_uid != os.getuid() or not os.access(directory, os.X_OK | os.W_OK):
        raise ControlError(f"{directory} belongs to uid {info.st_uid}, not to you (uid "
                           f"{os.getuid()}): only the job's owner can steer it (flags, dumps)")
    if not path.exists():
        raise ControlError(f"the hub has no control socket at {path}: it is an older hub, or "
                           "it is not running")


__all__ = ["ControlError", "Controller", "HubUnreachable", "check_reachable"]
