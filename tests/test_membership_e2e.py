"""Membership end to end: a real etcd, a real `rollcall rendezvous` process,
and real members (in-process async clients, or member processes that the
tests kill, freeze and terminate). Each test checks one behaviour of
docs/protocol.md: concurrent joins and leaves converge on one view, failures
are detected within their bounds, an evicted member is fenced, and every
member sees the same view for each epoch.

Timings are printed (run with ``-s`` to see them); the assertions only hold
them to the documented bounds, with no tighter guesses.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import pytest

from rollcall.membership.config import Config
from rollcall.membership.view import View
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.pb import rendezvous_pb2_grpc as pb_grpc
from rollcall.protocol.wire import token_metadata
from tests.harness import ControlPlane, MemberProcess

pytestmark = pytest.mark.integration

#: The bound the protocol promises between a member's last heartbeat and a
#: committed view without it (docs/protocol.md, "Failure signals").
EVICTION_BOUND = Config().eviction_bound()
#: A clean leave needs no detector: the others must reconfigure well before
#: the detector could have fired.
CLEAN_LEAVE_BOUND = 1.0
#: Safety bound for convergence that has no documented bound of its own
#: (joins): generous, so a slow machine does not fail the test.
CONVERGENCE_TIMEOUT = 20.0


# --- in-process clients ---------------------------------------------------------


def peer_address(index: int) -> str:
    """A distinct, well-formed peer address for client ``index`` (nobody dials it)."""
    return f"127.0.0.1:{20000 + index}"


async def join_all(plane: ControlPlane, count: int, first_index: int = 0) -> list[Any]:
    """``count`` new clients joining at once; returns them (joined, not yet in a view)."""
    clients = [plane.client() for _ in range(count)]
    await asyncio.gather(
        *(
            client.join(peer_address(first_index + n), name=f"w{first_index + n}")
            for n, client in enumerate(clients)
        )
    )
    return clients


async def all_hold(
    clients: Sequence[Any], predicate: Callable[[View], bool], timeout: float
) -> list[View]:
    """Wait until every client holds a view satisfying ``predicate``."""
    return list(await asyncio.gather(*(client.wait_view(predicate, timeout) for client in clients)))


async def close_all(clients: Sequence[Any]) -> None:
    await asyncio.gather(*(client.close() for client in clients), return_exceptions=True)


def same_view(views: Sequence[View]) -> bool:
    return len({(v.epoch, v.ids) for v in views}) == 1


# --- member processes -------------------------------------------------------------


def is_view(event: dict[str, Any]) -> bool:
    return event["event"] == "view"


def wait_all_see(members: Sequence[MemberProcess], ids: Sequence[str], timeout: float) -> int:
    """Wait until every member reported a view of exactly ``ids`` (any order);
    returns its epoch, the same for all."""
    wanted = set(ids)
    epochs = {
        m.wait_event(lambda e: is_view(e) and set(e["members"]) == wanted, timeout)["epoch"]
        for m in members
    }
    assert len(epochs) == 1, f"members saw {sorted(wanted)} at different epochs: {epochs}"
    return epochs.pop()


def wait_view_without(
    members: Sequence[MemberProcess], gone: str, after_epoch: int, timeout: float
) -> list[dict[str, Any]]:
    """The first view after ``after_epoch`` without ``gone``, as each member reported it."""
    return [
        m.wait_event(
            lambda e: is_view(e) and e["epoch"] > after_epoch and gone not in e["members"],
            timeout,
        )
        for m in members
    ]


def start_members(plane: ControlPlane, count: int) -> tuple[list[MemberProcess], int]:
    """``count`` member processes, all in one view; returns them and its epoch."""
    members = [plane.add_member(name=f"p{n}") for n in range(count)]
    epoch = wait_all_see(members, [m.member_id for m in members], CONVERGENCE_TIMEOUT)
    return members, epoch


def status_summary(plane: ControlPlane) -> tuple[int, list[tuple[str, int]]]:
    status = plane.status_json()
    return status["epoch"], [(m["id"], m["rank"]) for m in status["members"]]


# --- the tests ----------------------------------------------------------------------


def test_sixteen_concurrent_joins_end_in_one_view_all_receive(control_plane: ControlPlane) -> None:
    async def scenario() -> tuple[list[View], dict[str, Any], float]:
        started = time.monotonic()
        clients = await join_all(control_plane, 16)
        try:
            ids = {client.member_id for client in clients}
            await all_hold(clients, lambda v: ids <= set(v.ids), CONVERGENCE_TIMEOUT)
            elapsed = time.monotonic() - started
            # Status runs as a command; off the loop so the sessions keep heartbeating.
            status = await asyncio.to_thread(control_plane.status_json)
            return [client.view for client in clients], status, elapsed
        finally:
            await close_all(clients)

    views, status, elapsed = asyncio.run(scenario())

    assert same_view(views), (
        f"clients ended in different views: {[(v.epoch, v.ids) for v in views]}"
    )
    final = views[0]
    assert final.size == 16
    assert status["epoch"] == final.epoch
    assert [m["id"] for m in status["members"]] == list(final.ids)
    assert [m["rank"] for m in status["members"]] == list(range(16))
    print(
        f"\n16 concurrent joins: one view at epoch {final.epoch} "
        f"({final.epoch} epoch(s) from the empty view) after {elapsed * 1000:.0f} ms"
    )


def test_eight_join_and_eight_leave_concurrently_then_all_agree(
    control_plane: ControlPlane,
) -> None:
    async def scenario() -> tuple[View, list[View], list[str], list[str], float]:
        first = await join_all(control_plane, 16)
        clients = list(first)
        try:
            ids = {client.member_id for client in first}
            before = (await all_hold(first, lambda v: ids <= set(v.ids), CONVERGENCE_TIMEOUT))[0]
            order = list(before.ids)
            leaving = {order[rank] for rank in range(1, 16, 2)}
            survivors = [c for c in first if c.member_id not in leaving]
            leavers = [c for c in first if c.member_id in leaving]

            started = time.monotonic()
            joining = [control_plane.client() for _ in range(8)]
            clients += joining
            await asyncio.gather(
                *(c.leave() for c in leavers),
                *(c.join(peer_address(16 + n), name=f"j{n}") for n, c in enumerate(joining)),
            )
            remaining = survivors + joining
            wanted = {c.member_id for c in remaining}
            await all_hold(remaining, lambda v: set(v.ids) == wanted, CONVERGENCE_TIMEOUT)
            elapsed = time.monotonic() - started
            survivor_ids = [i for i in order if i not in leaving]
            joiner_ids = [c.member_id for c in joining]
            return before, [c.view for c in remaining], survivor_ids, joiner_ids, elapsed
        finally:
            await close_all(clients)

    before, views, survivor_ids, joiner_ids, elapsed = asyncio.run(scenario())

    assert same_view(views), (
        f"clients ended in different views: {[(v.epoch, v.ids) for v in views]}"
    )
    final = views[0]
    assert list(final.ids[:8]) == survivor_ids, "survivors must keep their relative order, first"
    assert set(final.ids[8:]) == set(joiner_ids), "joiners must come after the survivors"
    assert final.epoch > before.epoch
    print(
        f"\n8 joins + 8 leaves: epoch {before.epoch} -> {final.epoch} "
        f"({final.epoch - before.epoch} epoch(s)) in {elapsed * 1000:.0f} ms"
    )


def test_sigkilled_member_is_out_within_bound(control_plane: ControlPlane) -> None:
    members, epoch = start_members(control_plane, 3)
    victim, others = members[0], members[1:]

    started = time.monotonic()
    victim.kill()
    seen = wait_view_without(others, victim.member_id, epoch, EVICTION_BOUND + 10)
    elapsed = time.monotonic() - started

    print(
        f"\nSIGKILL: others saw the view without the victim after {elapsed * 1000:.0f} ms "
        f"(bound {EVICTION_BOUND:.2f} s)"
    )
    assert elapsed <= EVICTION_BOUND
    assert seen[0] == seen[1]
    assert seen[0]["members"] == [m.member_id for m in others]


def test_frozen_member_is_out_within_detector_bound_and_fenced_after_thaw(
    control_plane: ControlPlane,
) -> None:
    members, epoch = start_members(control_plane, 3)
    victim, others = members[1], [members[0], members[2]]
    old_id = victim.member_id
    old_epoch = victim.views()[-1]["epoch"]
    assert old_epoch == epoch

    started = time.monotonic()
    victim.signal(signal.SIGSTOP)
    seen = wait_view_without(others, old_id, epoch, EVICTION_BOUND + 10)
    elapsed = time.monotonic() - started
    print(
        f"\nSIGSTOP: others saw the view without the frozen member after "
        f"{elapsed * 1000:.0f} ms (bound {EVICTION_BOUND:.2f} s)"
    )
    assert elapsed <= EVICTION_BOUND
    eviction_epoch = seen[0]["epoch"]
    assert all(s["epoch"] == eviction_epoch for s in seen)

    victim.signal(signal.SIGCONT)
    ended = victim.wait_event(lambda e: e["event"] in ("ended", "left", "leave-failed"), 10)
    assert ended["event"] == "ended" and ended["error"] == "Evicted", ended

    before = status_summary(control_plane)
    assert before[0] == eviction_epoch

    async def act_with_old_identity() -> tuple[grpc.aio.AioRpcError | None, tuple[Any, str]]:
        # A session the service wrongly accepts would stay open: bound the
        # wait, and report that as the outcome rather than as a timeout.
        metadata = token_metadata(control_plane.token)
        async with grpc.aio.insecure_channel(control_plane.replicas[0].address) as channel:
            stub = pb_grpc.RendezvousStub(channel)
            leave_error = None
            try:
                await asyncio.wait_for(
                    stub.Leave(
                        pb.LeaveRequest(job=control_plane.job, member_id=old_id, epoch=old_epoch),
                        metadata=metadata,
                    ),
                    10,
                )
            except grpc.aio.AioRpcError as error:
                leave_error = error
            session = stub.Session(metadata=metadata)
            try:
                await session.write(
                    pb.SessionRequest(
                        open=pb.Open(job=control_plane.job, member_id=old_id, epoch=old_epoch)
                    )
                )
                code = await asyncio.wait_for(session.code(), 10)
                return leave_error, (code, await session.details() or "")
            except TimeoutError:
                return leave_error, (None, "the session stayed open for 10 s")
            finally:
                session.cancel()

    leave_error, (session_code, session_details) = asyncio.run(act_with_old_identity())

    assert leave_error is not None, "Leave with an evicted id and its old epoch succeeded"
    assert leave_error.code() == grpc.StatusCode.FAILED_PRECONDITION, leave_error
    assert "stale" in (leave_error.details() or "")
    assert session_code == grpc.StatusCode.FAILED_PRECONDITION, (session_code, session_details)
    assert "stale" in session_details
    time.sleep(0.3)  # room for any (wrong) roll call the attempts might have started
    assert status_summary(control_plane) == before
    assert all(m.views()[-1]["epoch"] == eviction_epoch for m in others)

    rejoined = control_plane.add_member(name="p1")
    assert rejoined.member_id != old_id
    after = [
        m.wait_event(lambda e: is_view(e) and rejoined.member_id in e["members"], 10)
        for m in [*others, rejoined]
    ]
    assert {a["epoch"] for a in after} == {eviction_epoch + 1}
    assert after[0]["members"] == [*(m.member_id for m in others), rejoined.member_id]


def test_clean_leave_reconfigures_without_timeout(control_plane: ControlPlane) -> None:
    members, epoch = start_members(control_plane, 3)
    leaver, others = members[2], members[:2]

    started = time.monotonic()
    leaver.signal(signal.SIGTERM)
    seen = wait_view_without(others, leaver.member_id, epoch, EVICTION_BOUND + 10)
    elapsed = time.monotonic() - started
    outcome = leaver.wait_event(lambda e: e["event"] in ("left", "leave-failed", "ended"), 10)

    print(
        f"\nSIGTERM (clean leave): others saw the new view after {elapsed * 1000:.0f} ms "
        f"(bound {CLEAN_LEAVE_BOUND:.1f} s, detector would need ~0.4 s+)"
    )
    assert outcome["event"] == "left", outcome
    assert leaver.proc.wait(timeout=10) == 0
    assert elapsed < CLEAN_LEAVE_BOUND
    assert seen[0]["epoch"] == seen[1]["epoch"] == epoch + 1
    assert seen[0]["members"] == [m.member_id for m in others]


def test_views_are_consistent_across_members(control_plane: ControlPlane) -> None:
    members, epoch = start_members(control_plane, 4)
    a, killed, left, d = members

    killed.kill()
    gone = wait_view_without([a, left, d], killed.member_id, epoch, EVICTION_BOUND + 10)
    epoch = gone[0]["epoch"]
    left.signal(signal.SIGTERM)
    left.wait_event(lambda e: e["event"] == "left", 10)
    wait_view_without([a, d], left.member_id, epoch, EVICTION_BOUND + 10)
    e = control_plane.add_member(name="p4")
    survivors = [a, d, e]
    final_epoch = wait_all_see(survivors, [m.member_id for m in survivors], CONVERGENCE_TIMEOUT)

    by_epoch: dict[int, dict[str, list[str]]] = {}
    repeated: dict[str, list[int]] = {}
    for member in [a, killed, left, d, e]:
        history = member.views()
        epochs = [v["epoch"] for v in history]
        if epochs != sorted(set(epochs)):
            repeated[member.member_id] = epochs
        for v in history:
            by_epoch.setdefault(v["epoch"], {})[member.member_id] = v["members"]
    assert not repeated, f"epochs not strictly increasing in these histories: {repeated}"

    for number, seen_by in sorted(by_epoch.items()):
        lists = {tuple(ids) for ids in seen_by.values()}
        assert len(lists) == 1, f"epoch {number} has several views: {seen_by}"
    shared = [n for n, seen_by in by_epoch.items() if len(seen_by) > 1]
    assert len(shared) >= 4, f"too few epochs seen by several members to compare: {by_epoch}"
    final = next(iter(by_epoch[final_epoch].values()))
    assert final == [m.member_id for m in survivors]
    print(
        f"\nconsistency: {len(by_epoch)} epochs, {len(shared)} seen by several members; "
        f"final epoch {final_epoch}"
    )
