"""The host agent end to end: a real etcd, a real `rollcall rendezvous`, a
real `rollcall agent` process, and members (in this process and as their
own processes) whose sessions it carries on one shared stream. Members
behind the agent are members like any other; one killed is suspected at
once, one frozen is found by the agent's detector; and the agent dying
evicts nobody: its members open their sessions on the replicas directly."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollcall.membership.config import Config
from rollcall.membership.errors import InvalidRequest
from rollcall.protocol.client import RendezvousClient
from tests.harness import AgentProcess, ControlPlane, wait_for

pytestmark = pytest.mark.integration

TIMEOUT = 20.0


@pytest.fixture
def agent(control_plane: ControlPlane, tmp_path: Path) -> Iterator[AgentProcess]:
    process = AgentProcess(control_plane, tmp_path)
    try:
        yield process
    finally:
        process.stop(timeout=5)


def replica_log(plane: ControlPlane) -> str:
    return (plane.workdir / "replica0.log").read_text(errors="replace")


def test_members_behind_the_agent_share_one_stream_and_are_members_like_any_other(
    control_plane: ControlPlane, agent: AgentProcess
) -> None:
    async def scenario() -> None:
        own = control_plane.client()
        behind = [
            RendezvousClient(control_plane.addresses, control_plane.job, control_plane.token,
                             agent=agent.address)  # fmt: skip
            for _ in range(3)
        ]
        await own.join("127.0.0.1:20700", name="own")
        for n, member in enumerate(behind):
            await member.join(f"127.0.0.1:{20701 + n}", name=f"a{n}")
        ids = {own.member_id, *(m.member_id for m in behind)}
        view = await own.wait_view(lambda v: ids <= set(v.ids), TIMEOUT)
        for member in behind:
            assert await member.wait_view(lambda v: v.epoch >= view.epoch, TIMEOUT) == view
            assert member.epoch_secret(view.epoch) == own.epoch_secret(view.epoch) is not None
        # The agent hands on the leader's acknowledgements of its stream as
        # acknowledgements of each member's own heartbeats.
        started = time.monotonic()
        await asyncio.sleep(0.6)
        assert all(m.last_acked > started for m in behind)
        await behind[0].leave()
        await behind[0].close()
        after = await own.wait_view(lambda v: behind[0].member_id not in v, TIMEOUT)
        assert await behind[1].wait_view(lambda v: v.epoch >= after.epoch, TIMEOUT) == after
        for member in (*behind[1:], own):
            await member.leave()
            await member.close()

    asyncio.run(scenario())
    log = replica_log(control_plane)
    assert log.count("on shared session @") == 3
    assert "INFO suspect " not in log


def test_a_killed_member_behind_the_agent_is_suspected_at_once(
    control_plane: ControlPlane, agent: AgentProcess
) -> None:
    keep = control_plane.add_member(name="keep", agent=agent.address)
    doomed = control_plane.add_member(name="doomed", agent=agent.address)
    both = {keep.member_id, doomed.member_id}
    joint = keep.wait_event(lambda e: e["event"] == "view" and both <= set(e["members"]), TIMEOUT)
    doomed.proc.kill()
    keep.wait_event(
        lambda e: e["event"] == "view" and e["epoch"] > joint["epoch"]
        and set(e["members"]) == {keep.member_id},
        TIMEOUT,
    )  # fmt: skip
    log = replica_log(control_plane)
    assert f"suspect {doomed.member_id}: session stream broken" in log


def test_a_frozen_member_behind_the_agent_is_found_by_the_agents_detector(
    control_plane: ControlPlane, agent: AgentProcess
) -> None:
    keep = control_plane.add_member(name="keep", agent=agent.address)
    frozen = control_plane.add_member(name="frozen", agent=agent.address)
    both = {keep.member_id, frozen.member_id}
    joint = keep.wait_event(lambda e: e["event"] == "view" and both <= set(e["members"]), TIMEOUT)
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        keep.wait_event(
            lambda e: e["event"] == "view" and e["epoch"] > joint["epoch"]
            and set(e["members"]) == {keep.member_id},
            TIMEOUT,
        )  # fmt: skip
        took = time.monotonic() - stopped
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    log = replica_log(control_plane)
    assert f"suspect {frozen.member_id}: silent, as the holder of its shared session saw it" in log
    # Not before the detector's earliest suspicion of a silent member.
    assert took >= Config().earliest_suspicion() - 0.1
    # Woken up, it learns it was taken off, and does not act in the job.
    frozen.wait_event(lambda e: e["event"] == "ended", TIMEOUT)


def test_the_agent_dying_evicts_nobody(control_plane: ControlPlane, tmp_path: Path) -> None:
    agent = AgentProcess(control_plane, tmp_path)
    try:
        members = [control_plane.add_member(name=f"m{n}", agent=agent.address)
                   for n in range(3)]  # fmt: skip
        ids = {m.member_id for m in members}
        first = members[0].wait_event(
            lambda e: e["event"] == "view" and ids <= set(e["members"]), TIMEOUT
        )
        agent.proc.kill()
        agent.proc.wait(timeout=10)

        def direct() -> bool:  # an Open of its own, not one on a shared session
            log = replica_log(control_plane)
            return all(re.search(rf"session open: {m} \(epoch \d+\)\n", log) for m in ids)

        wait_for(direct, "every member's session opened on the replica directly", TIMEOUT)
        time.sleep(2 * Config().earliest_suspicion())
        assert all(m.proc.poll() is None for m in members)
        views = members[0].views()
        assert views[-1]["epoch"] == first["epoch"], "a view change after the agent died"
        assert "INFO suspect " not in replica_log(control_plane)
    finally:
        agent.stop(timeout=5)


def test_the_agent_listens_on_this_host_only() -> None:
    from rollcall.agent.server import check_listen

    config = Config()
    assert check_listen("unix:/run/rollcall/agent.sock", config)
    assert check_listen("127.0.0.1:7070", config)
    assert check_listen("[::1]:7070", config)
    for outside in ("0.0.0.0:7070", "10.1.2.3:7070", "example.org:7070", "unix:"):
        with pytest.raises(InvalidRequest):
            check_listen(outside, config)
