"""Hostile and malformed requests against a real replica (real etcd) and a
real worker state server, sent as raw bytes over real gRPC: each is refused
with its documented status code (docs/protocol.md) and a clear message, none
changes anything (neither etcd, nor the view, step and checkpoints the job
reports, nor what a worker serves), and the service goes on serving.

This file holds the hand-picked cases and the helpers; generated requests
for every method are in tests/test_fuzz.py."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError, Message

from rollcall.etcd_local import LocalEtcd
from rollcall.membership.config import Config
from rollcall.membership.errors import ConfigurationMismatch
from rollcall.membership.view import Member, View
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.pb import rendezvous_pb2_grpc as pb_grpc
from rollcall.pb import state_pb2 as state_pb
from rollcall.pb import state_pb2_grpc as state_pb_grpc
from rollcall.protocol.client import error_from_rpc
from rollcall.protocol.wire import TokenInterceptor, token_metadata
from rollcall.rendezvous.store import EtcdStore
from rollcall.worker.transfer import Snapshot, StateServer
from tests.harness import TEST_SETTINGS, ControlPlane, MemberProcess

pytestmark = pytest.mark.integration  # starts processes

Code = grpc.StatusCode

#: No rejection may take longer than this (a call that is never answered fails).
CALL_TIMEOUT = 10.0
#: Time given to anything a rejected request might have set off (a join
#: settles in 50 ms) before the state is compared.
SETTLE = 0.1
#: Codes the replica may answer a malformed request with (docs/protocol.md).
DOCUMENTED_REJECTIONS = {
    Code.PERMISSION_DENIED,
    Code.INVALID_ARGUMENT,
    Code.RESOURCE_EXHAUSTED,
    Code.FAILED_PRECONDITION,
    Code.NOT_FOUND,
}
#: Codes a worker's state server may answer a malformed request with.
STATE_REJECTIONS = {
    Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED, Code.FAILED_PRECONDITION,
    Code.PERMISSION_DENIED,
}  # fmt: skip
#: A well-formed peer address (nobody listens there; it is never dialled).
ADDRESS = "127.0.0.1:29500"
#: Over the replica's 64 KiB message limit.
HUGE = "x" * 100_000
#: Over gRPC's default 4 MiB limit, which a worker's state server keeps.
HUGER = "x" * (5 << 20)
#: Not a protobuf message of any type: field 1 says 5 bytes follow, 2 do.
UNDECODABLE = b"\x0a\x05ab"
#: The replica's config for the shared jobs: a member that no process runs
#: (the puppet) keeps its place between the sessions the tests open for it.
PUPPET_SETTINGS = (
    *TEST_SETTINGS, "max_silence=600", "phi_min_std=60", "member_lease_ttl=900",
    # A checkpoint beyond the job's progress is refused without a long wait.
    "checkpoint_progress_wait=0.05",
)  # fmt: skip
#: Step of the checkpoint the shared jobs have published, and their progress
#: (written into etcd: their members report none).
CHECKPOINT_STEP = 1000
#: The configuration the shared jobs' puppet joined with (the job's fingerprint).
PUPPET_FINGERPRINT = {"global_batch": "48", "micro_batch": "8", "seed": "0"}


# --- the methods, called with raw bytes -----------------------------------------------


@dataclass(frozen=True)
class Method:
    """One RPC as its .proto declares it. Calls pass bytes through, so that
    a request need not be a message at all."""

    path: str
    request: type[Message]
    request_streaming: bool
    response_streaming: bool


def methods(module: ModuleType, service: str) -> dict[str, Method]:
    """Every method of ``service``, read from its compiled .proto."""
    descriptor = module.DESCRIPTOR.services_by_name[service]
    return {
        m.name: Method(
            f"/{descriptor.full_name}/{m.name}",
            getattr(module, m.input_type.name),
            m.client_streaming,
            m.server_streaming,
        )
        for m in descriptor.methods
    }


RENDEZVOUS = methods(pb, "Rendezvous")
STATE = methods(state_pb, "StateTransfer")


def encode(message: Message | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def decodes(message_type: type[Message], data: bytes) -> bool:
    try:
        message_type.FromString(data)
    except DecodeError:
        return False
    return True


async def drain(call: Any) -> int:
    """Read a response stream to its end, so that its status is known (an
    error status raises); returns how many messages came first."""
    count = 0
    while await call.read() is not grpc.aio.EOF:
        count += 1
    return count


async def send(
    channel: grpc.aio.Channel, method: Method, request: Any, md: Sequence[tuple[str, str]]
) -> None:
    """One call (a message or bytes; for a request stream, a list of them);
    returns only if the service accepted it (response streams: if it ended
    them cleanly). A session's request stream stays open, so the service,
    not the end of our input, has to end it."""
    if method.request_streaming:
        assert method.response_streaming, "no .proto declares a client-streaming RPC"
        call = channel.stream_stream(method.path)(metadata=md, timeout=CALL_TIMEOUT)
        for message in request:
            try:
                await call.write(encode(message))
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                break  # refused already: the status is read below
        await drain(call)
    elif method.response_streaming:
        await drain(
            channel.unary_stream(method.path)(encode(request), metadata=md, timeout=CALL_TIMEOUT)
        )
    else:
        await channel.unary_unary(method.path)(encode(request), metadata=md, timeout=CALL_TIMEOUT)


def token_for(token: str, right: str) -> tuple[tuple[str, str], ...]:
    if token == "right":
        return token_metadata(right)
    if token == "wrong":
        return token_metadata(right + "-not")
    assert token == "missing"
    return ()


def assert_refusal(
    error: grpc.aio.AioRpcError | None, request: Any, codes: Collection[Code], says: str
) -> None:
    assert error is not None, f"accepted: {request!r:.300}"
    assert error.code() in codes, f"{error.code()}: {error.details()}"
    assert error.details() and says in error.details(), error.details()


# --- a job on a real replica ------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """A running job, as the requests below see it: member processes and,
    in the shared jobs, a puppet in the view."""

    plane: ControlPlane
    store: EtcdStore
    members: tuple[str, ...]
    puppet: str | None = None
    #: Member id -> its member secret (from its Join answer).
    secrets: Mapping[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.plane.addresses[0]

    @property
    def name(self) -> str:
        return self.plane.job


@dataclass(frozen=True)
class Target:
    """What a request may refer to: the job, its members and current view."""

    job: str
    members: tuple[str, ...]
    puppet: str | None
    epoch: int
    in_view: frozenset[str]
    #: Member id -> its member secret.
    secrets: Mapping[str, str] = field(default_factory=dict)

    def secret_of(self, member_id: str) -> str:
        """The member's secret ("" for ids the tests hold none for)."""
        return self.secrets.get(member_id, "")


@dataclass(frozen=True)
class JobState:
    etcd: dict[str, bytes]
    status: pb.StatusResponse


def add_two_members(plane: ControlPlane) -> tuple[MemberProcess, MemberProcess]:
    """Two member processes, both in the committed view."""
    first, second = plane.add_member("a"), plane.add_member("b")
    both = {first.member_id, second.member_id}
    for member in (first, second):
        member.wait_event(lambda e: e["event"] == "view" and both <= set(e["members"]), 30)
    return first, second


async def enlist_puppet(plane: ControlPlane) -> tuple[str, str]:
    """A member of the view that no process runs: the tests speak for it.
    It joins, answers its first roll call, and ends its session with a
    message the replica refuses, which (unlike a broken stream) does not make
    the leader suspect it. A test may then open sessions as the puppet
    without a process reconnecting behind its back; the replica's relaxed
    detector (``PUPPET_SETTINGS``) lets it stay silent in between. Returns
    its id and its member secret."""
    md = token_metadata(plane.token)
    async with grpc.aio.insecure_channel(plane.addresses[0]) as channel:
        stub = pb_grpc.RendezvousStub(channel)
        joined = await stub.Join(
            pb.JoinRequest(
                job=plane.job, address=ADDRESS, name="puppet", fingerprint=PUPPET_FINGERPRINT
            ),
            metadata=md,
            timeout=CALL_TIMEOUT,
        )
        call = stub.Session(metadata=md, timeout=30)
        puppet, secret = joined.member_id, joined.member_secret
        await call.write(
            pb.SessionRequest(
                open=pb.Open(
                    job=plane.job, member_id=puppet, epoch=joined.view.epoch, member_secret=secret
                )
            )
        )
        while True:
            event = await call.read()
            assert event is not grpc.aio.EOF, "session ended before the puppet entered the view"
            if event.HasField("roll_call"):
                answer = pb.RollCallAnswer(epoch=event.roll_call.epoch)
                await call.write(pb.SessionRequest(answer=answer))
            elif event.HasField("view") and puppet in {m.id for m in event.view.members}:
                break
        await call.write(pb.SessionRequest())
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await drain(call)
        assert refused.value.code() == Code.INVALID_ARGUMENT, refused.value.details()
        return puppet, secret


async def publish_checkpoint(
    plane: ControlPlane, store: EtcdStore, member: MemberProcess, step: int
) -> None:
    """Publish a checkpoint of ``step``, recording that much progress first
    (a checkpoint beyond the job's progress is refused)."""
    md = token_metadata(plane.token)
    member_id = member.member_id
    async with grpc.aio.insecure_channel(plane.addresses[0]) as channel:
        stub = pb_grpc.RendezvousStub(channel)
        epoch = (await stub.Status(pb.StatusRequest(job=plane.job), metadata=md)).view.epoch
        store.write_progress(epoch, step)
        target = Target(
            plane.job, (member_id,), None, epoch, frozenset(), {member_id: member.secret}
        )
        response = await stub.PublishCheckpoint(
            publish(member_id, step=step)(target), metadata=md, timeout=CALL_TIMEOUT
        )
        assert response.accepted


@contextmanager
def running_job(workdir: Path) -> Iterator[Job]:
    """A job of two member processes and a puppet, with a published
    checkpoint, on its own etcd and replica."""
    with LocalEtcd() as etcd:
        plane = ControlPlane([etcd.endpoint], workdir, settings=PUPPET_SETTINGS)
        try:
            processes = add_two_members(plane)
            puppet, secret = asyncio.run(enlist_puppet(plane))
            members = tuple(p.member_id for p in processes)
            secrets = {p.member_id: p.secret for p in processes} | {puppet: secret}
            with EtcdStore([etcd.endpoint], plane.job, Config()) as store:
                asyncio.run(publish_checkpoint(plane, store, processes[0], CHECKPOINT_STEP))
                job = Job(plane, store, members, puppet, secrets)
                settled_target(job)
                yield job
        finally:
            plane.close()


def unchanging_job(workdir: Path) -> Iterator[Job]:
    """``running_job`` for cases that must change nothing (so they may share
    it), checked to report the same view at the end."""
    with running_job(workdir) as job:
        before = reported_view(job)
        yield job
        assert reported_view(job) == before, "the job reports another view"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    yield from unchanging_job(tmp_path_factory.mktemp("bad-input"))


@pytest.fixture
def own_job(control_plane: ControlPlane, etcd: LocalEtcd) -> Iterator[Job]:
    """A job of its own (default detector, no puppet), for tests that change it."""
    processes = add_two_members(control_plane)
    members = tuple(p.member_id for p in processes)
    secrets = {p.member_id: p.secret for p in processes}
    with EtcdStore([etcd.endpoint], control_plane.job, Config()) as store:
        yield Job(control_plane, store, members, secrets=secrets)


@pytest.fixture
def puppet_job(tmp_path: Path) -> Iterator[Job]:
    """A job with a puppet of its own, for tests that may change it."""
    with running_job(tmp_path) as job:
        yield job


# --- talking to the replica -------------------------------------------------------


async def status(channel: grpc.aio.Channel, job: Job) -> pb.StatusResponse:
    return await pb_grpc.RendezvousStub(channel).Status(
        pb.StatusRequest(job=job.name), metadata=token_metadata(job.plane.token), timeout=5
    )


def job_state(job: Job, status_response: pb.StatusResponse) -> JobState:
    etcd = {k: v for k, v in job.store.snapshot().items() if not k.endswith("/progress")}
    return JobState(etcd, status_response)


def reported_view(job: Job) -> dict[str, Any]:
    """The view as `rollcall status --json` reports it."""
    reported = job.plane.status_json()
    return {key: reported[key] for key in ("epoch", "members", "leader", "rollcall_epoch")}


def current_status(job: Job) -> pb.StatusResponse:
    async def ask() -> pb.StatusResponse:
        async with grpc.aio.insecure_channel(job.address) as channel:
            return await status(channel, job)

    return asyncio.run(ask())


def settled_target(job: Job) -> Target:
    """The job's current view, once no roll call is running."""
    deadline = time.monotonic() + CALL_TIMEOUT
    while True:
        response = current_status(job)
        if response.rollcall_epoch == 0 or time.monotonic() > deadline:
            in_view = frozenset(m.id for m in response.view.members)
            return Target(
                job.name, job.members, job.puppet, response.view.epoch, in_view, job.secrets
            )
        time.sleep(0.05)


def assert_refused(
    job: Job,
    rpc: str | Method,
    request: Any,
    codes: Collection[Code],
    says: str = "",
    token: str = "right",
) -> None:
    """Send one request (a method's name or a ``Method``) and check that the
    replica refuses it with one of ``codes`` and a message containing
    ``says``, that it still serves (``Status``) and that the job is the same
    after it as before: in etcd and in ``Status`` (view, leader, step, roll
    call, checkpoints)."""
    method = RENDEZVOUS[rpc] if isinstance(rpc, str) else rpc

    async def exchange() -> tuple[grpc.aio.AioRpcError | None, JobState, JobState]:
        async with grpc.aio.insecure_channel(job.address) as channel:
            before = job_state(job, await status(channel, job))
            try:
                await send(channel, method, request, token_for(token, job.plane.token))
                error = None
            except grpc.aio.AioRpcError as rpc_error:
                error = rpc_error
            await asyncio.sleep(SETTLE)
            return error, before, job_state(job, await status(channel, job))

    error, before, after = asyncio.run(exchange())
    assert_refusal(error, request, codes, says)
    assert after == before, f"refused with {error.code()}, but changed"
    assert job.plane.replicas[0].proc.poll() is None, "the replica died"


def assert_refused_with_a_documented_code(job: Job, rpc: str, request: Any) -> None:
    assert_refused(job, rpc, request, DOCUMENTED_REJECTIONS)


# --- requests -------------------------------------------------------------------------

Build = Callable[[Target], Any]


def member(t: Target, who: str | int | None) -> str:
    """``who``: an index into the member processes, an id, or (None) the puppet."""
    if who is None:
        assert t.puppet is not None, "this job has no puppet"
        return t.puppet
    return t.members[who] if isinstance(who, int) else who


def join(
    job: str | None = None,
    address: str = ADDRESS,
    name: str = "intruder",
    fingerprint: dict[str, str] | None = None,
) -> Build:
    return lambda t: pb.JoinRequest(
        job=t.job if job is None else job, address=address, name=name, fingerprint=fingerprint
    )


def secret_for(t: Target, who: str, secret: str | int | None) -> str:
    """``secret``: a text, the secret of member ``secret`` (an index into the
    member processes), or (None) ``who``'s own."""
    if secret is None:
        return t.secret_of(who)
    return t.secret_of(t.members[secret]) if isinstance(secret, int) else secret


def leave(
    who: str | int = 0,
    epoch: int | None = None,
    job: str | None = None,
    secret: str | int | None = None,
) -> Build:
    """Leave as ``who`` at ``epoch`` (default: the current one), with
    ``secret`` (default: ``who``'s own)."""
    return lambda t: pb.LeaveRequest(
        job=t.job if job is None else job,
        member_id=member(t, who),
        epoch=t.epoch if epoch is None else epoch,
        member_secret=secret_for(t, member(t, who), secret),
    )


def open_(
    t: Target,
    who: str | int | None = None,
    epoch: int | None = None,
    job: str | None = None,
    secret: str | int | None = None,
) -> pb.SessionRequest:
    """Open a session as ``who`` (default: the puppet), with ``secret``
    (default: ``who``'s own)."""
    return pb.SessionRequest(
        open=pb.Open(
            job=t.job if job is None else job,
            member_id=member(t, who),
            epoch=t.epoch if epoch is None else epoch,
            member_secret=secret_for(t, member(t, who), secret),
        )
    )


def session(*messages: Callable[[Target], pb.SessionRequest | bytes]) -> Build:
    return lambda t: [message(t) for message in messages]


def after_open(build: Callable[[Target], pb.SessionRequest | bytes]) -> Build:
    """A session of the puppet with ``build``'s message after its Open."""
    return session(open_, build)


def status_request(job: str | None = None) -> Build:
    return lambda t: pb.StatusRequest(job=t.job if job is None else job)


def watch(job: str | None = None, after_epoch: int = 0) -> Build:
    return lambda t: pb.WatchRequest(job=t.job if job is None else job, after_epoch=after_epoch)


def publish(
    who: str | int = 0,
    epoch: int | None = None,
    job: str | None = None,
    checkpoint_epoch: int | None = None,
    secret: str | int | None = None,
    **changes: Any,
) -> Build:
    """PublishCheckpoint as ``who`` at ``epoch`` with ``secret`` (default:
    ``who``'s own), the manifest's fields overridden by ``changes`` (its
    epoch by ``checkpoint_epoch``)."""

    def build(t: Target) -> pb.PublishCheckpointRequest:
        fields: dict[str, Any] = {
            "step": 3, "digest": "sha256:ab", "uri": "/tmp/rollcall-ckpt", "size": 10,
            "sha256": "0" * 64, "writer": "w-1", "created_unix": 1.0,
            "epoch": t.epoch if checkpoint_epoch is None else checkpoint_epoch,
            "step_seconds": 0.05,
        }  # fmt: skip
        fields.update(changes)
        return pb.PublishCheckpointRequest(
            job=t.job if job is None else job,
            member_id=member(t, who),
            epoch=t.epoch if epoch is None else epoch,
            checkpoint=pb.Checkpoint(**fields),
            member_secret=secret_for(t, member(t, who), secret),
        )

    return build


def forget(
    steps: Collection[int] = (CHECKPOINT_STEP,), everything: bool = False, job: str | None = None
) -> Build:
    """ForgetCheckpoints of ``steps`` (or ``everything``)."""
    return lambda t: pb.ForgetCheckpointsRequest(
        job=t.job if job is None else job, steps=list(steps), all=everything
    )


def checkpoint_failure(
    epoch: int | None = None, step: int = CHECKPOINT_STEP + 5, reason: str = "disk full"
) -> Build:
    return lambda t: pb.SessionRequest(
        checkpoint_failure=pb.CheckpointFailure(
            epoch=t.epoch if epoch is None else epoch, step=step, reason=reason
        )
    )


def heartbeat(epoch: int | None = None, sent_at: float = 1.0) -> Callable[[Target], Any]:
    return lambda t: pb.SessionRequest(
        heartbeat=pb.Heartbeat(epoch=t.epoch if epoch is None else epoch, sent_at=sent_at)
    )


def answer(epoch: int | None = None, step: int | None = None, digest: str = "") -> Build:
    """A roll-call answer (default: for the roll call that made the view)."""
    return lambda t: pb.SessionRequest(
        answer=pb.RollCallAnswer(
            epoch=t.epoch if epoch is None else epoch, step=step, digest=digest
        )
    )


def report(peer: str | int = 0, epoch: int | None = None, reason: str = "reset") -> Build:
    return lambda t: pb.SessionRequest(
        failure=pb.FailureReport(
            epoch=t.epoch if epoch is None else epoch, peer_id=member(t, peer), reason=reason
        )
    )


def view_report(epoch: int | None = None, **durations: float) -> Build:
    return lambda t: pb.SessionRequest(
        view_report=pb.ViewReport(epoch=t.epoch if epoch is None else epoch, **durations)
    )


@dataclass(frozen=True)
class Case:
    rpc: str
    request: Build
    code: grpc.StatusCode
    says: str
    token: str = "right"


#: Requests that would be accepted with the right token.
VALID = {
    "Join": join(),
    "Leave": leave(),
    "Status": status_request(),
    "Watch": watch(),
    "Session": session(open_),
    "PublishCheckpoint": publish(),
    "ForgetCheckpoints": forget(),
}
assert VALID.keys() == RENDEZVOUS.keys(), "a method without hostile cases"


def undecodable(rpc: str) -> Build:
    """Bytes that are no message, in place of ``rpc``'s request."""
    return lambda t: [UNDECODABLE] if RENDEZVOUS[rpc].request_streaming else UNDECODABLE


CASES = {
    **{
        f"{token} token on {rpc}": Case(
            rpc, request, Code.UNAUTHENTICATED, "missing or wrong job token", token
        )
        for rpc, request in VALID.items()
        for token in ("wrong", "missing")
    },
    # Bytes that do not decode: refused like any malformed request (gRPC
    # alone would answer UNKNOWN), after the token check.
    **{
        f"undecodable {rpc}": Case(
            rpc, undecodable(rpc), Code.INVALID_ARGUMENT, "undecodable request"
        )
        for rpc in RENDEZVOUS
    },
    **{
        f"undecodable {rpc} with a wrong token": Case(
            rpc, undecodable(rpc), Code.UNAUTHENTICATED, "missing or wrong job token", "wrong"
        )
        for rpc in RENDEZVOUS
    },
    "undecodable message after Open": Case(
        "Session", after_open(lambda t: UNDECODABLE), Code.INVALID_ARGUMENT, "undecodable request"
    ),
    # Malformed fields.
    "job name charset on Join": Case(
        "Join", join(job="job 1!"), Code.INVALID_ARGUMENT, "job 'job 1!' has characters outside"
    ),
    "job name charset on Status": Case(
        "Status", status_request("jöb"), Code.INVALID_ARGUMENT, "has characters outside"
    ),
    "job name charset on Watch": Case(
        "Watch", watch("a/b"), Code.INVALID_ARGUMENT, "has characters outside"
    ),
    "empty address": Case("Join", join(address=""), Code.INVALID_ARGUMENT, "address is empty"),
    "address without port": Case(
        "Join", join(address="127.0.0.1"), Code.INVALID_ARGUMENT, "is not host:port"
    ),
    "address port 0": Case(
        "Join", join(address="127.0.0.1:0"), Code.INVALID_ARGUMENT, "has no valid port"
    ),
    "address port too large": Case(
        "Join", join(address="127.0.0.1:65536"), Code.INVALID_ARGUMENT, "has no valid port"
    ),
    "address port in superscript digits": Case(
        "Join", join(address="127.0.0.1:\u00b2"), Code.INVALID_ARGUMENT, "has no valid port"
    ),
    "address port in Arabic-Indic digits": Case(
        "Join",
        join(address="127.0.0.1:\u0662\u0669\u0665\u0660\u0660"),
        Code.INVALID_ARGUMENT,
        "has no valid port",
    ),
    "address with a bad host": Case(
        "Join", join(address="no host:80"), Code.INVALID_ARGUMENT, "has an invalid host"
    ),
    "name charset": Case(
        "Join", join(name="two words"), Code.INVALID_ARGUMENT, "name 'two words' has characters"
    ),
    "overlong name": Case(
        "Join", join(name="n" * 65), Code.INVALID_ARGUMENT, "name is longer than 64 characters"
    ),
    "fingerprint with too many fields": Case(
        "Join",
        join(fingerprint={f"f{i}": "1" for i in range(33)}),
        Code.INVALID_ARGUMENT,
        "fingerprint has 33 fields, more than 32",
    ),
    "fingerprint field name with odd characters": Case(
        "Join",
        join(fingerprint={"Global Batch": "48"}),
        Code.INVALID_ARGUMENT,
        "fingerprint field name 'Global Batch' is not 1-32 characters of [a-z0-9_]",
    ),
    "overlong fingerprint field name": Case(
        "Join",
        join(fingerprint={"f" * 33: "48"}),
        Code.INVALID_ARGUMENT,
        "is not 1-32 characters",
    ),
    "overlong fingerprint value": Case(
        "Join",
        join(fingerprint={"seed": "1" * 257}),
        Code.INVALID_ARGUMENT,
        "fingerprint field seed is longer than 256 characters",
    ),
    "fingerprint value with a newline": Case(
        "Join",
        join(fingerprint={"seed": "0\n"}),
        Code.INVALID_ARGUMENT,
        "fingerprint field seed has characters outside printable ASCII",
    ),
    "fingerprint value outside ASCII": Case(
        "Join",
        join(fingerprint={"seed": "\u00e9"}),
        Code.INVALID_ARGUMENT,
        "fingerprint field seed has characters outside printable ASCII",
    ),
    "fingerprint of another configuration": Case(
        "Join",
        join(fingerprint={**PUPPET_FINGERPRINT, "global_batch": "96"}),
        Code.FAILED_PRECONDITION,
        "this worker's global_batch is 96 but job job1's is 48: every worker of a job",
    ),
    "fingerprint missing a field of the job's": Case(
        "Join",
        join(fingerprint={"global_batch": "48", "micro_batch": "8"}),
        Code.FAILED_PRECONDITION,
        "this worker's seed is unset but job job1's is 0",
    ),
    "overlong member id on Leave": Case(
        "Leave", leave("m" * 65), Code.INVALID_ARGUMENT, "member_id is longer than 64 characters"
    ),
    "overlong member id on Open": Case(
        "Session",
        session(lambda t: open_(t, "m" * 65)),
        Code.INVALID_ARGUMENT,
        "member_id is longer than 64 characters",
    ),
    "session starting with a heartbeat": Case(
        "Session",
        session(heartbeat()),
        Code.INVALID_ARGUMENT,
        "must start with an Open message",
    ),
    "session starting with an empty message": Case(
        "Session",
        session(lambda t: pb.SessionRequest()),
        Code.INVALID_ARGUMENT,
        "must start with an Open message",
    ),
    "session starting with a roll-call answer": Case(
        "Session", session(answer()), Code.INVALID_ARGUMENT, "must start with an Open message"
    ),
    "Open twice": Case("Session", session(open_, open_), Code.INVALID_ARGUMENT, "Open sent twice"),
    "empty message after Open": Case(
        "Session",
        after_open(lambda t: pb.SessionRequest()),
        Code.INVALID_ARGUMENT,
        "empty session message",
    ),
    "digest with bad characters": Case(
        "Session",
        after_open(answer(digest="sha256 <bad>")),
        Code.INVALID_ARGUMENT,
        "digest has characters outside",
    ),
    "overlong digest in a roll-call answer": Case(
        "Session",
        after_open(answer(digest="a" * 129)),
        Code.INVALID_ARGUMENT,
        "digest is longer than 128 characters",
    ),
    "roll-call answer with a step beyond int64": Case(
        "Session", after_open(answer(step=2**63)), Code.INVALID_ARGUMENT, "out of range"
    ),
    "roll-call answer with an epoch beyond int64": Case(
        "Session", after_open(answer(epoch=2**64 - 1)), Code.INVALID_ARGUMENT, "out of range"
    ),
    "progress with a step beyond int64": Case(
        "Session",
        after_open(lambda t: pb.SessionRequest(progress=pb.Progress(epoch=t.epoch, step=2**63))),
        Code.INVALID_ARGUMENT,
        "step 9223372036854775808 is out of range",
    ),
    "progress from a future epoch": Case(
        "Session",
        after_open(lambda t: pb.SessionRequest(progress=pb.Progress(epoch=t.epoch + 1, step=1))),
        Code.INVALID_ARGUMENT,
        "is ahead of the committed epoch",
    ),
    "heartbeat from a future epoch": Case(
        "Session",
        after_open(lambda t: heartbeat(t.epoch + 1)(t)),
        Code.INVALID_ARGUMENT,
        "is ahead of the committed epoch",
    ),
    "heartbeat with a NaN send time": Case(
        "Session",
        after_open(heartbeat(sent_at=float("nan"))),
        Code.INVALID_ARGUMENT,
        "heartbeat sent_at must be a finite",
    ),
    "heartbeat with an infinite send time": Case(
        "Session",
        after_open(heartbeat(sent_at=float("inf"))),
        Code.INVALID_ARGUMENT,
        "heartbeat sent_at must be a finite",
    ),
    "heartbeat with a negative send time": Case(
        "Session",
        after_open(heartbeat(sent_at=-1.0)),
        Code.INVALID_ARGUMENT,
        "heartbeat sent_at must be a finite",
    ),
    "failure report naming a malformed peer": Case(
        "Session", after_open(report("peer one")), Code.INVALID_ARGUMENT, "peer_id 'peer one'"
    ),
    "failure report with an overlong reason": Case(
        "Session",
        after_open(report(reason="r" * 257)),
        Code.INVALID_ARGUMENT,
        "reason is longer than 256 characters",
    ),
    "failure report from a future epoch": Case(
        "Session",
        after_open(lambda t: report(epoch=t.epoch + 1)(t)),
        Code.INVALID_ARGUMENT,
        "is ahead of the committed epoch",
    ),
    "view report with a negative duration": Case(
        "Session",
        after_open(view_report(fetch_s=-1.0)),
        Code.INVALID_ARGUMENT,
        "view report fetch_s must be a finite",
    ),
    "view report with a NaN duration": Case(
        "Session",
        after_open(view_report(step_s=float("nan"))),
        Code.INVALID_ARGUMENT,
        "view report step_s must be a finite",
    ),
    "view report with an infinite duration": Case(
        "Session",
        after_open(view_report(launch_s=float("inf"))),
        Code.INVALID_ARGUMENT,
        "view report launch_s must be a finite",
    ),
    "view report with an absurdly long duration": Case(
        "Session",
        after_open(view_report(rebuild_s=1e6)),
        Code.INVALID_ARGUMENT,
        "view report rebuild_s must be less than 1e+06 seconds",
    ),
    # Harmless messages, then a refused one: nothing changes either.
    "replayed roll-call answer, then garbage": Case(
        "Session",
        session(open_, answer(step=5, digest="sha256:ab"), lambda t: UNDECODABLE),
        Code.INVALID_ARGUMENT,
        "undecodable request",
    ),
    "answer for a roll call not yet held, then garbage": Case(
        "Session",
        session(open_, lambda t: answer(t.epoch + 1)(t), lambda t: UNDECODABLE),
        Code.INVALID_ARGUMENT,
        "undecodable request",
    ),
    "messages of an old epoch, then garbage": Case(
        "Session",
        session(
            lambda t: open_(t, epoch=t.epoch - 1),
            lambda t: heartbeat(t.epoch - 1)(t),
            lambda t: report(0, epoch=t.epoch - 1)(t),
            lambda t: pb.SessionRequest(progress=pb.Progress(epoch=t.epoch - 1, step=1)),
            lambda t: UNDECODABLE,
        ),
        Code.INVALID_ARGUMENT,
        "undecodable request",
    ),
    "epoch from the future on Leave": Case(
        "Leave", leave(epoch=1_000), Code.INVALID_ARGUMENT, "epoch 1000 is ahead of the committed"
    ),
    "epoch from the future on Open": Case(
        "Session",
        session(lambda t: open_(t, epoch=1_000)),
        Code.INVALID_ARGUMENT,
        "epoch 1000 is ahead of the committed",
    ),
    # A member the leader never saw, ahead of a view whose members are live:
    # what a worker of a view etcd lost would send, but nothing here says
    # etcd lost anything, so the claim is refused and not recorded.
    "an unknown member ahead of a live view on Leave": Case(
        "Leave",
        leave("ghost-0", epoch=227_049_656, secret=""),
        Code.FAILED_PRECONDITION,
        "member ghost-0 is at epoch 227049656",
    ),
    "an unknown member ahead of a live view on Open": Case(
        "Session",
        session(lambda t: open_(t, "ghost-0", epoch=2**62, secret="")),
        Code.FAILED_PRECONDITION,
        f"member ghost-0 is at epoch {2**62}",
    ),
    "epoch beyond int64 on Leave": Case(
        "Leave", leave(epoch=2**64 - 1), Code.INVALID_ARGUMENT, "out of range"
    ),
    "after_epoch beyond int64 on Watch": Case(
        "Watch", watch(after_epoch=2**64 - 1), Code.INVALID_ARGUMENT, "out of range"
    ),
    # Oversized.
    "oversized Join": Case("Join", join(name=HUGE), Code.RESOURCE_EXHAUSTED, "larger than max"),
    "oversized fingerprint": Case(
        "Join", join(fingerprint={"seed": HUGE}), Code.RESOURCE_EXHAUSTED, "larger than max"
    ),
    "oversized Leave": Case("Leave", leave(HUGE), Code.RESOURCE_EXHAUSTED, "larger than max"),
    "oversized Status": Case(
        "Status", status_request(HUGE), Code.RESOURCE_EXHAUSTED, "larger than max"
    ),
    "oversized Watch": Case("Watch", watch(HUGE), Code.RESOURCE_EXHAUSTED, "larger than max"),
    "oversized Open": Case(
        "Session", session(lambda t: open_(t, HUGE)), Code.RESOURCE_EXHAUSTED, "larger than max"
    ),
    # A member's id without its secret: not that member's request.
    **{
        f"{rpc} {what}": Case(rpc, build, Code.PERMISSION_DENIED, "without its member secret")
        for what, secret in [
            ("without the member's secret", ""),
            ("with another member's secret", 1),
            ("with a malformed secret", "not hex"),
            ("with a well-formed wrong secret", "0" * 64),
        ]
        for rpc, build in [
            ("Leave", leave(0, secret=secret)),
            ("Session", session(lambda t, secret=secret: open_(t, secret=secret))),
            ("PublishCheckpoint", publish(0, secret=secret)),
        ]
    },
    "the puppet's secret on member 0's Open": Case(
        "Session",
        session(lambda t: open_(t, 0, secret=t.secret_of(t.puppet or ""))),
        Code.PERMISSION_DENIED,
        "without its member secret",
    ),
    # Unknown or departed members, unknown job.
    "unknown member on Leave": Case(
        "Leave", leave("ghost-0"), Code.NOT_FOUND, "'ghost-0' is not a member of job"
    ),
    "unknown member on Open": Case(
        "Session",
        session(lambda t: open_(t, "ghost-0")),
        Code.NOT_FOUND,
        "'ghost-0' is not a member of job",
    ),
    "unknown member with an old epoch on Leave": Case(
        "Leave",
        lambda t: leave("ghost-0", epoch=t.epoch - 1)(t),
        Code.FAILED_PRECONDITION,
        "is stale: member ghost-0 is not in view",
    ),
    "unknown member with an old epoch on Open": Case(
        "Session",
        session(lambda t: open_(t, "ghost-0", epoch=t.epoch - 1)),
        Code.FAILED_PRECONDITION,
        "is stale: member ghost-0 is not in view",
    ),
    "wrong job on Status": Case("Status", status_request("job2"), Code.NOT_FOUND, "no such job"),
    "wrong job on Join": Case("Join", join(job="job2"), Code.NOT_FOUND, "no such job"),
    "wrong job on Leave": Case("Leave", leave(job="job2"), Code.NOT_FOUND, "no such job"),
    "wrong job on Watch": Case("Watch", watch(job="job2"), Code.NOT_FOUND, "no such job"),
    "wrong job on Open": Case(
        "Session", session(lambda t: open_(t, job="job2")), Code.NOT_FOUND, "no such job"
    ),
    # Checkpoint manifests.
    "checkpoint with an empty uri": Case(
        "PublishCheckpoint", publish(uri=""), Code.INVALID_ARGUMENT, "checkpoint uri must be"
    ),
    "checkpoint uri with a NUL": Case(
        "PublishCheckpoint", publish(uri="/a\x00b"), Code.INVALID_ARGUMENT, "without NUL"
    ),
    "checkpoint with a bad sha256": Case(
        "PublishCheckpoint", publish(sha256="xyz"), Code.INVALID_ARGUMENT, "64 lowercase hex"
    ),
    "checkpoint of zero bytes": Case(
        "PublishCheckpoint", publish(size=0), Code.INVALID_ARGUMENT, "size must be positive"
    ),
    "checkpoint digest with bad characters": Case(
        "PublishCheckpoint",
        publish(digest="sha256 <bad>"),
        Code.INVALID_ARGUMENT,
        "digest has characters outside",
    ),
    "checkpoint with an empty digest": Case(
        "PublishCheckpoint", publish(digest=""), Code.INVALID_ARGUMENT, "digest is empty"
    ),
    "checkpoint parts missing a partition": Case(
        "PublishCheckpoint",
        publish(parts=[pb.CheckpointPart(uri="/p1", size=1, sha256="0" * 64, partitions=[0],
                                         digests=["sha256:a"]),
                       pb.CheckpointPart(uri="/p2", size=1, sha256="0" * 64, partitions=[2],
                                         digests=["sha256:b"])]),
        Code.INVALID_ARGUMENT,
        "parts must hold partitions 0..n-1",
    ),  # fmt: skip
    "checkpoint part digest with bad characters": Case(
        "PublishCheckpoint",
        publish(parts=[pb.CheckpointPart(uri="/p1", size=1, sha256="0" * 64, partitions=[0],
                                         digests=["sha256 <bad>"])]),
        Code.INVALID_ARGUMENT,
        "digest has characters outside",
    ),  # fmt: skip
    "checkpoint writer with bad characters": Case(
        "PublishCheckpoint",
        publish(writer="w 1"),
        Code.INVALID_ARGUMENT,
        "checkpoint writer 'w 1' has characters",
    ),
    "checkpoint step beyond int64": Case(
        "PublishCheckpoint", publish(step=2**64 - 1), Code.INVALID_ARGUMENT, "out of range"
    ),
    "checkpoint with a NaN step time": Case(
        "PublishCheckpoint",
        publish(step_seconds=float("nan")),
        Code.INVALID_ARGUMENT,
        "checkpoint times must be finite, non-negative",
    ),
    "checkpoint with an infinite step time": Case(
        "PublishCheckpoint",
        publish(step_seconds=float("inf")),
        Code.INVALID_ARGUMENT,
        "checkpoint times must be finite, non-negative",
    ),
    "checkpoint with an infinite creation time": Case(
        "PublishCheckpoint",
        publish(created_unix=float("inf")),
        Code.INVALID_ARGUMENT,
        "checkpoint times must be finite, non-negative",
    ),
    "checkpoint from a future view": Case(
        "PublishCheckpoint",
        publish(checkpoint_epoch=1_000),
        Code.INVALID_ARGUMENT,
        "checkpoint epoch 1000 is ahead",
    ),
    "checkpoint sent with a future epoch": Case(
        "PublishCheckpoint",
        publish(epoch=1_000),
        Code.INVALID_ARGUMENT,
        "epoch 1000 is ahead of the committed",
    ),
    "checkpoint sent with an old epoch": Case(
        "PublishCheckpoint",
        lambda t: publish(epoch=max(0, t.epoch - 1))(t),
        Code.FAILED_PRECONDITION,
        "only members of the current view publish checkpoints",
    ),
    "checkpoint from an unknown member": Case(
        "PublishCheckpoint", publish("ghost-0"), Code.NOT_FOUND, "'ghost-0' is not a member"
    ),
    "checkpoint for the wrong job": Case(
        "PublishCheckpoint", publish(job="job2"), Code.NOT_FOUND, "no such job"
    ),
    "oversized checkpoint manifest": Case(
        "PublishCheckpoint", publish(uri=HUGE), Code.RESOURCE_EXHAUSTED, "larger than max"
    ),
    "checkpoint beyond the job's progress": Case(
        "PublishCheckpoint",
        publish(step=CHECKPOINT_STEP + 2),
        Code.INVALID_ARGUMENT,
        f"checkpoint of step {CHECKPOINT_STEP + 2} is beyond the job's progress",
    ),
    "checkpoint of step 10^12": Case(
        "PublishCheckpoint", publish(step=10**12), Code.INVALID_ARGUMENT, "beyond the job's"
    ),
    # Checkpoint failures (session) and the record's repair (operators).
    "checkpoint failure with an overlong reason": Case(
        "Session",
        after_open(checkpoint_failure(reason="r" * 257)),
        Code.INVALID_ARGUMENT,
        "checkpoint failure reason is longer than 256",
    ),
    "checkpoint failure of a step beyond int64": Case(
        "Session", after_open(checkpoint_failure(step=2**63)), Code.INVALID_ARGUMENT, "out of range"
    ),
    "checkpoint failure from a future epoch": Case(
        "Session",
        after_open(lambda t: checkpoint_failure(epoch=t.epoch + 1)(t)),
        Code.INVALID_ARGUMENT,
        "is ahead of the committed epoch",
    ),
    "forget neither steps nor all": Case(
        "ForgetCheckpoints", forget(()), Code.INVALID_ARGUMENT, "name the steps"
    ),
    "forget steps and all": Case(
        "ForgetCheckpoints", forget(everything=True), Code.INVALID_ARGUMENT, "name the steps"
    ),
    "forget a step not recorded": Case(
        "ForgetCheckpoints",
        forget((CHECKPOINT_STEP, 7)),
        Code.NOT_FOUND,
        "no checkpoint of step 7 is recorded",
    ),
    "forget a step beyond int64": Case(
        "ForgetCheckpoints", forget((2**64 - 1,)), Code.INVALID_ARGUMENT, "out of range"
    ),
    "forget for the wrong job": Case(
        "ForgetCheckpoints", forget(job="job2"), Code.NOT_FOUND, "no such job"
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_request_is_refused_with_its_code_and_changes_nothing(job: Job, case: Case) -> None:
    request = case.request(settled_target(job))
    assert_refused(job, case.rpc, request, {case.code}, case.says, case.token)


def test_a_join_of_another_configuration_names_its_error_in_trailing_metadata(job: Job) -> None:
    request = join(fingerprint={**PUPPET_FINGERPRINT, "seed": "1"})(settled_target(job))

    async def refusal() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(job.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await send(channel, RENDEZVOUS["Join"], request, token_metadata(job.plane.token))
            return refused.value

    error = asyncio.run(refusal())
    assert error.code() == Code.FAILED_PRECONDITION
    assert ("rollcall-error", "ConfigurationMismatch") in tuple(error.trailing_metadata() or ())
    assert error_from_rpc(error).__class__ is ConfigurationMismatch


def test_a_method_the_service_lacks_is_unimplemented(job: Job) -> None:
    missing = Method("/rollcall.v1.Rendezvous/Reset", pb.StatusRequest, False, False)
    request = status_request()(settled_target(job))
    assert_refused(job, missing, request, {Code.UNIMPLEMENTED}, "Method not found")


def test_an_oversized_message_on_an_open_session_changes_nothing(puppet_job: Job) -> None:
    big = report(reason=HUGE)
    request = after_open(big)(settled_target(puppet_job))
    assert_refused(puppet_job, "Session", request, {Code.RESOURCE_EXHAUSTED}, "larger than max")


def test_watch_from_a_future_epoch_waits_instead_of_refusing(job: Job) -> None:
    """Not refused: a client failing over to a replica that has not seen
    its last view yet must not be turned away. The stream sends nothing
    until a view with a larger epoch exists."""
    ahead = settled_target(job).epoch + 5

    async def watch_briefly() -> tuple[list[pb.View], grpc.aio.AioRpcError]:
        async with grpc.aio.insecure_channel(job.address) as channel:
            call = pb_grpc.RendezvousStub(channel).Watch(
                pb.WatchRequest(job=job.name, after_epoch=ahead),
                metadata=token_metadata(job.plane.token),
                timeout=0.5,
            )
            views = []
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for view in call:
                    views.append(view)
            return views, ended.value

    before = job_state(job, current_status(job))
    views, ended = asyncio.run(watch_briefly())
    assert views == [] and ended.code() == Code.DEADLINE_EXCEEDED, ended.details()
    assert job_state(job, current_status(job)) == before


@pytest.mark.parametrize("replayed", ["the newest", "an older step", "the newest step, changed"])
def test_a_replayed_checkpoint_changes_nothing(job: Job, replayed: str) -> None:
    """Publishing is idempotent: a retry of the newest manifest (its answer
    lost) is answered ``accepted``; anything not newer is not accepted."""
    t = settled_target(job)
    before = job_state(job, current_status(job))
    newest = before.status.checkpoints[0]
    manifest = pb.Checkpoint()
    manifest.CopyFrom(newest)
    if replayed == "an older step":
        manifest.step = newest.step - 1
    elif replayed == "the newest step, changed":
        manifest.uri = newest.uri + ".other"
    request = pb.PublishCheckpointRequest(
        job=t.job, member_id=t.members[0], epoch=t.epoch, checkpoint=manifest,
        member_secret=t.secret_of(t.members[0]),
    )  # fmt: skip

    async def republish() -> pb.PublishCheckpointResponse:
        async with grpc.aio.insecure_channel(job.address) as channel:
            return await pb_grpc.RendezvousStub(channel).PublishCheckpoint(
                request, metadata=token_metadata(job.plane.token), timeout=CALL_TIMEOUT
            )

    response = asyncio.run(republish())
    assert response.accepted == (replayed == "the newest")
    assert list(response.checkpoints) == list(before.status.checkpoints)
    assert job_state(job, current_status(job)) == before


@pytest.mark.parametrize("departure", ["leave", "kill"])
def test_old_member_with_its_old_epoch_is_refused_as_stale(own_job: Job, departure: str) -> None:
    old = settled_target(own_job)
    gone: MemberProcess = own_job.plane.members[0]
    if departure == "leave":
        gone.stop()
    else:
        gone.kill()
    survivor = own_job.plane.members[1]
    survivor.wait_event(lambda e: e["event"] == "view" and e["members"] == [own_job.members[1]], 30)
    assert settled_target(own_job).epoch > old.epoch

    for rpc, request in [("Leave", leave(0)(old)), ("Session", [open_(old, 0)])]:
        stale = f"epoch {old.epoch} is stale"
        assert_refused(own_job, rpc, request, {Code.FAILED_PRECONDITION}, stale)



def test_refused_claims_of_lost_etcd_data_are_logged_once_not_once_each(puppet_job: Job) -> None:
    """A token holder naming ids the leader never saw, ahead of a live view,
    is refused each time; the replica's log says so once for the lot, not
    once per request (a flood must not fill the leader's disk)."""
    target = settled_target(puppet_job)
    claims = 12
    for n in range(claims):
        request = leave(f"ghost-{n}", epoch=target.epoch + 1 + n, secret="")(target)
        assert_refused(puppet_job, "Leave", request, {Code.FAILED_PRECONDITION}, "is at epoch")
    replica_log = puppet_job.plane.replicas[0].log_path.read_text(errors="replace")
    lines = [line for line in replica_log.splitlines() if "not recorded as a loss" in line]
    assert len(lines) == 1, lines
    assert "ghost-0" in lines[0]


# --- a worker's state server -------------------------------------------------------------

#: The worker's job and view: it is ``SERVER``, rank 0, and ``PEER`` may pull from it.
STATE_JOB = "job1"
SERVER, PEER = "src", "peer"
STATE_VIEW = View(epoch=3, members=(Member(SERVER, "127.0.0.1:1"), Member(PEER, "127.0.0.1:2")))
STATE_TOKEN = "state-token"
#: The epoch secret of STATE_VIEW, which the server and PEER received.
STATE_SECRET = "ab" * 32
_DATA = bytes(range(256)) * 1200  # two chunks
SNAPSHOT = Snapshot(step=7, digest="sha256:" + hashlib.sha256(_DATA).hexdigest(), data=_DATA)


@dataclass
class Worker:
    """What a worker's state server did: the stores it hosted (GroupStore)."""

    own_id: str
    hosted: list[int] = field(default_factory=list)

    async def store_port(self, epoch: int) -> int:
        self.hosted.append(epoch)
        return 29400


@dataclass(frozen=True)
class Served:
    """What the server answers well-formed requests with, after the hostile one."""

    info: state_pb.StateInfo
    data: bytes
    hosted: tuple[int, ...]


#: What it answers before any hostile request.
UNTOUCHED = Served(state_pb.StateInfo(step=7, digest=SNAPSHOT.digest, size=len(_DATA)), _DATA, ())


def state_request(
    member_id: str = PEER,
    epoch: int = STATE_VIEW.epoch,
    job: str = STATE_JOB,
    epoch_secret: str = STATE_SECRET,
) -> state_pb.StateRequest:
    return state_pb.StateRequest(
        job=job, member_id=member_id, epoch=epoch, epoch_secret=epoch_secret
    )


def fetch_request(**changes: Any) -> state_pb.FetchRequest:
    """Fetch of the whole state by ``PEER``, with ``changes``."""
    fields: dict[str, Any] = {
        "job": STATE_JOB, "member_id": PEER, "epoch": STATE_VIEW.epoch,
        "digest": SNAPSHOT.digest, "offset": 0, "length": len(_DATA),
        "epoch_secret": STATE_SECRET,
    }  # fmt: skip
    return state_pb.FetchRequest(**{**fields, **changes})


def partition_request(**changes: Any) -> state_pb.PartitionRequest:
    """``PEER`` asking for partition 0 of step 7, with ``changes``."""
    fields: dict[str, Any] = {
        "job": STATE_JOB, "member_id": PEER, "epoch": STATE_VIEW.epoch,
        "epoch_secret": STATE_SECRET, "partition": 0, "step": 7,
    }  # fmt: skip
    return state_pb.PartitionRequest(**{**fields, **changes})


async def served(channel: grpc.aio.Channel, worker: Worker) -> Served:
    stub = state_pb_grpc.StateTransferStub(channel)
    md = token_metadata(STATE_TOKEN)
    info = await stub.Describe(state_request(), metadata=md, timeout=CALL_TIMEOUT)
    info.ClearField("data_port")  # where its data channel listens: not its state
    chunks = stub.Fetch(fetch_request(), metadata=md, timeout=CALL_TIMEOUT)
    data = b"".join([chunk.data async for chunk in chunks])
    return Served(info, data, tuple(worker.hosted))


def assert_state_refused(
    rpc: str,
    request: Any,
    codes: Collection[Code],
    says: str = "",
    token: str = "right",
    own_id: str = SERVER,
) -> None:
    """Send one request to a worker's state server (a real ``StateServer``
    on a real gRPC server, set up as the worker runtime sets it up) and check
    that it is refused with one of ``codes`` and a message containing
    ``says``, that it hosted no store and still serves the same state."""
    worker = Worker(own_id)

    async def exchange() -> tuple[grpc.aio.AioRpcError | None, Served]:
        server = grpc.aio.server(interceptors=[TokenInterceptor(STATE_TOKEN)])
        servicer = StateServer(
            STATE_JOB, Config(), lambda: worker.own_id, lambda: STATE_VIEW,
            lambda: SNAPSHOT, worker.store_port,
            epoch_secret=lambda e: STATE_SECRET if e == STATE_VIEW.epoch else None,
        )  # fmt: skip
        state_pb_grpc.add_StateTransferServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                try:
                    await send(channel, STATE[rpc], request, token_for(token, STATE_TOKEN))
                    error = None
                except grpc.aio.AioRpcError as rpc_error:
                    error = rpc_error
                return error, await served(channel, worker)
        finally:
            servicer.close()
            await server.stop(0)

    error, after = asyncio.run(exchange())
    assert_refusal(error, request, codes, says)
    assert after == UNTOUCHED, f"refused with {error.code()}, but changed"


@dataclass(frozen=True)
class StateCase:
    rpc: str
    request: Any
    code: grpc.StatusCode
    says: str
    token: str = "right"
    own_id: str = SERVER


STATE_VALID = {
    "Describe": state_request(),
    "Fetch": fetch_request(),
    "GroupStore": state_request(),
    "FetchPartition": partition_request(),
}
assert STATE_VALID.keys() == STATE.keys(), "a method without hostile cases"
NOT_IN_VIEW = "is not in this worker's view"
NO_SECRET = "does not carry view 3's epoch secret"
DENIED = Code.PERMISSION_DENIED

STATE_CASES = {
    **{
        f"{token} token on {rpc}": StateCase(
            rpc, request, Code.UNAUTHENTICATED, "missing or wrong job token", token
        )
        for rpc, request in STATE_VALID.items()
        for token in ("wrong", "missing")
    },
    **{
        f"undecodable {rpc}": StateCase(
            rpc, UNDECODABLE, Code.INVALID_ARGUMENT, "undecodable request"
        )
        for rpc in STATE
    },
    **{
        f"oversized {rpc}": StateCase(
            rpc, state_request(member_id=HUGER), Code.RESOURCE_EXHAUSTED, "larger than max"
        )
        for rpc in ("Describe", "GroupStore")
    },
    "oversized FetchPartition": StateCase(
        "FetchPartition", partition_request(member_id=HUGER), Code.RESOURCE_EXHAUSTED,
        "larger than max",
    ),  # fmt: skip
    "FetchPartition of a worker whose optimizer state is not sharded": StateCase(
        "FetchPartition", partition_request(), Code.INVALID_ARGUMENT, "is not sharded"
    ),
    "oversized Fetch": StateCase(
        "Fetch", fetch_request(digest=HUGER), Code.RESOURCE_EXHAUSTED, "larger than max"
    ),
    **{
        f"{what} on {rpc}": StateCase(rpc, request, code, says)
        for rpc, build in [
            ("Describe", state_request),
            ("GroupStore", state_request),
            ("Fetch", fetch_request),
            ("FetchPartition", partition_request),
        ]
        for what, request, code, says in [
            ("non-member", build(member_id="ghost-0"), Code.FAILED_PRECONDITION, NOT_IN_VIEW),
            ("stale epoch", build(epoch=2), Code.FAILED_PRECONDITION, NOT_IN_VIEW),
            ("future epoch", build(epoch=4), Code.FAILED_PRECONDITION, NOT_IN_VIEW),
            ("epoch beyond int64", build(epoch=2**64 - 1), Code.FAILED_PRECONDITION, NOT_IN_VIEW),
            ("another job", build(job="job2"), Code.INVALID_ARGUMENT, "is not this worker's job"),
            ("malformed member id", build(member_id="a b"), Code.INVALID_ARGUMENT, "member_id"),
            ("empty job", build(job=""), Code.INVALID_ARGUMENT, "job is empty"),
            ("no epoch secret", build(epoch_secret=""), DENIED, NO_SECRET),
            ("wrong epoch secret", build(epoch_secret="cd" * 32), DENIED, NO_SECRET),
            ("malformed epoch secret", build(epoch_secret="x" * 999), DENIED, NO_SECRET),
            ("a near miss of the secret", build(epoch_secret="ab" * 31 + "ac"), DENIED, NO_SECRET),
        ]
    },
    "GroupStore asked of a worker that is not rank 0": StateCase(
        "GroupStore",
        state_request(member_id=SERVER),
        Code.INVALID_ARGUMENT,
        "only the view's rank 0",
        own_id=PEER,
    ),  # fmt: skip
    "Fetch of another digest": StateCase(
        "Fetch", fetch_request(digest="sha256:00"), Code.FAILED_PRECONDITION, "does not hold state"
    ),
    "Fetch with an overlong digest": StateCase(
        "Fetch",
        fetch_request(digest="a" * 10_000),
        Code.INVALID_ARGUMENT,
        "digest is longer than 128 characters",
    ),
    "Fetch with a digest of bad characters": StateCase(
        "Fetch",
        fetch_request(digest="sha256:\x00"),
        Code.INVALID_ARGUMENT,
        "digest has characters outside",
    ),
    "Fetch of zero bytes": StateCase(
        "Fetch", fetch_request(length=0), Code.INVALID_ARGUMENT, "is outside"
    ),
    "Fetch past the end": StateCase(
        "Fetch", fetch_request(offset=len(_DATA), length=1), Code.INVALID_ARGUMENT, "is outside"
    ),
    "Fetch one byte too many": StateCase(
        "Fetch", fetch_request(offset=1), Code.INVALID_ARGUMENT, "is outside"
    ),
    "Fetch of a huge length": StateCase(
        "Fetch", fetch_request(length=2**64 - 1), Code.INVALID_ARGUMENT, "is outside"
    ),
    "Fetch from a huge offset": StateCase(
        "Fetch", fetch_request(offset=2**64 - 1, length=1), Code.INVALID_ARGUMENT, "is outside"
    ),
}


@pytest.mark.parametrize("case", STATE_CASES.values(), ids=STATE_CASES.keys())
def test_bad_state_request_is_refused_with_its_code_and_changes_nothing(case: StateCase) -> None:
    assert_state_refused(case.rpc, case.request, {case.code}, case.says, case.token, case.own_id)
