"""A malicious holder of the job token, against a real etcd, a real replica
and real workers (findings 9 and 10 of issue 12): member ids are not
credentials, roll-call answers are claims, and a worker's state and the
view's bootstrap store are for the view's members only.

Each test names what an attacker tried and checks that it was refused and
changed nothing: the view, the members' places, what the workers train."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rollcall.etcd_local import LocalEtcd
from rollcall.membership.cause import Cause
from rollcall.membership.config import Config
from rollcall.membership.view import View
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.pb import rendezvous_pb2_grpc as pb_grpc
from rollcall.protocol.client import RendezvousClient, RollCallAnswer
from rollcall.protocol.wire import token_metadata, view_from_pb
from tests.harness import (
    ControlPlane,
    MemberProcess,
    WorkerProcess,
    start_together,
    stop_together,
    wait_for,
)

Code = grpc.StatusCode

#: Generous bound for "training goes on" waits on a loaded 2-core machine.
PATIENCE = 60.0
#: How long the floods below go on.
FLOOD_SECONDS = 10.0


def status(plane: ControlPlane) -> pb.StatusResponse:
    async def ask() -> pb.StatusResponse:
        async with grpc.aio.insecure_channel(plane.addresses[0]) as channel:
            return await pb_grpc.RendezvousStub(channel).Status(
                pb.StatusRequest(job=plane.job), metadata=token_metadata(plane.token), timeout=10
            )

    return asyncio.run(ask())


def settled_view(plane: ControlPlane, members: int | None = None) -> View:
    """The committed view once no roll call runs (and, if given, once it
    has ``members`` members)."""

    def ready() -> View | None:
        response = status(plane)
        view = view_from_pb(response.view)
        settled = response.rollcall_epoch == 0 and members in (None, view.size)
        return view if settled else None

    view: View = wait_for(ready, f"a settled view of {members or 'any size'}", timeout=PATIENCE)
    return view


def two_members(plane: ControlPlane) -> tuple[MemberProcess, MemberProcess]:
    first, second = plane.add_member("a"), plane.add_member("b")
    both = {first.member_id, second.member_id}
    for member in (first, second):
        member.wait_event(lambda e: e["event"] == "view" and both <= set(e["members"]), 30)
    return first, second


def wait_step(worker: WorkerProcess, predicate: Any, timeout: float = PATIENCE) -> dict[str, Any]:
    return worker.wait_event(lambda e: e["event"] == "step" and predicate(e), timeout)


@contextlib.contextmanager
def two_workers(plane: ControlPlane, directory: Path) -> Iterator[list[WorkerProcess]]:
    """Two real workers training the example LM together."""
    team: list[WorkerProcess] = []
    try:
        start_together(
            team,
            lambda index: WorkerProcess(
                plane, directory / f"worker{index}.log", steps=100_000, wait_joined=False
            ),
            2,
        )
        for worker in team:
            wait_step(worker, lambda e: e["world"] == 2 and e["step"] >= 5)
        yield team
    finally:
        stop_together(team, timeout=20)


@pytest.fixture
def workers(control_plane: ControlPlane, tmp_path: Path) -> Iterator[list[WorkerProcess]]:
    """Two real workers training the example LM together."""
    with two_workers(control_plane, tmp_path) as team:
        yield team


@pytest.fixture(scope="module")
def pulled_from(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ControlPlane, list[WorkerProcess]]]:
    """A job of two real workers training, shared by the cases of the state
    pull: each one only asks (and is refused), then checks that the same
    view trains on."""
    directory = tmp_path_factory.mktemp("pulled-from")
    with LocalEtcd() as etcd:
        plane = ControlPlane([etcd.endpoint], directory)
        try:
            with two_workers(plane, directory) as team:
                yield plane, team
        finally:
            plane.close()


# --- member ids are not credentials ---------------------------------------------------


def test_a_leave_naming_a_member_without_its_secret_is_refused_and_evicts_nobody(
    control_plane: ControlPlane,
) -> None:
    """Finding 10: with the token, a forged Leave evicted a healthy member."""
    first, second = two_members(control_plane)
    before = settled_view(control_plane, 2)

    async def forged_leave() -> grpc.aio.AioRpcError | None:
        async with grpc.aio.insecure_channel(control_plane.addresses[0]) as channel:
            try:
                await pb_grpc.RendezvousStub(channel).Leave(
                    pb.LeaveRequest(job=control_plane.job, member_id=first.member_id,
                                    epoch=before.epoch),
                    metadata=token_metadata(control_plane.token), timeout=10,
                )  # fmt: skip
            except grpc.aio.AioRpcError as error:
                return error
            return None

    refused = asyncio.run(forged_leave())
    time.sleep(1.0)  # a roll call (50 ms settle, then answers) would be over by now
    after = settled_view(control_plane)

    assert refused is not None, "a Leave naming another member was accepted"
    assert refused.code() == Code.PERMISSION_DENIED, refused.details()
    assert "secret" in (refused.details() or "")
    assert after == before
    assert first.proc.poll() is None and not [e for e in first.views() if e["epoch"] > after.epoch]


def test_a_session_opened_under_a_members_id_is_refused_and_its_reports_start_nothing(
    control_plane: ControlPlane,
) -> None:
    """Finding 10: a session opened under member 0's id, sending failure
    reports in a loop, forced 171 view changes in 20 s."""
    first, second = two_members(control_plane)
    before = settled_view(control_plane, 2)

    async def flood() -> tuple[grpc.aio.AioRpcError | None, int]:
        md = token_metadata(control_plane.token)
        async with grpc.aio.insecure_channel(control_plane.addresses[0]) as channel:
            call = pb_grpc.RendezvousStub(channel).Session(metadata=md, timeout=FLOOD_SECONDS + 5)
            opening = pb.Open(job=control_plane.job, member_id=first.member_id, epoch=before.epoch)
            epoch, sent = before.epoch, 0

            async def read_views() -> None:
                nonlocal epoch
                async for event in call:
                    if event.HasField("view"):
                        epoch = max(epoch, event.view.epoch)

            try:
                await call.write(pb.SessionRequest(open=opening))
                # The Open is answered (a view) or refused (the stream ends)
                # before the flood: a write racing the end of the stream is
                # gRPC's INTERNAL on the client, hiding the service's code.
                first_event = await call.read()
                if first_event is grpc.aio.EOF:
                    raise asyncio.InvalidStateError
                reader = asyncio.ensure_future(read_views())
                deadline = time.monotonic() + FLOOD_SECONDS
                while time.monotonic() < deadline and not reader.done():
                    report = pb.FailureReport(epoch=epoch, peer_id=second.member_id,
                                              reason="reset by peer")  # fmt: skip
                    await call.write(pb.SessionRequest(failure=report))
                    sent += 1
                    await asyncio.sleep(0.01)
                if not reader.done():
                    call.cancel()
                await asyncio.gather(reader, return_exceptions=True)
                await call.code()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # writing after the refusal fails: how it ended is read next
            code = await call.code()
            print(f"\nthe session ended {code}: {await call.details()}")
            if code == Code.PERMISSION_DENIED:
                return grpc.aio.AioRpcError(code, None, None, await call.details()), sent
            return None, sent

    refused, sent = asyncio.run(flood())
    after = settled_view(control_plane)
    print(f"\n{sent} reports sent, {after.epoch - before.epoch} view changes")

    assert refused is not None, (
        f"a session under another member's id was accepted: {sent} reports forced "
        f"{after.epoch - before.epoch} view changes"
    )
    assert after == before


def test_a_members_flood_of_failure_reports_costs_a_bounded_number_of_roll_calls(
    control_plane: ControlPlane,
) -> None:
    """A member with its own credentials (a malicious token holder that
    joined) flooding failure reports and self roll-calls: each member's
    reports may start at most ``report_burst`` roll calls at once and one
    per ``report_interval`` after that (3, then 1 per 5 s by default)."""
    first, second = two_members(control_plane)
    settled_view(control_plane, 2)

    async def flood() -> tuple[int, int, int]:
        client = RendezvousClient(control_plane.addresses, control_plane.job, control_plane.token)
        try:
            me = await client.join("127.0.0.1:1", name="flood")
            await client.wait_member(PATIENCE)
            await asyncio.sleep(0.5)
            start, sent = client.view.epoch, 0
            deadline = time.monotonic() + FLOOD_SECONDS
            while time.monotonic() < deadline:
                peer = me if sent % 2 else first.member_id
                client.report_failure(peer, "reset by peer")
                sent += 1
                await asyncio.sleep(0.01)
            await asyncio.sleep(1.0)
            return start, client.view.epoch, sent
        finally:
            with contextlib.suppress(Exception):
                await client.leave()
            await client.close()

    start, end, sent = asyncio.run(flood())
    changes = end - start
    print(f"\n{sent} reports in {FLOOD_SECONDS:.0f} s: {changes} view changes")

    # report_burst (3) + one per report_interval (5 s), and one more for
    # a refill landing at the edge of the window.
    bound = 3 + int(FLOOD_SECONDS / 5.0) + 1
    assert changes <= bound, f"{changes} view changes from one member's reports (bound {bound})"
    assert changes >= 1, "the reports within the limit must still start roll calls"
    assert (Config().report_burst, Config().report_interval) == (3, 5.0)
    assert first.proc.poll() is None and second.proc.poll() is None


# --- roll-call answers are claims -------------------------------------------------------


def test_a_joiners_inflated_answer_is_refused_and_training_goes_on_unaffected(
    control_plane: ControlPlane, workers: list[WorkerProcess]
) -> None:
    """Finding 9: a client joined as "evil" and answered the roll call with
    step = real + 5000 and the digest of an all-zero model; every worker
    pulled its state and the job went on from it, 5000 steps skipped."""
    before = settled_view(control_plane, 2)
    honest = set(before.ids)
    forged = "sha256:" + "0" * 64

    async def poison() -> View:
        client = RendezvousClient(control_plane.addresses, control_plane.job, control_plane.token)

        async def answer(epoch: int, causes: tuple[Cause, ...]) -> RollCallAnswer:
            reached = (await client.status()).step or 0
            return RollCallAnswer(reached + 5000, forged)

        try:
            await client.join("127.0.0.1:1", name="evil", on_roll_call=answer)
            view = await client.wait_member(PATIENCE)
            await client.leave()
            return view
        finally:
            await client.close()

    poisoned = asyncio.run(poison())
    reached = max(e["step"] for w in workers for e in w.steps())
    evil = next(i for i in poisoned.ids if i not in honest)
    print(f"\nview {poisoned.epoch}: resume {poisoned.resume_step}, fetch {dict(poisoned.fetch)}")

    assert poisoned.resume_step is not None and poisoned.resume_step <= reached + 1, (
        f"the view resumes at {poisoned.resume_step}, the workers had reached {reached}"
    )
    assert poisoned.digest != forged
    assert evil in poisoned.fetch, "the joiner must fetch the survivors' state"
    assert all(evil not in sources for sources in poisoned.fetch.values())
    for worker in workers:
        wait_step(worker, lambda e: e["epoch"] > poisoned.epoch and e["world"] == 2)
    for worker in workers:
        steps = [e["step"] for e in worker.steps()]
        assert max(steps) < reached + 1000, "steps were skipped"
        assert all(b - a <= 1 for a, b in zip(steps, steps[1:], strict=False)), steps
    digests: dict[int, set[str]] = {}
    for worker in workers:
        for event in worker.steps():
            digests.setdefault(event["step"], set()).add(event["digest"])
    assert all(len(d) == 1 for d in digests.values()), "the workers' replicas diverged"


# --- a worker's state and the view's bootstrap store are for members only -------------


def test_epoch_secrets_go_to_the_views_members_only_and_survive_a_failover(
    etcd: Any, tmp_path: Path
) -> None:
    """A view's epoch secret reaches its members (not a member of an older
    view only, not anyone reading Status), and the standby that takes over
    derives the same one, so the members' proofs hold across a failover."""
    with contextlib.closing(ControlPlane([etcd.endpoint], tmp_path, replicas=2)) as plane:

        async def scenario() -> None:
            a = RendezvousClient(plane.addresses, plane.job, plane.token)
            b = RendezvousClient(plane.addresses, plane.job, plane.token)
            try:
                await a.join("127.0.0.1:1", name="a")
                first = await a.wait_member(PATIENCE)
                await b.join("127.0.0.1:2", name="b")
                both = await b.wait_member(PATIENCE)
                await a.wait_view(lambda v: v.epoch >= both.epoch, PATIENCE)
                held = a.epoch_secret(both.epoch)
                assert held is not None and len(held) == 64
                assert b.epoch_secret(both.epoch) == held
                assert a.epoch_secret(first.epoch) not in (None, held)
                assert b.epoch_secret(first.epoch) is None, "b was not in the first view"
                assert held not in str(await a.status()), "Status must not carry it"

                named = (await a.status()).leader
                leader = next(r for r in plane.replicas if r.address == named)
                a._epoch_secrets.clear()  # what a reopened session is sent again
                leader.kill()
                deadline = time.monotonic() + PATIENCE
                while a.epoch_secret(both.epoch) is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                assert a.epoch_secret(both.epoch) == held, "the standby derives another secret"
                assert a.view.epoch == both.epoch and b.ended is None
            finally:
                await a.close()
                await b.close()

        asyncio.run(scenario())



def _state_calls(
    address: str, job: str, token: str, member_id: str, epoch: int, secret: str
) -> dict[str, Any]:
    """Describe, Fetch and GroupStore on the state server at ``address``,
    naming ``member_id`` with ``secret``: each call's answer or status code."""
    from rollcall.pb import state_pb2 as spb
    from rollcall.pb import state_pb2_grpc as spb_grpc

    async def ask() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with grpc.aio.insecure_channel(address) as channel:
            stub = spb_grpc.StateTransferStub(channel)
            metadata = token_metadata(token)
            request = spb.StateRequest(
                job=job, member_id=member_id, epoch=epoch, epoch_secret=secret
            )
            for name, call in (("describe", stub.Describe), ("group_store", stub.GroupStore)):
                try:
                    out[name] = await call(request, metadata=metadata, timeout=10)
                except grpc.aio.AioRpcError as exc:
                    out[name] = exc.code()
            info = out["describe"]
            digest = info.digest if not isinstance(info, Code) else "sha256:" + "0" * 64
            fetch = spb.FetchRequest(
                job=job, member_id=member_id, epoch=epoch, digest=digest, offset=0,
                length=max(1, getattr(info, "size", 1)), epoch_secret=secret,
            )  # fmt: skip
            try:
                out["fetch"] = 0
                async for chunk in stub.Fetch(fetch, metadata=metadata, timeout=10):
                    out["fetch"] += len(chunk.data)
            except grpc.aio.AioRpcError as exc:
                out["fetch"] = exc.code()
        return out

    return asyncio.run(ask())


@pytest.mark.integration
@pytest.mark.parametrize("secret", ["", "0" * 64, "not a secret"])
def test_a_state_pull_naming_a_member_without_the_epoch_secret_is_refused(
    pulled_from: tuple[ControlPlane, list[WorkerProcess]], secret: str
) -> None:
    """Finding 10: a token holder that is not a member pulled the full state
    from a worker by naming a member id and the epoch (both in ``Status``),
    and rank 0's ``GroupStore`` handed it the bootstrap store's port."""
    control_plane, workers = pulled_from
    view = settled_view(control_plane, 2)
    rank0, rank1 = view.members
    asked = _state_calls(
        rank0.address, control_plane.job, control_plane.token, rank1.id, view.epoch, secret
    )
    print(f"\n{asked}")
    assert asked == {
        "describe": Code.PERMISSION_DENIED,
        "group_store": Code.PERMISSION_DENIED,
        "fetch": Code.PERMISSION_DENIED,
    }
    # Nothing changed: the same view trains on.
    reached = max(e["step"] for e in workers[0].steps())
    for worker in workers:
        wait_step(worker, lambda e: e["step"] >= reached + 5)
    assert settled_view(control_plane, 2).epoch == view.epoch
