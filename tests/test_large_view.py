"""A view of 10,000 members (issue 17): the leader commits it to a real etcd
in one transaction, a replica reads it back, and the message that takes it
to a member's session stays far below gRPC's transport limit, even when
half the members must fetch the state from the other half. The members are
lightweight stand-ins: ids and addresses, no processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rollcall.etcd_local import LocalEtcd
from rollcall.membership.config import Config
from rollcall.membership.shards import Sharding, decide_shards
from rollcall.membership.view import Member, View
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.protocol.wire import TRANSPORT_LIMIT, view_from_pb, view_to_pb
from rollcall.rendezvous.store import EtcdStore

pytestmark = pytest.mark.integration

MEMBERS = 10_000
#: etcd's own limit on one request (its --max-request-bytes default, 1.5 MiB).
ETCD_REQUEST_LIMIT = 1536 * 1024


@pytest.fixture
def store(etcd: LocalEtcd, config: Config) -> Iterator[EtcdStore]:
    with EtcdStore([etcd.endpoint], "large", config) as s:
        yield s


def large_view(epoch: int, sharded: bool) -> View:
    members = tuple(
        Member(f"w{i}-{i * 2654435761 % 2**32:08x}", f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:4"
               + f"{i % 10000:04d}")  # fmt: skip
        for i in range(MEMBERS)
    )
    ids = [m.id for m in members]
    holders = tuple(ids[: MEMBERS // 2])
    # Half of them were behind (or new): every one fetches from the holders.
    fetch = {member_id: holders for member_id in ids[MEMBERS // 2 :]}
    shards = None
    if sharded:
        hosts = {m.id: m.address.rpartition(":")[0] for m in members}
        shards = decide_shards(Sharding(512, 2), None, False, ids, hosts, None)
    return View(epoch, members, 41, "sha256:" + "a" * 64, fetch, shards)


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
def test_a_view_of_10000_members_is_committed_and_delivered_within_every_limit(
    store: EtcdStore, etcd: LocalEtcd, config: Config, sharded: bool
) -> None:
    view = large_view(1, sharded)
    record = view.to_json().encode()
    assert len(record) < 0.6 * ETCD_REQUEST_LIMIT, f"the view's etcd record is {len(record)} bytes"
    leader = store.campaign("replica-1", "127.0.0.1:7000")
    assert leader is not None
    revision = store.commit_view(view, 0, leader)
    assert revision is not None
    # Another replica reads it back whole (a standby, or this one after a restart).
    with EtcdStore([etcd.endpoint], "large", config) as other:
        read, at = other.read_view()
    assert (read, at) == (view, revision)
    # What the leader sends on each member's session, and what a member decodes.
    message = pb.SessionEvent(view=view_to_pb(read)).SerializeToString()
    assert len(message) < TRANSPORT_LIMIT / 4, f"the view's session message is {len(message)} bytes"
    decoded = pb.SessionEvent.FromString(message)
    assert view_from_pb(decoded.view) == view
    print(f"\n{MEMBERS} members: etcd record {len(record)} bytes, session message "
          f"{len(message)} bytes")
