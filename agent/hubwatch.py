"""The job's own hub (or, on other nodes, the node's relay) as a rank sees it: how warnings
name it, and starting a new one when it stops answering. Part of `Run` (agent/run.py)."""

from __future__ import annotations

import logging

from scalemon import settings
from scalemon.home.address import HubAddress
from scalemon.home.paths import relay_dir, run_dir

from .autostart import start_hub_if_needed, start_relay_if_needed
from .env import RankEnv
from .transport import Sender

log = logging.getLogger("scalemon.agent")


def hub_label(env: RankEnv, address: HubAddress, configured: str | None) -> str:
    """The hub as warnings name it: on other nodes of a multi-node job, the node's relay."""
    if not configured and env.multi_node and env.node_rank != 0:
        return f"{address.base} (this node's relay; see relay.log there)"
    return address.base


def watch_hub(sender: Sender, env: RankEnv, configured: str | None) -> None:
    """With the job's own (auto-started) hub or relay: when it stops answering, start a new
    one (on the same history, for a hub). Local rank k tries after 3 + k seconds, so the
    lowest live one does; the lock makes a second start a no-op."""
    if configured:
        return
    if env.multi_node and env.node_rank != 0:
        directory, start, what = relay_dir(env.job), start_relay_if_needed, "relay"
    elif settings.raw("SCALEMON_HUB") or env.node_rank != 0:
        return
    else:
        directory, start, what = run_dir(env.job), start_hub_if_needed, "hub"

    def replace() -> None:
        pid = start(env, directory)
        if pid is not None:
            log.warning("scalemon: the job's %s stopped answering; rank %d started a new "
                        "one (pid %d)", what, env.rank, pid)

    sender.on_hub_silent = replace
    sender.replace_after_s = 3.0 + env.local_rank
