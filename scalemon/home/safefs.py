"""Nothing trusted from the file system: scalemon's directories and job files are checked
for owner (this user) and mode (not writable by group or others), and opened without following
symbolic links; anything else is refused with the path and what is wrong, never chmod-ed or
written through.

A shared, writable `$SCALEMON_HOME` is where this matters: another user could otherwise make
`run/<job>` a link into a directory of theirs (or of a third user) and have the hub chmod it and
write there, or own `run/` and put sockets there that impersonate the hub.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from scalemon import settings

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FIX = "set SCALEMON_HOME (or SCALEMON_RUNTIME_DIR) to a private directory of yours"


class UnsafePathError(PermissionError):
    """A path scalemon would use is not safely this user's; the text says which and what to
    do."""


class NotOwnedError(UnsafePathError):
    """A directory or file scalemon would use belongs to another user."""


def user_name(uid: int) -> str:
    """`name (uid N)`, or `uid N` for an unknown user."""
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def check_stat(path: Path, info: os.stat_result, kind: str = "directory") -> None:
    """Raise UnsafePathError unless `info` (of `path`) is a `kind` ("directory" or "file")
    of this user, not writable by group or others."""
    is_kind = stat.S_ISDIR if kind == "directory" else stat.S_ISREG
    if stat.S_ISLNK(info.st_mode):
        raise UnsafePathError(f"{path} is a symbolic link ({_link_text(path)}): scalemon does "
                              f"not follow links there. Remove it, or {_FIX}")
    if not is_kind(info.st_mode):
        raise UnsafePathError(f"{path} is not a {kind}: remove it, or {_FIX}")
    if info.st_uid != os.getuid():
        raise NotOwnedError(
            f"{path} belongs to {user_name(info.st_uid)}, not to you "
            f"({user_name(os.getuid())}): scalemon keeps each job's sockets and history in a "
            f"directory of its own user. Remove it (or ask its owner to), or {_FIX}")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        raise UnsafePathError(
            f"{path} is writable by {_whom(mode)} (mode "
            f"{mode:o}): another user could replace what scalemon keeps there. Make it private "
            f"(chmod go-w {path}), remove it, or {_FIX}")


def _whom(mode: int) -> str:
    return " and ".join(w for w, bit in (("its group", 0o020), ("others", 0o002)) if mode & bit)


def _link_text(path: Path) -> str:
    try:
        return f"to {os.readlink(path)}"
    except OSError:
        return "unreadable"


def _open_dir(path: Path, name: str | None = None, dir_fd: int | None = None,
              follow: bool = False) -> int:
    """Open a directory without following a link (`follow`: only for the top of the tree,
    where a link of this user's own is accepted); raises UnsafePathError for a link."""
    flags = _DIR_FLAGS & ~os.O_NOFOLLOW if follow else _DIR_FLAGS
    try:
        return os.open(name if name is not None else path, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            info = os.lstat(path)
            check_stat(path, info)  # raises: a link, or not a directory
        raise


def _check_top(top: Path) -> int:
    """Open the top of scalemon's tree (the home, the runtime directory): a link there is
    accepted only when the link itself is this user's; the directory must be too."""
    info = os.lstat(top)
    if stat.S_ISLNK(info.st_mode) and info.st_uid != os.getuid():
        raise NotOwnedError(f"{top} is a symbolic link ({_link_text(top)}) made by "
                            f"{user_name(info.st_uid)}, not by you: remove it, or {_FIX}")
    fd = _open_dir(top, follow=stat.S_ISLNK(info.st_mode))
    try:
        check_stat(top, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_dir(path: Path, top: Path | None = None) -> Path:
    """Create `path` (mode 0700) and the directories between `top` and it, checking each from
    `top` down: this user's, not writable by group or others, no symbolic link (`top` itself
    may be a link of this user's). `path` is made 0700 when it is this user's; nothing refused
    is ever chmod-ed. `top` defaults to the scalemon home or runtime directory `path` is in,
    else `path` itself. Missing directories above `top` are created 0700."""
    path = Path(os.path.abspath(path))
    if top is None:
        top = _default_top(path)
    top = Path(os.path.abspath(top))
    if top != path and top not in path.parents:
        raise ValueError(f"{path} is not inside {top}")
    missing = []
    parent = top
    while not os.path.lexists(parent) and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made by another process meanwhile
            directory.mkdir(mode=0o700)
    fd = _check_top(top)
    try:
        current = top
        for name in path.relative_to(top).parts:
            current = current / name
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=fd)
            child = _open_dir(current, name, dir_fd=fd)
            os.close(fd)
            fd = child
            check_stat(current, os.fstat(fd))
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o700:
            os.fchmod(fd, 0o700)  # this user's, checked above, and not through a link
    finally:
        os.close(fd)
    return path


def check_dir(path: Path, own_link: bool = False) -> None:
    """Raise UnsafePathError unless `path` is a directory of this user's (not a link), not
    writable by group or others; FileNotFoundError when it is missing. `own_link`: a link
    that is itself this user's is followed (a shared `jobs/` or `keys/` linked from a
    node-local home), and the directory it leads to is checked."""
    info = os.lstat(path)
    if own_link and stat.S_ISLNK(info.st_mode):
        if info.st_uid != os.getuid():
            raise NotOwnedError(f"{path} is a symbolic link ({_link_text(path)}) made by "
                                f"{user_name(info.st_uid)}, not by you: remove it, or {_FIX}")
        info = os.stat(path)
    check_stat(path, info)


def _default_top(path: Path) -> Path:
    for top in (settings.scalemon_home(), settings.runtime_dir()):
        top = Path(os.path.abspath(top))
        if top == path or top in path.parents:
            return top
    return path


def read_private(path: Path) -> bytes:
    """The bytes of `path`, a regular file of this user's (not writable by group or others),
    opened without following a link; UnsafePathError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            check_stat(path, os.lstat(path), "file")
        raise
    with os.fdopen(fd, "rb") as f:
        check_stat(path, os.fstat(fd), "file")
        return f.read()


def write_private(path: Path, data: bytes) -> None:
    """Atomically replace `path` with `data` (mode 0600), never writing through a link."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
