"""The shard plan (``rollcall.membership.shards``): every partition keeps
``redundancy`` copies on distinct members, away from shared hosts where it
can; the first plan's loads are within one partition; a joiner gets its
share; live owners keep their copies across kills; a re-plan after kills
or after joins transfers exactly the fewest copies it can."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcall.membership.coordinator import Answer, RollCall, decide_view
from rollcall.membership.shards import (
    Sharding,
    ShardPlan,
    least_moves,
    moves,
    partition_bounds,
    place,
)
from rollcall.membership.view import EMPTY_VIEW, View
from rollcall.membership.view import Member as ViewMember
from rollcall.protocol.wire import view_from_pb, view_to_pb


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


# --- the sharded part of a view, as the leader decides it ---------------------------


def _decide(
    previous: View, members: list[str], steps: dict[str, int | None], sharding: Sharding,
    shard_epochs: dict[str, int] | None = None,
) -> View:  # fmt: skip
    """The view a roll call over ``members`` (answering ``steps``, and the
    epoch of the shard plan each holds, ``shard_epochs``) decides after
    ``previous``."""
    candidates = tuple(ViewMember(m, f"10.0.0.{i}:1") for i, m in enumerate(members))
    rollcall = RollCall(previous.epoch + 1, candidates, deadline=0.0, started_at=0.0, causes=())
    for m in members:
        step = steps[m]
        held = (shard_epochs or {}).get(m)
        rollcall.answers[m] = Answer(m, step, "" if step is None else f"d{step}", held)
    view = decide_view(rollcall, previous, {}, sharding).view
    return view


def test_the_leader_plans_the_shards_of_each_view_and_names_where_each_partition_is_held() -> None:
    sharding = Sharding(8, 2)
    start = _decide(EMPTY_VIEW, ["a", "b", "c", "d"], dict.fromkeys("abcd"), sharding)
    assert start.shards is not None and start.shards.sources == () and start.shards.base is None
    assert all(len(o) == 2 for o in start.shards.plan.owners)
    trained = View(start.epoch, start.members, 5, "d5", {}, start.shards)
    # b dies: every partition keeps two live owners, the copies come from
    # the holders of step 5, and nothing else moves.
    shrunk = _decide(trained, ["a", "c", "d"], {"a": 6, "c": 6, "d": 6}, sharding)
    assert shrunk.resume_step == 6 and shrunk.shards is not None
    assert shrunk.shards.base == start.shards.plan
    assert all(len(o) == 2 and "b" not in o for o in shrunk.shards.plan.owners)
    assert shrunk.shards.sources == tuple(
        tuple(m for m in o if m != "b") for o in start.shards.plan.owners
    )
    assert len(moves(start.shards.plan, shrunk.shards.plan)) == len(start.shards.plan.owned_by("b"))


def test_a_member_behind_by_a_step_does_not_count_as_holding_its_copies() -> None:
    sharding = Sharding(4, 2)
    start = _decide(EMPTY_VIEW, ["a", "b"], dict.fromkeys("ab"), sharding)
    trained = View(start.epoch, start.members, 3, "d3", {}, start.shards)
    view = _decide(trained, ["a", "b"], {"a": 4, "b": 3}, sharding)
    assert view.resume_step == 4 and view.shards is not None
    assert view.shards.sources == (("a",),) * 4
    assert view.shards.lost == ()


def test_both_owners_gone_makes_a_view_that_resumes_from_the_checkpoint() -> None:
    sharding = Sharding(8, 2)
    start = _decide(EMPTY_VIEW, ["a", "b", "c", "d"], dict.fromkeys("abcd"), sharding)
    assert start.shards is not None
    trained = View(start.epoch, start.members, 5, "d5", {}, start.shards)
    [pair] = {o for o in start.shards.plan.owners if "a" in o}
    rest = [m for m in "abcd" if m not in pair]
    view = _decide(trained, rest, dict.fromkeys(rest, 6), sharding)
    assert view.shards is not None
    assert view.shards.lost == tuple(p for p, o in enumerate(start.shards.plan.owners) if o == pair)
    # Nothing of the members' state is used: no resume step, nobody fetches,
    # and a fresh plan over the survivors.
    assert (view.resume_step, view.digest, dict(view.fetch)) == (None, "", {})
    assert view.shards.sources == () and view.shards.base is None
    assert {m for o in view.shards.plan.owners for m in o} == set(rest)


def test_until_a_step_commits_in_a_view_its_members_are_taken_to_hold_the_earlier_plan() -> None:
    sharding = Sharding(8, 2)
    start = _decide(EMPTY_VIEW, ["a", "b", "c", "d"], dict.fromkeys("abcd"), sharding)
    trained = View(start.epoch, start.members, 5, "d5", {}, start.shards)
    shrunk = _decide(trained, ["a", "c", "d"], dict.fromkeys("acd", 6), sharding)
    # The move into `shrunk` was aborted before any step: the members still
    # hold the copies of `start`'s plan (they keep them until a step).
    again = _decide(shrunk, ["a", "c", "d", "e"], {"a": 6, "c": 6, "d": 6, "e": None}, sharding)
    assert again.shards is not None and start.shards is not None
    assert again.shards.base == start.shards.plan
    after_step = _decide(
        View(again.epoch, again.members, 6, "d6", {}, again.shards),
        ["a", "c", "d", "e"], dict.fromkeys("acde", 7), sharding,
    )  # fmt: skip
    assert after_step.shards is not None and after_step.shards.base == again.shards.plan


def test_copies_taken_in_a_view_where_no_step_committed_count_for_the_members_that_took_them():
    # d leaves after step 5; the others enter that view and take d's copies,
    # then c is killed before any step commits in it. The partitions c and d
    # held together under the first plan are held by whoever took d's copy:
    # the members say they moved to the view's plan (the epoch of the plan
    # they hold), and that is not a loss.
    sharding = Sharding(8, 2)
    start = _decide(EMPTY_VIEW, ["a", "b", "c", "d"], dict.fromkeys("abcd"), sharding)
    assert start.shards is not None
    shared = tuple(p for p, o in enumerate(start.shards.plan.owners) if set(o) == {"c", "d"})
    assert shared, "c and d share a partition in the first plan"
    trained = View(start.epoch, start.members, 5, "d5", {}, start.shards)
    left = _decide(trained, ["a", "b", "c"], dict.fromkeys("abc", 5), sharding)
    assert left.shards is not None and left.shards.lost == ()
    took = {p: {m for m in left.shards.plan.owners[p] if m != "c"} for p in shared}
    assert all(took.values())
    moved = {"a": left.epoch, "b": left.epoch}
    after = _decide(left, ["a", "b"], dict.fromkeys("ab", 5), sharding, moved)
    assert after.shards is not None and after.shards.lost == ()
    assert after.resume_step == 5
    for p in shared:
        assert set(after.shards.sources[p]) == took[p]
    # Members that did not say so (an older worker, or one whose move was
    # aborted) hold only the first plan's copies: those partitions are lost.
    unmoved = _decide(left, ["a", "b"], dict.fromkeys("ab", 5), sharding)
    assert unmoved.shards is not None and unmoved.shards.lost == shared


def test_a_sharded_view_travels_through_json_and_protobuf_unchanged() -> None:
    sharding = Sharding(6, 2)
    start = _decide(EMPTY_VIEW, ["a", "b", "c"], dict.fromkeys("abc"), sharding)
    trained = View(start.epoch, start.members, 2, "d2", {}, start.shards)
    for view in (start, _decide(trained, ["a", "b"], dict.fromkeys("ab", 3), sharding),
                 _decide(trained, ["c"], {"c": 3}, sharding)):  # fmt: skip
        assert View.from_json(view.to_json()) == view
        assert view_from_pb(view_to_pb(view)) == view


def test_the_sharding_setting_is_read_from_the_job_fingerprint() -> None:
    assert Sharding.from_fingerprint(Sharding(64, 2).fields()) == Sharding(64, 2)
    assert Sharding.from_fingerprint({"global_batch": "8"}) is None
    assert Sharding.from_fingerprint({"shard_partitions": "x", "shard_redundancy": "2"}) is None
    with pytest.raises(ValueError, match="redundancy"):
        Sharding(4, 0)
