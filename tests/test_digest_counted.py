"""A summary's digest (scalemon/state/digest.py `RunDigest`) counts the ranks whose tokens/s
count for the job as `throughput.counted` does over every rank, whatever order the ranks'
first figures come in, without a pass over every rank at each new one (property-based, with
hypothesis); a digest of an earlier scalemon (no `group_best`) makes it again once."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from scalemon import throughput
from scalemon.protocol import Message
from scalemon.state.digest import RunDigest

MESHES = st.lists(
    st.one_of(st.none(), st.fixed_dictionaries(
        {"dp": st.integers(0, 2)},
        optional={"tp": st.integers(0, 2), "pp": st.integers(0, 1)})),
    min_size=1, max_size=12)


def step(rank: int, step_no: int = 1) -> Message:
    return Message("step", "j", rank, step_no, 1000.0 + step_no,
                   {"step": step_no, "extra": {"tokens_per_s": 100.0 + rank}})


@settings(max_examples=200, deadline=None)
@given(MESHES, st.randoms(use_true_random=False))
def test_the_ranks_counted_are_those_a_pass_over_every_rank_counts(
        meshes: list[Any], rng: Any) -> None:
    order = list(range(len(meshes)))
    rng.shuffle(order)
    digest = RunDigest()
    for rank in order:
        digest.add(step(rank), lambda r: meshes[r])
        seen = sorted(order[:order.index(rank) + 1])
        assert digest.counted == set(throughput.counted((r, meshes[r]) for r in seen))
    figures = digest.figures()
    assert figures.tokens_ranks == throughput.counted((r, meshes[r]) for r in range(len(meshes)))


def test_a_digest_without_its_groups_makes_them_again_once() -> None:
    meshes = [{"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 1}, {"dp": 1, "tp": 0}]
    digest = RunDigest()
    for rank in (1, 2):
        digest.add(step(rank), lambda r: meshes[r])
    assert digest.counted == {1, 2}
    del digest.group_best  # as pickled by an earlier scalemon: the class's None shows
    assert digest.group_best is None
    for rank in (0, 3):
        digest.add(step(rank), lambda r: meshes[r])
    assert digest.counted == {0, 3} and digest.recounted  # tp 0 of each dp group counts
    assert digest.group_best is not None
