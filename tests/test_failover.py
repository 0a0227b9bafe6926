"""Failover of the control plane, end to end: a rendezvous leader killed
(with and without a roll call in flight), an etcd member killed, etcd down
altogether. Real etcd, real `rollcall rendezvous` replicas, real member
processes; failures are SIGKILLs.

What must hold throughout (docs/protocol.md, "Leader election and failover"
and "etcd unavailable"): no live member is evicted by a control-plane
failure, and no epoch is ever committed with two different member lists.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable
from contextlib import closing
from pathlib import Path
from typing import Any

import grpc
import pytest

from rollcall.etcd_local import LocalEtcd, LocalEtcdCluster
from rollcall.membership.config import Config
from rollcall.membership.errors import ControlPlaneUnavailable
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.pb import rendezvous_pb2_grpc as pb_grpc
from rollcall.protocol.client import RendezvousClient
from rollcall.protocol.wire import token_metadata
from tests.harness import (
    ROOT,
    TEST_SETTINGS,
    AgentProcess,
    ControlPlane,
    MemberProcess,
    ReplicaProcess,
)

pytestmark = pytest.mark.integration

#: The replicas' settings in these tests (tests.harness.TEST_SETTINGS).
SETTINGS = Config(member_lease_ttl=6, election_ttl=2, takeover_grace=2.0)
#: Generous bound for anything that should take a few seconds.
BOUND = 20.0


# --- observing members --------------------------------------------------------


def _events(member: MemberProcess) -> list[dict[str, Any]]:
    """Every JSON event the member printed so far."""
    member.views()  # moves the lines printed so far into member.seen
    return [json.loads(line) for line in member.seen if line.startswith("{")]


def _assert_none_ended(members: Iterable[MemberProcess]) -> None:
    for member in members:
        ended = [e for e in _events(member) if e["event"] in ("ended", "left")]
        assert not ended, f"member {member.member_id} ended: {ended}\n{member.log_tail()}"
        assert member.proc.poll() is None, f"member {member.member_id} exited"


def _wait_view(member: MemberProcess, ids: set[str], timeout: float = BOUND) -> dict[str, Any]:
    """The first view the member received whose members are exactly ``ids``."""
    return member.wait_event(
        lambda e: e["event"] == "view" and set(e["members"]) == ids, timeout=timeout
    )


def _assert_one_member_list_per_epoch(members: Iterable[MemberProcess]) -> None:
    """Epochs only go up at each member, and every member that received an
    epoch received the same member list for it. (A member may be handed the
    same view twice, for instance by Join and again when its session opens;
    that is a re-delivery, not a repeated epoch.)"""
    by_epoch: dict[int, list[str]] = {}
    for member in members:
        views = member.views()
        epochs = [v["epoch"] for v in views]
        assert epochs == sorted(epochs), f"{member.member_id} saw epochs go back: {epochs}"
        for view in views:
            first = by_epoch.setdefault(view["epoch"], view["members"])
            assert view["members"] == first, (
                f"epoch {view['epoch']} was committed twice: {first} and {view['members']}"
            )
    print(f"  epochs seen: { {e: len(m) for e, m in sorted(by_epoch.items())} } (epoch: size)")


def _member_ids(status: dict[str, Any]) -> set[str]:
    return {m["id"] for m in status["members"]}


# --- observing replicas and etcd ---------------------------------------------------


def _log_lines(replica: ReplicaProcess, containing: str) -> list[str]:
    text = replica.log_path.read_text(errors="replace")
    return [line for line in text.splitlines() if containing in line]


def _eventually(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until ``check()`` held; fails the test after ``timeout``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)
    return time.monotonic() - start


async def _leader_named_by(address: str, plane: ControlPlane) -> str:
    """The leader that the replica at ``address`` names ("" if none or unreachable)."""
    client = RendezvousClient([address], plane.job, plane.token, Config(client_call_deadline=1.0))
    try:
        return (await client.status()).leader
    except ControlPlaneUnavailable:
        return ""
    finally:
        await client.close()


def _etcd_members_in_use(pid: int, cluster: LocalEtcdCluster) -> set[int]:
    """Indices of the etcd members the process ``pid`` holds a connection to."""
    out = subprocess.run(
        ["ss", "-tnpH", "state", "established"], capture_output=True, text=True, check=True
    ).stdout
    by_port = {str(m.client_port): i for i, m in enumerate(cluster.members)}
    used = set()
    for line in out.splitlines():
        if f"pid={pid}," in line:
            peer_port = line.split()[3].rsplit(":", 1)[1]
            if peer_port in by_port:
                used.add(by_port[peer_port])
    return used


def _etcd_raft_leader(cluster: LocalEtcdCluster) -> int:
    """Index of the etcd member that is the raft leader (etcd's JSON gateway)."""
    for index, member in enumerate(cluster.members):
        request = urllib.request.Request(f"{member.endpoint}/v3/maintenance/status", data=b"{}")
        with urllib.request.urlopen(request, timeout=5) as response:
            status = json.load(response)
        if status["header"]["member_id"] == status["leader"]:
            return index
    raise AssertionError("no etcd member is the raft leader")


# --- a leader replica killed ----------------------------------------------------------


def test_standby_takes_over_when_leader_is_killed_without_evicting_members(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    with closing(ControlPlane([etcd.endpoint], tmp_path, replicas=2)) as plane:
        members = [plane.add_member() for _ in range(3)]
        ids = {m.member_id for m in members}
        for member in members:
            _wait_view(member, ids)
        before = plane.status_json()
        assert _member_ids(before) == ids
        leader = next(r for r in plane.replicas if r.address == before["leader"])
        standby = next(r for r in plane.replicas if r is not leader)

        killed_at = time.monotonic()
        leader.kill()
        took_over = _eventually(
            lambda: asyncio.run(_leader_named_by(standby.address, plane)) == standby.address,
            BOUND,
            "the standby answers as leader",
        )
        print(f"\n  kill -> standby answers as leader: {took_over:.2f} s")
        _eventually(
            lambda: all(_log_lines(standby, f"session open: {i} ") for i in ids),
            BOUND,
            "every member's session reopens on the new leader",
        )
        reconnected = time.monotonic() - killed_at
        print(f"  kill -> all 3 sessions reopened on the new leader: {reconnected:.2f} s")
        assert plane.status_json()["leader"] == standby.address

        # Past the takeover grace, members that had not come back would be
        # suspected; every one of them did, so nobody may be evicted.
        settle = took_over + SETTINGS.takeover_grace + 2.0
        time.sleep(max(0.0, killed_at + settle - time.monotonic()))
        after = plane.status_json()
        print(f"  epoch before the kill {before['epoch']}, {settle:.1f} s after: {after['epoch']}")
        assert _member_ids(after) == ids
        assert after["leader"] == standby.address
        _assert_none_ended(members)

        joined_at = time.monotonic()
        newcomer = plane.add_member()
        everyone = ids | {newcomer.member_id}
        for member in [*members, newcomer]:
            _wait_view(member, everyone)
        took = time.monotonic() - joined_at
        print(f"  join after failover -> view of 4 everywhere: {took:.2f} s")
        assert _member_ids(plane.status_json()) == everyone
        _assert_none_ended([*members, newcomer])
        _assert_one_member_list_per_epoch([*members, newcomer])


def test_a_session_says_when_it_is_between_leaders(etcd: LocalEtcd, tmp_path: Path) -> None:
    """What a worker's fence waits for past ``fence_patience``
    (docs/worker.md, "Fencing"): a session is between leaders from the
    leader's death until the next leader acknowledges one of its
    heartbeats, and not while a leader does."""
    with closing(ControlPlane([etcd.endpoint], tmp_path, replicas=2)) as plane:
        leader = next(r for r in plane.replicas if r.address == plane.status_json()["leader"])

        async def until(client: RendezvousClient, between: bool) -> None:
            deadline = time.monotonic() + BOUND
            while client.between_leaders() != between:
                assert time.monotonic() < deadline, f"between_leaders() stayed {not between}"
                await asyncio.sleep(0.02)

        async def scenario() -> None:
            client = RendezvousClient(plane.addresses, plane.job, plane.token)
            try:
                await client.join("127.0.0.1:1", name="client")
                await client.wait_member(BOUND)
                await until(client, between=False)
                acked = client.last_acked
                leader.kill()
                await until(client, between=True)
                await until(client, between=False)  # the standby leads and acknowledges
                assert client.last_acked > acked
                assert client.ended is None
            finally:
                await client.close()

        asyncio.run(scenario())


@pytest.mark.parametrize("session", ["own", "agent"])
def test_a_member_leaves_when_a_failover_hands_it_to_a_leader_with_unsafe_timing(
    etcd: LocalEtcd, tmp_path: Path, session: str
) -> None:
    """Replicas of one job started with different settings: a member checks
    the timing of the leader it joins through, and must check the one a
    failover hands it to as well. A leader that waits less for a step's end
    than the member would evicts it at the first join; the member leaves at
    once, with the error that says what to change, on its own session or on
    a host agent's."""
    with closing(ControlPlane([etcd.endpoint], tmp_path, replicas=1)) as plane:
        first = plane.replicas[0]
        hasty = ReplicaProcess(
            plane.etcd, plane.job, plane.token_file, plane._free_port(),
            tmp_path / "replica-hasty.log", (*TEST_SETTINGS, "rollcall_step_end_wait=0.1"),
        )  # fmt: skip
        plane.replicas.append(hasty)
        agent = AgentProcess(plane, tmp_path) if session == "agent" else None
        try:
            member = plane.add_member(agent=agent.address if agent is not None else None)
            _wait_view(member, {member.member_id})
            assert plane.status_json()["leader"] == first.address
            _assert_none_ended([member])

            first.kill()
            ended = member.wait_event(lambda e: e["event"] == "ended", timeout=BOUND)
            assert ended["error"] == "UnsafeStepEndWait", ended
            assert "rollcall_step_end_wait=SECONDS" in ended["message"]
            assert "waits only 0.1 s" in ended["message"]
            # It left (rather than wait to be suspected): the new leader's
            # view goes on without it.
            _eventually(
                lambda: plane.status_json()["leader"] == hasty.address
                and not _member_ids(plane.status_json()),
                BOUND, "the refusing member is out of the new leader's view",
            )  # fmt: skip
            assert _log_lines(hasty, f"leave {member.member_id}"), hasty.log_tail()
        finally:
            if agent is not None:
                agent.stop(timeout=5)


def test_replicas_with_other_timing_settings_than_their_leader_say_so(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    """A replica started with other timing settings than the job's leader
    says so at once (rather than at the failover that would make workers
    leave), and again for each new leader: read at its start, and from the
    watch of the leader key. A replica whose settings match says nothing."""
    said = "runs with other timing settings than its leader"
    with closing(ControlPlane([etcd.endpoint], tmp_path, replicas=2)) as plane:
        first, same = plane.replicas
        hasty = ReplicaProcess(
            plane.etcd, plane.job, plane.token_file, plane._free_port(),
            tmp_path / "replica-hasty.log", (*TEST_SETTINGS, "rollcall_step_end_wait=0.1"),
        )  # fmt: skip
        plane.replicas.append(hasty)
        assert plane.status_json()["leader"] == first.address
        _eventually(lambda: bool(_log_lines(hasty, said)), BOUND, "the hasty standby says so")
        (line,) = _log_lines(hasty, said)
        assert f"its leader {first.address}" in line
        assert "rollcall_step_end_wait 0.1 s here, 0.5 s at the leader" in line
        assert "earliest_suspicion" not in line and "election_ttl" not in line

        first.kill()
        _eventually(
            lambda: asyncio.run(_leader_named_by(same.address, plane)) in (same.address,
                                                                           hasty.address),
            BOUND, "a standby leads",
        )  # fmt: skip
        leader = asyncio.run(_leader_named_by(same.address, plane))
        other = hasty if leader == same.address else same
        _eventually(
            lambda: any(f"its leader {leader}" in x for x in _log_lines(other, said)),
            BOUND, "the replica that does not lead says so of the new leader",
        )  # fmt: skip
        assert not _log_lines(first, said)
        assert not [x for x in _log_lines(same, said) if first.address in x]


def test_rollcall_in_progress_during_leader_kill_completes_or_is_retried(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    with closing(ControlPlane([etcd.endpoint], tmp_path, replicas=2)) as plane:
        members = [plane.add_member() for _ in range(2)]
        ids = {m.member_id for m in members}
        for member in members:
            _wait_view(member, ids)
        leader_address = plane.status_json()["leader"]
        leader = next(r for r in plane.replicas if r.address == leader_address)

        joiner = plane.add_member()  # returns as soon as Join has answered
        killed_at = time.monotonic()
        leader.kill()
        everyone = ids | {joiner.member_id}
        committed_before_kill = [
            line for line in _log_lines(leader, "committed epoch") if "3 members" in line
        ]
        print(
            "\n  old leader committed the view of 3 before dying: "
            f"{'yes' if committed_before_kill else 'no (the new leader ran the roll call)'}"
        )

        for member in [*members, joiner]:
            _wait_view(member, everyone)
        print(f"  kill -> all 3 members hold the view of 3: {time.monotonic() - killed_at:.2f} s")
        status = plane.status_json()
        assert _member_ids(status) == everyone
        latest = {m.member_id: m.views()[-1] for m in [*members, joiner]}
        assert {v["epoch"] for v in latest.values()} == {status["epoch"]}, latest
        _assert_none_ended([*members, joiner])
        _assert_one_member_list_per_epoch([*members, joiner])


# --- etcd failures --------------------------------------------------------------------


@pytest.mark.parametrize("victim", ["follower", "in_use", "raft_leader"])
def test_killing_one_etcd_member_changes_nothing_visible(
    etcd_cluster: LocalEtcdCluster, tmp_path: Path, victim: str
) -> None:
    with closing(ControlPlane(etcd_cluster.endpoints, tmp_path, replicas=1)) as plane:
        members = [plane.add_member() for _ in range(3)]
        ids = {m.member_id for m in members}
        for member in members:
            _wait_view(member, ids)
        before = plane.status_json()

        in_use = _etcd_members_in_use(plane.replicas[0].pid, etcd_cluster)
        assert len(in_use) == 1, f"replica connected to etcd members {in_use}"
        raft_leader = _etcd_raft_leader(etcd_cluster)
        if victim == "in_use":
            index = next(iter(in_use))
        elif victim == "raft_leader":
            index = raft_leader
        else:
            index = next(i for i in range(3) if i not in in_use and i != raft_leader)
        print(
            f"\n  killing etcd member {index} ({victim}; replica uses {sorted(in_use)}, "
            f"raft leader {raft_leader})"
        )
        killed_at = time.monotonic()
        etcd_cluster.kill(index)

        answers = []
        while time.monotonic() - killed_at < 3.0:
            asked_at = time.monotonic()
            status = plane.status_json()
            answers.append(time.monotonic() - asked_at)
            assert (status["epoch"], _member_ids(status)) == (before["epoch"], ids)
            assert status["leader"] == before["leader"]
        print(f"  status answered {len(answers)} times, slowest {max(answers):.2f} s")
        _assert_none_ended(members)

        joined_at = time.monotonic()
        newcomer = plane.add_member()
        everyone = ids | {newcomer.member_id}
        for member in [*members, newcomer]:
            _wait_view(member, everyone)
        took = time.monotonic() - joined_at
        print(f"  join with one etcd member down -> view of 4: {took:.2f} s")
        assert _member_ids(plane.status_json()) == everyone
        _assert_none_ended([*members, newcomer])
        _assert_one_member_list_per_epoch([*members, newcomer])


async def _raw_join_while_etcd_is_down(plane: ControlPlane) -> None:
    """Join answers UNAVAILABLE "control plane unavailable" on the wire, and
    the client raises ControlPlaneUnavailable."""
    async with grpc.aio.insecure_channel(plane.addresses[0]) as channel:
        asked_at = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            await pb_grpc.RendezvousStub(channel).Join(
                pb.JoinRequest(job=plane.job, address="127.0.0.1:1", name="raw"),
                metadata=token_metadata(plane.token),
                timeout=BOUND,
            )
        print(f"  raw Join refused in {time.monotonic() - asked_at:.2f} s: {raw.value.details()}")
        assert raw.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "control plane unavailable" in (raw.value.details() or "")

    client = RendezvousClient(
        plane.addresses, plane.job, plane.token,
        Config(client_call_deadline=1.0, join_deadline=1.0),
    )  # fmt: skip
    try:
        with pytest.raises(ControlPlaneUnavailable):
            await client.join("127.0.0.1:1", name="client")
    finally:
        await client.close()


def test_etcd_down_gives_control_plane_unavailable_and_sessions_wait(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    with closing(ControlPlane([etcd.endpoint], tmp_path, replicas=1)) as plane:
        members = [plane.add_member() for _ in range(2)]
        ids = {m.member_id for m in members}
        for member in members:
            _wait_view(member, ids)
        before = plane.status_json()

        killed_at = time.monotonic()
        etcd.kill()
        print()
        status_cli = subprocess.Popen(
            [sys.executable, "-m", "rollcall.cli", "status", "--rendezvous",
             ",".join(plane.addresses), "--job", plane.job,
             "--token-file", str(plane.token_file), "--timeout", "3"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        asyncio.run(_raw_join_while_etcd_is_down(plane))
        _, stderr = status_cli.communicate(timeout=60)
        print(f"  rollcall status, etcd down: exit {status_cli.returncode}: {stderr.strip()}")
        assert status_cli.returncode != 0
        assert len(stderr.strip().splitlines()) == 1, stderr
        assert "control plane unavailable" in stderr
        assert "Traceback" not in stderr

        time.sleep(max(0.0, killed_at + 3.0 - time.monotonic()))
        _assert_none_ended(members)
        outage = time.monotonic() - killed_at
        etcd.start()
        print(f"  etcd down for {outage:.2f} s (member leases: {SETTINGS.member_lease_ttl} s)")

        after = plane.status_json()
        assert (after["epoch"], _member_ids(after)) == (before["epoch"], ids)
        joined_at = time.monotonic()
        newcomer = plane.add_member()
        everyone = ids | {newcomer.member_id}
        for member in [*members, newcomer]:
            _wait_view(member, everyone)
        print(f"  join after etcd is back -> view of 3: {time.monotonic() - joined_at:.2f} s")
        suspicions = _log_lines(plane.replicas[0], "suspect")
        print(f"  suspicions logged by the replica: {suspicions or 'none'}")
        _assert_none_ended([*members, newcomer])
        _assert_one_member_list_per_epoch([*members, newcomer])


async def _client_join_error(plane: ControlPlane, deadline: float) -> str:
    client = RendezvousClient(
        plane.addresses, plane.job, plane.token,
        Config(client_call_deadline=deadline, join_deadline=deadline),
    )  # fmt: skip
    try:
        await client.join("127.0.0.1:1", name="client")
    except ControlPlaneUnavailable as error:
        return str(error)
    finally:
        await client.close()
    raise AssertionError("Join succeeded while etcd was down")


def test_client_join_while_etcd_is_down_names_the_cause(etcd: LocalEtcd, tmp_path: Path) -> None:
    """Whenever the client gives up, its error says why: the control plane
    (etcd) is unavailable, not merely that time ran out. Several clients with
    different deadlines give up at different points of their retry schedule."""
    with closing(ControlPlane([etcd.endpoint], tmp_path, replicas=1)) as plane:
        assert plane.status_json()["leader"] == plane.addresses[0]
        etcd.kill()

        async def join_all() -> list[str]:
            # Each long enough for a replica to answer once even on a loaded
            # machine; they still end at different points of the retry schedule.
            deadlines = [1.5 + 0.1 * i for i in range(12)]
            return await asyncio.gather(*(_client_join_error(plane, d) for d in deadlines))

        errors = asyncio.run(join_all())
        print("\n" + "\n".join(f"  client Join gave up: {e}" for e in errors))
        assert all("control plane unavailable" in e for e in errors), errors
