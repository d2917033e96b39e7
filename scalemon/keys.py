"""CurveZMQ keys for hubs and clients that talk over TCP (pyzmq's zmq.auth; no own crypto).

Layout (`$SCALEMON_HOME/keys`, mode 0700, this user's only)::

    keys/user.key  user.key_secret    the user's keypair: clients and agents (secret 0600)
    keys/hub.key   hub.key_secret     the keypair this user's hubs serve TCP with (secret 0600)
    keys/authorized                   public keys (z85) a hub admits: one a line, '#' comments

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
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from scalemon.jobs import NotOwnedError, jobs_dir, private_dir, scalemon_home

HUB_KEY_ENV = "SCALEMON_HUB_KEY"
AUTHORIZED = "authorized"
ZAP_DOMAIN = "scalemon"
_Z85_KEY_LEN = 40


class KeyFileError(ValueError):
    """A key file or the keys directory is unusable; the text says which and what to do."""


class NoServerKey(KeyFileError):
    """A tcp endpoint whose hub public key is not known: no connection is made."""


@dataclass(frozen=True)
class Keypair:
    """A Curve keypair, both halves z85-encoded (40 ASCII bytes)."""

    public: bytes
    secret: bytes


def keys_dir(home: Path | None = None) -> Path:
    """`$SCALEMON_HOME/keys`, created 0700 and checked to be this user's."""
    home = home or scalemon_home()
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
        text = ("# public keys (z85) of the clients and agents this user's hubs admit over "
                "TCP,\n# one a line; '#' starts a comment. The first is your own.\n"
                f"{own}\n")
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)  # never replaces one made meanwhile
        tmp.unlink()
    return path


def parse_authorized(text: str, where: str = AUTHORIZED) -> set[bytes]:
    """The z85 public keys of an `authorized` file's text; KeyFileError names a bad line."""
    keys: set[bytes] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()  # '#' is a z85 character: comments start a line or follow a blank
        if not line or line.startswith("#"):
            continue
        line = line.split()[0]
        if not valid_z85_key(line):
            raise KeyFileError(
                f"{where} line {number}: {line[:60]!r} is not a Curve public key (40 z85 "
                "characters, as in a .key file's public-key): fix or remove the line, or "
                "comment it out with '#'")
        keys.add(line.encode())
    return keys


def load_authorized(home: Path | None = None) -> set[bytes]:
    """The public keys a hub of this home admits."""
    path = authorized_file(home)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise KeyFileError(f"{path} can be changed by others (owner uid {info.st_uid}, mode "
                        f"{stat.S_IMODE(info.st_mode):04o}): anyone could admit themselves. "
                        f"Make it yours and `chmod 600 {path}`")
    return parse_authorized(path.read_text(), str(path))


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
        ("the explicit server key", explicit), (HUB_KEY_ENV, os.environ.get(HUB_KEY_ENV))]
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
        f"hub's public key. Set {HUB_KEY_ENV} to the `server_key` of the hub's job file "
        f"($SCALEMON_HOME/jobs/<job>.json on its host), or use the same SCALEMON_HOME as the "
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


def secure_server(sock: zmq.Socket, keys: Keypair) -> None:
    """Make `sock` a Curve server whose clients the ZAP handler must admit (bind afterwards);
    with no handler running every handshake fails (ZAP_ENFORCE_DOMAIN), never admits."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
