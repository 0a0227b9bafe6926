"""A real user's training loop comes out right, or is refused with a clear
error: an ordinary script (tests/programs/cnn_train.py: BatchNorm, dropout,
a DataLoader with worker processes, AdamW with OneCycleLR, clipping through
the hook, evaluation on rank 0, the model saved) run as real processes on a
real etcd and rendezvous service."""

from __future__ import annotations

import contextlib
import json
import math
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rollcall.membership.config import Config
from rollcall.worker.ledger import Ledger, merge_ledgers
from rollcall.worker.plan import DataPlan
from tests.harness import ROOT, ControlPlane, ProgramProcess, WorkerProcess, wait_for

pytestmark = pytest.mark.integration

PATIENCE = 120.0
PROGRAM = "cnn_train.py"


@pytest.fixture
def plane(etcd, tmp_path: Path) -> Iterator[ControlPlane]:
    control = ControlPlane([etcd.endpoint], tmp_path, events=True)
    try:
        yield control
    finally:
        control.close()


class Programs:
    """Copies of the test program, all stopped at the end."""

    def __init__(self, plane: ControlPlane, tmp_path: Path) -> None:
        self.plane, self.tmp_path = plane, tmp_path
        self.all: list[ProgramProcess] = []

    def start(self, *args: str, env: dict[str, str] | None = None) -> ProgramProcess:
        index = len(self.all)
        program = ProgramProcess(
            self.plane, PROGRAM,
            [*args, "--ledger", str(self.tmp_path / f"ledger{index}.jsonl")],
            self.tmp_path / f"program{index}.log", env=env,
        )  # fmt: skip
        self.all.append(program)
        return program

    def close(self) -> None:
        for program in self.all:
            with contextlib.suppress(Exception):
                program.stop(timeout=20)


@pytest.fixture
def programs(plane: ControlPlane, tmp_path: Path) -> Iterator[Programs]:
    group = Programs(plane, tmp_path)
    try:
        yield group
    finally:
        group.close()


def wait_step(program: ProgramProcess, predicate, timeout: float = PATIENCE) -> dict:
    return program.wait_event(lambda e: e["event"] == "step" and predicate(e), timeout)


def assert_a_pair_agrees_at_every_step(programs: Programs, *flags: str) -> None:
    """Two workers train four steps together, with ``flags``: both exit 0
    and their model digests agree after every step."""
    args = ["--steps", "4", "--loader-workers", "0", "--min-workers", "2", "--digests", *flags]
    team = [programs.start(*args) for _ in range(2)]
    for program in team:
        assert program.proc.wait(timeout=PATIENCE) == 0, program.log_tail()
    models: dict[int, set[str]] = {}
    for program in team:
        for event in program.events("step"):
            assert event["world"] == 2
            models.setdefault(event["step"], set()).add(event["model"])
    assert sorted(models) == [0, 1, 2, 3]
    assert {step: d for step, d in models.items() if len(d) > 1} == {}


def reference_steps(*args: str) -> dict[int, dict]:
    """Step records of the single-process run (no rollcall) of the program."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "programs" / PROGRAM), "--reference", *args],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    events = [json.loads(line) for line in result.stdout.splitlines()]
    return {e["step"]: e for e in events if e["event"] == "step"}


def replica_log(plane: ControlPlane) -> str:
    return plane.replicas[0].log_path.read_text()


def view_changes(plane: ControlPlane) -> list[dict]:
    assert plane.events is not None
    if not plane.events.exists():
        return []
    records = [json.loads(line) for line in plane.events.read_text().splitlines()]
    return [r for r in records if r.get("kind") == "view_change"]


@pytest.mark.parametrize("overlap", [False, True], ids=["reduce-after-backward", "overlapped"])
def test_an_ordinary_script_survives_a_kill_and_a_join_with_every_replica_identical(
    programs: Programs, tmp_path: Path, overlap: bool
) -> None:
    steps = 400  # the survivors must still be training when the joiner arrives
    (tmp_path / "models").mkdir()
    models = tmp_path / "models"
    common = ["--steps", str(steps), "--digests", "--eval-every", "40", "--save-all", str(models),
              "--min-workers", "3", *(["--overlap"] if overlap else [])]  # fmt: skip
    team = [programs.start(*common) for _ in range(3)]
    for program in team:
        wait_step(program, lambda e: e["step"] >= 25)
    victim, survivors = team[2], team[:2]
    killed_at_step = max(e["step"] for e in victim.events("step"))
    victim.kill()
    for program in survivors:
        wait_step(program, lambda e: e["world"] == 2)
    joiner = programs.start(*common)
    for program in [*survivors, joiner]:
        wait_step(program, lambda e: e["world"] == 3, timeout=PATIENCE)
    for program in [*survivors, joiner]:
        assert program.proc.wait(timeout=PATIENCE) == 0, program.log_tail()

    # Every replica has the same full state (parameters, buffers, optimizer,
    # scheduler) at every step it committed.
    by_step: dict[int, set[str]] = {}
    for program in programs.all:
        for event in program.events("step"):
            by_step.setdefault(event["step"], set()).add(event["digest"])
    assert sorted(by_step) == list(range(steps))
    assert {s: d for s, d in by_step.items() if len(d) > 1} == {}
    # Survivors' buffers agree, so no view change made one fetch the state for
    # differing from the others. (One whose step in flight was aborted while
    # the other's completed holds the step before, and fetches: that is not it.)
    assert not any("its state of that step differed" in p.log_tail(400) for p in survivors)
    assert "pulled step" in joiner.log_tail(400)
    # No sample lost or repeated across the kill and the join.
    ledgers = [Ledger.load(tmp_path / f"ledger{i}.jsonl").steps() for i in range(4)]
    plan = DataPlan(3000, 48, 8, 0)
    merged = merge_ledgers([ledger for ledger in ledgers if ledger])
    assert Ledger.compare({s: plan.step_samples(s) for s in range(steps)}, merged) == []
    # Until the kill the loss is that of one process running the global batch.
    reference = reference_steps("--steps", str(steps), "--until", str(killed_at_step + 1))
    # Clipping in before_update saw the global gradient: the same norm.
    compared = 0
    for event in team[0].events("step"):
        if event["step"] <= killed_at_step and event["world"] == 3:
            expected = reference[event["step"]]
            assert event["loss"] == pytest.approx(expected["loss"], rel=1e-6)
            assert event["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
            compared += 1
    assert compared >= 20
    assert any(e["event"] == "eval" for p in programs.all for e in p.events())
    # Whichever rank saves the model, it is the same model, buffers included.
    saved = [torch.load(path, weights_only=True) for path in sorted(models.glob("*.pt"))]
    assert len(saved) == 3
    for other in saved[1:]:
        assert other.keys() == saved[0].keys()
        assert all(torch.equal(other[k], saved[0][k]) for k in saved[0]), "replicas differ"


def test_state_the_loop_changes_after_commit_travels_with_its_step(
    programs: Programs, tmp_path: Path
) -> None:
    # The loop updates its EMA (registered state) after commit() returns, as
    # ordinary loops do; here it pauses first, so that the joiner's roll call
    # and the checkpoints land in between. What a peer is sent, and what a
    # checkpoint holds, must be the step's whole state: what the loop holds
    # when it asks for the next step, EMA update included.
    checkpoints = tmp_path / "checkpoints"
    common = ["--steps", "40", "--digests", "--after-commit-pause", "0.3", "--loader-workers",
              "0", "--checkpoint-every", "4"]  # fmt: skip
    env = {"ROLLCALL_CHECKPOINT_DIR": str(checkpoints)}
    first = programs.start(*common, env=env)
    wait_step(first, lambda e: e["step"] >= 3)
    joiner = programs.start(*common, env=env)
    for program in (first, joiner):
        assert program.proc.wait(timeout=PATIENCE) == 0, program.log_tail()
    assert "pulled step" in joiner.log_tail(400)
    by_step: dict[int, set[str]] = {}
    for program in programs.all:
        for event in program.events("step"):
            by_step.setdefault(event["step"], set()).add(event["digest"])
    assert sorted(by_step) == list(range(40))
    assert {s: d for s, d in by_step.items() if len(d) > 1} == {}, "the joiner's state differs"
    manifests = [json.loads(p.read_text()) for p in checkpoints.glob("*.manifest.json")]
    assert len(manifests) >= 3
    for manifest in manifests:
        assert {manifest["digest"]} == by_step[manifest["step"]], manifest["uri"]


def test_registered_state_whose_load_state_dict_forgets_a_field_is_refused_at_the_pull(
    programs: Programs,
) -> None:
    # The EMA's load_state_dict keeps its own weights (a state class that
    # forgot a field). At 88252a8 the joiner pulled the step, kept the EMA
    # it had built, and both workers trained on to exit 0 with different
    # EMAs: the weights a script exports at the end depended on which
    # worker exported them.
    common = ["--steps", "100000", "--loader-workers", "0", "--ema-load-forgets"]
    first = programs.start(*common)
    wait_step(first, lambda e: e["step"] >= 3)
    joiner = programs.start(*common)
    assert joiner.proc.wait(timeout=PATIENCE) != 0, joiner.log_tail()
    log = joiner.log_tail(30)
    assert "UsageError: state['ema']: after load_state_dict" in log, log
    assert "'weights'" in log, log
    assert not joiner.events("step")
    at = first.events("step")[-1]["step"]
    wait_step(first, lambda e: e["step"] > at + 3)


def test_a_scheduler_stepped_in_the_loop_as_well_is_refused(programs: Programs) -> None:
    program = programs.start("--steps", "20", "--misuse-scheduler")
    assert program.proc.wait(timeout=PATIENCE) != 0
    assert "remove scheduler.step() from the loop" in program.log_tail(30)
    assert program.events("step") == [], "a step was applied with the schedule stepped twice"


def test_a_second_scheduler_built_after_elastic_is_refused_at_the_first_commit(
    programs: Programs,
) -> None:
    # A warm-up built after Elastic, beside the registered OneCycleLR, and
    # stepped in the loop: the runtime never steps it, so a worker that
    # joins starts its schedule again from 0.
    program = programs.start("--steps", "20", "--late-warmup")
    assert program.proc.wait(timeout=PATIENCE) != 0
    log = program.log_tail(30)
    assert "another LR scheduler (LinearLR) is attached to this optimizer" in log, log
    assert program.events("step") == [], "a step was applied with a schedule not registered"


def test_a_late_worker_on_a_job_with_progress_and_no_checkpoint_will_not_start_from_scratch(
    plane: ControlPlane, tmp_path: Path
) -> None:
    first = WorkerProcess(plane, tmp_path / "first.log", steps=1000)
    try:
        first.wait_event(lambda e: e["event"] == "step" and e["step"] >= 5, timeout=PATIENCE)
        wait_for(lambda: plane.status_json()["last_step"] is not None, "progress recorded")
    finally:
        first.kill()
    late = WorkerProcess(plane, tmp_path / "late.log", steps=1000)
    try:
        assert late.proc.wait(timeout=PATIENCE) == 4
        tail = late.log_tail(20)
        assert "cannot resume" in tail and "--start-over" in tail
        assert late.steps() == [], "the late worker trained from step 0"
    finally:
        late.stop()
    again = WorkerProcess(plane, tmp_path / "again.log", steps=1000, extra=["--start-over"])
    try:
        first_step = again.wait_event(lambda e: e["event"] == "step", timeout=PATIENCE)
        assert first_step["step"] == 0
        assert "starting over from step 0 as asked" in again.log_tail(50)
    finally:
        again.stop()


def test_sigterm_is_a_clean_leave_not_a_crash(plane: ControlPlane, tmp_path: Path) -> None:
    team = [WorkerProcess(plane, tmp_path / f"w{i}.log", steps=100_000) for i in range(3)]
    try:
        for worker in team:
            worker.wait_event(lambda e: e["event"] == "step" and e["world"] == 3, PATIENCE)
        leaving = team[2]
        before = max(e["epoch"] for e in team[0].steps())
        sent = time.monotonic()
        leaving.signal(signal.SIGTERM)
        team[0].wait_event(
            lambda e: e["event"] == "step" and e["epoch"] > before and e["world"] == 2, PATIENCE
        )
        stall = time.monotonic() - sent
        assert leaving.proc.wait(timeout=PATIENCE) == 128 + signal.SIGTERM
        assert "left job" in leaving.log_tail(10) and "Traceback" not in leaving.log_tail(40)
        print(f"\nSIGTERM -> next committed step of the others: {stall * 1000:.0f} ms")
        assert stall < Config().detection_bound(), "the others waited for a detector"
        log = replica_log(plane)
        assert f"leave:{leaving.member_id}" in log
        assert f"suspect:{leaving.member_id}" not in log
        changes = wait_for(
            lambda: [c for c in view_changes(plane) if c["epoch"] > before], "the view change"
        )
        assert changes[0]["cause"] == "leave"
    finally:
        for worker in team:
            worker.stop()


def test_a_rank_away_for_twice_the_collective_timeout_in_declared_busy_time_costs_no_roll_call(
    programs: Programs, plane: ControlPlane
) -> None:
    # Rank 0 evaluates for 12 s after step 9 with collective_timeout at 6 s
    # (its default is 30 s: the ratio is what matters), so without the busy
    # declaration the other rank would give up on it and ask for a roll call.
    args = ["--steps", "14", "--eval-every", "10", "--eval-pause", "12", "--min-workers", "2",
            "--eval-all", "5", "--collective-timeout", "6"]  # fmt: skip
    team = [programs.start(*args) for _ in range(2)]
    for program in team:
        wait_step(program, lambda e: e["step"] >= 9)
    epoch = max(e["epoch"] for e in team[0].events("step"))
    for program in team:
        assert program.proc.wait(timeout=PATIENCE) == 0, program.log_tail()
    evaluation = [e for p in team for e in p.events("eval")]
    assert len(evaluation) == 1 and evaluation[0]["seconds"] >= 12
    after = [e for p in team for e in p.events("step") if e["step"] > 9]
    assert {e["epoch"] for e in after} == {epoch}, "a roll call happened during the busy time"
    log = replica_log(plane)
    assert "reports" not in log and "suspect" not in log
    assert "busy (evaluation)" in log
    [waiting] = [p for p in team if not p.events("eval")]
    assert "is busy (evaluation)" in waiting.log_tail(100)
    # The ranks' own all-reduced evaluation (at steps 4 and 9, the second
    # one waiting for the busy rank) is that of the whole validation set.
    shared = [e for p in team for e in p.events("eval_all")]
    assert sorted(e["step"] for e in shared) == [4, 4, 9, 9]
    for event in shared:
        assert event["world"] == 2
        assert event["loss"] == pytest.approx(event["alone"], rel=1e-5)


@pytest.mark.parametrize("mode", [[], ["--exact"], ["--overlap"]],
                         ids=["default", "exact", "overlapped"])  # fmt: skip
def test_a_parameter_no_rank_used_in_a_step_is_left_alone_by_its_update(
    programs: Programs, mode: list[str]
) -> None:
    # The second head takes part in the loss of steps 0-2 only. A plain loop
    # (and DDP) gives it no gradient from step 3 on, so AdamW leaves it
    # alone; given a zero gradient instead, AdamW would go on moving it by
    # its momentum and weight decay, away from what the script trains.
    args = ["--steps", "8", "--aux-until", "3", "--loader-workers", "0"]
    team = [programs.start(*args, "--min-workers", "2", *mode) for _ in range(2)]
    for program in team:
        assert program.proc.wait(timeout=PATIENCE) == 0, program.log_tail()
    reference = {step: e["aux"] for step, e in reference_steps(*args).items()}
    assert all(reference[step] == reference[2] for step in range(3, 8))
    assert reference[2] != reference[1]
    for program in team:
        aux = {e["step"]: e["aux"] for e in program.events("step") if e["world"] == 2}
        assert sorted(aux) == list(range(8))
        assert [step for step in range(3, 8) if aux[step] != aux[2]] == [], aux
        for step in range(8):
            assert aux[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-7), step


@pytest.mark.parametrize("hook", [[], ["--no-clip"]], ids=["clipped in the hook", "no hook"])
def test_a_layer_run_twice_under_reentrant_checkpointing_trains_as_the_plain_loop_with_overlap(
    programs: Programs, hook: list[str]
) -> None:
    # The mix layer runs twice on the logits, each run checkpointed with
    # use_reentrant=True: its gradient is accumulated twice in each backward
    # pass. With a bucket of its own (440 bytes: its 110 elements), started
    # as soon as its first accumulation was done, the second was added to a
    # sum already under way: each rank's gradient lost the others' part.
    # Without a hook that trained on to exit 0, the losses apart from the
    # plain loop's from step 2; with one, the ranks' hooks were said to differ.
    args = ["--steps", "6", "--loader-workers", "0", "--reentrant-reuse", *hook]
    team = [programs.start(*args, "--min-workers", "2", "--overlap", "--bucket-bytes", "440",
                           "--digests") for _ in range(2)]  # fmt: skip
    for program in team:
        assert program.proc.wait(timeout=PATIENCE) == 0, program.log_tail()
    reference = reference_steps(*args)
    digests: dict[int, set[str]] = {}
    for program in team:
        steps = {e["step"]: e for e in program.events("step") if e["world"] == 2}
        assert sorted(steps) == list(range(6))
        for step, event in steps.items():
            digests.setdefault(step, set()).add(event["digest"])
            assert event["loss"] == pytest.approx(reference[step]["loss"], rel=1e-5), step
            assert event["grad_norm"] == pytest.approx(reference[step]["grad_norm"], rel=1e-4), step
    assert {step: d for step, d in digests.items() if len(d) > 1} == {}


@pytest.mark.parametrize("mode", [[], ["--exact"]], ids=["default", "exact"])
def test_a_buffer_the_forward_pass_assigns_anew_stays_identical_on_every_replica(
    programs: Programs, mode: list[str]
) -> None:
    # `self.mean = 0.9 * self.mean + ...` in a layer's forward pass: at
    # 0785841 the runtime kept the buffer tensor the model held when Elastic
    # was built, so the new ones were never reduced and each replica's
    # running mean followed its own microbatches (the model digests of the
    # two workers apart from step 0, with no word).
    assert_a_pair_agrees_at_every_step(programs, "--centred", *mode)


def test_a_killed_worker_restarted_at_once_on_its_ledger_is_not_refused_by_its_loaders(
    programs: Programs,
) -> None:
    # The ledger file is locked while its worker runs (one file per worker).
    # A loader worker outlives a SIGKILLed training process by up to 5 s (the
    # DataLoader's watchdog): had it inherited the ledger's descriptor, the
    # lock would live on with it, and the worker restarted at once on the
    # same ledger would be refused ("being written by another worker").
    import psutil

    args = ["--steps", "400", "--loader-workers", "2", "--min-workers", "2"]
    team = [programs.start(*args) for _ in range(2)]
    for program in team:
        wait_step(program, lambda e: e["step"] >= 2)
    victim = team[0]
    ledger = (programs.tmp_path / "ledger0.jsonl").resolve()
    opened = {Path(f.path).resolve() for f in psutil.Process(victim.proc.pid).open_files()}
    assert ledger in opened
    loaders = psutil.Process(victim.proc.pid).children()
    assert len(loaders) >= 2, loaders
    for loader in loaders:
        assert ledger not in {Path(f.path).resolve() for f in loader.open_files()}, loader
    victim.signal(signal.SIGKILL)
    victim.proc.wait(timeout=PATIENCE)
    restarted = ProgramProcess(
        programs.plane, PROGRAM, [*args, "--ledger", str(ledger)],
        programs.tmp_path / "restarted.log",
    )  # fmt: skip
    programs.all.append(restarted)
    wait_step(restarted, lambda e: e["world"] == 2)
    assert "being written by another" not in restarted.log_tail(40)


def test_a_job_started_at_step_0_on_a_ledger_another_run_wrote_is_refused_before_it_trains(
    programs: Programs,
) -> None:
    # A script run again with the same --ledger path (a new `rollcall up`,
    # a job started over): at 50e2599 the worker trained step 0, applied
    # it, and died in its commit with "ValueError: step 0 is already
    # recorded", which named neither the file nor what to do.
    path = programs.tmp_path / "ledger0.jsonl"  # the first program's (Programs.start)
    write_ledger(path, PROGRAM_PLAN, steps=3)  # the script's own data plan: its earlier run
    before = path.read_bytes()
    log = refused_before_a_step(programs)
    assert f"the ledger {path} already holds steps 0 to 2" in log, log
    assert path.read_bytes() == before


def test_a_worker_joining_a_job_before_its_first_commit_on_an_earlier_runs_ledger_is_refused(
    programs: Programs,
) -> None:
    # The same script's earlier run left the joiner's ledger (the same data
    # plan). The job has committed no step yet, so the joiner starts at step
    # 0 as much as a worker that starts the job does. Listed as unchecked in
    # an earlier stop (a crash at its first commit feared); it is refused as
    # the starting worker is: no member holds a committed state, so the view
    # takes the resume path.
    hold = programs.tmp_path / "hold"
    hold.touch()
    first = programs.start("--steps", "6", "--loader-workers", "0", "--hold-while", str(hold))
    wait_for(lambda: "step 0 next" in first.log_tail(), "the first worker's view", PATIENCE)
    path = programs.tmp_path / "ledger1.jsonl"  # the second program's
    write_ledger(path, PROGRAM_PLAN, steps=3)
    before = path.read_bytes()
    joiner = programs.start("--steps", "6", "--loader-workers", "0")
    try:
        code = joiner.proc.wait(timeout=PATIENCE)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        hold.unlink()
    log = joiner.log_tail(30)
    assert code is not None and code != 0, log
    assert f"the ledger {path} already holds steps 0 to 2" in log, log
    assert path.read_bytes() == before
    assert first.proc.wait(timeout=PATIENCE) == 0, first.log_tail()


def test_a_worker_joining_on_a_ledger_another_job_wrote_is_refused_and_leaves_it_as_it_was(
    programs: Programs,
) -> None:
    # The --ledger path of another job (another data order) given to a worker
    # that joins a running job at step s > 0: at c079c1b it pulled the state,
    # kept the other job's records up to s, appended this job's after them
    # and trained on to exit 0: one file mixing two jobs' steps, which a
    # merge of the run's ledgers takes for this job's.
    first = programs.start("--steps", "400", "--loader-workers", "0")
    wait_step(first, lambda e: e["step"] >= 3)
    path = programs.tmp_path / "ledger1.jsonl"  # the second program's
    other = DataPlan(PROGRAM_PLAN.num_samples, PROGRAM_PLAN.global_batch,
                     PROGRAM_PLAN.micro_batch, seed=PROGRAM_PLAN.seed + 1)  # fmt: skip
    write_ledger(path, other, steps=3)
    before = path.read_bytes()
    joiner = programs.start("--steps", "400", "--loader-workers", "0")
    assert joiner.proc.wait(timeout=PATIENCE) != 0, joiner.log_tail()
    log = joiner.log_tail(30)
    assert f"UsageError: the ledger {path} holds step 0 with other samples" in log, log
    assert "nothing was trained" in log
    assert not joiner.events("step")
    assert path.read_bytes() == before
    # The job went on without it.
    done = len(first.events("step"))
    wait_step(first, lambda e: e["step"] >= done + 2)
    assert first.proc.poll() is None, first.log_tail()


#: The data plan of tests/programs/cnn_train.py with its default sizes and seed.
PROGRAM_PLAN = DataPlan(num_samples=3000, global_batch=48, micro_batch=8, seed=0)


def write_ledger(path: Path, plan: DataPlan, steps: int) -> None:
    """A ledger file of ``steps`` steps under ``plan``, as a worker of one
    rank writes it."""
    ledger = Ledger(path)
    for step in range(steps):
        ledger.record(step, 1, 1, plan.step_samples(step))
    ledger.close()


@pytest.mark.parametrize("loader_workers", ["0", "2"], ids=["loaded here", "loader workers"])
def test_a_data_set_the_loop_changes_after_elastic_was_built_is_refused_at_the_next_step(
    programs: Programs, loader_workers: str
) -> None:
    # A curriculum kept in the data set (`dataset.flip_chance = 0.9` at
    # step 3). The loader's worker processes hold copies made when they
    # started, and a worker that joins builds its own data set: at b35a462
    # the change reached some samples or none, and training went on, exit 0.
    program = programs.start(
        "--steps", "8", "--loader-workers", loader_workers, "--harder-data-at", "3"
    )
    assert program.proc.wait(timeout=PATIENCE) != 0, program.log_tail()
    log = program.log_tail(30)
    assert "UsageError: step 3: the data set's flip_chance changed from 0.5 to 0.9" in log, log
    assert [e["step"] for e in program.events("step")] == [0, 1, 2]


@pytest.mark.parametrize("mode", [[], ["--exact"]], ids=["default", "exact"])
def test_gradient_noise_a_hook_draws_from_torchs_generator_is_the_same_on_every_rank(
    programs: Programs, mode: list[str]
) -> None:
    # A before_update adding noise to the reduced gradient (DP-SGD, gradient
    # noise) from torch's global generator: at 3809eb2 each rank drew from
    # wherever its last microbatch left the generator, the updates differed,
    # and every rank was refused at the next commit ("different gradients
    # after before_update"). The update now runs with the generators seeded
    # from (seed, step): the same noise everywhere, and the replicas agree.
    assert_a_pair_agrees_at_every_step(programs, "--grad-noise", "0.01", *mode)


def test_a_layer_first_run_twice_under_reentrant_checkpointing_after_its_bucket_started_is_refused(
    programs: Programs,
) -> None:
    # The mix layer runs once in steps 0-2 and twice from step 3 on, and
    # each rank runs one microbatch a step: no earlier pass showed the
    # repeat, and its bucket is under way when the second run's backward
    # adds to it. Refused there, on every rank, naming it. (With more
    # microbatches a rank's earlier passes of step 3 would show it, and its
    # last pass would hold that bucket back.)
    args = ["--steps", "6", "--loader-workers", "0", "--reentrant-reuse", "--reuse-once-until",
            "3", "--global-batch", "16", "--min-workers", "2", "--overlap", "--bucket-bytes",
            "440"]  # fmt: skip
    team = [programs.start(*args) for _ in range(2)]
    for program in team:
        assert program.proc.wait(timeout=PATIENCE) != 0, program.log_tail()
        log = program.log_tail(40)
        assert "UsageError: with overlap=True, the gradient of mix." in log, log
        assert "use_reentrant=False" in log
        assert sorted(e["step"] for e in program.events("step")) == [0, 1, 2]


def test_a_sharded_job_says_once_that_it_updates_a_parameter_no_rank_used(
    programs: Programs,
) -> None:
    # A sharded update runs over flat partitions that cut across parameters:
    # the second head gets a zero gradient from step 3 on and AdamW moves
    # it. Not left unsaid: the log names the parameters, once.
    args = ["--steps", "6", "--aux-until", "3", "--loader-workers", "0", "--min-workers", "2",
            "--shard-redundancy", "1"]  # fmt: skip
    team = [programs.start(*args) for _ in range(2)]
    for program in team:
        assert program.proc.wait(timeout=PATIENCE) == 0, program.log_tail()
        log = program.log_tail(200)
        said = "step 3: no microbatch gave a gradient to 2 of 12 (aux.weight, aux.bias)"
        assert log.count(said) == 1, log
        assert "a sharded job updates such parameters with a zero gradient" in log
        aux = {e["step"]: e["aux"] for e in program.events("step")}
        assert aux[3] != aux[2]  # as said


def test_a_grad_scaler_changes_nothing_but_the_scale(programs: Programs) -> None:
    # Powers of two scale and unscale exactly: one worker with a GradScaler
    # trains bit for bit like the single-process run without one.
    program = programs.start("--steps", "25", "--grad-scaler")
    assert program.proc.wait(timeout=PATIENCE) == 0, program.log_tail()
    reference = reference_steps("--steps", "25")
    losses = [(e["step"], e["loss"]) for e in program.events("step")]
    assert losses == [(s, reference[s]["loss"]) for s in range(25)]


def test_a_worker_started_with_another_value_of_the_scripts_own_setting_is_refused_at_join(
    programs: Programs,
) -> None:
    # The label smoothing is the script's own (its loss), which no other
    # field sees; the script passes it as Elastic(settings=...). Its ledger
    # path differs between the workers and is left out.
    args = ["--steps", "100000", "--loader-workers", "0"]
    first = programs.start(*args)
    wait_step(first, lambda e: e["step"] >= 2)
    other = programs.start(*args, "--label-smoothing", "0.1")
    assert other.proc.wait(timeout=PATIENCE) != 0, other.log_tail()
    log = other.log_tail(30)
    assert "ConfigurationMismatch" in log, log
    assert "this worker's settings is label_smoothing=0.1 but job job1's is " in log, log
    assert "label_smoothing=0.0" in log and "a label smoothing" in log, log
    assert not other.events("step")
    at = first.events("step")[-1]["step"]
    later = wait_step(first, lambda e: e["step"] > at + 3)
    assert later["world"] == 1


NAN_AT = 5


@pytest.mark.parametrize(
    "mode",
    [[], ["--overlap"], ["--exact"], ["--shard-redundancy", "1"], ["--disabled-grad-scaler"]],
    ids=["default", "overlap", "exact", "sharded", "disabled scaler"],
)
def test_a_step_whose_gradient_is_not_finite_stops_every_rank_before_it_is_applied(
    programs: Programs, mode: list[str]
) -> None:
    # Rank 0's loss is NaN at one step: the reduced gradient of that step is
    # NaN on every rank. Applied, it would make every replica's weights NaN
    # for the rest of the run, with no error. A grad scaler built with
    # enabled=False (mixed precision off) skips nothing: its step() is the
    # optimizer's.
    for log in stopped_at_the_nan_step(programs, "--nan-at", str(NAN_AT), *mode):
        assert f"step {NAN_AT}: the reduced gradient" in log, log
        assert f"hold step {NAN_AT - 1}" in log, log


def stopped_at_the_nan_step(
    programs: Programs, *flags: str, applied: int = NAN_AT, env: dict[str, str] | None = None
) -> list[str]:
    """The logs of two workers run with ``flags`` (and ``env``), once each
    has stopped at step ``NAN_AT`` with ``NonFiniteGradient``, every step
    before it committed and none after, the first ``applied`` with a finite
    loss."""
    args = ["--steps", "12", "--min-workers", "2", "--loader-workers", "0", *flags]
    team = [programs.start(*args, env=env) for _ in range(2)]
    for program in team:
        assert program.proc.wait(timeout=PATIENCE) != 0, program.log_tail()
    logs = []
    for program in team:
        steps = program.events("step")
        assert [e["step"] for e in steps] == list(range(NAN_AT)), program.log_tail()
        assert all(math.isfinite(e["loss"]) for e in steps[:applied])
        logs.append(program.log_tail(60))
        assert "NonFiniteGradient" in logs[-1], logs[-1]
    return logs


@pytest.mark.parametrize("scaler", [[], ["--grad-scaler"]], ids=["no scaler", "grad scaler"])
def test_a_gradient_before_update_leaves_not_finite_stops_every_rank_before_the_update(
    programs: Programs, scaler: list[str]
) -> None:
    # The reduced gradient is finite; the hook (a division by a norm of 0)
    # makes it NaN. The optimizer would apply it on every rank; so would a
    # grad scaler, which found nothing when it unscaled.
    for log in stopped_at_the_nan_step(programs, "--hook-nan-at", str(NAN_AT), *scaler):
        assert f"step {NAN_AT}: the gradient before_update (__main__.Clip) left" in log, log
        assert "1 of 10 (head.bias)" in log and "fix the hook" in log, log


@pytest.mark.parametrize("mode", [[], ["--shard-redundancy", "1"]], ids=["replicated", "sharded"])
def test_an_update_that_leaves_parameters_not_finite_stops_every_rank_before_a_checkpoint(
    programs: Programs, mode: list[str]
) -> None:
    # The gradient is finite; the update is not (a learning rate of NaN,
    # as a schedule computed wrongly gives): every replica's weights are NaN
    # after it. Kept, every later step would be NaN and every checkpoint
    # from then on; the checkpoint due at that very step is not written.
    checkpoints = programs.tmp_path / "checkpoints"
    logs = stopped_at_the_nan_step(
        programs, "--lr-nan-at", str(NAN_AT), "--checkpoint-every", str(NAN_AT + 1), *mode,
        env={"ROLLCALL_CHECKPOINT_DIR": str(checkpoints)},
    )  # fmt: skip
    for log in logs:
        assert f"step {NAN_AT}: the parameters the optimizer's update left are not finite" in log
        assert "10 of 10" in log and "learning rates: nan" in log, log
    written = [p.name for p in checkpoints.rglob("*") if p.is_file()]
    assert not written, written  # the first due is at step NAN_AT: its weights are NaN


def test_a_nan_sample_under_a_grad_scaler_stops_every_rank_before_its_statistics_are_kept(
    programs: Programs,
) -> None:
    # One pixel of one sample is NaN: the forward pass makes the batch
    # norms' running statistics NaN. The grad scaler skips the step's
    # gradient, but the statistics have moved: training (on batch
    # statistics) went on to the last step with exit 0, and every
    # evaluation of the final model read NaN.
    for log in stopped_at_the_nan_step(programs, "--grad-scaler", "--nan-input-at", str(NAN_AT)):
        assert f"step {NAN_AT}: the buffers the step's forward passes left are not finite" in log
        assert "features.1.running_mean" in log, log


def refused_before_a_step(programs: Programs, *args: str) -> str:
    """The log of one worker run with ``args`` (a few steps, no loader
    workers), once it has stopped with a ``UsageError`` before committing
    any step."""
    program = programs.start("--steps", "6", "--loader-workers", "0", *args)
    assert program.proc.wait(timeout=PATIENCE) != 0, program.log_tail()
    log = program.log_tail(30)
    assert "UsageError" in log, log
    assert not program.events("step")
    return log


def test_a_loop_that_leaves_the_microbatches_of_a_step_early_is_refused_at_its_commit(
    programs: Programs,
) -> None:
    # A break out of `for batch in step.microbatches()` (a time budget per
    # step, a debugging limit, an error caught outside the loop) left the
    # rest of the rank's microbatches unrun; the step was applied on the
    # first 2 of 6 and its 48 samples were recorded as trained.
    log = refused_before_a_step(programs, "--break-after", "2")
    assert "step 0: the loop left step.microbatches() with 3 of this rank's 6" in log, log
    assert "samples would be recorded as trained" in log


def test_a_hook_that_drops_every_gradient_at_every_step_is_refused_before_the_update(
    programs: Programs,
) -> None:
    # optimizer.zero_grad() moved from a plain loop's end into before_update
    # (after the clipping): the optimizer found no gradient and left every
    # parameter as it was; at c079c1b the job trained on, exit 0, with a
    # model that never learned. A skipped update is a hook's choice now and
    # then; max_skipped_steps of them in a row are refused.
    program = programs.start(
        "--steps", "8", "--loader-workers", "0", "--zero-grad-in-hook", "all",
        "--max-skipped-steps", "3",
    )  # fmt: skip
    assert program.proc.wait(timeout=PATIENCE) != 0, program.log_tail()
    log = program.log_tail(30)
    assert "UsageError: step 2: before_update (__main__.Clip) set every gradient to None at " \
        "each step since step 0 (3 in a row" in log, log
    assert "no update since has been given a gradient" in log
    assert [e["step"] for e in program.events("step")] == [0, 1]


def test_a_hook_that_drops_some_gradients_trains_on(programs: Programs) -> None:
    # A hook that freezes a part by dropping its gradients is a choice.
    program = programs.start(
        "--steps", "4", "--loader-workers", "0", "--zero-grad-in-hook", "head",
        "--max-skipped-steps", "2",
    )  # fmt: skip
    assert program.proc.wait(timeout=PATIENCE) == 0, program.log_tail()
    assert [e["step"] for e in program.events("step")] == [0, 1, 2, 3]


def test_a_loop_that_trains_on_its_own_data_loader_is_refused_at_its_commit(
    programs: Programs,
) -> None:
    # A port that kept its own DataLoader (shuffled, undivided) and never
    # ran step.microbatches(): every worker trained on batches of its own,
    # repeating each other's samples, while the plan's samples of every
    # step were recorded as trained. At 1df8450 it ran its 6 steps, exit 0.
    log = refused_before_a_step(programs, "--own-loader")
    assert (
        "step 0: step.backward() was called before `for batch in step.microbatches()` "
        "handed out any microbatch of the step" in log
    ), log
    assert "not on batches of the script's own DataLoader" in log, log
    # A loop that commits steps it never ran is refused at the commit.
    log = refused_before_a_step(programs, "--commit-only")
    assert "step 0: none of this rank's 6 microbatches of the step was run" in log, log


def test_a_step_left_without_commit_is_refused_when_the_loop_asks_for_the_next(
    programs: Programs,
) -> None:
    # A loop that skips a step it finds bad (`continue` before commit()). At
    # 1df8450 the worker waited for a new view from then on, with no word.
    program = programs.start("--steps", "6", "--loader-workers", "0", "--skip-commit-at", "2")
    assert program.proc.wait(timeout=PATIENCE) != 0, program.log_tail()
    log = program.log_tail(30)
    assert "UsageError: step 2 was handed out and not committed" in log, log
    assert sorted(e["step"] for e in program.events("step")) == [0, 1]


def test_an_epoch_loop_around_steps_is_refused_when_it_asks_again(programs: Programs) -> None:
    # A port that kept its epoch loop, `for epoch in range(3): for step in
    # job.steps(steps_per_epoch)`: steps() takes the job's total, so at
    # b13c651 the later epochs handed out no step and the worker ended with
    # exit 0 after the first epoch, its model trained a third of the way.
    program = programs.start("--steps", "2", "--loader-workers", "0", "--epoch-loop", "3")
    assert program.proc.wait(timeout=PATIENCE) != 0, program.log_tail()
    log = program.log_tail(30)
    assert "UsageError: job.steps(2) was called again after this worker's job.steps(2)" in log, log
    assert "job.steps(epochs * steps_per_epoch)" in log, log
    assert sorted(e["step"] for e in program.events("step")) == [0, 1]
    assert not program.events("done")


@pytest.mark.parametrize(
    "mode", [[], ["--overlap"], ["--exact"], ["--shard-redundancy", "1"]],
    ids=["default", "overlap", "exact", "sharded"],
)  # fmt: skip
def test_a_loop_that_calls_steps_again_with_a_larger_total_trains_on(
    programs: Programs, mode: list[str]
) -> None:
    # Training in phases (`job.steps(100)`, an evaluation, `job.steps(200)`):
    # at b13c651 the later call waited for a view change that never came,
    # the first worker there hanging while the other waited for it.
    args = ["--steps", "2", "--loader-workers", "0", "--min-workers", "2", "--phases", "3", *mode]
    team = [programs.start(*args) for _ in range(2)]
    for program in team:
        assert program.proc.wait(timeout=PATIENCE) == 0, program.log_tail()
        assert [e["step"] for e in program.events("step")] == [0, 1, 2, 3, 4, 5]
        assert [e["step"] for e in program.events("done")] == [5]


def test_a_backward_pass_outside_the_microbatch_loop_is_refused(programs: Programs) -> None:
    # An L2 penalty given to step.backward once per step, after the loop:
    # every worker adds it, so the step's gradient held it once per worker
    # (3 times with 3 workers, once alone). At 1df8450 it trained on, exit 0.
    log = refused_before_a_step(programs, "--step-penalty", "0.001")
    assert (
        "UsageError: step 0: step.backward() was called outside `for batch in "
        "step.microbatches()` (after its last microbatch)" in log
    ), log
    assert "once per worker" in log and "before_update" in log, log


def test_an_all_reduce_between_a_steps_microbatches_is_refused_on_every_rank(
    programs: Programs,
) -> None:
    # Three microbatches a step over two workers: rank 0 runs two, rank 1
    # one, so a job.all_reduce after each backward pass is called twice on
    # one and once on the other. At 1df8450 rank 1's gradient all-reduce met
    # rank 0's second call: gloo aborted rank 0's process ("Received data
    # size doesn't match expected size"), and rank 1 waited for a second
    # worker from then on.
    args = ["--steps", "4", "--loader-workers", "0", "--global-batch", "24", "--min-workers",
            "2", "--all-reduce-in-step"]  # fmt: skip
    team = [programs.start(*args) for _ in range(2)]
    for program in team:
        assert program.proc.wait(timeout=PATIENCE) != 0, program.log_tail()
        log = program.log_tail(30)
        assert (
            "UsageError: step 0: job.all_reduce() was called between the step's first "
            "microbatch and its commit()" in log
        ), log
        assert "doesn't match expected size" not in log and "terminate called" not in log, log
        assert not program.events("step")


@pytest.mark.parametrize(
    ("ported", "said"),
    [("mean", "a loss averaged over its samples (NllLossBackward0"),
     ("accumulated", "weighing 0.25, reached through DivBackward0) with count=8"),
     ("divided", "a loss summed over its samples and divided by count=8, which is their mean"),
     ("scaled", "a loss the grad scaler has scaled (scaler.scale(loss))")],
    ids=["averaged", "averaged and divided", "summed and divided", "already scaled"],
)  # fmt: skip
def test_a_loss_averaged_or_already_scaled_is_refused_at_the_first_backward(
    programs: Programs, ported: str, said: str
) -> None:
    # step.backward wants the loss summed and unscaled. Given a batch's mean
    # (a port that kept the default reduction) the gradient is 8 times too
    # small, 32 times with a gradient accumulation's "/ 4" kept, and so it
    # is for a sum divided by the count (the mean spelled out); given
    # scaler.scale(loss) (a port that kept AMP's line), it is the scale
    # times too large. AdamW and the clip hide most of either: the run
    # trained on, with no error.
    log = refused_before_a_step(programs, "--grad-scaler", "--ported-loss", ported)
    assert said in log, log


def test_a_generator_the_first_forward_pass_makes_is_refused_in_exact_mode(
    programs: Programs,
) -> None:
    # A custom dropout that makes its torch.Generator on first use
    # (`if self.noise is None: self.noise = torch.Generator().manual_seed(7)`)
    # was not among the generators found when Elastic was built. Each
    # process's first microbatch drew from the fresh generator and later
    # ones went on from there: at eed8d21 exact mode trained on, exit 0,
    # and one worker and two drew other masks (other bits, no word).
    log = refused_before_a_step(programs, "--exact", "--model-generator", "in-forward")
    assert "the model made a random generator during this process's first microbatch" in log
    assert "(noise: a torch.Generator)" in log, log


@pytest.mark.parametrize(
    ("mode", "zeroed"),
    [((), "none"), ((), "zeros"), (("--exact",), "none"), (("--overlap",), "zeros")],
    ids=["default, set to None", "default, zeroed in place", "exact", "overlapped, in place"],
)  # fmt: skip
def test_zero_grad_between_microbatches_is_refused_at_the_next_backward(
    programs: Programs, mode: tuple[str, ...], zeroed: str
) -> None:
    # A plain loop's optimizer.zero_grad() kept at the top of the microbatch
    # loop throws away the gradients of the rank's earlier microbatches of
    # the step, which the count still includes: the step's gradient is the
    # last microbatch's, divided by all of them. The run trained on with no
    # error. (In exact mode each microbatch's gradient is already taken
    # apart, so nothing is lost there, but the loop is refused alike: the
    # same loop is wrong in the other modes.)
    log = refused_before_a_step(programs, "--ported-zero-grad", zeroed, *mode)
    assert "since the step's previous step.backward()" in log, log
    assert "remove zero_grad() from the loop" in log, log


def test_a_zero_grad_at_the_top_of_a_step_that_kept_microbatches_is_refused(
    programs: Programs,
) -> None:
    # A plain loop's zero_grad() kept before the step's microbatch loop is
    # harmless while every step's gradients start empty. After a kill mid-step
    # a survivor keeps the microbatches it finished whose new split still
    # gives them to it: their gradients wait in .grad and they are not run
    # again. Zeroed there, they were dropped from the step's gradient while
    # its count still held them, and the run trained on with no error.
    common = ["--steps", "12", "--loader-workers", "0", "--zero-grad-at-step-start",
              "--microbatch-pause", "0.6", "--slow-until", "12", "--min-workers", "3"]
    team = [programs.start(*common) for _ in range(3)]
    for program in team:
        wait_step(program, lambda e: e["step"] >= 3)
    first = team[0]
    seen = first.last_step()
    wait_for(lambda: first.last_step() > seen, "the next step", PATIENCE)
    # Rank 0 (2 microbatches a step, each followed by a 0.6 s pause) has
    # finished its first and is in its second.
    time.sleep(0.9)
    team[2].kill()
    logs = []
    for program in team[:2]:
        program.proc.wait(timeout=PATIENCE)
        logs.append(program.log_tail(60))
    kept = [log for log in logs if "finished before it was aborted are kept" in log]
    assert kept, logs  # the kill landed mid-step: a survivor kept microbatches
    for log in kept:
        assert "UsageError" in log and "since the step's previous step.backward()" in log, log
        assert "also those kept from an aborted attempt" in log, log


@pytest.mark.parametrize("when", ["before", "after"], ids=["before commit", "after commit"])
def test_a_second_optimizer_stepped_in_the_loop_is_refused_at_its_step(
    programs: Programs, when: str
) -> None:
    # A job with two optimizers (Muon for the matrices and AdamW for the
    # rest, SparseAdam for the embeddings) ported by passing one to Elastic
    # and stepping the other in the loop as before: stepped before commit()
    # it applies this worker's partial gradient (the replicas part), after
    # it there is no gradient left (the runtime drops them with its update)
    # and its parameters never train. Both trained on with no error.
    # Refused at step 0 (the program says a step after stepping the other).
    log = refused_before_a_step(programs, "--second-optimizer", when)
    assert "another optimizer (SGD) holds 2 of the model's" in log, log
    assert "Elastic steps only the optimizer passed to it" in log, log


def test_a_trainable_parameter_no_optimizer_holds_is_left_alone(programs: Programs) -> None:
    # A model part left out of the optimizer but still trainable (a
    # fine-tuning that builds the optimizer on the head only): its gradient
    # is reduced with the others and dropped with the update, as the
    # optimizer's own are, not left to add up into the next step.
    program = programs.start("--steps", "4", "--loader-workers", "0",
                             "--second-optimizer", "never")  # fmt: skip
    assert program.proc.wait(timeout=PATIENCE) == 0, program.log_tail()
    assert [e["step"] for e in program.events("step")] == [0, 1, 2, 3]


def test_a_grad_scaler_skips_a_step_whose_gradient_is_not_finite(programs: Programs) -> None:
    # With a grad scaler a non-finite step is expected (mixed precision): the
    # scaler skips it and lowers its scale, and the run goes on. Three skips
    # in a row are fewer than max_skipped_steps=4.
    nan = range(NAN_AT, NAN_AT + 3)
    program = programs.start("--steps", "12", "--grad-scaler", "--loader-workers", "0",
                             "--nan-at", str(NAN_AT), "--nan-for", "3",
                             "--max-skipped-steps", "4")  # fmt: skip
    assert program.proc.wait(timeout=PATIENCE) == 0, program.log_tail()
    losses = {e["step"]: e["loss"] for e in program.events("step")}
    assert sorted(losses) == list(range(12))
    assert all(math.isnan(losses[step]) for step in nan)
    assert all(math.isfinite(loss) for step, loss in losses.items() if step not in nan)


def test_a_grad_scaler_that_skips_every_step_stops_the_run(programs: Programs) -> None:
    # From step NAN_AT on, rank 0's loss is NaN at every step: the scaler
    # skips them all, and would to the last step, the run ending with exit 0
    # and a model that stopped training at NAN_AT - 1.
    logs = stopped_at_the_nan_step(
        programs, "--grad-scaler", "--nan-at", str(NAN_AT - 3), "--nan-for", "100",
        "--max-skipped-steps", "4", applied=NAN_AT - 3,
    )  # fmt: skip
    for log in logs:
        assert f"every step since step {NAN_AT - 3} (4 in a row" in log, log
        assert f"has not changed since step {NAN_AT - 4}" in log, log


def test_an_unreachable_rendezvous_is_said_within_seconds(plane: ControlPlane) -> None:
    from rollcall.etcd_local import free_port

    program = ProgramProcess(
        plane, PROGRAM, ["--steps", "5"], plane.workdir / "lost.log",
        env={"ROLLCALL_RENDEZVOUS": f"127.0.0.1:{free_port()}"},
    )  # fmt: skip
    try:
        started = time.monotonic()
        wait_for(
            lambda: "cannot reach the rendezvous service" in program.log_tail(5),
            "the unreachable-service message", timeout=30,
        )  # fmt: skip
        assert time.monotonic() - started < 20
    finally:
        program.stop()


def test_a_sigterm_handler_of_the_scripts_is_said_to_be_replaced_while_the_job_runs(
    programs: Programs,
) -> None:
    # A cluster script's own SIGTERM handler (save and requeue): Elastic
    # installs its own while the job runs, so the script's never ran, and
    # at 085a996 nothing said so.
    program = programs.start("--steps", "100", "--own-sigterm", "--loader-workers", "0")
    wait_step(program, lambda e: e["step"] >= 1)
    log = program.log_tail(40)
    replaced = r"the script's SIGTERM handler \([\w.]*requeue\) is replaced while the job runs"
    assert re.search(replaced, log), log
    assert "catch rollcall.Interrupted" in log, log
    program.signal(signal.SIGTERM)
    assert program.proc.wait(timeout=PATIENCE) == 128 + signal.SIGTERM  # left cleanly
    assert not program.events("requeue")


def test_a_second_signal_exits_at_once(programs: Programs, plane: ControlPlane) -> None:
    # The first SIGINT arrives while rank 0 is busy for 60 s: it leaves the
    # job at once, but the evaluation goes on; the second ends the process.
    args = ["--steps", "100", "--eval-every", "3", "--eval-pause", "60"]
    program = programs.start(*args)
    wait_step(program, lambda e: e["step"] >= 2)
    time.sleep(0.5)  # inside the evaluation now
    program.signal(signal.SIGINT)
    wait_for(lambda: "leave" in replica_log(plane), "the leave", timeout=30)
    sent = time.monotonic()
    program.signal(signal.SIGINT)
    assert program.proc.wait(timeout=30) == 128 + signal.SIGINT
    assert time.monotonic() - sent < 5
    assert "second SIGINT: exiting at once" in program.log_tail(5)
