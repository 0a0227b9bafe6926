"""Values in etcd that rollcall did not write (planted, forged or corrupted),
against a real replica process on a real etcd: each is logged and ignored,
or the replica refuses to lead with one clear line, and no task of the
replica dies of it (docs/protocol.md, "What is read from etcd is checked").

The values are written straight into etcd, as a holder of etcd's
credentials could; the pure checks of every record kind are in
tests/test_records.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyetcd.client import Endpoint, MultiEndpointEtcd3Client

from rollcall.etcd_local import LocalEtcd
from tests.harness import ControlPlane, MemberProcess, wait_for

pytestmark = pytest.mark.integration

#: Bound on anything the replica has to do about a planted value (its view
#: poll runs every second, a campaign waits at most election_ttl).
PROMPT = 15.0


def raw_etcd(endpoint: str) -> MultiEndpointEtcd3Client:
    """A plain etcd client, independent of the code under test."""
    host, _, port = endpoint.removeprefix("http://").rpartition(":")
    return MultiEndpointEtcd3Client([Endpoint(host, int(port), secure=False)], timeout=5)


@pytest.fixture
def raw(etcd: LocalEtcd) -> Iterator[MultiEndpointEtcd3Client]:
    client = raw_etcd(etcd.endpoint)
    try:
        yield client
    finally:
        client.close()


def key(plane: ControlPlane, name: str) -> str:
    return f"/rollcall/jobs/{plane.job}/{name}"


def replica_log(plane: ControlPlane, index: int = 0) -> str:
    return (plane.workdir / f"replica{index}.log").read_text(errors="replace")


def member_ids(plane: ControlPlane) -> list[str]:
    return [m["id"] for m in plane.status_json()["members"]]


def in_view(plane: ControlPlane, *members: MemberProcess) -> bool:
    try:
        return sorted(member_ids(plane)) == sorted(m.member_id for m in members)
    except RuntimeError:
        return False


def seen_members(member: MemberProcess) -> set[str]:
    """Every member id in any view this member received."""
    return {m for view in member.views() for m in view["members"]}


def stored_view(raw: MultiEndpointEtcd3Client, plane: ControlPlane) -> dict[str, Any]:
    value, _ = raw.get(key(plane, "view"))
    return dict(json.loads(value))


def two_members(plane: ControlPlane) -> tuple[MemberProcess, MemberProcess]:
    a, b = plane.add_member("a"), plane.add_member("b")
    wait_for(lambda: in_view(plane, a, b), "a view of both members", PROMPT)
    return a, b


def test_a_view_that_is_not_json_does_not_stop_the_leader(
    control_plane: ControlPlane, raw: MultiEndpointEtcd3Client
) -> None:
    a, b = two_members(control_plane)
    raw.put(key(control_plane, "view"), "not json")

    # The leader puts its own view back, and view changes go on.
    restored = lambda: raw.get(key(control_plane, "view"))[0] != b"not json"  # noqa: E731
    wait_for(restored, "the view restored", PROMPT)
    c = control_plane.add_member("c")
    wait_for(lambda: in_view(control_plane, a, b, c), "a view with the joiner", PROMPT)
    log = replica_log(control_plane)
    assert "Traceback" not in log, log
    assert "malformed" in log and "not JSON" in log


def test_a_view_forged_behind_the_leaders_back_is_not_adopted(
    control_plane: ControlPlane, raw: MultiEndpointEtcd3Client
) -> None:
    a, b = two_members(control_plane)
    forged = stored_view(raw, control_plane)
    forged["epoch"] += 1
    forged["members"].append({"id": "fake-1", "address": "127.0.0.1:9", "rank": 2})
    raw.put(key(control_plane, "view"), json.dumps(forged))

    wait_for(
        lambda: "fake-1" not in json.dumps(stored_view(raw, control_plane)),
        "the leader's view back in etcd", PROMPT,
    )  # fmt: skip
    assert "fake-1" not in member_ids(control_plane)
    c = control_plane.add_member("c")
    wait_for(lambda: in_view(control_plane, a, b, c), "a view with the joiner", PROMPT)
    assert "fake-1" not in seen_members(a) | seen_members(b) | seen_members(c)
    assert sorted(m["id"] for m in stored_view(raw, control_plane)["members"]) == sorted(
        [a.member_id, b.member_id, c.member_id]
    )
    assert "not written by this job's leader" in replica_log(control_plane)


@pytest.mark.parametrize(
    "value, says",
    [
        ("not json", "not JSON"),
        ('{"epoch": 3, "members": [{"id": "x", "address": "127.0.0.1:1"},'
         ' {"id": "x", "address": "127.0.0.1:2"}]}', "duplicate"),
        ('{"epoch": -1, "members": []}', "epoch"),
    ],
    ids=["not-json", "duplicate-ids", "negative-epoch"],
)  # fmt: skip
def test_a_replica_refuses_to_lead_on_a_malformed_view_and_leads_once_it_is_gone(
    etcd: LocalEtcd, raw: MultiEndpointEtcd3Client, tmp_path: Path, value: str, says: str
) -> None:
    raw.put("/rollcall/jobs/job1/view", value)
    plane = ControlPlane([etcd.endpoint], tmp_path)
    try:
        line = wait_for(
            lambda: next((s for s in replica_log(plane).splitlines() if "refuses to lead" in s),
                         None),
            "the replica to say it refuses to lead", PROMPT,
        )  # fmt: skip
        assert says in line and "/rollcall/jobs/job1/view" in line, line
        with pytest.raises(RuntimeError, match="malformed") as refused:
            plane.status_json("--timeout", "2")
        assert "JSONDecodeError" not in str(refused.value)

        raw.delete("/rollcall/jobs/job1/view")
        member = plane.add_member("m")
        wait_for(lambda: in_view(plane, member), "the replica leading again", PROMPT)
        log = replica_log(plane)
        assert "Traceback" not in log, log
        assert log.count("refuses to lead") == 1, "said once, not at every attempt"
    finally:
        plane.close()


@pytest.mark.parametrize(
    "planted",
    ["garbage", json.dumps({"replica_id": "evil", "address": "10.9.9.9:1", "lease_id": 1})],
    ids=["not-json", "no-lease"],
)
def test_a_planted_leader_key_is_removed_and_the_job_goes_on(
    control_plane: ControlPlane, raw: MultiEndpointEtcd3Client, planted: str
) -> None:
    a = control_plane.add_member("a")
    wait_for(lambda: in_view(control_plane, a), "a view of the member", PROMPT)
    raw.put(key(control_plane, "leader"), planted)

    wait_for(
        lambda: control_plane.status_json()["leader"] == control_plane.addresses[0],
        "the replica leading again", PROMPT,
    )  # fmt: skip
    b = control_plane.add_member("b")
    wait_for(lambda: in_view(control_plane, a, b), "a view with the joiner", PROMPT)
    assert "removed a leader key" in replica_log(control_plane)


def test_malformed_member_progress_and_checkpoint_records_are_ignored_at_takeover(
    etcd: LocalEtcd, raw: MultiEndpointEtcd3Client, tmp_path: Path
) -> None:
    plane = ControlPlane([etcd.endpoint], tmp_path, replicas=2)
    try:
        # No step is reported, so Status reads the progress record.
        a = plane.add_member("a")
        wait_for(lambda: in_view(plane, a), "a view of the member", PROMPT)
        raw.put(key(plane, "members/ghost"), "{]")
        raw.put(key(plane, "progress"), '{"epoch": "one"}')
        raw.put(key(plane, "checkpoints"), '[{"step": -5}, 7]')
        # The standby takes over and reads them all.
        leader = plane.status_json()["leader"]
        (old,) = [r for r in plane.replicas if r.address == leader]
        (standby,) = [i for i, r in enumerate(plane.replicas) if r is not old]
        old.stop()
        wait_for(
            lambda: plane.status_json()["leader"] == plane.replicas[standby].address,
            "the standby leading", PROMPT,
        )  # fmt: skip
        b = plane.add_member("b")
        wait_for(lambda: in_view(plane, a, b), "a view with the joiner", PROMPT)
        status = plane.status_json()
        assert status["checkpoints"] == [] and status["last_step"] is None
        log = replica_log(plane, standby)
        assert "Traceback" not in log, log
        for name in ("members/ghost", "progress", "checkpoints"):
            assert f"/rollcall/jobs/{plane.job}/{name}" in log, name
    finally:
        plane.close()
