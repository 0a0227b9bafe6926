"""The keep-alive runtime end to end: a real etcd, a real rendezvous service
and real `rollcall worker` processes training the example LM."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path

import pytest

from rollcall.etcd_local import LocalEtcd
from rollcall.membership.config import Config
from rollcall.worker.ledger import Ledger, merge_ledgers
from rollcall.worker.plan import DataPlan
from tests.harness import (
    ROOT,
    AgentProcess,
    ControlPlane,
    Process,
    WorkerProcess,
    log_tails,
    start_together,
    stop_together,
    wait_for,
)

#: Generous safety bound for "training continues" waits on a loaded 2-core box.
PATIENCE = 60.0


@pytest.fixture
def plane(control_plane: ControlPlane) -> ControlPlane:
    return control_plane


class Workers:
    def __init__(
        self, plane: ControlPlane, tmp_path: Path, steps: int, extra: Sequence[str] = ()
    ) -> None:
        """Workers of ``steps`` steps, each given the arguments ``extra``."""
        self.plane, self.tmp_path, self.steps, self.extra = plane, tmp_path, steps, extra
        self.all: list[WorkerProcess] = []

    def start(self) -> WorkerProcess:
        (worker,) = self.start_together(1)
        return worker

    def start_together(
        self, count: int, agent: str | None = None, faults: Sequence[str] = ()
    ) -> list[WorkerProcess]:
        """``count`` workers started at once (their sessions carried by the
        host agent at ``agent``, if given; the i-th injecting ``faults[i]``,
        if given); returns once each joined."""

        first = len(self.all)

        def start(index: int) -> WorkerProcess:
            nth = index - first  # among these
            injected = faults[nth] if nth < len(faults) else ""
            return WorkerProcess(
                self.plane, self.tmp_path / f"worker{index}.log", steps=self.steps,
                ledger=self.tmp_path / f"ledger{index}.jsonl", wait_joined=False,
                extra=(*self.extra, *(("--agent", agent) if agent else ())),
                env={"ROLLCALL_FAULTS": injected} if injected else None,
            )  # fmt: skip

        return start_together(self.all, start, count)

    def close(self) -> None:
        stop_together(self.all, timeout=20)


@pytest.fixture
def workers(plane: ControlPlane, tmp_path: Path) -> Iterator[Workers]:
    group = Workers(plane, tmp_path, steps=10_000)
    try:
        yield group
    finally:
        group.close()


def wait_step(worker: WorkerProcess, predicate, timeout: float = PATIENCE) -> dict:
    return worker.wait_event(lambda e: e["event"] == "step" and predicate(e), timeout)


def epoch_now(workers: list[WorkerProcess]) -> int:
    """The newest view epoch any of ``workers`` committed a step in so far."""
    return max(e["epoch"] for w in workers for e in w.steps())


def assert_digests_agree(workers: list[WorkerProcess]) -> int:
    """Every step reported by several workers has one digest; returns how
    many steps were compared."""
    by_step: dict[int, set[str]] = {}
    for worker in workers:
        for event in worker.steps():
            by_step.setdefault(event["step"], set()).add(event["digest"])
    assert by_step, "no committed steps"
    disagreeing = {s: d for s, d in by_step.items() if len(d) > 1}
    assert not disagreeing, f"replicas disagree at steps {sorted(disagreeing)}"
    return len(by_step)


def test_survivors_keep_training_without_restart_when_a_worker_is_killed(
    workers: Workers, plane: ControlPlane, tmp_path: Path
):
    """Two of the four have their sessions carried by a host agent (one
    shared stream), the victim among them: a worker behind the agent is
    found dead as fast as one with a session of its own."""
    agent = AgentProcess(plane, tmp_path)
    try:
        team = workers.start_together(2, agent=agent.address) + workers.start_together(2)
        killed_behind_the_agent(team, plane)
    finally:
        agent.stop(timeout=5)


def killed_behind_the_agent(team: list[WorkerProcess], plane: ControlPlane) -> None:
    for worker in team:
        wait_step(worker, lambda e: e["world"] == 4 and e["step"] >= 3)
    victim, survivors = team[1], [team[0], *team[2:]]
    pids = [w.pid for w in survivors]
    before = epoch_now(team)
    killed_at = time.monotonic()
    victim.kill()
    resumed = [wait_step(w, lambda e: e["epoch"] > before) for w in survivors]
    recovery = time.monotonic() - killed_at
    print(f"\nkill -> next committed step on all survivors: {recovery * 1000:.0f} ms")
    assert [w.pid for w in survivors] == pids
    assert all(w.proc.poll() is None for w in survivors), "a survivor exited"
    assert len({e["epoch"] for e in resumed}) == 1
    assert {e["world"] for e in resumed} == {3}
    assert recovery < Config().eviction_bound() + 30
    for worker in survivors:
        wait_step(worker, lambda e, s=resumed[0]["step"]: e["step"] >= s + 3)
    print(f"digests compared at {assert_digests_agree(survivors)} steps")
    log = (plane.workdir / "replica0.log").read_text(errors="replace")
    assert log.count("on shared session @") == 2
    assert f"suspect {victim.member_id}: session stream broken" in log


def test_joiner_pulls_state_from_peers_and_all_digests_agree(workers: Workers):
    team = workers.start_together(4)
    for worker in team:
        wait_step(worker, lambda e: e["world"] == 4 and e["step"] >= 5)
    joiner = workers.start()
    first = wait_step(joiner, lambda e: True)
    assert first["world"] == 5
    assert first["step"] > 5, "the joiner started from scratch instead of the peers' state"
    for worker in [*team, joiner]:
        wait_step(worker, lambda e, s=first["step"]: e["step"] >= s + 3)
    compared = assert_digests_agree([*team, joiner])
    print(f"\njoiner's first step {first['step']}; digests compared at {compared} steps")
    assert "pulled step" in joiner.log_tail(200)


def test_a_replica_that_drifted_from_the_others_says_so_at_the_next_view_change(
    workers: Workers,
):
    """One worker computes its updates differently from the others (here a
    parameter nudged by one ulp after each step it lands, as a kernel, a
    library version or a CPU that differs would): its replica drifts from
    theirs, and nothing in a step shows it. At the next view change it
    holds the resume step with another state than most holders: it takes
    theirs and says why, naming both digests; the others say nothing of
    that view."""
    said = "drifted from the view's sources"
    team = workers.start_together(3, faults=["diverge_steps=100000"])
    drifted, others = team[0], team[1:]
    for worker in team:
        wait_step(worker, lambda e: e["world"] == 3 and e["step"] >= 3)
    theirs = {e["step"]: e["digest"] for e in others[0].steps() if e["world"] == 3}
    mine = {e["step"]: e["digest"] for e in drifted.steps() if e["world"] == 3}
    common = sorted(set(theirs) & set(mine))
    assert common, "no step reported by both"
    assert all(theirs[s] != mine[s] for s in common), "the fault changed nothing"
    assert_digests_agree(others)

    joiner = workers.start()
    view = wait_step(joiner, lambda e: True)["epoch"]

    def warned() -> list[str]:
        text = drifted.log_path.read_text(errors="replace")
        return [x for x in text.splitlines() if said in x and f"view {view}:" in x]

    deadline = time.monotonic() + PATIENCE
    while not warned() and time.monotonic() < deadline:
        time.sleep(0.1)
    (line,) = warned()
    resume = int(line.split("held step ")[1].split()[0])
    agreed = {e["digest"] for e in others[0].steps() if e["step"] == resume}
    assert len(agreed) == 1 and next(iter(agreed))[:19] in line, line
    assert mine.get(resume, "?")[:19] in line or resume not in mine, line
    # (At start-up two workers may hold a step alone: a tie, which the most
    # senior's state wins, drifted or not; the other then says so. At the
    # hot-add two hold one state and the drifted one is alone.)
    for worker in [*others, joiner]:
        text = worker.log_path.read_text(errors="replace")
        assert not [x for x in text.splitlines() if said in x and f"view {view}:" in x], text


def test_replicas_compare_their_states_every_few_steps_and_a_drifted_one_is_healed(
    plane: ControlPlane, tmp_path: Path
):
    """Drift is not left until the next membership change: every
    ``drift_check_every`` steps the ranks compare their states' digests.
    One worker drifts for its first steps (a parameter nudged after each):
    the check finds it, every rank says so and asks for a roll call, the
    drifted replica takes the others' state, and once it no longer drifts
    every replica holds the same state again, with no member changed."""
    group = Workers(plane, tmp_path, steps=10_000, extra=("--set", "drift_check_every=5"))
    try:
        team = group.start_together(3, faults=["diverge_steps=25"])
        drifted = team[0]
        for worker in team:
            wait_step(worker, lambda e: e["world"] == 3 and e["step"] >= 55)
        logs = [w.log_path.read_text(errors="replace") for w in team]
        # Every rank in the view at a check while it drifted says so (a
        # worker still joining at the first checks may have missed them).
        assert "the replicas' states differ" in logs[0], drifted.log_tail(40)
        assert any("the replicas' states differ" in text for text in logs[1:]), logs[1][-2000:]
        assert "drifted from the view's sources" in logs[0], drifted.log_tail(40)
        late = [e for w in team for e in w.steps() if e["step"] >= 45]
        by_step: dict[int, set[str]] = {}
        for event in late:
            by_step.setdefault(event["step"], set()).add(event["digest"])
        assert by_step and all(len(d) == 1 for d in by_step.values()), by_step
        assert {e["world"] for e in late} == {3}
        assert all(w.proc.poll() is None for w in team)
    finally:
        group.close()


def test_a_sharded_copy_that_drifted_stops_its_worker_and_the_others_train_on(
    plane: ControlPlane, tmp_path: Path
):
    """A sharded job: the owners of a partition keep identical copies by
    running the same update, and the model follows the copy its sender
    sent. A third worker's copy is nudged by one ulp once, after its first
    step in the view of three (as a kernel that computes differently
    would; alone in a view, it would send every partition and nothing
    would differ): at the next check (every 5 steps) the
    owner whose copy differs from the sender's says so and stops with
    exit code 3, rather than keep a copy that would change the job's
    course once the sender is lost. The others re-shard without it and
    train on, their copies in agreement through the checks that follow."""
    said = "of the sharded optimizer state is not bit for bit the one another owner computed"
    group = Workers(
        plane, tmp_path, steps=10_000,
        extra=("--shard-redundancy", "2", "--set", "drift_check_every=5"),
    )  # fmt: skip
    try:
        team = group.start_together(2)
        for worker in team:
            wait_step(worker, lambda e: e["world"] == 2)
        team += group.start_together(1, faults=["diverge_steps=1"])
        stopped = wait_for(
            lambda: [w for w in team if w.proc.poll() is not None], "a worker to stop",
            timeout=PATIENCE, explain=lambda: log_tails(team),
        )  # fmt: skip
        (worker,) = stopped
        assert worker.proc.wait() == 3, worker.log_tail(40)
        lines = [x for x in worker.log_path.read_text(errors="replace").splitlines() if said in x]
        assert lines and "start it again" in lines[-1], worker.log_tail(40)
        step = int(lines[-1].split("step ")[1].split(":")[0])
        assert (step + 1) % 5 == 0, lines[-1]
        others = [w for w in team if w is not worker]
        after = max(e["step"] for w in others for e in w.steps())
        for other in others:  # two more checks in a view of two
            wait_step(other, lambda e: e["world"] == 2 and e["step"] >= after + 10)
        for other in others:
            assert other.proc.poll() is None, other.log_tail(40)
            assert said not in other.log_path.read_text(errors="replace"), other.log_tail(40)
    finally:
        group.close()


def changing_worker(
    workers: Workers, plane: ControlPlane, change: str, *flags: str, log: str = ""
) -> Process:
    """A ``tests.param_changing_worker`` process whose loop makes ``change``
    (its log ``<change><log>.log``)."""
    process = Process(
        [sys.executable, "-m", "tests.param_changing_worker", ",".join(plane.addresses),
         plane.job, change, *flags],
        {"ROLLCALL_TOKEN": plane.token}, workers.tmp_path / f"{change}{log}.log",
    )  # fmt: skip
    workers.all.append(process)  # type: ignore[arg-type]
    return process


def usage_error_of(worker: Process) -> str:
    """The one ``UsageError: step`` line of a worker that exited with an error."""
    assert worker.proc.wait(timeout=PATIENCE) != 0, worker.log_tail(40)
    text = worker.log_path.read_text(errors="replace")
    (line,) = [x for x in text.splitlines() if "UsageError: step" in x]
    return line


def refused_at(worker: Process, step: int) -> str:
    """The ``UsageError`` line of a worker that committed ``step - 1``, then
    was refused at ``step`` and exited."""
    assert worker.proc.wait(timeout=PATIENCE) != 0, worker.log_tail(40)
    worker.wait_line(lambda x: f'"step": {step - 1},' in x, timeout=PATIENCE)  # committed
    with pytest.raises(RuntimeError, match="process exited"):  # every line read, none for step
        worker.wait_line(lambda x: f'"step": {step},' in x, timeout=PATIENCE)
    text = worker.log_path.read_text(errors="replace")
    (line,) = [x for x in text.splitlines() if "UsageError: " in x]
    return line


@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_a_loop_that_freezes_or_unfreezes_a_parameter_is_refused_at_the_next_commit(
    workers: Workers, plane: ControlPlane, change: str
):
    """The runtime reduces the gradients of the parameters that required
    grad when ``Elastic`` was built. A parameter frozen later would stay
    among them (in a sharded job updated with a zero gradient: weight
    decay, momentum); one unfrozen later would be updated with this
    worker's own partial gradient, silently wrong: the commit after the
    change raises ``UsageError`` naming the parameter and what to do
    instead."""
    line = refused_at(changing_worker(workers, plane, change), 3)
    assert "UsageError: step 3:" in line, line
    verb = "frozen" if change == "freeze" else "unfrozen"
    assert f"was {verb} (requires_grad set to {change == 'unfreeze'})" in line, line
    assert "lr to 0" in line, line


@pytest.mark.parametrize(
    ("change", "said"),
    [("replace", "was replaced by another Parameter"),
     ("retype", "changed from torch.float32 to torch.float64")],
)  # fmt: skip
def test_a_loop_that_replaces_or_retypes_a_parameter_is_refused_at_the_next_commit(
    workers: Workers, plane: ControlPlane, change: str, said: str
):
    """The runtime reduces, transfers and checkpoints the Parameter objects
    the model held when ``Elastic`` was built. One the loop replaces (a
    rebuilt layer, even put in the optimizer in the old one's place) would
    be updated with this worker's own gradient while the runtime reduced a
    stale one; ``model.double()`` changes what every buffer and peer
    expects. Either is refused at the next commit, naming the parameter."""
    line = refused_at(changing_worker(workers, plane, change), 3)
    assert "UsageError: step 3:" in line and said in line, line
    assert "before building Elastic" in line, line


def test_a_sparse_gradient_is_refused_at_the_commit_naming_the_parameter(
    workers: Workers, plane: ControlPlane
):
    """The reduction carries dense gradients. An embedding built with
    ``sparse=True`` is refused at construction; one whose gradient turns
    sparse later (the flag set after, or ``F.embedding(..., sparse=True)``
    in the model's own code) is refused at that step's commit, before the
    reduction, naming the parameter (before, torch's "reshape is not
    implemented for sparse tensors" from inside the reduction)."""
    line = refused_at(changing_worker(workers, plane, "sparse_after"), 3)
    assert "UsageError: step 3: the gradient of token_embedding.weight is sparse" in line, line
    assert "sparse=False" in line, line


def test_a_param_group_of_parameters_outside_the_model_is_refused_at_the_next_commit(
    workers: Workers, plane: ControlPlane
):
    """Replicated: a group of the model's parameters may be added to the
    optimizer in the loop, but one of a parameter the model does not hold
    (whose gradient the runtime never reduces) is refused at the next commit."""
    line = refused_at(changing_worker(workers, plane, "add_group"), 3)
    assert "of the optimizer's param group 1 is not a parameter of the model" in line, line


def test_a_parameter_taken_out_of_a_sharded_optimizer_is_refused_at_the_next_commit(
    workers: Workers, plane: ControlPlane
):
    """The sharded state is cut from the optimizer's parameters when it was
    sharded: one taken out later would still be updated (one added, never).
    The commit after the loop takes one out raises ``UsageError``."""
    line = refused_at(changing_worker(workers, plane, "drop_param", "--sharded"), 3)
    assert "UsageError: the optimizer's param groups changed after" in line, line


def test_a_sharded_loop_that_changes_the_parameters_after_commit_is_refused(
    workers: Workers, plane: ControlPlane
):
    """In a sharded job each update starts from the owners' copies of the
    parameters, so a change the loop makes to the model's parameters after
    ``commit()`` would be lost at the next step, silently. The worker whose
    loop does so is refused at the first check (every 5 steps) with one
    clear error; the other, whose loop does not, trains on alone."""

    steady = changing_worker(workers, plane, "none", "--sharded")
    steady.wait_line(lambda line: '"step": 0,' in line, timeout=PATIENCE)
    changing = changing_worker(workers, plane, "scale", "--sharded")
    assert changing.proc.wait(timeout=PATIENCE) != 0, changing.log_tail(40)
    text = changing.log_path.read_text(errors="replace")
    said = "UsageError: step "
    (line,) = [x for x in text.splitlines() if said in x and "changed outside the optimizer" in x]
    assert "lost at the next step" in line, line
    step = int(line.split(said)[1].split(":")[0])
    assert (step + 1) % 5 == 0, line
    steady.wait_line(lambda x: '"world": 1' in x and f'"step": {step + 11},' in x, PATIENCE)
    assert steady.proc.poll() is None
    assert "changed outside the optimizer" not in steady.log_path.read_text(errors="replace")


def test_a_sharded_jobs_before_update_that_changes_the_parameters_is_refused(
    workers: Workers, plane: ControlPlane
):
    """``before_update`` runs after the reduction, before the update, which
    in a sharded job starts from the owners' copies: a change it makes to
    the model's parameters is lost at this very step's all-gather, so no
    later comparison could see it. It is compared right after the hook, at
    the check steps (every 5 here), and refused."""
    line = refused_at(changing_worker(workers, plane, "hook_scale", "--sharded"), 4)
    assert "UsageError: step 4:" in line, line
    assert "changed in before_update" in line and "lost at this step" in line, line


def test_a_learning_rate_counted_by_the_loop_itself_is_refused_when_a_joiner_counts_anew(
    workers: Workers, plane: ControlPlane
):
    """A warm-up written against a count the loop keeps itself (here in
    ``before_update``) gives a worker that joins another learning rate
    than the others': every rank applies the same reduced gradient, and
    the replicas part. The ranks compare the settings of their last updates
    in each step's reduction: every rank refuses, with the learning rates."""
    first = changing_worker(workers, plane, "counter_lr")
    first.wait_line(lambda x: '"step": 5,' in x, timeout=PATIENCE)  # alone: nothing to compare
    joiner = changing_worker(workers, plane, "counter_lr", log="-joiner")
    for worker in (first, joiner):
        line = usage_error_of(worker)
        assert "with different optimizer settings (this rank's learning rates: " in line, line
        assert "registered LR scheduler" in line, line


def test_a_joiner_whose_before_update_clips_to_another_norm_is_refused_by_every_rank(
    workers: Workers, plane: ControlPlane
):
    """The fingerprint names the hook, not the values it closes over: a
    worker started with another clip norm joins, and from then on applies
    other updates than the others to the same reduced gradient (before,
    both trained on, the replicas apart, with no error). The ranks compare
    a probe of the gradients their hooks left in each step's reduction:
    every rank refuses, naming the hook."""
    first = changing_worker(workers, plane, "clip", "--clip-norm", "1.0")
    first.wait_line(lambda x: '"step": 5,' in x, timeout=PATIENCE)  # alone: nothing to compare
    joiner = changing_worker(workers, plane, "clip", "--clip-norm", "0.01", log="-joiner")
    for worker in (first, joiner):
        line = usage_error_of(worker)
        assert "with different gradients after before_update (this rank's hook: " in line, line
        assert "main.<locals>.change)" in line, line
        assert "another clip norm" in line, line


def test_a_rank_left_in_eval_mode_after_evaluating_is_refused_by_every_rank(
    workers: Workers, plane: ControlPlane
):
    """A rank that evaluates (``model.eval()``) and does not call
    ``model.train()`` again trains on with dropout off and batch norms on
    their running statistics while the others do not, and its gradients
    were averaged with theirs with no error. The ranks compare which of
    their modules are in training mode at every step: every rank refuses
    at the next step, and says what to do."""
    first = changing_worker(workers, plane, "none")
    first.wait_line(lambda x: '"step": 3,' in x, timeout=PATIENCE)
    joiner = changing_worker(workers, plane, "forget_train")
    for worker in (first, joiner):
        line = usage_error_of(worker)
        assert "ran it with their modules in different training modes" in line, line
        assert "Call model.train() after evaluating" in line, line
    assert "modules in eval mode: 0 of " in usage_error_of(first)
    assert re.search(r"modules in eval mode: (\d+) of \1 \(the model, ", usage_error_of(joiner))


def test_a_joiner_running_another_version_of_the_training_script_is_refused_at_join(
    workers: Workers, plane: ControlPlane, tmp_path: Path
):
    """A host started from another version of the script (here its loss
    weighted twice; a changed loss, a label smoothing, a fixed bug): every
    setting the fingerprint compared was alike, and its gradients were
    averaged with the others' with no error. The fingerprint compares the
    source of the module that constructs ``Elastic`` (and of those that
    define the model, data set, state and hook): the joiner is refused at
    join, naming the module, and the job trains on."""
    first = changing_worker(workers, plane, "none")
    first.wait_line(lambda x: '"step": 3,' in x, timeout=PATIENCE)
    source = (ROOT / "tests" / "param_changing_worker.py").read_text()
    line = "            loss, count = loss_sum(model, batch[0], batch[1])\n"
    assert source.count(line) == 1
    edited = tmp_path / "param_changing_worker_v2.py"
    edited.write_text(source.replace(line, line + "            loss = loss * 2.0\n"))
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    joiner = Process(
        [sys.executable, str(edited), ",".join(plane.addresses), plane.job, "none"],
        {"ROLLCALL_TOKEN": plane.token, "PYTHONPATH": path}, tmp_path / "v2.log",
    )  # fmt: skip
    workers.all.append(joiner)  # type: ignore[arg-type]
    assert joiner.proc.wait(timeout=PATIENCE) != 0, joiner.log_tail(40)
    text = joiner.log_path.read_text(errors="replace")
    (said,) = [x for x in text.splitlines() if "ConfigurationMismatch: " in x]
    assert re.search(r"this worker's code is __main__=\w{8} but job \S+'s is __main__=\w{8} ",
                     said), said  # fmt: skip
    assert "other code under the same names" in said and "code_check=False" in said, said
    lines = joiner.read_all(exited=True)
    assert not any('"event": "step"' in x for x in lines), "the joiner trained"
    last = max(int(m) for m in re.findall(r'"step": (\d+),', "".join(first.read_all())))
    first.wait_line(lambda x: f'"step": {last + 3},' in x, timeout=PATIENCE)  # trains on


@pytest.mark.parametrize("change", ["commit_twice", "backward_after", "microbatches_after"])
def test_a_step_used_after_its_commit_is_refused_before_it_changes_anything(
    workers: Workers, plane: ControlPlane, change: str
):
    """A second ``commit()`` of a step reduced and applied again (alone, a
    second update and scheduler step; with others, its all-reduce met their
    next step's); a ``backward`` after ``commit()`` left its gradients for
    the next step's sum; the step's microbatches handed out again after
    ``commit()`` were loaded and seeded again and counted as finished twice,
    and their training-mode forward passes moved the buffers outside any
    step. Each is refused at the call, before it does anything."""
    line = refused_at(changing_worker(workers, plane, change), 3)
    assert "UsageError: step 2: " in line, line
    said = {"commit_twice": "commit() was called again", "backward_after": "step.backward after",
            "microbatches_after": "step.microbatches() after commit()"}[change]  # fmt: skip
    assert said in line, line
    assert "each step commits once" in line, line


@pytest.mark.parametrize("change", ["busy_state", "after_busy"])
def test_registered_state_changed_after_busy_began_is_refused_when_the_loop_asks_for_a_step(
    workers: Workers, plane: ControlPlane, change: str
):
    """From ``job.busy()`` on, roll calls are answered with the registered
    state of then: a worker that joins meanwhile takes it. A tally the loop
    counts inside the ``with`` block, or after it before the next step,
    would be missing on that worker for ever. The loop is refused when it
    asks for the next step (before, it trained on)."""
    line = refused_at(changing_worker(workers, plane, change), 3)
    assert "UsageError: step 2: registered state (state=, scheduler or grad scaler) " in line
    assert "changed after job.busy('evaluation') began" in line, line
    assert "after commit() and before job.busy()" in line, line


def test_registered_state_changed_before_busy_or_put_back_inside_it_trains_on(
    workers: Workers, plane: ControlPlane
):
    """The tally counted after ``commit()`` and before ``job.busy()``, and
    changed and put back inside it (an evaluation that swaps weights in and
    out), at every step: nothing to refuse."""
    worker = changing_worker(workers, plane, "busy_ok")
    worker.wait_line(lambda x: '"step": 6,' in x, timeout=PATIENCE)
    assert worker.proc.poll() is None, worker.log_tail(40)


def test_kills_and_joins_consume_exactly_the_samples_of_an_uninterrupted_run(
    plane: ControlPlane, tmp_path: Path
):
    steps = 300  # enough for the kills and joins below to land mid-run (~20 s of room)
    group = Workers(plane, tmp_path, steps=steps)
    try:
        # One by one: what the first ones train meanwhile is not left for the final wait.
        team = [group.start() for _ in range(3)]
        for worker in team:
            wait_step(worker, lambda e: e["world"] == 3 and e["step"] >= 4)
        team[0].kill()
        before = epoch_now(team)
        wait_step(team[1], lambda e: e["epoch"] > before and e["world"] == 2)
        group.start()
        wait_step(team[1], lambda e: e["world"] == 3 and e["step"] >= 10)
        team[2].kill()
        before = epoch_now(team)
        wait_step(team[1], lambda e: e["epoch"] > before and e["world"] == 2)
        last = group.start()
        for worker in group.all:
            if worker not in (team[0], team[2]):
                assert worker.proc.wait(timeout=PATIENCE) == 0, worker.log_tail()
        assert last.steps(), "the second joiner arrived after the end: make the run longer"
    finally:
        group.close()
    ledgers = [Ledger.load(w.ledger).steps() for w in group.all if w.ledger and w.ledger.exists()]
    merged = merge_ledgers(ledgers)
    plan = DataPlan(num_samples=_corpus_samples(), global_batch=32, micro_batch=8, seed=0)
    uninterrupted = {s: plan.step_samples(s) for s in range(steps)}
    differences = Ledger.compare(uninterrupted, merged)
    assert differences == [], differences
    assert all(len(samples) == 32 for samples in merged.values())


def _corpus_samples() -> int:
    from rollcall.worker.examples.lm import CharCorpus, LMConfig

    return len(CharCorpus(LMConfig()))


def test_frozen_worker_is_evicted_and_never_commits_in_its_old_epoch(workers: Workers):
    team = workers.start_together(3)
    for worker in team:
        wait_step(worker, lambda e: e["world"] == 3 and e["step"] >= 3)
    frozen = team[2]
    before = epoch_now(team)
    frozen.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    for worker in team[:2]:
        wait_step(worker, lambda e: e["epoch"] > before and e["world"] == 2)
    evicted_after = time.monotonic() - stopped_at
    print(f"\nfrozen -> survivors commit without it: {evicted_after * 1000:.0f} ms")
    assert evicted_after < Config().eviction_bound() + 30
    # Workers flush a line per committed step, and the frozen one has been
    # stopped for longer than it takes to read what it wrote before.
    committed_before_thaw = len(frozen.steps())
    frozen.signal(signal.SIGCONT)
    assert frozen.proc.wait(timeout=PATIENCE) == 3
    assert "evicted" in frozen.log_tail(50)
    assert len(frozen.steps()) == committed_before_thaw, "the thawed worker committed a step"
    assert all(e["epoch"] <= before for e in frozen.steps())


def test_a_worker_that_finishes_leaves_without_a_timeout(workers: Workers, plane, tmp_path):
    team = workers.start_together(2)
    for worker in team:
        wait_step(worker, lambda e: e["world"] == 2 and e["step"] >= 3)
    before = epoch_now(team)
    # It joins, trains a few steps with the others, reaches its --steps and leaves.
    finish = max(e["step"] for e in team[0].steps()) + 200  # past its start-up
    short = WorkerProcess(plane, tmp_path / "short.log", steps=finish, ledger=None)
    workers.all.append(short)
    done = short.wait_event(lambda e: e["event"] == "done", timeout=PATIENCE)
    left_at = time.monotonic()
    assert done["step"] == finish - 1
    assert any(e["world"] == 3 for e in short.steps()), "it never trained with the others"
    after = wait_step(team[0], lambda e: e["epoch"] > before + 1 and e["world"] == 2)
    took = time.monotonic() - left_at
    assert short.proc.wait(timeout=PATIENCE) == 0
    print(f"\nclean leave -> next committed step without it: {took * 1000:.0f} ms")
    assert took < Config().detection_bound()
    assert after["step"] >= finish


def test_ctrl_c_leaves_cleanly(workers: Workers):
    team = workers.start_together(3)
    for worker in team:
        wait_step(worker, lambda e: e["world"] == 3)
    before = epoch_now(team)
    team[2].signal(signal.SIGINT)
    interrupted_at = time.monotonic()
    wait_step(team[0], lambda e: e["epoch"] > before and e["world"] == 2)
    took = time.monotonic() - interrupted_at
    assert team[2].proc.wait(timeout=PATIENCE) == 130
    print(f"\nCtrl-C -> next committed step without it: {took * 1000:.0f} ms")
    assert took < Config().detection_bound() + 5


def test_ctrl_c_while_the_training_thread_holds_the_protocol_state_still_leaves(
    workers: Workers,
):
    """A signal is handled on the training thread, between two of its
    bytecodes: also while that thread holds the lock of the worker's
    protocol state (a fence check; an injected fault holds it 1 s at every
    step here, after the step's event). The handler must not take that
    lock itself: it did, and the worker hung for good, its peers'
    all-reduce failing 30 s later (seen once in the full suite), until a
    second signal killed it."""
    (worker,) = workers.start_together(1, faults=("held_states=100000",))
    wait_step(worker, lambda e: e["step"] >= 2)
    time.sleep(0.5)  # the next step computes (~0.1 s) and holds the lock for 1 s
    worker.signal(signal.SIGINT)
    assert worker.proc.wait(timeout=PATIENCE) == 130, worker.log_tail()
    assert "SIGINT: leaving job" in worker.log_tail(40)
    assert "second SIGINT" not in worker.log_tail(40)


def test_ctrl_c_lets_the_step_in_flight_land_with_the_leavers_part(workers: Workers):
    """A worker asked to leave (SIGINT) runs its step in flight on to its
    reduction and leaves without applying it: the others land that step
    in the view with it (none of their work is thrown away), stop after
    it, and train on without it."""
    team = workers.start_together(3)
    for worker in team:
        wait_step(worker, lambda e: e["world"] == 3)
    team[2].signal(signal.SIGINT)
    assert team[2].proc.wait(timeout=PATIENCE) == 130, team[2].log_tail()
    leavers_last = max(e["step"] for e in team[2].steps())
    for survivor in team[:2]:
        wait_step(survivor, lambda e: e["world"] == 2)
        landed = {e["step"]: e for e in survivor.steps()}
        assert landed[leavers_last + 1]["world"] == 3, (
            f"the step in flight when the worker left (step {leavers_last + 1}) was trained "
            f"again without it: {landed[leavers_last + 1]}"
        )


#: A worker's debug line when it answers a roll call (its time, the epoch,
#: how long after the roll call arrived, how long it waited for a step).
_ANSWERED = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .* roll call (\d+) answered in ([\d.]+) ms "
    r"\(step \S+: ([\d.]+) ms waiting for it to land"
)
#: A worker's line when a view reaches it (its time, the epoch).
_VIEW_RECEIVED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .* INFO view (\d+): ")


def _first_logged(
    worker: WorkerProcess, line: re.Pattern[str], after_epoch: int
) -> tuple[float, re.Match[str]]:
    """The first line of ``worker``'s log that ``line`` matches with an
    epoch (its second group) newer than ``after_epoch``: its wall-clock
    time (the first group) and the match."""
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        for text in worker.log_path.read_text(errors="replace").splitlines():
            found = line.match(text)
            if found and int(found[2]) > after_epoch:
                return datetime.strptime(found[1], "%Y-%m-%d %H:%M:%S,%f").timestamp(), found
        time.sleep(0.05)
    raise TimeoutError(f"no {line.pattern!r} after epoch {after_epoch}: {worker.log_tail()}")


def _roll_call_answered(worker: WorkerProcess, after_epoch: int) -> tuple[float, float]:
    """When the first roll call newer than ``after_epoch`` reached
    ``worker`` (wall clock, from its debug log) and how long its answer
    waited for the step in flight to end, in seconds."""
    logged, found = _first_logged(worker, _ANSWERED, after_epoch)
    return logged - float(found[3]) / 1000, float(found[4]) / 1000


def test_a_clean_leave_just_after_a_join_lands_its_step_in_flight_with_the_leavers_part(
    etcd: LocalEtcd, tmp_path: Path
):
    """A clean leave whose roll call arrives just before the join's roll
    call has waited ``rollcall_step_end_wait`` (15 s here; steps
    of 1-2 s, 7 s on a loaded host): the join's time running out gives up
    nothing of the leave's, whose step in flight lands with the leaver's
    part. (Before, the join's timer gave up whichever roll call waited: the
    step was aborted and trained again without the leaver, in 4 runs of
    4.) The leave comes only once the join's view reached the leaver: a
    leave before it is a leave from the older view (as when, with 4 s here
    and steps of 3.5 s on a slow CI host, the view came 0.05 s after it).
    It comes a third of a step (0.25-1.5 s) before the join's time runs
    out: on a loaded host the leave's roll call took longer than 0.25 s to
    reach the others, and the join's timer found nothing to give up."""
    wait = 15.0
    plane = ControlPlane([etcd.endpoint], tmp_path, settings=(f"rollcall_step_end_wait={wait}",))
    group = Workers(
        plane, tmp_path, steps=10_000,
        extra=("--set", f"rollcall_step_end_wait={wait}", "--d-model", "256", "--layers", "16",
               "--log-level", "debug"),
    )  # fmt: skip
    try:
        team = group.start_together(2)
        epoch = max(wait_step(w, lambda e: e["world"] == 2)["epoch"] for w in team)
        group.start()
        arrived, waited = _roll_call_answered(team[0], epoch)
        # The join's roll call waited for a step's end, so its timer runs.
        assert waited > 0.01, f"the join's roll call waited {waited:.3f} s for the step's end"
        received, _ = _first_logged(team[1], _VIEW_RECEIVED, epoch)
        step_s = 32 / team[0].steps()[-1]["samples_s"]  # the example's global batch
        lead = min(max(step_s / 3, 0.25), 1.5)
        assert received < arrived + wait - lead, (
            f"the join's view reached the leaver {received - arrived:.2f} s after the join's roll "
            f"call, too late for a leave in it {lead:.2f} s before that roll call's {wait} s ran "
            f"out\n{log_tails(group.all)}"
        )
        time.sleep(max(0.0, arrived + wait - lead - time.time()))
        team[1].signal(signal.SIGINT)
        assert team[1].proc.wait(timeout=PATIENCE) == 130, team[1].log_tail()
        leavers_last = max(e["step"] for e in team[1].steps())
        wait_step(team[0], lambda e: e["world"] == 2 and e["step"] > leavers_last + 1)
        landed = {e["step"]: e for e in team[0].steps()}
        assert landed[leavers_last + 1]["world"] == 3, (
            f"the step in flight when the worker left (step {leavers_last + 1}) was trained "
            f"again without it: {landed[leavers_last + 1]}\n{log_tails(group.all)}"
        )
    finally:
        group.close()
        plane.close()


def test_a_leaver_whose_leave_call_fails_is_still_left_behind_with_no_sample_lost_or_repeated(
    plane: ControlPlane, tmp_path: Path
):
    """SIGINT to a worker whose ``Leave`` call fails (the leader
    unreachable just then): the others still land the step in flight with
    its part, and learn of its going when its session ends with its
    process; every sample of the run is trained once."""
    steps = 250
    group = Workers(plane, tmp_path, steps=steps)
    try:
        team = group.start_together(3, faults=("", "", "failed_leaves=1"))
        for worker in team:
            wait_step(worker, lambda e: e["world"] == 3 and e["step"] >= 4)
        team[2].signal(signal.SIGINT)
        assert team[2].proc.wait(timeout=PATIENCE) == 130, team[2].log_tail()
        assert "leave failed: injected fault" in team[2].log_tail(40)
        leavers_last = max(e["step"] for e in team[2].steps())
        for survivor in team[:2]:
            assert survivor.proc.wait(timeout=PATIENCE * 2) == 0, survivor.log_tail()
            landed = {e["step"]: e for e in survivor.steps()}
            assert landed[leavers_last + 1]["world"] == 3, landed[leavers_last + 1]
            assert landed[leavers_last + 2]["world"] == 2, landed[leavers_last + 2]
    finally:
        group.close()
    log = (plane.workdir / "replica0.log").read_text(errors="replace")
    assert f"suspect {team[2].member_id}: session stream broken" in log
    ledgers = [Ledger.load(w.ledger).steps() for w in group.all if w.ledger]
    plan = DataPlan(num_samples=_corpus_samples(), global_batch=32, micro_batch=8, seed=0)
    uninterrupted = {s: plan.step_samples(s) for s in range(steps)}
    assert Ledger.compare(uninterrupted, merge_ledgers(ledgers)) == []


def test_in_an_overlap_job_a_survivor_computes_while_its_group_builds(
    plane: ControlPlane, tmp_path: Path
):
    """With ``overlap`` a survivor of a crash builds its new group on a
    thread of its own while it computes the view's first microbatches (the
    buckets' all-reduces, started in the last backward pass, wait for it),
    as without: its build, made 1 s slow, is not a stall of its own. The
    replicas still agree, step by step."""
    group = Workers(plane, tmp_path, 10_000, extra=("--overlap", "--log-level", "debug"))
    try:
        team = group.start_together(3, faults=("slow_builds=20",))
        for worker in team:
            wait_step(worker, lambda e: e["world"] == 3)
        team[2].kill()
        before = epoch_now(team[:2])
        after = [
            wait_step(survivor, lambda e: e["epoch"] > before and e["world"] == 2)
            for survivor in team[:2]
        ]
        log = team[0].log_path.read_text(errors="replace")
        assert "fault injection: building a group" in log
        # The crash's view itself, not a join's before it.
        assert f"while the group of view {after[0]['epoch']} builds" in log, (
            "the survivor waited for its group's build"
        )
        for survivor, first in zip(team[:2], after, strict=True):
            wait_step(survivor, lambda e, f=first: e["epoch"] == f["epoch"] and e["step"] >= 3)
        print(f"digests compared at {assert_digests_agree(team[:2])} steps")
    finally:
        group.close()


def test_a_worker_whose_steps_outlast_the_step_end_wait_says_so_once(plane, tmp_path):
    """A roll call held for a joiner gives the step in flight up after
    ``rollcall_step_end_wait``; a worker whose steps take longer says once
    that every join throws a step's work away, and names the setting."""
    extra = ("--d-model", "128", "--layers", "4", "--set", "rollcall_step_end_wait=0.01")
    said = "did not end within rollcall_step_end_wait"
    team: list[WorkerProcess] = []

    def join() -> None:
        team.append(WorkerProcess(plane, tmp_path / f"w{len(team)}.log", 10_000, extra=extra))
        wait_step(team[0], lambda e: e["world"] == len(team))

    try:
        join()
        join()
        for _ in range(3):  # a join whose roll call met no step in flight says nothing
            join()
            if said in team[0].log_path.read_text(errors="replace"):
                break
        join()  # one more: nothing more to say
    finally:
        stop_together(team, timeout=20)
    lines = [line for line in team[0].log_path.read_text(errors="replace").splitlines()
             if said in line]  # fmt: skip
    assert len(lines) == 1, lines
    assert "--set rollcall_step_end_wait=SECONDS" in lines[0]


def test_an_exception_in_user_code_leaves_and_the_others_continue(workers: Workers, plane):
    # Three copies of one program (the job compares its code): two that
    # never raise, and one whose loop raises at step fail_at.
    def raising(fail_at: int, log: str) -> Process:
        process = Process(
            [sys.executable, "-m", "tests.raising_worker", ",".join(plane.addresses), plane.job,
             str(fail_at)],
            {"ROLLCALL_TOKEN": plane.token}, workers.tmp_path / f"{log}.log",
        )  # fmt: skip
        workers.all.append(process)  # type: ignore[arg-type]
        return process

    def is_step(predicate: Callable[[dict], bool]) -> Callable[[dict], bool]:
        return lambda e: e["event"] == "step" and predicate(e)

    team = [raising(10**9, f"w{i}") for i in range(2)]
    steps = [w.wait_event(is_step(lambda e: e["world"] == 2 and e["step"] >= 3), PATIENCE)
             for w in team]  # fmt: skip
    before = max(e["epoch"] for e in steps)
    fail_at = max(e["step"] for e in steps) + 150  # past its start-up
    buggy = raising(fail_at, "buggy")
    buggy.wait_line(lambda line: f'"step": {fail_at},' in line, timeout=PATIENCE)
    raised_at = time.monotonic()
    after = team[0].wait_event(
        is_step(lambda e: e["epoch"] > before + 1 and e["world"] == 2), PATIENCE
    )
    took = time.monotonic() - raised_at
    print(f"\nexception in user code -> next committed step of the others: {took * 1000:.0f} ms")
    assert buggy.proc.wait(timeout=PATIENCE) != 0
    assert "a bug in user code" in buggy.log_tail(40)
    assert took < Config().detection_bound()
    assert after["step"] > fail_at
