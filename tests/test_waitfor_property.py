"""Property-based tests of the wait-for rule (`reports.waitfor.wait_for_graph`): random groups
over random ranks, random waits (through collectives: a rank issued one more of a group than
the rank it waits for; through P2P: recv from / send to that rank), random dead ends (gone, in
Python) and cycles. The culprits are exactly the ends of the chains and the ranks on cycles;
nobody is blamed whom nobody waits for."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from scalemon.reports.waitfor import wait_for_graph

EXAMPLES = settings(max_examples=100, deadline=None)


@dataclass
class Job:
    """A generated hang and what the rule must find in it."""

    ranks: int
    parent: dict[int, int] = field(default_factory=dict)  # rank -> the rank it waits for
    link: dict[int, str] = field(default_factory=dict)  # rank -> "coll" | "recv" | "send"
    cycle: list[int] = field(default_factory=list)
    gone: set[int] = field(default_factory=set)
    noise: list[list[int]] = field(default_factory=list)

    def inputs(self) -> tuple[dict, dict, dict]:
        """(status, members, p2p) as the hub hands them to `wait_for_graph`."""
        status: dict[int, dict[str, list[int]]] = {r: {"world": [9, 9]} for r in range(self.ranks)}
        members: dict[str, tuple[int, ...]] = {"world": tuple(range(self.ranks))}
        for i, ranks in enumerate(self.noise):  # groups where every member completed all
            members[f"n{i}"] = tuple(sorted(ranks))
            for r in ranks:
                status[r][f"n{i}"] = [5, 5]
        p2p: dict[int, list[list]] = {}
        for rank, awaited in self.parent.items():
            group = f"L{rank}"
            members[group] = tuple(sorted((rank, awaited)))
            if self.link[rank] == "coll":  # it issued one more than `awaited`
                status[rank][group], status[awaited][group] = [2, 1], [1, 1]
            else:
                p2p[rank] = [[group, self.link[rank], awaited, 100.0 + rank, 64]]
        return status, members, p2p

    def ends(self) -> set[int]:
        """Dead ends somebody waits for (gone or in Python), and the ranks on the cycle."""
        return {p for p in self.parent.values() if p not in self.parent} | set(self.cycle)


@st.composite
def jobs(draw: st.DrawFn) -> Job:
    n = draw(st.integers(2, 10))
    order = draw(st.permutations(range(n)))
    job = Job(n)
    cycle_len = draw(st.sampled_from([0, 0, 2, 3]))
    if cycle_len and n >= cycle_len:
        job.cycle = list(order[:cycle_len])
        for i, rank in enumerate(job.cycle):
            job.parent[rank] = job.cycle[(i + 1) % cycle_len]
    placed = list(job.cycle)
    for rank in order[len(job.cycle):]:  # a forest: each rank waits for an earlier one or not
        if placed and draw(st.booleans()):
            job.parent[rank] = draw(st.sampled_from(placed))
        placed.append(rank)
    for rank in job.parent:
        job.link[rank] = draw(st.sampled_from(["coll", "recv", "send"]))
    for rank, awaited in job.parent.items():  # a send to a rank that receives from it: both
        if job.link[rank] == "send" and job.parent.get(awaited) == rank \
                and job.link[awaited] == "recv":  # sides issued it; make it a real wait
            job.link[rank] = "recv"
    roots = [r for r in range(n) if r not in job.parent]
    job.gone = {r for r in roots if draw(st.booleans())}
    job.noise = draw(st.lists(st.lists(st.integers(0, n - 1), min_size=1, max_size=n,
                                       unique=True), max_size=3))
    return job


@EXAMPLES
@given(jobs())
def test_the_culprits_are_exactly_the_ends_of_the_chains(job: Job):
    status, members, p2p = job.inputs()
    found = wait_for_graph(status, members, job.gone, p2p=p2p)
    if not job.parent:
        assert found is None
        return
    assert set(found["culprits"]) == job.ends()
    for rank in job.ends() - set(job.cycle):
        assert found["causes"][rank] == {"cause": "gone" if rank in job.gone else "python"}
    for rank in job.cycle:
        assert found["causes"][rank]["cause"] == "deadlock"
    assert set(found["waiting"]) == set(job.parent) - set(job.cycle)
    for rank, awaited in job.parent.items():
        wait = found["waits"][rank]
        assert wait["for"] == [awaited]
        assert (wait["seq"] is None) == (job.link[rank] != "coll")


@EXAMPLES
@given(jobs())
def test_nobody_is_blamed_whom_nobody_waits_for_and_chains_follow_the_waits(job: Job):
    status, members, p2p = job.inputs()
    found = wait_for_graph(status, members, job.gone, p2p=p2p)
    if found is None:
        return
    awaited = {r for w in found["waits"].values() for r in w["for"]}
    assert set(found["culprits"]) <= awaited  # no desync, no teardown here
    for chain in found["chains"]:
        for waiter, next_rank in zip(chain, chain[1:], strict=False):
            assert next_rank in found["waits"][waiter]["for"]
        assert chain[-1] in found["culprits"] or chain[-1] in chain[:-1] or (
            len(set(chain)) == len(chain) and chain[-1] in job.cycle)
    for chain in found["chains"]:  # a chain from a rank nobody waits for ends at its end
        if chain[0] not in awaited and not set(chain) & set(job.cycle):
            end = chain[0]
            while end in job.parent:
                end = job.parent[end]
            assert chain[-1] == end
