"""A resilient etcd client: endpoints, failover, retries, credentials, watches.

It knows nothing of jobs: ``rollcall.rendezvous.store`` keeps a job's keys,
records and transactions and sends them through it.

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

Watches. :meth:`EtcdClient.watch` follows one key in a thread of its own,
across broken streams, endpoint failover and compaction (:class:`_KeyWatch`).
"""

from __future__ import annotations

import logging
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
from rollcall.membership.config import Config
from rollcall.membership.errors import ControlPlaneUnavailable, EtcdCredentialsRefused
from rollcall.rendezvous import etcd_auth

_log = logging.getLogger(__name__)

T = TypeVar("T")

#: ``attempt(channel, timeout, retried)``: one try of an operation on one
#: endpoint (``EtcdClient.call``).
Attempt = Callable[[grpc.Channel, float, bool], T]

#: Status codes that mean "this endpoint could not serve the request now".
_UNREACHABLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}
)
#: etcd passes its own context errors on unmapped, as UNKNOWN: when the
#: deadline we sent expires inside etcd first, this is what we receive.
_CONTEXT_ERRORS = ("context deadline exceeded", "context canceled")


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


@dataclass(frozen=True)
class EtcdClientTLS:
    """TLS towards etcd: the CA that signed etcd's certificate and, when etcd
    requires client certificates, this client's certificate and key."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None


def _await_connection(channel: grpc.Channel, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for ``channel`` to be connected."""
    ready = grpc.channel_ready_future(channel)
    try:
        ready.result(timeout=max(0.0, timeout))
    except grpc.FutureTimeoutError:
        ready.cancel()


def prefix_end(prefix: bytes) -> bytes:
    """The range end covering every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def range_request(key: bytes, *, prefix: bool = False, **fields: Any) -> etcdrpc.RangeRequest:
    request = etcdrpc.RangeRequest(key=key, **fields)
    if prefix:
        request.range_end = prefix_end(key)
    return request


def key_compare(key: bytes, target: str, value: int | bytes) -> etcdrpc.Compare:
    """``key``'s ``target`` (CREATE, MOD or VALUE) must equal ``value``."""
    compare = etcdrpc.Compare(
        key=key, target=getattr(etcdrpc.Compare, target), result=etcdrpc.Compare.EQUAL
    )
    field = {"CREATE": "create_revision", "MOD": "mod_revision", "VALUE": "value"}[target]
    setattr(compare, field, value)
    return compare


def put_op(key: bytes, value: bytes, lease: int = 0) -> etcdrpc.RequestOp:
    return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key, value=value, lease=lease))


def range_op(request: etcdrpc.RangeRequest) -> etcdrpc.RequestOp:
    return etcdrpc.RequestOp(request_range=request)


def first_kv(response: etcdrpc.TxnResponse, index: int) -> Any:
    """The first key-value read by the ``index``-th operation of a transaction."""
    kvs = response.responses[index].response_range.kvs
    return kvs[0] if kvs else None


class EtcdClient:
    """Requests to an etcd cluster with failover, retries and credentials.
    See the module docstring for how connection errors become
    :class:`ControlPlaneUnavailable`."""

    def __init__(
        self,
        endpoints: Sequence[str],
        config: Config,
        tls: EtcdClientTLS | None = None,
        credentials: etcd_auth.EtcdCredentials | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("an etcd client needs at least one etcd endpoint")
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

    def unavailable(self) -> ControlPlaneUnavailable:
        """The error of an operation that etcd could not serve."""
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

    def call(self, attempt: Attempt[T]) -> T:
        """Run ``attempt(channel, timeout, retried)`` with failover and retries.

        ``retried`` tells the attempt that an earlier one may have reached
        etcd, so a conditional write that now fails may have been our own.
        """
        if self._closed:
            raise RuntimeError("the etcd client is closed")
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
        error = self.unavailable()
        error.add_note("attempts: " + "; ".join(attempts))
        raise error from failure

    def kv_range(self, request: etcdrpc.RangeRequest) -> etcdrpc.RangeResponse:
        """A linearizable read."""

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> Any:
            return etcdrpc.KVStub(channel).Range(request, timeout=timeout, metadata=_REQUIRE_LEADER)

        return self.call(attempt)

    def txn(self, request: etcdrpc.TxnRequest, channel: grpc.Channel, timeout: float) -> Any:
        """One attempt of a transaction, for an ``Attempt`` to make."""
        return etcdrpc.KVStub(channel).Txn(request, timeout=timeout, metadata=_REQUIRE_LEADER)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        request = etcdrpc.PutRequest(key=key, value=value, lease=lease)

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> None:
            etcdrpc.KVStub(channel).Put(request, timeout=timeout, metadata=_REQUIRE_LEADER)

        self.call(attempt)

    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its id."""

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> int:
            response = etcdrpc.LeaseStub(channel).LeaseGrant(
                etcdrpc.LeaseGrantRequest(TTL=ttl), timeout=timeout, metadata=_REQUIRE_LEADER
            )
            if response.error:
                raise RuntimeError(f"etcd refused a lease of {ttl} s: {response.error}")
            return int(response.ID)

        return self.call(attempt)

    def revoke(self, lease_id: int) -> None:
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

        self.call(attempt)

    def delete(self, key: bytes) -> None:
        """Delete ``key``; a key already gone is fine."""
        request = etcdrpc.DeleteRangeRequest(key=key)

        def attempt(channel: grpc.Channel, timeout: float, retried: bool) -> None:
            etcdrpc.KVStub(channel).DeleteRange(request, timeout=timeout, metadata=_REQUIRE_LEADER)

        self.call(attempt)

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

        ttls = self.call(attempt)
        if len(ttls) != len(ids):
            # The stream ended early without an error: treat as unreachable
            # rather than guess the missing leases' fate.
            raise self.unavailable()
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

        return self.call(attempt)

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

    def watch(
        self,
        key: bytes,
        handle: Callable[[Any], None],
        after_revision: int | None,
        what: str,
    ) -> Callable[[], None]:
        """Hand every change of ``key`` after ``after_revision`` (default:
        now) to ``handle`` (:class:`_KeyWatch`); ``what`` names its thread.
        Returns a function that cancels the watch without blocking."""
        if after_revision is None:
            after_revision = int(self.kv_range(range_request(key, count_only=True)).header.revision)
        watch = _KeyWatch(self, key, after_revision + 1, handle, f"rollcall-watch-{what}")
        with self._watches_lock:
            if self._closed:
                raise RuntimeError("the etcd client is closed")
            self._watches.add(watch)
        watch.start()

        def cancel() -> None:
            with self._watches_lock:
                self._watches.discard(watch)
            watch.cancel()

        return cancel


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
        client: EtcdClient,
        key: bytes,
        start_revision: int,
        handle: Callable[[Any], None],
        name: str,
    ) -> None:
        self._client = client
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
        config = self._client._config
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
        endpoint, channel, failed_before = self._client._select()
        if failed_before:
            _await_connection(channel, self._client._config.etcd_reconnect_wait)
        started = time.time()  # pyetcd stamps endpoint failures with time.time()
        ended = threading.Event()

        def requests() -> Iterator[etcdrpc.WatchRequest]:
            create = etcdrpc.WatchCreateRequest(key=self._key, start_revision=self._next_revision)
            yield etcdrpc.WatchRequest(create_request=create)
            # Keep the request side open while we follow. If the store's
            # requests to this endpoint fail meanwhile (a frozen or cut-off
            # member), leave it rather than wait for gRPC keep-alive.
            while not ended.wait(self._client._config.etcd_watch_health_interval):
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
            if self._client._tokens is not None:
                self._client._tokens.invalidate()
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
        response = self._client.kv_range(range_request(self._key))
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
