"""Hostile and malformed requests against a real replica (raw gRPC stubs, real
etcd): each is refused with its documented status code and a clear message,
and none changes anything, neither in etcd nor in the view the job reports."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from membership.config import Config
from rendezvous.etcd_local import LocalEtcd
from rendezvous.store import EtcdStore
from rendezvous.wire import token_metadata
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.pb import rendezvous_pb2_grpc as pb_grpc
from tests.harness import ControlPlane, MemberProcess

Code = grpc.StatusCode

#: No rejection may take longer than this (a call that is never answered fails).
CALL_TIMEOUT = 10.0
#: Time given to anything a rejected request might have set off (a join
#: settles in 50 ms) before the state is compared.
SETTLE = 0.1
#: Codes the service may answer a malformed request with (docs/protocol.md).
DOCUMENTED_REJECTIONS = {
    Code.INVALID_ARGUMENT,
    Code.RESOURCE_EXHAUSTED,
    Code.FAILED_PRECONDITION,
    Code.NOT_FOUND,
}
#: A well-formed peer address (nobody listens there; it is never dialled).
ADDRESS = "127.0.0.1:29500"
#: Over the service's 64 KiB message limit.
HUGE = "x" * 100_000


@dataclass(frozen=True)
class Job:
    """A running job with two members, as the requests below see it."""

    plane: ControlPlane
    store: EtcdStore
    members: tuple[str, str]

    @property
    def address(self) -> str:
        return self.plane.addresses[0]

    @property
    def name(self) -> str:
        return self.plane.job


@dataclass(frozen=True)
class Target:
    """What a request may refer to: the job, its members, its current epoch."""

    job: str
    members: tuple[str, str]
    epoch: int


@dataclass(frozen=True)
class JobState:
    etcd: dict[str, bytes]
    status: pb.StatusResponse


def add_two_members(plane: ControlPlane) -> tuple[str, str]:
    """Two members, both in the committed view."""
    first, second = plane.add_member("a"), plane.add_member("b")
    both = {first.member_id, second.member_id}
    for member in (first, second):
        member.wait_event(lambda e: e["event"] == "view" and set(e["members"]) == both, 30)
    return first.member_id, second.member_id


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    """Shared by the cases that must change nothing (so they may share it)."""
    with LocalEtcd() as etcd:
        plane = ControlPlane([etcd.endpoint], tmp_path_factory.mktemp("bad-input"))
        try:
            members = add_two_members(plane)
            with EtcdStore([etcd.endpoint], plane.job, Config()) as store:
                yield Job(plane, store, members)
        finally:
            plane.close()


@pytest.fixture
def own_job(control_plane: ControlPlane, etcd: LocalEtcd) -> Iterator[Job]:
    """A job of its own, for tests that change it first."""
    members = add_two_members(control_plane)
    with EtcdStore([etcd.endpoint], control_plane.job, Config()) as store:
        yield Job(control_plane, store, members)


# --- talking to the replica -------------------------------------------------------


def metadata(job: Job, token: str) -> tuple[tuple[str, str], ...]:
    if token == "right":
        return token_metadata(job.plane.token)
    if token == "wrong":
        return token_metadata(job.plane.token + "-not")
    assert token == "missing"
    return ()


async def status(stub: pb_grpc.RendezvousStub, job: Job) -> pb.StatusResponse:
    return await stub.Status(
        pb.StatusRequest(job=job.name), metadata=metadata(job, "right"), timeout=CALL_TIMEOUT
    )


async def send(
    stub: pb_grpc.RendezvousStub, rpc: str, request: Any, md: Sequence[tuple[str, str]]
) -> None:
    """One call; returns only if the service accepted it (streams: if it
    ended them cleanly). A session's request stream stays open, so the
    service, not the end of our input, has to end it."""
    if rpc == "Session":
        call = stub.Session(metadata=md, timeout=CALL_TIMEOUT)
        for message in request:
            try:
                await call.write(message)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                break  # refused already: the status is read below
        while await call.read() is not grpc.aio.EOF:
            pass
    elif rpc == "Watch":
        async for _ in stub.Watch(request, metadata=md, timeout=CALL_TIMEOUT):
            pass
    else:
        await getattr(stub, rpc)(request, metadata=md, timeout=CALL_TIMEOUT)


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
            return await status(pb_grpc.RendezvousStub(channel), job)

    return asyncio.run(ask())


def settled_target(job: Job) -> Target:
    """The job's current epoch, once no roll call is running."""
    deadline = time.monotonic() + CALL_TIMEOUT
    while True:
        response = current_status(job)
        if response.rollcall_epoch == 0 or time.monotonic() > deadline:
            return Target(job.name, job.members, response.view.epoch)
        time.sleep(0.05)


def assert_refused(
    job: Job,
    rpc: str,
    request: Any,
    codes: Collection[grpc.StatusCode],
    says: str = "",
    token: str = "right",
    check_cli: bool = True,
) -> None:
    """Send one request and check that the service refuses it with one of
    ``codes`` and a message containing ``says``, and that the job is the
    same after it as before: in etcd, in ``Status`` and (with ``check_cli``)
    in what `rollcall status --json` reports."""

    async def exchange() -> tuple[grpc.aio.AioRpcError | None, pb.StatusResponse]:
        async with grpc.aio.insecure_channel(job.address) as channel:
            stub = pb_grpc.RendezvousStub(channel)
            try:
                await send(stub, rpc, request, metadata(job, token))
                error = None
            except grpc.aio.AioRpcError as rpc_error:
                error = rpc_error
            await asyncio.sleep(SETTLE)
            return error, await status(stub, job)

    reported_before = reported_view(job) if check_cli else None
    before = job_state(job, current_status(job))
    error, status_after = asyncio.run(exchange())
    after = job_state(job, status_after)
    assert error is not None, f"{rpc} was accepted: {request}"
    assert error.code() in codes, f"{error.code()}: {error.details()}"
    assert error.details() and says in error.details(), error.details()
    assert after == before, f"{rpc} refused with {error.code()} but changed the job"
    if check_cli:
        assert reported_view(job) == reported_before


# --- requests -------------------------------------------------------------------------

Build = Callable[[Target], Any]


def join(job: str | None = None, address: str = ADDRESS, name: str = "intruder") -> Build:
    return lambda t: pb.JoinRequest(job=t.job if job is None else job, address=address, name=name)


def leave(member: str | int = 0, epoch: int | None = None, job: str | None = None) -> Build:
    """Leave as ``member`` (an index into the job's members, or an id) at
    ``epoch`` (default: the current one)."""
    return lambda t: pb.LeaveRequest(
        job=t.job if job is None else job,
        member_id=t.members[member] if isinstance(member, int) else member,
        epoch=t.epoch if epoch is None else epoch,
    )


def open_(t: Target, member: str | int = 0, epoch: int | None = None) -> pb.SessionRequest:
    return pb.SessionRequest(
        open=pb.Open(
            job=t.job,
            member_id=t.members[member] if isinstance(member, int) else member,
            epoch=t.epoch if epoch is None else epoch,
        )
    )


def session(*messages: Callable[[Target], pb.SessionRequest]) -> Build:
    return lambda t: [message(t) for message in messages]


def status_request(job: str | None = None) -> Build:
    return lambda t: pb.StatusRequest(job=t.job if job is None else job)


def watch(job: str | None = None, after_epoch: int = 0) -> Build:
    return lambda t: pb.WatchRequest(job=t.job if job is None else job, after_epoch=after_epoch)


def publish(
    member: str | int = 0,
    epoch: int | None = None,
    job: str | None = None,
    checkpoint_epoch: int | None = None,
    **changes: Any,
) -> Build:
    """PublishCheckpoint as ``member`` at ``epoch``, the manifest's fields
    overridden by ``changes`` (its epoch by ``checkpoint_epoch``)."""

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
            member_id=t.members[member] if isinstance(member, int) else member,
            epoch=t.epoch if epoch is None else epoch,
            checkpoint=pb.Checkpoint(**fields),
        )

    return build


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
}

CASES = {
    **{
        f"{token} token on {rpc}": Case(
            rpc, request, Code.UNAUTHENTICATED, "missing or wrong job token", token
        )
        for rpc, request in VALID.items()
        for token in ("wrong", "missing")
    },
    # Malformed fields.
    "job name charset on Join": Case(
        "Join", join(job="job 1!"), Code.INVALID_ARGUMENT, "job 'job 1!' has characters outside"
    ),
    "job name charset on Status": Case(
        "Status", status_request("jöb"), Code.INVALID_ARGUMENT, "has characters outside"
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
        session(lambda t: pb.SessionRequest(heartbeat=pb.Heartbeat(epoch=t.epoch))),
        Code.INVALID_ARGUMENT,
        "must start with an Open message",
    ),
    "session starting with an empty message": Case(
        "Session",
        session(lambda t: pb.SessionRequest()),
        Code.INVALID_ARGUMENT,
        "must start with an Open message",
    ),
    "Open twice": Case("Session", session(open_, open_), Code.INVALID_ARGUMENT, "Open sent twice"),
    "digest with bad characters": Case(
        "Session",
        session(
            open_,
            lambda t: pb.SessionRequest(
                answer=pb.RollCallAnswer(epoch=t.epoch + 1, step=1, digest="sha256 <bad>")
            ),
        ),
        Code.INVALID_ARGUMENT,
        "digest has characters outside",
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
    "epoch beyond int64 on Leave": Case(
        "Leave", leave(epoch=2**64 - 1), Code.INVALID_ARGUMENT, "out of range"
    ),
    "after_epoch beyond int64 on Watch": Case(
        "Watch", watch(after_epoch=2**64 - 1), Code.INVALID_ARGUMENT, "out of range"
    ),
    # Oversized.
    "oversized Join": Case("Join", join(name=HUGE), Code.RESOURCE_EXHAUSTED, "larger than max"),
    "oversized Open": Case(
        "Session", session(lambda t: open_(t, HUGE)), Code.RESOURCE_EXHAUSTED, "larger than max"
    ),
    # Unknown member, unknown job.
    "unknown member on Leave": Case(
        "Leave", leave("ghost-0"), Code.NOT_FOUND, "'ghost-0' is not a member of job"
    ),
    "unknown member on Open": Case(
        "Session",
        session(lambda t: open_(t, "ghost-0")),
        Code.NOT_FOUND,
        "'ghost-0' is not a member of job",
    ),
    "wrong job on Status": Case("Status", status_request("job2"), Code.NOT_FOUND, "no such job"),
    "wrong job on Join": Case("Join", join(job="job2"), Code.NOT_FOUND, "no such job"),
    "wrong job on Leave": Case("Leave", leave(job="job2"), Code.NOT_FOUND, "no such job"),
    "wrong job on Watch": Case("Watch", watch(job="job2"), Code.NOT_FOUND, "no such job"),
    "heartbeat with a NaN send time": Case(
        "Session",
        session(
            open_,
            lambda t: pb.SessionRequest(
                heartbeat=pb.Heartbeat(epoch=t.epoch, sent_at=float("nan"))
            ),
        ),
        Code.INVALID_ARGUMENT,
        "heartbeat sent_at must be a finite",
    ),
    "view report with a negative duration": Case(
        "Session",
        session(
            open_,
            lambda t: pb.SessionRequest(view_report=pb.ViewReport(epoch=t.epoch, fetch_s=-1.0)),
        ),
        Code.INVALID_ARGUMENT,
        "view report durations must be in",
    ),
    "view report with a NaN duration": Case(
        "Session",
        session(
            open_,
            lambda t: pb.SessionRequest(
                view_report=pb.ViewReport(epoch=t.epoch, step_s=float("nan"))
            ),
        ),
        Code.INVALID_ARGUMENT,
        "view report durations must be in",
    ),
    # Checkpoint manifests.
    "checkpoint with an empty uri": Case(
        "PublishCheckpoint", publish(uri=""), Code.INVALID_ARGUMENT, "checkpoint uri must be"
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
    "checkpoint step beyond int64": Case(
        "PublishCheckpoint", publish(step=2**64 - 1), Code.INVALID_ARGUMENT, "out of range"
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
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_request_is_refused_with_its_code_and_changes_nothing(job: Job, case: Case) -> None:
    request = case.request(settled_target(job))
    assert_refused(job, case.rpc, request, {case.code}, case.says, case.token)


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


# --- arbitrary input ------------------------------------------------------------------
#
# Each example starts from a request the service would accept and replaces
# one or more of its fields with arbitrary values.

#: ASCII-only reading of the documented grammar, independent of the code under test.
_STRICT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_STRICT_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):([0-9]{1,5})")


def might_join(job: Job, request: pb.JoinRequest) -> bool:
    address = _STRICT_ADDRESS.fullmatch(request.address)
    return (
        request.job == job.name
        and address is not None
        and 0 < int(address.group(2)) < 65536
        and (request.name == "" or _STRICT_ID.fullmatch(request.name) is not None)
    )


texts = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["", "w", "job1", "a b", "-x", "\u00e9", "\x00", "x" * 65]),
    st.integers(60_000, 70_000).map("n".__mul__),
)
#: Digits of every kind: str.isdigit() accepts more than int() and than ASCII.
ports = st.one_of(
    st.integers(-10, 70_000).map(str),
    st.text(st.characters(categories=["Nd", "No"]), min_size=1, max_size=6),
    st.text(max_size=8),
)
addresses = st.one_of(
    st.builds("{}:{}".format, st.sampled_from(["127.0.0.1", "localhost", "[::1]"]), ports),
    st.builds("{}:{}".format, texts, ports),
    st.text(max_size=300),
)
counters = st.one_of(
    st.integers(0, 2**64 - 1),
    st.sampled_from([0, 1, 2, 3, 2**63 - 1, 2**63, 2**64 - 1]),
)
JOIN_FIELDS = {"job": texts, "address": addresses, "name": texts}
LEAVE_FIELDS = {"job": texts, "member_id": texts, "epoch": counters}


def fuzzed_fields(
    data: st.DataObject, valid: dict[str, Any], strategies: dict[str, st.SearchStrategy[Any]]
) -> dict[str, Any]:
    fields = dict(valid)
    for name in data.draw(st.sets(st.sampled_from(sorted(fields)), min_size=1), label="fuzzed"):
        fields[name] = data.draw(strategies[name], label=name)
    return fields


def fuzzing(examples: int) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """No shrinking: every failing example a shrinker would try again could
    change the live job (an accepted Join does) and so the examples after it."""
    return settings(
        max_examples=examples,
        deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def assert_refused_with_a_documented_code(job: Job, rpc: str, request: Any) -> None:
    assert_refused(job, rpc, request, DOCUMENTED_REJECTIONS, check_cli=False)
    assert job.plane.replicas[0].proc.poll() is None, "the replica died"


@pytest.fixture
def fuzzed_job(own_job: Job) -> Iterator[Job]:
    """``own_job``, checked to report the same view after the fuzzing."""
    before = reported_view(own_job)
    yield own_job
    assert reported_view(own_job) == before


@fuzzing(examples=50)
@given(data=st.data())
def test_arbitrary_join_is_refused_with_a_documented_code(
    fuzzed_job: Job, data: st.DataObject
) -> None:
    valid = {"job": fuzzed_job.name, "address": ADDRESS, "name": "fuzz"}
    request = pb.JoinRequest(**fuzzed_fields(data, valid, JOIN_FIELDS))
    assume(not might_join(fuzzed_job, request))
    assert_refused_with_a_documented_code(fuzzed_job, "Join", request)


@fuzzing(examples=30)
@given(data=st.data())
def test_arbitrary_leave_is_refused_with_a_documented_code(
    fuzzed_job: Job, data: st.DataObject
) -> None:
    epoch = settled_target(fuzzed_job).epoch
    valid = {"job": fuzzed_job.name, "member_id": fuzzed_job.members[0], "epoch": epoch}
    request = pb.LeaveRequest(**fuzzed_fields(data, valid, LEAVE_FIELDS))
    assume(
        not (
            request.job == fuzzed_job.name
            and request.member_id in fuzzed_job.members
            and request.epoch <= epoch
        )
    )
    assert_refused_with_a_documented_code(fuzzed_job, "Leave", request)
