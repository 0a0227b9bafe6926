"""Views announced as changes of the previous view (rollcall.membership.delta):
a change rebuilds exactly the view it was made from, and only on the view
it was made against; anything else is refused rather than acted on."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from rollcall.membership.delta import ViewDelta, apply_delta, delta_between
from rollcall.membership.shards import Sharding, decide_shards
from rollcall.membership.view import Member, View
from rollcall.protocol.wire import delta_from_pb, delta_to_pb


def member(n: int) -> Member:
    return Member(f"w{n}-{n:08x}", f"127.0.0.1:{20000 + n}")


def base_view(size: int, epoch: int = 4) -> View:
    return View(epoch, tuple(member(n) for n in range(size)), 7, "sha256:" + "b" * 64)


@st.composite
def changes(draw: st.DrawFn) -> tuple[View, View]:
    """A view and the next one as a roll call decides it: some members
    removed, the survivors in their order, joiners appended, and maybe a
    fetch plan naming members of the new view."""
    size = draw(st.integers(0, 40))
    base = base_view(size)
    kept = [m for m in base.members if draw(st.booleans())]
    joiners = tuple(member(1000 + n) for n in range(draw(st.integers(0, 5))))
    members = (*kept, *joiners)
    fetch: dict[str, tuple[str, ...]] = {}
    if members and draw(st.booleans()):
        ids = [m.id for m in members]
        sources = tuple(draw(st.lists(st.sampled_from(ids), min_size=1, max_size=4, unique=True)))
        for fetcher in draw(st.lists(st.sampled_from(ids), max_size=6, unique=True)):
            fetch[fetcher] = sources
    resume = draw(st.none() | st.integers(0, 2**63 - 1))
    digest = draw(st.sampled_from(["", "sha256:" + "c" * 64]))
    epoch = base.epoch + draw(st.integers(1, 3))
    return base, View(epoch, members, resume, digest, fetch)


@settings(max_examples=200, deadline=None)
@given(changes())
def test_a_change_rebuilds_exactly_the_view_it_was_made_from(change: tuple[View, View]) -> None:
    base, view = change
    delta = delta_between(base, view)
    assert delta is not None
    assert apply_delta(base, delta) == view
    # And so does the change after its trip over the wire.
    assert apply_delta(base, delta_from_pb(delta_to_pb(delta))) == view


@settings(max_examples=100, deadline=None)
@given(changes())
def test_a_change_does_not_apply_to_any_other_view(change: tuple[View, View]) -> None:
    base, view = change
    delta = delta_between(base, view)
    assert delta is not None
    older = dataclasses.replace(base, epoch=base.epoch - 1)
    assert apply_delta(older, delta) is None
    assert apply_delta(view, delta) is None  # already newer


def test_a_member_that_missed_a_change_cannot_use_the_next_one() -> None:
    first = base_view(6)
    second = View(first.epoch + 1, first.members[1:])  # w0 crashed
    third = View(second.epoch + 1, (*second.members[:2], *second.members[3:], member(99)))
    delta = delta_between(second, third)
    assert delta is not None
    # The member still holds `first` (it missed the change to `second`).
    assert apply_delta(first, delta) is None
    # Even if the epochs were made to line up, the ranks it removes are
    # ranks of `second`, and the list it would build does not hash right.
    relabelled = dataclasses.replace(first, epoch=second.epoch)
    assert apply_delta(relabelled, delta) is None


def test_a_change_whose_list_does_not_hash_right_is_refused() -> None:
    base = base_view(5)
    view = View(base.epoch + 1, base.members[:4])
    delta = delta_between(base, view)
    assert delta is not None
    for tampered in (
        dataclasses.replace(delta, removed=(3,)),
        dataclasses.replace(delta, added=(member(50),)),
        dataclasses.replace(delta, members_sha256=bytes(32)),
    ):
        assert apply_delta(base, tampered) is None


def test_malformed_changes_are_refused() -> None:
    base = base_view(5)
    good = delta_between(base, View(base.epoch + 1, base.members[:3]))
    assert good is not None
    assert good.removed == (3, 4)
    for bad in (
        dataclasses.replace(good, removed=(4, 3)),  # not ascending
        dataclasses.replace(good, removed=(3, 3, 4)),  # twice
        dataclasses.replace(good, removed=(3, 5)),  # beyond the base
        dataclasses.replace(good, added=(base.members[0],)),  # a member twice
        dataclasses.replace(good, fetch_groups=(((0,), (7,)),)),  # a rank past the view
    ):
        assert apply_delta(base, bad) is None


def test_views_that_reorder_members_or_carry_a_shard_plan_are_sent_whole() -> None:
    base = base_view(4)
    swapped = View(base.epoch + 1, (base.members[1], base.members[0], *base.members[2:]))
    assert delta_between(base, swapped) is None
    ids = [m.id for m in base.members]
    hosts = {m.id: m.address.rpartition(":")[0] for m in base.members}
    shards = decide_shards(Sharding(8, 2), None, False, ids, hosts, None)
    assert delta_between(base, dataclasses.replace(base, epoch=base.epoch + 1,
                                                   shards=shards)) is None  # fmt: skip
    assert delta_between(base, base) is None  # not newer


def test_a_change_of_one_member_in_2048_is_small() -> None:
    base = base_view(2048)
    view = View(base.epoch + 1, base.members[:1000] + base.members[1001:])
    delta = delta_between(base, view)
    assert delta is not None
    from rollcall.pb import rendezvous_pb2 as pb
    from rollcall.protocol.wire import view_to_pb

    whole = len(pb.SessionEvent(view=view_to_pb(view)).SerializeToString())
    change = len(pb.SessionEvent(view_delta=delta_to_pb(delta)).SerializeToString())
    assert whole > 50_000 and change < 100, (whole, change)


def test_a_change_is_said_by_rank_and_appended_members() -> None:
    base = base_view(4)
    view = View(base.epoch + 1, (base.members[0], base.members[2], member(9)),
                fetch={member(9).id: (base.members[0].id,)})  # fmt: skip
    delta = delta_between(base, view)
    assert delta == ViewDelta(
        epoch=base.epoch + 1,
        base_epoch=base.epoch,
        removed=(1, 3),
        added=(member(9),),
        members_sha256=view.members_sha256,
        resume_step=None,
        digest="",
        fetch_groups=(((0,), (2,)),),
    )


# --- the member's side (no service: the client's handling of one event) ----------


def test_a_member_that_cannot_apply_a_change_asks_for_the_whole_view_and_keeps_its_own() -> None:
    from rollcall.protocol.client import RendezvousClient

    first = base_view(6)
    second = View(first.epoch + 1, first.members[1:])
    third = View(second.epoch + 1, second.members[1:])
    seen: list[View] = []
    client = RendezvousClient(["127.0.0.1:1"], "job", "token")
    client._on_view = seen.append
    client._set_view(first)

    client._apply_delta(delta_between(second, third))  # it missed `second`

    assert client.view == first and seen == [first]
    request = client._outbox.get_nowait()
    assert request.WhichOneof("kind") == "view_request"
    assert request.view_request.epoch == first.epoch

    client._apply_delta(delta_between(first, second))
    assert client.view == second and seen == [first, second]
    assert client._outbox.empty()


def test_a_member_heartbeats_as_told_but_within_its_fence_window() -> None:
    from rollcall.membership.config import Config
    from rollcall.protocol.client import RendezvousClient

    client = RendezvousClient(["127.0.0.1:1"], "job", "token", Config())
    client._pace(250)
    assert client.heartbeat_interval == 0.25
    client._pace(900)  # beyond 0.6 x fence_window (0.5 s)
    assert client.heartbeat_interval == 0.3
    client._pace(0)  # a service that does not say
    assert client.heartbeat_interval == 0.3


def test_a_member_refuses_a_service_that_waits_less_for_a_step_end_than_it_would() -> None:
    from rollcall.membership.config import Config
    from rollcall.membership.errors import UnsafeStepEndWait
    from rollcall.pb import rendezvous_pb2 as pb
    from rollcall.protocol.client import RendezvousClient

    def unsafe(own: float, service: float) -> object:
        client = RendezvousClient(
            ["127.0.0.1:1"], "job", "token", Config(rollcall_step_end_wait=own)
        )
        return client._unsafe_timing(
            pb.JoinResponse(rollcall_deadline_s=1.0, rollcall_step_end_wait_s=service)
        )

    assert unsafe(0.5, 0.5) is None
    assert unsafe(0.3, 0.5) is None  # giving a step up sooner is safe
    assert unsafe(0.1 + 0.2, 0.3) is None  # the same setting, as a double
    assert unsafe(4.0, 0.0) is None  # a service that does not say
    refusal = unsafe(4.0, 0.5)
    assert isinstance(refusal, UnsafeStepEndWait)
    assert (refusal.wait, refusal.service_wait) == (4.0, 0.5)


def test_a_member_refuses_a_service_whose_leader_failover_outlasts_its_fence_patience() -> None:
    from rollcall.membership.config import Config
    from rollcall.membership.errors import UnsafeFencePatience
    from rollcall.pb import rendezvous_pb2 as pb
    from rollcall.protocol.client import RendezvousClient

    def unsafe(election_ttl: float) -> object:
        client = RendezvousClient(["127.0.0.1:1"], "job", "token", Config())  # 5 s patience
        return client._unsafe_timing(pb.JoinResponse(election_ttl_s=election_ttl))

    assert unsafe(2.0) is None  # the default: 2 s + 1 s of session_open_timeout
    assert unsafe(4.0) is None  # 4 + 1 = 5 s: covered exactly
    assert unsafe(0.0) is None  # a service that does not say
    refusal = unsafe(6.0)
    assert isinstance(refusal, UnsafeFencePatience)
    assert "up to 7 s" in str(refusal) and "fence_patience=SECONDS" in str(refusal)


def test_a_member_checks_the_timing_of_each_leader_its_session_opens_on() -> None:
    import asyncio

    from rollcall.membership.config import Config
    from rollcall.membership.errors import UnsafeStepEndWait
    from rollcall.pb import rendezvous_pb2 as pb
    from rollcall.protocol.client import RendezvousClient
    from rollcall.protocol.wire import view_to_pb

    def timing(deadline: float, wait: float) -> pb.SessionEvent:
        return pb.SessionEvent(
            timing=pb.ServiceTiming(rollcall_deadline_s=deadline, rollcall_step_end_wait_s=wait)
        )

    async def scenario() -> None:
        client = RendezvousClient(["127.0.0.1:1"], "job", "token", Config())  # waits 0.5 s
        client._set_view(base_view(3, epoch=4))
        # Settings that fit: kept, for the answer deadline.
        await client._on_event(timing(2.0, 0.5))
        assert client.answer_deadline(at_step_end=True) == 2.5
        assert client.ended is None and not client.refused_leader
        # A leader that waits less for a step's end: refused, and nothing
        # more of it is acted on while the member leaves.
        await client._on_event(timing(1.0, 0.1))
        assert isinstance(client.ended, UnsafeStepEndWait)
        assert client.refused_leader
        assert client.answer_deadline(at_step_end=True) == 2.5
        await client._on_event(pb.SessionEvent(view=view_to_pb(base_view(2, epoch=9))))
        assert client.view.epoch == 4
        await client.close()

    asyncio.run(scenario())


def test_members_of_one_process_share_the_rebuild_of_a_change_to_the_same_view() -> None:
    from rollcall.protocol.client import RendezvousClient

    first = base_view(6)
    second = View(first.epoch + 1, first.members[2:])
    one, two, three = (RendezvousClient(["127.0.0.1:1"], "job", "token") for _ in range(3))
    one._set_view(first)
    two._set_view(first)
    three._set_view(dataclasses.replace(first))  # equal, but its own object
    change = delta_between(first, second)

    for client in (one, two, three):
        client._apply_delta(change)

    assert one.view is two.view and one.view == second
    assert three.view == second
