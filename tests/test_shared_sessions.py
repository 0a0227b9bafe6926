"""Shared sessions end to end (docs/protocol.md, "Shared sessions"): a real
etcd, a real `rollcall rendezvous` process and in-process members whose
sessions ride one stream (``SessionCarrier``), beside members with streams
of their own. The members of a shared stream are members like any other:
the same views and epoch secrets, acknowledged heartbeats, answers counted
for the member that gave them; one dropped without leaving is suspected at
once; a broken stream suspects every member on it and nobody else; a
member refused on the stream ends alone."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from rollcall.membership.errors import PermissionDenied
from rollcall.membership.view import View
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.pb import rendezvous_pb2_grpc as pb_grpc
from rollcall.protocol.carrier import SessionCarrier
from rollcall.protocol.client import RendezvousClient, RollCallAnswer, error_from_end
from rollcall.protocol.wire import token_metadata
from tests.harness import ControlPlane, wait_for

pytestmark = pytest.mark.integration

TIMEOUT = 20.0


def carried(plane: ControlPlane, carrier: SessionCarrier) -> RendezvousClient:
    return RendezvousClient(plane.addresses, plane.job, plane.token, carrier=carrier)


def replica_log(plane: ControlPlane) -> str:
    return (plane.workdir / "replica0.log").read_text(errors="replace")


def test_members_of_a_shared_stream_are_members_like_any_other(
    control_plane: ControlPlane,
) -> None:
    async def scenario() -> None:
        carrier = SessionCarrier(control_plane.addresses, control_plane.job, control_plane.token)
        own = control_plane.client()
        members = [carried(control_plane, carrier) for _ in range(3)]
        seen: list[View] = []
        await own.join("127.0.0.1:20100", name="own", on_view=seen.append)
        for n, member in enumerate(members):
            await member.join(f"127.0.0.1:{20101 + n}", name=f"c{n}")
        ids = {own.member_id, *(m.member_id for m in members)}
        view = await own.wait_view(lambda v: ids <= set(v.ids), TIMEOUT)
        for member in members:
            held = await member.wait_view(lambda v: v.epoch >= view.epoch, TIMEOUT)
            assert held == view
            assert member.epoch_secret(view.epoch) == own.epoch_secret(view.epoch) is not None
        # The stream's heartbeats are acknowledged for every member on it.
        started = time.monotonic()
        await asyncio.sleep(0.5)
        assert all(m.last_acked > started for m in members)

        await members[1].leave()
        await members[1].close()
        after = await own.wait_view(lambda v: members[1].member_id not in v, TIMEOUT)
        for member in (members[0], members[2]):
            assert await member.wait_view(lambda v: v.epoch >= after.epoch, TIMEOUT) == after
        for member in (members[0], members[2], own):
            await member.leave()
            await member.close()
        await carrier.close()

    asyncio.run(scenario())
    assert "on shared session @" in replica_log(control_plane)


def test_each_member_of_a_shared_stream_answers_the_roll_call_for_itself(
    control_plane: ControlPlane,
) -> None:
    """Answers travel batched on one stream: the view's resume step and
    fetch plan must still name the member each one came from."""

    async def scenario() -> View:
        carrier = SessionCarrier(control_plane.addresses, control_plane.job, control_plane.token)
        ahead, behind, fresh = (carried(control_plane, carrier) for _ in range(3))
        steps = {"ahead": 5, "behind": 4}

        def answering(name: str) -> object:
            return lambda epoch, causes: RollCallAnswer(steps.get(name), f"digest-{name}")

        await ahead.join("127.0.0.1:20201", name="ahead", on_roll_call=answering("ahead"))
        await behind.join("127.0.0.1:20202", name="behind", on_roll_call=answering("behind"))
        ids = {ahead.member_id, behind.member_id}
        view = await ahead.wait_view(lambda v: ids <= set(v.ids), TIMEOUT)
        # Both hold steps now (as in the view in force), then a joiner
        # makes a roll call that checks them.
        for member, step in ((ahead, 5), (behind, 4)):
            member.report_progress(step)
        await asyncio.sleep(0.3)
        await fresh.join("127.0.0.1:20203", name="fresh", on_roll_call=answering("fresh"))
        final = await ahead.wait_view(lambda v: fresh.member_id in v, TIMEOUT)
        assert final.epoch > view.epoch
        for member in (ahead, behind, fresh):
            await member.leave()
            await member.close()
        await carrier.close()
        return final

    final = asyncio.run(scenario())
    ahead_id, behind_id, fresh_id = final.ids
    assert final.resume_step == 5 and final.digest == "digest-ahead"
    assert final.fetch == {behind_id: (ahead_id,), fresh_id: (ahead_id,)}


@pytest.mark.parametrize("shared", [False, True], ids=["own-stream", "shared-stream"])
def test_an_answer_that_waits_for_a_heartbeat_acknowledgement_gets_one(
    control_plane: ControlPlane, shared: bool
) -> None:
    """An answer to a roll call held at the step's end waits for the step
    to land, and a step lands only once a heartbeat sent within
    ``fence_window`` was acknowledged (the fence). The acknowledgement
    comes on the stream that brought the roll call: it must be read while
    the answer waits. (Read after it, the member waited at its fence for
    ``fence_patience``, dropped its step and answered after the deadline:
    evicted at a hot-add of a 306 MB model on 2 cores.)"""
    waited: list[float] = []

    async def scenario() -> View:
        carrier = (
            SessionCarrier(control_plane.addresses, control_plane.job, control_plane.token)
            if shared
            else None
        )
        member = carried(control_plane, carrier) if carrier else control_plane.client()

        async def answering(epoch: int, causes: object) -> RollCallAnswer:
            if member.member_id in member.view:  # not its own join's roll call
                arrived = time.monotonic()
                deadline = arrived + 3.0
                while member.last_acked <= arrived and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)  # as the fence polls
                waited.append(time.monotonic() - arrived)
            return RollCallAnswer(3, "digest-3")

        await member.join("127.0.0.1:20301", name="landing", on_roll_call=answering)
        await member.wait_member(TIMEOUT)
        member.report_progress(3)
        joiner = control_plane.client()
        await joiner.join("127.0.0.1:20302", name="joiner")
        view = await joiner.wait_member(TIMEOUT)
        for client in (member, joiner):
            await client.leave()
            await client.close()
        if carrier is not None:
            await carrier.close()
        return view

    view = asyncio.run(scenario())
    assert len(view.members) == 2, view
    assert len(waited) == 1 and waited[0] < 1.0, waited


def test_a_member_dropped_from_a_shared_stream_is_suspected_at_once(
    control_plane: ControlPlane,
) -> None:
    async def scenario() -> float:
        carrier = SessionCarrier(control_plane.addresses, control_plane.job, control_plane.token)
        keep, drop = carried(control_plane, carrier), carried(control_plane, carrier)
        await keep.join("127.0.0.1:20301", name="keep")
        await drop.join("127.0.0.1:20302", name="drop")
        await keep.wait_view(lambda v: drop.member_id in v and keep.member_id in v, TIMEOUT)
        dropped = drop.member_id
        started = time.monotonic()
        await drop.close()  # no Leave: as a killed process's link ends
        await keep.wait_view(lambda v: dropped not in v, TIMEOUT)
        took = time.monotonic() - started
        await keep.leave()
        await keep.close()
        await carrier.close()
        return took

    took = asyncio.run(scenario())
    log = replica_log(control_plane)
    assert "session stream broken" in log  # not the detector's silence
    assert "heartbeat detector" not in log
    assert took < 10.0


def test_a_broken_shared_stream_suspects_every_member_on_it_and_nobody_else(
    control_plane: ControlPlane,
) -> None:
    async def scenario() -> View:
        carrier = SessionCarrier(control_plane.addresses, control_plane.job, control_plane.token)
        own = control_plane.client()
        await own.join("127.0.0.1:20400", name="own")
        riders = [carried(control_plane, carrier) for _ in range(3)]
        for n, rider in enumerate(riders):
            await rider.join(f"127.0.0.1:{20401 + n}", name=f"r{n}")
        ids = {own.member_id, *(r.member_id for r in riders)}
        await own.wait_view(lambda v: ids <= set(v.ids), TIMEOUT)
        # The holder's process dies: its connection resets, no Close is sent.
        task = carrier._task
        assert task is not None
        task.cancel()
        final = await own.wait_view(lambda v: not (set(v.ids) & (ids - {own.member_id})),
                                    TIMEOUT)  # fmt: skip
        await own.leave()
        await own.close()
        for rider in riders:
            await rider._close_channels()
        await carrier._close_channels()
        return final

    final = asyncio.run(scenario())
    assert len(final.ids) == 1
    assert replica_log(control_plane).count("session stream broken") == 3


def test_a_member_refused_on_a_shared_stream_ends_alone(control_plane: ControlPlane) -> None:
    """A shared stream on which the second Open carries a wrong member
    secret: that member's session ends with the refusal its own stream
    would have ended with; the first member's goes on."""

    async def scenario() -> tuple[list[pb.SessionEvent], bool]:
        metadata = token_metadata(control_plane.token)
        async with grpc.aio.insecure_channel(control_plane.replicas[0].address) as channel:
            stub = pb_grpc.RendezvousStub(channel)
            joined = []
            for name in ("good", "bad"):
                request = pb.JoinRequest(job=control_plane.job, address="127.0.0.1:20501",
                                         name=name)  # fmt: skip
                joined.append(await join_when_leading(stub, request, metadata))
            good, bad = joined
            session = stub.Session(metadata=metadata)

            def opening(slot: int, answer: pb.JoinResponse, secret: str) -> pb.SessionRequest:
                return pb.SessionRequest(slot=slot, open=pb.Open(
                    job=control_plane.job, member_id=answer.member_id, epoch=0,
                    member_secret=secret, view_deltas=True, shared=True,
                ))  # fmt: skip

            await session.write(opening(1, good, good.member_secret))
            await session.write(opening(2, bad, "0" * 64))
            events: list[pb.SessionEvent] = []
            acked = False
            async with asyncio.timeout(TIMEOUT):
                while not (acked and any(e.WhichOneof("kind") == "end" for e in events)):
                    await session.write(pb.SessionRequest(heartbeat=pb.Heartbeat(sent_at=1.0)))
                    event = await session.read()
                    events.append(event)
                    acked = acked or event.WhichOneof("kind") == "ack"
            session.cancel()
            return events, acked

    events, acked = asyncio.run(scenario())
    (end,) = [e for e in events if e.WhichOneof("kind") == "end"]
    assert list(end.slots) == [2]
    assert end.end.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert isinstance(error_from_end(end.end), PermissionDenied)
    assert acked  # the stream, and the good member's session on it, go on
    views = [e for e in events if e.WhichOneof("kind") in ("view", "view_delta")]
    assert all(list(e.slots) == [1] for e in views)


async def join_when_leading(
    stub: pb_grpc.RendezvousStub, request: pb.JoinRequest, metadata: tuple[tuple[str, str], ...]
) -> pb.JoinResponse:
    async with asyncio.timeout(TIMEOUT):
        while True:
            try:
                return await stub.Join(request, metadata=metadata, timeout=TIMEOUT)
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                await asyncio.sleep(0.1)


def test_shared_sessions_survive_a_leader_failover(tmp_path, etcd) -> None:  # noqa: ANN001
    """The leader is killed: the shared stream moves to the new leader and
    every member on it keeps its place (nobody is evicted for it)."""
    plane = ControlPlane([etcd.endpoint], tmp_path, replicas=2)
    try:

        async def scenario() -> tuple[View, View]:
            carrier = SessionCarrier(plane.addresses, plane.job, plane.token)
            members = [carried(plane, carrier) for _ in range(3)]
            for n, member in enumerate(members):
                await member.join(f"127.0.0.1:{20601 + n}", name=f"f{n}")
            ids = {m.member_id for m in members}
            before = await members[0].wait_view(lambda v: ids <= set(v.ids), TIMEOUT)
            status = await members[0].status()
            leader = next(r for r in plane.replicas if r.address == status.leader)
            leader.proc.kill()
            leader.proc.wait(timeout=10)
            survivor = next(r for r in plane.replicas if r is not leader)

            def leads() -> bool:
                return "leads job" in (survivor.log_path.read_text(errors="replace"))

            await asyncio.get_running_loop().run_in_executor(
                None, lambda: wait_for(leads, "the standby leads", TIMEOUT)
            )
            # A leave after the takeover: a view change on the new leader.
            await members[2].leave()
            await members[2].close()
            after = await members[0].wait_view(lambda v: members[2].member_id not in v, TIMEOUT)
            assert all(m.ended is None for m in members[:2])
            for member in members[:2]:
                await member.leave()
                await member.close()
            await carrier.close()
            return before, after

        before, after = asyncio.run(scenario())
    finally:
        plane.close()
    assert set(after.ids) == set(before.ids[:2])
    assert after.epoch == before.epoch + 1


def test_the_leader_advises_host_agents_once_members_on_their_own_streams_are_many(
    etcd, tmp_path  # noqa: ANN001
) -> None:
    plane = ControlPlane([etcd.endpoint], tmp_path, settings=("own_sessions_advised=2",))
    try:

        async def scenario() -> None:
            members = [plane.client() for _ in range(4)]
            for n, member in enumerate(members):
                await member.join(f"127.0.0.1:{20801 + n}", name=f"o{n}")
            ids = {m.member_id for m in members}
            await members[0].wait_view(lambda v: ids <= set(v.ids), TIMEOUT)
            for member in members:
                await member.leave()
                await member.close()

        asyncio.run(scenario())
        log = (tmp_path / "replica0.log").read_text(errors="replace")
    finally:
        plane.close()
    assert log.count("run `rollcall agent` on each host") == 1
    assert "3 members hold sessions of their own" in log
