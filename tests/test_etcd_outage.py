"""etcd stalls and outages longer than every lease, with real workers
training: real etcd (SIGSTOP/SIGCONT, SIGKILL and restart), a real
`rollcall rendezvous` replica, real `rollcall worker` processes.

What must hold (docs/protocol.md, "etcd unavailable"): training never
needs etcd, so it goes on during the outage; etcd expiring the leases it
could not keep alive is not evidence that members died, so nobody is
evicted; and the job's progress record is current again soon after etcd
answers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollcall.etcd_local import LocalEtcd
from rollcall.membership.config import Config
from rollcall.rendezvous.store import EtcdStore
from tests.harness import ControlPlane, WorkerProcess, last_step, training_team, wait_for

pytestmark = pytest.mark.integration

#: Generous bound for "should take a few seconds" on 2 loaded cores.
PATIENCE = 60.0
#: The replica's settings: short leases, so that any outage of more than a
#: few seconds outlives all of them.
SETTINGS = ("member_lease_ttl=6", "election_ttl=2", "takeover_grace=2.0")
#: How far behind the workers' step the recorded progress may be (the
#: leader writes it at most every progress_write_interval, workers report
#: at most every heartbeat interval; a few steps of 30-80 ms each).
PROGRESS_SLACK = 40


@pytest.fixture
def team(etcd: LocalEtcd, tmp_path: Path) -> Iterator[tuple[ControlPlane, list[WorkerProcess]]]:
    with training_team([etcd.endpoint], tmp_path, SETTINGS, patience=PATIENCE) as (plane, workers):
        assert {m["id"] for m in plane.status_json()["members"]} == {w.member_id for w in workers}
        yield plane, workers


def _epochs(worker: WorkerProcess, after: int) -> set[int]:
    """Epochs the worker committed steps in from step ``after`` on."""
    return {e["epoch"] for e in worker.steps() if e["step"] > after}


def _check_outage(
    plane: ControlPlane,
    workers: list[WorkerProcess],
    outage: float,
    restart: bool,
    etcd: LocalEtcd,
) -> None:
    ids = {w.member_id for w in workers}
    before = plane.status_json()
    epoch = before["epoch"]
    start_steps = [last_step(w) for w in workers]
    started = time.monotonic()
    if restart:
        etcd.kill()
    else:
        etcd.pause()
    try:
        # Training goes on meanwhile: every worker commits steps.
        midway = started + outage / 2
        time.sleep(max(0.0, midway - time.monotonic()))
        during = [last_step(w) for w in workers]
        assert all(d > s + 5 for d, s in zip(during, start_steps, strict=True)), (
            f"training stalled during the etcd outage: {start_steps} -> {during}"
        )
        time.sleep(max(0.0, started + outage - time.monotonic()))
        late = [last_step(w) for w in workers]
        assert all(x > d for x, d in zip(late, during, strict=True)), (
            f"training stalled late in the etcd outage: {during} -> {late}"
        )
    finally:
        if restart:
            etcd.start()
        else:
            etcd.resume()
    resumed = time.monotonic()
    print(f"\n  etcd {'down' if restart else 'stopped'} {resumed - started:.1f} s; "
          f"steps {start_steps} -> {late}")  # fmt: skip

    # After the outage: still the same members, nobody evicted or exited,
    # and etcd's progress record (what a job that then lost every worker
    # would resume against) catches up with the workers.
    with EtcdStore([etcd.endpoint], plane.job, Config()) as store:

        def recorded_lag() -> int | None:
            recorded = store.read_progress()
            if recorded is None:
                return None
            return min(last_step(w) for w in workers) - recorded[1]

        def progress_current() -> bool:
            lag = recorded_lag()
            return lag is not None and lag <= PROGRESS_SLACK

        waited = wait_for(lambda: progress_current() and time.monotonic(), "progress", PATIENCE)
        print(f"  progress record current {waited - resumed:.2f} s after etcd answered again")
        time.sleep(5.0)  # long enough for any eviction a stale lease would cause
        after = plane.status_json()
        assert {m["id"] for m in after["members"]} == ids, after
        for worker in workers:
            assert worker.proc.poll() is None, f"{worker.member_id} exited: {worker.log_tail()}"
        again = [last_step(w) for w in workers]
        time.sleep(2.0)
        assert all(last_step(w) > a for w, a in zip(workers, again, strict=True)), "stopped"
        lag = recorded_lag()
        print(f"  epoch {epoch} -> {after['epoch']}; etcd's progress record {lag} steps behind")
        assert lag is not None and lag <= PROGRESS_SLACK
    # At most a view change that kept every member.
    assert after["epoch"] <= epoch + 1
    for worker in workers:
        assert _epochs(worker, start_steps[0]) <= {epoch, epoch + 1}


@pytest.mark.timeout(240)
def test_etcd_stopped_60_s_evicts_nobody_and_training_goes_on(team, etcd: LocalEtcd) -> None:
    # 60 s outlives every lease (6 s) by far: etcd stalls for a minute.
    plane, workers = team
    _check_outage(plane, workers, 60.0, restart=False, etcd=etcd)


@pytest.mark.timeout(180)
def test_etcd_down_longer_than_every_lease_evicts_nobody(team, etcd: LocalEtcd) -> None:
    plane, workers = team
    _check_outage(plane, workers, 12.0, restart=True, etcd=etcd)
