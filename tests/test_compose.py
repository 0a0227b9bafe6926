"""The docker-compose deployment, for real: a private Docker engine in a
network namespace made here, the image built without a registry, the compose
project of deploy/ brought up, and every check read from outside the
containers with `rollcall status --json`.

The tests share one deployment and run in file order, each leaving it in the
state the next one starts from: 3 workers, then 4 (scaled), 3 (one killed),
2 (one cut off the network), then the control plane loses its rendezvous
leader and an etcd member. The first test pays for the engine, the image
(minutes from scratch, seconds from .cache/deploy) and `compose up`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import pytest

from rollcall.membership.config import Config
from tests.compose_harness import LOG_DIR, NETWORK, ComposeCluster, Container, Status
from tests.harness import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

#: Committed steps that count as "training advances" (the example commits
#: 5-20 steps per second here, with up to 4 workers on 2 cores).
PROGRESS = 15
#: Bound on PROGRESS steps, also right after a failure of the control plane:
#: training does not go through it (DESIGN.md), and a new rendezvous leader
#: takes over within election_ttl + takeover_grace (2 s + 3 s), after which
#: `status` reports the step again. A stall for the gloo timeout (30 s) fails.
PROGRESS_TIMEOUT = 20.0
#: Bound on a view change after a worker dies or is cut off (detection takes
#: at most max_silence + join_settle + rollcall_deadline, about 3 s).
EVICTION_TIMEOUT = 30.0
#: Bound on a new container joining: start, import torch, build the model,
#: join, pull the state, on a loaded 2-core machine.
JOIN_TIMEOUT = 90.0
ETCD_STATUS = (
    "etcdctl --endpoints=http://etcd1:2379,http://etcd2:2379,http://etcd3:2379"
    " endpoint status -w json"
)


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[ComposeCluster]:
    deployment = ComposeCluster()
    try:
        deployment.start(workers=3)
        yield deployment
    finally:
        try:
            deployment.close()
        finally:
            report_timings(request, deployment.timings)


def report_timings(request: pytest.FixtureRequest, timings: dict[str, float]) -> None:
    """Print how long each phase took, past pytest's output capture."""
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if capture is None or reporter is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        for what, seconds in timings.items():
            reporter.write_line(f"compose tier: {what:<45} {seconds:7.1f} s")
        reporter.write_line(f"compose tier: container logs in {LOG_DIR}")


def workers_in_view(cluster: ComposeCluster, status: Status) -> bool:
    """Every running worker container's address is a member, and only those."""
    running = {c.address for c in cluster.running("worker")}
    return None not in running and status.hosts == running


def settled(cluster: ComposeCluster) -> Status:
    """A reading with a committed step (right after a view change the step
    of the new epoch may not be reported yet)."""
    return cluster.wait_for_view(
        "a status with a committed step", lambda s: s.step is not None, PROGRESS_TIMEOUT
    )


def assert_training_advances(cluster: ComposeCluster) -> None:
    start = settled(cluster)
    assert start.step is not None
    cluster.wait_for_progress(start.step, PROGRESS, timeout=PROGRESS_TIMEOUT)


def test_training_advances(cluster: ComposeCluster) -> None:
    first = cluster.wait_for_view(
        "a view of the 3 worker containers with a committed step",
        lambda s: len(s.members) == 3 and s.step is not None and workers_in_view(cluster, s),
        timeout=JOIN_TIMEOUT,
    )
    assert first.step is not None
    later = cluster.wait_for_progress(first.step, PROGRESS, timeout=PROGRESS_TIMEOUT)
    assert later.epoch == first.epoch and later.members == first.members


def test_etcd_refuses_the_job_records_to_a_client_without_credentials(
    cluster: ComposeCluster,
) -> None:
    """Anyone on the compose network reaches etcd: without the rollcall
    user's password they can neither read nor write /rollcall/ (finding 8),
    while the replicas, which have it, serve the job (test_training_advances)."""
    etcd1 = cluster.running("etcd1")[0].id
    endpoints = "--endpoints=http://etcd1:2379"
    for argv in (["get", "--prefix", "/rollcall/"], ["put", "/rollcall/demo/leader", "x"]):
        done = cluster.run(
            ["docker", "exec", etcd1, "etcdctl", endpoints, "--command-timeout=5s", *argv],
            timeout=30, check=False,
        )  # fmt: skip
        assert done.returncode != 0, done.stdout
        assert "user name is empty" in done.stderr, done.stderr
    assert cluster.status().step is not None


def test_scaling_to_four_workers_adds_a_member_that_pulls_state(cluster: ComposeCluster) -> None:
    before = settled(cluster)
    old = {c.id for c in cluster.running()}
    assert before.step is not None and len(before.members) == 3

    with cluster.timed("scale 3 -> 4: new member in the view"):
        cluster.compose("up", "-d", "--scale", "worker=4", timeout=180)
        (new,) = [c for c in cluster.running("worker") if c.id not in old]
        joined = cluster.wait_for_view(
            f"{new.name} ({new.address}) in the view",
            lambda s: new.address in s.hosts and len(s.members) == 4,
            timeout=JOIN_TIMEOUT,
        )
    assert joined.epoch > before.epoch
    # The others were neither recreated nor restarted, and kept their ids.
    assert old < {c.id for c in cluster.running()}
    assert before.member_ids < joined.member_ids

    # It pulled the live state from its peers instead of starting at step 0:
    # its first committed step follows the step it pulled. (Being in the
    # view precedes its first commit: wait for that line.)
    def committed() -> str | None:
        log = cluster.logs(new)
        return log if '"event": "step"' in log else None

    log = wait_for(committed, f"{new.name} committing a step", PROGRESS_TIMEOUT, every=0.5)
    pulled = re.search(r"pulled step (\d+) \((\d+) bytes\) from (\d+) peers", log)
    assert pulled, f"{new.name} did not log a state pull:\n{log[-2000:]}"
    steps = [json.loads(line)["step"] for line in log.splitlines() if '"event": "step"' in line]
    assert steps[0] == int(pulled[1]) + 1, (pulled[0], steps[:3])
    assert_training_advances(cluster)


def test_killed_worker_leaves_the_other_containers_running_with_a_new_view(
    cluster: ComposeCluster,
) -> None:
    before = settled(cluster)
    everyone = {c.id for c in cluster.running()}
    victim = cluster.running("worker")[-1]
    assert victim.address in before.hosts

    with cluster.timed("docker kill of a worker: new view"):
        cluster.docker("kill", victim.id)
        after = cluster.wait_for_view(
            f"a view without the killed {victim.name}",
            lambda s: victim.address not in s.hosts,
            timeout=EVICTION_TIMEOUT,
        )
    assert after.epoch > before.epoch
    # Same containers, still running: nobody was restarted.
    assert {c.id for c in cluster.running()} == everyone - {victim.id}
    survivors = {c.address for c in cluster.running("worker")}
    assert after.hosts == survivors and len(after.members) == 3
    assert after.member_ids < before.member_ids
    assert_training_advances(cluster)


def test_worker_cut_off_the_network_is_evicted_while_the_rest_continue(
    cluster: ComposeCluster,
) -> None:
    before = settled(cluster)
    victim: Container = cluster.running("worker")[0]
    others = {c.address for c in cluster.running("worker")} - {victim.address}
    assert victim.address in before.hosts and len(others) == 2

    with cluster.timed("network disconnect of a worker: evicted"):
        cluster.docker("network", "disconnect", NETWORK, victim.id)
        after = cluster.wait_for_view(
            f"a view without the disconnected {victim.name}",
            lambda s: victim.address not in s.hosts,
            timeout=EVICTION_TIMEOUT,
        )
    assert after.epoch > before.epoch
    assert after.hosts == others
    assert after.member_ids < before.member_ids
    assert_training_advances(cluster)


def test_training_continues_when_the_rendezvous_leader_container_is_killed(
    cluster: ComposeCluster,
) -> None:
    before = settled(cluster)
    assert before.leader is not None
    service = before.leader.rpartition(":")[0]  # advertised as <service>:7000
    (leader,) = cluster.running(service)
    workers = {c.id for c in cluster.running("worker")}

    with cluster.timed("rendezvous leader killed: new leader"):
        cluster.docker("kill", leader.id)
        cluster.wait_for_view(
            "a new rendezvous leader",
            lambda s: s.leader not in (None, before.leader),
            timeout=PROGRESS_TIMEOUT,
        )
    # By the end of the takeover grace the new leader has taken every
    # member's session over (or evicted it): training must go on after that,
    # not only with the steps that were under way when the leader died.
    time.sleep(Config().takeover_grace + 1)
    with cluster.timed("after the takeover: training advances"):
        assert_training_advances(cluster)
    after = cluster.status()
    # The workers were not touched: same containers, same members.
    assert {c.id for c in cluster.running("worker")} == workers
    assert after.member_ids == before.member_ids


def test_training_continues_when_an_etcd_member_is_killed(cluster: ComposeCluster) -> None:
    before = settled(cluster)
    assert before.step is not None
    # The etcd member that leads the raft group, for the hardest case.
    report = json.loads(
        cluster.docker("exec", cluster.running("etcd1")[0].id, *ETCD_STATUS.split())
    )
    (raft_leader,) = [
        e["Endpoint"] for e in report if e["Status"]["header"]["member_id"] == e["Status"]["leader"]
    ]
    service = raft_leader.split("//")[1].split(":")[0]
    (victim,) = cluster.running(service)
    workers = {c.id for c in cluster.running("worker")}

    with cluster.timed("etcd leader member killed: training advances"):
        cluster.docker("kill", victim.id)
        after = cluster.wait_for_progress(before.step, PROGRESS, timeout=PROGRESS_TIMEOUT)
    assert {c.id for c in cluster.running("worker")} == workers
    assert after.member_ids == before.member_ids
    # The control plane still answers and still records progress in etcd.
    assert_training_advances(cluster)
