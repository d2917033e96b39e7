"""A dashboard that attaches late starts from the hub's own fold of the history (`seed`): what it
then holds is what replaying the whole history gives, record for record, before and after
more records come live; the seed builds nothing but the fold's classes; from 512 ranks on, a
rank's series come from the hub when the rank is shown (real hubs, real sockets)."""

from __future__ import annotations

import asyncio
import math
import os
import pickle
import threading
from array import array
from collections import deque
from typing import Any

import pytest
import zmq

import scalemon
from conftest import wait_for
from scalemon import protocol
from scalemon.link import seed
from scalemon.protocol import RANK_RECORDS_KEPT, Message
from scalemon.state.fold import SERIES_ALL_BELOW, JobFold
from scalemon.tui.feed import HubFeed
from scalemon.tui.model import FOLD_ATTRIBUTES, DashboardData
from scalemon.tui.sim import SimJob

CONFIG = {"_job", "_cap", "_hang_after_s", "_world_size", "watched"}
"""What a dashboard sets itself: left out of the comparison."""


def canon(obj: Any) -> Any:
    """Everything an object graph holds, as plain values (floats exact, NaN as "nan")."""
    if isinstance(obj, float):
        return "nan" if math.isnan(obj) else obj
    if obj is None or isinstance(obj, (str, int, bytes)):
        return obj
    if isinstance(obj, dict):
        return {repr(k): canon(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [canon(x) for x in obj]
    if isinstance(obj, deque):
        return ("deque", obj.maxlen, [canon(x) for x in obj])
    if isinstance(obj, (set, frozenset)):
        return ("set", sorted(repr(x) for x in obj))
    if isinstance(obj, array):
        return ("array", obj.typecode, obj.tobytes())
    names = {n for cls in type(obj).__mro__ for n in getattr(cls, "__slots__", ())}
    names |= set(getattr(obj, "__dict__", {}))
    return (type(obj).__name__, {n: canon(getattr(obj, n)) for n in sorted(names)
                                 if hasattr(obj, n) and n != "_handlers"
                                 and not callable(getattr(obj, n))})


def fold_of(data: DashboardData) -> dict[str, Any]:
    with data.lock:
        return {name: canon(getattr(data, name)) for name in sorted(FOLD_ATTRIBUTES - CONFIG)}


def frames_of(messages: list[Message]) -> list[bytes]:
    return [protocol.encode(m.type, m.job, m.rank, m.seq, m.body, t=m.t) for m in messages]


class Dashboard:
    """A HubFeed folding into DashboardData on its own thread, as the app's receiver does."""

    def __init__(self, hub, use_seed: bool) -> None:
        self.data = DashboardData()
        self.feed = HubFeed(address=hub.address, use_seed=use_seed, timeout_s=5.0)
        self._stop = threading.Event()
        self.thread = threading.Thread(
            target=self.feed.run, args=(self.data, self._stop.is_set, lambda *_: None),
            daemon=True)
        self.thread.start()

    def at(self, head: int) -> bool:
        return self.data.next_seq == head

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)


def watched(data: DashboardData, rank: int) -> bool:
    """True once the receiver took `rank`'s series in (read under the lock it does that in)."""
    with data.lock:
        return rank in data.watched


def send_all(zctx: zmq.Context, hub, frames: list[bytes]) -> int:
    """Send `frames` to the hub; returns its head once it stored them all."""
    from scalemon.link.client import HubClient

    push = zctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 5000)
    push.connect(hub.address.ingest)
    before = HubClient(hub.address).request("ping")["head"]
    for frame in frames:
        push.send(frame)
    client = HubClient(hub.address)
    return wait_for(lambda: (h := client.request("ping")["head"]) >= before + len(frames) and h,
                    timeout=60)


def test_a_seeded_dashboard_holds_what_a_full_replay_holds_then_and_after_live_records(
        start_hub, zctx) -> None:
    hub = start_hub("seedjob", "--lost-after", "600")
    sim = SimJob(job="seedjob", ranks=8, straggler=3, ranks_per_host=4)
    run = sim.run(80, heartbeat_every=5, finish=True)
    split = next(i for i, m in enumerate(run) if m.type == "step" and m.body["step"] > 60)
    head = send_all(zctx, hub, frames_of(run[:split]))
    seeded, replayed = Dashboard(hub, use_seed=True), Dashboard(hub, use_seed=False)
    try:
        wait_for(lambda: seeded.at(head) and replayed.at(head), timeout=60)
        assert seeded.data.seeded_at == head and replayed.data.seeded_at is None
        assert seeded.feed.seed_note.startswith("started from the hub's fold at record")
        assert seeded.data.state.ranks[3].lateness  # collectives were folded
        assert fold_of(seeded.data) == fold_of(replayed.data)

        head = send_all(zctx, hub, frames_of(run[split:]))
        wait_for(lambda: seeded.at(head) and replayed.at(head), timeout=60)
        assert seeded.data.seeded_at < head
        assert seeded.data.state.state == "finished"
        assert fold_of(seeded.data) == fold_of(replayed.data)
    finally:
        seeded.close()
        replayed.close()


def test_a_hub_of_protocol_1_3_has_no_seed_and_the_dashboard_replays(start_hub, zctx) -> None:
    hub = start_hub("oldhub", version="1.3")
    sim = SimJob(job="oldhub", ranks=2)
    frames = [protocol.encode(m.type, m.job, m.rank, m.seq, m.body, t=m.t)
              for m in sim.run(5)]
    push = zctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 5000)
    push.connect(hub.address.ingest)
    for frame in frames:
        push.send(frame)
    dash = Dashboard(hub, use_seed=True)
    try:
        wait_for(lambda: dash.data.next_seq == len(frames), timeout=30)
        assert dash.data.seeded_at is None
        assert "unknown request op 'seed'" in dash.feed.seed_note
        assert dash.data.state.ranks[1].step == 5
    finally:
        dash.close()


def test_a_big_jobs_rank_gets_its_series_from_the_hub_when_shown_then_live(
        start_hub, zctx) -> None:
    ranks = SERIES_ALL_BELOW + 8
    hub = start_hub("bigseed", "--lost-after", "600")
    sim = SimJob(job="bigseed", ranks=ranks)
    first = sim.run(6, heartbeat_every=3)
    head = send_all(zctx, hub, frames_of(first))
    dash = Dashboard(hub, use_seed=True)
    try:
        wait_for(lambda: dash.at(head), timeout=60)
        data = dash.data
        assert data.big() and data.seeded_at == head
        assert not any(t.series for t in data.tracks.values())  # none kept for 520 ranks
        assert data.show_rank(300) is True
        wait_for(lambda: watched(data, 300), timeout=30)
        loss = data.tracks[300].series["loss"]
        assert list(loss.arrays()[0]) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        assert data.show_rank(300) is False  # kept from now on: nothing to fetch again
        assert not data.tracks[301].series

        more = [m for m in sim.run(9, heartbeat_every=3) if m.type != "hello"
                and m.body.get("step", 0) > 6]
        # `run` numbers the new messages after the old ones: the same ranks going on
        head = send_all(zctx, hub, frames_of(more))
        wait_for(lambda: dash.at(head), timeout=60)
        reference = JobFold()
        reference.watched = {300}
        for i, m in enumerate(first + more):
            reference.apply(i, m)
        got, want = data.tracks[300].series, reference.tracks[300].series
        for name in ("loss", "step_time_s", "mem_allocated_bytes", "gpu_util_pct"):
            assert canon(got[name]) == canon(want[name]), name
        assert list(got["loss"].arrays()[0]) == [float(s) for s in range(1, 10)]
    finally:
        dash.close()


def test_a_rank_with_more_records_than_the_hub_indexes_says_from_which_step_its_plots_go(
        start_hub, zctx) -> None:
    from scalemon.tui.views.rank_detail import rank_detail

    ranks = SERIES_ALL_BELOW
    hub = start_hub("bigtrim", "--lost-after", "600")
    sim = SimJob(job="bigtrim", ranks=ranks)
    first = sim.run(1)
    body = dict(first[-1].body)  # a step body of the last rank, for rank 5's many steps
    many = [Message("step", "bigtrim", 5, sim.seq[5] + i, sim.end_t(1) + i * 0.01,
                    {**body, "step": step}) for i, step in enumerate(range(2, 8302))]
    head = send_all(zctx, hub, frames_of(first + many))
    dash = Dashboard(hub, use_seed=True)
    try:
        wait_for(lambda: dash.at(head), timeout=60)
        dash.data.show_rank(5)
        wait_for(lambda: watched(dash.data, 5), timeout=30)
        first_step = 8301 - RANK_RECORDS_KEPT + 1  # the latest 4096 of its records: all steps
        assert dash.data.partial_series == {5: first_step}
        assert dash.data.tracks[5].series["loss"].arrays()[0][0] >= first_step
        facts = dict(rank_detail(dash.data, 5).facts)
        assert facts["plots"].startswith(f"from step {first_step} on")
        dash.data.show_rank(6)
        wait_for(lambda: watched(dash.data, 6), timeout=30)
        assert 6 not in dash.data.partial_series  # all of rank 6's records were there
    finally:
        dash.close()


def test_the_rank_detail_of_a_big_job_says_it_is_fetching_then_draws_the_series(
        start_hub, zctx) -> None:
    from test_tui_app import until
    from test_tui_snapshots import screen_text

    from scalemon.tui.app import DashboardApp
    from scalemon.tui.screens.rank_detail import RankDetailScreen

    ranks = SERIES_ALL_BELOW
    hub = start_hub("bigdetail", "--lost-after", "600")
    sim = SimJob(job="bigdetail", ranks=ranks)
    send_all(zctx, hub, frames_of(sim.run(12, heartbeat_every=4)))
    app = DashboardApp(HubFeed(address=hub.address))

    async def scenario() -> None:
        async with app.run_test(size=(160, 50)) as pilot:
            await until(pilot, lambda: app.data.next_seq > 0 and app.redraws, timeout=60)
            assert app.data.seeded_at
            app.push_screen(RankDetailScreen(77))
            await until(pilot, lambda: isinstance(app.screen, RankDetailScreen))
            await until(pilot, lambda: watched(app.data, 77), timeout=30)
            await until(pilot, lambda: "fetching rank 77" not in screen_text(app)
                        and "step 12" in screen_text(app), timeout=30)

    asyncio.run(scenario())


# ---- what a seed may hold --------------------------------------------------------------------

class _Evil:
    def __reduce__(self):  # noqa: ANN204 - what a hostile seed would carry
        return (os.system, ("echo pwned",))


def test_a_seed_that_names_anything_but_the_folds_classes_is_refused() -> None:
    blob = pickle.dumps({"format": seed.FORMAT, "scalemon": scalemon.__version__,
                         "fold": _Evil()}, protocol=5)
    with pytest.raises(seed.SeedError, match=r"names posix\.system, which a seed may not hold"):
        seed.load(blob)


def test_seeds_of_another_format_or_version_or_damaged_are_refused_with_the_reason() -> None:
    good = seed.dump(JobFold())
    assert isinstance(seed.load(good), JobFold)
    other = pickle.dumps({"format": seed.FORMAT + 1, "scalemon": scalemon.__version__,
                          "fold": JobFold()}, protocol=5)
    with pytest.raises(seed.SeedError, match="seed format 2, this scalemon reads format 1"):
        seed.load(other)
    older = pickle.dumps({"format": seed.FORMAT, "scalemon": "0.0.1", "fold": JobFold()},
                         protocol=5)
    with pytest.raises(seed.SeedError, match="comes from scalemon 0.0.1"):
        seed.load(older)
    with pytest.raises(seed.SeedError, match="unreadable seed"):
        seed.load(good[: len(good) // 2])
    not_a_fold = pickle.dumps({"format": seed.FORMAT, "scalemon": scalemon.__version__,
                               "fold": [1, 2]}, protocol=5)
    with pytest.raises(seed.SeedError, match="holds a list, not a JobFold"):
        seed.load(not_a_fold)


def test_a_fold_round_trips_through_its_seed_shared_deques_included() -> None:
    sim = SimJob(ranks=4, straggler=1)
    fold = JobFold()
    for i, m in enumerate(sim.run(30, heartbeat_every=5)):
        fold.apply(i, m)
    back = seed.load(seed.dump(fold))
    assert canon(back) == canon(fold)
    # a rank's lateness is the arrival tracker's deque itself: still one object after loading
    assert back.state.ranks[1].lateness is back.state.arrival.lateness[1]
    for i, m in enumerate(sim.run(35, heartbeat_every=5)[len(back.state.ranks):], start=10**6):
        if m.body.get("step", 0) > 30:
            back.apply(i, m)
            fold.apply(i, m)
    assert canon(back) == canon(fold)
