"""The seed: the hub's `JobFold` of its history up to some record, for a dashboard that attaches
late, so that attaching costs what the fold holds (bounded) instead of the whole history.

It is a pickle (the fold is a graph of the reducer's objects, shared deques included, and
pickle keeps that graph as it is, in C), read back by an unpickler that builds only the
fold's own classes and a few containers (`ALLOWED`): a seed cannot name any other callable,
so it cannot run code, whoever wrote it. A seed of another `FORMAT` or scalemon version is
refused (the dashboard then replays the history instead).
"""

from __future__ import annotations

import copyreg
import io
import pickle
from array import _array_reconstructor, array
from collections import deque
from typing import Any

import scalemon
from scalemon.collectives import CollectiveStats, P2PRow, P2PStats, StatRow
from scalemon.collector import collector_paused
from scalemon.state.arrival import ArrivalTracker
from scalemon.state.flagstate import FlagState, LogLine, RankFlags
from scalemon.state.fold import JobFold, RankTrack, StepAcc
from scalemon.state.jobstate import JobState, RankView
from scalemon.state.series import Marks, Series
from scalemon.throughput import TokenWindow

FORMAT = 1
MAX_SEED_BYTES = 60 << 20
"""A larger seed is not offered (the dashboard replays instead): replies stay under the
protocol's MAX_REPLY_BYTES (64 MiB). A 16,384-rank job with collectives made 39 MB in 25 s,
and more as its ranks' lateness and heat fill up (`state.arrival`'s budgets)."""

_OWN = (JobFold, JobState, RankView, CollectiveStats, StatRow, ArrivalTracker, FlagState,
        RankFlags, LogLine, RankTrack, StepAcc, Series, Marks, P2PStats, P2PRow, TokenWindow)
ALLOWED: dict[tuple[str, str], Any] = {
    **{(cls.__module__, cls.__qualname__): cls for cls in _OWN},
    ("collections", "deque"): deque,
    ("array", "array"): array,
    ("array", "_array_reconstructor"): _array_reconstructor,
}
"""Everything a seed may build, by (module, name)."""


class SeedError(ValueError):
    """A seed that cannot be used; the text says why."""


def _deque(d: deque) -> tuple[type[deque], tuple[list[Any], int | None]]:
    return deque, (list(d), d.maxlen)


_REDUCERS = {**copyreg.dispatch_table, deque: _deque}
"""A deque as its items and length: the default way asks `copyreg._slotnames` of a deque
every time (a built-in class keeps no answer), some 14 us each, half a 16,384-rank seed's
time."""


def dump(fold: JobFold) -> bytes:
    """The seed of `fold`."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=5)
    pickler.dispatch_table = _REDUCERS
    with collector_paused():
        pickler.dump({"format": FORMAT, "scalemon": scalemon.__version__, "fold": fold})
    return out.getvalue()


def unpickle_only(blob: bytes, allowed: dict[tuple[str, str], Any],
                  error: type[ValueError], what: str) -> Any:
    """Unpickle `blob`, building only the classes `allowed` names; raises `error` (never
    another error) for a damaged blob or one that names anything else (`what` it is)."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found = allowed.get((module, name))
            if found is None:
                raise error(f"the {what} names {module}.{name}, which a {what} may not hold")
            return found

    try:  # a 16,384-rank fold: millions of objects; 1.6-2.0 s with the collector, 0.4-0.6 without
        with collector_paused():
            return Unpickler(io.BytesIO(blob)).load()
    except error:
        raise
    except Exception as exc:  # a damaged blob: any unpickling error
        raise error(f"unreadable {what} ({type(exc).__name__}: {exc})") from None


def load(blob: bytes) -> JobFold:
    """The fold a seed holds; raises SeedError (never another error) for one it cannot use."""
    payload = unpickle_only(blob, ALLOWED, SeedError, "seed")
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        got = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise SeedError(f"seed format {got!r}, this scalemon reads format {FORMAT}")
    if payload.get("scalemon") != scalemon.__version__:
        raise SeedError(f"the seed comes from scalemon {payload.get('scalemon')}, this is "
                        f"{scalemon.__version__}")
    fold = payload.get("fold")
    if not isinstance(fold, JobFold):
        raise SeedError(f"the seed holds a {type(fold).__name__}, not a JobFold")
    return fold
