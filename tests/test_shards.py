"""The shard plan (``rollcall.membership.shards``): every partition keeps
``redundancy`` copies on distinct members, away from shared hosts where it
can; the first plan's loads are within one partition; a joiner gets its
share; live owners keep their copies across kills; a re-plan after kills
or after joins transfers exactly the fewest copies it can."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcall.membership.shards import ShardPlan, least_moves, moves, partition_bounds, place


@given(numel=st.integers(0, 10_000), count=st.integers(1, 300))
def test_partitions_cover_the_state_contiguously_in_near_equal_parts(
    numel: int, count: int
) -> None:
    bounds = partition_bounds(numel, count)
    assert len(bounds) == count and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1


def _members(n: int, prefix: str = "w") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def _check(
    plan: ShardPlan, members: list[str], redundancy: int, count: int, balanced: bool = True
) -> None:
    copies = min(redundancy, len(members))
    assert plan.count == count
    for owners in plan.owners:
        assert len(owners) == copies and set(owners) <= set(members)
    load = plan.load()
    loads = [load.get(m, 0) for m in members]
    if balanced:
        assert min(loads) >= count * copies // len(members), load  # nobody below its share
        assert max(loads) - min(loads) <= 1, load


@given(hosts=st.integers(1, 6), per_host=st.integers(1, 4), redundancy=st.integers(1, 3),
       count=st.integers(1, 80))  # fmt: skip
def test_the_first_plan_is_balanced_and_keeps_copies_off_a_shared_host(
    hosts: int, per_host: int, redundancy: int, count: int
) -> None:
    members = _members(hosts * per_host)
    label = {m: f"h{i // per_host}" for i, m in enumerate(members)}  # hosts of equal size
    plan = place(members, label, count, redundancy)
    _check(plan, members, redundancy, count)
    if hosts >= redundancy:
        for owners in plan.owners:
            assert len({label[m] for m in owners}) == len(owners), (owners, label)


@settings(max_examples=300)
@given(
    size=st.integers(1, 12), redundancy=st.integers(1, 3), count=st.integers(1, 64),
    data=st.data(),
)  # fmt: skip
def test_a_view_change_keeps_live_copies_and_moves_only_what_it_must(
    size: int, redundancy: int, count: int, data: st.DataObject
) -> None:
    members = _members(size)
    before = place(members, {}, count, redundancy)
    dead = data.draw(st.sets(st.sampled_from(members), max_size=size - 1))
    joiners = _members(data.draw(st.integers(0, 4)), prefix="j")
    after_members = [m for m in members if m not in dead] + joiners
    after = place(after_members, {}, count, redundancy, previous=before)
    _check(after, after_members, redundancy, count, balanced=False)
    copies = min(redundancy, len(after_members))
    load = after.load()
    for joiner in joiners:  # a joiner gets at least its share
        assert load.get(joiner, 0) >= count * copies // len(after_members), load
    if not joiners:  # a live copy moves only to make room for a joiner
        for old, new in zip(before.owners, after.owners, strict=True):
            live = [m for m in old if m not in dead]
            assert set(live[:copies]) <= set(new), (old, new)
    moved = len(moves(before, after))
    least = least_moves(before, after_members, redundancy)
    if not joiners or not dead:  # only kills, or only joins: exactly the minimum
        assert moved == least, (moved, least, before.owners, after.owners)
    else:
        assert moved >= least


def test_a_partition_without_a_live_owner_is_reported() -> None:
    plan = place(_members(4), {}, 4, 2)
    assert plan.owners == (("w0", "w1"), ("w2", "w3"), ("w0", "w1"), ("w2", "w3"))
    assert plan.uncovered({"w2", "w3"}) == (0, 2)
    assert plan.uncovered({"w0", "w2"}) == ()


def test_bad_plans_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one member"):
        place([], {}, 4, 2)
    with pytest.raises(ValueError, match="fixed for a job"):
        place(["a"], {}, 8, 2, previous=place(["a"], {}, 4, 2))
    with pytest.raises(ValueError, match="names an owner twice"):
        ShardPlan((("a", "a"),), 2)
    plan = place(_members(3), {}, 5, 2)
    assert ShardPlan.from_dict(plan.to_dict()) == plan
