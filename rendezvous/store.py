"""A job's keyspace in etcd: its keys, records and transactions.

Everything for a job lives under ``/rollcall/jobs/<job>/`` as JSON, readable
with ``etcdctl get --prefix /rollcall/jobs/``::

    view            the committed view (``View.to_json``)
    leader          {"address", "lease_id", "replica_id"}, tied to the leader's lease
    members/<id>    {"address", "id", "secret_sha256"}, each tied to its own
                    lease (the hash of the member's secret, ``rollcall.membership.credentials``)
    secrets/<id>    {"secret_sha256"}: the member's secret hash again, tied to no lease: a member
                    whose lease etcd let expire (an outage, a partition) is
                    still recognised by the leader it reconnects to; deleted
                    with the member
    progress        {"epoch", "step"}: last committed step reported for the view
    checkpoints     [manifest, ...]: durable checkpoints, newest first
                    (``rollcall.membership.checkpoint.CheckpointManifest``); absent
                    when there are none
    checkpoint_failure  {"step", "reason", "since_unix", "failures", "writer"}:
                    checkpoints fail (``rollcall.membership.checkpoint.CheckpointFailure``)
    fingerprint     {field: value}: what every worker of the job must match
                    (``rollcall.membership.fingerprint.JobFingerprint``), recorded by
                    the first fingerprinted join
    epoch_key       {"key"}: the random key every view's epoch secret is
                    derived from (``rollcall.membership.credentials.epoch_secret``)
    lost            {"epoch"}: etcd lost the job's data; the highest epoch a
                    member was refused at for being in a view etcd no longer
                    holds (``JobRecordLost``): the job trained before

The store is synchronous: the asyncio service calls it from worker threads.

Every request goes through ``rollcall.rendezvous.etcd_client.EtcdClient``:
failover between endpoints and retries within ``2 * config.etcd_timeout``,
then :class:`ControlPlaneUnavailable`; credentials etcd refuses raise
``EtcdCredentialsRefused``; watches survive broken streams.

Validation. Every value read is checked (``rollcall.rendezvous.records``) before it is
used: a malformed view raises :class:`MalformedRecord`; a malformed leader,
member, progress or checkpoint record is logged (once per value) and ignored.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from pyetcd import etcdrpc

from rollcall.membership.checkpoint import (
    CheckpointFailure,
    CheckpointManifest,
    beyond_progress,
    record,
)
from rollcall.membership.config import Config
from rollcall.membership.continuity import EtcdPosition
from rollcall.membership.credentials import SECRET_BYTES, is_secret_text
from rollcall.membership.errors import (
    ControlPlaneUnavailable,
    InvalidRequest,
    MalformedRecord,
    NoSuchCheckpoint,
)
from rollcall.membership.fingerprint import JobFingerprint, check_fingerprint
from rollcall.membership.view import EMPTY_VIEW, Member, View
from rollcall.rendezvous import etcd_auth, records
from rollcall.rendezvous.etcd_client import (
    EtcdClient,
    EtcdClientTLS,
    first_kv,
    key_compare,
    put_op,
    range_op,
    range_request,
)

_log = logging.getLogger(__name__)

T = TypeVar("T")

#: Compare-and-swap rounds before a contended update gives up.
_CAS_ATTEMPTS = 5


_PREFIX = "/rollcall/jobs/"


@dataclass(frozen=True)
class MemberRecord:
    """A member's record in etcd, tied to its own lease."""

    member: Member
    lease_id: int
    #: etcd revision at which the record was created: orders joiners by arrival.
    create_revision: int
    #: Hash of the member's secret (``rollcall.membership.credentials.secret_hash``);
    #: "" when the record holds none or a malformed one: nothing then proves
    #: a request to be the member's.
    secret_hash: str = ""


@dataclass(frozen=True)
class StoredFingerprint:
    """The job's fingerprint as etcd holds it, with what a join needs to
    decide about a joiner's, all read at one revision."""

    #: None when absent or malformed (``malformed`` then says why).
    fingerprint: JobFingerprint | None
    #: The key's mod_revision (0: absent), for a compare-and-swap.
    revision: int
    #: Why a value that is present could not be used ("" if it could).
    malformed: str
    #: Whether the job has a progress record, and published checkpoints.
    progress: bool
    checkpoints: bool


@dataclass(frozen=True)
class LeaderInfo:
    """The replica holding a job's election, and the lease that holds it."""

    replica_id: str
    address: str
    lease_id: int
    #: The leader's timing settings (``records.timing_pairs``); none from a
    #: replica of an earlier version.
    timing: tuple[tuple[str, float], ...] = ()


#: Most members ``EtcdStore.add_members`` records in one transaction: two
#: puts each within etcd's default --max-txn-ops (128).
MEMBERS_PER_TXN = 64


def _dumps(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def _leader_value(leader: LeaderInfo) -> bytes:
    return _dumps({
        "address": leader.address, "lease_id": leader.lease_id, "replica_id": leader.replica_id,
        "timing": dict(leader.timing),
    })  # fmt: skip


def _parse_leader(kv: Any) -> LeaderInfo:
    """The leader record ``kv`` holds; ``MalformedRecord`` if it is not one
    a replica wrote (``records.check_leader``)."""
    return LeaderInfo(*records.check_leader(kv.value, int(kv.lease)))


def _check_name(kind: str, value: str) -> None:
    if not value or "/" in value:
        raise InvalidRequest(f"{kind} must be non-empty and contain no '/', got {value!r}")


@dataclass(frozen=True)
class JobRecord:
    """What etcd holds of a job and a replica remembers, so that it can be
    written back if etcd loses it (``EtcdStore.restore_job``)."""

    view: View
    #: The view key's mod_revision (0: absent), for a compare-and-swap.
    view_revision: int
    progress: tuple[int, int] | None
    fingerprint: dict[str, str] | None
    checkpoints: tuple[CheckpointManifest, ...]


def _fingerprint(value: bytes) -> dict[str, str]:
    """The fingerprint record ``value`` holds, or ``MalformedRecord``."""
    try:
        data = json.loads(value)
        if not isinstance(data, dict):
            raise InvalidRequest(f"a JSON {type(data).__name__}, not an object")
        return check_fingerprint(data).as_dict()
    except (ValueError, RecursionError, InvalidRequest) as exc:
        raise MalformedRecord(str(exc)[:200] or type(exc).__name__) from None


def _first_kv_of(response: etcdrpc.RangeResponse) -> Any:
    return response.kvs[0] if response.kvs else None


def _parse_epoch_key(value: bytes) -> str | None:
    """The key of an ``epoch_key`` value, or None if it is malformed."""
    try:
        data = json.loads(value)
    except (ValueError, RecursionError):
        return None
    key = data.get("key") if isinstance(data, dict) else None
    return key if isinstance(key, str) and is_secret_text(key) else None


class EtcdStore:
    """A job's durable state in etcd. See the module docstring for the layout;
    connection errors raise :class:`ControlPlaneUnavailable` (``EtcdClient``)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        job: str,
        config: Config,
        tls: EtcdClientTLS | None = None,
        credentials: etcd_auth.EtcdCredentials | None = None,
    ) -> None:
        _check_name("job", job)
        self.job = job
        self._config = config
        #: The resilient client every request of the job goes through.
        self.etcd = EtcdClient(endpoints, config, tls, credentials)
        #: Malformed records already logged: key -> mod_revision.
        self._warned: dict[bytes, int] = {}
        self._warned_lock = threading.Lock()
        #: The view last decoded or written, and its bytes: the view key is
        #: read every keep-alive round and every view poll, and a view of
        #: thousands of members costs milliseconds to decode and check
        #: (one pair, replaced as a whole: safe across the etcd threads).
        self._known_view: tuple[bytes, View] = (b"", EMPTY_VIEW)
        base = f"{_PREFIX}{job}/"
        self.prefix = base.encode()
        self._view_key = f"{base}view".encode()
        self._leader_key = f"{base}leader".encode()
        self._members_prefix = f"{base}members/".encode()
        self._secrets_prefix = f"{base}secrets/".encode()
        self._progress_key = f"{base}progress".encode()
        self._checkpoints_key = f"{base}checkpoints".encode()
        self._checkpoint_failure_key = f"{base}checkpoint_failure".encode()
        self._lost_key = f"{base}lost".encode()
        # Revision of a malformed failure record already logged.
        self._failure_warned = 0
        self._fingerprint_key = f"{base}fingerprint".encode()
        self._epoch_key_key = f"{base}epoch_key".encode()

    def close(self) -> None:
        """Cancel the watches and close the connections. Idempotent."""
        self.etcd.close()

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def ping(self) -> None:
        """Raise :class:`ControlPlaneUnavailable` unless etcd serves a
        linearizable read (which needs a quorum)."""
        self.etcd.kv_range(range_request(self._view_key, count_only=True))

    # --- view ----------------------------------------------------------------
    def read_view(self) -> tuple[View, int]:
        """The committed view and its key's mod_revision; ``(EMPTY_VIEW, 0)``
        before the first commit."""
        response = self.etcd.kv_range(range_request(self._view_key))
        if not response.kvs:
            return EMPTY_VIEW, 0
        kv = response.kvs[0]
        return self._checked_view(kv), int(kv.mod_revision)

    def read_stored_view(self) -> tuple[View | None, int, str]:
        """The view key as it is: ``(view, mod_revision, "")``, or ``(None,
        mod_revision, why)`` when it holds no valid view (``(EMPTY_VIEW, 0,
        "")`` when absent). For a leader that checks whether someone else
        wrote it."""
        response = self.etcd.kv_range(range_request(self._view_key))
        if not response.kvs:
            return EMPTY_VIEW, 0, ""
        kv = response.kvs[0]
        try:
            return self._view_of(kv.value), int(kv.mod_revision), ""
        except MalformedRecord as exc:
            return None, int(kv.mod_revision), str(exc)

    def _view_of(self, value: bytes) -> View:
        """``records.check_view(value)``, decoded once per value."""
        known_bytes, known = self._known_view
        if value == known_bytes:
            return known
        view = records.check_view(value, self._config)
        self._known_view = (bytes(value), view)
        return view

    def _checked_view(self, kv: Any) -> View:
        try:
            return self._view_of(kv.value)
        except MalformedRecord as exc:
            raise MalformedRecord(
                f"etcd holds a malformed view of job {self.job} at {kv.key.decode()} ({exc})"
            ) from None

    def _checked(self, kv: Any, check: Callable[[bytes], T]) -> T | None:
        """``check(kv.value)``, or None when ``kv`` is absent or malformed
        (logged once per value)."""
        if kv is None:
            return None
        try:
            return check(kv.value)
        except MalformedRecord as exc:
            self._ignore(kv, exc)
            return None

    def _ignore(self, kv: Any, why: MalformedRecord | str) -> None:
        """Log (once per value) that the record ``kv`` is ignored."""
        key, revision = bytes(kv.key), int(kv.mod_revision)
        with self._warned_lock:
            if self._warned.get(key) == revision:
                return
            self._warned[key] = revision
        _log.warning(
            "etcd: ignored the malformed record %s of job %s (%s)", key.decode(), self.job, why
        )

    def commit_view(self, view: View, prev_revision: int, leader: LeaderInfo) -> int | None:
        """Publish ``view`` in one transaction, if the view key is still at
        ``prev_revision`` (absent when 0) and the leader key still holds
        exactly ``leader`` (same replica and same election lease, so a
        deposed leader, even one re-elected since, is fenced).

        Returns the view's new mod_revision, or ``None`` when a comparison
        failed and nothing was written. (When an attempt's answer was lost and
        the retry finds exactly this view in place, that counts as success.)
        """
        value = view.to_json().encode()
        self._known_view = (value, view)
        if prev_revision == 0:
            view_compare = key_compare(self._view_key, "CREATE", 0)
        else:
            view_compare = key_compare(self._view_key, "MOD", prev_revision)
        request = etcdrpc.TxnRequest(
            compare=[view_compare, key_compare(self._leader_key, "VALUE", _leader_value(leader))],
            success=[put_op(self._view_key, value)],
            failure=[range_op(range_request(self._view_key))],
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> int | None:
            response = self.etcd.txn(request, channel, timeout)
            if response.succeeded:
                return int(response.header.revision)
            current = first_kv(response, 0)
            if retried and current is not None and current.value == value:
                # An earlier attempt committed it and its answer was lost.
                return int(current.mod_revision)
            return None

        return self.etcd.call(attempt)

    def job_exists(self) -> bool:
        """Whether the job has a view, a leader or any member record."""
        request = etcdrpc.TxnRequest(
            success=[
                range_op(range_request(self._view_key, count_only=True)),
                range_op(range_request(self._leader_key, count_only=True)),
                range_op(range_request(self._members_prefix, prefix=True, count_only=True)),
            ]
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> bool:
            response = self.etcd.txn(request, channel, timeout)
            return any(r.response_range.count > 0 for r in response.responses)

        return self.etcd.call(attempt)

    # --- members ---------------------------------------------------------------
    def _member_key(self, member_id: str) -> bytes:
        return self._members_prefix + member_id.encode()

    def add_member(self, member: Member, secret_hash: str = "") -> MemberRecord:
        """Record ``member`` (and the hash of its secret) under a new lease of
        ``config.member_lease_ttl``.

        A member id holds one record at a time: adding an id that already has
        a record raises :class:`InvalidRequest` (remove it first).
        """
        _check_name("member id", member.id)
        key = self._member_key(member.id)
        value = _dumps({"address": member.address, "id": member.id, "secret_sha256": secret_hash})
        lease_id = self.etcd.grant(self._config.member_lease_ttl)
        request = etcdrpc.TxnRequest(
            compare=[key_compare(key, "CREATE", 0)],
            success=[
                put_op(key, value, lease_id),
                range_op(range_request(key)),
                put_op(self._secret_key(member.id), _dumps({"secret_sha256": secret_hash})),
            ],
            failure=[range_op(range_request(key))],
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> Any:
            response = self.etcd.txn(request, channel, timeout)
            if response.succeeded:
                return first_kv(response, 1)
            current = first_kv(response, 0)
            if retried and current is not None and current.lease == lease_id:
                return current  # an earlier attempt wrote it
            return None

        kv = self.etcd.call(attempt)
        if kv is None:
            self.etcd.revoke(lease_id)
            raise InvalidRequest(f"member {member.id!r} already has a record in job {self.job!r}")
        return MemberRecord(member, lease_id, int(kv.create_revision), secret_hash)

    def grant_member_lease(self) -> int:
        """A new lease of ``config.member_lease_ttl`` for ``add_members``
        (unused, it holds no key and expires by itself)."""
        return self.etcd.grant(self._config.member_lease_ttl)

    def add_members(
        self, members: Sequence[tuple[Member, str]], lease_ids: Sequence[int]
    ) -> list[MemberRecord]:
        """Record several members (each with the hash of its secret) in one
        transaction, each under its own lease (``grant_member_lease``): one
        etcd write for a batch of joiners instead of one each. At most
        ``MEMBERS_PER_TXN`` (etcd's default --max-txn-ops is 128, and each
        member is two puts). If any id already has a record, none is written
        and :class:`InvalidRequest` is raised."""
        if len(members) != len(lease_ids) or not 0 < len(members) <= MEMBERS_PER_TXN:
            raise ValueError(f"add_members takes 1 to {MEMBERS_PER_TXN} members with a lease each")
        keys = []
        success = []
        for (member, secret_hash), lease_id in zip(members, lease_ids, strict=True):
            _check_name("member id", member.id)
            key = self._member_key(member.id)
            value = {"address": member.address, "id": member.id, "secret_sha256": secret_hash}
            keys.append(key)
            success.append(put_op(key, _dumps(value), lease_id))
            success.append(put_op(self._secret_key(member.id),
                                  _dumps({"secret_sha256": secret_hash})))  # fmt: skip
        request = etcdrpc.TxnRequest(
            compare=[key_compare(key, "CREATE", 0) for key in keys],
            success=success,
            failure=[range_op(range_request(key)) for key in keys],
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> int | None:
            response = self.etcd.txn(request, channel, timeout)
            if response.succeeded:
                return int(response.header.revision)
            found = [first_kv(response, i) for i in range(len(keys))]
            if retried and all(
                kv is not None and kv.lease == lease_id
                for kv, lease_id in zip(found, lease_ids, strict=True)
            ):
                return int(found[0].create_revision)  # an earlier attempt wrote them
            return None

        revision = self.etcd.call(attempt)
        if revision is None:
            raise InvalidRequest(f"a member of this batch already has a record in job {self.job!r}")
        return [
            MemberRecord(member, lease_id, revision, secret_hash)
            for (member, secret_hash), lease_id in zip(members, lease_ids, strict=True)
        ]

    def list_members(self) -> list[MemberRecord]:
        """Every member record, oldest first (by create_revision)."""
        response = self.etcd.kv_range(
            range_request(
                self._members_prefix,
                prefix=True,
                sort_order=etcdrpc.RangeRequest.ASCEND,
                sort_target=etcdrpc.RangeRequest.CREATE,
            )
        )
        found = []
        for kv in response.kvs:
            member_id = bytes(kv.key)[len(self._members_prefix) :].decode(errors="replace")
            try:
                member = records.check_member_record(
                    member_id, kv.value, int(kv.lease), self._config
                )
            except MalformedRecord as exc:
                self._ignore(kv, exc)
                continue
            # The hash of the member's secret: a record without a valid one
            # opens no session (``rollcall.membership.credentials``).
            secret = json.loads(kv.value).get("secret_sha256")
            secret = secret if isinstance(secret, str) and is_secret_text(secret) else ""
            found.append(MemberRecord(member, int(kv.lease), int(kv.create_revision), secret))
        return found

    def remove_member(self, member_id: str, lease_id: int) -> None:
        """Revoke the member's lease, which deletes its record, and delete
        its secret hash. Removing a member that is already gone is not an
        error."""
        self.etcd.revoke(lease_id)
        self.etcd.delete(self._secret_key(member_id))

    def _secret_key(self, member_id: str) -> bytes:
        return self._secrets_prefix + member_id.encode()

    def forget_secrets(self, member_ids: Iterable[str]) -> None:
        """Delete the secret hashes of members that are gone (in one
        transaction; deleting one that is already gone is not an error)."""
        ops = [
            etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=self._secret_key(i)))
            for i in member_ids
        ]
        if not ops:
            return
        request = etcdrpc.TxnRequest(success=ops)

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> None:
            self.etcd.txn(request, channel, timeout)

        self.etcd.call(attempt)

    def list_secret_hashes(self) -> dict[str, str]:
        """Member id -> the hash of its secret, for every member not removed
        (their records may be gone with an expired lease). Malformed values
        are left out (logged): such a member opens no session."""
        response = self.etcd.kv_range(range_request(self._secrets_prefix, prefix=True))
        found = {}
        for kv in response.kvs:
            member_id = bytes(kv.key)[len(self._secrets_prefix) :].decode(errors="replace")
            try:
                data = json.loads(kv.value)
                value = data.get("secret_sha256") if isinstance(data, dict) else None
            except (ValueError, RecursionError):
                value = None
            if isinstance(value, str) and is_secret_text(value):
                found[member_id] = value
            else:
                self._ignore(kv, "not a secret hash")
        return found

    def keep_alive(self, lease_ids: Iterable[int]) -> dict[int, int]:
        """Refresh many leases over one keep-alive stream (``EtcdClient.keep_alive``)."""
        return self.etcd.keep_alive(lease_ids)

    def lease_ttl(self, lease_id: int) -> int:
        """Seconds left on a lease (etcd rounds down); -1 when it is gone."""
        return self.etcd.lease_ttl(lease_id)

    # --- leader election -------------------------------------------------------
    def campaign(self, replica_id: str, address: str) -> LeaderInfo | None:
        """Try to become the job's leader: returns our LeaderInfo if the
        leader key was free and is now ours, else ``None``."""
        leader = self._take_leader_key(replica_id, address, [])
        if leader is not None:
            return leader
        self._remove_planted_leader()
        return None

    def _take_leader_key(
        self, replica_id: str, address: str, compare: list[Any]
    ) -> LeaderInfo | None:
        """Write our leader record under a new election lease if the leader
        key is free (and ``compare`` holds); None, with the unused lease
        revoked, if not."""
        lease_id = self.etcd.grant(self._config.election_ttl)
        timing = records.timing_pairs(self._config.service_timing())
        leader = LeaderInfo(replica_id, address, lease_id, timing)
        value = _leader_value(leader)
        request = etcdrpc.TxnRequest(
            compare=[key_compare(self._leader_key, "CREATE", 0), *compare],
            success=[put_op(self._leader_key, value, lease_id)],
            failure=[range_op(range_request(self._leader_key))],
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> bool:
            response = self.etcd.txn(request, channel, timeout)
            if response.succeeded:
                return True
            current = first_kv(response, 0)
            return retried and current is not None and current.value == value

        if self.etcd.call(attempt):
            return leader
        try:
            self.etcd.revoke(lease_id)
        except ControlPlaneUnavailable:
            # The unused lease holds no key and expires within election_ttl.
            _log.info("could not revoke unused election lease %x", lease_id)
        return None

    def _remove_planted_leader(self) -> None:
        """Delete the leader key if it does not hold a leader record a
        replica wrote (``records.check_leader``: no lease, malformed, another
        lease named than the key's). Such a key would otherwise stop every
        replica from leading for good. The deletion compares the key's
        revision, so a replica's record written meanwhile is never removed."""
        kv = self.etcd.kv_range(range_request(self._leader_key)).kvs
        if not kv:
            return
        try:
            _parse_leader(kv[0])
            return
        except MalformedRecord as exc:
            why = exc
        request = etcdrpc.TxnRequest(
            compare=[key_compare(self._leader_key, "MOD", int(kv[0].mod_revision))],
            success=[
                etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(
                    key=self._leader_key
                ))
            ],
        )  # fmt: skip

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> bool:
            return bool(self.etcd.txn(request, channel, timeout).succeeded)

        if self.etcd.call(attempt):
            _log.warning(
                "etcd: removed a leader key of job %s that no replica wrote (%s)", self.job, why
            )

    def refresh_leader(self, leader: LeaderInfo) -> bool:
        """Keep our election lease alive. False once the lease is gone or the
        leader key no longer holds ``leader``."""
        if self.keep_alive([leader.lease_id]).get(leader.lease_id, 0) <= 0:
            return False
        return self.read_leader() == leader

    def resign(self, leader: LeaderInfo) -> None:
        """Give up the election by revoking our lease (deletes the key)."""
        self.etcd.revoke(leader.lease_id)

    def read_leader(self) -> LeaderInfo | None:
        response = self.etcd.kv_range(range_request(self._leader_key))
        if not response.kvs:
            return None
        try:
            return _parse_leader(response.kvs[0])
        except MalformedRecord as exc:
            self._ignore(response.kvs[0], exc)
            return None

    # --- watches ---------------------------------------------------------------
    def watch_leader(
        self,
        callback: Callable[[LeaderInfo | None], None],
        *,
        after_revision: int | None = None,
    ) -> Callable[[], None]:
        """Call ``callback`` with the new leader (``None`` when the key is
        deleted) on every change after ``after_revision`` (default: now).
        Returns a function that cancels the watch without blocking. See
        :class:`rollcall.rendezvous.etcd_client.EtcdClient.watch`."""

        def handle(kv: Any) -> None:
            try:
                callback(None if kv is None else _parse_leader(kv))
            except MalformedRecord as exc:
                self._ignore(kv, exc)
                callback(None)

        return self.etcd.watch(self._leader_key, handle, after_revision, "leader")

    def watch_view(
        self,
        callback: Callable[[View], None],
        *,
        after_revision: int | None = None,
    ) -> Callable[[], None]:
        """Call ``callback`` with every view committed after ``after_revision``
        (default: now; pass the revision from ``read_view`` to miss nothing).
        Returns a function that cancels the watch without blocking. See
        :class:`rollcall.rendezvous.etcd_client.EtcdClient.watch`."""

        def handle(kv: Any) -> None:
            if kv is None:
                return
            try:
                view = self._view_of(kv.value)
            except MalformedRecord as exc:
                self._ignore(kv, exc)
                return
            callback(view)

        return self.etcd.watch(self._view_key, handle, after_revision, "view")

    # --- progress --------------------------------------------------------------
    def write_progress(self, epoch: int, step: int) -> None:
        """Record the last committed step reported for view ``epoch``."""
        self.etcd.put(self._progress_key, _dumps({"epoch": epoch, "step": step}))

    def read_progress(self) -> tuple[int, int] | None:
        """``(epoch, step)`` last written, or ``None``."""
        response = self.etcd.kv_range(range_request(self._progress_key))
        if not response.kvs:
            return None
        try:
            return records.check_progress(response.kvs[0].value)
        except MalformedRecord as exc:
            self._ignore(response.kvs[0], exc)
            return None

    def record_lost(self, epoch: int) -> None:
        """Record that a member of epoch ``epoch`` found the job's data lost
        (kept at the highest such epoch)."""
        known = self.read_lost()
        if known is None or known < epoch:
            self.etcd.put(self._lost_key, _dumps({"epoch": epoch}))

    def read_lost(self) -> int | None:
        """The epoch of the lost-history record, or None (none, or malformed:
        logged)."""
        response = self.etcd.kv_range(range_request(self._lost_key))
        if not response.kvs:
            return None
        try:
            return records.check_lost(response.kvs[0].value)
        except MalformedRecord as exc:
            self._ignore(response.kvs[0], exc)
            return None

    # --- checkpoints -----------------------------------------------------------
    def read_checkpoints(self) -> list[CheckpointManifest]:
        """The published checkpoint manifests, newest first. Entries that are
        malformed are left out, and logged once per version of the record."""
        return self._read_checkpoints()[0]

    def _read_checkpoints(self) -> tuple[list[CheckpointManifest], int]:
        response = self.etcd.kv_range(range_request(self._checkpoints_key))
        if not response.kvs:
            return [], 0
        kv = response.kvs[0]
        try:
            manifests, skipped = records.check_checkpoints(kv.value, self._config)
        except MalformedRecord as exc:
            self._ignore(kv, exc)
            return [], int(kv.mod_revision)
        if skipped:
            self._ignore(kv, "; ".join(skipped)[:300])
        return manifests, int(kv.mod_revision)

    def publish_checkpoint(
        self, manifest: CheckpointManifest, keep: int, limit: int | None = None
    ) -> tuple[bool, list[CheckpointManifest]]:
        """Record ``manifest`` if it is newer than every recorded one, keeping
        the ``keep`` newest; a compare-and-swap on the key, retried when
        another writer got in between. With ``limit`` (the highest step the
        job's progress allows), recorded manifests beyond it are dropped
        first (logged): a forged one must not hold the record. Returns
        (accepted, manifests kept)."""
        dropped: list[CheckpointManifest]
        for _ in range(_CAS_ATTEMPTS):
            recorded, revision = self._read_checkpoints()
            kept, dropped = recorded, []
            if limit is not None:
                kept, dropped = beyond_progress(recorded, limit)
            accepted, updated = record(kept, manifest, keep)
            if not accepted:
                # (Or an earlier attempt of ours landed and its answer was lost.)
                accepted = bool(kept) and kept[0] == manifest
                if not dropped:
                    return accepted, kept
            if self._swap_checkpoints(revision, updated):
                for gone in dropped:
                    _log.warning(
                        "job %s: dropped the recorded checkpoint of step %d (%s): it is beyond "
                        "the job's progress (step %d at most)", self.job, gone.step, gone.uri,
                        limit,
                    )  # fmt: skip
                return accepted, updated
        raise ControlPlaneUnavailable("checkpoint manifest: too much contention on etcd")

    def forget_checkpoints(
        self, steps: Sequence[int] | None
    ) -> tuple[list[CheckpointManifest], list[CheckpointManifest]]:
        """Remove the manifests of ``steps`` from the record (None: the whole
        record, malformed entries too). Raises ``NoSuchCheckpoint`` naming
        any step not recorded (nothing removed then). Returns (forgotten,
        kept)."""
        for _ in range(_CAS_ATTEMPTS):
            recorded, revision = self._read_checkpoints()
            if steps is None:
                forgotten, kept = recorded, []
            else:
                missing = sorted(set(steps) - {m.step for m in recorded})
                if missing:
                    have = ", ".join(str(m.step) for m in recorded) or "none"
                    raise NoSuchCheckpoint(
                        f"no checkpoint of step {', '.join(map(str, missing))} is recorded for "
                        f"job {self.job} (recorded: {have})"
                    )
                forgotten = [m for m in recorded if m.step in steps]
                kept = [m for m in recorded if m.step not in steps]
            if revision == 0 or self._swap_checkpoints(revision, kept):
                return forgotten, kept
        raise ControlPlaneUnavailable("checkpoint record: too much contention on etcd")

    def _swap_checkpoints(self, revision: int, manifests: Sequence[CheckpointManifest]) -> bool:
        """Replace the record read at ``revision`` (0: absent) by
        ``manifests``, or delete it when there are none (a job without
        checkpoints has no key). False if it changed meanwhile."""
        key = self._checkpoints_key
        compare = key_compare(key, "MOD", revision) if revision else key_compare(key, "CREATE", 0)
        if manifests:
            op = put_op(key, _dumps([m.to_dict() for m in manifests]))
        else:
            op = etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=key))
        request = etcdrpc.TxnRequest(compare=[compare], success=[op])

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> bool:
            return bool(self.etcd.txn(request, channel, timeout).succeeded)

        return self.etcd.call(attempt)

    def read_checkpoint_failure(self) -> CheckpointFailure | None:
        """The job's durability failure record, if any; a malformed one is
        logged once and read as none."""
        response = self.etcd.kv_range(range_request(self._checkpoint_failure_key))
        if not response.kvs:
            return None
        kv = response.kvs[0]
        try:
            return CheckpointFailure.from_dict(json.loads(kv.value))
        except (ValueError, RecursionError, InvalidRequest) as exc:
            if int(kv.mod_revision) != self._failure_warned:
                self._failure_warned = int(kv.mod_revision)
                _log.warning("job %s: the checkpoint failure record in etcd is ignored: %s",
                             self.job, str(exc)[:200])  # fmt: skip
            return None

    def write_checkpoint_failure(self, failure: CheckpointFailure | None) -> None:
        """Record that checkpoints fail (None: that they no longer do)."""
        if failure is not None:
            self.etcd.put(self._checkpoint_failure_key, _dumps(failure.to_dict()))
            return
        self.etcd.delete(self._checkpoint_failure_key)

    # --- fingerprint -----------------------------------------------------------
    def read_fingerprint(self) -> StoredFingerprint:
        """The job's fingerprint, validated, with its revision and whether the
        job has progress or checkpoints. A malformed value is reported in
        ``malformed`` (and ``fingerprint`` is None), never raised."""
        request = etcdrpc.TxnRequest(
            success=[
                range_op(range_request(self._fingerprint_key)),
                range_op(range_request(self._progress_key, count_only=True)),
                range_op(range_request(self._checkpoints_key, count_only=True)),
            ]
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> Any:
            return self.etcd.txn(request, channel, timeout)

        response = self.etcd.call(attempt)
        kv = first_kv(response, 0)
        progress = response.responses[1].response_range.count > 0
        checkpoints = response.responses[2].response_range.count > 0
        if kv is None:
            return StoredFingerprint(None, 0, "", progress, checkpoints)
        fingerprint, malformed = None, ""
        try:
            data = json.loads(kv.value)
            if not isinstance(data, dict):
                raise InvalidRequest(f"a JSON {type(data).__name__}, not an object")
            fingerprint = check_fingerprint(data)
        except (ValueError, RecursionError, InvalidRequest) as exc:
            malformed = str(exc)[:200] or type(exc).__name__
        return StoredFingerprint(
            fingerprint, int(kv.mod_revision), malformed, progress, checkpoints
        )

    def record_fingerprint(self, fingerprint: JobFingerprint, revision: int) -> bool:
        """Write ``fingerprint`` if the key is still at ``revision`` (absent
        when 0): create-if-absent, or replace exactly the value read. False
        when another writer got in between (nothing written)."""
        value = _dumps(fingerprint.as_dict())
        if revision == 0:
            compare = key_compare(self._fingerprint_key, "CREATE", 0)
        else:
            compare = key_compare(self._fingerprint_key, "MOD", revision)
        request = etcdrpc.TxnRequest(
            compare=[compare],
            success=[put_op(self._fingerprint_key, value)],
            failure=[range_op(range_request(self._fingerprint_key))],
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> bool:
            response = self.etcd.txn(request, channel, timeout)
            if response.succeeded:
                return True
            current = first_kv(response, 0)
            # An earlier attempt of ours landed and its answer was lost.
            return retried and current is not None and current.value == value

        return self.etcd.call(attempt)

    # --- epoch key -------------------------------------------------------------
    def epoch_key(self) -> str:
        """The job's epoch key (``rollcall.membership.credentials``: 64 hex digits),
        created at random if the job has none yet (create-if-absent), so that
        every replica that leads derives the same epoch secrets. A malformed
        value is logged and replaced (compare-and-swap on its revision):
        epoch secrets derived from it change, and members that held the old
        ones are refused by their peers until the next view."""
        for _ in range(_CAS_ATTEMPTS):
            kv = _first_kv_of(self.etcd.kv_range(range_request(self._epoch_key_key)))
            if kv is not None:
                stored = _parse_epoch_key(kv.value)
                if stored is not None:
                    return stored
                _log.warning("job %s: the epoch key in etcd is malformed: replaced", self.job)
            fresh = secrets.token_hex(SECRET_BYTES)
            compare = (
                key_compare(self._epoch_key_key, "MOD", int(kv.mod_revision))
                if kv is not None
                else key_compare(self._epoch_key_key, "CREATE", 0)
            )
            request = etcdrpc.TxnRequest(
                compare=[compare], success=[put_op(self._epoch_key_key, _dumps({"key": fresh}))]
            )

            def attempt(
                channel: grpc.Channel, timeout: float, retried: bool, txn: Any = request
            ) -> bool:
                return bool(self.etcd.txn(txn, channel, timeout).succeeded)

            if self.etcd.call(attempt):
                return fresh
            # Another replica wrote one meanwhile (or our earlier attempt
            # landed and its answer was lost): read it.
        raise ControlPlaneUnavailable("epoch key: too much contention on etcd")

    def snapshot(self) -> dict[str, bytes]:
        """Every key under the job's prefix with its value."""
        response = self.etcd.kv_range(range_request(self.prefix, prefix=True))
        return {kv.key.decode(): bytes(kv.value) for kv in response.kvs}

    # --- outages and lost data ---------------------------------------------------
    def reclaim_leadership(
        self, replica_id: str, address: str, view_revision: int
    ) -> LeaderInfo | None:
        """Take the election again under a new lease after ours expired
        while etcd could not be reached (or kept it alive): only if nobody
        holds the leader key and the view key is still at ``view_revision``
        (absent when 0), i.e. nobody led meanwhile. ``None`` otherwise."""
        if view_revision:
            view_compare = key_compare(self._view_key, "MOD", view_revision)
        else:
            view_compare = key_compare(self._view_key, "CREATE", 0)
        return self._take_leader_key(replica_id, address, [view_compare])

    def register_again(self, member: Member, secret_hash: str) -> MemberRecord:
        """Record ``member`` (and the hash of its secret) again under a new
        lease: its old lease expired (etcd could not keep it alive) or its
        record is gone, while the member itself is alive. Replaces any
        record the id still has."""
        _check_name("member id", member.id)
        key = self._member_key(member.id)
        value = _dumps({"address": member.address, "id": member.id, "secret_sha256": secret_hash})
        lease_id = self.etcd.grant(self._config.member_lease_ttl)
        request = etcdrpc.TxnRequest(
            success=[
                put_op(key, value, lease_id),
                range_op(range_request(key)),
                put_op(self._secret_key(member.id), _dumps({"secret_sha256": secret_hash})),
            ]
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> Any:
            return first_kv(self.etcd.txn(request, channel, timeout), 1)

        kv = self.etcd.call(attempt)
        revision = int(kv.create_revision) if kv is not None else 0
        return MemberRecord(member, lease_id, revision, secret_hash)

    def write_progress_as(self, leader: LeaderInfo, epoch: int, step: int) -> bool:
        """Record the last committed step reported for view ``epoch``, if
        the leader key still holds ``leader`` (a deposed leader's late write
        must not replace its successor's). False if it does not."""
        request = etcdrpc.TxnRequest(
            compare=[key_compare(self._leader_key, "VALUE", _leader_value(leader))],
            success=[put_op(self._progress_key, _dumps({"epoch": epoch, "step": step}))],
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> bool:
            return bool(self.etcd.txn(request, channel, timeout).succeeded)

        return self.etcd.call(attempt)

    def read_job(self) -> tuple[JobRecord, EtcdPosition]:
        """The job's record (view, progress, fingerprint, checkpoints) and
        etcd's position, read at one revision. Malformed values are logged
        and left out (a malformed view counts as none)."""
        request = etcdrpc.TxnRequest(
            success=[
                range_op(range_request(self._view_key)),
                range_op(range_request(self._progress_key)),
                range_op(range_request(self._fingerprint_key)),
                range_op(range_request(self._checkpoints_key)),
            ]
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> Any:
            return self.etcd.txn(request, channel, timeout)

        response = self.etcd.call(attempt)
        kvs = [first_kv(response, i) for i in range(4)]
        view, view_revision = EMPTY_VIEW, 0
        if kvs[0] is not None:
            # A malformed view is never "no view": MalformedRecord (the
            # replica refuses to lead on it, ``records.check_view``).
            view, view_revision = self._checked_view(kvs[0]), int(kvs[0].mod_revision)
        progress = self._checked(kvs[1], records.check_progress)
        fingerprint = self._checked(kvs[2], _fingerprint)
        checkpoints: list[CheckpointManifest] | None = None
        if kvs[3] is not None:
            try:
                checkpoints, skipped = records.check_checkpoints(kvs[3].value, self._config)
                if skipped:
                    self._ignore(kvs[3], "; ".join(skipped)[:300])
            except MalformedRecord as exc:
                self._ignore(kvs[3], exc)
        record = JobRecord(view, view_revision, progress, fingerprint, tuple(checkpoints or ()))
        header = response.header
        return record, EtcdPosition(int(header.cluster_id), int(header.revision), view.epoch)

    def restore_job(self, record: JobRecord, found_revision: int, leader: LeaderInfo) -> int | None:
        """Write ``record`` back into an etcd that lost it: one transaction,
        only if the leader key holds ``leader`` (the caller leads) and the
        view key is still at ``found_revision`` (what the caller found there;
        0: absent). Returns the view's new mod_revision, or ``None`` when a
        comparison failed and nothing was written."""
        if found_revision:
            view_compare = key_compare(self._view_key, "MOD", found_revision)
        else:
            view_compare = key_compare(self._view_key, "CREATE", 0)
        value = record.view.to_json().encode()
        puts = [put_op(self._view_key, value)]
        if record.progress is not None:
            epoch, step = record.progress
            puts.append(put_op(self._progress_key, _dumps({"epoch": epoch, "step": step})))
        if record.fingerprint is not None:
            puts.append(put_op(self._fingerprint_key, _dumps(record.fingerprint)))
        if record.checkpoints:
            manifests = [m.to_dict() for m in record.checkpoints]
            puts.append(put_op(self._checkpoints_key, _dumps(manifests)))
        request = etcdrpc.TxnRequest(
            compare=[key_compare(self._leader_key, "VALUE", _leader_value(leader)), view_compare],
            success=puts,
            failure=[range_op(range_request(self._view_key))],
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> int | None:
            response = self.etcd.txn(request, channel, timeout)
            if response.succeeded:
                return int(response.header.revision)
            current = first_kv(response, 0)
            if retried and current is not None and current.value == value:
                return int(current.mod_revision)  # an earlier attempt of ours landed
            return None

        return self.etcd.call(attempt)
