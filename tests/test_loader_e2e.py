"""Loading ahead in real training processes: workers fed by a DataLoader with
two loader processes each train through a kill and a join, and every
microbatch they trained on holds exactly the samples of the plan (real etcd,
real rendezvous, real workers; tests/loader_worker.py)."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from rollcall.etcd_local import pid_alive as alive
from rollcall.worker.faults import ENV as FAULTS
from rollcall.worker.ledger import Ledger, merge_ledgers
from rollcall.worker.plan import DataPlan
from tests.harness import ControlPlane, Process, wait_for
from tests.loader_worker import GLOBAL_BATCH, MICRO_BATCH, SAMPLES

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

#: Generous bound for "training continues" waits on a loaded 2-core box.
PATIENCE = 60.0


class LoaderWorker(Process):
    def __init__(
        self, plane: ControlPlane, tmp_path: Path, index: int, mutate: str = "",
        faults: str = "", overlap: bool = False,
    ) -> None:  # fmt: skip
        """``mutate``: "mutate" or "nudge" (``tests.loader_worker``)."""
        self.ledger = tmp_path / f"ledger{index}.jsonl"
        argv = [sys.executable, "-m", "tests.loader_worker", ",".join(plane.addresses), plane.job,
                str(self.ledger), *([mutate] if mutate else []),
                *(["overlap"] if overlap else [])]  # fmt: skip
        env = {"ROLLCALL_TOKEN": plane.token, FAULTS: faults}
        super().__init__(argv, env, tmp_path / f"worker{index}.log")

    def joined(self) -> dict[str, Any]:
        return self.wait_event(lambda e: e["event"] == "joined", PATIENCE)

    def step(self, predicate: Any) -> dict[str, Any]:
        return self.wait_event(lambda e: e["event"] == "step" and predicate(e), PATIENCE)

    def steps(self) -> list[dict[str, Any]]:
        return [e for e in map(_parse, self.read_all()) if e is not None and e["event"] == "step"]


def _parse(line: str) -> dict[str, Any] | None:
    return json.loads(line) if line.startswith("{") else None




@pytest.mark.parametrize(
    "overlap", [False, True], ids=["reduce-after-backward", "overlapped-landed-at-commit"]
)
def test_microbatches_loaded_ahead_hold_the_plans_samples_through_a_kill_and_a_join(
    control_plane: ControlPlane, tmp_path: Path, overlap: bool
):
    """Overlapped: the survivor answers the joiner's fetch 1 s late (an
    injected fault), so the joiner loads the state at its first step's
    commit, then starts its (empty) buckets after the survivor's. (Two
    late answers: the other worker of the first two fetches from it too
    if it trained alone for a while first, seen under load.)"""
    plane = control_plane
    team: list[LoaderWorker] = []
    try:
        team += [
            LoaderWorker(plane, tmp_path, i, overlap=overlap,
                         faults="slow_describes=2" if overlap and i == 0 else "")
            for i in range(2)
        ]  # fmt: skip
        loader_pids = [pid for worker in team for pid in worker.joined()["loader_pids"]]
        assert len(loader_pids) == 4, "each worker should run two loader processes"
        for worker in team:
            worker.step(lambda e: e["world"] == 2 and e["step"] >= 3)
        survivor, victim = team
        victim.kill()
        alone = survivor.step(lambda e: e["world"] == 1)
        joiner = LoaderWorker(plane, tmp_path, 2, overlap=overlap)
        team.append(joiner)
        loader_pids += joiner.joined()["loader_pids"]
        first = joiner.step(lambda e: e["world"] == 2)
        survivor.step(lambda e, s=first["step"]: e["step"] >= s + 5)
        for worker in (survivor, joiner):
            worker.signal(signal.SIGINT)
        for worker in (survivor, joiner):
            assert worker.proc.wait(timeout=PATIENCE) == 130, worker.log_tail()
    finally:
        for worker in team:
            with contextlib.suppress(Exception):
                worker.stop(timeout=20)
    # The killed worker's loader processes notice their parent is gone by themselves.
    wait_for(lambda: not any(alive(pid) for pid in loader_pids), "loader processes to exit", 20)

    plan = DataPlan(SAMPLES, GLOBAL_BATCH, MICRO_BATCH, seed=0)
    records = [e for worker in team for e in worker.steps()]
    by_step: dict[tuple[int, int], dict[int, list[int]]] = defaultdict(dict)
    for record in records:
        step, world, rank = record["step"], record["world"], record["rank"]
        trained = {int(index): ids for index, ids in record["microbatches"].items()}
        idle = frozenset(record["idle"])
        assert sorted(trained) == list(plan.assignment(step, world, idle)[rank]), record
        for index, ids in trained.items():
            assert ids == list(plan.microbatches(step)[index].sample_ids), (step, index)
            by_step[step, world][index] = ids
    whole = [step for (step, world), seen in by_step.items() if len(seen) == plan.num_microbatches]
    assert len(whole) > 10
    assert {e["world"] for e in records} == {1, 2}
    assert alone["epoch"] < first["epoch"]
    # The joiner fetched the state during its view's first step: it ran none
    # of that step's microbatches, the survivor all of them.
    assert first["idle"] == [first["rank"]] and first["microbatches"] == {}, first
    beside = [e for e in survivor.steps()
              if e["epoch"] == first["epoch"] and e["step"] == first["step"]]  # fmt: skip
    assert len(beside) == 1 and len(beside[0]["microbatches"]) == plan.num_microbatches, beside
    # Every worker holds the same state after every step it committed.
    digests: dict[int, set[str]] = defaultdict(set)
    for record in records:
        digests[record["step"]].add(record["digest"])
    assert {s: d for s, d in digests.items() if len(d) > 1} == {}
    assert first["step"] in digests and len(digests) > 10
    if overlap:
        pulled = [line for line in joiner.log_tail(400).splitlines() if "pulled step" in line]
        assert len(pulled) == 1 and float(pulled[0].split(" in ")[1].split(" s")[0]) >= 1.0
    merged = merge_ledgers(Ledger.load(w.ledger).steps() for w in team if w.ledger.exists())
    last = max(merged)
    assert Ledger.compare({s: plan.step_samples(s) for s in range(last + 1)}, merged) == []
    print(f"\n{len(records)} step records checked against the plan, {last + 1} steps")


def test_a_loop_that_changes_registered_state_before_commit_is_refused_at_its_first_commit(
    control_plane: ControlPlane, tmp_path: Path
):
    """A count kept in registered state (``state=``) before ``commit()``: a
    step aborted and handed out again would count twice, and a worker that
    joins during the step would drop the count. Refused at the first
    commit, on any worker, whatever happens in the job (before, only a
    joiner that loaded the state at its commit refused it; the others
    counted on)."""
    worker = LoaderWorker(control_plane, tmp_path, 0, mutate="mutate")
    try:
        assert worker.proc.wait(timeout=PATIENCE) != 0, worker.log_tail()
        text = worker.log_tail()
        said = "UsageError: step 0: registered state (state 'counter') changed in the loop "
        assert said + "before commit()" in text, text
        assert not worker.steps(), "a step was committed"
    finally:
        with contextlib.suppress(Exception):
            worker.stop(timeout=20)


def test_a_joiner_refuses_a_loop_that_changes_the_parameters_before_commit(
    control_plane: ControlPlane, tmp_path: Path
):
    """A worker that joins fetches the state during its view's first step
    and, when the fetch outlasts its group build (here: the peer answers
    1 s late, an injected fault), loads it at that step's commit: a change
    the loop made to the parameters before commit() (which alike loops make
    alike on every rank) would be lost on it alone, so it refuses with the
    contract's UsageError instead of training on a state that differs from
    the others'; the others train on."""
    plane = control_plane
    team: list[LoaderWorker] = []
    try:
        first = LoaderWorker(plane, tmp_path, 0, mutate="nudge", faults="slow_describes=1")
        team.append(first)
        first.step(lambda e: e["step"] >= 3)
        joiner = LoaderWorker(plane, tmp_path, 1, mutate="nudge")
        team.append(joiner)
        assert joiner.proc.wait(timeout=PATIENCE) != 0, joiner.log_tail()
        assert "changed in the loop before commit()" in joiner.log_tail(), joiner.log_tail()
        assert not joiner.steps(), "the joiner committed a step"
        now = max(e["step"] for e in first.steps())
        first.step(lambda e, s=now: e["world"] == 1 and e["step"] >= s + 3)
    finally:
        for worker in team:
            with contextlib.suppress(Exception):
                worker.stop(timeout=20)


def test_a_member_whose_answer_is_slow_warns_naming_the_deadline_and_stays_in_the_view(
    control_plane: ControlPlane, tmp_path: Path
):
    """A member whose answer to a roll call (the capture and digest of its
    state) takes more than half the roll call's deadline says so, naming
    the setting to raise: a large state's answer can outlast the deadline,
    and a member that answers after it is left out of the view. Here its
    answers to the roll calls of its own join and of the joiner's are each
    0.8 s late (an injected fault): more than half of the 1.5 s such a roll
    call waits (held at the step's end), less than all of it, so it stays."""
    plane = control_plane
    team: list[LoaderWorker] = []
    try:
        first = LoaderWorker(plane, tmp_path, 0, faults="slow_answers=2")
        team.append(first)
        first.step(lambda e: e["step"] >= 3)
        joiner = LoaderWorker(plane, tmp_path, 1)
        team.append(joiner)
        together = joiner.step(lambda e: e["world"] == 2)
        first.step(lambda e, s=together["step"]: e["world"] == 2 and e["step"] >= s)
        warned = [line for line in first.log_tail(400).splitlines()
                  if "capturing and digesting the state" in line]  # fmt: skip
        assert len(warned) == 2, first.log_tail()
        assert all("rollcall_deadline" in line and "left out of the view" in line
                   for line in warned)  # fmt: skip
        # The second answer was to the joiner's roll call: of a step trained.
        answered = int(warned[1].split("the state of step ")[1].split(" ")[0])
        assert answered >= 3 and answered < together["step"], warned[1]
        assert not any("capturing and digesting" in line
                       for line in joiner.log_tail(400).splitlines())  # fmt: skip
    finally:
        for worker in team:
            with contextlib.suppress(Exception):
                worker.stop(timeout=20)
