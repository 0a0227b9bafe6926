"""Losing every replica: a new set of `rollcall worker` processes resumes from
the newest durable checkpoint (real etcd, real rendezvous, real workers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollcall.worker.ledger import Ledger, merge_ledgers
from rollcall.worker.plan import DataPlan
from tests.harness import ControlPlane, WorkerProcess, start_together, stop_together, wait_for
from tests.test_worker_e2e import PATIENCE, _corpus_samples, assert_digests_agree, wait_step

EVERY = 5


def start(
    plane: ControlPlane, tmp_path: Path, index: int, steps: int, wait_joined: bool = True
) -> WorkerProcess:
    return WorkerProcess(
        plane, tmp_path / f"worker{index}.log", steps=steps,
        ledger=tmp_path / f"ledger{index}.jsonl",
        extra=["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", str(EVERY)],
        wait_joined=wait_joined,
    )  # fmt: skip


def kill_everyone(plane: ControlPlane, team: list[WorkerProcess]) -> None:
    for worker in team:
        worker.kill()
    wait_for(lambda: not plane.status_json()["members"], "the view to empty", PATIENCE)


def test_every_worker_killed_then_new_workers_resume_from_the_newest_checkpoint(
    control_plane: ControlPlane, tmp_path: Path
):
    plane = control_plane
    workers: list[WorkerProcess] = []
    try:
        first = start_together(
            workers, lambda i: start(plane, tmp_path, i, 100_000, wait_joined=False), 3
        )
        for worker in first:
            wait_step(worker, lambda e: e["world"] == 3 and e["step"] >= 4 * EVERY)
        kill_everyone(plane, first)
        done = max(e["step"] for w in first for e in w.steps())
        # The new workers train well past the checkpoint, so that the second
        # one joins while the first still trains, however slow its start.
        steps = done + 60 * EVERY
        newest = plane.status_json()["checkpoints"][0]
        assert newest["step"] % EVERY == EVERY - 1 and newest["step"] <= done
        # The manifest's digest is the state the first workers printed at that step.
        printed = {e["digest"] for w in first for e in w.steps() if e["step"] == newest["step"]}
        assert printed == {newest["digest"]}

        second = [start(plane, tmp_path, i, steps) for i in (3, 4)]
        workers += second
        for worker in second:
            assert worker.proc.wait(timeout=PATIENCE * 2) == 0, worker.log_tail()
        # A worker of the new set loads the checkpoint itself, or pulls the
        # state from one that did (it joined a moment later).
        resumed_events = [e for w in second for e in w.events() if e["event"] == "resumed"]
        assert resumed_events, "no worker reported resuming from the checkpoint"
        for resumed in resumed_events:
            assert resumed["s_ckpt"] == newest["step"]
            # The job's last step as the control plane recorded it: workers
            # report progress at most once per heartbeat interval (a couple
            # of steps here), and a kill may land before the report.
            assert done - 4 <= resumed["s_done"] <= done
            assert resumed["replay_steps"] == resumed["s_done"] - resumed["s_ckpt"]
            cost = resumed["replay_steps"] * resumed["t_step"]
            cost += resumed["t_launch"] + resumed["t_load"]
            assert resumed["replay_cost_s"] == pytest.approx(cost)
            assert 0 < resumed["t_step"] < 10 and resumed["t_launch"] > 0
            print(
                f"\nresumed from step {resumed['s_ckpt']} (job had reached {resumed['s_done']}): "
                f"replay cost {resumed['replay_cost_s']:.2f} s = {resumed['replay_steps']} x "
                f"{resumed['t_step']:.3f} s + launch {resumed['t_launch']:.2f} s "
                f"+ load {resumed['t_load'] * 1000:.1f} ms"
            )
        first_step = min(e["step"] for w in second for e in w.steps())
        assert first_step == newest["step"] + 1, "no step lost, none skipped"
        assert_digests_agree(second)
    finally:
        stop_together(workers, timeout=20)
    # Every step of the run consumed the samples of an uninterrupted run
    # (replayed steps consumed the same ones again).
    merged = merge_ledgers(
        Ledger.load(w.ledger).steps() for w in workers if w.ledger and w.ledger.exists()
    )
    assert max(merged) == steps - 1
    plan = DataPlan(num_samples=_corpus_samples(), global_batch=32, micro_batch=8, seed=0)
    assert Ledger.compare({s: plan.step_samples(s) for s in range(steps)}, merged) == []


def test_when_no_checkpoint_can_be_loaded_the_worker_says_so_and_changes_nothing(
    control_plane: ControlPlane, tmp_path: Path
):
    plane = control_plane
    workers = [start(plane, tmp_path, 0, 1000)]
    try:
        wait_for(lambda: plane.status_json()["checkpoints"], "a published checkpoint", PATIENCE)
        kill_everyone(plane, workers)
        directory = tmp_path / "ckpt"
        for path in directory.iterdir():  # same size, one byte flipped
            data = path.read_bytes()
            path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
        before = {p.name: p.read_bytes() for p in directory.iterdir()}
        manifests = plane.status_json()["checkpoints"]

        workers.append(start(plane, tmp_path, 1, 1000))
        assert workers[1].proc.wait(timeout=PATIENCE) == 4
        log = workers[1].log_tail(50).splitlines()
        errors = [line for line in log if "rollcall: error" in line]
        assert errors and "cannot resume" in errors[0] and "SHA-256 differs" in errors[0], errors
        assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
        assert plane.status_json()["checkpoints"] == manifests
        assert not workers[1].steps(), "a worker that cannot resume must not train from scratch"
    finally:
        stop_together(workers, timeout=20)
