"""`scalemon flags` and `scalemon toggle`: the flags of a running job, and changing one."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from scalemon import protocol
from scalemon.flags import FlagError, check, parse_assignment, tier_text
from scalemon.home.lookup import JobLookupError, resolve_hub
from scalemon.link.client import HubClient, HubUnreachable
from scalemon.link.control import ControlError, Controller, log_count_wait
from scalemon.options import add_hub_timeout, add_query_arguments, seconds
from scalemon.state.flagstate import log_count_text, toggle_line

EXIT_REFUSED = 3
EXIT_NOT_APPLIED = 4
TOGGLE_REFUSALS = """\
The hub refuses a toggle (exit 3, the reason said, the refusal audited) when:
  - NAME is not among the flags scalemon changes (`scalemon flags JOB` lists them), or VALUE
    is not one the flag accepts (docs/flags.md);
  - another toggle of the job is still under way (wait for it: `scalemon flags JOB`);
  - no rank of the job is running;
  - the flag needs a restart (or --restart was given) and a rank cannot checkpoint and be
    restarted: the job needs --ckpt-dir and torchrun --max-restarts >= 1;
  - the asker may not steer the job: from another machine, a key of role control is needed
    (the job's owner runs `scalemon keys add KEY --role control --name NAME`).
"""


def add_parsers(sub: Any) -> None:
    """Add the `flags` and `toggle` commands to the `scalemon` parser."""
    flags = sub.add_parser(
        "flags", help="the job's NCCL/torch flags: tier and value per rank",
        description="The job's NCCL and torch flags: each one's tier (when a change takes "
                    "effect), its value on every rank, mismatches; then the last toggles.")
    add_query_arguments(flags)
    flags.set_defaults(func=cmd_flags)

    toggle = sub.add_parser(
        "toggle", help="change a flag on every rank at the same step, and wait until it is in "
                       "effect",
        description="Change NAME on every rank of the job at one step boundary (NAME= unsets). "
                    "Exit status: 0 in effect on every rank, 3 refused, 4 not in effect on "
                    "every rank in time, 2 no hub.",
        epilog=TOGGLE_REFUSALS)
    toggle.add_argument("words", nargs="+", metavar="[JOB] NAME=VALUE",
                        help="the flag and its new value, after the job id or hub address "
                             "(default: the live job)")
    toggle.add_argument("--restart", action="store_true",
                        help="restart the job with the value (checkpoint, torchrun restart) "
                             "whatever the flag's tier: every group gets it")
    toggle.add_argument("--wait", type=seconds(0.0), default=180.0, metavar="S",
                        help="seconds to wait for every rank to apply it")
    add_hub_timeout(toggle)
    toggle.set_defaults(func=cmd_toggle)


def cmd_flags(args: argparse.Namespace) -> int:
    """Print the flags panel: tier, why, value per rank, mismatches; and the toggles."""
    try:
        job, address = resolve_hub(args.target)
        state = HubClient(address, timeout_s=args.timeout).state()["state"]
    except (JobLookupError, HubUnreachable, ValueError, protocol.ProtocolError) as exc:
        print(f"scalemon flags: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"flags": state["flags"], "toggles": state["toggles"]}, indent=1))
        return 0
    print(format_flags(state))
    return 0


def format_flags(state: dict[str, Any]) -> str:
    """The panel as text: a row per flag, then the last toggles."""
    rows = state.get("flags") or []
    width = max((len(r["name"]) for r in rows), default=10)
    lines = [f"job {state['job']}: flags in effect (tier: when a change takes effect)"]
    for row in rows:
        values = row["values"]
        distinct = set(values.values())
        if len(distinct) <= 1:
            shown = _value(next(iter(distinct), None)) + (" (all ranks)" if values else "")
        else:
            shown = " ".join(f"{r}:{_value(v)}" for r, v in values.items())
        mark = "  MISMATCH" if row["mismatch"] else ""
        lines.append(f"  {row['name']:<{width}}  {tier_text(row['tier']):<8}  {shown}{mark}")
        lines.append(f"  {'':<{width}}  {'':<8}  why: {row['why']}")
    toggles = state.get("toggles") or []
    if toggles:
        lines.append("toggles:")
        for t in toggles[-10:]:
            lines.append("  " + toggle_line(t))
    return "\n".join(lines)


def _value(value: str | None) -> str:
    return "unset" if value is None else value


def _split_words(words: list[str]) -> tuple[str | None, str]:
    if len(words) == 1:
        return None, words[0]
    if len(words) == 2:
        return words[0], words[1]
    raise FlagError("expected [JOB] NAME=VALUE (one flag per toggle)")


def cmd_toggle(args: argparse.Namespace) -> int:
    """Change a flag and wait until every rank reports it in effect (or say who did not)."""
    try:
        target, assignment = _split_words(args.words)
        name, value = parse_assignment(assignment)
    except FlagError as exc:
        print(f"scalemon toggle: refused: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    try:  # the hub decides (and audits) whether to make it; this is said if it cannot
        check(name, value)
        local_refusal = None
    except FlagError as exc:
        local_refusal = f"scalemon toggle: refused: {exc}"
    try:
        job, address = resolve_hub(target)
        control = Controller(address, timeout_s=args.timeout)
    except (JobLookupError, ValueError, ControlError) as exc:
        print(local_refusal or f"scalemon toggle: {exc}", file=sys.stderr)
        return EXIT_REFUSED if local_refusal else 2
    try:
        reply = control.toggle(name, value, restart=args.restart)
    except HubUnreachable as exc:
        print(local_refusal or f"scalemon toggle: {exc}", file=sys.stderr)
        return EXIT_REFUSED if local_refusal else 2
    except protocol.ProtocolError as exc:
        print(f"scalemon toggle: {str(exc).removeprefix('hub refused the request: ')}",
              file=sys.stderr)
        return EXIT_REFUSED
    print(f"toggle #{reply['id']}: {reply['text']}", flush=True)
    try:
        final = control.wait_toggle(reply["id"], args.wait)
        if final is not None and final.get("state") in ("applied", "partial"):
            final = control.wait_log_counts(final, log_count_wait(final))
    except (HubUnreachable, protocol.ProtocolError) as exc:
        print(f"scalemon toggle: lost the hub while waiting: {exc}", file=sys.stderr)
        return EXIT_NOT_APPLIED
    finally:
        control.close()
    counted = log_count_text(final) if final is not None else None
    if final is None or final.get("state") not in ("applied", "restarted"):
        state = final.get("state") if final else "not seen"
        text = final.get("text") if final else ""
        print(f"scalemon toggle: #{reply['id']} {state} after {args.wait:g} s: {text}",
              file=sys.stderr)
        if counted:
            print(f"scalemon toggle: {counted}", file=sys.stderr)
        return EXIT_NOT_APPLIED
    print(f"toggle #{final['id']}: {final['state']}: {final.get('text') or ''}")
    if counted:
        print(f"toggle #{final['id']}: {counted}")
    return 0
