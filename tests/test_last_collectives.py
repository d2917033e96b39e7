"""The end of a job loses no collective, and none is misnamed (issue #37): the agent's reader
holds back a gloo entry read while its timed call is still being issued (gloo's recorder names a
reduce-scatter `all_reduce`; the host timer's call says what it is), and its last read, at
`finish()`, waits for the collectives still running and then takes every entry. Unit tests on
recorder entries shaped as torch writes them, then real 2-rank FSDP2 jobs with both cores busy,
counted by `scalemon snapshot --json` and by each rank's records in the hub's history."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections import deque

import pytest
from test_collectives import FakeSource, entry, reader
from test_collectives_jobs import fsdp_group, job_env, snapshot

from conftest import REPO, free_port, wait_for
from scalemon.home.history import history_path, read_messages


class FakeGroup:
    """A process group as the host timer sees it: a sequence number per collective issued."""

    def __init__(self) -> None:
        self.seq = 0

    def _get_sequence_number_for_group(self) -> int:
        return self.seq


@pytest.fixture
def group():
    """A fake group torch's group map names "0" (the entries' group)."""
    import torch.distributed as dist

    fake = FakeGroup()
    names = dist.distributed_c10d._world.pg_names
    names[fake] = "0"
    yield fake
    del names[fake]


def ops(sent: list) -> dict[str, int]:
    """Collectives counted by op over every `collectives` message sent."""
    out: dict[str, int] = {}
    for _, body in sent:
        for row in body["stats"]:
            out[row[1]] = out.get(row[1], 0) + row[3]
    return out


def test_an_entry_read_while_its_call_is_issued_waits_for_the_calls_op(group):
    """The race of issue #37, made to happen: the reader runs after the entry is in the ring
    and before the wrapper left its call. The entry waits for the next read, and is counted
    once, as the reduce-scatter it is (it used to go out as an `all_reduce`)."""
    from scalemon.agent.hosttiming import HostTimer

    source = FakeSource()
    timer = HostTimer()
    rec, sent = reader(source, host_calls=timer.calls, host_issuing=timer.issuing)

    def reduce_scatter(output, input, op=None, group=None, async_op=False):  # noqa: A002
        group.seq += 1
        source.entries.append(entry(group.seq - 1, group.seq, "all_reduce",  # gloo's name
                                     t=time.time()))
        assert timer.issuing  # the call is under way
        rec.read_all(False)  # the recorder's thread, right here
        return None

    timed = timer._wrap(reduce_scatter, "reduce_scatter", 3, "reduce_scatter_tensor")
    timed(None, None, group=group)
    assert not timer.issuing
    assert ops(sent) == {}  # held back: its call was still being issued
    rec.read_all(False)
    assert ops(sent) == {"reduce_scatter": 1}
    assert sent[-1][1]["stats"][0][5] == 1  # and timed (a synchronous call)
    rec.read_all(False)
    assert ops(sent) == {"reduce_scatter": 1}  # once


def test_an_entry_no_timed_call_issued_is_taken_at_once(group):
    """A collective issued without the host timer (DDP's reducer, a C++ caller) gets no call:
    read while no timed call is under way, it is counted at once under the recorder's name."""
    from scalemon.agent.hosttiming import HostTimer

    source = FakeSource()
    timer = HostTimer()
    rec, sent = reader(source, host_calls=timer.calls, host_issuing=timer.issuing)
    source.entries = [entry(0, 1, "all_reduce", t=time.time())]
    rec.read_all(False)
    assert ops(sent) == {"all_reduce": 1}


def test_the_last_read_waits_for_a_running_collective_then_takes_everything(group):
    """At `finish()`: an NCCL entry not completed yet is read again until it completed (its
    duration counted); one that never completes is taken without one when the wait is over,
    as is a gloo entry whose call never came."""
    source = FakeSource()
    now = time.time()
    source.entries = [entry(0, 1, backend="nccl", t=now, state="started")]
    rec, sent = reader(source)

    def complete() -> None:
        time.sleep(0.3)
        source.entries[0] = {**source.entries[0], "state": "completed", "duration_ms": 4.0}

    threading.Thread(target=complete).start()
    t0 = time.monotonic()
    rec.last_read(wait_s=5.0)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert ops(sent) == {"all_reduce": 1} and sent[-1][1]["stats"][0][5:7] == [1, 0.004]

    source = FakeSource()
    source.entries = [entry(0, 1, backend="nccl", t=now, state="started")]
    rec, sent = reader(source)
    rec.last_read(wait_s=0.2)
    assert ops(sent) == {"all_reduce": 1} and sent[-1][1]["stats"][0][5] == 0  # untimed

    source = FakeSource()
    issuing = {object()}  # a call that never returns (another thread stuck in it)
    rec, sent = reader(source, host_calls=deque(), host_issuing=issuing)
    source.entries = [entry(0, 1, "all_reduce", t=now)]
    rec.read_all(False)
    assert ops(sent) == {}
    rec.last_read(wait_s=0.2)
    assert ops(sent) == {"all_reduce": 1}


def test_the_last_read_waits_for_a_group_status_that_has_not_completed_its_last_collective():
    """gloo marks a collective completed in its ring a moment after the call returned: the
    last status read at once said [5, 4]. The last read reads again until the status says
    every issued collective completed (the wait bounded: a stuck one is reported as it is)."""
    source = FakeSource()
    source.status = {"0": {"last_enqueued_collective": 5, "last_completed_collective": 4}}
    rec, _ = reader(source)

    def complete() -> None:
        time.sleep(0.3)
        source.status = {"0": {"last_enqueued_collective": 5, "last_completed_collective": 5}}

    threading.Thread(target=complete).start()
    t0 = time.monotonic()
    rec.last_read(wait_s=5.0)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert rec.heartbeat_fields()["groups"] == {"0": [5, 5]}

    source.status = {"0": {"last_enqueued_collective": 6, "last_completed_collective": 5}}
    t0 = time.monotonic()
    rec.last_read(wait_s=0.2)  # never completes: the status as it is, after the wait
    assert time.monotonic() - t0 >= 0.2 and rec.heartbeat_fields()["groups"] == {"0": [6, 5]}


# --- real jobs ---------------------------------------------------------------------------------

LAYERS, STEPS = 4, 30


@contextlib.contextmanager
def busy_cores(count: int = 2):
    """`count` busy-loop processes for the block's duration: the job competes for every core."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


def per_rank_ops(home) -> dict[int, dict[str, int]]:
    """Each rank's collectives by op, summed over its `collectives` messages in the history."""
    messages, _ = read_messages(history_path(home.name, home))
    out: dict[int, dict[str, int]] = {}
    for _, m in messages:
        if m.type == "collectives":
            for row in m.body.get("stats") or ():
                mine = out.setdefault(m.rank, {})
                mine[row[1]] = mine.get(row[1], 0) + row[3]
    return out


@pytest.mark.integration
@pytest.mark.parametrize("run", range(3))
def test_fsdp2_collectives_are_counted_exactly_with_both_cores_busy(home, run):
    """tests/jobs/fsdp2_plain.py: 4 sharded layers, 30 steps, 2 gloo ranks, 2 busy loops
    beside them. Every rank counted every reduce-scatter, and none as something else."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "--", str(REPO / "tests" / "jobs" /
                                                         "fsdp2_plain.py"),
           "--layers", str(LAYERS), "--steps", str(STEPS)]
    with busy_cores():
        done = subprocess.run(cmd, env=job_env(home), capture_output=True, text=True,
                              timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    state = wait_for(lambda: (s := snapshot(home)) and len(s["ranks"]) == 2 and all(
        r["state"] == "finished" for r in s["ranks"]) and s, timeout=60)
    rows = {(r["group"], r["op"]): r["count"] for r in state["collectives"]}
    mesh = fsdp_group(state)
    assert rows[(mesh, "reduce_scatter")] == LAYERS * STEPS, rows
    assert {op for _, op in rows} == {"all_gather", "reduce_scatter"}, rows
    counted = per_rank_ops(home)
    for rank in (0, 1):
        assert counted[rank]["reduce_scatter"] == LAYERS * STEPS, counted
        assert set(counted[rank]) == {"all_gather", "reduce_scatter"}, counted
    assert counted[0]["all_gather"] == counted[1]["all_gather"], counted
