"""The one pid lock (`scalemon.home.pidlock`) of the hub and the relay: one holder at a time,
the second refused with the holder's pid, released on close; `is_locked` tells from outside."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scalemon.home.pidlock import is_locked, take_lock


class Taken(RuntimeError):
    """Raised by the second taker."""


def _refuse(holder: str) -> Exception:
    return Taken(f"held by pid {holder}")


def test_the_second_taker_is_refused_with_the_holders_pid(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    first = take_lock(path, _refuse)
    try:
        assert path.read_text() == str(os.getpid())  # for people
        with pytest.raises(Taken, match=f"held by pid {os.getpid()}$"):
            take_lock(path, _refuse)
    finally:
        first.close()


def test_the_lock_is_released_on_close(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    take_lock(path, _refuse).close()
    second = take_lock(path, _refuse)  # taken again: the first holder let go
    second.close()


def test_is_locked_says_whether_a_process_holds_it(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    assert not is_locked(path)  # no file: nobody
    assert not path.exists()  # and asking does not make one
    held = take_lock(path, _refuse)
    try:
        assert is_locked(path)
    finally:
        held.close()
    assert not is_locked(path)  # the file stays, the lock went with its holder


def test_a_pid_that_cannot_be_written_does_not_stop_the_taker(tmp_path: Path,
                                                               monkeypatch) -> None:
    errors: list[OSError] = []
    real_open = open

    class FullDisk:
        def __init__(self, f) -> None:
            self._f = f

        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

        def __getattr__(self, name: str):
            return getattr(self._f, name)

    import scalemon.home.pidlock as pidlock

    monkeypatch.setattr(pidlock, "open", lambda *a, **k: FullDisk(real_open(*a, **k)),
                        raising=False)
    held = take_lock(tmp_path / "x.lock", _refuse, on_write_error=errors.append)
    monkeypatch.undo()
    try:
        assert [e.errno for e in errors] == [28]
        assert is_locked(tmp_path / "x.lock")
    finally:
        held.close()
