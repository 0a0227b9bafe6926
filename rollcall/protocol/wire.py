"""What crosses the wire: protobuf <-> domain objects, errors <-> gRPC status,
and the job-token metadata."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from rollcall.membership.cause import Cause
from rollcall.membership.checkpoint import (
    CheckpointFailure,
    CheckpointManifest,
    CheckpointPart,
    Durability,
)
from rollcall.membership.delta import ViewDelta
from rollcall.membership.errors import (
    ConfigurationMismatch,
    ControlPlaneUnavailable,
    Evicted,
    InvalidRequest,
    JobRecordLost,
    NoSuchCheckpoint,
    NoSuchJob,
    NotAMember,
    NotLeader,
    PermissionDenied,
    RollcallError,
    StaleEpoch,
    Unauthenticated,
)
from rollcall.membership.shards import ShardedView, ShardPlan
from rollcall.membership.view import Member, View
from rollcall.pb import rendezvous_pb2 as pb

#: Metadata key carrying the job token ("Bearer <token>").
TOKEN_METADATA = "authorization"
#: Trailing metadata key naming the leader when a standby refuses a call.
LEADER_METADATA = "rollcall-leader"
#: Trailing metadata key naming the error when the status code alone does
#: not tell it (``NAMED_BY_METADATA``).
ERROR_METADATA = "rollcall-error"
#: Environment variable naming a file that holds the job token.
TOKEN_FILE_ENV = "ROLLCALL_TOKEN_FILE"
#: Environment variable holding the job token when no file is given.
TOKEN_ENV = "ROLLCALL_TOKEN"


class Undecodable(InvalidRequest):
    """The bytes of a request are not a message of the method's type."""


class Oversized(InvalidRequest):
    """A request is larger than the service accepts (``RESOURCE_EXHAUSTED``)."""


#: gRPC's own receive limit on the services whose interceptor checks the
#: size: above ``Config.max_message_bytes`` so that an oversized request
#: reaches the interceptor and is refused like any malformed one (gRPC would
#: end a session stream under the service, as if its member had crashed).
#: Requests above this one are still cut off by the transport.
TRANSPORT_LIMIT = 4 * 1024 * 1024


#: Which gRPC status each named error travels as (documented in the .proto).
STATUS_OF: dict[type[RollcallError], grpc.StatusCode] = {
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    StaleEpoch: grpc.StatusCode.FAILED_PRECONDITION,
    Evicted: grpc.StatusCode.FAILED_PRECONDITION,
    ConfigurationMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    JobRecordLost: grpc.StatusCode.FAILED_PRECONDITION,
    Oversized: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotAMember: grpc.StatusCode.NOT_FOUND,
    NoSuchCheckpoint: grpc.StatusCode.NOT_FOUND,
    NoSuchJob: grpc.StatusCode.NOT_FOUND,
    NotLeader: grpc.StatusCode.UNAVAILABLE,
    ControlPlaneUnavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_of(error: RollcallError) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]  # type: ignore[index]
    return grpc.StatusCode.INTERNAL


#: Errors that share their status code with others and travel with their
#: name in ``ERROR_METADATA``, so that the client raises the right one.
NAMED_BY_METADATA: dict[str, type[RollcallError]] = {
    "ConfigurationMismatch": ConfigurationMismatch,
    "JobRecordLost": JobRecordLost,
    "NoSuchCheckpoint": NoSuchCheckpoint,
}


def error_metadata(error: RollcallError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata naming ``error``, if it is one of ``NAMED_BY_METADATA``."""
    for name, cls in NAMED_BY_METADATA.items():
        if type(error) is cls:
            return ((ERROR_METADATA, name),)
    return ()


def end_to_pb(error: RollcallError) -> pb.SessionEnd:
    """How ``error`` ends one member's session on a shared stream: the
    status and trailing metadata its own stream would have ended with."""
    named = dict(error_metadata(error)).get(ERROR_METADATA, "")
    return pb.SessionEnd(code=status_of(error).value[0], message=str(error), error=named)


#: gRPC status codes by number (``SessionEnd.code``).
STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def view_to_pb(view: View) -> pb.View:
    message = pb.View(
        epoch=view.epoch,
        members=[pb.Member(id=m.id, address=m.address, rank=r) for r, m in enumerate(view.members)],
        digest=view.digest,
        fetch_groups=[
            pb.FetchGroup(sources=list(sources), members=list(fetchers))
            for sources, fetchers in view.fetch_groups()
        ],
    )
    if view.resume_step is not None:
        message.resume_step = view.resume_step
    if view.shards is not None:
        shards = view.shards
        message.shards.CopyFrom(pb.ShardedView(
            redundancy=shards.plan.redundancy,
            owners=[pb.MemberList(ids=list(o)) for o in shards.plan.owners],
            sources=[pb.MemberList(ids=list(s)) for s in shards.sources],
            lost=list(shards.lost),
            base=[pb.MemberList(ids=list(o)) for o in (shards.base.owners if shards.base else ())],
        ))  # fmt: skip
    return message


def _fetch_from_pb(message: pb.View) -> dict[str, tuple[str, ...]]:
    fetch = {f.member_id: tuple(f.sources) for f in message.fetch}
    for group in message.fetch_groups:
        sources = tuple(group.sources)
        fetch.update(dict.fromkeys(group.members, sources))
    return fetch


def view_from_pb(message: pb.View) -> View:
    return View(
        epoch=message.epoch,
        members=tuple(Member(m.id, m.address) for m in message.members),
        resume_step=message.resume_step if message.HasField("resume_step") else None,
        digest=message.digest,
        fetch=_fetch_from_pb(message),
        shards=_shards_from_pb(message.shards) if message.HasField("shards") else None,
    )


def delta_to_pb(delta: ViewDelta) -> pb.ViewDelta:
    message = pb.ViewDelta(
        epoch=delta.epoch,
        base_epoch=delta.base_epoch,
        removed=delta.removed,
        added=[pb.Member(id=m.id, address=m.address) for m in delta.added],
        members_sha256=delta.members_sha256,
        digest=delta.digest,
        fetch_groups=[
            pb.RankGroup(sources=sources, members=fetchers)
            for sources, fetchers in delta.fetch_groups
        ],
    )
    if delta.resume_step is not None:
        message.resume_step = delta.resume_step
    return message


def delta_from_pb(message: pb.ViewDelta) -> ViewDelta:
    return ViewDelta(
        epoch=message.epoch,
        base_epoch=message.base_epoch,
        removed=tuple(message.removed),
        added=tuple(Member(m.id, m.address) for m in message.added),
        members_sha256=message.members_sha256,
        resume_step=message.resume_step if message.HasField("resume_step") else None,
        digest=message.digest,
        fetch_groups=tuple((tuple(g.sources), tuple(g.members)) for g in message.fetch_groups),
    )


def _shards_from_pb(message: pb.ShardedView) -> ShardedView:
    plan = ShardPlan(tuple(tuple(o.ids) for o in message.owners), message.redundancy)
    base = ShardPlan(tuple(tuple(o.ids) for o in message.base), message.redundancy)
    return ShardedView(
        plan, tuple(tuple(s.ids) for s in message.sources), tuple(message.lost),
        base if message.base else None,
    )  # fmt: skip


def causes_from_pb(texts: Iterable[str]) -> tuple[Cause, ...]:
    """A roll call's causes from their wire texts (``str(Cause)``); a text
    that is not a cause (a leader of another version) is left out."""
    parsed = (Cause.parse(text) for text in texts)
    return tuple(cause for cause in parsed if cause is not None)


def manifest_to_pb(manifest: CheckpointManifest) -> pb.Checkpoint:
    record = manifest.to_dict()
    parts = [pb.CheckpointPart(**part) for part in record.pop("parts")]
    return pb.Checkpoint(**record, parts=parts)


def manifest_from_pb(message: pb.Checkpoint) -> CheckpointManifest:
    """Raises ``InvalidRequest`` for a malformed manifest."""
    parts = tuple(
        CheckpointPart(p.uri, p.size, p.sha256, tuple(p.partitions), tuple(p.digests))
        for p in message.parts
    )
    fields = (f.name for f in dataclasses.fields(CheckpointManifest) if f.name != "parts")
    return CheckpointManifest(**{name: getattr(message, name) for name in fields}, parts=parts)


def durability_to_pb(durability: Durability) -> pb.Durability:
    message = pb.Durability()
    if durability.durable_step is not None:
        message.durable_step = durability.durable_step
    failure = durability.failure
    if failure is not None:
        message.failures = failure.failures
        message.failed_step = failure.step
        message.reason = failure.reason
        message.failing_since_unix = failure.since_unix
        message.writer = failure.writer
    return message


def durability_from_pb(message: pb.Durability) -> Durability:
    failure = None
    if message.failures:
        failure = CheckpointFailure(
            step=message.failed_step, reason=message.reason,
            since_unix=message.failing_since_unix, failures=message.failures,
            writer=message.writer,
        )  # fmt: skip
    durable = message.durable_step if message.HasField("durable_step") else None
    return Durability(durable, failure)


def read_token(token_file: str | os.PathLike[str] | None) -> str:
    """The job token, from the first of: ``token_file`` (``--token-file``),
    the file named by ``$ROLLCALL_TOKEN_FILE``, ``$ROLLCALL_TOKEN``.

    A file comes before the token itself in the environment: its mode
    guards it, while the environment is handed on to every program the
    process starts. Raises ``ValueError`` with a message fit for the command
    line (the token itself never appears in it)."""
    path = token_file if token_file is not None else os.environ.get(TOKEN_FILE_ENV) or None
    if path is not None:
        return _token_from_file(Path(path))
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(
            f"no job token: pass --token-file FILE or set {TOKEN_FILE_ENV} or {TOKEN_ENV}"
        )
    return token


def _token_from_file(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read token file {path}: {exc.strerror}") from None
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def write_token_file(path: Path, token: str) -> bool:
    """Create ``path`` holding ``token``, readable by this user only from
    the moment it exists (no window in which another user could open it).
    False if the file already exists (it is left as it is)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    os.fchmod(fd, 0o600)  # a strict umask may have taken the owner's bits too
    with os.fdopen(fd, "w") as file:
        file.write(token)
    return True


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_METADATA, f"Bearer {token}"),)


def token_matches(presented: str | None, expected_digest: bytes) -> bool:
    """Constant-time comparison (of fixed-length digests, so the length of
    the token does not leak either)."""
    value = presented or ""
    if value.startswith("Bearer "):
        value = value[len("Bearer ") :]
    return hmac.compare_digest(hashlib.sha256(value.encode()).digest(), expected_digest)


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call whose job token is missing or wrong, before any
    handler (and so any state) is reached, and refuses a request whose bytes
    do not decode (``INVALID_ARGUMENT``) or, with ``max_request_bytes``, are
    more than that (``RESOURCE_EXHAUSTED``) as an ordinary malformed request.
    Serves every gRPC service of the project (rendezvous, state transfer).
    A handler may yield responses it encoded already (``bytes``): they are
    sent as they are."""

    def __init__(self, token: str, max_request_bytes: int | None = None) -> None:
        self._digest = token_digest(token)
        self._max_request_bytes = max_request_bytes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        presented = None
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_METADATA:
                presented = value if isinstance(value, str) else value.decode()
        if handler is None:
            return handler
        if token_matches(presented, self._digest):
            return _refusing_malformed(handler, self._max_request_bytes)
        return _deny_like(handler)


def _refusing_malformed(
    handler: grpc.RpcMethodHandler, max_bytes: int | None
) -> grpc.RpcMethodHandler:
    """``handler``, except that a request that does not decode is refused
    with ``INVALID_ARGUMENT``, one of more than ``max_bytes`` (if given) with
    ``RESOURCE_EXHAUSTED``. Left to gRPC it would be answered ``UNKNOWN``
    with a traceback in the log, and in the middle of a session stream the
    handler would see only the stream end, as if the member had crashed.

    The decoder hands an ``Undecodable`` or ``Oversized`` error on as the
    request; on a request stream it is raised to the handler like any
    malformed message."""
    decode = handler.request_deserializer
    if decode is None:
        return handler

    def deserialize(data: bytes) -> Any:
        if max_bytes is not None and len(data) > max_bytes:
            return Oversized(f"request of {len(data)} bytes is larger than max {max_bytes}")
        try:
            return decode(data)
        except DecodeError as error:
            return Undecodable(f"undecodable request: {error}")

    async def refuse(context: grpc.aio.ServicerContext, error: InvalidRequest) -> None:
        await context.abort(status_of(error), str(error))

    async def decoded(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, InvalidRequest):
                raise request
            yield request

    serialize = _sending_encoded(handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        bidi = handler.stream_stream

        async def checked_bidi(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async with aclosing(bidi(decoded(requests), context)) as responses:
                    async for response in responses:
                        yield response
            except InvalidRequest as error:  # not handled by the handler itself
                await refuse(context, error)

        return grpc.stream_stream_rpc_method_handler(checked_bidi, deserialize, serialize)
    if handler.request_streaming:
        return handler  # client streaming: no such method in our services
    if handler.response_streaming:
        stream_out = handler.unary_stream

        async def checked_stream_out(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, InvalidRequest):
                await refuse(context, request)
            async with aclosing(stream_out(request, context)) as responses:
                async for response in responses:
                    yield response

        return grpc.unary_stream_rpc_method_handler(checked_stream_out, deserialize, serialize)
    unary = handler.unary_unary

    async def checked_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, InvalidRequest):
            await refuse(context, request)
        return await unary(request, context)

    return grpc.unary_unary_rpc_method_handler(checked_unary, deserialize, serialize)


def _sending_encoded(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    """``serialize``, except that a response already encoded (``bytes``)
    is sent as it is: an event sent on thousands of sessions (a view, a roll
    call) is encoded once (``rollcall.rendezvous.replica.leadership``)."""
    if serialize is None:
        return None
    encode = serialize

    def serialize_or_pass(response: Any) -> bytes:
        return response if isinstance(response, bytes) else encode(response)

    return serialize_or_pass


def _deny_like(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED."""
    message = str(Unauthenticated("missing or wrong job token"))

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    async def take_first(requests: Any) -> None:
        # Accept the client's first message before refusing: a client whose
        # first write races the refusal otherwise sees a local INTERNAL error
        # ("execute_batch") instead of UNAUTHENTICATED.
        async for _ in requests:
            return

    async def deny_stream_in(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await take_first(requests)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_bidi(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await take_first(requests)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_bidi)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny_stream_in)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream)
    return grpc.unary_unary_rpc_method_handler(deny)
