"""EtcdStore against real etcd: view CAS, member leases, election, watches,
progress, and ControlPlaneUnavailable when etcd cannot be reached."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from rollcall.etcd_local import EtcdServerTLS, LocalEtcd, LocalEtcdCluster
from rollcall.membership.checkpoint import CheckpointManifest
from rollcall.membership.config import Config
from rollcall.membership.credentials import secret_hash
from rollcall.membership.errors import ControlPlaneUnavailable, InvalidRequest
from rollcall.membership.fingerprint import JobFingerprint
from rollcall.membership.view import EMPTY_VIEW, Member, View
from rollcall.rendezvous.etcd_client import EtcdClientTLS
from rollcall.rendezvous.store import EtcdStore, LeaderInfo
from tests.conftest import TLSFiles
from tests.test_etcd_local import client_for

T = TypeVar("T")

#: member_lease_ttl as short as Config allows with etcd's 2 s minimum election TTL.
SHORT_LEASES = Config(
    member_lease_ttl=3, election_ttl=2, takeover_grace=0.5, session_open_timeout=0.25
)


@pytest.fixture
def store(etcd: LocalEtcd, config: Config) -> Iterator[EtcdStore]:
    with EtcdStore([etcd.endpoint], "job-a", config) as s:
        yield s


@pytest.fixture
def short_store(etcd: LocalEtcd) -> Iterator[EtcdStore]:
    with EtcdStore([etcd.endpoint], "job-a", SHORT_LEASES) as s:
        yield s


@pytest.fixture
def cluster_store(etcd_cluster: LocalEtcdCluster, config: Config) -> Iterator[EtcdStore]:
    with EtcdStore(etcd_cluster.endpoints, "job-a", config) as s:
        yield s


def view(epoch: int, *ids: str) -> View:
    return View(epoch, tuple(Member(i, f"10.0.0.1:{n}") for n, i in enumerate(ids)))


def eventually(probe: Callable[[], T | None], timeout: float, interval: float = 0.05) -> T:
    """Poll ``probe`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


class Recorder:
    """Collects watch callbacks from pyetcd-independent watch threads."""

    def __init__(self) -> None:
        self.items: list[object] = []
        self._cond = threading.Condition()

    def __call__(self, item: object) -> None:
        with self._cond:
            self.items.append(item)
            self._cond.notify_all()

    def wait_for(self, count: int, timeout: float = 5.0) -> list[object]:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.items) >= count, timeout):
                raise AssertionError(f"got {self.items}, wanted {count} items within {timeout} s")
            return list(self.items)


# --- view compare-and-swap ----------------------------------------------------


def test_read_view_before_any_commit_is_empty(store: EtcdStore) -> None:
    assert store.read_view() == (EMPTY_VIEW, 0)


def test_first_commit_with_prev_revision_zero(store: EtcdStore) -> None:
    leader = store.campaign("replica-1", "127.0.0.1:7000")
    assert leader is not None

    revision = store.commit_view(view(1, "a", "b"), 0, leader)

    assert revision is not None and revision > 0
    assert store.read_view() == (view(1, "a", "b"), revision)


def test_commit_with_current_revision_replaces_view(store: EtcdStore) -> None:
    leader = store.campaign("replica-1", "127.0.0.1:7000")
    assert leader is not None
    first = store.commit_view(view(1, "a"), 0, leader)
    assert first is not None

    second = store.commit_view(view(2, "a", "b"), first, leader)

    assert second is not None and second > first
    assert store.read_view() == (view(2, "a", "b"), second)


def test_commit_with_stale_revision_fails_and_changes_nothing(store: EtcdStore) -> None:
    leader = store.campaign("replica-1", "127.0.0.1:7000")
    assert leader is not None
    first = store.commit_view(view(1, "a"), 0, leader)
    assert first is not None
    second = store.commit_view(view(2, "a", "b"), first, leader)
    assert second is not None
    before = store.snapshot()

    assert store.commit_view(view(3, "a"), first, leader) is None
    assert store.commit_view(view(3, "a"), 0, leader) is None
    assert store.snapshot() == before


def test_commit_by_non_leader_fails_and_changes_nothing(store: EtcdStore) -> None:
    leader = store.campaign("replica-1", "127.0.0.1:7000")
    assert leader is not None
    before = store.snapshot()
    impostor = LeaderInfo("replica-2", "127.0.0.1:7001", leader.lease_id)

    assert store.commit_view(view(1, "a"), 0, impostor) is None
    assert store.snapshot() == before


def test_commit_by_deposed_leader_fails(store: EtcdStore) -> None:
    old = store.campaign("replica-1", "127.0.0.1:7000")
    assert old is not None
    store.resign(old)
    new = store.campaign("replica-1", "127.0.0.1:7000")  # same replica, new term
    assert new is not None

    assert store.commit_view(view(1, "a"), 0, old) is None
    assert store.commit_view(view(1, "a"), 0, new) is not None


def test_commit_without_any_leader_fails(store: EtcdStore) -> None:
    nobody = LeaderInfo("replica-1", "127.0.0.1:7000", 12345)
    assert store.commit_view(view(1, "a"), 0, nobody) is None
    assert store.snapshot() == {}


def test_job_exists_once_anything_is_recorded(etcd: LocalEtcd, config: Config) -> None:
    with (
        EtcdStore([etcd.endpoint], "with-member", config) as members,
        EtcdStore([etcd.endpoint], "with-leader", config) as leaders,
        EtcdStore([etcd.endpoint], "untouched", config) as untouched,
    ):
        assert not members.job_exists()
        members.add_member(Member("a", "127.0.0.1:1"))
        assert leaders.campaign("replica-1", "127.0.0.1:7000") is not None

        assert members.job_exists()
        assert leaders.job_exists()
        assert not untouched.job_exists()


def test_jobs_do_not_see_each_other(etcd: LocalEtcd, config: Config) -> None:
    # "job" is a prefix of "job2": keys must still be disjoint.
    with (
        EtcdStore([etcd.endpoint], "job", config) as one,
        EtcdStore([etcd.endpoint], "job2", config) as two,
    ):
        two.add_member(Member("a", "127.0.0.1:1"))
        two.write_progress(1, 1)
        assert one.list_members() == []
        assert one.snapshot() == {}
        assert one.read_progress() is None


def test_values_are_json_under_the_job_prefix(store: EtcdStore) -> None:
    leader = store.campaign("replica-1", "127.0.0.1:7000")
    assert leader is not None
    store.commit_view(view(1, "a"), 0, leader)
    store.add_member(Member("a", "127.0.0.1:1"))
    store.write_progress(1, 7)

    snapshot = store.snapshot()

    assert set(snapshot) == {
        "/rollcall/jobs/job-a/view",
        "/rollcall/jobs/job-a/leader",
        "/rollcall/jobs/job-a/members/a",
        "/rollcall/jobs/job-a/secrets/a",
        "/rollcall/jobs/job-a/progress",
    }
    decoded = {key: json.loads(value) for key, value in snapshot.items()}
    assert decoded["/rollcall/jobs/job-a/leader"]["replica_id"] == "replica-1"
    assert decoded["/rollcall/jobs/job-a/members/a"] == {
        "address": "127.0.0.1:1",
        "id": "a",
        "secret_sha256": "",
    }
    assert decoded["/rollcall/jobs/job-a/progress"] == {"epoch": 1, "step": 7}
    assert decoded["/rollcall/jobs/job-a/secrets/a"] == {"secret_sha256": ""}


def test_a_members_secret_hash_outlives_its_lease_until_it_is_removed(store: EtcdStore) -> None:
    hashed = "ab" * 32
    record = store.add_member(Member("a", "127.0.0.1:1"), hashed)
    store.add_member(Member("b", "127.0.0.1:2"), "cd" * 32)
    store.etcd.revoke(record.lease_id)  # etcd let the lease expire: the record is gone
    assert [r.member.id for r in store.list_members()] == ["b"]
    assert store.list_secret_hashes() == {"a": hashed, "b": "cd" * 32}
    again = store.register_again(Member("a", "127.0.0.1:1"), hashed)
    assert [r.secret_hash for r in store.list_members() if r.member.id == "a"] == [hashed]
    store.remove_member("a", again.lease_id)
    assert store.list_secret_hashes() == {"b": "cd" * 32}


def test_job_name_with_slash_is_rejected(etcd: LocalEtcd, config: Config) -> None:
    with pytest.raises(InvalidRequest):
        EtcdStore([etcd.endpoint], "a/b", config)


# --- members and their leases ---------------------------------------------------


def test_members_are_listed_in_arrival_order(store: EtcdStore) -> None:
    for member_id in ["zed", "alpha", "mid"]:
        store.add_member(Member(member_id, f"127.0.0.1:{len(member_id)}"))

    records = store.list_members()

    assert [r.member.id for r in records] == ["zed", "alpha", "mid"]
    revisions = [r.create_revision for r in records]
    assert revisions == sorted(revisions) and len(set(revisions)) == 3
    assert len({r.lease_id for r in records}) == 3


def test_a_members_secret_hash_is_kept_in_its_record(store: EtcdStore) -> None:
    """The hash of the member's secret travels with its record, so that any
    replica leading later can check the member's requests; a value that is
    no such hash (a hand-written record) reads as none, which proves nothing."""
    hashed = secret_hash("s" * 64)
    written = store.add_member(Member("a", "127.0.0.1:1"), hashed)
    store.add_member(Member("b", "127.0.0.1:2"), "not a hash")

    records = {r.member.id: r for r in store.list_members()}

    assert records["a"] == written and records["a"].secret_hash == hashed
    assert records["b"].secret_hash == ""


def test_add_member_returns_its_record(store: EtcdStore, config: Config) -> None:
    record = store.add_member(Member("a", "127.0.0.1:1"))

    assert store.list_members() == [record]
    assert 0 < store.lease_ttl(record.lease_id) <= config.member_lease_ttl


def test_adding_a_member_twice_is_refused(store: EtcdStore) -> None:
    first = store.add_member(Member("a", "127.0.0.1:1"))
    with pytest.raises(InvalidRequest):
        store.add_member(Member("a", "127.0.0.1:2"))
    assert store.list_members() == [first]


def test_remove_member_deletes_the_record_and_tolerates_repeats(store: EtcdStore) -> None:
    gone = store.add_member(Member("a", "127.0.0.1:1"))
    kept = store.add_member(Member("b", "127.0.0.1:2"))

    store.remove_member("a", gone.lease_id)
    store.remove_member("a", gone.lease_id)

    assert store.list_members() == [kept]
    assert store.lease_ttl(gone.lease_id) == -1


def test_keep_alive_holds_a_lease_past_its_ttl(short_store: EtcdStore) -> None:
    record = short_store.add_member(Member("a", "127.0.0.1:1"))
    deadline = time.monotonic() + SHORT_LEASES.member_lease_ttl + 1.5
    while time.monotonic() < deadline:
        assert short_store.keep_alive([record.lease_id]) == {record.lease_id: 3}
        time.sleep(0.5)
    assert short_store.list_members() == [record]


def test_lease_not_kept_alive_expires_with_its_record(short_store: EtcdStore) -> None:
    kept = short_store.add_member(Member("kept", "127.0.0.1:1"))
    dropped = short_store.add_member(Member("dropped", "127.0.0.1:2"))
    start = time.monotonic()

    def only_kept_left() -> bool:
        short_store.keep_alive([kept.lease_id])
        return [r.member.id for r in short_store.list_members()] == ["kept"]

    # etcd revokes expired leases in a loop every 500 ms.
    eventually(only_kept_left, timeout=SHORT_LEASES.member_lease_ttl + 2.0, interval=0.2)
    assert time.monotonic() - start >= SHORT_LEASES.member_lease_ttl - 1
    assert short_store.keep_alive([dropped.lease_id]) == {dropped.lease_id: 0}


def test_keep_alive_refreshes_512_leases_in_one_call(store: EtcdStore, config: Config) -> None:
    records = [store.add_member(Member(f"m{i}", f"127.0.0.1:{i}")) for i in range(512)]
    lease_ids = [r.lease_id for r in records]
    gone = records[0]
    store.remove_member(gone.member.id, gone.lease_id)

    start = time.monotonic()
    ttls = store.keep_alive(lease_ids + lease_ids[:10])  # duplicates are refreshed once
    elapsed = time.monotonic() - start

    assert set(ttls) == set(lease_ids)
    assert ttls[gone.lease_id] <= 0
    assert all(ttls[i] == config.member_lease_ttl for i in lease_ids[1:])
    assert elapsed < config.etcd_timeout


def test_a_batch_of_members_is_recorded_in_one_transaction_each_under_its_own_lease(
    store: EtcdStore,
) -> None:
    members = [(Member(f"b{i}", f"127.0.0.1:{3000 + i}"), f"{i:064x}") for i in range(64)]
    leases = [store.grant_member_lease() for _ in members]

    records = store.add_members(members, leases)

    assert [(r.member, r.lease_id, r.secret_hash) for r in records] == [
        (member, lease, hashed) for (member, hashed), lease in zip(members, leases, strict=True)
    ]
    assert len({r.create_revision for r in records}) == 1  # one write
    listed = {r.member.id: r for r in store.list_members()}
    pairs = zip(members, leases, strict=True)
    assert all(listed[member.id].lease_id == lease for (member, _), lease in pairs)
    assert store.list_secret_hashes() == {m.id: hashed for m, hashed in members}
    # Each record goes with its own lease.
    store.remove_member("b0", leases[0])
    assert "b0" not in {r.member.id for r in store.list_members()}
    assert len(store.list_members()) == 63


def test_a_batch_with_a_taken_id_writes_none_of_its_members(store: EtcdStore) -> None:
    store.add_member(Member("taken", "127.0.0.1:1"))
    batch = [(Member("fresh", "127.0.0.1:2"), ""), (Member("taken", "127.0.0.1:3"), "")]

    with pytest.raises(InvalidRequest, match="already has a record"):
        store.add_members(batch, [store.grant_member_lease() for _ in batch])

    assert [r.member.id for r in store.list_members()] == ["taken"]
    with pytest.raises(ValueError):
        store.add_members([], [])


def test_keep_alive_of_nothing_is_empty(store: EtcdStore) -> None:
    assert store.keep_alive([]) == {}


# --- leader election -------------------------------------------------------------


def test_only_one_of_two_campaigners_wins(etcd: LocalEtcd, config: Config) -> None:
    with (
        EtcdStore([etcd.endpoint], "job-a", config) as one,
        EtcdStore([etcd.endpoint], "job-a", config) as two,
    ):
        results: dict[str, LeaderInfo | None] = {}
        threads = [
            threading.Thread(target=lambda s=s, r=r: results.update({r: s.campaign(r, r)}))
            for s, r in [(one, "replica-1"), (two, "replica-2")]
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        winners = [info for info in results.values() if info is not None]
        assert len(winners) == 1
        assert one.read_leader() == winners[0]


def test_other_campaigner_wins_after_the_winner_resigns(store: EtcdStore) -> None:
    first = store.campaign("replica-1", "127.0.0.1:7000")
    assert first is not None
    assert store.campaign("replica-2", "127.0.0.1:7001") is None

    store.resign(first)
    second = store.campaign("replica-2", "127.0.0.1:7001")

    assert second is not None and second.replica_id == "replica-2"
    assert store.read_leader() == second


def test_leadership_lapses_when_not_refreshed(store: EtcdStore, config: Config) -> None:
    first = store.campaign("replica-1", "127.0.0.1:7000")
    assert first is not None
    start = time.monotonic()

    second = eventually(
        lambda: store.campaign("replica-2", "127.0.0.1:7001"),
        timeout=config.election_ttl + 2.0,
        interval=0.1,
    )

    assert time.monotonic() - start >= config.election_ttl - 1
    assert not store.refresh_leader(first)
    assert store.refresh_leader(second)


def test_refresh_leader_holds_leadership_past_its_ttl(store: EtcdStore, config: Config) -> None:
    leader = store.campaign("replica-1", "127.0.0.1:7000")
    assert leader is not None
    deadline = time.monotonic() + config.election_ttl + 1.0
    while time.monotonic() < deadline:
        assert store.refresh_leader(leader)
        time.sleep(0.4)
    assert store.read_leader() == leader
    assert store.campaign("replica-2", "127.0.0.1:7001") is None


def test_refresh_leader_is_false_after_losing(store: EtcdStore) -> None:
    leader = store.campaign("replica-1", "127.0.0.1:7000")
    assert leader is not None
    store.resign(leader)
    assert store.read_leader() is None
    assert not store.refresh_leader(leader)


# --- watches -----------------------------------------------------------------------


def test_watch_view_delivers_every_commit_in_order(store: EtcdStore) -> None:
    leader = store.campaign("replica-1", "127.0.0.1:7000")
    assert leader is not None
    seen = Recorder()
    cancel = store.watch_view(seen)
    revision = 0
    for epoch in range(1, 4):
        revision = store.commit_view(view(epoch, "a"), revision, leader) or 0

    assert seen.wait_for(3) == [view(1, "a"), view(2, "a"), view(3, "a")]
    cancel()


def test_watch_view_from_a_read_revision_misses_nothing(store: EtcdStore) -> None:
    leader = store.campaign("replica-1", "127.0.0.1:7000")
    assert leader is not None
    _, revision = store.read_view()
    store.commit_view(view(1, "a"), revision, leader)  # before the watch exists

    seen = Recorder()
    cancel = store.watch_view(seen, after_revision=revision)

    assert seen.wait_for(1) == [view(1, "a")]
    cancel()


def test_watch_leader_reports_election_and_resignation(store: EtcdStore) -> None:
    seen = Recorder()
    cancel = store.watch_leader(seen)
    leader = store.campaign("replica-1", "127.0.0.1:7000")
    assert leader is not None
    store.resign(leader)

    assert seen.wait_for(2) == [leader, None]
    cancel()


def test_cancelled_watch_delivers_nothing_more(store: EtcdStore) -> None:
    leader = store.campaign("replica-1", "127.0.0.1:7000")
    assert leader is not None
    seen = Recorder()
    cancel = store.watch_view(seen)
    first = store.commit_view(view(1, "a"), 0, leader)
    seen.wait_for(1)

    cancel()
    store.commit_view(view(2, "a"), first or 0, leader)
    time.sleep(0.3)

    assert seen.items == [view(1, "a")]


def test_watch_survives_a_callback_that_raises(store: EtcdStore) -> None:
    leader = store.campaign("replica-1", "127.0.0.1:7000")
    assert leader is not None
    seen = Recorder()

    def fragile(v: View) -> None:
        seen(v)
        raise RuntimeError("callback bug")

    cancel = store.watch_view(fragile)
    first = store.commit_view(view(1, "a"), 0, leader)
    store.commit_view(view(2, "a"), first or 0, leader)

    assert seen.wait_for(2) == [view(1, "a"), view(2, "a")]
    cancel()


def test_watch_resumes_after_etcd_restarts(etcd: LocalEtcd, store: EtcdStore) -> None:
    leader = store.campaign("replica-1", "127.0.0.1:7000")
    assert leader is not None
    seen = Recorder()
    cancel = store.watch_view(seen)
    first = store.commit_view(view(1, "a"), 0, leader)
    seen.wait_for(1)

    etcd.kill()
    etcd.start()
    # Committed right away, possibly before the watch is re-established:
    # it resumes from the last revision it saw, so nothing is lost.
    assert store.commit_view(view(2, "a"), first or 0, leader) is not None

    assert seen.wait_for(2) == [view(1, "a"), view(2, "a")]
    cancel()


def test_watch_from_compacted_history_hands_over_the_current_view(
    etcd: LocalEtcd, store: EtcdStore
) -> None:
    leader = store.campaign("replica-1", "127.0.0.1:7000")
    assert leader is not None
    first = store.commit_view(view(1, "a"), 0, leader)
    second = store.commit_view(view(2, "a"), first or 0, leader)
    assert first is not None and second is not None
    with client_for(etcd.endpoint) as client:
        client.compact(second)

    seen = Recorder()
    cancel = store.watch_view(seen, after_revision=first - 1)
    seen.wait_for(1)
    store.commit_view(view(3, "a"), second, leader)

    assert seen.wait_for(2) == [view(2, "a"), view(3, "a")]
    cancel()


# --- progress -----------------------------------------------------------------------


def test_progress_round_trip(store: EtcdStore) -> None:
    assert store.read_progress() is None
    store.write_progress(3, 41)
    store.write_progress(3, 42)
    assert store.read_progress() == (3, 42)


def test_the_lost_history_record_keeps_the_highest_epoch_and_ignores_a_malformed_one(
    store: EtcdStore,
) -> None:
    assert store.read_lost() is None
    store.record_lost(4)
    store.record_lost(2)  # a member of an older view, refused later
    assert store.read_lost() == 4
    store.etcd.put(b"/rollcall/jobs/job-a/lost", b'{"epoch": "four"}')
    assert store.read_lost() is None  # logged and ignored, never raised


# --- fingerprint ----------------------------------------------------------------------

RUN1 = JobFingerprint.of({"global_batch": "48", "seed": "0"})
RUN2 = JobFingerprint.of({"global_batch": "96", "seed": "0"})


def test_fingerprint_is_created_only_if_absent(store: EtcdStore) -> None:
    absent = store.read_fingerprint()
    assert (absent.fingerprint, absent.revision, absent.malformed) == (None, 0, "")
    assert store.record_fingerprint(RUN1, 0)
    assert not store.record_fingerprint(RUN2, 0)
    recorded = store.read_fingerprint()
    assert recorded.fingerprint == RUN1 and recorded.revision > 0
    key = "/rollcall/jobs/job-a/fingerprint"
    assert json.loads(store.snapshot()[key]) == {"global_batch": "48", "seed": "0"}


def test_fingerprint_is_replaced_only_at_the_revision_read(store: EtcdStore) -> None:
    store.record_fingerprint(RUN1, 0)
    read = store.read_fingerprint()
    assert store.record_fingerprint(RUN2, read.revision)
    assert not store.record_fingerprint(RUN1, read.revision)  # stale: someone wrote since
    assert store.read_fingerprint().fingerprint == RUN2


def test_fingerprint_read_tells_whether_the_job_has_progress_and_checkpoints(
    store: EtcdStore,
) -> None:
    before = store.read_fingerprint()
    assert (before.progress, before.checkpoints) == (False, False)
    store.write_progress(1, 5)
    manifest = CheckpointManifest(
        step=5, digest="sha256:ab", uri="/tmp/c", size=1, sha256="0" * 64, epoch=1,
        writer="w-1", created_unix=1.0, step_seconds=0.1,
    )  # fmt: skip
    store.publish_checkpoint(manifest, 3)
    after = store.read_fingerprint()
    assert (after.progress, after.checkpoints) == (True, True)


@pytest.mark.parametrize(
    "value",
    [b"{", b"\xff", b"[]", b'{"seed": 0}', b'{"Seed": "0"}', b'{"seed": "0\\n"}', b"[" * 50_000],
)
def test_a_malformed_fingerprint_is_reported_not_raised(etcd: LocalEtcd, store: EtcdStore,
                                                        value: bytes) -> None:  # fmt: skip
    client = client_for(etcd.endpoint)
    try:
        client.put("/rollcall/jobs/job-a/fingerprint", value)
    finally:
        client.close()
    read = store.read_fingerprint()
    assert read.fingerprint is None and read.malformed and read.revision > 0
    assert store.record_fingerprint(RUN1, read.revision)  # it takes the malformed one's place
    assert store.read_fingerprint().fingerprint == RUN1


def test_the_epoch_key_is_made_once_and_kept(etcd: LocalEtcd, store: EtcdStore,
                                              config: Config) -> None:  # fmt: skip
    """Every replica that leads derives the same epoch secrets: the first
    call makes the job's epoch key, later ones (from any store) read it."""
    key = store.epoch_key()
    other = EtcdStore([etcd.endpoint], "job-a", config)
    try:
        assert other.epoch_key() == key == store.epoch_key()
    finally:
        other.close()
    assert len(key) == 64 and int(key, 16) >= 0


@pytest.mark.parametrize("value", [b"{", b"\xff", b"[]", b'{"key": "short"}', b'{"key": 5}'])
def test_a_malformed_epoch_key_is_replaced(etcd: LocalEtcd, store: EtcdStore,
                                           value: bytes) -> None:  # fmt: skip
    client = client_for(etcd.endpoint)
    try:
        client.put("/rollcall/jobs/job-a/epoch_key", value)
    finally:
        client.close()
    key = store.epoch_key()
    assert len(key) == 64 and store.epoch_key() == key


# --- etcd unreachable ----------------------------------------------------------------


def test_every_call_raises_unavailable_quickly_when_etcd_is_down(
    etcd: LocalEtcd, store: EtcdStore
) -> None:
    leader = store.campaign("replica-1", "127.0.0.1:7000")
    assert leader is not None
    record = store.add_member(Member("a", "127.0.0.1:1"))
    etcd.kill()

    calls: list[Callable[[], object]] = [
        store.ping,
        store.read_view,
        lambda: store.commit_view(view(1, "a"), 0, leader),
        store.job_exists,
        lambda: store.add_member(Member("b", "127.0.0.1:2")),
        store.list_members,
        lambda: store.remove_member("a", record.lease_id),
        lambda: store.keep_alive([record.lease_id]),
        lambda: store.campaign("replica-2", "127.0.0.1:7001"),
        lambda: store.refresh_leader(leader),
        lambda: store.resign(leader),
        store.read_leader,
        lambda: store.watch_view(lambda v: None),
        lambda: store.write_progress(1, 1),
        store.read_progress,
        store.read_fingerprint,
        lambda: store.record_fingerprint(RUN1, 0),
        store.snapshot,
    ]
    for call in calls:
        start = time.monotonic()
        with pytest.raises(ControlPlaneUnavailable, match="etcd unreachable at http://127"):
            call()
        assert time.monotonic() - start < 1.0


def test_unavailable_within_twice_the_timeout_when_etcd_is_frozen(etcd: LocalEtcd) -> None:
    config = Config(etcd_timeout=0.5)
    with EtcdStore([etcd.endpoint], "job-a", config) as store:
        store.ping()
        etcd.pause()
        try:
            start = time.monotonic()
            with pytest.raises(ControlPlaneUnavailable):
                store.read_view()
            elapsed = time.monotonic() - start
        finally:
            etcd.resume()
        assert elapsed <= 2 * config.etcd_timeout + 0.3
        eventually(lambda: store.read_view() == (EMPTY_VIEW, 0), timeout=3.0)


def test_store_works_again_once_etcd_returns(etcd: LocalEtcd, store: EtcdStore) -> None:
    record = store.add_member(Member("a", "127.0.0.1:1"))
    etcd.kill()
    with pytest.raises(ControlPlaneUnavailable):
        store.ping()

    etcd.start()

    store.ping()
    assert store.list_members() == [record]


def test_member_lease_survives_an_etcd_restart_with_full_ttl(
    etcd: LocalEtcd, store: EtcdStore, config: Config
) -> None:
    record = store.add_member(Member("a", "127.0.0.1:1"))
    time.sleep(1.5)
    before = store.lease_ttl(record.lease_id)
    assert before <= config.member_lease_ttl - 2
    etcd.kill()
    etcd.start()

    # etcd renews every lease when a leader takes office, including at restart
    # (etcd reports whole seconds, rounded down).
    assert store.lease_ttl(record.lease_id) >= config.member_lease_ttl - 1
    assert store.list_members() == [record]


# --- a 3-member cluster ------------------------------------------------------------------


def test_cluster_reads_and_commits_survive_killing_the_member_in_use(
    etcd_cluster: LocalEtcdCluster, cluster_store: EtcdStore
) -> None:
    leader = cluster_store.campaign("replica-1", "127.0.0.1:7000")
    assert leader is not None
    first = cluster_store.commit_view(view(1, "a"), 0, leader)
    assert first is not None
    record = cluster_store.add_member(Member("a", "127.0.0.1:1"))
    seen = Recorder()
    cancel = cluster_store.watch_view(seen, after_revision=first)

    etcd_cluster.kill(etcd_cluster.endpoints.index(cluster_store.etcd.endpoint_in_use))

    assert cluster_store.read_view() == (view(1, "a"), first)
    second = cluster_store.commit_view(view(2, "a"), first, leader)
    assert second is not None
    assert cluster_store.refresh_leader(leader)
    assert cluster_store.keep_alive([record.lease_id])[record.lease_id] > 0
    assert seen.wait_for(1) == [view(2, "a")]
    cancel()


def test_cluster_watch_leaves_a_frozen_member(etcd_cluster: LocalEtcdCluster) -> None:
    # An election lease that outlives the first, frozen, attempt.
    config = Config(election_ttl=4)
    with EtcdStore(etcd_cluster.endpoints, "job-a", config) as store:
        leader = store.campaign("replica-1", "127.0.0.1:7000")
        assert leader is not None
        seen = Recorder()
        cancel = store.watch_view(seen)
        frozen = etcd_cluster.members[etcd_cluster.endpoints.index(store.etcd.endpoint_in_use)]
        frozen.pause()
        try:
            start = time.monotonic()
            # The first attempt waits etcd_timeout on the frozen member, the
            # retry goes elsewhere; the watch follows once the store saw the
            # failure.
            assert store.commit_view(view(1, "a"), 0, leader) is not None
            assert seen.wait_for(1, timeout=3.0) == [view(1, "a")]
            assert time.monotonic() - start < config.etcd_timeout + 2.0
        finally:
            frozen.resume()
        cancel()


def test_cluster_without_quorum_is_unavailable_until_it_returns(
    etcd_cluster: LocalEtcdCluster, cluster_store: EtcdStore
) -> None:
    cluster_store.ping()
    etcd_cluster.kill(0)
    etcd_cluster.kill(1)

    start = time.monotonic()
    with pytest.raises(ControlPlaneUnavailable):
        cluster_store.ping()
    assert time.monotonic() - start < 2 * Config().etcd_timeout + 0.5

    etcd_cluster.start(1)
    cluster_store.ping()
    assert cluster_store.read_view() == (EMPTY_VIEW, 0)


# --- TLS ----------------------------------------------------------------------------------


@pytest.mark.integration
def test_store_over_tls_with_client_certificate(tls_files: TLSFiles, config: Config) -> None:
    server_tls = EtcdServerTLS(
        cert_file=tls_files.server_cert,
        key_file=tls_files.server_key,
        trusted_ca_file=tls_files.ca_cert,
        client_cert_auth=True,
    )
    client_tls = EtcdClientTLS(
        ca_file=tls_files.ca_cert, cert_file=tls_files.client_cert, key_file=tls_files.client_key
    )
    with (
        LocalEtcd(tls=server_tls) as server,
        EtcdStore([server.endpoint], "job-a", config, tls=client_tls) as store,
    ):
        leader = store.campaign("replica-1", "127.0.0.1:7000")
        assert leader is not None
        assert store.commit_view(view(1, "a"), 0, leader) is not None
        assert store.read_view()[0] == view(1, "a")


@pytest.mark.integration
def test_store_over_tls_without_client_certificate(tls_files: TLSFiles, config: Config) -> None:
    server_tls = EtcdServerTLS(
        cert_file=tls_files.server_cert,
        key_file=tls_files.server_key,
        trusted_ca_file=tls_files.ca_cert,
        client_cert_auth=False,
    )
    client_tls = EtcdClientTLS(ca_file=tls_files.ca_cert)
    with (
        LocalEtcd(tls=server_tls) as server,
        EtcdStore([server.endpoint], "job-a", config, tls=client_tls) as store,
    ):
        store.write_progress(1, 2)
        assert store.read_progress() == (1, 2)


def test_https_endpoint_without_tls_settings_is_rejected(config: Config) -> None:
    with pytest.raises(ValueError, match="https"):
        EtcdStore(["https://127.0.0.1:2379"], "job-a", config)
