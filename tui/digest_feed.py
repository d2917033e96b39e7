"""A big job's dashboard: the hub's digest instead of every record (`follow_digest`).

From `DIGEST_FROM_RANKS` ranks on (the hub says it publishes digests in its `seed` reply) the
dashboard starts from the hub's fold and then subscribes to the feed's `dig` and `few` topics
only (`hub/digest.py`): once a second the fields of each rank that its steps and heartbeats
change, the job-wide figures and the per-step bands, and every other record one by one, folded
as before. The node rows, the header, the hang, stragglers and collectives screens read the
same `JobState` as for a small job. The series of a rank the screen shows (`watched`: a node's
ranks, a rank's detail) come from the hub's `rank_records`, its latest records once a second,
for as long as the screen shows it.
"""

from __future__ import annotations

import math
import time
from typing import Any

import msgpack

from scalemon import metrics, protocol
from scalemon.home.address import HubAddress
from scalemon.link.client import HubClient, feed_subscriber, received
from scalemon.link.columns import decode_column
from scalemon.messages import (
    DIGEST_EXTRAS,
    DIGEST_FROM_RANKS,
    DIGEST_LEAN_FIELDS,
    DIGEST_METRICS,
    DIGEST_RANK_FIELDS,
    DIGEST_TOPIC,
    DIGEST_WANTED_S,
    FEW_TOPIC,
)
from scalemon.protocol import RANK_RECORDS_KEPT, ProtocolError
from scalemon.state.fold import step_values

from .model import DashboardData
from .views.nodes import node_totals

WATCH_EVERY_S = 1.0
"""How often the shown ranks' latest records are fetched."""
WATCH_LIMIT = 64
"""Records fetched per shown rank each time (a second of a rank is a few)."""
TOTALS_EVERY_S = 1.0
"""The pass over the ranks the redraws read (`DashboardData.totals`) is made again after
digests and records that came one by one, at most this often..."""
TOTALS_RANKS_PER_S = 8192
"""...and at most this many ranks' worth a second (every 2 s at 16,384 ranks, where the pass
takes the receiver some 0.3 s, during which the screen waits)."""
SILENT_AFTER_S = 10.0
"""No digest for this long: the hub is taken for unreachable (it sends one every 1-2 s)."""


def wants_digest(data: DashboardData) -> bool:
    """True for a job big enough for the hub's digest (call under the lock, or racy-ok)."""
    state = data.state
    return (state.world_size or len(state.ranks)) >= DIGEST_FROM_RANKS


class DigestFollower:
    """The feed's `dig` and `few` topics of one hub, subscribed before the seed is asked for
    (nothing published after the seed's record is missed)."""

    def __init__(self, address: HubAddress, client: HubClient) -> None:
        self.client = client
        self.sub = feed_subscriber(client.ctx, address, DIGEST_TOPIC, FEW_TOPIC)
        self.digests = 0  # digests folded
        self.few = 0  # records folded one by one
        self.rejected = 0
        self.last_digest = time.monotonic()
        self._next_watch = 0.0
        self._next_want = time.monotonic() + DIGEST_WANTED_S / 3  # the seed said it first
        self.fetches = 0  # rank_records requests for the shown ranks
        self._rank_seq: dict[int, int] = {}  # a shown rank -> its last record's own seq
        self._changed = False  # records folded since the last pass over the ranks
        self._totals_at = 0.0  # when that pass was made (monotonic)

    def poll(self, data: DashboardData, timeout_s: float = 0.1) -> None:
        """Fold what arrived (waits up to `timeout_s` for the first); raises ConnectionError
        when no digest came for SILENT_AFTER_S."""
        for frames in received(self.sub, int(timeout_s * 1000)):
            self._take(data, frames)
        now = time.monotonic()
        every = max(TOTALS_EVERY_S, len(data.state.ranks) / TOTALS_RANKS_PER_S)
        if self._changed and now - self._totals_at >= 0.9 * every:  # 0.9: a digest's jitter
            self._totals_at = now
            self._changed = False
            make_totals(data)
        if now - self.last_digest > SILENT_AFTER_S:
            raise ConnectionError(f"no digest from the hub for {SILENT_AFTER_S:g} s")
        if now >= self._next_watch:
            self._next_watch = now + WATCH_EVERY_S
            self.fetch_shown(data)
        if now >= self._next_want:  # the hub builds digests only while one is followed
            self._next_want = now + DIGEST_WANTED_S / 3
            self.client.request("digest")

    def _take(self, data: DashboardData, frames: list[bytes]) -> None:
        try:
            if frames[0].startswith(DIGEST_TOPIC) and len(frames) == 2:
                data.wait_for_screen()  # unpacking holds the interpreter for a while
                digest = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
                if digest["seq"] < data.next_seq:
                    return  # older than the seed
                apply_digest(data, digest)
                self.digests += 1
                self._changed = True
                self.last_digest = time.monotonic()
            elif frames[0].startswith(FEW_TOPIC) and len(frames) == 3:
                seq = protocol.unpack_seq(frames[1])
                if seq < data.next_seq:
                    return  # the seed has it
                msg = protocol.decode_stored(frames[2])
                with data.lock:
                    data.apply(seq, msg)
                    data.version += 1
                self.few += 1
                self._changed = True
            else:
                self.rejected += 1
        except (ProtocolError, ValueError, KeyError, TypeError, IndexError,
                msgpack.UnpackException):
            self.rejected += 1

    def fetch_shown(self, data: DashboardData) -> None:
        """The records of the ranks the screen shows: a newly shown rank's kept records (its
        series from them), then each second its latest ones; a rank no longer shown is no
        longer fetched."""
        with data.lock:
            new, data.to_watch = sorted(data.to_watch - data.watched), set()
            shown = sorted(data.watched)
        for rank in [r for r in self._rank_seq if r not in shown and r not in new]:
            del self._rank_seq[rank]
        for rank in new:
            messages, complete = self._records(rank, RANK_RECORDS_KEPT)
            data.watch_with(rank, messages, complete=complete)
            self._rank_seq[rank] = messages[-1].seq if messages else -1
        for rank in shown:
            messages, _ = self._records(rank, WATCH_LIMIT)
            last = self._rank_seq.get(rank, -1)
            fresh = [m for m in messages if m.seq > last]
            if fresh:
                self._rank_seq[rank] = fresh[-1].seq
                add_series(data, rank, fresh)
        self.fetches += len(new) + len(shown)

    def _records(self, rank: int, limit: int) -> tuple[list[protocol.Message], bool]:
        """Rank `rank`'s latest `limit` records (`rank_records`), and whether they reach back
        to its first."""
        reply = self.client.request("rank_records", rank=rank, before=1 << 62, limit=limit)
        messages = []
        for record in reply.get("records") or ():
            try:
                msg = protocol.decode(record)
            except ProtocolError:
                continue
            if msg.rank == rank:
                messages.append(msg)
        return messages, bool(reply.get("complete"))

    def close(self) -> None:
        """Close the subscription (the client is the caller's)."""
        self.sub.close(linger=0)


APPLY_CHUNK = 1024
"""Ranks of a digest folded per hold of the data's lock (a redraw waits for one at most)."""


def lean_rows(digest: dict[str, Any]) -> dict[str, list[Any]]:
    """A digest's `DIGEST_LEAN_FIELDS` columns as lists ({} for none); ProtocolError (or
    KeyError, TypeError) for a digest that is not one."""
    lean = digest["lean"]
    rows = lean["rows"]
    if type(rows) is not int or rows < 0:
        raise ProtocolError(f"a digest of {rows!r} lean rows")
    if not rows:
        return {}
    return {name: decode_column(lean["columns"][name], rows) for name in DIGEST_LEAN_FIELDS}


def apply_digest(data: DashboardData, digest: dict[str, Any]) -> None:
    """Fold one digest (`DIGEST_FIELDS`) into `data`: each rank's lean values and whole rows
    into its view, a step sample for its step rate, the job's figures and the new per-step
    bands; APPLY_CHUNK ranks per hold of the lock, letting a redraw under way finish in
    between."""
    lean = lean_rows(digest)
    rows = digest["ranks"]
    width = len(DIGEST_RANK_FIELDS)
    if not all(isinstance(row, list) and len(row) == width for row in rows):
        raise ProtocolError(f"a digest row is not one of {width} fields")
    count = len(lean.get("rank", ()))
    for start in range(0, max(count, len(rows)), APPLY_CHUNK):
        data.wait_for_screen()
        part = slice(start, start + APPLY_CHUNK)
        with data.lock:
            _apply_lean(data, {k: v[part] for k, v in lean.items()})
            _apply_rows(data, rows[part])
    with data.lock:
        _apply_job(data, digest)


_ROW_FIELDS = DIGEST_RANK_FIELDS[1:9]  # a row's plain fields after its rank


def _apply_rows(data: DashboardData, rows: list[list[Any]]) -> None:
    """Whole rows of a digest into their ranks' views (under the lock); a rank not known yet
    is skipped (its hello comes as a record of its own)."""
    ranks = data.state.ranks
    offsets = data.state.host_offsets
    for row in rows:
        v = ranks.get(row[0])
        if v is None:
            continue
        v.__dict__.update(zip(_ROW_FIELDS, row[1:9], strict=True))  # C loops, not setattr
        v.metrics.update(zip(DIGEST_METRICS, row[9], strict=True))
        if row[10]:
            v.extra.update((k, x) for k, x in zip(DIGEST_EXTRAS, row[10], strict=True)
                           if x is not None)
        v.derived, v.alerts = row[11], row[12]
        metrics_now = v.metrics  # what the reducer keeps beside them, as it would
        offset = metrics_now["clock_offset_s"]
        if v.host is not None and type(offset) in (int, float):
            offsets.setdefault(v.host, {})[v.rank] = offset  # per-host clocks (hang times)
        step_time = metrics_now["step_time_s"]
        if type(step_time) in (int, float) and 0 < step_time < math.inf:
            v.token_window.last_step_s = float(step_time)  # when its tokens/s goes stale
    data.version += 1


def _apply_lean(data: DashboardData, lean: dict[str, list[Any]]) -> None:
    """Lean values of a digest into their ranks' views, and a step sample for each rank's
    step rate (under the lock)."""
    if not lean:
        return
    ranks = data.state.ranks
    track = data.track
    names = DIGEST_LEAN_FIELDS[1:]
    for rank, *values in zip(*(lean[name] for name in DIGEST_LEAN_FIELDS), strict=True):
        v = ranks.get(rank)
        if v is None:
            continue
        v.__dict__.update(zip(names, values, strict=True))
        step, step_t = v.step, v.last_step_t
        if step is not None and step_t is not None:
            samples = track(rank).samples
            if not samples or step_t - samples[-1][0] >= 0.5:
                samples.append((step_t, step))
    data.version += 1


def _apply_job(data: DashboardData, digest: dict[str, Any]) -> None:
    """A digest's job-wide figures and per-step bands (under the lock)."""
    job = digest["job"]
    state = data.state
    state.last_t = _later(state.last_t, job.get("last_t"))
    state.last_step_t = _later(state.last_step_t, job.get("last_step_t"))
    data.last_step_t = _later(data.last_step_t, job.get("fold_last_step_t"))
    data.records = max(data.records, int(job.get("records") or 0))
    data.by_type = dict(job.get("by_type") or data.by_type)
    for name, group in (job.get("groups") or {}).items():
        state.groups.setdefault(name, group)
    for name, points in (digest.get("agg") or {}).items():
        series = data.agg.get(name)
        if series is not None:
            for x, lo, hi, mean in points:
                series.add(x, lo, hi, mean)
    data.next_seq = max(data.next_seq, int(digest["seq"]))
    data.digests += 1
    data.version += 1


def make_totals(data: DashboardData) -> None:
    """The pass over every rank that the redraws read (`views.totals`), made here once per
    digest instead of in every redraw; a redraw under way finishes first, and the screen
    does not start one while this holds the lock (`DashboardData.busy`)."""
    data.wait_for_screen()
    with data.lock:
        data.busy = True
        try:
            data.totals = node_totals(data, time.time())
            data.version += 1
        finally:
            data.busy = False


def add_series(data: DashboardData, rank: int, messages: list[protocol.Message]) -> None:
    """Append a shown rank's new `step` and `heartbeat` records to its series."""
    with data.lock:
        track = data.track(rank)
        step = None
        for msg in messages:
            if msg.type == "step":
                step = msg.body["step"]
                derived = metrics.derived_values(msg.body, None)
                track.add_step_series(msg.body, step_values(msg.body, derived))
            elif msg.type == "heartbeat":
                track.add_heartbeat_series(msg.body, step)
        data.version += 1


def _later(a: float | None, b: Any) -> float | None:
    if not isinstance(b, (int, float)):
        return a
    return b if a is None or b > a else a

