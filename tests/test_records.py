"""The checks of values read from etcd (rendezvous/records.py): what
rollcall writes passes, anything else is MalformedRecord naming what is
wrong, and no input raises anything else."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcall.membership.checkpoint import CheckpointManifest
from rollcall.membership.config import Config
from rollcall.membership.errors import ControlPlaneUnavailable, MalformedRecord
from rollcall.membership.shards import ShardedView, ShardPlan
from rollcall.membership.view import Member, View
from rollcall.rendezvous import records

CONFIG = Config()
VIEW = View(
    7,
    (Member("w0-1a2b3c4d", "10.0.0.1:29500"), Member("w1-5e6f7a8b", "[::1]:29501")),
    resume_step=120,
    digest="sha256:abc",
    fetch={"w1-5e6f7a8b": ("w0-1a2b3c4d",)},
)
MANIFEST = CheckpointManifest(
    step=100, digest="sha256:abc", uri="/ck/ckpt-000000000100.rcs", size=10, sha256="0" * 64,
    epoch=3, writer="w0-1a2b3c4d", created_unix=1.5e9, step_seconds=0.02,
)  # fmt: skip


def view_with(**changes: Any) -> bytes:
    data = VIEW.to_dict()
    data.update(changes)
    return json.dumps(data).encode()


def member(member_id: str, address: str = "10.0.0.1:1") -> dict[str, str]:
    return {"id": member_id, "address": address}


def test_a_malformed_record_is_a_control_plane_unavailability() -> None:
    # So every task that survives etcd being down survives a bad value too.
    assert issubclass(MalformedRecord, ControlPlaneUnavailable)


def test_a_view_as_rollcall_writes_it_passes() -> None:
    assert records.check_view(VIEW.to_json().encode(), CONFIG) == VIEW


A, B = VIEW.ids
SHARDED = View(
    VIEW.epoch, VIEW.members, VIEW.resume_step, VIEW.digest, VIEW.fetch,
    ShardedView(ShardPlan(((A, B), (B, A), (A,)), 2), sources=((A,), (A,), (A,)),
                base=ShardPlan(((A, "w9-00000000"), (A,), (A,)), 2)),
)  # fmt: skip


def sharded_with(**changes: Any) -> bytes:
    data = SHARDED.to_dict()
    data["shards"] = {**data["shards"], **changes}
    return json.dumps(data).encode()


def test_a_sharded_view_keeps_its_shard_plan() -> None:
    assert records.check_view(SHARDED.to_json().encode(), CONFIG) == SHARDED
    lost = View(3, VIEW.members, shards=ShardedView(ShardPlan(((A, B),), 2), lost=(0,)))
    assert records.check_view(lost.to_json().encode(), CONFIG) == lost


@pytest.mark.parametrize(
    "value, says",
    [
        (view_with(shards=[]), "shards is not an object"),
        (sharded_with(redundancy=0), "redundancy"),
        (sharded_with(owners="x"), "owners"),
        (sharded_with(owners=[[A], [], [A]]), "partition 1 has no owner"),
        (sharded_with(owners=[[A, A], [B], [A]]), "names an owner twice"),
        (sharded_with(owners=[[A], ["fake-1"], [A]]), "non-members fake-1"),
        (sharded_with(sources=[[A]]), "sources name 1 partitions"),
        (sharded_with(sources=[[A], ["fake-1"], [A]]), "non-members fake-1"),
        (sharded_with(lost=[3]), "lost"),
        (sharded_with(lost=["0"]), "lost"),
        (sharded_with(base=[[A]]), "base names 1 partitions"),
        (sharded_with(base=[[A], ["a b"], [A]]), "member id"),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, str) else None,
)
def test_a_malformed_shard_plan_is_refused_naming_what_is_wrong(value: bytes, says: str) -> None:
    with pytest.raises(MalformedRecord, match=says):
        records.check_view(value, CONFIG)


def test_the_empty_view_passes() -> None:
    assert records.check_view(View(0, ()).to_json().encode(), CONFIG) == View(0, ())


def test_unknown_fields_of_a_view_are_let_through() -> None:
    assert records.check_view(view_with(cluster="x", future={"a": 1}), CONFIG) == VIEW


@pytest.mark.parametrize(
    "value, says",
    [
        (b"not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not an object"),
        (b'"view"', "not an object"),
        (view_with(epoch=-1), "epoch"),
        (view_with(epoch="7"), "epoch"),
        (view_with(epoch=7.0), "epoch"),
        (view_with(epoch=True), "epoch"),
        (view_with(epoch=2**63), "epoch"),
        (view_with(members={"a": 1}), "members is not a list"),
        (view_with(members=[member("x"), member("x")]), "duplicate member ids x"),
        (view_with(members=[member("a/b")]), "member id"),
        (view_with(members=[member("")]), "member id"),
        (view_with(members=[member("x", "10.0.0.1 :1")]), "address"),
        (view_with(members=[member("x", "x" * 300)]), "address"),
        (view_with(members=[{"id": "x"}]), "address"),
        (view_with(members=[7]), "not an object"),
        (view_with(members=[{**member("x"), "rank": 3}]), "rank"),
        (view_with(resume_step=-1), "resume_step"),
        (view_with(resume_step="1"), "resume_step"),
        (view_with(digest=5), "digest"),
        (view_with(digest="bad digest!"), "digest"),
        (view_with(fetch=[]), "fetch is not an object"),
        (view_with(fetch={"w1-5e6f7a8b": "w0-1a2b3c4d"}), "not lists of ids"),
        (view_with(fetch_groups={"sources": []}), "fetch_groups is not a list"),
        (view_with(fetch_groups=[["w0-1a2b3c4d"]]), "a fetch group is not an object"),
        (view_with(fetch_groups=[{"sources": "w0-1a2b3c4d", "members": []}]), "not lists of ids"),
        (view_with(fetch_groups=[{"sources": ["fake-1"], "members": ["w0-1a2b3c4d"]}]),
         "non-members fake-1"),
        (view_with(fetch_groups=[{"sources": [], "members": ["w0-1a2b3c4d"]},
                                 {"sources": [], "members": ["w0-1a2b3c4d"]}]), "twice"),
        (view_with(fetch={"w1-5e6f7a8b": ["fake-1"]}), "non-members fake-1"),
        (view_with(fetch={"fake-1": ["w0-1a2b3c4d"]}), "non-members fake-1"),
        (b"[" * 100_000, "not JSON"),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, str) else None,
)
def test_a_malformed_view_is_refused_naming_what_is_wrong(value: bytes, says: str) -> None:
    with pytest.raises(MalformedRecord, match=says):
        records.check_view(value, CONFIG)


def leader_value(**changes: Any) -> bytes:
    data: dict[str, Any] = {"replica_id": "127.0.0.1:7000-a1b2c3", "address": "127.0.0.1:7000",
                            "lease_id": 42}  # fmt: skip
    data.update(changes)
    return json.dumps(data).encode()


def test_a_leader_record_tied_to_the_lease_it_names_passes() -> None:
    assert records.check_leader(leader_value(), 42) == ("127.0.0.1:7000-a1b2c3",
                                                        "127.0.0.1:7000", 42, ())  # fmt: skip


def test_a_leader_records_timing_settings_are_read_and_anything_else_there_is_none() -> None:
    timing = {"rollcall_step_end_wait_s": 0.1, "election_ttl_s": 2}
    assert records.check_leader(leader_value(timing=timing), 42)[3] == (
        ("election_ttl_s", 2.0), ("rollcall_step_end_wait_s", 0.1),
    )  # fmt: skip
    # A replica of another version may write other things: still a leader's
    # record (never removed as planted), with no settings to compare.
    for odd in ("fast", [1, 2], {"election_ttl_s": "2"}, {"election_ttl_s": True},
                {"election_ttl_s": float("nan")}, {"heartbeat_s": 1.0}):  # fmt: skip
        assert records.check_leader(leader_value(timing=odd), 42)[3] == ()
    # What a replica writes reads back equal (its election checks its own record).
    config = Config(rollcall_step_end_wait=0.3, election_ttl=2.5)
    written = json.loads(json.dumps(config.service_timing()))
    assert records.timing_pairs(written) == records.timing_pairs(config.service_timing())
    assert len(records.timing_pairs(written)) == 4


@pytest.mark.parametrize(
    "value, lease, says",
    [
        (leader_value(), 0, "not tied to a lease"),
        (leader_value(), 43, "names lease 42"),
        (b"garbage", 42, "not JSON"),
        (leader_value(replica_id=""), 42, "replica_id"),
        (leader_value(replica_id="x" * 301), 42, "replica_id"),
        (leader_value(replica_id="a\nb"), 42, "replica_id"),
        (leader_value(address=""), 42, "address"),
        (leader_value(lease_id="42"), 42, "lease_id"),
    ],
)
def test_a_planted_leader_record_is_refused(value: bytes, lease: int, says: str) -> None:
    with pytest.raises(MalformedRecord, match=says):
        records.check_leader(value, lease)


def test_a_member_record_passes_with_its_own_id_and_a_lease() -> None:
    value = json.dumps(member("w0-1")).encode()
    assert records.check_member_record("w0-1", value, 5, CONFIG) == Member("w0-1", "10.0.0.1:1")


@pytest.mark.parametrize(
    "key_id, value, lease, says",
    [
        ("w0-1", json.dumps(member("w0-2")).encode(), 5, "not 'w0-1'"),
        ("w0-1", json.dumps(member("w0-1")).encode(), 0, "not tied to a lease"),
        ("w0-1", b"{]", 5, "not JSON"),
        ("w0-1", json.dumps(member("w0-1", "x\x00:1")).encode(), 5, "address"),
    ],
)
def test_a_malformed_member_record_is_refused(
    key_id: str, value: bytes, lease: int, says: str
) -> None:
    with pytest.raises(MalformedRecord, match=says):
        records.check_member_record(key_id, value, lease, CONFIG)


def test_progress_passes_and_malformed_progress_is_refused() -> None:
    assert records.check_progress(b'{"epoch": 3, "step": 9}') == (3, 9)
    for bad in (b'{"epoch": "one", "step": 1}', b'{"epoch": 1}', b"[3, 9]",
                b'{"epoch": 1, "step": -2}'):  # fmt: skip
        with pytest.raises(MalformedRecord):
            records.check_progress(bad)


def test_checkpoints_keep_their_valid_entries_newest_first() -> None:
    older = {**MANIFEST.to_dict(), "step": 50}
    value = json.dumps([older, {"step": -5}, 7, MANIFEST.to_dict(),
                        {**MANIFEST.to_dict(), "sha256": "nope"}]).encode()  # fmt: skip
    kept, skipped = records.check_checkpoints(value, CONFIG)
    assert [m.step for m in kept] == [100, 50]
    assert [s.split(":")[0] for s in skipped] == ["entry 1", "entry 2", "entry 4"]


def test_a_checkpoint_record_that_is_not_a_list_is_refused() -> None:
    with pytest.raises(MalformedRecord, match="not a list"):
        records.check_checkpoints(b'{"step": 1}', CONFIG)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                               max_size=4),
    max_leaves=20,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        JSON.map(lambda v: json.dumps(v).encode()),
        st.fixed_dictionaries(
            {"epoch": JSON, "members": st.lists(JSON | st.builds(member, st.text(max_size=5)),
                                                max_size=3),
             "resume_step": JSON, "digest": JSON, "fetch": JSON},
        ).map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=40),
    ),
)  # fmt: skip
def test_no_value_raises_anything_but_malformed_record(value: bytes) -> None:
    for check in (
        lambda: records.check_view(value, CONFIG),
        lambda: records.check_leader(value, 1),
        lambda: records.check_member_record("x", value, 1, CONFIG),
        lambda: records.check_progress(value),
        lambda: records.check_checkpoints(value, CONFIG),
    ):
        # Either a value of the record's kind or MalformedRecord: any other
        # exception (KeyError, TypeError, RecursionError...) fails the test.
        try:
            result = check()
        except MalformedRecord as exc:
            assert str(exc), "a refusal says why"
        else:
            assert result is not None
