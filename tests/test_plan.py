"""The data plan and the ledger (DESIGN.md, "Data: no sample lost, none
counted twice")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollcall.membership.errors import UsageError
from rollcall.worker.ledger import Ledger, merge_ledgers
from rollcall.worker.plan import (
    DataPlan,
    Microbatch,
    load_seed,
    microbatch_seed,
)

ROOT = Path(__file__).resolve().parent.parent


@st.composite
def plans(draw: st.DrawFn) -> DataPlan:
    """Small plans: up to 8 microbatches of up to 4 samples, and a dataset of
    one to a few global batches, often not a multiple of the global batch so
    that steps straddle data epochs."""
    micro_batch = draw(st.integers(1, 4))
    global_batch = micro_batch * draw(st.integers(1, 8))
    num_samples = draw(st.integers(global_batch, 3 * global_batch + 5))
    seed = draw(st.integers(-(2**40), 2**40))
    return DataPlan(num_samples, global_batch, micro_batch, seed)


# The order ---------------------------------------------------------------


@given(plans(), st.integers(0, 50))
def test_order_is_a_permutation_of_the_dataset(plan: DataPlan, data_epoch: int) -> None:
    assert sorted(plan.order(data_epoch)) == list(range(plan.num_samples))


@given(plans(), st.integers(0, 50))
def test_order_depends_only_on_seed_and_data_epoch(plan: DataPlan, data_epoch: int) -> None:
    other = DataPlan(plan.num_samples, plan.global_batch, plan.micro_batch, plan.seed)
    other.order(data_epoch + 1)

    assert other.order(data_epoch) == plan.order(data_epoch)


def test_order_differs_across_data_epochs_and_seeds() -> None:
    plan = DataPlan(1000, 10, 5, seed=3)

    assert len({plan.order(e) for e in range(5)}) == 5
    assert DataPlan(1000, 10, 5, seed=4).order(0) != plan.order(0)


def test_order_is_pinned_so_every_machine_and_version_derives_it() -> None:
    assert DataPlan(10, 4, 2, seed=7).order(0) == (5, 3, 8, 6, 1, 4, 2, 9, 0, 7)
    assert DataPlan(10, 4, 2, seed=7).order(1) == (7, 0, 5, 3, 4, 8, 2, 1, 6, 9)


@pytest.mark.integration
def test_order_and_seeds_are_the_same_in_another_process() -> None:
    script = (
        "from rollcall.worker.plan import DataPlan, microbatch_seed\n"
        "plan = DataPlan(500, 20, 4, seed=11)\n"
        "print(list(plan.order(3)), microbatch_seed(11, 9, 2))\n"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", script],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        ).stdout
        for hash_seed in ("1", "2")
    }
    plan = DataPlan(500, 20, 4, seed=11)

    assert outputs == {f"{list(plan.order(3))} {microbatch_seed(11, 9, 2)}\n"}


def test_order_is_recomputed_correctly_after_leaving_the_cache() -> None:
    plan = DataPlan(50, 10, 5, seed=1)
    first = plan.order(0)
    plan.order(1)
    plan.order(2)

    assert plan.order(0) == first


# Steps -------------------------------------------------------------------


def test_position_is_data_epoch_and_offset_of_the_first_sample() -> None:
    plan = DataPlan(10, 4, 2, seed=0)

    assert [plan.position(s) for s in range(6)] == [
        (0, 0),
        (0, 4),
        (0, 8),
        (1, 2),
        (1, 6),
        (2, 0),
    ]


def test_a_step_straddling_two_data_epochs_takes_tail_then_head() -> None:
    plan = DataPlan(10, 4, 2, seed=0)

    assert plan.step_samples(2) == plan.order(0)[8:] + plan.order(1)[:2]


@given(plans(), st.integers(1, 4))
def test_steps_consume_the_epoch_orders_consecutively(plan: DataPlan, epochs: int) -> None:
    steps = -(-epochs * plan.num_samples // plan.global_batch)
    stream = [i for step in range(steps) for i in plan.step_samples(step)]
    orders = [i for e in range(epochs + 1) for i in plan.order(e)]

    assert all(len(plan.step_samples(s)) == plan.global_batch for s in range(steps))
    assert stream == orders[: len(stream)]


@given(plans(), st.integers(1, 4))
def test_every_sample_is_consumed_once_per_data_epoch(plan: DataPlan, epochs: int) -> None:
    steps = epochs * plan.num_samples // plan.global_batch + 1
    stream = [i for step in range(steps) for i in plan.step_samples(step)]

    for e in range(epochs):
        epoch_samples = stream[e * plan.num_samples : (e + 1) * plan.num_samples]
        assert sorted(epoch_samples) == list(range(plan.num_samples))


def test_samples_per_step_is_the_global_batch() -> None:
    plan = DataPlan(100, 12, 4, seed=0)

    assert plan.samples_per_step() == 12
    assert plan.num_microbatches == 3


# Microbatches ------------------------------------------------------------


@given(plans(), st.integers(0, 30))
def test_microbatches_cut_the_step_in_order(plan: DataPlan, step: int) -> None:
    batches = plan.microbatches(step)

    assert [m.index for m in batches] == list(range(plan.num_microbatches))
    assert all(m.step == step and len(m.sample_ids) == plan.micro_batch for m in batches)
    assert tuple(i for m in batches for i in m.sample_ids) == plan.step_samples(step)


def test_microbatch_seed_comes_from_plan_seed_step_and_index() -> None:
    plan = DataPlan(100, 8, 2, seed=42)

    assert [m.seed for m in plan.microbatches(5)] == [microbatch_seed(42, 5, i) for i in range(4)]


def test_microbatch_seed_is_pinned_and_63_bit() -> None:
    assert microbatch_seed(7, 0, 0) == 2585335097307489986
    assert all(0 <= microbatch_seed(1, s, i) < 2**63 for s in range(50) for i in range(8))


def test_microbatch_seeds_differ_for_neighbouring_inputs() -> None:
    seeds = {microbatch_seed(seed, s, i) for seed in (0, 1) for s in range(40) for i in range(8)}

    assert len(seeds) == 2 * 40 * 8


def test_load_seed_is_pinned_and_63_bit() -> None:
    assert load_seed(7, 0, 0) == 9119223276265718402
    assert load_seed(7, 3, 1) == 6936039513281782405
    assert all(0 <= load_seed(1, s, i) < 2**63 for s in range(50) for i in range(8))


def test_load_seeds_are_not_the_microbatch_seeds() -> None:
    loading = {load_seed(seed, s, i) for seed in (0, 1) for s in range(40) for i in range(8)}
    forward = {microbatch_seed(seed, s, i) for seed in (0, 1) for s in range(40) for i in range(8)}

    assert len(loading) == 2 * 40 * 8
    assert not loading & forward


@given(plans(), st.integers(0, 30), st.integers(1, 16), st.integers(1, 16))
def test_a_microbatch_is_the_same_whichever_world_runs_it(
    plan: DataPlan, step: int, world_a: int, world_b: int
) -> None:
    def by_index(world_size: int) -> dict[int, Microbatch]:
        return {
            m.index: m for rank in range(world_size) for m in plan.for_rank(step, rank, world_size)
        }

    assert by_index(world_a) == by_index(world_b)


# Assignment --------------------------------------------------------------


@given(plans(), st.data())
def test_assignment_is_contiguous_near_even_and_covers_each_microbatch_once(
    plan: DataPlan, data: st.DataObject
) -> None:
    world_size = data.draw(st.integers(1, 2 * plan.num_microbatches))
    blocks = plan.assignment(0, world_size)
    sizes = [len(b) for b in blocks]

    assert len(blocks) == world_size
    assert [i for b in blocks for i in b] == list(range(plan.num_microbatches))
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


@given(plans(), st.data())
def test_idle_ranks_run_nothing_and_the_others_divide_the_step_as_a_smaller_world(
    plan: DataPlan, data: st.DataObject
) -> None:
    """A view's first step while some members fetch the state: every
    microbatch is run once, by the others, in the blocks a world of their
    number would give, in rank order."""
    world_size = data.draw(st.integers(2, 2 * plan.num_microbatches))
    idle = frozenset(data.draw(st.sets(st.integers(0, world_size - 1), max_size=world_size - 1)))
    blocks = plan.assignment(0, world_size, idle)
    active = [rank for rank in range(world_size) if rank not in idle]

    assert all(blocks[rank] == () for rank in idle)
    assert [blocks[rank] for rank in active] == list(plan.assignment(0, len(active)))
    assert sorted(i for b in blocks for i in b) == list(range(plan.num_microbatches))


@pytest.mark.parametrize(
    ("idle", "says"),
    [
        (frozenset({0, 1}), "leave no rank to run step 0"),
        (frozenset({2}), "are not all ranks of 2"),
        (frozenset({-1}), "are not all ranks of 2"),
    ],
)
def test_idle_ranks_must_leave_a_rank_and_be_in_the_world(idle: frozenset[int], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        DataPlan(100, 6, 2, seed=0).assignment(0, 2, idle)


@given(plans(), st.integers(0, 30), st.data())
def test_the_lightest_rank_runs_the_fewest_microbatches(
    plan: DataPlan, step: int, data: st.DataObject
) -> None:
    world_size = data.draw(st.integers(1, 2 * plan.num_microbatches))
    sizes = [len(block) for block in plan.assignment(step, world_size)]

    assert sizes[DataPlan.lightest_rank(world_size)] == min(sizes)


def test_ranks_beyond_the_microbatches_get_none() -> None:
    plan = DataPlan(100, 6, 2, seed=0)

    assert plan.assignment(0, 5) == ((0,), (1,), (2,), (), ())
    assert plan.for_rank(0, 4, 5) == ()


def test_lower_ranks_get_the_extra_microbatches() -> None:
    plan = DataPlan(100, 7, 1, seed=0)

    assert plan.assignment(3, 3) == ((0, 1, 2), (3, 4), (5, 6))


@given(plans(), st.integers(0, 30), st.data())
def test_ranks_together_run_exactly_the_step(
    plan: DataPlan, step: int, data: st.DataObject
) -> None:
    world_size = data.draw(st.integers(1, 2 * plan.num_microbatches))
    together = tuple(m for r in range(world_size) for m in plan.for_rank(step, r, world_size))

    assert together == plan.microbatches(step)


# Validation --------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_samples", "global_batch", "micro_batch", "message"),
    [
        (0, 1, 1, "num_samples must be >= 1"),
        (10, 0, 1, "global_batch must be >= 1"),
        (10, 4, 0, "micro_batch must be >= 1"),
        (10, 4, 3, r"global_batch \(4\) must be a multiple of micro_batch \(3\)"),
        (10, 12, 4, r"global_batch \(12\) must not exceed num_samples \(10\)"),
        (10.0, 4, 2, "num_samples must be an int"),
        (10, True, 1, "global_batch must be an int"),
    ],
)
def test_a_bad_plan_is_refused(
    num_samples: int, global_batch: int, micro_batch: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        DataPlan(num_samples, global_batch, micro_batch, seed=0)


def test_bad_step_rank_and_world_size_are_refused() -> None:
    plan = DataPlan(10, 4, 2, seed=0)

    with pytest.raises(ValueError, match="step must be >= 0"):
        plan.step_samples(-1)
    with pytest.raises(ValueError, match="data_epoch must be >= 0"):
        plan.order(-1)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        plan.assignment(0, 0)
    with pytest.raises(ValueError, match="rank 2 is out of range for world size 2"):
        plan.for_rank(0, 2, 2)
    with pytest.raises(ValueError, match="rank must be >= 0"):
        plan.for_rank(0, -1, 2)


# Ledger ------------------------------------------------------------------


def test_ledger_round_trips_through_its_file(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    ledger.record(3, view_epoch=1, world_size=2, sample_ids=[5, 1])
    ledger.record(4, view_epoch=2, world_size=1, sample_ids=(0, 4))

    loaded = Ledger.load(path)

    assert loaded.steps() == ledger.steps() == {3: (5, 1), 4: (0, 4)}
    assert loaded.entries() == ledger.entries()
    assert loaded.entries()[4].world_size == 1


def test_ledger_file_holds_one_json_line_per_step(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    Ledger(path).record(0, view_epoch=7, world_size=3, sample_ids=[2, 9])

    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 0, "epoch": 7, "world_size": 3, "samples": [2, 9]}
    ]


def test_loading_ignores_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    Ledger(path).record(0, view_epoch=1, world_size=1, sample_ids=[1, 2])
    with path.open("a") as file:
        file.write('{"step":1,"epoch":1,"world_size":1,"samples":[3,')

    assert Ledger.load(path).steps() == {0: (1, 2)}


def test_a_continued_ledger_cuts_the_torn_line_before_appending(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    Ledger(path).record(0, view_epoch=1, world_size=1, sample_ids=[1, 2])
    with path.open("a") as file:
        file.write('{"step":1,"epoch":1,"wor')

    continued = Ledger(path)
    continued.record(1, view_epoch=2, world_size=2, sample_ids=[3, 4])

    assert continued.steps() == Ledger.load(path).steps() == {0: (1, 2), 1: (3, 4)}


@pytest.mark.parametrize(
    "content",
    [b'{"lr": 0.1, "epochs": 90}', b"notes with no newline at their end",
     b'{"step":0,"epoch":1,"world_size":1,"samples":[1]}\nhello'],
    ids=["a one-line config", "text", "a ledger with a foreign tail"],
)  # fmt: skip
def test_a_file_whose_last_line_is_no_record_cut_short_is_refused_and_kept(
    tmp_path: Path, content: bytes
) -> None:
    # ledger= given a file of the user's by mistake (a config of one line
    # with no newline at its end): at a69fb69 its last line was taken for a
    # record a killed worker cut short, and the file was cut to nothing.
    path = tmp_path / "config.json"
    path.write_bytes(content)
    for opening in (Ledger, Ledger.load):
        with pytest.raises(ValueError, match="not a ledger record cut short.*nothing was changed"):
            opening(path)
        assert path.read_bytes() == content


@pytest.mark.parametrize("kind", ["a directory", "a pipe", "a device"])
def test_a_ledger_path_that_is_no_regular_file_is_refused_at_once(
    tmp_path: Path, kind: str
) -> None:
    # A named pipe blocked the open until a reader came (a worker hung
    # before it trained); /dev/null failed the first fsync with "[Errno 22]
    # Invalid argument", naming no path; a directory failed bare.
    if kind == "a pipe":
        path = tmp_path / "pipe"
        os.mkfifo(path)
    else:
        path = tmp_path if kind == "a directory" else Path("/dev/null")
    for opening in (Ledger, Ledger.load):
        with pytest.raises(ValueError, match=f"the ledger {path} is {kind}, not a regular file"):
            opening(path)


@pytest.mark.parametrize("differs", ["first", "last", "seed"])
def test_a_ledger_of_another_data_plan_is_refused_and_one_of_the_plan_is_not(
    tmp_path: Path, differs: str
) -> None:
    # Records of another plan (another job's ledger) would be kept beside
    # this job's: refused, the file unchanged. The plan's own records (the
    # same job's worker restarted on its ledger) are not.
    plan = DataPlan(num_samples=100, global_batch=8, micro_batch=2, seed=3)
    other = DataPlan(num_samples=100, global_batch=8, micro_batch=2, seed=4)
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    for step in range(5, 30):  # a worker that joined at step 5, over three data epochs
        wrong = differs == "seed" or (differs == "first" and step == 5) or (
            differs == "last" and step == 29)  # fmt: skip
        ledger.record(step, 1, 2, (other if wrong else plan).step_samples(step))
    ledger.close()
    before = path.read_bytes()
    opened = Ledger(path)  # as the runtime opens it, before the check
    with pytest.raises(UsageError) as refused:
        opened.refuse_another_plan(plan)
    opened.close()
    own = Ledger(tmp_path / "own.jsonl")
    for step in range(5, 30):
        own.record(step, 1, 2, plan.step_samples(step))
    own.refuse_another_plan(plan)
    own.refuse_another_plan(DataPlan(100, 8, 2, seed=3))  # an equal plan, built anew
    own.close()
    step = 29 if differs == "last" else 5
    assert f"the ledger {path} holds step {step} with other samples" in str(refused.value)
    assert "seed=3" in str(refused.value)
    assert path.read_bytes() == before
    Ledger(tmp_path / "empty.jsonl").refuse_another_plan(plan)


def test_a_ledger_path_that_cannot_be_appended_to_is_refused_naming_it() -> None:
    # A file of /proc: "OSError: [Errno 22] Invalid argument", naming no path.
    with pytest.raises(OSError, match="the ledger /proc/version cannot be appended to"):
        Ledger(Path("/proc/version"))


_FILE_SIZE_LIMITED = """
import resource, signal, sys
from pathlib import Path
from rollcall.worker.ledger import Ledger

path = Path(sys.argv[1])
ledger = Ledger(path, sync_interval=0)
ledger.record(0, view_epoch=1, world_size=1, sample_ids=[1, 2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 20, resource.RLIM_INFINITY))
try:
    ledger.record(1, view_epoch=1, world_size=1, sample_ids=list(range(100, 140)))
except OSError as error:
    print(error)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    ledger.record(1, view_epoch=1, world_size=1, sample_ids=[3, 4])  # room again
    ledger.close()
"""


@pytest.mark.integration
def test_a_record_the_disk_refuses_names_the_ledger_and_step_and_leaves_no_half_line(
    tmp_path: Path,
) -> None:
    # A full disk (here a file size limit, which the kernel enforces the
    # same way: a write cut short, then an error) failed the commit with
    # "[Errno 27] File too large", naming neither the file nor the step;
    # the half record it left made the next record a corrupt line.
    path = tmp_path / "ledger.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", _FILE_SIZE_LIMITED, str(path)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert f"the ledger {path} could not take the record of step 1 (File too large)" in done.stdout
    assert "records up to step 0 are kept" in done.stdout, done.stdout
    assert Ledger.load(path).steps() == {0: (1, 2), 1: (3, 4)}


def test_a_malformed_complete_line_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    path.write_text('not json\n{"step":1,"epoch":1,"world_size":1,"samples":[3]}\n')

    with pytest.raises(ValueError, match="ledger.jsonl:1: bad ledger record"):
        Ledger.load(path)


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (1, "step 1 does not come after the last recorded step 3"),
        (2, "step 2 is already recorded"),
        (3, "step 3 is already recorded"),
    ],
)
def test_ledger_refuses_a_step_at_or_before_the_last(
    tmp_path: Path, step: int, message: str
) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    ledger.record(2, view_epoch=0, world_size=1, sample_ids=[0])
    ledger.record(3, view_epoch=0, world_size=1, sample_ids=[1])
    before = path.read_bytes()

    with pytest.raises(ValueError, match=message):
        ledger.record(step, view_epoch=0, world_size=1, sample_ids=[9])
    assert path.read_bytes() == before
    assert ledger.steps() == {2: (0,), 3: (1,)}


def test_ledger_accepts_a_gap_left_by_a_state_pull(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.record(2, view_epoch=0, world_size=1, sample_ids=[0])
    ledger.record(5, view_epoch=1, world_size=2, sample_ids=[1])
    assert Ledger.load(tmp_path / "ledger.jsonl").steps() == {2: (0,), 5: (1,)}


def test_the_ledger_file_is_fsynced_at_most_every_interval_and_on_sync(tmp_path: Path) -> None:
    clock = [0.0]
    ledger = Ledger(tmp_path / "ledger.jsonl", sync_interval=1.0, clock=lambda: clock[0])
    for step, at in enumerate([0.1, 0.5, 0.9]):
        clock[0] = at
        ledger.record(step, view_epoch=0, world_size=1, sample_ids=[step])
    assert ledger.fsyncs == 0  # all three within the first second
    clock[0] = 1.2
    ledger.record(3, view_epoch=0, world_size=1, sample_ids=[3])
    assert ledger.fsyncs == 1  # the record after a second is due: it syncs all four
    clock[0] = 1.5
    ledger.record(4, view_epoch=0, world_size=1, sample_ids=[4])
    assert ledger.fsyncs == 1
    ledger.sync()
    assert ledger.fsyncs == 2
    ledger.sync()  # nothing new: no fsync
    assert ledger.fsyncs == 2
    assert Ledger.load(tmp_path / "ledger.jsonl").steps() == {i: (i,) for i in range(5)}


def test_a_ledger_with_interval_zero_fsyncs_every_record(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.jsonl", sync_interval=0.0)
    for step in range(3):
        ledger.record(step, view_epoch=0, world_size=1, sample_ids=[step])
    assert ledger.fsyncs == 3
    with pytest.raises(ValueError, match="sync_interval"):
        Ledger(tmp_path / "other.jsonl", sync_interval=-1.0)


@pytest.mark.integration  # a second process tries the file too
def test_a_ledger_file_another_ledger_writes_is_refused_until_that_one_closes(
    tmp_path: Path,
) -> None:
    # Two workers given one ledger path (`rollcall up --workers 2 -- rollcall
    # worker --ledger l.jsonl`, a script's constant path): at b3ed102 both
    # appended every step, the file held each step twice, and a worker
    # started later took the other's records for its own.
    from rollcall.membership.errors import UsageError

    path = tmp_path / "ledger.jsonl"
    first = Ledger(path)
    first.record(0, view_epoch=1, world_size=2, sample_ids=[0, 1])
    with pytest.raises(UsageError, match="ledger.jsonl is being written by another"):
        Ledger(path, lock_wait=0.2)
    first.rewind(0)  # the file is cut in place: still the one held
    with pytest.raises(UsageError, match="a ledger file of its own"):
        Ledger(path, lock_wait=0.2)
    code = (f"import pathlib, rollcall.worker.ledger as l; "
            f"l.Ledger(pathlib.Path({str(path)!r}), lock_wait=0.2)")  # fmt: skip
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert other.returncode == 1 and "is being written by another" in other.stderr, other.stderr
    assert Ledger.load(path).steps() == {0: (0, 1)}  # reading takes no lock
    # A holder that lets go within the wait (a restarted worker's former
    # self still ending) is waited for.
    threading.Timer(0.3, first.close).start()
    again = Ledger(path, lock_wait=30.0)
    again.record(1, view_epoch=2, world_size=1, sample_ids=[2, 3])
    assert Ledger.load(path).steps() == {0: (0, 1), 1: (2, 3)}


def test_an_in_memory_ledger_writes_nothing(tmp_path: Path) -> None:
    ledger = Ledger()
    ledger.record(0, view_epoch=0, world_size=1, sample_ids=[1])

    assert ledger.path is None
    assert ledger.steps() == {0: (1,)}
    assert list(tmp_path.iterdir()) == []


def test_identical_ledgers_compare_equal() -> None:
    assert Ledger.compare({0: [1, 2], 1: [3, 4]}, {0: (1, 2), 1: (3, 4)}) == []


def test_compare_reports_missing_and_extra_steps() -> None:
    differences = Ledger.compare({0: [1], 1: [2]}, {0: [1], 2: [2]})

    assert "step 1: missing" in differences
    assert "step 2: extra (not in the reference)" in differences


def test_compare_reports_lost_and_repeated_samples() -> None:
    reference = {0: [0, 1], 1: [2, 3], 2: [4, 5]}
    replayed = {0: [0, 1], 1: [0, 1], 2: [4, 5]}

    assert Ledger.compare(reference, replayed) == [
        "step 1: lost [2, 3]",
        "step 1: unexpected [0, 1]",
        "overall: lost [2, 3]",
        "overall: repeated [0, 1]",
    ]


def test_compare_reports_a_changed_order() -> None:
    assert Ledger.compare({0: [1, 2]}, {0: [2, 1]}) == ["step 0: same samples in a different order"]


def test_compare_elides_long_id_lists() -> None:
    differences = Ledger.compare({0: list(range(20))}, {0: []})

    assert differences[0] == "step 0: lost [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ... (20 in all)]"


def test_merge_combines_overlapping_worker_ledgers_in_step_order() -> None:
    first = {0: [1, 2], 1: [3, 4]}
    joined_later = {2: [5, 6], 1: [3, 4]}

    assert merge_ledgers([joined_later, first]) == {0: (1, 2), 1: (3, 4), 2: (5, 6)}
    assert list(merge_ledgers([joined_later, first])) == [0, 1, 2]


def test_merge_names_the_step_workers_disagree_on() -> None:
    with pytest.raises(ValueError, match="step 1: ledger 1 disagrees"):
        merge_ledgers([{0: [1], 1: [2]}, {1: [3]}])


@given(plans(), st.lists(st.integers(1, 6), min_size=1, max_size=12))
def test_a_run_whose_world_changes_consumes_what_a_steady_run_does(
    plan: DataPlan, world_sizes: list[int]
) -> None:
    steady, elastic = Ledger(), Ledger()
    for step, world_size in enumerate(world_sizes):
        steady.record(step, view_epoch=0, world_size=1, sample_ids=plan.step_samples(step))
        ran = [
            i
            for rank in range(world_size)
            for m in plan.for_rank(step, rank, world_size)
            for i in m.sample_ids
        ]
        elastic.record(step, view_epoch=step, world_size=world_size, sample_ids=ran)

    assert Ledger.compare(steady.steps(), elastic.steps()) == []
