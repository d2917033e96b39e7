"""A big job's feed for dashboards: once a second a digest of the hub's fold, and the few
records that are neither steps nor heartbeats one by one (`RankDigest`, owned by the `Intake`).

From `DIGEST_FROM_RANKS` ranks on a dashboard cannot fold every record (16,384 ranks send some
20,000 a second). It starts from the hub's fold (`seed`) and then follows two topics of the
feed besides `rec`: `dig`, each rank's fields that its steps and heartbeats change, with the
job-wide figures and the per-step bands, and `few`, every other record (hellos, exits,
collectives, the hub's own records), which it folds as it does today. The digest is built from
the fold's state, never from the records, and its cost on the hub's thread is bounded: every
rank heard from since the previous digest gets its step and times (a few attribute reads,
sent as columns), and at most DIGEST_FULL_ROWS ranks their whole row (its metrics: reading
them is the cost), the ranks taking turns. Small jobs get neither.
"""

from __future__ import annotations

import time
from operator import attrgetter, itemgetter
from typing import Any

import msgpack

from scalemon.link.columns import encode_column
from scalemon.messages import (
    DIGEST_EXTRAS,
    DIGEST_FROM_RANKS,
    DIGEST_LEAN_FIELDS,
    DIGEST_METRICS,
    DIGEST_TOPIC,
    FEW_TOPIC,
)
from scalemon.protocol import pack_seq
from scalemon.state.jobstate import RankView

from .core import HubCore
from .sockets import FanOut

DIGEST_EVERY_S = 1.0
"""How often a big job's digest goes out."""
DIGEST_FULL_ROWS = 2048
"""Most ranks whose whole row (`DIGEST_RANK_FIELDS`) a digest carries: reading 16,384 ranks'
metrics takes the hub's thread some 200 ms, so a bigger job's rows take turns (a rank's
metrics are then up to ranks / 2048 s old: 8 s at 16,384 ranks); every rank heard from gets
its `DIGEST_LEAN_FIELDS` (step and times: a few attribute reads) in every digest."""
_metric_values = itemgetter(*DIGEST_METRICS)  # a RankView's metrics in DIGEST_METRICS order
_lean_values = attrgetter(*DIGEST_LEAN_FIELDS)


def topic_of(kind: bytes, feed_topic: bytes) -> bytes:
    """The feed topic `rec <id> <base>` with its first word replaced by `kind` (dig, few)."""
    return kind + feed_topic[feed_topic.index(b" "):]


def rank_row(v: RankView) -> list[Any]:
    """One rank's `DIGEST_RANK_FIELDS` row (packed by msgpack as it is: the cheapest form for
    the hub to make)."""
    extra = v.extra
    return [v.rank, v.step, v.steps_received, v.last_seen_t, v.last_step_t, v.last_seq,
            v.seq_seen, v.seq_gaps, v.compute_over_median_s, _metric_values(v.metrics),
            [extra.get(k) for k in DIGEST_EXTRAS] if extra else (), v.derived, v.alerts]


def lean_columns(lean: list[tuple[Any, ...]]) -> dict[str, Any]:
    """Ranks' `DIGEST_LEAN_FIELDS` values (at least one rank's) as columns
    (`scalemon.link.columns`)."""
    by_field = zip(*lean, strict=True)
    return {name: encode_column(list(values))
            for name, values in zip(DIGEST_LEAN_FIELDS, by_field, strict=True)}


class RankDigest:
    """What a big job's dashboards follow instead of every record."""

    def __init__(self, core: HubCore) -> None:
        self.core = core
        self._sent: dict[int, tuple[Any, ...]] = {}  # rank -> what its last row said
        self._heard: dict[int, tuple[Any, ...]] = {}  # rank -> what its last lean values said
        self._cursor = 0  # where the next digest's rows start, in the ranks' order
        self._agg_x: dict[str, float] = {}  # metric -> the last band's step sent
        self._groups_sent: set[str] = set()
        self._next = 0.0
        self.published = 0  # digests sent
        self.few_sent = 0  # records sent one by one

    def active(self) -> bool:
        """True for a job of DIGEST_FROM_RANKS ranks or more that a dashboard follows (it
        asked for the seed or the digest within DIGEST_WANTED_S)."""
        state = self.core.state
        return ((state.world_size or len(state.ranks)) >= DIGEST_FROM_RANKS
                and time.monotonic() < self.core.digest_wanted_until)

    def send_few(self, feed: FanOut, records: list[tuple[int, bytes]]) -> None:
        """Publish a big job's records that are neither steps nor heartbeats, one by one."""
        topic = topic_of(FEW_TOPIC, self.core.topic)
        for seq, frame in records:
            feed.send_multipart([topic, pack_seq(seq), frame])
        self.few_sent += len(records)

    def tick(self, feed: FanOut, now: float) -> None:
        """Publish a digest when one is due (a big job only)."""
        if now < self._next or not self.active():
            return
        self._next = now + DIGEST_EVERY_S
        feed.send_multipart([topic_of(DIGEST_TOPIC, self.core.topic),
                             msgpack.packb(self.build(), use_bin_type=True)])
        self.published += 1

    def build(self) -> dict[str, Any]:
        """The digest (`DIGEST_FIELDS`): the lean values of every rank heard from since the
        previous one, the rows of up to DIGEST_FULL_ROWS ranks, the job's figures."""
        fold = self.core.fold
        state = fold.state
        heard = self._heard
        lean = []  # the lean values of the ranks heard from since the previous digest
        for rank, v in state.ranks.items():
            values = _lean_values(v)
            if heard.get(rank) != values:
                heard[rank] = values
                lean.append(values)
        job = {"last_t": state.last_t, "last_step_t": state.last_step_t,
               "fold_last_step_t": fold.last_step_t, "records": fold.records,
               "by_type": fold.by_type, "groups": self._new_groups()}
        return {"seq": len(self.core.history), "t": time.time(), "ranks": self._rows(),
                "lean": {"rows": len(lean), "columns": lean_columns(lean) if lean else {}},
                "job": job, "agg": self._new_bands()}

    def _rows(self) -> list[list[Any]]:
        """The rows of up to DIGEST_FULL_ROWS ranks that changed since their last row, going
        round the ranks from where the previous digest stopped."""
        views = list(self.core.state.ranks.values())
        sent = self._sent
        rows: list[list[Any]] = []
        start = self._cursor if self._cursor < len(views) else 0
        at = start
        for _ in range(len(views)):
            v = views[at]
            at = at + 1 if at + 1 < len(views) else 0
            said = (v.last_seen_t, v.compute_over_median_s, v.steps_received)
            if sent.get(v.rank) != said:
                sent[v.rank] = said
                rows.append(rank_row(v))
                if len(rows) >= DIGEST_FULL_ROWS:
                    break
        self._cursor = at
        return rows

    def _new_groups(self) -> dict[str, Any]:
        """The process groups first seen since the previous digest (`JobState.groups`)."""
        groups = self.core.state.groups
        if len(groups) == len(self._groups_sent):
            return {}
        new = {name: g for name, g in groups.items() if name not in self._groups_sent}
        self._groups_sent.update(new)
        return new

    def _new_bands(self) -> dict[str, list[list[float]]]:
        """The per-step bands (`JobFold.agg`) closed since the previous digest."""
        out: dict[str, list[list[float]]] = {}
        for name, series in self.core.fold.agg.items():
            last = self._agg_x.get(name, float("-inf"))
            xs = series.xs
            i = len(xs)
            while i > 0 and xs[i - 1] > last:
                i -= 1
            if i < len(xs):
                out[name] = [[xs[j], series.lo[j], series.hi[j], series.mean[j]]
                             for j in range(i, len(xs))]
                self._agg_x[name] = xs[-1]
        return out
