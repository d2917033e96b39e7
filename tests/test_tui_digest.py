"""A big job's dashboard follows the hub's digest, not every record: a real hub, 1,024 simulated
ranks on 128 nodes, the real app. The node rows come from the digest (steps move on), a node
opened shows its ranks' live rows and fetches their records while shown, and the dashboard
receives a digest a second and the few other records, not the ranks' steps and heartbeats.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
from types import SimpleNamespace

import msgpack
import zmq
from test_tui_app import until

from scalemon import protocol
from scalemon.hub import digest as digest_module
from scalemon.link.client import HubClient
from scalemon.messages import DIGEST_FROM_RANKS, DIGEST_TOPIC, FEW_TOPIC
from scalemon.state.fold import JobFold
from scalemon.tui.app import DashboardApp
from scalemon.tui.digest_feed import apply_digest, lean_rows
from scalemon.tui.feed import HubFeed
from scalemon.tui.model import DashboardData
from scalemon.tui.screens.node import NodeScreen
from scalemon.tui.screens.overview import OverviewScreen
from scalemon.tui.sim import SimJob
from scalemon.tui.views import nodes as nodes_module
from scalemon.tui.views import totals as totals_module
from scalemon.tui.views.overview import overview
from scalemon.tui.widgets.node_table import NodeTable
from scalemon.tui.widgets.rank_table import RankTable

RANKS = DIGEST_FROM_RANKS  # 128 nodes of 8


class BatchSender:
    """Every rank's messages of a round as one multipart message on one socket (as a
    node's relay forwards them; the hub takes each part as one message)."""

    def __init__(self, ctx: zmq.Context, address, sim: SimJob) -> None:
        self.sim = sim
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(address.ingest)
        self.sent = 0

    def _send(self, frames: list[bytes]) -> None:
        for i in range(0, len(frames), 256):
            self.sock.send_multipart(frames[i:i + 256])
        self.sent += len(frames)

    def hello(self) -> None:
        self._send([self.sim.frame(r, "hello", self.sim.hello(r), time.time())
                    for r in range(self.sim.ranks)])

    def step(self, step: int) -> None:
        now = time.time()
        bodies = self.sim.step_bodies(step, now)
        self._send([self.sim.frame(r, "step", bodies[r], now) for r in range(self.sim.ranks)])

    def heartbeat(self, step: int) -> None:
        self._send([self.sim.frame(r, "heartbeat", self.sim.heartbeat(r, step), time.time())
                    for r in range(self.sim.ranks)])


class SteppingJob:
    """A hub and `ranks` simulated ranks that said hello and took step 1; `more` takes the next
    step (and a heartbeat every `heartbeat_every` steps): what `until` calls while it waits."""

    def __init__(self, start_hub, zctx, job: str, ranks: int, straggler: int,
                 heartbeat_every: int = 0) -> None:
        self.hub = start_hub(job)
        self.sim = SimJob(job=job, ranks=ranks, gpu=False, straggler=straggler)
        self.ranks = BatchSender(zctx, self.hub.address, self.sim)
        self.ranks.hello()
        self.ranks.step(1)
        self.step = 1
        self.heartbeat_every = heartbeat_every

    def more(self) -> None:
        self.step += 1
        self.ranks.step(self.step)
        if self.heartbeat_every and self.step % self.heartbeat_every == 0:
            self.ranks.heartbeat(self.step)


def test_the_hub_publishes_a_big_jobs_digest_and_its_few_records(start_hub, zctx):
    hub = start_hub("digA")
    sub = zctx.socket(zmq.SUB)
    for topic in (DIGEST_TOPIC, FEW_TOPIC):
        sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(hub.address.feed)
    time.sleep(0.3)
    ranks = BatchSender(zctx, hub.address, SimJob(job="digA", ranks=RANKS, gpu=False))
    ranks.hello()
    # no dashboard asked for the digest (`seed` or `digest` request): none is built
    end = time.monotonic() + 2.5
    while time.monotonic() < end:
        if sub.poll(200):
            assert not sub.recv_multipart()[0].startswith((DIGEST_TOPIC, FEW_TOPIC))
    assert HubClient(hub.address).request("digest")["ok"]
    ranks.step(1)  # the hellos went unpublished: the seed has them
    ranks.step(2)
    digests, few = [], []
    end = time.monotonic() + 10
    while time.monotonic() < end and not any(
            any(step == 2 for step in lean_rows(d).get("step", ())) for d in digests):
        if sub.poll(200):
            frames = sub.recv_multipart()
            if frames[0].startswith(DIGEST_TOPIC):
                digests.append(msgpack.unpackb(frames[1], strict_map_key=False))
            else:
                few.append(protocol.decode_stored(frames[2]).type)
    assert digests, "no digest within 10 s"
    rows = {row[0]: row for d in digests for row in d["ranks"]}
    assert len(rows) == RANKS  # [rank, step, ...]: every rank's whole row
    steps = {rank: step for d in digests
             for rank, step in zip(*(lean_rows(d).get(k, ()) for k in ("rank", "step")),
                                   strict=True)}
    assert steps[517] == 2  # the step of every rank heard from, in every digest
    assert "step" not in few  # the steps are in digests, never one by one
    assert ranks.sent == 3 * RANKS


def test_a_big_jobs_dashboard_follows_the_digest_and_fetches_a_shown_nodes_ranks(
        start_hub, zctx):
    job = SteppingJob(start_hub, zctx, "digB", RANKS, straggler=517, heartbeat_every=5)
    feed, more = HubFeed(address=job.hub.address), job.more

    async def scenario() -> None:
        app = DashboardApp(feed)
        async with app.run_test(size=(160, 50)) as pilot:
            data = app.data
            await until(pilot, lambda: data.digest_followed and data.digests >= 1, 20, more)
            assert isinstance(app.screen, OverviewScreen)
            table = app.screen.query_one(NodeTable)
            await until(pilot, lambda: len(table.keys) == RANKS // 8, 10, more)
            seen = job.step
            await until(pilot, lambda: min(v.step or 0 for v in data.state.ranks.values())
                        > seen, 10, more)  # every rank's step moves on, from digests alone

            app.push_screen(NodeScreen("node64"))
            await until(pilot, lambda: isinstance(app.screen, NodeScreen), 5)
            await until(pilot, lambda: data.watched == set(range(512, 520)), 10, more)
            rank_table = app.screen.query_one(RankTable)
            await until(pilot, lambda: len(rank_table.rows) == 8, 10, more)
            now = job.step
            await until(pilot, lambda: int(rank_table.cells_by_rank(["step"])[517][0]) > now,
                        10, more)  # its ranks' rows are live
            await until(pilot, lambda: (s := data.tracks[517].series.get("step_time_s"))
                        is not None and len(s) >= 3, 10, more)  # its records, on demand
            fetched = feed.follower.fetches
            await until(pilot, lambda: feed.follower.fetches > fetched, 5, more)
            await pilot.press("escape")
            await until(pilot, lambda: isinstance(app.screen, OverviewScreen), 5)
            await until(pilot, lambda: not data.watched, 5, more)  # left: fetched no more
            follower = feed.follower
            records_sent = job.ranks.sent
            assert follower.digests >= 2
            # what it received: a digest a second and the hellos, never the steps
            assert follower.few <= RANKS + 20 < records_sent // 3
            assert data.records > 2 * RANKS  # the hub's count of what it folded, all of it
            await pilot.press("q")

    asyncio.run(scenario())


def test_a_digest_gives_every_rank_heard_its_step_and_the_whole_rows_in_turns(monkeypatch):
    """The hub's cost per digest is bounded: every rank heard from gets its lean values, at
    most DIGEST_FULL_ROWS ranks their whole row, the others' rows in the next digests."""
    monkeypatch.setattr(digest_module, "DIGEST_FULL_ROWS", 16)
    sim = SimJob(job="digR", ranks=64, gpu=False)
    fold = JobFold("digR")
    for seq, msg in enumerate(sim.run(2, heartbeat_every=1)):
        fold.apply(seq, msg)
    core = SimpleNamespace(fold=fold, state=fold.state, history=[b""] * 10, topic=b"rec x y")
    digest = digest_module.RankDigest(core)
    first = msgpack.unpackb(msgpack.packb(digest.build()), strict_map_key=False)
    assert lean_rows(first)["rank"] == list(range(64)) and len(first["ranks"]) == 16
    rows = {row[0] for row in first["ranks"]}
    for _ in range(3):
        rows |= {row[0] for row in digest.build()["ranks"]}
    assert rows == set(range(64))  # each rank's row in turn, none twice before all had one
    quiet = digest.build()
    assert quiet["lean"]["rows"] == 0 and quiet["ranks"] == []  # nothing new: nothing sent
    fold.state.ranks[5].last_seen_t += 1.0
    again = digest.build()
    assert lean_rows(again)["rank"] == [5] and [row[0] for row in again["ranks"]] == [5]


def test_a_2048_rank_dashboard_redraws_from_the_receivers_pass_over_the_ranks(
        start_hub, zctx, monkeypatch):
    """Following the digest, the screen reads the pass over every rank that the receiver made
    once per digest (`DashboardData.totals`), never one of its own; the header, node rows and
    a rank that exits (a record of its own) show as they do for a small job."""
    ranks_n = 2048  # 256 nodes of 8
    calls = {"screen": 0, "receiver": 0}
    made = totals_module.rank_totals

    def counted(*args, **kwargs):
        on_screen = threading.current_thread() is threading.main_thread()
        calls["screen" if on_screen else "receiver"] += 1
        return made(*args, **kwargs)

    monkeypatch.setattr(totals_module, "rank_totals", counted)
    monkeypatch.setattr(nodes_module, "rank_totals", counted)
    job = SteppingJob(start_hub, zctx, "digT", ranks_n, straggler=1000)
    feed, more = HubFeed(address=job.hub.address), job.more

    async def scenario() -> None:
        app = DashboardApp(feed)
        async with app.run_test(size=(160, 50)) as pilot:
            data = app.data
            await until(pilot, lambda: data.digest_followed and data.totals is not None, 30,
                        more)
            table = app.screen.query_one(NodeTable)
            await until(pilot, lambda: len(table.keys) == ranks_n // 8, 10, more)
            screen_calls = calls["screen"]
            seen, redraws = job.step, app.redraws
            await until(pilot, lambda: app.redraws > redraws + 2 and data.totals.step_min
                        is not None and data.totals.step_min > seen, 15, more)
            assert calls["screen"] == screen_calls  # the redraws made no pass of their own
            assert calls["receiver"] >= 2
            header = overview(data, time.time(), plots=False).summary  # as the screen's
            assert header.ranks_seen == ranks_n and header.step_max > seen
            assert header.steps_per_s is not None  # from the steps the lean values carry
            exit_body = {"reason": "exception", "exit_code": 1, "error": "RuntimeError: boom",
                         "step": job.step, "dropped": 0}
            job.ranks._send([job.sim.frame(1234, "exit", exit_body, time.time())])
            await until(pilot, lambda: data.totals.nodes["node154"].worst == "failed", 10, more)
            await until(pilot, lambda: table.keys[0] == "node154", 5, more)  # trouble first
            assert calls["screen"] == screen_calls
            await pilot.press("q")

    asyncio.run(scenario())


def test_a_digest_folds_into_a_seeded_dashboard_as_the_records_fold_into_the_hub():
    """A dashboard seeded at step 1 and given the digests of steps 2-3 holds what the hub's fold
    holds for what the screens read: steps, metrics, the per-host clock offsets (the hang
    screen's times) and when each rank's tokens/s goes stale."""
    sim = SimJob(job="digF", ranks=16, gpu=False)
    fold = JobFold("digF")
    messages = sim.run(3, heartbeat_every=1)
    first_step_done = 16 + 2 * 16 + 16  # hellos, step 1's steps, collectives, heartbeats
    for seq, msg in enumerate(messages[:first_step_done]):
        fold.apply(seq, msg)
    data = DashboardData("digF")
    data.load_seed(pickle.loads(pickle.dumps(fold)), None)
    core = SimpleNamespace(fold=fold, state=fold.state, history=[b""] * 10, topic=b"rec x y")
    digest = digest_module.RankDigest(core)
    apply_digest(data, msgpack.unpackb(msgpack.packb(digest.build()), strict_map_key=False))
    for seq, msg in enumerate(messages[first_step_done:], start=first_step_done):
        if msg.type == "heartbeat":
            msg.body["clock_offset_s"] = 0.25 if msg.rank < 8 else -0.5
        fold.apply(seq, msg)
    apply_digest(data, msgpack.unpackb(msgpack.packb(digest.build()), strict_map_key=False))
    hub, dash = fold.state, data.state
    assert [v.step for v in dash.ranks.values()] == [v.step for v in hub.ranks.values()] == [3] * 16
    assert all(dash.ranks[r].metrics == hub.ranks[r].metrics for r in hub.ranks)
    assert dash.host_offsets == hub.host_offsets == {"node0": dict.fromkeys(range(8), 0.25),
                                                     "node1": dict.fromkeys(range(8, 16), -0.5)}
    assert dash.clock_offset(dash.ranks[9]) == -0.5
    assert all(dash.ranks[r].token_window.last_step_s == hub.ranks[r].token_window.last_step_s
               for r in hub.ranks)
    assert data.digests == 2
