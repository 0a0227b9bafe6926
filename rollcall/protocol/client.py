"""Client of the rendezvous service, for members and for read-only callers.

It is given every replica's address and fails over between them: calls that
only the leader serves follow the leader named by a refusing standby, and a
member's session reconnects to whichever replica leads now, keeping its member
id, so a leader failover evicts nobody.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from rollcall.membership.backoff import Backoff
from rollcall.membership.cause import Cause
from rollcall.membership.checkpoint import CheckpointManifest, Durability
from rollcall.membership.config import Config
from rollcall.membership.delta import ViewDelta, apply_delta
from rollcall.membership.errors import (
    ControlPlaneUnavailable,
    Evicted,
    InvalidRequest,
    NoSuchJob,
    NotAMember,
    NotLeader,
    PermissionDenied,
    RollcallError,
    StaleEpoch,
    Unauthenticated,
    UnsafeFencePatience,
    UnsafeFenceWindow,
    UnsafeStepEndWait,
    UnsafeTiming,
)
from rollcall.membership.fingerprint import JobFingerprint
from rollcall.membership.view import EMPTY_VIEW, View
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.pb import rendezvous_pb2_grpc as pb_grpc
from rollcall.protocol.wire import (
    ERROR_METADATA,
    LEADER_METADATA,
    NAMED_BY_METADATA,
    STATUS_BY_NUMBER,
    causes_from_pb,
    delta_from_pb,
    durability_from_pb,
    manifest_from_pb,
    manifest_to_pb,
    token_metadata,
    view_from_pb,
)

if TYPE_CHECKING:
    from rollcall.protocol.carrier import SessionCarrier

log = logging.getLogger("rollcall.client")

#: A service's settings travel as doubles: a worker's value that exceeds the
#: service's by less than this is the same setting.
TIMING_SLACK = 1e-6

T = TypeVar("T")


@dataclass(frozen=True)
class RollCallAnswer:
    """What a member answers at a roll call: its last committed step (None:
    none), the digest of its state, in a sharded job the epoch of the view
    whose shard plan it moved to (None: not sharded, nothing held), and
    whether it answers before the loop's code after that step's ``commit()``
    ran (``unsettled``: nobody may take the state it serves)."""

    step: int | None
    digest: str
    shard_epoch: int | None = None
    unsettled: bool = False


#: Called with the roll call's epoch and its causes (``Cause`` values, for
#: messages); may be a coroutine function. Must abort the step in flight
#: before it returns.
RollCallHandler = Callable[[int, tuple[Cause, ...]], RollCallAnswer | Awaitable[RollCallAnswer]]
#: Called when a peer declares itself busy: (member id, seconds from now, reason).
BusyHandler = Callable[[str, float, str], None]

#: The longest heartbeat interval, as a share of ``fence_window``: the
#: rest of the window is the acknowledgement's way back.
_FENCE_SHARE = 0.6

#: Epoch secrets kept for views before the newest one received (a state
#: server answers for the view it is in, which may lag by a view or two).
_EPOCH_SECRETS_KEPT = 2

#: gRPC status codes after which a call or session tries the next replica.
RETRY_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
}


class Answering:
    """Roll-call answers under way on one session stream. They run beside
    the stream's reading, not in it: an answer may wait for the step in
    flight to land, and a step lands only once a heartbeat was
    acknowledged (the fence), an acknowledgement that comes on this same
    stream. (Read after the answer, it never came in time: the member
    waited at its fence for ``fence_patience``, dropped its step and
    answered after the deadline.) An answer that fails fails the stream at
    its next event, as when it was read inline."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._failed: BaseException | None = None

    def start(self, answer: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(answer)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        failed = task.exception()
        # Said here too: a stream that ends before its next event never
        # raises it.
        log.error("answering a roll call failed: %r", failed, exc_info=failed)
        if self._failed is None:
            self._failed = failed

    def check(self) -> None:
        """Raise what an answer raised, if one failed."""
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    async def stop(self) -> None:
        """(The stream ended.) Cancel the answers still under way."""
        tasks, self._tasks = self._tasks, set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._failed = None


def _ms(seconds: float) -> int:
    """``seconds`` in whole milliseconds, as gRPC's channel options take them."""
    return round(seconds * 1000)


@dataclass(frozen=True)
class ClientTLS:
    """TLS towards the service: the CA that signed its certificate and,
    when the service requires client certificates, ours."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return None if path is None else open(path, "rb").read()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file),
            private_key=read(self.key_file),
            certificate_chain=read(self.cert_file),
        )


def open_channel(
    address: str, tls: ClientTLS | None, options: list[tuple[str, Any]]
) -> grpc.aio.Channel:
    """A gRPC channel to ``address``, with TLS when ``tls`` is given."""
    if tls is not None:
        return grpc.aio.secure_channel(address, tls.credentials(), options)
    return grpc.aio.insecure_channel(address, options)


@dataclass(frozen=True)
class Status:
    view: View
    leader: str
    step: int | None
    replica: str
    rollcall_epoch: int
    #: Durable checkpoints, newest first.
    checkpoints: tuple[CheckpointManifest, ...] = ()
    #: Last committed step recorded for the job in any view.
    last_step: int | None = None
    #: How far the job is durable, and whether checkpoints fail.
    durability: Durability = Durability(None)
    #: etcd lost the job's data: the highest epoch a member was refused at
    #: for it (0: never).
    lost_epoch: int = 0


#: The last views rebuilt from a change in this process: (base, change,
#: result). ``apply_delta`` is pure, so members of one process (lightweight
#: members, tests) that hold the same view object and receive the same
#: change share its rebuild instead of each repeating it.
_REBUILT: list[tuple[View, ViewDelta, View | None]] = []
_REBUILT_KEPT = 4


def _rebuild(base: View, delta: ViewDelta) -> View | None:
    for known_base, known_delta, result in _REBUILT:
        if known_base is base and known_delta == delta:
            return result
    result = apply_delta(base, delta)
    _REBUILT.insert(0, (base, delta, result))
    del _REBUILT[_REBUILT_KEPT:]
    return result


def paced(config: Config, interval_ms: int, current: float) -> float:
    """The heartbeat interval to keep when the leader says ``interval_ms``
    (0: it does not say, ``current`` stays), but at most every 0.6 x
    ``fence_window`` (never below the configured interval): a step applies
    only with the acknowledgement of a heartbeat sent within the fence
    window."""
    if not interval_ms:
        return current
    cap = max(config.heartbeat_interval, _FENCE_SHARE * config.fence_window)
    return min(interval_ms / 1000, cap)


def error_from_rpc(error: grpc.aio.AioRpcError) -> RollcallError:
    """The named error a gRPC status stands for (see the .proto)."""
    metadata = dict(error.trailing_metadata() or ())
    return error_from_status(error.code(), error.details() or "", metadata)


def error_from_end(end: pb.SessionEnd) -> RollcallError:
    """The named error a member's ``SessionEnd`` on a shared session stands
    for: the one its own stream would have ended with."""
    code = STATUS_BY_NUMBER.get(end.code, grpc.StatusCode.UNKNOWN)
    return error_from_status(code, end.message, {ERROR_METADATA: end.error} if end.error else {})


def error_from_status(
    code: grpc.StatusCode, message: str, metadata: Mapping[str, Any]
) -> RollcallError:
    """The named error of a status code, its details and trailing metadata."""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(message)
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return PermissionDenied(message)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return InvalidRequest(f"request too large: {message}")
    named = NAMED_BY_METADATA.get(str(metadata.get(ERROR_METADATA)))
    if named is not None:
        return named(message)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return StaleEpoch(message)
    if code == grpc.StatusCode.NOT_FOUND:
        return NoSuchJob(message) if message.startswith("no such job") else NotAMember(message)
    if code == grpc.StatusCode.UNAVAILABLE and "not the leader" in message:
        leader = metadata.get(LEADER_METADATA)
        return NotLeader(message, leader=str(leader) if leader else None)
    return ControlPlaneUnavailable(f"rendezvous unavailable: {message or code.name}")


class ReplicaSet:
    """The replicas of one rendezvous service, a channel to each (opened
    on first use) and the one presumed to lead."""

    def __init__(
        self,
        addresses: Sequence[str],
        job: str,
        token: str,
        config: Config | None = None,
        tls: ClientTLS | None = None,
        agent: str | None = None,
    ) -> None:
        """``agent``: a host agent's address (``rollcall agent``), which
        carries this host's sessions: a member's session is opened there
        first and on the replicas when it does not answer."""
        if not addresses:
            raise ValueError("no rendezvous address given")
        self._agent = agent
        self._addresses = list(addresses)
        self._job = job
        self._metadata = token_metadata(token)
        self._config = config or Config()
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._leader_hint: str | None = None

    def _stub(self, address: str) -> pb_grpc.RendezvousStub:
        channel = self._channels.get(address)
        if channel is None:
            config = self._config
            options = [
                ("grpc.max_receive_message_length", 16 * 1024 * 1024),
                ("grpc.keepalive_time_ms", _ms(config.client_keepalive_interval)),
                ("grpc.initial_reconnect_backoff_ms", _ms(config.client_retry_initial)),
                ("grpc.max_reconnect_backoff_ms", _ms(config.client_retry_max)),
            ]
            # The agent is on this host, reached without TLS
            # (``rollcall.agent.server.check_listen``).
            tls = None if address == self._agent else self._tls
            channel = open_channel(address, tls, options)
            self._channels[address] = channel
        return pb_grpc.RendezvousStub(channel)

    def _order(self) -> list[str]:
        """Replica addresses to try, the presumed leader first."""
        hint = self._leader_hint
        if hint in self._addresses:
            return [hint, *(a for a in self._addresses if a != hint)]
        return list(self._addresses)

    def _retry_backoff(self) -> Backoff:
        """The wait between two rounds over the replica list."""
        return Backoff(self._config.client_retry_initial, self._config.client_retry_max)

    async def _round(
        self, hold: Callable[[str], Awaitable[bool]], backoff: Backoff, going: Callable[[], bool]
    ) -> RollcallError | None:
        """One round over the replicas, the presumed leader first: hold a
        session stream on each in turn (``hold``: until it ends; whether the
        replica answered) while ``going()``. A replica that does not answer
        at all (its host is gone: no connection reset) must not hold the
        session longer than a new leader's takeover grace, and one that is
        not the leader names it. Returns the error that ends the session for
        good (a refusal that no other replica would answer otherwise)."""
        for address in self._order():
            if not going():
                return None
            try:
                if await hold(address):
                    backoff.reset()
            except TimeoutError:
                log.info("session on %s: no answer to Open, trying the next replica", address)
                if address == self._leader_hint:
                    self._leader_hint = None
            except grpc.aio.AioRpcError as rpc_error:
                error = error_from_rpc(rpc_error)
                if isinstance(error, NotLeader) and error.leader:
                    self._leader_hint = error.leader
                if rpc_error.code() in RETRY_CODES:
                    log.debug("session on %s: %s", address, error)
                    continue
                return Evicted(str(error)) if isinstance(error, StaleEpoch) else error
        return None

    async def _close_channels(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


class RendezvousClient(ReplicaSet):
    """Async client. One instance serves one member (``join``) or any number
    of read-only calls (``status``, ``watch``).

    A member's session is a stream of its own, or its place on a stream
    that it shares with other members of this process (``carrier``:
    docs/protocol.md, "Shared sessions")."""

    def __init__(
        self,
        addresses: Sequence[str],
        job: str,
        token: str,
        config: Config | None = None,
        tls: ClientTLS | None = None,
        carrier: SessionCarrier | None = None,
        agent: str | None = None,
    ) -> None:
        super().__init__(addresses, job, token, config, tls, agent)
        self._carrier = carrier
        self.member_id: str | None = None
        #: The member's credential from the Join answer: every later call
        #: naming the member carries it.
        self._member_secret = ""
        #: Epoch secrets of the latest views this member is in (epoch -> secret).
        self._epoch_secrets: dict[int, str] = {}
        self._view = EMPTY_VIEW
        self._view_changed = asyncio.Event()
        self._heartbeat_interval = self._config.heartbeat_interval
        #: The service's rollcall_deadline and rollcall_step_end_wait, once
        #: its Join answer said them (``answer_deadline``).
        self._rollcall_timing = (
            self._config.rollcall_deadline,
            self._config.rollcall_step_end_wait,
        )
        #: Monotonic time this member's Open was sent on the session stream
        #: now up (its own, or a carrier's); None while none is up.
        self.session_opened: float | None = None
        self._session_task: asyncio.Task[None] | None = None
        #: Whether the member's session runs (its own stream, or its place
        #: on the carrier's).
        self._in_session = False
        self._outbox: asyncio.Queue[pb.SessionRequest] = asyncio.Queue()
        self._on_roll_call: RollCallHandler | None = None
        #: Recent roll calls held only for joiners (``at_step_end``).
        self._at_step_end: set[int] = set()
        #: Its answers under way on its own stream (``_session_on``).
        self._answering = Answering()
        self._on_view: Callable[[View], None] | None = None
        self._on_busy: BusyHandler | None = None
        self._step: int | None = None
        #: The newest step the member committed, set by its training thread
        #: without waking this loop (a plain attribute: one int written
        #: under the GIL); the session's writer reports it with the next
        #: heartbeat (``note_progress``).
        self._committed: int | None = None
        self._ended: RollcallError | None = None
        self._on_end: Callable[[RollcallError], None] | None = None
        #: Its Leave after refusing the timing of a leader it failed over
        #: to (``_check_timing``); ``close`` waits for it.
        self._refusing: asyncio.Task[None] | None = None
        #: Monotonic send time of the newest heartbeat the leader acknowledged:
        #: the leader heard this member at or after it, so it cannot have
        #: evicted it before ``last_acked`` + the detector's earliest suspicion.
        self.last_acked = 0.0
        self._closing = False

    # --- plumbing ------------------------------------------------------------

    async def _call(
        self, method: str, request: Any, leader_only: bool, patience: float | None = None
    ) -> Any:
        """A unary call with failover across replicas until ``patience``
        (default ``client_call_deadline``) has passed; named errors other
        than "unavailable" are raised at once. While no replica answers, a
        warning says so after ``unreachable_notice`` and again at that
        interval."""
        started = time.monotonic()
        deadline = started + (patience or self._config.client_call_deadline)
        backoff = self._retry_backoff()
        last: RollcallError | None = None
        notice = started + self._config.unreachable_notice
        while True:
            for address in self._order():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise last or ControlPlaneUnavailable("no rendezvous replica reachable")
                try:
                    rpc = getattr(self._stub(address), method)
                    attempt = min(remaining, self._config.client_attempt_timeout)
                    return await rpc(request, metadata=self._metadata, timeout=attempt)
                except grpc.aio.AioRpcError as rpc_error:
                    error = error_from_rpc(rpc_error)
                    if rpc_error.code() not in RETRY_CODES:
                        raise error from None
                    # Our own deadline cutting an attempt short says less
                    # than what a replica answered before.
                    if rpc_error.code() != grpc.StatusCode.DEADLINE_EXCEEDED or last is None:
                        last = error
                    if isinstance(error, NotLeader):
                        if not leader_only:
                            raise error from None
                        if error.leader:
                            self._leader_hint = error.leader
                    elif (
                        rpc_error.code() == grpc.StatusCode.UNAVAILABLE
                        and address == self._leader_hint
                    ):
                        self._leader_hint = None
            if time.monotonic() >= notice and last is not None:
                notice = time.monotonic() + self._config.unreachable_notice
                log.warning(
                    "cannot reach the rendezvous service at %s for %.0f s (%s); "
                    "still trying for %.0f s",
                    ", ".join(self._addresses), time.monotonic() - started, last,
                    max(0.0, deadline - time.monotonic()),
                )  # fmt: skip
            await asyncio.sleep(backoff.next())

    # --- read-only calls -----------------------------------------------------------

    async def status(self) -> Status:
        response = await self._call("Status", pb.StatusRequest(job=self._job), leader_only=False)
        if response.leader:
            self._leader_hint = response.leader
        return Status(
            view=view_from_pb(response.view),
            leader=response.leader,
            step=response.step if response.HasField("step") else None,
            replica=response.replica,
            rollcall_epoch=response.rollcall_epoch,
            checkpoints=tuple(manifest_from_pb(m) for m in response.checkpoints),
            last_step=response.last_step if response.HasField("last_step") else None,
            durability=durability_from_pb(response.durability),
            lost_epoch=response.lost_epoch,
        )

    async def watch(self, after_epoch: int = 0) -> AsyncIterator[View]:
        """Every committed view with an epoch above ``after_epoch``, across
        replica failovers. A round over the replicas that ended without a
        view is followed by a back-off (``client_retry_*``), reset by a view."""
        sent = after_epoch
        backoff = self._retry_backoff()
        while not self._closing:
            for address in self._order():
                call = self._stub(address).Watch(
                    pb.WatchRequest(job=self._job, after_epoch=sent), metadata=self._metadata
                )
                try:
                    async for message in call:
                        view = view_from_pb(message)
                        sent = view.epoch
                        backoff.reset()
                        yield view
                except grpc.aio.AioRpcError as rpc_error:
                    if rpc_error.code() not in RETRY_CODES:
                        raise error_from_rpc(rpc_error) from None
            await asyncio.sleep(backoff.next())

    # --- membership -----------------------------------------------------------------

    @property
    def view(self) -> View:
        """The last committed view received."""
        return self._view

    @property
    def step(self) -> int | None:
        """The last committed step this member reported."""
        return self._step

    async def join(
        self,
        address: str,
        name: str = "w",
        on_roll_call: RollCallHandler | None = None,
        on_view: Callable[[View], None] | None = None,
        on_end: Callable[[RollcallError], None] | None = None,
        on_busy: BusyHandler | None = None,
        fingerprint: JobFingerprint | None = None,
    ) -> str:
        """Join the job and open the session; returns the member id. The
        member is in the job once a view containing it arrives
        (``wait_member``).

        With ``fingerprint`` the service checks it against the job's
        (``ConfigurationMismatch`` if it differs; not retried). If the
        service's earliest suspicion of a silent member is not above this
        client's ``fence_window``, its ``rollcall_step_end_wait`` is below
        this client's, or a failover of its leader outlasts this client's
        ``fence_patience``, the member leaves again at once and an
        ``UnsafeTiming`` error saying which is raised."""
        if self._in_session:
            raise RuntimeError("this client already joined; use a new client to rejoin")
        request = pb.JoinRequest(
            job=self._job, address=address, name=name,
            fingerprint=fingerprint.as_dict() if fingerprint is not None else {},
            # On a shared session the view comes from the carrier, which
            # has it: decoding a view of thousands per joiner is not free.
            view_on_session=self._carrier is not None,
        )  # fmt: skip
        response = await self._call(
            "Join", request, leader_only=True, patience=self._config.join_deadline
        )
        self.member_id = response.member_id
        self._member_secret = response.member_secret
        unsafe = self._unsafe_timing(response)
        if unsafe is not None:
            self._view = view_from_pb(response.view)
            try:
                await self.leave()
            except RollcallError as exc:  # the record goes with its lease then
                log.warning("could not leave after refusing the service's settings: %s", exc)
            raise unsafe
        self._keep_timing(response)
        self._pace(response.heartbeat_interval_ms)
        self._on_roll_call = on_roll_call
        self._on_view = on_view
        self._on_end = on_end
        self._on_busy = on_busy
        if response.HasField("view"):
            self._set_view(view_from_pb(response.view))
        self._in_session = True
        if self._carrier is not None:
            self._carrier.attach(self)
        else:
            self._session_task = asyncio.create_task(self._session_forever(), name="session")
        return response.member_id

    def _unsafe_timing(self, response: pb.JoinResponse | pb.ServiceTiming) -> UnsafeTiming | None:
        """Why this client's timing does not fit the service's, as the
        ``Join`` answer or a ``ServiceTiming`` event gives it (fields of 0:
        the service did not say)."""
        bound = response.earliest_suspicion_s
        if bound and self._config.fence_window >= bound:
            return UnsafeFenceWindow(self._config.fence_window, bound)
        wait = response.rollcall_step_end_wait_s
        if wait and self._config.rollcall_step_end_wait > wait + TIMING_SLACK:
            return UnsafeStepEndWait(self._config.rollcall_step_end_wait, wait)
        ttl, opening = response.election_ttl_s, self._config.session_open_timeout
        if ttl and self._config.fence_patience < ttl + opening - TIMING_SLACK:
            return UnsafeFencePatience(self._config.fence_patience, ttl, opening)
        return None

    def _keep_timing(self, timing: pb.JoinResponse | pb.ServiceTiming) -> None:
        """The service's roll-call timing, for ``answer_deadline``."""
        if timing.rollcall_deadline_s:
            self._rollcall_timing = (timing.rollcall_deadline_s, timing.rollcall_step_end_wait_s)

    def between_leaders(self) -> bool:
        """Whether this member's session is between leaders: no stream is
        up, or none of its heartbeats was acknowledged on the one up (a
        failover, or the only replica restarting). Its next answer is a
        leader's: an acknowledgement, or the refusal of a member it no
        longer holds (the session then ends)."""
        opened = self.session_opened
        return opened is None or self.last_acked < opened

    def _check_timing(self, timing: pb.ServiceTiming) -> None:
        """The timing of the leader this member's session opened on. The
        member checked the one it joined through; a failover may hand it
        to a replica started with other settings. If they do not fit its
        own, it leaves at once and its session ends with the error a Join
        would have raised (``UnsafeTiming``)."""
        unsafe = self._unsafe_timing(timing)
        if unsafe is None:
            self._keep_timing(timing)
            return
        if self._closing:
            return
        log.error("the rendezvous leader's settings do not fit this member's; leaving: %s", unsafe)
        self._closing = True  # no session opens again
        self._end(unsafe)
        self._refusing = asyncio.ensure_future(self._leave_refusing())

    @property
    def refused_leader(self) -> bool:
        """Whether this member refused the timing of the leader its session
        opened on and is leaving: it acts on no event of that leader."""
        return self._refusing is not None

    async def _leave_refusing(self) -> None:
        try:
            await self.leave()
        except RollcallError as exc:  # the record goes with its lease then
            log.warning("could not leave after refusing the leader's settings: %s", exc)

    def answer_deadline(self, at_step_end: bool) -> float:
        """How long after a roll call starts the service takes its answers
        (``Config.answer_deadline`` with the service's settings, as its
        ``Join`` answer gave them; this client's own before that)."""
        deadline, wait = self._rollcall_timing
        return deadline + (wait if at_step_end else 0.0)

    def _pace(self, interval_ms: int) -> None:
        """Heartbeat as the leader says (``paced``)."""
        self._heartbeat_interval = paced(self._config, interval_ms, self._heartbeat_interval)

    @property
    def heartbeat_interval(self) -> float:
        """How often this member heartbeats (as the leader said, capped)."""
        return self._heartbeat_interval

    async def wait_view(self, predicate: Callable[[View], bool], timeout: float) -> View:
        """Wait until a received view satisfies ``predicate``. Raises the
        session's error if it ended (``Evicted``...), ``TimeoutError`` after
        ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            if self._ended is not None:
                raise self._ended
            if predicate(self._view):
                return self._view
            self._view_changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no matching view within {timeout} s (at {self._view.epoch})")
            try:
                await asyncio.wait_for(self._view_changed.wait(), remaining)
            except TimeoutError:
                pass

    async def wait_member(self, timeout: float) -> View:
        """Wait for the first view that contains this member."""
        return await self.wait_view(lambda v: self.member_id in v, timeout)

    def report_progress(self, step: int) -> None:
        """This member committed ``step`` in the current view (reported now)."""
        self._step = step
        self._send(pb.SessionRequest(progress=pb.Progress(epoch=self._view.epoch, step=step)))

    def note_progress(self, step: int) -> None:
        """This member committed ``step``: reported with the next heartbeat,
        at most ``heartbeat_interval`` later. Safe from any thread, and it
        wakes nothing: the training thread calls it at every commit."""
        self._committed = step

    def report_failure(self, peer_id: str, reason: str) -> None:
        """This member saw ``peer_id`` fail."""
        self._send(
            pb.SessionRequest(
                failure=pb.FailureReport(epoch=self._view.epoch, peer_id=peer_id, reason=reason)
            )
        )

    def report_view(self, report: pb.ViewReport) -> None:
        """How entering the current view went (after the first commit in it)."""
        self._send(pb.SessionRequest(view_report=report))

    def declare_busy(self, seconds: float, reason: str) -> None:
        """This member will be away from collectives for at most ``seconds``
        (0: no longer): its peers wait for it, the detector spares it."""
        self._send(
            pb.SessionRequest(busy=pb.Busy(epoch=self._view.epoch, seconds=seconds, reason=reason))
        )

    def request_rollcall(self, reason: str) -> None:
        """Ask for a roll call: this member's state changed outside a step
        (it loaded a checkpoint), so the view's resume step must be decided
        again. Sent as a failure report naming the member itself."""
        assert self.member_id is not None
        self.report_failure(self.member_id, reason)

    async def publish_checkpoint(
        self, manifest: CheckpointManifest
    ) -> tuple[bool, tuple[CheckpointManifest, ...]]:
        """Record a complete checkpoint; returns (accepted, manifests kept)."""
        assert self.member_id is not None
        response = await self._call(
            "PublishCheckpoint",
            pb.PublishCheckpointRequest(
                job=self._job,
                member_id=self.member_id,
                epoch=self._view.epoch,
                checkpoint=manifest_to_pb(manifest),
                member_secret=self._member_secret,
            ),
            leader_only=True,
        )
        return response.accepted, tuple(manifest_from_pb(m) for m in response.checkpoints)

    def report_checkpoint_failure(self, step: int, reason: str) -> None:
        """This member could not make the checkpoint of ``step`` durable."""
        self._send(
            pb.SessionRequest(
                checkpoint_failure=pb.CheckpointFailure(
                    epoch=self._view.epoch, step=step, reason=reason
                )
            )
        )

    async def forget_checkpoints(
        self, steps: Sequence[int] | None
    ) -> tuple[tuple[CheckpointManifest, ...], tuple[CheckpointManifest, ...]]:
        """Remove the manifests of ``steps`` (None: all) from the job's
        record; returns (forgotten, kept). ``NoSuchCheckpoint`` if a step is
        not recorded (nothing is removed then)."""
        request = pb.ForgetCheckpointsRequest(job=self._job, steps=steps or (), all=steps is None)
        response = await self._call("ForgetCheckpoints", request, leader_only=True)
        return (
            tuple(manifest_from_pb(m) for m in response.forgotten),
            tuple(manifest_from_pb(m) for m in response.kept),
        )

    async def leave(self) -> None:
        """Leave cleanly; the others reconfigure at once."""
        if self.member_id is None:
            return
        self._closing = True
        try:
            await self._call(
                "Leave",
                pb.LeaveRequest(
                    job=self._job,
                    member_id=self.member_id,
                    epoch=self._view.epoch,
                    member_secret=self._member_secret,
                ),  # fmt: skip
                leader_only=True,
            )
        finally:
            await self._stop_session()

    async def close(self) -> None:
        """Drop the session without leaving (as a crash would) and close
        channels; a Leave under way after refusing a leader's timing
        (``_check_timing``) is waited for first."""
        self._closing = True
        if self._refusing is not None:
            await asyncio.gather(self._refusing, return_exceptions=True)
        await self._stop_session()
        await self._close_channels()

    def epoch_secret(self, epoch: int) -> str | None:
        """The secret of view ``epoch`` as the leader sent it (only to members
        of that view, just before the view), or None if it did not."""
        return self._epoch_secrets.get(epoch)

    def _keep_epoch_secret(self, epoch: int, secret: str) -> None:
        self._epoch_secrets[epoch] = secret
        for old in [e for e in self._epoch_secrets if e < epoch - _EPOCH_SECRETS_KEPT]:
            del self._epoch_secrets[old]

    @property
    def ended(self) -> RollcallError | None:
        """Why the session ended, if it did (``Evicted``, ``Unauthenticated``...)."""
        return self._ended

    # --- the session ----------------------------------------------------------------

    def _send(self, request: pb.SessionRequest) -> None:
        if not self._in_session:
            raise RuntimeError("not joined")
        self._queue(request)

    def _queue(self, request: pb.SessionRequest) -> None:
        """A message for the session: on the member's own stream, or on
        the carrier's in the member's slot."""
        if self._carrier is not None:
            self._carrier.send(self, request)
        else:
            self._outbox.put_nowait(request)

    def _set_view(self, view: View) -> None:
        if view.epoch <= self._view.epoch and self._view is not EMPTY_VIEW:
            return  # already known (a reconnect sends the current view again)
        self._view = view
        self._view_changed.set()
        if self._on_view is not None:
            self._on_view(view)

    async def _stop_session(self) -> None:
        if self._carrier is not None and self._in_session:
            self._carrier.detach(self)
        self._in_session = False
        task, self._session_task = self._session_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _session_forever(self) -> None:
        backoff = self._retry_backoff()
        while not self._closing:
            if self._agent is not None and (await self._on_agent(self._agent) or self._closing):
                return
            ended = await self._round(self._session_on, backoff, lambda: not self._closing)
            if ended is not None:
                self._end(ended)
                return
            if self._closing:
                return
            await asyncio.sleep(backoff.next())

    async def _on_agent(self, address: str) -> bool:
        """Hold the session on the host agent until it ends; whether the
        member's session is over for good (the agent passed on a refusal
        of the leader's). An agent that does not answer, or cannot reach
        the leader, sends the session to the replicas."""
        try:
            await self._session_on(address)
            return False
        except TimeoutError:
            log.info("session on the host agent %s: no answer; on the replicas instead", address)
        except grpc.aio.AioRpcError as rpc_error:
            error = error_from_rpc(rpc_error)
            if rpc_error.code() in RETRY_CODES:
                log.info("session on the host agent %s: %s; on the replicas instead",
                         address, error)  # fmt: skip
                return False
            self._end(Evicted(str(error)) if isinstance(error, StaleEpoch) else error)
            return True
        return False

    def _end(self, error: RollcallError) -> None:
        log.info("session of %s ended: %s", self.member_id, error)
        self._ended = error
        self._view_changed.set()
        if self._on_end is not None:
            self._on_end(error)

    async def _session_on(self, address: str) -> bool:
        """Hold the session on ``address`` until it ends; whether it was
        established (the replica answered the Open). ``TimeoutError`` if the
        replica does not answer within ``session_open_timeout``."""
        assert self.member_id is not None
        call = self._stub(address).Session(metadata=self._metadata)
        opened = False
        writer: asyncio.Task[None] | None = None
        try:
            async with asyncio.timeout(self._config.session_open_timeout):
                self.session_opened = time.monotonic()
                await call.write(pb.SessionRequest(open=self._opening()))
                event = await call.read()
            writer = asyncio.create_task(self._write_session(call))
            while True:
                if event is grpc.aio.EOF:
                    return opened  # ended cleanly (a failed stream raises instead)
                opened = True
                if address != self._agent:
                    self._leader_hint = address
                await self._on_event(event)
                event = await call.read()
                self._answering.check()
        finally:
            self.session_opened = None
            call.cancel()
            await self._answering.stop()
            if writer is not None:
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)

    def _opening(self, shared: bool = False, relayed: bool = False) -> pb.Open:
        """The member's Open, on its own stream or a shared one."""
        assert self.member_id is not None
        return pb.Open(
            job=self._job, member_id=self.member_id, epoch=self._view.epoch,
            member_secret=self._member_secret, view_deltas=True, shared=shared, relayed=relayed,
        )  # fmt: skip

    async def _on_event(self, event: pb.SessionEvent) -> None:
        """One event of the member's session."""
        if self.refused_leader:
            return  # only its Leave is left to do (``_check_timing``)
        kind = event.WhichOneof("kind")
        if kind == "ack":
            self.last_acked = max(self.last_acked, event.ack.sent_at)
        elif kind == "epoch_secret":
            self._keep_epoch_secret(event.epoch_secret.epoch, event.epoch_secret.secret)
        elif kind == "view":
            if event.view.epoch > self._view.epoch or self._view is EMPTY_VIEW:
                # (decoded only if new: a session that opens is sent the
                # view in force, which the member mostly holds)
                self._set_view(view_from_pb(event.view))
        elif kind == "view_delta":
            change = event.view_delta
            if change.epoch_secret:
                self._keep_epoch_secret(change.epoch, change.epoch_secret)
            self._apply_delta(delta_from_pb(change))
        elif kind == "pace":
            self._pace(event.pace.heartbeat_interval_ms)
        elif kind == "timing":
            self._check_timing(event.timing)
        elif kind == "roll_call":
            request = event.roll_call
            causes = causes_from_pb(request.causes)
            self._answering.start(self._answer(request.epoch, causes, request.at_step_end))
        elif kind == "busy" and self._on_busy is not None:
            busy = event.busy
            self._on_busy(busy.member_id, busy.seconds, busy.reason)

    def _progress_due(self) -> pb.SessionRequest | None:
        """The step committed since the last report (``note_progress``), as
        the report that goes with the next heartbeat."""
        committed = self._committed
        if committed is None or committed == self._step:
            return None
        self._step = committed
        return pb.SessionRequest(progress=pb.Progress(epoch=self._view.epoch, step=committed))

    def _apply_delta(self, delta: ViewDelta) -> None:
        """A view sent as a change of the one the session carried before.
        One that does not apply to the view this member holds (it missed
        one) or does not rebuild the list the leader hashed is never acted
        on: the member asks for the whole view instead."""
        if delta.epoch <= self._view.epoch:
            return  # already known
        view = _rebuild(self._view, delta)
        if view is None:
            log.info(
                "view %d came as a change of view %d, which this member does not hold "
                "(it holds %d) or which did not check out: asking for the whole view",
                delta.epoch, delta.base_epoch, self._view.epoch,
            )  # fmt: skip
            request = pb.ViewRequest(epoch=self._view.epoch)
            self._queue(pb.SessionRequest(view_request=request))
            return
        self._set_view(view)

    def at_step_end(self, epoch: int) -> bool:
        """Whether roll call ``epoch`` was held only for joiners, so that
        its answer may wait for the end of the step in flight
        (``RollCallRequest.at_step_end``; a roll-call handler asks)."""
        return epoch in self._at_step_end

    def _answer(
        self, epoch: int, causes: tuple[Cause, ...], at_step_end: bool = False
    ) -> Awaitable[None]:
        """Roll call ``epoch`` arrived: the handler is called now (a roll
        call takes effect as it is read: the step in flight stops before the
        stream's next event, an acknowledgement say, is acted on), and the
        answer is sent once it is ready, by the awaitable returned (run
        beside the stream's reading: ``Answering``)."""
        if at_step_end:
            self._at_step_end = {e for e in self._at_step_end if e > epoch - 4} | {epoch}
        if self._on_roll_call is None:
            return self._send_answer(epoch, RollCallAnswer(self._step, ""))
        return self._send_answer(epoch, self._on_roll_call(epoch, causes))

    async def _send_answer(
        self, epoch: int, result: RollCallAnswer | Awaitable[RollCallAnswer]
    ) -> None:
        reply = await result if inspect.isawaitable(result) else result
        step = reply.step
        if step is not None and step != self._step and self.member_id in self._view:
            # The leader checks an answer against the progress reported in
            # the view (docs/protocol.md, "A roll call"): report the step
            # the answer names first, which progress reports (at most one
            # per heartbeat interval) may not have named yet.
            self.report_progress(step)
        answer = pb.RollCallAnswer(epoch=epoch, digest=reply.digest)
        if step is not None:
            answer.step = step
        if reply.shard_epoch is not None:
            answer.shard_epoch = reply.shard_epoch
        answer.unsettled = reply.unsettled
        self._queue(pb.SessionRequest(answer=answer))

    async def _write_session(self, call: Any) -> None:
        """Send queued messages, and a heartbeat every heartbeat interval
        whatever else is sent (each is acknowledged by the leader)."""
        next_beat = 0.0
        while True:
            request: pb.SessionRequest | None
            try:
                # Not wait_for, which makes a task for every message.
                async with asyncio.timeout(max(0.0, next_beat - time.monotonic())):
                    request = await self._outbox.get()
            except TimeoutError:
                request = None
            now = time.monotonic()
            try:
                if now >= next_beat:
                    next_beat = now + self._heartbeat_interval
                    progress = self._progress_due()
                    if progress is not None:
                        await call.write(progress)
                    beat = pb.Heartbeat(epoch=self._view.epoch, sent_at=now)
                    await call.write(pb.SessionRequest(heartbeat=beat))
                if request is not None:
                    await call.write(request)
            except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
                return  # the stream ended; the reader reports why
