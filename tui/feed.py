"""Where the dashboard's records come from. `Feed.run` is the body of the receiver thread.

`HubFeed` owns its `HubStream` (SUB + DEALER sockets, used on that thread only): it attaches
from the record after the last one folded (at first from the hub's own fold of its history,
`seed`, else from record 0: the whole history), polls with a short timeout, folds each batch
into `DashboardData`, and when the hub stops answering it reports "disconnected", waits and
attaches again, resuming at the same record number. A hub restarted for the same job keeps its
numbering; one whose history restarted at 0 makes it start over. Between batches it fetches the
earlier records of a big job's rank the screen asks for (`rank_records`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import zmq

from scalemon import protocol
from scalemon.home.address import HubAddress
from scalemon.home.history import ID_SUFFIX, history_path, read_messages
from scalemon.home.lookup import JobLookupError, hub_gone_text, serving_jobs
from scalemon.link import seed
from scalemon.link.client import HistoryReset, HubStream, HubUnreachable
from scalemon.protocol import RANK_RECORDS_KEPT, ProtocolError, VersionMismatch, version_text
from scalemon.state.fold import record_key

from .digest_feed import DigestFollower, make_totals, wants_digest
from .gcpause import freeze_loaded
from .model import DashboardData

SEED_TIMEOUT_S = 30.0
"""Longest wait for the hub's fold (a big job's is megabytes, pickled on the hub's thread)."""

StopCheck = Callable[[], bool]
StatusHook = Callable[[str, str], None]


class Feed(ABC):
    """A source of records for the dashboard."""

    label = ""

    @abstractmethod
    def run(self, data: DashboardData, stop: StopCheck, on_status: StatusHook) -> None:
        """Fold records into `data` until `stop()` is true (called on the receiver thread)."""


class HubFeed(Feed):
    """A live hub, by job id (looked up in the job files on every attempt) or by address."""

    def __init__(self, job: str | None = None, address: HubAddress | None = None,
                 home: Path | None = None, timeout_s: float = 2.0, retry_s: float = 1.0,
                 use_seed: bool = True) -> None:
        if job is None and address is None:
            raise ValueError("HubFeed needs a job id or an address")
        self.job = job
        self.address = address
        self.home = home
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.label = job or (address.base if address else "")
        self.attaches = 0  # successful attaches (the first one included)
        self.use_seed = use_seed
        self.seed_note = ""  # how the last attach from scratch started (seed or replay)
        self.digest_offered = False  # the hub publishes a big job's digest (its seed said)
        self.seed_figures: dict[str, float] = {}
        """The last seed's size, seconds from asking to its reply, and to load it."""
        self.follower: DigestFollower | None = None  # the last one followed (a big job's)

    def _resolve(self) -> HubAddress | None:
        """The job's hub while it serves, lingering after the job ended included (None when
        it has none: a stale address is no use), or the address given."""
        if self.job is not None:
            try:
                serving = serving_jobs(self.home, clean=False)
            except JobLookupError:  # job files not to be trusted: offline, history only
                return None
            for jf in serving:
                if jf.job == self.job:
                    self.address = jf.hub_address()  # with its control socket on this host
                    return self.address
            return None
        return self.address

    def run(self, data: DashboardData, stop: StopCheck, on_status: StatusHook) -> None:
        def status(state: str, detail: str = "") -> None:
            if data.set_conn(state, detail):
                on_status(state, detail)

        while not stop():
            if data.conn.status == "offline":
                self._watch_from_file(data)
            address = self._resolve()
            if address is None:
                if data.conn.status != "offline":  # else the history file is shown already
                    if self._replay_history(data):
                        status("offline", _offline_text(hub_gone_text(self.job, self.home)))
                    else:
                        status("waiting", f"no hub for job {self.job} yet")
                _sleep(self.retry_s, stop)
                continue
            since = 0 if data.digest_followed else data.next_seq  # a digest: seeded again
            stream = HubStream(address, since=since, timeout_s=self.timeout_s,
                               identity=data.history_identity)
            follower: DigestFollower | None = None
            try:
                if not data.digest_followed and not self._same_history(stream, data):
                    data.reset()  # a new (or shortened) history under the same name
                    stream.next_seq = 0
                if stream.next_seq == 0 and self.use_seed:
                    follower = DigestFollower(address, stream.client)
                    try:
                        if not (self._start_from_seed(stream, data) and self.digest_offered
                                and wants_digest(data)):
                            follower.close()
                            follower = None
                        with data.lock:
                            data.digest_followed = follower is not None
                        if follower is not None:
                            make_totals(data)  # what the redraws read, before any digest
                    finally:
                        data.busy = False  # the seed held the redraws (`load_seed`)
                else:
                    with data.lock:
                        data.digest_followed = False
                self.attaches += 1
                status("connected", address.base)
                if follower is not None:  # a big job: the hub's digest, not every record
                    self.follower = follower
                    stream.sub.setsockopt(zmq.UNSUBSCRIBE, protocol.FEED_TOPIC)
                    while not stop():
                        data.wait_for_screen()
                        follower.poll(data)
                    continue
                while not stop():
                    data.wait_for_screen()
                    batch = stream.poll(0.1)
                    if batch:
                        data.apply_batch(batch)
                    data.history_identity = stream.identity
                    for rank in data.take_watch():
                        self._watch(stream, data, rank)
                    if stream.rejected:
                        with data.lock:
                            data.rejected += stream.rejected
                        stream.rejected = 0
                    if self.use_seed and self.digest_offered and wants_digest(data):
                        data.reset()  # the job grew big: follow its digest from a seed
                        break
            except HistoryReset as exc:  # the records shown are not the hub's: start over
                data.reset()
                status("restarted", f"history started over: {exc}")
                stream.close()
                continue
            except VersionMismatch as exc:
                status("incompatible", f"the hub speaks scalemon protocol "
                       f"{version_text(exc.theirs)}, this dashboard {version_text(exc.ours)}: "
                       "attach with the scalemon version the job runs")
            except (HubUnreachable, ProtocolError, zmq.ZMQError, OSError,
                    ConnectionError) as exc:
                if data.conn.status != "offline":  # else the history file is shown already
                    gone = self._ended_hub_of_address(data)
                    if gone is not None and self._replay_history(data, data.state.job):
                        status("offline", _offline_text(gone))  # the hub ended for good
                    else:
                        status("disconnected", _short(exc))
            finally:
                if follower is not None:
                    follower.close()
                stream.close()
            _sleep(self.retry_s, stop)

    def _start_from_seed(self, stream: HubStream, data: DashboardData) -> bool:
        """Start from the hub's fold of its history (`seed`) instead of replaying it; False
        (and `seed_note` says why) when the hub offers none, so the history is replayed."""
        client = stream.client
        timeout, client.timeout_s = client.timeout_s, max(client.timeout_s, SEED_TIMEOUT_S)
        asked = time.perf_counter()
        try:
            reply = client.request("seed")
        except ProtocolError as exc:  # a hub of protocol 1.3 does not know the op
            self.seed_note = f"replayed the history: {exc}"
            return False
        finally:
            client.timeout_s = timeout
        data.hub_hang_after(reply.get("hang_after_s"))  # one threshold, the hub's
        self.digest_offered = reply.get("digest") is True  # a big job's digest on its feed
        blob = reply.get("seed")
        if not isinstance(blob, bytes):
            self.seed_note = f"replayed the history: {reply.get('why') or 'no seed'}"
            return False
        answered = time.perf_counter()
        try:
            fold = seed.load(blob)
        except seed.SeedError as exc:
            self.seed_note = f"replayed the history: {exc}"
            return False
        if fold.big():
            freeze_loaded()  # else the next collections walk it all, in a redraw
        stream.check_identity(client.history)
        data.load_seed(fold, client.history, hold=True)
        self.seed_figures = {"bytes": len(blob), "reply_s": answered - asked,
                             "load_s": time.perf_counter() - answered}
        stream.next_seq = data.next_seq
        self.seed_note = f"started from the hub's fold at record {data.next_seq:,}"
        return True

    def _watch(self, stream: HubStream, data: DashboardData, rank: int) -> None:
        """Fetch a big job's rank's earlier records and keep its series from them on (called
        between two batches, so they end where the live records begin)."""
        try:
            reply = stream.client.request("rank_records", rank=rank, before=data.next_seq,
                                          limit=RANK_RECORDS_KEPT)
        except ProtocolError:  # a 1.3 hub: the series start now
            data.watch_with(rank, None, complete=False)
            return
        except BaseException:
            with data.lock:
                data.to_watch.add(rank)  # asked again once attached again
            raise
        messages = []
        for record in reply.get("records") or ():
            try:
                messages.append(protocol.decode(record))
            except ProtocolError:
                continue
        data.watch_with(rank, messages, complete=bool(reply.get("complete")))

    @staticmethod
    def _same_history(stream: HubStream, data: DashboardData) -> bool:
        """True when the hub still holds the last record we folded under the same number
        (a hub killed before flushing, or a recreated run directory, renumbers records)."""
        if data.next_seq == 0:
            stream.client.request("ping")  # raises HubUnreachable when nobody answers
            return True
        records, _ = stream.client.fetch(data.next_seq - 1, 1)
        if not records:
            return False
        try:
            return record_key(protocol.decode(records[0])) == data.last_key
        except ProtocolError:
            return False

    def _replay_history(self, data: DashboardData, job: str | None = None) -> bool:
        """Fold the job's history file when its hub is gone: the records after those already
        shown (all of them when the file is another history than the one shown); True when
        there was a file."""
        job = job or self.job
        try:
            path = history_path(job, self.home) if job else None
        except ValueError:
            return False
        if path is None or not path.exists():
            return False
        file_id = _read_id(path)
        known = data.history_identity
        if data.next_seq and (known is None or file_id is None or known.get("id") != file_id):
            data.reset()  # not the history the records came from: show the file's alone
        batch, rejected = read_messages(path, job)
        with data.lock:
            data.rejected += rejected
        data.apply_batch([(seq, msg) for seq, msg in batch if seq >= data.next_seq])
        if file_id is not None:
            data.history_identity = {"id": file_id, "base": data.next_seq}
        return True

    def _watch_from_file(self, data: DashboardData) -> None:
        """While the history file is shown: the series of a big job's ranks asked for, from
        their records in the file."""
        ranks = data.take_watch()
        job = data.state.job or self.job
        if not ranks or job is None:
            return
        try:
            batch, _ = read_messages(history_path(job, self.home), job)
        except (OSError, ValueError):
            batch = []
        for rank in ranks:
            mine = [m for seq, m in batch if m.rank == rank and seq < data.next_seq]
            data.watch_with(rank, mine[-RANK_RECORDS_KEPT:],
                            complete=len(mine) <= RANK_RECORDS_KEPT)

    def _ended_hub_of_address(self, data: DashboardData) -> str | None:
        """For a feed attached by address: why the hub of the job shown is gone for good (its
        job file here says so), else None (a job-id feed finds that out in `_resolve`)."""
        job = data.state.job
        if self.job is not None or job is None:
            return None
        return hub_gone_text(job, self.home)


def _offline_text(why: str | None) -> str:
    """Why the history file is shown (the job ended, or its hub died), and what comes next."""
    return f"{why or 'no live hub'}: showing its history file; attaches again when a hub comes"


def _read_id(path: Path) -> str | None:
    """The random id of the history file at `path` (None when it has none)."""
    try:
        return path.with_name(path.name + ID_SUFFIX).read_text().strip() or None
    except OSError:
        return None


def _short(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, HubUnreachable):  # the address whole, without the advice after it
        text = text.split(" within ")[0]
    return text if len(text) <= 160 else text[:159] + "…"


def _sleep(seconds: float, stop: StopCheck) -> None:
    end = time.monotonic() + seconds
    while not stop() and time.monotonic() < end:
        time.sleep(0.05)
