"""The dashboard's requests to the hub, run in thread workers of the app (tui/app.py): a
Flight Recorder dump (the hang screen's `d`) and a flag change (the flags screen). Each answer
comes back to the app as a Message."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq
from textual.message import Message

from scalemon.home.address import HubAddress
from scalemon.link.client import HubUnreachable
from scalemon.link.control import ControlError, Controller
from scalemon.protocol import ProtocolError

NO_HUB = "no hub: dumps need a live job"
NO_HUB_FLAGS = ("no live hub behind this dashboard (simulated or replayed data): flags can be "
                "changed only in a live job, from the hub's host")
ToggleSender = Callable[[str, str, bool], dict[str, Any]]
"""(name, value, restart) -> the hub's reply; raises ProtocolError (refused), HubUnreachable,
ControlError (the job cannot be steered from here)."""


class DumpAnswer(Message):
    """What became of a Flight Recorder dump request (posted from the worker's thread)."""

    def __init__(self, text: str, ok: bool) -> None:
        super().__init__()
        self.text = text
        self.ok = ok


class ToggleAnswer(Message):
    """What became of a flag change request (posted from the worker's thread)."""

    def __init__(self, text: str, ok: bool) -> None:
        super().__init__()
        self.text = text
        self.ok = ok


def ask_dump(address: HubAddress) -> DumpAnswer:
    """Ask the hub at `address` for a Flight Recorder dump of every rank (blocks)."""
    try:
        controller = Controller(address, timeout_s=5.0)
    except ControlError as exc:
        return DumpAnswer(f"dump failed: {exc}", ok=False)
    try:
        reply = controller.command("dump_fr")
    except (HubUnreachable, ProtocolError, zmq.ZMQError) as exc:
        return DumpAnswer(f"dump failed: {exc}", ok=False)
    finally:
        controller.close()
    where = reply.get("directory", "?")
    if "ranks" in reply:
        text = f"dump requested: {len(reply['ranks'])} ranks -> {where}"
    else:
        text = f"dump requested: {reply.get('note') or 'the hub took it'} -> {where}"
    return DumpAnswer(text, ok=True)


def ask_toggle(send: ToggleSender, name: str, value: str, restart: bool) -> ToggleAnswer:
    """Send a flag change through `send` (blocks); the answer says what became of it."""
    change = f"{name}={value}" if value else f"{name}= (unset)"
    try:
        reply = send(name, value, restart)
    except ControlError as exc:
        return ToggleAnswer(f"cannot change flags from here: {exc}", ok=False)
    except ProtocolError as exc:
        return ToggleAnswer(f"the hub refused {change}: {exc}", ok=False)
    except (HubUnreachable, zmq.ZMQError, OSError) as exc:
        return ToggleAnswer(f"{change} not sent: {exc}", ok=False)
    text = reply.get("text") or (f"{change} ({reply.get('tier', '?')}) planned for "
                                 f"step {reply.get('at_step', '?')}")
    return ToggleAnswer(f"toggle #{reply.get('id', '?')}: {text}", ok=True)


def toggle_on_hub(address: HubAddress | None, name: str, value: str,
                  restart: bool) -> dict[str, Any]:
    """A flag change sent to the live hub's control socket (the app's default sender)."""
    if address is None:
        raise ControlError(NO_HUB_FLAGS)
    controller = Controller(address, timeout_s=5.0)
    try:
        return controller.toggle(name, value, restart=restart)
    finally:
        controller.close()
