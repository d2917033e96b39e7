"""Reading the errors ranks die with: which rank failed first, which only lost a peer.

When one rank of a job dies, its peers fail too, a moment later, in their next collective
("Connection closed by peer", "NCCL communicator was aborted"...). Every rank then shows
`exited 1`; what a person needs is the first rank that failed for a reason of its own. These
rules are shared by the hub, the dashboard and `scalemon snapshot`.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scalemon.text.ranks import ranks_text

PEER_LOSS_PATTERNS: tuple[re.Pattern[str], ...] = tuple(re.compile(p, re.IGNORECASE) for p in (
    r"connection closed by peer",
    r"connection reset by peer",
    r"broken pipe",
    r"remote worker crash",
    r"remote process exited",
    r"remote peer",
    r"communicator was aborted",
    r"NCCL communicator .* aborted",
    r"ncclRemoteError",
    r"socket timeout",
    r"DistNetworkError",
    r"failed to recv, got 0 bytes",
    r"read error .* connection",
    r"Rank \d+ .*(died|crashed|exited)",
))
"""Error texts of a rank that failed because another one went away."""

CALLBACK_WRAPPER = "Got the following error when running the callback: "
"""torch's prefix for an error raised inside a Future callback (DDP comm hooks run in one)."""


SIGNAL_REASON = "signal"
"""The `exit` reason of a rank ended by a signal (agent/sigexit.py); its code: 128 + the number."""
GUESS = " (killed?)"
"""What the hub adds to a rank whose process ended without an exit: a guess at why."""


def signal_text(body: Mapping[str, Any]) -> str | None:
    """"ended by SIGTERM, exit 143": how a rank that sent an `exit` with the reason "signal"
    ended; None for any other exit."""
    if body.get("reason") != SIGNAL_REASON:
        return None
    code = body.get("exit_code")
    try:
        return f"ended by {signal.Signals(code - 128).name}, exit {code}"
    except (TypeError, ValueError):
        return "ended by a signal"


def without_guess(reason: str | None) -> str | None:
    """The hub's reason for a rank gone, without its guess at why (the user stopped it)."""
    return reason[:-len(GUESS)] if reason and reason.endswith(GUESS) else reason


def is_peer_loss(error: str | None) -> bool:
    """True when `error` reads like the consequence of a peer's death, not a cause."""
    return bool(error) and any(p.search(error) for p in PEER_LOSS_PATTERNS)


def first_line(error: str | None, width: int = 200) -> str:
    """The first non-blank line of an error, cut to `width` characters."""
    for line in (error or "").splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= width else line[:width - 1] + "…"
    return ""


def clean_error(text: str, own_dirs: tuple[Path, ...]) -> str:
    """`text` without what the monitor itself added: torch's callback wrapper around an error
    that merely passed through scalemon's comm hook, and the `At:` stack lines of frames in
    `own_dirs` (scalemon's package). Frames of other code are kept."""
    out = text
    if CALLBACK_WRAPPER in out:
        # "RuntimeError: Got the following error ...: RuntimeError: <the real error>"
        out = out[out.index(CALLBACK_WRAPPER) + len(CALLBACK_WRAPPER):]
    roots = tuple(str(d) + "/" for d in own_dirs)
    kept = [line for line in out.splitlines()  # "  /path/scalemon/agent/timing.py(209): _done"
            if not (roots and line.strip().startswith(roots)
                    and re.search(r"\(\d+\): \S+$", line.strip()))]
    # an "At:" heading left with no frame under it goes too
    kept = [line for line, after in zip(kept, [*kept[1:], ""], strict=True)
            if not (line.strip() == "At:" and not after.strip())]
    return "\n".join(kept).strip() + ("\n" if text.endswith("\n") else "")


def failure_text(rank: int, step: int | None, why: str, peer_loss: list[int]) -> str:
    """"rank 1 failed first (step 30): InjectedCrash: ...; rank 0 failed after losing a peer"."""
    at = f" (step {step})" if step is not None else ""
    text = f"rank {rank} failed first{at}: {why}"
    if peer_loss:
        text += f"; {ranks_text(peer_loss)} failed only because a peer went away"
    return text
