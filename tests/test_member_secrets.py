"""A member's secret hash (etcd's ``secrets/<id>``, kept without a lease so
that a member whose record expired in an etcd stall is still recognised)
does not outlive the member: a removal that etcd did not take while it was
stopped is done once it answers, and a new leader removes the hashes of
members it does not know. Real etcd, a real replica, real members."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from rollcall.etcd_local import LocalEtcd
from rollcall.membership.config import Config
from rollcall.membership.credentials import secret_hash
from rollcall.membership.view import Member
from rollcall.rendezvous.store import EtcdStore
from tests.harness import ControlPlane, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

#: Generous bound for "should take a few seconds" on 2 loaded cores.
PATIENCE = 60.0
SETTINGS = ("member_lease_ttl=6", "election_ttl=2", "takeover_grace=2.0")


def test_a_member_that_leaves_while_etcd_is_stopped_leaves_no_secret_behind(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    plane = ControlPlane([etcd.endpoint], tmp_path, settings=SETTINGS)
    try:
        stay, go = plane.add_member("stay"), plane.add_member("go")
        both = {stay.member_id, go.member_id}
        wait_for(lambda: any(set(v["members"]) == both for v in stay.views()), "a view of both",
                 PATIENCE)  # fmt: skip
        with EtcdStore([etcd.endpoint], plane.job, Config()) as store:
            assert set(store.list_secret_hashes()) == both
            etcd.pause()
            try:
                go.signal(signal.SIGTERM)  # it leaves: the leader answers without etcd
                go.proc.wait(timeout=PATIENCE)
                # Longer than the budget of an etcd call (twice etcd_timeout):
                # the removal's calls fail.
                time.sleep(3 * Config().etcd_timeout + 2.0)
            finally:
                etcd.resume()
            wait_for(
                lambda: set(store.list_secret_hashes()) == {stay.member_id},
                "the secret hash of the member that left removed", PATIENCE,
            )  # fmt: skip
    finally:
        plane.close()


def test_a_new_leader_removes_the_secret_hashes_of_members_it_does_not_know(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    with EtcdStore([etcd.endpoint], "job1", Config()) as store:
        # A member whose removal etcd never took: its record expired with
        # its lease, its secret hash stayed.
        ghost = store.add_member(Member("ghost-00000000", "127.0.0.1:9"), secret_hash("ab" * 32))
        store.etcd.revoke(ghost.lease_id)
        assert set(store.list_secret_hashes()) == {"ghost-00000000"}
        plane = ControlPlane([etcd.endpoint], tmp_path, settings=SETTINGS)
        try:
            member = plane.add_member("live")
            wait_for(
                lambda: set(store.list_secret_hashes()) == {member.member_id},
                "the unknown member's secret hash removed", PATIENCE,
            )  # fmt: skip
        finally:
            plane.close()
