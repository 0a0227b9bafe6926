"""A rendezvous replica cut off from etcd (while etcd itself runs on) for
longer than every lease, with four workers training, each process on a host
of its own (tests/netns.py): etcd expires the leases nobody could refresh,
which says nothing about the members, so nobody may be evicted for it.

- one replica: when it reaches etcd again it takes the election back and
  records the members again; training never stopped;
- the leader of two: the standby takes over meanwhile, but the members are
  alive (their processes answer) and still held by the cut-off leader, so
  the standby evicts nobody and waits; once the cut heals the old leader
  finds the election lost and its members move over, keeping their places.

Each test ends with the shared invariant check (``tests.netns.check_invariants``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Cluster, Replica, Worker, example_plan, kill
from tests.test_faults import PATIENCE, epoch_now, finish, train_on, wait_resumed, wait_training

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

#: Longer than every lease of the cluster's settings (member_lease_ttl 6 s).
CUT = 12.0


@pytest.fixture(scope="module")
def plan() -> Any:
    return example_plan()


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(replicas: int) -> Cluster:
        cluster = Cluster(tmp_path / f"cluster{len(made)}", 1, replicas)
        made.append(cluster)
        return cluster.__enter__()

    try:
        yield make
    finally:
        for cluster in made:
            cluster.close()
        left = [item for cluster in made for item in cluster.leftovers()]
        assert not left, f"left behind: {left}"


def _cut_off(cluster: Cluster, replica: Replica, team: list[Worker]) -> None:
    """Cut ``replica`` off from etcd for ``CUT`` seconds; training goes on
    throughout and nobody leaves."""
    pids = [w.pid for w in team]
    before = epoch_now(team)
    cluster.outage_begins(f"cut {replica.host.name} off from etcd")
    cluster.network.partition([replica.host], [m.host for m in cluster.etcd])
    started = time.monotonic()
    try:
        for half in (1, 2):
            last = max(e["step"] for w in team for e in w.steps())
            time.sleep(max(0.0, started + half * CUT / 2 - time.monotonic()))
            for worker in team:
                assert max(e["step"] for e in worker.steps()) > last, (
                    f"{worker.host.name} stopped training while the replica was cut off"
                )
    finally:
        cluster.network.heal()
        cluster.outage_ends(f"heal {replica.host.name}")
    assert epoch_now(team) == before, "a view changed while the leader was cut off"
    healed = time.monotonic()
    # Nobody evicted: every worker trains on in a view of all four.
    last = max(e["step"] for w in team for e in w.steps())
    for worker in team:
        worker.wait_step(lambda e: e["step"] > last + 5 and e["world"] == 4, PATIENCE)
    cluster.stalls["healed -> all four trained on"] = time.monotonic() - healed
    assert [w.pid for w in team] == pids and all(w.proc.poll() is None for w in team)


def _then_a_crash_is_handled(cluster: Cluster, team: list[Worker]) -> None:
    """The control plane still changes views afterwards."""
    before = epoch_now(team)
    crashed, survivors = team[3], team[:3]
    crashed_at = cluster.note(f"kill {crashed.host.name}")
    kill(crashed)
    cluster.mark_left(crashed, before)
    resumed = wait_resumed(survivors, before)
    cluster.stalls["kill -> survivors committed"] = time.monotonic() - crashed_at
    assert {e["world"] for e in resumed} == {3}
    train_on(survivors, resumed[0]["step"])


def test_lone_replica_cut_off_from_etcd_longer_than_every_lease_evicts_nobody(
    make_cluster: Callable[..., Cluster], plan: Any
) -> None:
    cluster = make_cluster(replicas=1)
    team = cluster.start_workers(4)
    wait_training(team)
    _cut_off(cluster, cluster.replicas[0], team)
    _then_a_crash_is_handled(cluster, team)
    finish(cluster, plan)


def test_leader_cut_off_from_etcd_while_a_standby_takes_over_evicts_nobody(
    make_cluster: Callable[..., Cluster], plan: Any
) -> None:
    cluster = make_cluster(replicas=2)
    team = cluster.start_workers(4)
    wait_training(team)
    leader = cluster.rendezvous_leader()
    _cut_off(cluster, leader, team)
    successor = cluster.rendezvous_leader()
    assert successor is not leader
    _then_a_crash_is_handled(cluster, team)
    finish(cluster, plan)
