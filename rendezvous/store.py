"""The rendezvous service's etcd adapter: views, member leases, election, progress.

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

The store is synchronous: the asyncio service calls it from worker threads.

Reaching etcd. The pyetcd client (``MultiEndpointEtcd3Client`` with failover)
owns one gRPC channel per endpoint and picks the endpoint to use; this module
sends the requests itself through the raw etcd stubs on that channel, because
it needs what pyetcd's wrappers do not give: a deadline per attempt, the
response header of a transaction, and one keep-alive stream for many leases.
An operation that fails with a connection error (gRPC UNAVAILABLE, which also
covers etcd's "no leader" and "request timed out", DEADLINE_EXCEEDED, INTERNAL,
or etcd's own "context deadline exceeded" passed on as UNKNOWN) marks the
endpoint failed and is retried on the next endpoint, at most
``len(endpoints) + 1`` attempts within ``2 * config.etcd_timeout``; then it
raises :class:`ControlPlaneUnavailable`. Requests carry etcd's "require leader"
metadata: a member that knows it has no leader (one election timeout after
losing it) refuses at once instead of letting the request time out, and the
client moves on to another member.

Authentication. Given credentials, every request carries an etcd token for
them (``rollcall.rendezvous.etcd_auth``): fetched on first use, fetched again when
etcd no longer takes it (restarted, token expired, users changed). When
etcd refuses who we are (wrong password, no credentials where it requires
them, no permission on ``/rollcall/``) the call raises
:class:`EtcdCredentialsRefused`, at once and without retrying.

Validation. Every value read is checked (``rollcall.rendezvous.records``) before it is
used: a malformed view raises :class:`MalformedRecord`; a malformed leader,
member, progress or checkpoint record is logged (once per value) and ignored.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import grpc
from pyetcd import etcdrpc
from pyetcd.client import Endpoint, MultiEndpointEtcd3Client
from pyetcd.exceptions import NoServerAvailableError

from rollcall.membership.backoff import Backoff
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
    EtcdCredentialsRefused,
    InvalidRequest,
    MalformedRecord,
    NoSuchCheckpoint,
)
from rollcall.membership.fingerprint import JobFingerprint, check_fingerprint
from rollcall.membership.view import EMPTY_VIEW, Member, View
from rollcall.rendezvous import etcd_auth, records

_log = logging.getLogger(__name__)

T = TypeVar("T")

#: Status codes that mean "this endpoint could not serve the request now".
_UNREACHABLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}
)
#: etcd passes its own context errors on unmapped, as UNKNOWN: when the
#: deadline we sent expires inside etcd first, this is what we receive.
_CONTEXT_ERRORS = ("context deadline exceeded", "context canceled")
#: Compare-and-swap rounds before a contended update gives up.
_CAS_ATTEMPTS = 5


def _unreachable(exc: grpc.RpcError) -> bool:
    """Whether a gRPC error means that this endpoint could not serve us now."""
    code = exc.code()
    if code in _UNREACHABLE_CODES:
        return True
    return code == grpc.StatusCode.UNKNOWN and (exc.details() or "") in _CONTEXT_ERRORS


#: etcd refuses requests (and cancels streams) on a member without a leader.
_REQUIRE_LEADER = (("hasleader", "true"),)


def _grpc_options(config: Config) -> list[tuple[str, int]]:
    """Options of each etcd channel: reconnect back-off and keep-alive
    (``config.etcd_reconnect_backoff_*``, ``etcd_keepalive_*``)."""
    backoff_initial = round(config.etcd_reconnect_backoff_initial * 1000)
    keepalive_timeout = round(config.etcd_keepalive_timeout * 1000)
    return [
        ("grpc.initial_reconnect_backoff_ms", backoff_initial),
        ("grpc.min_reconnect_backoff_ms", backoff_initial),
        ("grpc.max_reconnect_backoff_ms", round(config.etcd_reconnect_backoff_max * 1000)),
        # With grpcio 1.85 the keep-alive timeout has no effect without
        # ping_timeout_ms: a ping to a frozen server was measured to wait
        # for an answer indefinitely.
        ("grpc.keepalive_time_ms", round(config.etcd_keepalive_interval * 1000)),
        ("grpc.keepalive_timeout_ms", keepalive_timeout),
        ("grpc.http2.ping_timeout_ms", keepalive_timeout),
        ("grpc.http2.max_pings_without_data", 0),
    ]


#: An attempt gets at least this share of etcd_timeout, or is not made.
_MIN_ATTEMPT_SHARE = 0.1

_PREFIX = "/rollcall/jobs/"


@dataclass(frozen=True)
class EtcdClientTLS:
    """TLS towards etcd: the CA that signed etcd's certificate and, when etcd
    requires client certificates, this client's certificate and key."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None


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


def _dumps(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def _leader_value(leader: LeaderInfo) -> bytes:
    return _dumps(
        {"address": leader.address, "lease_id": leader.lease_id, "replica_id": leader.replica_id}
    )


def _parse_leader(kv: Any) -> LeaderInfo:
    """The leader record ``kv`` holds; ``MalformedRecord`` if it is not one
    a replica wrote (``records.check_leader``)."""
    return LeaderInfo(*records.check_leader(kv.value, int(kv.lease)))


def _await_connection(channel: grpc.Channel, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for ``channel`` to be connected."""
    ready = grpc.channel_ready_future(channel)
    try:
        ready.result(timeout=max(0.0, timeout))
    except grpc.FutureTimeoutError:
        ready.cancel()


def _prefix_end(prefix: bytes) -> bytes:
    """The range end covering every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def _check_name(kind: str, value: str) -> None:
    if not value or "/" in value:
        raise InvalidRequest(f"{kind} must be non-empty and contain no '/', got {value!r}")


def _range(key: bytes, *, prefix: bool = False, **fields: Any) -> etcdrpc.RangeRequest:
    request = etcdrpc.RangeRequest(key=key, **fields)
    if prefix:
        request.range_end = _prefix_end(key)
    return request


def _compare(key: bytes, target: str, value: int | bytes) -> etcdrpc.Compare:
    """``key``'s ``target`` (CREATE, MOD or VALUE) must equal ``value``."""
    compare = etcdrpc.Compare(
        key=key, target=getattr(etcdrpc.Compare, target), result=etcdrpc.Compare.EQUAL
    )
    field = {"CREATE": "create_revision", "MOD": "mod_revision", "VALUE": "value"}[target]
    setattr(compare, field, value)
    return compare


def _put_op(key: bytes, value: bytes, lease: int = 0) -> etcdrpc.RequestOp:
    return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key, value=value, lease=lease))


def _range_op(request: etcdrpc.RangeRequest) -> etcdrpc.RequestOp:
    return etcdrpc.RequestOp(request_range=request)


def _first_kv(response: etcdrpc.TxnResponse, index: int) -> Any:
    kvs = response.responses[index].response_range.kvs
    return kvs[0] if kvs else None


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
    """A job's durable state in etcd. See the module docstring for the layout
    and for how connection errors become :class:`ControlPlaneUnavailable`."""

    def __init__(
        self,
        endpoints: Sequence[str],
        job: str,
        config: Config,
        tls: EtcdClientTLS | None = None,
        credentials: etcd_auth.EtcdCredentials | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("EtcdStore needs at least one etcd endpoint")
        _check_name("job", job)
        self.job = job
        self._config = config
        self._endpoint_urls = ",".join(endpoints)
        self._url_by_netloc = {urlsplit(url).netloc: url for url in endpoints}
        self._client = MultiEndpointEtcd3Client(
            endpoints=[self._make_endpoint(url, tls) for url in endpoints],
            timeout=config.etcd_timeout,
            failover=True,
        )
        self._max_attempts = len(self._client.endpoints) + 1
        self._select_lock = threading.Lock()
        self._watches: set[_KeyWatch] = set()
        self._watches_lock = threading.Lock()
        self._closed = False
        self._user = credentials.user if credentials is not None else None
        self._tokens = (
            etcd_auth.TokenKeeper(credentials, config.etcd_auth_timeout) if credentials else None
        )
        self._authenticated: dict[int, grpc.Channel] = {}
        #: Malformed records already logged: key -> mod_revision.
        self._warned: dict[bytes, int] = {}
        self._warned_lock = threading.Lock()
        base = f"{_PREFIX}{job}/"
        self.prefix = base.encode()
        self._view_key = f"{base}view".encode()
        self._leader_key = f"{base}leader".encode()
        self._members_prefix = f"{base}members/".encode()
        self._secrets_prefix = f"{base}secrets/".encode()
        self._progress_key = f"{base}progress".encode()
        self._checkpoints_key = f"{base}checkpoints".encode()
        self._checkpoint_failure_key = f"{base}checkpoint_failure".encode()
        # Revision of a malformed failure record already logged.
        self._failure_warned = 0
        self._fingerprint_key = f"{base}fingerprint".encode()
        self._epoch_key_key = f"{base}epoch_key".encode()

    def _make_endpoint(self, url: str, tls: EtcdClientTLS | None) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
            raise ValueError(f"etcd endpoint must look like http://HOST:PORT, got {url!r}")
        secure = parts.scheme == "https"
        if secure != (tls is not None):
            raise ValueError(f"etcd endpoint {url!r}: use https exactly when TLS is configured")
        creds = None
        if tls is not None:
            creds = MultiEndpointEtcd3Client.get_secure_creds(
                tls.ca_file, tls.key_file, tls.cert_file
            )
        return Endpoint(
            parts.hostname,
            parts.port,
            secure=secure,
            creds=creds,
            # How long a failed endpoint is skipped while others remain
            # (pyetcd's default, 300 s, would shun a restarted etcd for minutes).
            time_retry=self._config.etcd_timeout,
            opts=_grpc_options(self._config),
        )

    @property
    def endpoint_in_use(self) -> str:
        """URL of the etcd endpoint that requests currently go to."""
        label = self._client.endpoint_in_use.netloc
        return self._url_by_netloc.get(label, label)

    # --- plumbing ------------------------------------------------------------
    def _unavailable(self) -> ControlPlaneUnavailable:
        return ControlPlaneUnavailable(
            f"control plane unavailable: etcd unreachable at {self._endpoint_urls}"
        )

    def _select(self) -> tuple[Endpoint, grpc.Channel, bool]:
        """The endpoint to use, its channel, and whether it is one that failed
        recently: when every endpoint did, the one that failed longest ago is
        tried again."""
        with self._select_lock:
            try:
                return self._client.endpoint_in_use, self._with_token(self._client.channel), False
            except NoServerAvailableError:
                oldest = min(self._client.endpoints.values(), key=lambda e: e.last_failed)
                oldest.last_failed = 0
                return oldest, self._with_token(self._client.channel), True

    def _with_token(self, channel: grpc.Channel) -> grpc.Channel:
        """``channel``, its calls carrying our etcd token if we have credentials."""
        if self._tokens is None:
            return channel
        wrapped = self._authenticated.get(id(channel))
        if wrapped is None:
            interceptor = etcd_auth.TokenInterceptor(self._tokens, channel)
            wrapped = self._authenticated[id(channel)] = grpc.intercept_channel(
                channel, interceptor
            )
        return wrapped

    def _refused(self, exc: grpc.RpcError) -> bool:
        """Handle an answer about who we are: True if the token was stale
        (dropped: try again); raises EtcdCredentialsRefused if etcd refuses
        our credentials; False for any other error."""
        if self._tokens is not None and etcd_auth.is_stale_token(exc):
            self._tokens.invalidate()
            return True
        refused = etcd_auth.refusal(exc, self._user)
        if refused is not None:
            raise refused from None
        return False

    def _call(self, attempt: Callable[[grpc.Channel, float, bool], T]) -> T:
        """Run ``attempt(channel, timeout, retried)`` with failover and retries.

        ``retried`` tells the attempt that an earlier one may have reached
        etcd, so a conditional write that now fails may have been our own.
        """
        if self._closed:
            raise RuntimeError("EtcdStore is closed")
        budget = 2 * self._config.etcd_timeout
        deadline = time.monotonic() + budget
        failure: grpc.RpcError | None = None
        attempts: list[str] = []
        for number in range(self._max_attempts):
            remaining = deadline - time.monotonic()
            if number and remaining < _MIN_ATTEMPT_SHARE * self._config.etcd_timeout:
                break
            endpoint, channel, failed_before = self._select()
            if number and failed_before:
                # Nowhere else to go. A channel whose connection was refused
                # fails every request at once until gRPC's reconnect back-off
                # lets it try again: give it that chance.
                _await_connection(channel, min(self._config.etcd_reconnect_wait, remaining / 2))
                remaining = deadline - time.monotonic()
            started = time.monotonic()
            try:
                return attempt(channel, min(self._config.etcd_timeout, remaining), number > 0)
            except grpc.RpcError as exc:
                if self._refused(exc):
                    failure = exc
                    attempts.append(f"{endpoint.netloc}: token no longer valid")
                    continue
                if not _unreachable(exc):
                    raise
                failure = exc
                endpoint.fail()
                attempts.append(
                    f"{endpoint.netloc}: {exc.code().name} ({exc.details()}) "
                    f"after {time.monotonic() - started:.2f} s"
                )
                _log.debug("etcd attempt failed at %s", attempts[-1])
        error = self._unavailable()
        error.add_note("attempts: " + "; ".join(attempts))
        raise error from failure

    def _kv_range(self, request: etcdrpc.RangeRequest) -> etcdrpc.RangeResponse:
        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> Any:
            return etcdrpc.KVStub(channel).Range(request, timeout=timeout, metadata=_REQUIRE_LEADER)

        return self._call(attempt)

    def _txn_call(self, request: etcdrpc.TxnRequest, channel: grpc.Channel, timeout: float) -> Any:
        return etcdrpc.KVStub(channel).Txn(request, timeout=timeout, metadata=_REQUIRE_LEADER)

    def _put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        request = etcdrpc.PutRequest(key=key, value=value, lease=lease)

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> None:
            etcdrpc.KVStub(channel).Put(request, timeout=timeout, metadata=_REQUIRE_LEADER)

        self._call(attempt)

    def _grant(self, ttl: int) -> int:
        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> int:
            response = etcdrpc.LeaseStub(channel).LeaseGrant(
                etcdrpc.LeaseGrantRequest(TTL=ttl), timeout=timeout, metadata=_REQUIRE_LEADER
            )
            if response.error:
                raise RuntimeError(f"etcd refused a lease of {ttl} s: {response.error}")
            return int(response.ID)

        return self._call(attempt)

    def _revoke(self, lease_id: int) -> None:
        """Revoke a lease, deleting its keys; a lease already gone is fine."""

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> None:
            try:
                etcdrpc.LeaseStub(channel).LeaseRevoke(
                    etcdrpc.LeaseRevokeRequest(ID=lease_id),
                    timeout=timeout,
                    metadata=_REQUIRE_LEADER,
                )
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise

        self._call(attempt)

    def close(self) -> None:
        """Cancel the watches and close the connections. Idempotent."""
        with self._watches_lock:
            watches = list(self._watches)
            self._watches.clear()
        for watch in watches:
            watch.cancel()
        for watch in watches:
            watch.cancel(wait=self._config.etcd_close_wait)
        if not self._closed:
            self._closed = True
            self._client.close()

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def ping(self) -> None:
        """Raise :class:`ControlPlaneUnavailable` unless etcd serves a
        linearizable read (which needs a quorum)."""
        self._kv_range(_range(self._view_key, count_only=True))

    # --- view ----------------------------------------------------------------
    def read_view(self) -> tuple[View, int]:
        """The committed view and its key's mod_revision; ``(EMPTY_VIEW, 0)``
        before the first commit."""
        response = self._kv_range(_range(self._view_key))
        if not response.kvs:
            return EMPTY_VIEW, 0
        kv = response.kvs[0]
        return self._checked_view(kv), int(kv.mod_revision)

    def read_stored_view(self) -> tuple[View | None, int, str]:
        """The view key as it is: ``(view, mod_revision, "")``, or ``(None,
        mod_revision, why)`` when it holds no valid view (``(EMPTY_VIEW, 0,
        "")`` when absent). For a leader that checks whether someone else
        wrote it."""
        response = self._kv_range(_range(self._view_key))
        if not response.kvs:
            return EMPTY_VIEW, 0, ""
        kv = response.kvs[0]
        try:
            return records.check_view(kv.value, self._config), int(kv.mod_revision), ""
        except MalformedRecord as exc:
            return None, int(kv.mod_revision), str(exc)

    def _checked_view(self, kv: Any) -> View:
        try:
            return records.check_view(kv.value, self._config)
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
        if prev_revision == 0:
            view_compare = _compare(self._view_key, "CREATE", 0)
        else:
            view_compare = _compare(self._view_key, "MOD", prev_revision)
        request = etcdrpc.TxnRequest(
            compare=[view_compare, _compare(self._leader_key, "VALUE", _leader_value(leader))],
            success=[_put_op(self._view_key, value)],
            failure=[_range_op(_range(self._view_key))],
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> int | None:
            response = self._txn_call(request, channel, timeout)
            if response.succeeded:
                return int(response.header.revision)
            current = _first_kv(response, 0)
            if retried and current is not None and current.value == value:
                # An earlier attempt committed it and its answer was lost.
                return int(current.mod_revision)
            return None

        return self._call(attempt)

    def job_exists(self) -> bool:
        """Whether the job has a view, a leader or any member record."""
        request = etcdrpc.TxnRequest(
            success=[
                _range_op(_range(self._view_key, count_only=True)),
                _range_op(_range(self._leader_key, count_only=True)),
                _range_op(_range(self._members_prefix, prefix=True, count_only=True)),
            ]
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> bool:
            response = self._txn_call(request, channel, timeout)
            return any(r.response_range.count > 0 for r in response.responses)

        return self._call(attempt)

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
        lease_id = self._grant(self._config.member_lease_ttl)
        request = etcdrpc.TxnRequest(
            compare=[_compare(key, "CREATE", 0)],
            success=[
                _put_op(key, value, lease_id),
                _range_op(_range(key)),
                _put_op(self._secret_key(member.id), _dumps({"secret_sha256": secret_hash})),
            ],
            failure=[_range_op(_range(key))],
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> Any:
            response = self._txn_call(request, channel, timeout)
            if response.succeeded:
                return _first_kv(response, 1)
            current = _first_kv(response, 0)
            if retried and current is not None and current.lease == lease_id:
                return current  # an earlier attempt wrote it
            return None

        kv = self._call(attempt)
        if kv is None:
            self._revoke(lease_id)
            raise InvalidRequest(f"member {member.id!r} already has a record in job {self.job!r}")
        return MemberRecord(member, lease_id, int(kv.create_revision), secret_hash)

    def list_members(self) -> list[MemberRecord]:
        """Every member record, oldest first (by create_revision)."""
        response = self._kv_range(
            _range(
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
        self._revoke(lease_id)
        request = etcdrpc.DeleteRangeRequest(key=self._secret_key(member_id))

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> None:
            etcdrpc.KVStub(channel).DeleteRange(request, timeout=timeout, metadata=_REQUIRE_LEADER)

        self._call(attempt)

    def _secret_key(self, member_id: str) -> bytes:
        return self._secrets_prefix + member_id.encode()

    def list_secret_hashes(self) -> dict[str, str]:
        """Member id -> the hash of its secret, for every member not removed
        (their records may be gone with an expired lease). Malformed values
        are left out (logged): such a member opens no session."""
        response = self._kv_range(_range(self._secrets_prefix, prefix=True))
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
        """Refresh many leases over one keep-alive stream.

        Returns lease id -> TTL granted again; 0 (or less) means the lease is
        gone (expired or revoked) and its keys with it.
        """
        ids = list(dict.fromkeys(int(i) for i in lease_ids))
        if not ids:
            return {}

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> dict[int, int]:
            requests = iter([etcdrpc.LeaseKeepAliveRequest(ID=i) for i in ids])
            responses = etcdrpc.LeaseStub(channel).LeaseKeepAlive(
                requests, timeout=timeout, metadata=_REQUIRE_LEADER
            )
            ttls: dict[int, int] = {}
            try:
                # etcd answers each request in order on the stream.
                for response in responses:
                    ttls[int(response.ID)] = int(response.TTL)
                    if len(ttls) == len(ids):
                        break
            finally:
                responses.cancel()
            return ttls

        ttls = self._call(attempt)
        if len(ttls) != len(ids):
            # The stream ended early without an error: treat as unreachable
            # rather than guess the missing leases' fate.
            raise self._unavailable()
        return ttls

    def lease_ttl(self, lease_id: int) -> int:
        """Seconds left on a lease (etcd rounds down); -1 when it is gone."""

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> int:
            response = etcdrpc.LeaseStub(channel).LeaseTimeToLive(
                etcdrpc.LeaseTimeToLiveRequest(ID=lease_id),
                timeout=timeout,
                metadata=_REQUIRE_LEADER,
            )
            return int(response.TTL)

        return self._call(attempt)

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
        lease_id = self._grant(self._config.election_ttl)
        leader = LeaderInfo(replica_id, address, lease_id)
        value = _leader_value(leader)
        request = etcdrpc.TxnRequest(
            compare=[_compare(self._leader_key, "CREATE", 0), *compare],
            success=[_put_op(self._leader_key, value, lease_id)],
            failure=[_range_op(_range(self._leader_key))],
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> bool:
            response = self._txn_call(request, channel, timeout)
            if response.succeeded:
                return True
            current = _first_kv(response, 0)
            return retried and current is not None and current.value == value

        if self._call(attempt):
            return leader
        try:
            self._revoke(lease_id)
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
        kv = self._kv_range(_range(self._leader_key)).kvs
        if not kv:
            return
        try:
            _parse_leader(kv[0])
            return
        except MalformedRecord as exc:
            why = exc
        request = etcdrpc.TxnRequest(
            compare=[_compare(self._leader_key, "MOD", int(kv[0].mod_revision))],
            success=[
                etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(
                    key=self._leader_key
                ))
            ],
        )  # fmt: skip

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> bool:
            return bool(self._txn_call(request, channel, timeout).succeeded)

        if self._call(attempt):
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
        self._revoke(leader.lease_id)

    def read_leader(self) -> LeaderInfo | None:
        response = self._kv_range(_range(self._leader_key))
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
        :class:`_KeyWatch`."""

        def handle(kv: Any) -> None:
            try:
                callback(None if kv is None else _parse_leader(kv))
            except MalformedRecord as exc:
                self._ignore(kv, exc)
                callback(None)

        return self._watch(self._leader_key, handle, after_revision, "leader")

    def watch_view(
        self,
        callback: Callable[[View], None],
        *,
        after_revision: int | None = None,
    ) -> Callable[[], None]:
        """Call ``callback`` with every view committed after ``after_revision``
        (default: now; pass the revision from ``read_view`` to miss nothing).
        Returns a function that cancels the watch without blocking. See
        :class:`_KeyWatch`."""

        def handle(kv: Any) -> None:
            if kv is None:
                return
            try:
                view = records.check_view(kv.value, self._config)
            except MalformedRecord as exc:
                self._ignore(kv, exc)
                return
            callback(view)

        return self._watch(self._view_key, handle, after_revision, "view")

    def _watch(
        self,
        key: bytes,
        handle: Callable[[Any], None],
        after_revision: int | None,
        what: str,
    ) -> Callable[[], None]:
        if after_revision is None:
            after_revision = int(self._kv_range(_range(key, count_only=True)).header.revision)
        watch = _KeyWatch(self, key, after_revision + 1, handle, f"rollcall-watch-{what}")
        with self._watches_lock:
            if self._closed:
                raise RuntimeError("EtcdStore is closed")
            self._watches.add(watch)
        watch.start()

        def cancel() -> None:
            with self._watches_lock:
                self._watches.discard(watch)
            watch.cancel()

        return cancel

    # --- progress --------------------------------------------------------------
    def write_progress(self, epoch: int, step: int) -> None:
        """Record the last committed step reported for view ``epoch``."""
        self._put(self._progress_key, _dumps({"epoch": epoch, "step": step}))

    def read_progress(self) -> tuple[int, int] | None:
        """``(epoch, step)`` last written, or ``None``."""
        response = self._kv_range(_range(self._progress_key))
        if not response.kvs:
            return None
        try:
            return records.check_progress(response.kvs[0].value)
        except MalformedRecord as exc:
            self._ignore(response.kvs[0], exc)
            return None

    # --- checkpoints -----------------------------------------------------------
    def read_checkpoints(self) -> list[CheckpointManifest]:
        """The published checkpoint manifests, newest first. Entries that are
        malformed are left out, and logged once per version of the record."""
        return self._read_checkpoints()[0]

    def _read_checkpoints(self) -> tuple[list[CheckpointManifest], int]:
        response = self._kv_range(_range(self._checkpoints_key))
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
        compare = _compare(key, "MOD", revision) if revision else _compare(key, "CREATE", 0)
        if manifests:
            op = _put_op(key, _dumps([m.to_dict() for m in manifests]))
        else:
            op = etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=key))
        request = etcdrpc.TxnRequest(compare=[compare], success=[op])

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> bool:
            return bool(self._txn_call(request, channel, timeout).succeeded)

        return self._call(attempt)

    def read_checkpoint_failure(self) -> CheckpointFailure | None:
        """The job's durability failure record, if any; a malformed one is
        logged once and read as none."""
        response = self._kv_range(_range(self._checkpoint_failure_key))
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
            self._put(self._checkpoint_failure_key, _dumps(failure.to_dict()))
            return
        request = etcdrpc.DeleteRangeRequest(key=self._checkpoint_failure_key)

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> None:
            etcdrpc.KVStub(channel).DeleteRange(request, timeout=timeout, metadata=_REQUIRE_LEADER)

        self._call(attempt)

    # --- fingerprint -----------------------------------------------------------
    def read_fingerprint(self) -> StoredFingerprint:
        """The job's fingerprint, validated, with its revision and whether the
        job has progress or checkpoints. A malformed value is reported in
        ``malformed`` (and ``fingerprint`` is None), never raised."""
        request = etcdrpc.TxnRequest(
            success=[
                _range_op(_range(self._fingerprint_key)),
                _range_op(_range(self._progress_key, count_only=True)),
                _range_op(_range(self._checkpoints_key, count_only=True)),
            ]
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> Any:
            return self._txn_call(request, channel, timeout)

        response = self._call(attempt)
        kv = _first_kv(response, 0)
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
            compare = _compare(self._fingerprint_key, "CREATE", 0)
        else:
            compare = _compare(self._fingerprint_key, "MOD", revision)
        request = etcdrpc.TxnRequest(
            compare=[compare],
            success=[_put_op(self._fingerprint_key, value)],
            failure=[_range_op(_range(self._fingerprint_key))],
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> bool:
            response = self._txn_call(request, channel, timeout)
            if response.succeeded:
                return True
            current = _first_kv(response, 0)
            # An earlier attempt of ours landed and its answer was lost.
            return retried and current is not None and current.value == value

        return self._call(attempt)

    # --- epoch key -------------------------------------------------------------
    def epoch_key(self) -> str:
        """The job's epoch key (``rollcall.membership.credentials``: 64 hex digits),
        created at random if the job has none yet (create-if-absent), so that
        every replica that leads derives the same epoch secrets. A malformed
        value is logged and replaced (compare-and-swap on its revision):
        epoch secrets derived from it change, and members that held the old
        ones are refused by their peers until the next view."""
        for _ in range(_CAS_ATTEMPTS):
            kv = _first_kv_of(self._kv_range(_range(self._epoch_key_key)))
            if kv is not None:
                stored = _parse_epoch_key(kv.value)
                if stored is not None:
                    return stored
                _log.warning("job %s: the epoch key in etcd is malformed: replaced", self.job)
            fresh = secrets.token_hex(SECRET_BYTES)
            compare = (
                _compare(self._epoch_key_key, "MOD", int(kv.mod_revision))
                if kv is not None
                else _compare(self._epoch_key_key, "CREATE", 0)
            )
            request = etcdrpc.TxnRequest(
                compare=[compare], success=[_put_op(self._epoch_key_key, _dumps({"key": fresh}))]
            )

            def attempt(
                channel: grpc.Channel, timeout: float, retried: bool, txn: Any = request
            ) -> bool:
                return bool(self._txn_call(txn, channel, timeout).succeeded)

            if self._call(attempt):
                return fresh
            # Another replica wrote one meanwhile (or our earlier attempt
            # landed and its answer was lost): read it.
        raise ControlPlaneUnavailable("epoch key: too much contention on etcd")

    def snapshot(self) -> dict[str, bytes]:
        """Every key under the job's prefix with its value."""
        response = self._kv_range(_range(self.prefix, prefix=True))
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
            view_compare = _compare(self._view_key, "MOD", view_revision)
        else:
            view_compare = _compare(self._view_key, "CREATE", 0)
        return self._take_leader_key(replica_id, address, [view_compare])

    def register_again(self, member: Member, secret_hash: str) -> MemberRecord:
        """Record ``member`` (and the hash of its secret) again under a new
        lease: its old lease expired (etcd could not keep it alive) or its
        record is gone, while the member itself is alive. Replaces any
        record the id still has."""
        _check_name("member id", member.id)
        key = self._member_key(member.id)
        value = _dumps({"address": member.address, "id": member.id, "secret_sha256": secret_hash})
        lease_id = self._grant(self._config.member_lease_ttl)
        request = etcdrpc.TxnRequest(
            success=[
                _put_op(key, value, lease_id),
                _range_op(_range(key)),
                _put_op(self._secret_key(member.id), _dumps({"secret_sha256": secret_hash})),
            ]
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> Any:
            return _first_kv(self._txn_call(request, channel, timeout), 1)

        kv = self._call(attempt)
        revision = int(kv.create_revision) if kv is not None else 0
        return MemberRecord(member, lease_id, revision, secret_hash)

    def write_progress_as(self, leader: LeaderInfo, epoch: int, step: int) -> bool:
        """Record the last committed step reported for view ``epoch``, if
        the leader key still holds ``leader`` (a deposed leader's late write
        must not replace its successor's). False if it does not."""
        request = etcdrpc.TxnRequest(
            compare=[_compare(self._leader_key, "VALUE", _leader_value(leader))],
            success=[_put_op(self._progress_key, _dumps({"epoch": epoch, "step": step}))],
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> bool:
            return bool(self._txn_call(request, channel, timeout).succeeded)

        return self._call(attempt)

    def read_job(self) -> tuple[JobRecord, EtcdPosition]:
        """The job's record (view, progress, fingerprint, checkpoints) and
        etcd's position, read at one revision. Malformed values are logged
        and left out (a malformed view counts as none)."""
        request = etcdrpc.TxnRequest(
            success=[
                _range_op(_range(self._view_key)),
                _range_op(_range(self._progress_key)),
                _range_op(_range(self._fingerprint_key)),
                _range_op(_range(self._checkpoints_key)),
            ]
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> Any:
            return self._txn_call(request, channel, timeout)

        response = self._call(attempt)
        kvs = [_first_kv(response, i) for i in range(4)]
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
            view_compare = _compare(self._view_key, "MOD", found_revision)
        else:
            view_compare = _compare(self._view_key, "CREATE", 0)
        value = record.view.to_json().encode()
        puts = [_put_op(self._view_key, value)]
        if record.progress is not None:
            epoch, step = record.progress
            puts.append(_put_op(self._progress_key, _dumps({"epoch": epoch, "step": step})))
        if record.fingerprint is not None:
            puts.append(_put_op(self._fingerprint_key, _dumps(record.fingerprint)))
        if record.checkpoints:
            manifests = [m.to_dict() for m in record.checkpoints]
            puts.append(_put_op(self._checkpoints_key, _dumps(manifests)))
        request = etcdrpc.TxnRequest(
            compare=[_compare(self._leader_key, "VALUE", _leader_value(leader)), view_compare],
            success=puts,
            failure=[_range_op(_range(self._view_key))],
        )

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> int | None:
            response = self._txn_call(request, channel, timeout)
            if response.succeeded:
                return int(response.header.revision)
            current = _first_kv(response, 0)
            if retried and current is not None and current.value == value:
                return int(current.mod_revision)  # an earlier attempt of ours landed
            return None

        return self._call(attempt)


class _KeyWatch:
    """Follows one key from a start revision in a thread of its own.

    Each change is handed to ``handle`` (the new key-value, or ``None`` for a
    deletion) in that thread; an exception from it is logged, never raised.

    When the stream breaks (etcd restarted, member killed, member lost its
    leader) the watch is re-established, on whichever endpoint the store
    selects, from the revision after the last change seen, with a back-off of
    ``config.etcd_watch_backoff_initial`` doubling to ``etcd_watch_backoff_max``:
    no change is missed, as long as etcd still holds that history. If it was
    compacted away, the key's current value is handed over once (if it
    changed since) and the watch resumes from there.

    A member that froze or was cut off without closing the connection sends
    nothing, so the stream cannot break by itself: the watch moves away as
    soon as one of the store's requests to that endpoint fails (within
    ``config.etcd_timeout``, checked every ``etcd_watch_health_interval``), and otherwise gRPC
    keep-alive closes the stream after about 15 s. Nothing is reported while
    etcd is unreachable; the store's other calls raise
    :class:`ControlPlaneUnavailable` meanwhile.
    """

    def __init__(
        self,
        store: EtcdStore,
        key: bytes,
        start_revision: int,
        handle: Callable[[Any], None],
        name: str,
    ) -> None:
        self._store = store
        self._key = key
        self._next_revision = start_revision
        self._handle = handle
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._broken = False
        #: Why etcd last refused this watch our credentials ("" if it did not).
        self._refusal = ""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def cancel(self, wait: float = 0.0) -> None:
        """Stop delivering (a callback already under way may still finish)
        and end the stream; wait up to ``wait`` seconds for the thread."""
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if wait > 0 and threading.current_thread() is not self._thread:
            self._thread.join(timeout=wait)

    def _run(self) -> None:
        config = self._store._config
        backoff = Backoff(config.etcd_watch_backoff_initial, config.etcd_watch_backoff_max)
        while not self._stop.is_set():
            try:
                if self._follow():
                    backoff.reset()
            except EtcdCredentialsRefused as exc:
                self._refused(str(exc))
            except Exception:  # noqa: BLE001 - the thread must survive anything
                if not self._stop.is_set():
                    _log.exception("watch on %s failed", self._key.decode())
            self._stop.wait(backoff.next())

    def _follow(self) -> bool:
        """One watch stream, until it breaks. True if it was established."""
        endpoint, channel, failed_before = self._store._select()
        if failed_before:
            _await_connection(channel, self._store._config.etcd_reconnect_wait)
        started = time.time()  # pyetcd stamps endpoint failures with time.time()
        ended = threading.Event()

        def requests() -> Iterator[etcdrpc.WatchRequest]:
            create = etcdrpc.WatchCreateRequest(key=self._key, start_revision=self._next_revision)
            yield etcdrpc.WatchRequest(create_request=create)
            # Keep the request side open while we follow. If the store's
            # requests to this endpoint fail meanwhile (a frozen or cut-off
            # member), leave it rather than wait for gRPC keep-alive.
            while not ended.wait(self._store._config.etcd_watch_health_interval):
                if endpoint.last_failed > started:
                    self._abandon()
                    return

        call = etcdrpc.WatchStub(channel).Watch(requests(), metadata=_REQUIRE_LEADER)
        with self._lock:
            self._call = call
        if self._stop.is_set():
            call.cancel()
        established = False
        try:
            for response in call:
                if response.created and not established and not response.canceled:
                    established = True
                    self._refusal = ""
                    if self._broken:
                        self._broken = False
                        _log.info(
                            "watch on %s re-established at %s from revision %d",
                            self._key.decode(),
                            endpoint,
                            self._next_revision,
                        )
                    if int(response.header.revision) + 1 < self._next_revision:
                        # etcd's history went back (its data was lost or
                        # restored from a backup): the revision we wait for
                        # may never come. Start again from what it holds.
                        _log.warning(
                            "etcd's revision went back to %d under the watch on %s (it "
                            "expected %d): following it from there",
                            response.header.revision, self._key.decode(), self._next_revision,
                        )  # fmt: skip
                        self._next_revision = 0
                        self._resync()
                        return established
                if response.compact_revision:
                    self._resync()
                    return established
                if response.canceled:
                    return self._canceled(response.cancel_reason) and established
                for event in response.events:
                    self._next_revision = int(event.kv.mod_revision) + 1
                    deleted = event.type == event.DELETE
                    self._deliver(None if deleted else event.kv)
        except grpc.RpcError as exc:
            if not self._stop.is_set():
                if not self._broken:
                    self._broken = True
                    _log.info(
                        "watch on %s broke (%s: %s); re-establishing",
                        self._key.decode(),
                        exc.code().name,
                        exc.details(),
                    )
                if _unreachable(exc):
                    endpoint.fail()
        finally:
            ended.set()
            call.cancel()
            with self._lock:
                self._call = None
        return established

    def _canceled(self, reason: str) -> bool:
        """etcd ended the watch (``reason``): False when it refused our
        credentials, which is said once, so that retries back off."""
        if "invalid auth token" in reason or "revision of auth store is old" in reason:
            if self._store._tokens is not None:
                self._store._tokens.invalidate()
            return True
        if "user name is empty" in reason or "permission denied" in reason:
            self._refused(f"etcd refused our credentials ({reason})")
            return False
        return True

    def _refused(self, why: str) -> None:
        if why != self._refusal:
            self._refusal = why
            _log.warning("watch on %s: %s; retrying", self._key.decode(), why)

    def _abandon(self) -> None:
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()

    def _resync(self) -> None:
        """The history we need was compacted: hand over the current value if
        it changed since, and continue from now."""
        response = self._store._kv_range(_range(self._key))
        kv = response.kvs[0] if response.kvs else None
        if kv is None or kv.mod_revision >= self._next_revision:
            self._deliver(kv)
        self._next_revision = int(response.header.revision) + 1

    def _deliver(self, kv: Any) -> None:
        if self._stop.is_set():
            return
        try:
            self._handle(kv)
        except Exception:  # noqa: BLE001 - never raise into the watch thread
            _log.exception("watch callback for %s raised", self._key.decode())
