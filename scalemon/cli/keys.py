"""`scalemon keys`: this user's Curve key to hand over, and the keys this user's hubs admit
over TCP, each with a role (`rank`, `watch`, `control`; `scalemon.home.keys.ROLES`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from scalemon.home.keys import (
    ROLE_TEXT,
    ROLES,
    KeyFileError,
    add_key,
    hub_keypair,
    load_authorized,
    remove_key,
    user_keypair,
    valid_z85_key,
)
from scalemon.home.lookup import JobLookupError, serving_jobs
from scalemon.home.safefs import NotOwnedError

CUT_WITHIN_S = 2
"""A hub reads `authorized` again at most a second after it changed and cuts at once."""


def add_parsers(sub: Any) -> None:
    """Add the `keys` command and its subcommands to the `scalemon` parser."""
    keys = sub.add_parser(
        "keys", help="your public key, and the keys (with roles) your hubs admit over TCP",
        description="CurveZMQ keys. A hub admits over TCP the keys of "
                    "$SCALEMON_HOME/keys/authorized, each with a role: "
                    + "; ".join(f"{role}: {text}" for role, text in ROLE_TEXT.items())
                    + ". Your own key is control. Hubs read the file again within a second: "
                      "a removed key's live connections are cut.")
    actions = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="print your public key: the line to hand over",
                              description="Print your public key (one line) for the owner "
                                          "of a hub to admit with `scalemon keys add`.")
    show.add_argument("--hub", action="store_true",
                      help="print your hubs' public key instead (what a client elsewhere "
                           "sets as SCALEMON_HUB_KEY)")
    show.set_defaults(func=cmd_show)
    add = actions.add_parser("add", help="admit a key with a role",
                             description="Admit public KEY (40 z85 characters, what `scalemon "
                                         "keys show` printed on the other side) with a role.")
    add.add_argument("key", metavar="KEY")
    add.add_argument("--role", required=True, choices=ROLES,
                     help="; ".join(f"{r}: {t}" for r, t in ROLE_TEXT.items()))
    add.add_argument("--name", required=True,
                     help="who it is (letters, digits, ._@+-): the audit and `keys remove` "
                          "use it")
    add.set_defaults(func=cmd_add)
    listing = actions.add_parser("list", help="the admitted keys: name, role, key")
    listing.add_argument("--json", action="store_true", help="as JSON")
    listing.set_defaults(func=cmd_list)
    remove = actions.add_parser("remove", help="stop admitting a key; its live connections "
                                               "are cut")
    remove.add_argument("name", metavar="NAME")
    remove.set_defaults(func=cmd_remove)


def key_last(argv: list[str]) -> list[str]:
    """`argv` with a key that starts with '-' (z85 allows it) put after `--` for `keys add`,
    so that argparse takes it for KEY, not for an option."""
    if argv[:2] != ["keys", "add"] or "--" in argv:
        return argv
    keys = [a for a in argv[2:] if a.startswith("-") and valid_z85_key(a)]
    rest = [a for a in argv[2:] if a not in keys]
    return [*argv[:2], *rest, "--", *keys] if keys else argv


def cmd_show(args: argparse.Namespace) -> int:
    """Print this user's (or with --hub, this user's hubs') public key."""
    try:
        key = (hub_keypair() if args.hub else user_keypair()).public.decode()
    except (KeyFileError, NotOwnedError, OSError) as exc:
        print(f"scalemon keys: {exc}", file=sys.stderr)
        return 2
    print(key)
    if sys.stdout.isatty():
        hint = ("set it as SCALEMON_HUB_KEY where a client reaches your hubs over TCP"
                if args.hub else "the hub's owner admits it with `scalemon keys add KEY "
                                 "--role watch|control|rank --name NAME`")
        print(f"# {hint}", file=sys.stderr)
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    """Admit a key with a role."""
    try:
        added = add_key(args.key, args.role, args.name)
    except (KeyFileError, NotOwnedError, OSError) as exc:
        print(f"scalemon keys add: {exc}", file=sys.stderr)
        return 2
    print(f"admitted {added.name} (role {added.role}: {ROLE_TEXT[added.role]}); your hubs "
          f"admit it from its next connection")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """Print the admitted keys."""
    try:
        keys = sorted(load_authorized().values(), key=lambda k: (not k.own, k.line))
    except (KeyFileError, NotOwnedError, OSError) as exc:
        print(f"scalemon keys list: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{"name": k.name, "role": k.role, "key": k.key.decode(), "own": k.own,
                           "legacy": k.legacy} for k in keys], indent=1))
        return 0
    width = max([len(k.name) for k in keys] + [4])
    print(f"{'NAME':<{width}}  {'ROLE':<7}  KEY")
    for k in keys:
        note = "  (your own key)" if k.own else (
            "  (no role in the file: read as watch)" if k.legacy else "")
        print(f"{k.name:<{width}}  {k.role:<7}  {k.key.decode()}{note}")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    """Stop admitting a key; the hubs of this home cut its live connections."""
    try:
        gone = remove_key(args.name)
    except (KeyFileError, NotOwnedError, OSError) as exc:
        print(f"scalemon keys remove: {exc}", file=sys.stderr)
        return 2
    try:
        listening = sum(1 for jf in serving_jobs() if jf.tcp)
    except (JobLookupError, OSError, ValueError):
        listening = 0
    print(f"removed {gone.name} (role {gone.role}); {listening} hub(s) of yours listen on TCP "
          f"here: each cuts its live connections within {CUT_WITHIN_S} s and refuses it from "
          "then on")
    return 0
