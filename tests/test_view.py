"""The view: ``(epoch, ordered members)``, rank = position, and its JSON form."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollcall.membership.view import EMPTY_VIEW, Member, View

A = Member("a", "10.0.0.1:29500")
B = Member("b", "10.0.0.2:29500")
C = Member("c", "10.0.0.3:29500")


def test_rank_is_position_in_member_list() -> None:
    view = View(epoch=3, members=(B, A, C))

    assert [view.rank_of(m.id) for m in (B, A, C)] == [0, 1, 2]


def test_rank_of_a_non_member_is_none() -> None:
    assert View(epoch=1, members=(A,)).rank_of("b") is None


def test_ids_size_and_membership_follow_member_list() -> None:
    view = View(epoch=2, members=(C, A))

    assert view.ids == ("c", "a")
    assert view.size == 2
    assert "a" in view
    assert "b" not in view


def test_duplicate_member_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        View(epoch=1, members=(A, Member("a", "10.0.0.9:29500")))


def test_negative_epoch_is_rejected() -> None:
    with pytest.raises(ValueError, match="epoch"):
        View(epoch=-1, members=())


def test_empty_view_is_epoch_zero_without_members() -> None:
    assert EMPTY_VIEW.epoch == 0
    assert EMPTY_VIEW.size == 0
    assert EMPTY_VIEW.resume_step is None
    assert EMPTY_VIEW.fetch == {}


def test_json_round_trip_keeps_a_view_without_resume_step() -> None:
    view = View(epoch=1, members=(A, B))

    assert View.from_json(view.to_json()) == view
    assert View.from_json(view.to_json()).resume_step is None


def test_json_round_trip_keeps_resume_step_digest_and_fetch_plan() -> None:
    view = View(
        epoch=7,
        members=(A, B, C),
        resume_step=41,
        digest="sha256:abc",
        fetch={"c": ("a", "b"), "b": ("a",)},
    )

    restored = View.from_json(view.to_json())

    assert restored == view
    assert restored.fetch["c"] == ("a", "b")


def test_json_round_trip_accepts_bytes() -> None:
    view = View(epoch=1, members=(A,), resume_step=0, digest="d")

    assert View.from_json(view.to_json().encode()) == view


def test_json_names_each_members_rank() -> None:
    data = json.loads(View(epoch=1, members=(B, A)).to_json())

    assert [(m["id"], m["rank"]) for m in data["members"]] == [("b", 0), ("a", 1)]


def test_json_does_not_depend_on_fetch_insertion_order() -> None:
    one = View(epoch=1, members=(A, B, C), resume_step=1, fetch={"b": ("a",), "c": ("a",)})
    other = View(epoch=1, members=(A, B, C), resume_step=1, fetch={"c": ("a",), "b": ("a",)})

    assert one.to_json() == other.to_json()


member_ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=8)


@st.composite
def views(draw: st.DrawFn) -> View:
    ids = draw(st.lists(member_ids, unique=True, max_size=6))
    members = tuple(Member(i, f"{i}.example:{draw(st.integers(1, 65535))}") for i in ids)
    fetch = (
        {
            i: tuple(draw(st.lists(st.sampled_from(ids), unique=True, min_size=1)))
            for i in draw(st.lists(st.sampled_from(ids), unique=True))
        }
        if ids
        else {}
    )
    return View(
        epoch=draw(st.integers(0, 2**40)),
        members=members,
        resume_step=draw(st.none() | st.integers(0, 2**40)),
        digest=draw(st.text(max_size=12)),
        fetch=fetch,
    )


@given(views())
def test_any_view_survives_a_json_round_trip(view: View) -> None:
    assert View.from_json(view.to_json()) == view


def test_the_fetch_plan_is_written_once_per_set_of_sources_and_old_records_still_read() -> None:
    view = View(epoch=2, members=(A, B, C), resume_step=4, digest="d",
                fetch={"b": ("a",), "c": ("a",)})  # fmt: skip
    data = json.loads(view.to_json())
    assert data["fetch_groups"] == [{"sources": ["a"], "members": ["b", "c"]}]
    assert "fetch" not in data
    assert View.from_json(view.to_json()) == view
    written_before = {**data, "fetch": {"b": ["a"], "c": ["a"]}}
    del written_before["fetch_groups"]
    assert View.from_dict(written_before) == view


def test_on_the_wire_too_the_plan_goes_as_groups_and_per_member_plans_are_still_read() -> None:
    from rollcall.pb import rendezvous_pb2 as pb
    from rollcall.protocol.wire import view_from_pb, view_to_pb

    view = View(epoch=2, members=(A, B, C), resume_step=4, digest="d",
                fetch={"b": ("a",), "c": ("a",)})  # fmt: skip
    message = view_to_pb(view)
    assert [(list(g.sources), list(g.members)) for g in message.fetch_groups] == [
        (["a"], ["b", "c"])
    ]
    assert len(message.fetch) == 0
    assert view_from_pb(message) == view
    del message.fetch_groups[:]
    message.fetch.extend([pb.FetchPlan(member_id="b", sources=["a"]),
                          pb.FetchPlan(member_id="c", sources=["a"])])  # fmt: skip
    assert view_from_pb(message) == view
