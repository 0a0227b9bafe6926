"""Views announced as changes, end to end: a real etcd, a real `rollcall
rendezvous` process and in-process members. A member that cannot apply a
change (it missed the one before) asks for the whole view and never acts on
a wrong member list; a member of an earlier version, which does not say it
applies changes, is sent every view whole; and the members are told the
heartbeat interval for the view's size."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from rollcall.membership.delta import ViewDelta
from rollcall.membership.view import View
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.pb import rendezvous_pb2_grpc as pb_grpc
from rollcall.protocol.client import RendezvousClient
from rollcall.protocol.wire import token_metadata, view_from_pb
from tests.harness import TEST_SETTINGS, ControlPlane

pytestmark = pytest.mark.integration

TIMEOUT = 20.0


class LosingClient(RendezvousClient):
    """A member that loses the next view change sent to it once ``losing``
    is set (as if it had missed it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losing = False
        self.lost: int | None = None
        self.changes = 0

    def _apply_delta(self, delta: ViewDelta) -> None:
        self.changes += 1
        if self.losing and self.lost is None:
            self.lost = delta.epoch
            return
        super()._apply_delta(delta)


def test_a_member_that_missed_a_change_fetches_the_whole_view_and_acts_on_no_wrong_one(
    control_plane: ControlPlane,
) -> None:
    async def scenario() -> tuple[list[View], list[View], LosingClient]:
        seen: dict[str, list[View]] = {"a": [], "b": []}
        a = control_plane.client()
        b = LosingClient(control_plane.addresses, control_plane.job, control_plane.token)
        c = control_plane.client()
        await a.join("127.0.0.1:20001", name="a", on_view=seen["a"].append)
        await b.join("127.0.0.1:20002", name="b", on_view=seen["b"].append)
        await c.join("127.0.0.1:20003", name="c")
        members = {a.member_id, b.member_id, c.member_id}
        start = await a.wait_view(lambda v: members <= set(v.ids), TIMEOUT)
        await b.wait_view(lambda v: v.epoch >= start.epoch, TIMEOUT)
        # c leaves: b loses that change, then d joins: a change b cannot apply.
        b.losing = True
        await c.leave()
        await c.close()
        await a.wait_view(lambda v: v.epoch > start.epoch, TIMEOUT)
        d = control_plane.client()
        await d.join("127.0.0.1:20004", name="d")
        final = await a.wait_view(lambda v, m=d.member_id: m in v, TIMEOUT)
        await b.wait_view(lambda v: v.epoch >= final.epoch, TIMEOUT)
        # The epoch secret came inside a's change, and with b's whole view.
        secrets = {client.epoch_secret(final.epoch) for client in (a, b, d)}
        assert len(secrets) == 1 and None not in secrets
        for client in (a, b, d):
            await client.leave()
            await client.close()
        return seen["a"], seen["b"], b

    views_a, views_b, b = asyncio.run(scenario())

    assert b.lost is not None and b.changes >= 2
    committed = {view.epoch: view for view in views_a}
    assert b.lost not in [view.epoch for view in views_b]  # it never held the lost one
    assert views_b, "b received no view"
    for view in views_b:  # every view b acted on is the one committed at its epoch
        if view.epoch in committed:
            assert view == committed[view.epoch]
    # b came to the view a ended in (b may see one more after it: a leaves
    # first below).
    assert views_a[-1] in views_b


def test_a_member_of_an_earlier_version_is_sent_every_view_whole(
    control_plane: ControlPlane,
) -> None:
    async def scenario() -> list[str]:
        metadata = token_metadata(control_plane.token)
        async with grpc.aio.insecure_channel(control_plane.replicas[0].address) as channel:
            stub = pb_grpc.RendezvousStub(channel)
            request = pb.JoinRequest(job=control_plane.job, address="127.0.0.1:20011", name="old")
            async with asyncio.timeout(TIMEOUT):
                while True:  # until the replica leads
                    try:
                        joined = await stub.Join(request, metadata=metadata, timeout=TIMEOUT)
                        break
                    except grpc.aio.AioRpcError as error:
                        if error.code() != grpc.StatusCode.UNAVAILABLE:
                            raise
                        await asyncio.sleep(0.1)
            session = stub.Session(metadata=metadata)
            await session.write(pb.SessionRequest(open=pb.Open(
                job=control_plane.job, member_id=joined.member_id, epoch=0,
                member_secret=joined.member_secret,
            )))  # fmt: skip
            kinds: list[str] = []
            other = control_plane.client()
            epoch = 0

            async def heartbeat() -> None:
                while True:
                    beat = pb.Heartbeat(epoch=epoch)
                    await session.write(pb.SessionRequest(heartbeat=beat))
                    await asyncio.sleep(0.1)

            beating = asyncio.create_task(heartbeat())
            try:
                async with asyncio.timeout(TIMEOUT):
                    while True:
                        event = await session.read()
                        kind = event.WhichOneof("kind")
                        kinds.append(kind)
                        if kind == "roll_call":
                            answer = pb.RollCallAnswer(epoch=event.roll_call.epoch)
                            await session.write(pb.SessionRequest(answer=answer))
                        elif kind == "view":
                            view = view_from_pb(event.view)
                            epoch = view.epoch
                            if joined.member_id in view and other.member_id is None:
                                await other.join("127.0.0.1:20012", name="new")
                            if other.member_id in view:
                                break
            finally:
                beating.cancel()
                session.cancel()
                await other.close()
            return kinds

    kinds = asyncio.run(scenario())

    assert kinds.count("view") >= 3  # at open, with itself, with the other member
    assert "view_delta" not in kinds


def test_members_are_told_a_longer_heartbeat_interval_as_the_view_grows(
    etcd: Any, tmp_path: Any
) -> None:
    # 3 members at 20 heartbeats per second: 0.15 s.
    settings = (*TEST_SETTINGS, "heartbeat_rate_max=20")
    plane = ControlPlane([etcd.endpoint], tmp_path, settings=settings)
    try:

        async def scenario() -> list[float]:
            clients = [plane.client() for _ in range(3)]
            intervals = []
            for n, client in enumerate(clients):
                await client.join(f"127.0.0.1:{20020 + n}", name=f"m{n}")
                intervals.append(client.heartbeat_interval)
            ids = {c.member_id for c in clients}
            await asyncio.gather(
                *(c.wait_view(lambda v: ids <= set(v.ids), TIMEOUT) for c in clients)
            )
            deadline = asyncio.get_running_loop().time() + TIMEOUT
            while any(c.heartbeat_interval != 0.15 for c in clients):
                assert asyncio.get_running_loop().time() < deadline, "no pace arrived"
                await asyncio.sleep(0.05)
            for client in clients:
                await client.leave()
                await client.close()
            return intervals

        assert asyncio.run(scenario()) == [0.1, 0.1, 0.1]
    finally:
        plane.close()
