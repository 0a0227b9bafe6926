"""The rendezvous replica: gRPC in front, etcd behind, the leader's pure
policy (``rollcall.membership.leader.Leader``, which owns the roll-call
``Coordinator`` and the ``FailureDetector``) in the middle.

One replica serves one job. Every replica answers ``Status`` and ``Watch``;
the one that holds the job's etcd election runs roll calls and serves
``Join``, ``Session`` and ``Leave``. All mutable state is owned by one asyncio
event loop, so no locks: etcd calls (blocking client) run in a small thread
pool and their results come back to the loop.

``Replica`` is put together from its parts in ``rollcall.rendezvous.replica``,
one concern each (election, sessions, the unary calls, checkpoints, the
leader's actions, over one shared state); it adds only its lifecycle.
"""

from __future__ import annotations

import asyncio

from rollcall.membership.errors import ControlPlaneUnavailable
from rollcall.membership.view import View
from rollcall.pb import rendezvous_pb2_grpc as pb_grpc
from rollcall.rendezvous.replica.calls import MemberCalls
from rollcall.rendezvous.replica.election import Election
from rollcall.rendezvous.replica.sessions import Sessions
from rollcall.rendezvous.store import LeaderInfo

__all__ = ["Replica"]


class Replica(Election, Sessions, MemberCalls, pb_grpc.RendezvousServicer):
    """One rendezvous replica for one job."""

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def on_view(view: View) -> None:
            loop.call_soon_threadsafe(self._observe_stored_view, view)

        def on_leader(leader: LeaderInfo | None) -> None:
            loop.call_soon_threadsafe(self._leader_seen, leader)

        self._cancel_watches.append(self._store.watch_view(on_view))
        self._cancel_watches.append(self._store.watch_leader(on_leader))
        self._tasks.append(asyncio.create_task(self._campaign_forever(), name="campaign"))
        self._tasks.append(asyncio.create_task(self._poll_view_forever(), name="poll-view"))
        self._tasks.append(asyncio.create_task(self._compare_with_leader(), name="timing"))

    async def stop(self) -> None:
        """Step down (resigning the election so a standby takes over at once)."""
        self._stopping = True
        lead = self._lead
        if lead is not None:
            self._lose(lead, "replica shutting down")
            try:
                await self._etcd(self._store.resign, lead.info)
            except ControlPlaneUnavailable:
                pass
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for cancel in self._cancel_watches:
            cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._join_pool.shutdown(wait=False, cancel_futures=True)
