"""CurveZMQ keys for hubs and clients that talk over TCP (pyzmq's zmq.auth; no own crypto).

Layout (`$SCALEMON_HOME/keys`, mode 0700, this user's only)::

    keys/user.key  user.key_secret    the user's keypair: clients and agents (secret 0600)
    keys/hub.key   hub.key_secret     the keypair this user's hubs serve TCP with (secret 0600)
    keys/authorized                   the keys a hub admits: `KEY role=ROLE name=NAME` a line,
                                      '#' comments (see ROLES; `scalemon keys` manages it)

Both keypairs are made on first use, in the certificate format `zmq.auth.load_certificate`
reads; `authorized` is made holding the user's own public key (ssh-style).

A client connecting a tcp endpoint needs the hub's public key: given explicitly, else
`SCALEMON_HUB_KEY`, else the `server_key` of a job file of this home naming that endpoint, else
this home's own hub key (a hub of this user sharing the home). Without one it refuses to
connect (`NoServerKey`): there is never a plaintext TCP connection.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import getpass
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from scalemon import settings
from scalemon.home.paths import jobs_dir
from scalemon.home.safefs import NotOwnedError, private_dir

HUB_KEY_ENV = "SCALEMON_HUB_KEY"
AUTHORIZED = "authorized"
ZAP_DOMAIN = "scalemon"
_Z85_KEY_LEN = 40
ROLES = ("rank", "watch", "control")
"""What a key may do: `rank` sends a job's metrics and answers its commands (agents, relays);
`watch` reads jobs (snapshot, attach, jobs); `control` does both and steers the job (toggles,
Flight Recorder dumps, stop). The user's own key is `control`."""
ROLE_TEXT = {
    "rank": "send metrics and answer the job's commands (agents, relays)",
    "watch": "read jobs (jobs, snapshot, attach, flags)",
    "control": "everything: read, send, toggle flags, dump, stop",
}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,63}")
NAME_RULE = ("is not a key name: 1 to 64 letters, digits or ._@+- , starting with a letter or "
             "digit")


class KeyFileError(ValueError):
    """A key file or the keys directory is unusable; the text says which and what to do."""


class NoServerKey(KeyFileError):
    """A tcp endpoint whose hub public key is not known: no connection is made."""


@dataclass(frozen=True)
class AuthorizedKey:
    """A key of `authorized`: who it is (`name`), what it may do (`role`, one of ROLES)."""

    key: bytes
    role: str
    name: str
    line: int = 0
    legacy: bool = False  # a line without a role (read as `watch`)
    own: bool = False  # the user's own key (always `control`)


@dataclass(frozen=True)
class Keypair:
    """A Curve keypair, both halves z85-encoded (40 ASCII bytes)."""

    public: bytes
    secret: bytes


def keys_dir(home: Path | None = None) -> Path:
    """`$SCALEMON_HOME/keys`, created 0700 and checked to be this user's."""
    home = home or settings.scalemon_home()
    path = private_dir(home / "keys", top=home / "keys")  # a link of this user's is allowed
    return path


def _check_secret_file(path: Path) -> None:
    """Refuse a secret key file of another user or readable by group or others."""
    info = path.stat()
    if info.st_uid != os.getuid():
        raise NotOwnedError(
            f"{path} belongs to uid {info.st_uid}, not to you: remove it (a new key is made on "
            "next use) or point SCALEMON_HOME at a directory of yours")
    if info.st_mode & 0o077:
        raise KeyFileError(
            f"{path} is readable by others (mode {stat.S_IMODE(info.st_mode):04o}): anyone "
            "who read it can pose as you. Remove it (a new key is made on next use) and "
            "re-admit the new public key where the old one was authorized, or, if no one else "
            f"could read it, `chmod 600 {path}`")


def _write_cert(path: Path, public: bytes, secret: bytes | None) -> None:
    """Write a zmq certificate file (the `zmq.auth.create_certificates` format) created
    0600 from the start (no window in which it is readable by others)."""
    lines = [f"#   ZeroMQ CURVE {'Secret' if secret else 'Public'} Certificate",
             f"#   made by scalemon {datetime.datetime.now():%Y-%m-%d %H:%M:%S}", "",
             "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)


def load_or_create(name: str, home: Path | None = None) -> Keypair:
    """The keypair `name` ("user" or "hub") of this home, made on first use."""
    directory = keys_dir(home)
    secret_file = directory / f"{name}.key_secret"
    if not secret_file.exists():
        public, secret = zmq.curve_keypair()
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            _write_cert(directory / f"{name}.key", public, None)
            _write_cert(secret_file, public, secret)
    _check_secret_file(secret_file)
    try:
        public, secret = zmq.auth.load_certificate(secret_file)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"unreadable key file {secret_file}: {exc}; remove it (a new key is "
                        "made on next use)") from None
    if secret is None or len(public) != _Z85_KEY_LEN or len(secret) != _Z85_KEY_LEN:
        raise KeyFileError(f"{secret_file} holds no valid Curve keypair: remove it (a new key is "
                        "made on next use)")
    return Keypair(public, secret)


def user_keypair(home: Path | None = None) -> Keypair:
    """The user's own keypair (clients and agents)."""
    keys = load_or_create("user", home)
    authorized_file(home)  # first use: the user's key is admitted
    return keys


def hub_keypair(home: Path | None = None) -> Keypair:
    """The keypair this user's hubs serve TCP with."""
    return load_or_create("hub", home)


def authorized_file(home: Path | None = None) -> Path:
    """`keys/authorized`, made holding the user's own public key when missing."""
    path = keys_dir(home) / AUTHORIZED
    if not path.exists():
        own = load_or_create("user", home).public.decode()
        text = (f"{AUTHORIZED_HEADER}{own} role=control name={_own_name()}\n")
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)  # never replaces one made meanwhile
        tmp.unlink()
    return path


AUTHORIZED_HEADER = (
    "# The keys this user's hubs admit over TCP, one a line: KEY role=ROLE name=NAME\n"
    "# roles: rank (agents, relays), watch (read only), control (read and steer).\n"
    "# '#' starts a comment. The first key is your own. `scalemon keys` manages this file.\n")


def add_key(key: str, role: str, name: str, home: Path | None = None) -> AuthorizedKey:
    """Admit public `key` with `role` under `name`; KeyFileError says why not (a bad key, role
    or name, or a key or name already there). Hubs of this home read it again within a
    second."""
    key = key.strip()
    if not valid_z85_key(key):
        raise KeyFileError(f"{key[:60]!r} is not a Curve public key (40 z85 characters): ask "
                           "for the line `scalemon keys show` prints on the other side")
    if role not in ROLES:
        raise KeyFileError(f"role {role!r} is not one of {', '.join(ROLES)}")
    if not valid_key_name(name):
        raise KeyFileError(f"{name[:64]!r} {NAME_RULE}")
    with _authorized_lock(home) as path:
        current = load_authorized(home)
        for known in current.values():
            if known.key == key.encode():
                raise KeyFileError(f"that key is already admitted as {known.name!r} (role "
                                   f"{known.role}); `scalemon keys remove {known.name}` first "
                                   "to give it another role")
            if known.name == name:
                raise KeyFileError(f"a key named {name!r} is already admitted; choose another "
                                   "name or remove that one first")
        text = path.read_text()
        if text and not text.endswith("\n"):
            text += "\n"
        _rewrite(path, text + f"{key} role={role} name={name}\n")
    return AuthorizedKey(key.encode(), role, name)


def remove_key(name: str, home: Path | None = None) -> AuthorizedKey:
    """Take the key named `name` out of `authorized` (every line of that key); returns it.
    KeyFileError for an unknown name or the user's own key."""
    with _authorized_lock(home) as path:
        current = load_authorized(home)
        match = [k for k in current.values() if k.name == name]
        if not match:
            names = ", ".join(sorted(k.name for k in current.values())) or "none"
            raise KeyFileError(f"no admitted key is named {name!r} (admitted: {names}); "
                               "`scalemon keys list` shows them")
        gone = match[0]
        if gone.own:
            raise KeyFileError(f"{name!r} is your own key: your agents and dashboards use it "
                               "to reach your hubs over TCP, so it cannot be removed")
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if line.strip().split()[:1] != [gone.key.decode()]]
        _rewrite(path, "".join(kept))
    return gone


@contextlib.contextmanager
def _authorized_lock(home: Path | None):  # noqa: ANN202 - a context manager
    """Hold `keys/authorized.lock` while the file is read and rewritten (no lost update)."""
    path = authorized_file(home)
    fd = os.open(path.with_name(AUTHORIZED + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield path
    finally:
        os.close(fd)


def _rewrite(path: Path, text: str) -> None:
    """Replace `path` with `text` at once (a reader sees the old or the new file), 0600."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def parse_authorized(text: str, where: str = AUTHORIZED,
                     own: bytes | None = None) -> dict[bytes, AuthorizedKey]:
    """The keys of an `authorized` file's text by public key; KeyFileError names a bad line.

    A line is `KEY [role=ROLE] [name=NAME]`; other text after the key is a comment. `own` (the
    user's own public key) is `control` whatever its line says; another key without a role is
    `watch` (its `legacy` flag set: written before keys had roles)."""
    keys: dict[bytes, AuthorizedKey] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split()  # '#' is a z85 character, but never a key's first (85**4 *
        if not words or words[0].startswith("#"):  # 83 > 2**32): comments start with it
            continue
        if not valid_z85_key(words[0]):
            raise KeyFileError(
                f"{where} line {number}: {words[0][:60]!r} is not a Curve public key (40 z85 "
                "characters, as in a .key file's public-key): fix or remove the line, or "
                "comment it out with '#'")
        key = words[0].encode()
        fields: dict[str, str] = {}
        for word in words[1:]:
            if word.startswith("#"):
                break
            label, sep, value = word.partition("=")
            if sep and label in ("role", "name"):
                fields[label] = value
        role = fields.get("role")
        if role is not None and role not in ROLES:
            raise KeyFileError(f"{where} line {number}: role {role[:40]!r} is not one of "
                               f"{', '.join(ROLES)}: fix the line (`scalemon keys add` writes "
                               "it right)")
        name = fields.get("name") or (
            _own_name() if key == own else "key-" + zmq.utils.z85.decode(key)[:4].hex())
        if not valid_key_name(name):
            raise KeyFileError(f"{where} line {number}: name {name[:40]!r} {NAME_RULE}")
        if key == own:
            role = "control"
        if key not in keys:  # the first line of a key counts
            keys[key] = AuthorizedKey(key, role or "watch", name, number,
                                      legacy=role is None and key != own, own=key == own)
    return keys


def load_authorized(home: Path | None = None) -> dict[bytes, AuthorizedKey]:
    """The keys a hub of this home admits, with their roles."""
    path = authorized_file(home)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise KeyFileError(f"{path} can be changed by others (owner uid {info.st_uid}, mode "
                        f"{stat.S_IMODE(info.st_mode):04o}): anyone could admit themselves. "
                        f"Make it yours and `chmod 600 {path}`")
    return parse_authorized(path.read_text(), str(path), own_public_key(home))


def own_public_key(home: Path | None = None) -> bytes | None:
    """This user's own public key (keys/user.key), None while it does not exist."""
    path = keys_dir(home) / "user.key"
    try:
        return zmq.auth.load_certificate(path)[0]
    except (OSError, ValueError):
        return None


def valid_key_name(name: str) -> bool:
    """True for a key name `keys add` accepts (see NAME_RULE)."""
    return bool(_NAME.fullmatch(name))


def _own_name() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid{os.getuid()}"
    return user if valid_key_name(user) else "owner"


def valid_z85_key(text: str) -> bool:
    """True for a 40-character z85 string that decodes to a 32-byte key."""
    if len(text) != _Z85_KEY_LEN:
        return False
    try:
        return len(zmq.utils.z85.decode(text.encode())) == 32
    except (ValueError, KeyError, TypeError):
        return False


def server_key_for(endpoint: str, explicit: str | bytes | None = None,
                   home: Path | None = None) -> bytes:
    """The public key of the hub behind tcp `endpoint` (see the module text for the order)."""
    candidates: list[tuple[str, str | bytes | None]] = [
        ("the explicit server key", explicit), (HUB_KEY_ENV, settings.raw(HUB_KEY_ENV))]
    for source, key in candidates:
        if key:
            text = key.decode() if isinstance(key, bytes) else key
            if not valid_z85_key(text.strip()):
                raise NoServerKey(f"{source} {text[:60]!r} is not a Curve public key (40 z85 "
                                  "characters): use the `server_key` of the hub's job file")
            return text.strip().encode()
    from_job = _job_file_key(endpoint, home)
    if from_job:
        return from_job
    own = keys_dir(home) / "hub.key"
    if own.exists():
        with contextlib.suppress(OSError, ValueError):
            return zmq.auth.load_certificate(own)[0]
    raise NoServerKey(
        f"no server key for {endpoint}: scalemon talks TCP only with CurveZMQ and needs the "
        f"hub's public key. Set {HUB_KEY_ENV} to what `scalemon keys show --hub` prints on "
        "the hub's host (its job file's `server_key`), or use the same SCALEMON_HOME as the "
        "hub")


def _job_file_key(endpoint: str, home: Path | None) -> bytes | None:
    """`server_key` of a job file of this home that lists `endpoint` among its tcp ones."""
    import json

    directory = jobs_dir(home)
    if not directory.is_dir():
        return None
    for path in sorted(directory.glob("*.json"), key=lambda p: -p.stat().st_mtime):
        with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
            data = json.loads(path.read_text())
            tcp = data.get("tcp") or {}
            key = data.get("server_key")
            if key and endpoint in tcp.values() and valid_z85_key(key):
                return key.encode()
    return None


def secure_client(sock: zmq.Socket, endpoint: str, server_key: str | bytes | None = None,
                  home: Path | None = None) -> None:
    """Make `sock` a Curve client when `endpoint` is tcp (before connecting it); ipc and
    inproc endpoints are left as they are. Raises NoServerKey rather than go plaintext."""
    if not endpoint.startswith("tcp://"):
        return
    server = server_key_for(endpoint, server_key, home)
    own = user_keypair(home)
    sock.curve_secretkey = own.secret
    sock.curve_publickey = own.public
    sock.curve_serverkey = server


def secure_server(sock: zmq.Socket, keys: Keypair, domain: str = ZAP_DOMAIN) -> None:
    """Make `sock` a Curve server whose clients the ZAP handler must admit for `domain` (bind
    afterwards); with no handler running every handshake fails (ZAP_ENFORCE_DOMAIN)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    sock.zap_domain = domain.encode()
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
