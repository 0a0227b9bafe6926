"""Loading microbatches ahead: what a microbatch contains never depends on
where, when or by which process it was loaded (worker/loader.py).

The schedule is tested on its own (pure, no processes); the loader with real
DataLoader worker processes (forked; a few hundred milliseconds each test)."""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import random
import re
import signal
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    WeightedRandomSampler,
    get_worker_info,
)

from rollcall.etcd_local import pid_alive as alive
from rollcall.worker.loader import (
    Batch,
    Key,
    LoaderClosed,
    LoaderMisconfigured,
    LoaderOptions,
    MicrobatchLoader,
    NotAPair,
    PrefetchSchedule,
    Take,
    Target,
    UnindexableDataset,
    assigned,
    default_collate,
    load_microbatch,
    next_key,
    upcoming,
)
from rollcall.worker.plan import DataPlan, load_seed

#: Generous bound for "the workers got there" waits on a loaded 2-core box.
PATIENCE = 20.0

#: The ``children`` fixture: this test's processes still running.
Children = Callable[[], list[BaseProcess]]


# --- datasets ---------------------------------------------------------------------------


class Numbers(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample ``i`` is ``([i, 2i], i)``, after ``delay`` seconds."""

    def __init__(self, size: int, delay: float = 0.0) -> None:
        self.size, self.delay = size, delay

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)
        return torch.tensor([float(i), 2.0 * i]), torch.tensor(i)


class Recorded(Numbers):
    """Appends ``"<sample id> <tag>"`` to ``log`` for every sample it loads and
    returns ``([i, tag], i)``: the tag (not drawn from any seeded RNG) tells
    one load of a sample from another."""

    def __init__(self, size: int, log: Path, delay: float = 0.0) -> None:
        super().__init__(size, delay)
        self.log = str(log)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        tag = int.from_bytes(os.urandom(6), "big")
        with open(self.log, "a") as file:
            file.write(f"{i} {tag}\n")
        if self.delay:
            time.sleep(self.delay)
        return torch.tensor([i, tag]), torch.tensor(i)


def loads(log: Path) -> list[tuple[int, int]]:
    """``(sample id, tag)`` of every load recorded so far."""
    if not log.exists():
        return []
    lines = log.read_text().splitlines()
    return [(int(a), int(b)) for a, b in (line.split() for line in lines if line)]


class Augmented(Numbers):
    """Random augmentation from torch, ``random`` and numpy."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noisy = torch.full((2,), float(i)) + torch.rand(2)
        extra = torch.tensor([random.random(), float(numpy.random.rand())], dtype=torch.float64)
        return noisy, extra


class DiesOn(Numbers):
    """A loader worker process exits (code 5) when it reaches sample ``fatal``."""

    def __init__(self, size: int, fatal: int) -> None:
        super().__init__(size)
        self.fatal = fatal

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.fatal and get_worker_info() is not None:
            os._exit(5)
        return super().__getitem__(i)


class RaisesOn(Numbers):
    def __init__(self, size: int, bad: int) -> None:
        super().__init__(size)
        self.bad = bad

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.bad:
            raise ValueError(f"bad sample {i}")
        return super().__getitem__(i)


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(10))


class OnlyGetitem:
    def __getitem__(self, i: int) -> int:
        return i


class OnlyLen(Dataset[int]):
    def __len__(self) -> int:
        return 10


def as_dict(samples: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """A collate function whose batches are not pairs."""
    return {"x": torch.stack([x for x, _ in samples]), "ids": [int(y) for _, y in samples]}


def note_worker(path: str, worker_id: int) -> None:
    with open(path, "a") as file:
        file.write(f"{worker_id} {os.getpid()}\n")


def direct(dataset: Any, plan: DataPlan, key: Key, collate: Any = default_collate) -> Any:
    """The microbatch loaded by hand, the way the runtime did it before."""
    ids = plan.microbatches(key.step)[key.index].sample_ids
    return collate([dataset[i] for i in ids])


def same(a: Any, b: Any) -> bool:
    """Bit-identical nested tensors."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def workers(count: int, prefetch: int = 2) -> LoaderOptions:
    return LoaderOptions(num_workers=count, prefetch_factor=prefetch)




@pytest.fixture(autouse=True)
def children() -> Iterator[Children]:
    """The processes this test started and that still run; none may outlive
    the test."""
    before = set(multiprocessing.active_children())

    def started() -> list[BaseProcess]:
        return [c for c in multiprocessing.active_children() if c not in before]

    yield started
    deadline = time.monotonic() + PATIENCE
    while started() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not started(), "loader workers outlived the test"


# --- the pure core ----------------------------------------------------------------------

SIX = DataPlan(600, 24, 4, seed=3)  # six microbatches per step


def test_upcoming_is_the_ranks_block_of_every_step_from_the_next_one() -> None:
    keys = upcoming(SIX, Target(rank=1, world_size=4, next_step=5))
    first = [next(keys) for _ in range(6)]

    assert first == [
        Key(5, 2), Key(5, 3), Key(6, 2), Key(6, 3), Key(7, 2), Key(7, 3),
    ]  # fmt: skip
    assert all(key.index in SIX.assignment(key.step, 4)[1] for key in first)


def test_a_rank_beyond_the_microbatches_has_nothing_upcoming() -> None:
    idle = Target(rank=7, world_size=8, next_step=0)

    assert list(upcoming(SIX, idle)) == []
    assert next_key(SIX, idle, set()) is None


def test_next_key_skips_the_keys_in_hand() -> None:
    target = Target(rank=0, world_size=2, next_step=3)

    assert next_key(SIX, target, {Key(3, 0), Key(3, 2)}) == Key(3, 1)
    assert next_key(SIX, target, {Key(3, 0), Key(3, 1), Key(3, 2)}) == Key(4, 0)


def test_assigned_means_this_rank_and_a_step_not_committed_yet() -> None:
    target = Target(rank=1, world_size=2, next_step=4)

    assert assigned(SIX, target, Key(4, 3))
    assert not assigned(SIX, target, Key(4, 2)), "another rank's microbatch"
    assert not assigned(SIX, target, Key(3, 3)), "a committed step"


def test_a_position_outside_the_view_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 of 2"):
        Target(rank=2, world_size=2, next_step=0)


def test_before_any_target_the_schedule_issues_idle_slots() -> None:
    schedule = PrefetchSchedule(SIX, capacity=4)

    assert [schedule.issue() for _ in range(2)] == [None, None]
    assert schedule.arrived(None) is False
    assert schedule.request(Key(0, 0)) is Take.LOAD_HERE


def test_issue_follows_the_ranks_order_and_never_repeats_a_key_in_flight() -> None:
    schedule = PrefetchSchedule(SIX, capacity=4)
    schedule.retarget(Target(rank=0, world_size=3, next_step=0))

    issued = [schedule.issue() for _ in range(4)]

    assert issued == [Key(0, 0), Key(0, 1), Key(1, 0), Key(1, 1)]
    assert schedule.in_flight == tuple(issued)


def test_a_view_change_drops_kept_keys_the_rank_no_longer_runs_and_keeps_the_others() -> None:
    schedule = PrefetchSchedule(SIX, capacity=8)
    schedule.retarget(Target(rank=0, world_size=2, next_step=0))  # runs 0, 1, 2
    for _ in range(6):
        assert schedule.arrived(schedule.issue())
    assert schedule.kept == {Key(s, i) for s in (0, 1) for i in (0, 1, 2)}

    dropped = schedule.retarget(Target(rank=0, world_size=3, next_step=1))  # runs 0, 1

    assert dropped == (Key(0, 0), Key(0, 1), Key(0, 2), Key(1, 2))
    assert schedule.kept == {Key(1, 0), Key(1, 1)}


def test_a_load_that_arrives_after_the_view_moved_on_is_dropped() -> None:
    schedule = PrefetchSchedule(SIX, capacity=4)
    schedule.retarget(Target(rank=0, world_size=2, next_step=0))
    other_rank, committed = schedule.issue(), schedule.issue()
    schedule.retarget(Target(rank=1, world_size=2, next_step=0))

    assert other_rank == Key(0, 0)
    assert schedule.arrived(other_rank) is False
    schedule.retarget(Target(rank=0, world_size=2, next_step=1))
    assert committed == Key(0, 1)
    assert schedule.arrived(committed) is False
    assert schedule.kept == frozenset()


def test_a_key_handed_out_is_not_issued_again_until_the_position_moves() -> None:
    schedule = PrefetchSchedule(SIX, capacity=4)
    target = Target(rank=0, world_size=2, next_step=0)
    schedule.retarget(target)
    assert schedule.request(Key(0, 0)) is Take.LOAD_HERE  # nothing in flight yet

    assert schedule.issue() == Key(0, 1)
    schedule.retarget(target)  # an aborted step, the same position in a new view
    assert schedule.issue() == Key(0, 0)


def test_the_next_key_to_issue_is_received_rather_than_loaded_twice() -> None:
    schedule = PrefetchSchedule(SIX, capacity=4)
    idle = schedule.issue()
    schedule.retarget(Target(rank=0, world_size=1, next_step=0))

    assert schedule.request(Key(0, 0)) is Take.RECEIVE  # receiving frees a slot for it
    assert schedule.issue() == Key(0, 0)
    assert schedule.arrived(idle) is False
    assert schedule.request(Key(0, 0)) is Take.RECEIVE
    assert schedule.arrived(Key(0, 0)) is True
    assert schedule.request(Key(0, 0)) is Take.CACHED


def test_a_key_the_rank_does_not_run_is_never_served_from_the_pipeline() -> None:
    schedule = PrefetchSchedule(SIX, capacity=4)
    schedule.retarget(Target(rank=0, world_size=2, next_step=0))
    schedule.issue()  # Key(0, 0) in flight

    schedule.retarget(Target(rank=1, world_size=2, next_step=0))

    assert schedule.request(Key(0, 0)) is Take.LOAD_HERE


def test_the_cache_holds_at_most_its_capacity_but_always_the_awaited_key() -> None:
    schedule = PrefetchSchedule(SIX, capacity=2)
    schedule.retarget(Target(rank=0, world_size=1, next_step=0))
    issued = [schedule.issue() for _ in range(4)]
    assert schedule.request(Key(0, 3)) is Take.RECEIVE

    kept = [schedule.arrived(key) for key in issued]

    assert kept == [True, True, False, True]
    assert schedule.kept == {Key(0, 0), Key(0, 1), Key(0, 3)}


def test_a_load_coming_back_out_of_order_is_refused() -> None:
    schedule = PrefetchSchedule(SIX, capacity=4)
    schedule.retarget(Target(rank=0, world_size=1, next_step=0))
    schedule.issue()
    schedule.issue()

    with pytest.raises(ValueError, match="oldest in flight"):
        schedule.arrived(Key(0, 1))


@settings(max_examples=200, deadline=None)
@given(
    views=st.lists(
        st.tuples(st.integers(0, 7), st.integers(1, 8), st.integers(0, 3), st.integers(0, 3)),
        min_size=1, max_size=6,
    ),
    window=st.integers(1, 6),
)  # fmt: skip
def test_every_request_is_served_its_own_load_within_the_window(
    views: list[tuple[int, int, int, int]], window: int
) -> None:
    """An in-order pipeline of ``window`` slots driven as the loader drives a
    DataLoader (one slot refilled per item received, before the item is
    handed over), over view changes with aborted steps. Every request is
    served within ``window + 1`` receptions, with a load of its own key that
    was never dropped, and the cache stays bounded."""
    schedule = PrefetchSchedule(SIX, capacity=window)
    serial = iter(range(10**9))
    pipe: deque[tuple[Key | None, int]] = deque()
    loaded: dict[Key, tuple[Key, int]] = {}
    dropped: set[int] = set()

    def issue() -> None:
        pipe.append((schedule.issue(), next(serial)))

    def receive() -> None:
        issue()
        key, number = pipe.popleft()
        if schedule.arrived(key):
            assert key is not None
            loaded[key] = (key, number)
        else:
            dropped.add(number)

    def get(key: Key) -> tuple[Key, int]:
        for _ in range(window + 2):
            take = schedule.request(key)
            if take is Take.CACHED:
                return loaded.pop(key)
            if take is Take.LOAD_HERE:
                return key, next(serial)
            receive()
        raise AssertionError(f"{key} not served within {window + 1} receptions")

    for _ in range(window):
        issue()
    next_step = 0
    for rank, world_size, full_steps, partial in views:
        target = Target(rank % world_size, world_size, next_step)
        for key in schedule.retarget(target):
            dropped.add(loaded.pop(key)[1])
        for step in range(next_step, next_step + full_steps + 1):
            block = SIX.assignment(step, world_size)[target.rank]
            aborted = step == next_step + full_steps
            for index in block[:partial] if aborted else block:
                got, number = get(Key(step, index))
                assert got == Key(step, index)
                assert number not in dropped, f"{got} was served from a dropped load"
            assert set(loaded) == set(schedule.kept)
            assert len(schedule.kept) <= window + 1
            assert all(assigned(SIX, target, k) for k in schedule.kept)
            if aborted:
                break
            target = Target(target.rank, world_size, step + 1)
            for key in schedule.retarget(target):
                dropped.add(loaded.pop(key)[1])
        next_step += full_steps


# --- loading one microbatch ---------------------------------------------------------------


def test_loading_here_leaves_the_callers_rng_streams_as_they_were() -> None:
    random.seed(1)
    numpy.random.seed(2)
    torch.manual_seed(3)
    before = (random.getstate(), numpy.random.get_state(legacy=False), torch.get_rng_state())

    load_microbatch(Augmented(10), default_collate, [1, 2], seed=99)

    after = (random.getstate(), numpy.random.get_state(legacy=False), torch.get_rng_state())
    assert before[0] == after[0]
    assert before[1]["state"]["key"].tolist() == after[1]["state"]["key"].tolist()
    assert before[1]["state"]["pos"] == after[1]["state"]["pos"]
    assert torch.equal(before[2], after[2])


@pytest.mark.integration
def test_a_microbatch_is_bit_identical_whichever_process_or_rank_loads_it() -> None:
    plan = DataPlan(120, 12, 2, seed=9)  # world 2: ranks run 0-2 and 3-5; world 3: 0-1, 2-3, 4-5
    dataset = Augmented(120)
    key = Key(4, 2)
    with MicrobatchLoader(dataset, plan) as here:
        here.enter_view(rank=0, world_size=2, next_step=4)
        on_thread = here.get(4, 2)
    with MicrobatchLoader(dataset, plan, options=workers(2)) as there:
        there.enter_view(rank=1, world_size=3, next_step=4)
        other = there.get(4, 3)  # asked out of order: another worker, another position
        in_worker = there.get(4, 2)
    ids, seed = plan.microbatches(4)[2].sample_ids, load_seed(plan.seed, key.step, key.index)

    assert same(on_thread, in_worker)
    assert same(on_thread, load_microbatch(dataset, default_collate, ids, seed))
    noise, other_noise = on_thread[0] - on_thread[0].floor(), other[0] - other[0].floor()
    assert not same(noise, other_noise), "the same augmentation for two microbatches"
    draws = [*noise.flatten().tolist(), *on_thread[1].flatten().tolist()]
    assert len(set(draws)) == len(draws), "torch, random and numpy drew alike"


# --- the probe of the job's fingerprint --------------------------------------------------


class ByProcess(Numbers):
    """Sample ``i`` is ``([i], pid of the process that loaded it)``."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([float(i)]), torch.tensor(os.getpid())


@pytest.mark.integration
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_the_probe_reads_the_plans_first_microbatch_as_steps_do_and_leaves_them_alone(
    num_workers: int,
) -> None:
    dataset = Augmented(600)
    with MicrobatchLoader(dataset, SIX, options=workers(num_workers, prefetch=1)) as loader:
        loader.start()
        reads = loader.probe()
        loader.enter_view(rank=0, world_size=2, next_step=0)
        served = {index: loader.get(0, index) for index in SIX.assignment(0, 2)[0]}

    first = load_microbatch(dataset, default_collate, SIX.microbatches(0)[0].sample_ids,
                            load_seed(SIX.seed, 0, 0))  # fmt: skip
    assert len(reads) == 2 and all(same(read, first) for read in reads)
    for index, batch in served.items():
        ids, seed = SIX.microbatches(0)[index].sample_ids, load_seed(SIX.seed, 0, index)
        assert same(batch, load_microbatch(dataset, default_collate, ids, seed)), index


class PerWorkerRng(Numbers):
    """Sample ``i`` is ``([i + noise], i)``, the noise drawn from a numpy
    generator that :func:`per_worker_rng` makes in each loader worker, as
    numpy-based augmentation is often set up."""

    rng: Any = None

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([i + float(self.rng.random())]), torch.tensor(i)


def per_worker_rng(worker_id: int) -> None:
    """worker_init_fn: a generator of the loader worker's own."""
    import numpy

    info = torch.utils.data.get_worker_info()
    assert info is not None
    info.dataset.dataset.rng = numpy.random.default_rng(1000 + worker_id)


@pytest.mark.integration
def test_a_generator_a_worker_init_fn_makes_is_seeded_like_the_data_sets_own() -> None:
    # At 0f3f7ce the generators were found when the loader was built, not
    # after each worker's worker_init_fn: one made there drew per worker, and
    # the two probe reads (one per worker) differed.
    dataset = PerWorkerRng(600)
    options = LoaderOptions(num_workers=2, prefetch_factor=1, worker_init_fn=per_worker_rng)
    with MicrobatchLoader(dataset, SIX, options=options) as loader:
        loader.start()
        reads = loader.probe()
    assert len(reads) == 2 and same(reads[0], reads[1]), reads


@pytest.mark.integration
def test_with_workers_the_probe_is_read_by_two_of_them_and_never_by_the_training_process() -> None:
    """The training process opens none of the data set's files before its
    workers fork (an HDF5 or LMDB handle must not be shared with them)."""
    with MicrobatchLoader(ByProcess(600), SIX, options=workers(2)) as loader:
        loader.start()
        pids = {int(read[1][0]) for read in loader.probe()}
    assert len(pids) == 2 and os.getpid() not in pids


@pytest.mark.integration
def test_an_error_reading_the_probe_is_raised_and_stops_the_loader() -> None:
    bad = SIX.microbatches(0)[0].sample_ids[1]
    with MicrobatchLoader(RaisesOn(600, bad), SIX, options=workers(1)) as loader:
        loader.start()
        with pytest.raises(ValueError, match=f"bad sample {bad}"):
            loader.probe()
        with pytest.raises(LoaderClosed):
            loader.enter_view(rank=0, world_size=1, next_step=0)


# --- the loader with worker processes ---------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_batches_equal_direct_loading_across_view_changes(num_workers: int) -> None:
    dataset = Numbers(600, delay=0.0005)
    # (rank, world size, steps to commit, microbatches of the next step run before an abort)
    views = [(0, 2, 2, 1), (1, 3, 2, 0), (0, 1, 1, 5), (2, 4, 2, 1), (7, 8, 1, 0), (1, 2, 2, 0)]
    served: list[Key] = []
    with MicrobatchLoader(dataset, SIX, options=workers(num_workers)) as loader:
        step = 0
        for rank, world_size, commits, partial in views:
            loader.enter_view(rank, world_size, step)
            for number in range(step, step + commits + 1):
                block = SIX.assignment(number, world_size)[rank]
                aborted = number == step + commits
                for index in block[:partial] if aborted else block:
                    batch = loader.get(number, index)
                    assert same(batch, direct(dataset, SIX, Key(number, index))), (number, index)
                    served.append(Key(number, index))
                if not aborted:
                    loader.step_committed(number)
            step += commits

    assert len(served) == 31
    # Run in an aborted step, then again by the same rank in the next view.
    assert [key for key in served if served.count(key) > 1] == [Key(5, 4), Key(5, 4)]


@pytest.mark.integration
def test_prefetched_microbatches_dropped_at_a_view_change_are_never_handed_out(
    tmp_path: Path,
) -> None:
    plan = DataPlan(400, 16, 4, seed=1)  # four microbatches: rank 0 of 2 runs 0-1, rank 1 runs 2-3
    log = tmp_path / "loads"
    dataset = Recorded(400, log)

    def tags(key: Key) -> set[int]:
        ids = set(plan.microbatches(key.step)[key.index].sample_ids)
        return {tag for sample, tag in loads(log) if sample in ids}

    with MicrobatchLoader(dataset, plan, options=workers(2)) as loader:
        loader.enter_view(rank=0, world_size=2, next_step=0)
        loader.get(0, 0)
        loader.get(0, 1)
        loader.step_committed(0)
        loader.get(2, 0)  # out of order: (1, 0) and (1, 1) arrive first and are kept
        assert {Key(1, 0), Key(1, 1)} <= loader.cached()
        first = tags(Key(1, 0)) | tags(Key(1, 1))

        loader.enter_view(rank=1, world_size=2, next_step=1)  # step 1 aborted, view changed
        assert not loader.cached() & {Key(1, 0), Key(1, 1), Key(2, 0)}
        for index in (2, 3):
            batch = loader.get(1, index)
            assert same(batch[1], direct(dataset, plan, Key(1, index))[1])

        loader.enter_view(rank=0, world_size=2, next_step=1)  # and back again
        again = [loader.get(1, 0), loader.get(1, 1)]

    assert len(first) == 8, "the first loads were recorded"
    served = {int(tag) for inputs, _ in again for tag in inputs[:, 1]}
    assert served.isdisjoint(first), "a microbatch dropped at the view change was handed out"
    for index, (inputs, targets) in enumerate(again):
        assert targets.tolist() == list(plan.microbatches(1)[index].sample_ids)
        assert inputs[:, 0].tolist() == targets.tolist()


@pytest.mark.integration
def test_prefetch_stops_at_workers_times_prefetch_factor(tmp_path: Path) -> None:
    plan = DataPlan(1000, 8, 4, seed=2)
    log = tmp_path / "loads"
    dataset = Recorded(1000, log, delay=0.002)
    key_of = {
        sample: Key(step, mb.index)
        for step in range(100)
        for mb in plan.microbatches(step)
        for sample in mb.sample_ids
    }

    def started() -> set[Key]:
        return {key_of[sample] for sample, _ in loads(log)}

    options = workers(2, prefetch=2)
    with MicrobatchLoader(dataset, plan, options=options) as loader:
        loader.enter_view(rank=0, world_size=1, next_step=0)
        consumed = 0
        for step in range(3):
            for index in range(2):
                loader.get(step, index)
                consumed += 1
                deadline = time.monotonic() + PATIENCE
                while len(started()) < consumed + options.window:
                    assert time.monotonic() < deadline, "the workers did not load ahead"
                    time.sleep(0.01)
                time.sleep(0.1)  # room to overshoot, if anything would
                assert len(started()) == consumed + options.window
            loader.step_committed(step)


@pytest.mark.integration
def test_close_stops_the_worker_processes_promptly(children: Children) -> None:
    loader = MicrobatchLoader(Numbers(100), DataPlan(100, 8, 4, seed=0), options=workers(2))
    loader.enter_view(rank=0, world_size=1, next_step=0)
    loader.get(0, 0)
    pids = [child.pid for child in children()]
    assert len(pids) == 2

    began = time.monotonic()
    loader.close()
    took = time.monotonic() - began

    assert not children()
    assert not any(alive(pid) for pid in pids if pid is not None)
    assert took < 5.0
    with pytest.raises(LoaderClosed, match="closed"):
        loader.get(0, 1)
    loader.close()  # again: nothing to do


@pytest.mark.integration
def test_no_worker_process_outlives_a_training_loop_that_raised(children: Children) -> None:
    with pytest.raises(ZeroDivisionError):
        plan = DataPlan(100, 8, 4, seed=0)
        with MicrobatchLoader(Numbers(100), plan, options=workers(2)) as loader:
            loader.enter_view(rank=0, world_size=1, next_step=0)
            loader.get(0, 0)
            assert len(children()) == 2
            _ = 1 / 0

    assert not children()


class _DeadSender:
    """A DataLoader iterator whose worker died after putting a batch on the
    queue: receiving the batch asks the dead process for its file
    descriptor, and the connection is reset (seen once in a full run of
    the test below, instead of the DataLoader's own error)."""

    def __init__(self, worker: BaseProcess) -> None:
        self._workers = [worker]

    def __next__(self) -> Any:
        raise ConnectionResetError(104, "Connection reset by peer")


@pytest.mark.integration
def test_a_batch_lost_with_its_dead_worker_is_the_worker_death_error() -> None:
    dead = multiprocessing.get_context("fork").Process(target=os._exit, args=(5,))
    dead.start()
    dead.join(10)
    plan = DataPlan(100, 8, 4, seed=0)
    with MicrobatchLoader(Numbers(100), plan, options=workers(2)) as loader:
        loader.enter_view(rank=0, world_size=1, next_step=0)
        loader.get(0, 0)
        pipeline = loader._pipeline
        loader._pipeline = _DeadSender(dead)  # type: ignore[assignment]
        try:
            with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid {dead.pid}\) "
                               r"exited unexpectedly with exit code 5") as raised:  # fmt: skip
                loader.get(1, 0)
        finally:
            loader._pipeline = pipeline
    assert isinstance(raised.value.__cause__, ConnectionResetError)


@pytest.mark.integration
def test_a_worker_process_that_dies_is_an_error_on_the_calling_thread(children: Children) -> None:
    plan = DataPlan(100, 8, 4, seed=0)
    fatal = plan.microbatches(1)[0].sample_ids[0]

    # The DataLoader's SIGCHLD handler may raise it anywhere on this thread:
    # the loop ends, and closing the loader (the runtime's close) stops the rest.
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid.*\) exited unexpectedly"):
        with MicrobatchLoader(DiesOn(100, fatal), plan, options=workers(2)) as loader:
            loader.enter_view(rank=0, world_size=1, next_step=0)
            for step in range(2):
                for index in range(2):
                    loader.get(step, index)
                loader.step_committed(step)

    assert not children(), "the other worker was left running"


@pytest.mark.integration
def test_after_a_workers_error_the_loader_stops_its_workers_by_itself(children: Children) -> None:
    plan = DataPlan(100, 8, 4, seed=0)
    bad = plan.microbatches(0)[1].sample_ids[2]
    loader = MicrobatchLoader(RaisesOn(100, bad), plan, options=workers(2))
    loader.enter_view(rank=0, world_size=1, next_step=0)
    loader.get(0, 0)

    with pytest.raises(ValueError, match=f"bad sample {bad}"):
        loader.get(0, 1)

    assert not children()
    with pytest.raises(LoaderClosed, match=f"stopped after an error: ValueError.*bad sample {bad}"):
        loader.get(1, 0)


@pytest.mark.integration
def test_workers_keep_loading_through_a_sigint_sent_to_them(children: Children) -> None:
    """Ctrl-C, or a supervisor signalling the process group, reaches the
    loader workers too; the training process decides when they stop."""
    plan, dataset = DataPlan(400, 8, 4, seed=0), Numbers(400)
    with MicrobatchLoader(dataset, plan, options=workers(2)) as loader:
        loader.enter_view(rank=0, world_size=1, next_step=0)
        loader.get(0, 0)  # from worker 0
        loader.get(0, 1)  # from worker 1: both have started
        loader.step_committed(0)
        pids = [child.pid for child in children() if child.pid is not None]
        for pid in pids:
            os.kill(pid, signal.SIGINT)
        time.sleep(0.2)
        for step in range(1, 6):
            for index in range(2):
                assert same(loader.get(step, index), direct(dataset, plan, Key(step, index)))
            loader.step_committed(step)

        assert all(alive(pid) for pid in pids)


@pytest.mark.integration
def test_an_exception_in_a_workers_getitem_keeps_its_type_and_message() -> None:
    plan = DataPlan(100, 8, 4, seed=0)
    bad = plan.microbatches(0)[1].sample_ids[2]
    with MicrobatchLoader(RaisesOn(100, bad), plan, options=workers(2)) as loader:
        loader.enter_view(rank=0, world_size=1, next_step=0)
        loader.get(0, 0)
        with pytest.raises(ValueError, match=f"bad sample {bad}") as raised:
            loader.get(0, 1)

    assert "in DataLoader worker process" in str(raised.value)


# --- what may be passed -------------------------------------------------------------------


@pytest.mark.integration
def test_a_dataloader_brings_its_dataset_collate_fn_and_worker_settings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, children: Children
) -> None:
    dataset = Numbers(100)
    noted = tmp_path / "workers"
    init = functools.partial(note_worker, str(noted))
    given = DataLoader(
        dataset, batch_size=4, shuffle=True, drop_last=True, collate_fn=as_dict, num_workers=2,
        prefetch_factor=3, worker_init_fn=init, persistent_workers=True, timeout=30,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="rollcall.worker.loader"):
        loader = MicrobatchLoader.open(given, global_batch=8, micro_batch=4, seed=0)

    with loader:
        assert loader.plan.num_samples == 100, "the length in samples, not in batches"
        assert loader.options == LoaderOptions(
            num_workers=2, prefetch_factor=3, worker_init_fn=init, timeout=30
        )
        # What the job's fingerprint compares the code of (its `code` field).
        assert loader.user_objects == (dataset, as_dict, init)
        loader.enter_view(rank=0, world_size=1, next_step=0)
        batch = loader.get(0, 1)
        assert same(batch, direct(dataset, loader.plan, Key(0, 1), as_dict))
        deadline = time.monotonic() + PATIENCE
        while len(lines := (noted.read_text() if noted.exists() else "").splitlines()) < 2:
            assert time.monotonic() < deadline, "worker_init_fn did not run in two workers"
            time.sleep(0.01)
        pids = {int(line.split()[1]) for line in lines}
        assert sorted(int(line.split()[0]) for line in lines) == [0, 1]
        assert pids == {child.pid for child in children()}
        assert os.getpid() not in pids
    replaced = [r for r in caplog.records if "replaced by the data plan" in r.getMessage()]
    assert len(replaced) == 1 and replaced[0].levelno == logging.INFO
    assert "RandomSampler" in replaced[0].getMessage()


def test_torch_default_collate_lists_work_as_inputs_and_targets() -> None:
    dataset = Numbers(100)
    loader = MicrobatchLoader.open(
        DataLoader(dataset, batch_size=4), global_batch=8, micro_batch=4, seed=0
    )
    loader.enter_view(rank=0, world_size=1, next_step=0)
    microbatch = loader.plan.microbatches(0)[0]

    batch = Batch(microbatch, loader.get(0, 0))

    assert isinstance(batch.data, list)
    assert torch.equal(batch.inputs, torch.stack([dataset[i][0] for i in microbatch.sample_ids]))
    assert batch.targets.tolist() == list(microbatch.sample_ids)


def test_a_batch_that_is_not_a_pair_is_read_through_data() -> None:
    microbatch = SIX.microbatches(0)[0]
    batch = Batch(microbatch, {"x": torch.zeros(2), "y": torch.ones(2)})
    triple = Batch(microbatch, (1, 2, 3))

    assert set(batch.data) == {"x", "y"}
    with pytest.raises(NotAPair, match=r"a dict with keys \['x', 'y'\]: use batch.data"):
        _ = batch.inputs
    with pytest.raises(NotAPair, match="a tuple of 3 items: use batch.data"):
        _ = triple.targets


def test_the_default_collate_takes_what_torchs_does_and_keeps_pairs_as_inputs_and_targets() -> None:
    # A bare data set of (image, label) pairs with the label a Python int,
    # as torchvision's are: at 81facaf torch.stack refused the ints ("expected
    # Tensor as element 0 in argument 0, but got int"), and a dict or a triple
    # failed with "too many values to unpack".
    images = [torch.full((2, 2), float(i)) for i in range(3)]
    inputs, targets = default_collate([(image, i) for i, image in enumerate(images)])
    assert torch.equal(inputs, torch.stack(images))
    assert torch.equal(targets, torch.tensor([0, 1, 2]))
    inputs, targets = default_collate([(image, float(i)) for i, image in enumerate(images)])
    assert targets.dtype == torch.float64  # as torch's default_collate makes them
    microbatch = SIX.microbatches(0)[0]
    records = [{"ids": torch.arange(4) + i, "labels": i} for i in range(3)]
    batch = Batch(microbatch, default_collate(records))
    assert torch.equal(batch.data["ids"], torch.stack([r["ids"] for r in records]))
    with pytest.raises(NotAPair, match=r"a dict with keys \['ids', 'labels'\]: use batch.data"):
        _ = batch.inputs
    triple = Batch(microbatch, default_collate([(image, image, 1) for image in images]))
    assert len(triple.data) == 3 and torch.equal(triple.data[2], torch.tensor([1, 1, 1]))
    with pytest.raises(TypeError, match="default_collate: batch must contain tensors"):
        default_collate([(object(), 1), (object(), 2)])


def test_a_dataloader_batch_size_other_than_micro_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="batch_size is 5 but micro_batch is 4"):
        MicrobatchLoader.open(
            DataLoader(Numbers(100), batch_size=5), global_batch=8, micro_batch=4, seed=0
        )


def test_a_dataloader_with_batch_size_none_collates_like_torch() -> None:
    dataset = Numbers(100)
    loader = MicrobatchLoader.open(
        DataLoader(dataset, batch_size=None), global_batch=8, micro_batch=4, seed=0
    )
    loader.enter_view(rank=0, world_size=1, next_step=0)

    by_torch = direct(dataset, loader.plan, Key(0, 0), torch.utils.data.default_collate)
    assert same(loader.get(0, 0), by_torch)
    with pytest.raises(LoaderMisconfigured, match="one sample at a time"):
        MicrobatchLoader.open(
            DataLoader(dataset, batch_size=None, collate_fn=as_dict),
            global_batch=8, micro_batch=4, seed=0,
        )  # fmt: skip


@pytest.mark.parametrize(
    "given",
    [Stream(), DataLoader(Stream(), batch_size=4)],
    ids=["directly", "inside a DataLoader"],
)
def test_an_iterable_dataset_is_refused_saying_why_and_what_to_pass(given: Any) -> None:
    with pytest.raises(UnindexableDataset) as refused:
        MicrobatchLoader.open(given, global_batch=8, micro_batch=4, seed=0)

    message = str(refused.value)
    assert "IterableDataset (Stream)" in message
    assert "no sample lost or repeated" in message
    assert "__len__ and __getitem__" in message
    assert "Materialise it" in message


@pytest.mark.parametrize(
    ("given", "missing"),
    [(OnlyGetitem(), "has no __len__:"), (OnlyLen(), "has no __getitem__:")],
)
def test_a_dataset_without_len_or_getitem_is_refused(given: Any, missing: str) -> None:
    with pytest.raises(UnindexableDataset, match=missing):
        MicrobatchLoader.open(given, global_batch=8, micro_batch=4, seed=0)


def test_a_dataloader_that_chooses_its_own_samples_is_refused() -> None:
    dataset = Numbers(100)
    weighted = WeightedRandomSampler([1.0] * 100, num_samples=100)
    batches = BatchSampler(RandomSampler(dataset), batch_size=4, drop_last=False)

    for refused, named in [
        (DataLoader(dataset, batch_size=4, sampler=weighted), "sampler (WeightedRandomSampler)"),
        (DataLoader(dataset, batch_sampler=batches), "batch_sampler (BatchSampler)"),
        (DataLoader(dataset, batch_size=4, sampler=RandomSampler(dataset, replacement=True)),
         "sampler (RandomSampler)"),
    ]:  # fmt: skip
        with pytest.raises(LoaderMisconfigured, match=rf"own {re.escape(named)}.*Subset\("):
            MicrobatchLoader.open(refused, global_batch=8, micro_batch=4, seed=0)


def test_a_distributed_sampler_is_replaced_by_the_plan() -> None:
    dataset = Numbers(100)
    sharded: DistributedSampler[int] = DistributedSampler(dataset, num_replicas=4, rank=3)

    loader = MicrobatchLoader.open(
        DataLoader(dataset, batch_size=4, sampler=sharded), global_batch=8, micro_batch=4, seed=0
    )

    assert loader.plan.num_samples == 100


def test_a_dataloader_and_separate_loading_settings_are_refused() -> None:
    given = DataLoader(Numbers(100), batch_size=4)

    with pytest.raises(LoaderMisconfigured, match="a DataLoader and num_workers=, pin_memory="):
        MicrobatchLoader.open(
            given, global_batch=8, micro_batch=4, seed=0,
            options=LoaderOptions(num_workers=2, pin_memory=True),
        )  # fmt: skip
    with pytest.raises(LoaderMisconfigured, match="a DataLoader and collate="):
        MicrobatchLoader.open(given, global_batch=8, micro_batch=4, seed=0, collate=as_dict)


def test_bad_loading_options_are_refused() -> None:
    with pytest.raises(ValueError, match="num_workers"):
        LoaderOptions(num_workers=-1)
    with pytest.raises(ValueError, match="prefetch_factor"):
        LoaderOptions(num_workers=2, prefetch_factor=0)
