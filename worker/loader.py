"""Loading this rank's upcoming microbatches ahead of the training thread.

The data plan (:mod:`rollcall.worker.plan`) fixes what microbatch ``(step, index)``
contains; this module decides only *when* and *where* it is read, never
*what*: whatever process reads it, the training thread gets exactly
``collate([dataset[i] for i in plan sample ids])``.

* :class:`PrefetchSchedule` is the pure core: for the rank's current position
  (a :class:`Target`: rank, world size, next step) it says which microbatch
  to load next, which loaded ones to keep when the position moves (a view
  change, a commit) and how a request of the training thread is served. No
  processes, no torch, no clock.
* :func:`load_microbatch` reads and collates one microbatch with torch's
  CPU generator, ``random``, numpy and the generators the data set and the
  collate function hold (:mod:`rollcall.worker.randomness`) seeded from
  :func:`rollcall.worker.plan.load_seed`, so that augmentation drawn in
  ``__getitem__`` depends neither on the process nor on what it read before.
* :class:`MicrobatchLoader` is the shell: a ``torch.utils.data.DataLoader``
  (its worker processes, queues, pinning and ``worker_init_fn``) over a
  keyed view of the dataset, whose sampler asks the schedule for the next
  microbatch each time the DataLoader has a free slot. The DataLoader keeps
  ``num_workers * prefetch_factor`` loads in flight and pulls the next key
  only when one comes back, so prefetch stays bounded and every key pulled
  reflects the rank's position at that moment.
* :func:`data_source` accepts what the user passes as the dataset: a
  map-style dataset, or a DataLoader whose dataset, collate function and
  worker settings are used and whose sampling is replaced by the plan. An
  iterable source is refused: see :class:`UnindexableDataset`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import random
import signal
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from enum import Enum
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_convert,
    get_worker_info,
)
from torch.utils.data import default_collate as torch_default_collate

from rollcall.membership.config import Config
from rollcall.membership.errors import RollcallError
from rollcall.worker.plan import DataPlan, Microbatch, load_seed
from rollcall.worker.randomness import held_generators, seed_held

try:
    import numpy
except ImportError:  # numpy is optional for a user's data: then there is nothing to seed
    numpy = None  # type: ignore[assignment]

log = logging.getLogger("rollcall.worker.loader")

#: The extra seed word that sets numpy's stream apart from ``random``'s.
_NUMPY_WORD = 0x6E756D70  # "nump"
T = TypeVar("T")


# --- errors -----------------------------------------------------------------------------


class UnindexableDataset(RollcallError, TypeError):
    """The dataset cannot be indexed by sample id (an ``IterableDataset``, or
    no ``__len__`` / ``__getitem__``). Exact accounting needs one: pass a
    map-style dataset instead."""


class LoaderMisconfigured(RollcallError, ValueError):
    """The loading settings contradict the data plan or each other (a
    DataLoader's batch size other than ``micro_batch``, its own sampler, the
    same setting given twice); the message says what to pass instead."""


class LoaderClosed(RollcallError, RuntimeError):
    """The loader was closed, or stopped after a failure it raised earlier."""


class NotAPair(RollcallError, TypeError):
    """``batch.inputs`` / ``batch.targets`` of a batch that is not an
    ``(inputs, targets)`` pair: read ``batch.data``."""


# --- what the training thread gets ----------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """One microbatch of this rank: its plan entry and the collated samples."""

    microbatch: Microbatch
    data: Any
    """What the collate function returned, whatever its structure."""

    @property
    def inputs(self) -> Any:
        """The first item of an ``(inputs, targets)`` pair (tuple or list)."""
        return self._pair()[0]

    @property
    def targets(self) -> Any:
        """The second item of an ``(inputs, targets)`` pair (tuple or list)."""
        return self._pair()[1]

    def _pair(self) -> tuple[Any, Any] | list[Any]:
        # torch's default_collate turns tuple samples into a *list* [X, Y].
        data = self.data
        if isinstance(data, tuple | list) and len(data) == 2:
            return data
        raise NotAPair(
            "batch.inputs and batch.targets need the collate function to return an "
            f"(inputs, targets) pair; it returned {_describe_value(data)}: use batch.data"
        )


def _describe_value(value: Any) -> str:
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


def default_collate(samples: Sequence[Any]) -> Any:
    """torch's ``default_collate`` of the samples: ``(input, target)`` pairs
    (tensors, numbers, numpy arrays: a torchvision label is an int) give an
    ``(inputs, targets)`` tuple of batched tensors; other samples (a dict, a
    triple) their collated structure, read from ``batch.data``."""
    data = torch_default_collate(list(samples))
    if isinstance(data, list) and len(data) == 2:  # pairs come back as a list
        return data[0], data[1]
    return data


# --- the pure core: which microbatch next, which to keep ------------------------------


@dataclass(frozen=True, order=True)
class Key:
    """A microbatch's identity: its content depends on it alone."""

    step: int
    index: int


@dataclass(frozen=True)
class Target:
    """Where this rank stands: its place in the view and the next step to run."""

    rank: int
    world_size: int
    next_step: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size or self.next_step < 0:
            raise ValueError(
                f"no such position: rank {self.rank} of {self.world_size}, step {self.next_step}"
            )


def assigned(plan: DataPlan, target: Target, key: Key) -> bool:
    """Whether the rank at ``target`` runs ``key``: a step not committed yet
    and an index in the rank's block of that step."""
    return (
        key.step >= target.next_step
        and key.index in plan.assignment(key.step, target.world_size)[target.rank]
    )


def upcoming(plan: DataPlan, target: Target) -> Iterator[Key]:
    """The keys the rank at ``target`` runs, in the order the training
    thread asks for them: endless, or empty when the rank runs nothing (more
    ranks than microbatches)."""
    step = target.next_step
    while True:
        block = plan.assignment(step, target.world_size)[target.rank]
        if not block:
            return  # every step is divided the same way: no work now, none later
        for index in block:
            yield Key(step, index)
        step += 1


def next_key(plan: DataPlan, target: Target, skip: set[Key]) -> Key | None:
    """The first key of :func:`upcoming` not in ``skip``; ``None`` if the rank
    runs nothing. ``skip`` is finite, so the search ends."""
    for key in upcoming(plan, target):
        if key not in skip:
            return key
    return None


class Take(Enum):
    """How :meth:`PrefetchSchedule.request` serves a microbatch."""

    CACHED = "cached"
    """Loaded ahead and kept: hand it out."""
    RECEIVE = "receive"
    """It is (or is about to be) in flight: receive the next load, ask again."""
    LOAD_HERE = "load here"
    """Nothing in flight will bring it: load it on the calling thread."""


class PrefetchSchedule:
    """Which microbatches of one rank are loaded ahead, and which are kept.

    Bookkeeping over :class:`Key` values only; the loaded data lives with the
    caller. It models an in-order pipeline: every key :meth:`issue` hands out
    is loaded and comes back, in issue order, through :meth:`arrived`.

    Invariants: a kept key is assigned to the current target and was not
    handed out since the target was set; at most ``capacity`` keys are kept,
    plus the one the training thread is waiting for; no key is in flight
    twice. A key handed out is not issued again until the target moves: a
    view change needs the aborted step's microbatches again, a commit moves
    past them.
    """

    def __init__(self, plan: DataPlan, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._plan = plan
        self._capacity = capacity
        self._target: Target | None = None
        self._in_flight: deque[Key | None] = deque()  # None: an idle slot
        self._kept: set[Key] = set()
        self._taken: set[Key] = set()  # handed out since the target was set
        self._awaited: Key | None = None  # kept on arrival whatever the capacity

    @property
    def target(self) -> Target | None:
        """The position set last, if any."""
        return self._target

    @property
    def kept(self) -> frozenset[Key]:
        """Keys loaded ahead and kept for the training thread."""
        return frozenset(self._kept)

    @property
    def in_flight(self) -> tuple[Key | None, ...]:
        """Keys issued and not back yet, oldest first (``None``: idle slot)."""
        return tuple(self._in_flight)

    def retarget(self, target: Target) -> tuple[Key, ...]:
        """Move to ``target``. Returns the kept keys it does not run, sorted;
        they are forgotten here and the caller frees their data."""
        self._target = target
        dropped = tuple(sorted(k for k in self._kept if not assigned(self._plan, target, k)))
        self._kept.difference_update(dropped)
        self._taken.clear()
        self._awaited = None
        return dropped

    def issue(self) -> Key | None:
        """The key to load in a slot that just freed: the rank's first upcoming
        key not in flight, kept or handed out. ``None`` (an idle slot, loaded
        as nothing) before any target or when the rank runs nothing."""
        key = self._next()
        self._in_flight.append(key)
        return key

    def arrived(self, key: Key | None) -> bool:
        """The oldest load in flight came back as ``key``: True to keep it.

        Kept when the current target runs it, it was not handed out since, and
        there is room (always for the key the training thread waits for).
        Raises :class:`ValueError` if ``key`` is not the oldest in flight: the
        pipeline is not in order, and nothing it says can be trusted.
        """
        expected = self._in_flight[0] if self._in_flight else "nothing"
        if key != expected:
            raise ValueError(f"load of {key} came back while {expected} was the oldest in flight")
        self._in_flight.popleft()
        target = self._target
        keep = (
            key is not None
            and target is not None
            and key not in self._taken
            and assigned(self._plan, target, key)
            and (key == self._awaited or len(self._kept) < self._capacity)
        )
        if keep:
            assert key is not None  # mypy: narrowed by `keep`
            self._kept.add(key)
        return keep

    def request(self, key: Key) -> Take:
        """How to serve the training thread's request for ``key``.

        A key the current target does not run is always loaded here: nothing
        loaded ahead for another position may serve it. A kept one is handed
        out; one in flight, or next to issue while something is in flight
        (receiving it frees the slot that issues it), is received; anything
        else is loaded here, and then counts as handed out.
        """
        target = self._target
        if target is None or not assigned(self._plan, target, key):
            return Take.LOAD_HERE
        if key in self._kept:
            self._kept.remove(key)
            self._taken.add(key)
            self._awaited = None
            return Take.CACHED
        if key in self._in_flight or (self._in_flight and key == self._next()):
            self._awaited = key
            return Take.RECEIVE
        self._taken.add(key)
        self._awaited = None
        return Take.LOAD_HERE

    def _next(self) -> Key | None:
        if self._target is None:
            return None
        skip = {k for k in self._in_flight if k is not None} | self._kept | self._taken
        return next_key(self._plan, self._target, skip)


# --- loading one microbatch -----------------------------------------------------------


def _seed_everything(seed: int) -> None:
    """Seed torch's CPU generator, ``random`` and numpy from ``seed``.

    The CPU generator alone, not ``torch.manual_seed``: that one also seeds
    every accelerator through lazy calls that each format a stack trace,
    ~0.4 ms, and loader workers draw from the CPU generator.
    """
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    if numpy is not None:
        # numpy takes 32-bit words: both halves of the 63-bit seed, plus a
        # third word, because ``random`` seeds the very same Mersenne Twister
        # from the two halves alone and the two streams would be equal.
        numpy.random.seed([seed & 0xFFFF_FFFF, seed >> 32, _NUMPY_WORD])


def seed_generators(seed: int) -> None:
    """Seed what the training thread draws from, before each microbatch is
    handed out and before the update: torch's generators, ``random`` and
    numpy, from ``seed``. torch's: every
    accelerator's generator too when an accelerator is there, else only the
    CPU generator. On a machine without one, ``torch.manual_seed`` still
    queues a lazy seeding of each accelerator kind, each formatting a stack
    trace: 0.1-0.7 ms per call here (deeper stacks cost more), once per
    microbatch, against ~1 us for the CPU generator alone; the CPU
    generator's state is the same either way. ``random`` and numpy: a loop
    that draws from them (a stochastic depth, a masking ratio) draws the
    same numbers for a microbatch whichever rank runs it (~10 us)."""
    _seed_everything(seed)
    if torch.accelerator.is_available():
        torch.manual_seed(seed)


@contextlib.contextmanager
def _streams_kept() -> Iterator[None]:
    """The caller's torch CPU, ``random`` and numpy states, restored on exit."""
    torch_state = torch.get_rng_state()
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def load_microbatch(
    dataset: Any,
    collate: Callable[[Sequence[Any]], Any],
    sample_ids: Sequence[int],
    seed: int,
    held: Sequence[Any] = (),
) -> Any:
    """``collate([dataset[i] for i in sample_ids])`` with torch's CPU
    generator, ``random``, numpy and the generators in ``held`` (those the
    data set and ``collate`` hold: :func:`held_generators`) seeded from
    ``seed`` (a :func:`rollcall.worker.plan.load_seed`); the caller's global
    generator states are restored afterwards, so loading on the training
    thread leaves its streams as they were."""
    with _streams_kept():
        return _load_seeded(dataset, collate, sample_ids, seed, held)


def _load_seeded(
    dataset: Any,
    collate: Callable[[Sequence[Any]], Any],
    sample_ids: Sequence[int],
    seed: int,
    held: Sequence[Any],
) -> Any:
    # In a loader worker nothing else draws: no state to restore.
    _seed_everything(seed)
    seed_held(held, seed)
    return collate([dataset[i] for i in sample_ids])


# --- what the user may pass -----------------------------------------------------------


@dataclass(frozen=True)
class LoaderOptions:
    """How microbatches are loaded ahead: ``torch.utils.data.DataLoader``'s
    settings of the same names."""

    num_workers: int = 0
    """Worker processes; 0 loads on the calling thread when asked, no prefetch."""
    prefetch_factor: int = 2
    """Microbatches in flight per worker."""
    worker_init_fn: Callable[[int], None] | None = None
    """Called in each worker process with its id, before it loads anything."""
    multiprocessing_context: Any = None
    """A start method name or a ``multiprocessing`` context; None: torch's default."""
    pin_memory: bool = False
    """Pin the loaded tensors (when an accelerator is present)."""
    timeout: float = 0.0
    """Seconds to wait for a worker's microbatch before failing; 0: no limit."""

    def __post_init__(self) -> None:
        if isinstance(self.num_workers, bool) or self.num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {self.num_workers!r}")
        if isinstance(self.prefetch_factor, bool) or self.prefetch_factor < 1:
            raise ValueError(f"prefetch_factor must be an int >= 1, got {self.prefetch_factor!r}")
        if self.timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {self.timeout!r}")

    @property
    def window(self) -> int:
        """Microbatches in flight at most: ``num_workers * prefetch_factor``."""
        return self.num_workers * self.prefetch_factor


@dataclass(frozen=True)
class DataSource:
    """What to load from: an indexable dataset, a collate function, options."""

    dataset: Any
    collate: Callable[[Sequence[Any]], Any]
    options: LoaderOptions


_WHY_INDEXABLE = (
    "exact accounting (no sample lost or repeated when workers die or join) needs an "
    "indexable dataset with __len__ and __getitem__: the data plan hands out sample ids, "
    "and any rank must be able to load any of them. Materialise it (for example a list "
    "of its items, or a TensorDataset), or index it (a map-style Dataset over its files "
    "or shards), and pass that"
)


def require_indexable(dataset: Any, what: str = "the dataset") -> None:
    """Raise :class:`UnindexableDataset` unless ``dataset`` is map-style."""
    kind = type(dataset).__name__
    if isinstance(dataset, IterableDataset):
        raise UnindexableDataset(f"{what} is an IterableDataset ({kind}): {_WHY_INDEXABLE}")
    missing = [name for name in ("__len__", "__getitem__") if not _defines(dataset, name)]
    if missing:
        lacks = " and no ".join(missing)
        raise UnindexableDataset(f"{what} ({kind}) has no {lacks}: {_WHY_INDEXABLE}")


def _defines(dataset: Any, name: str) -> bool:
    # torch's Dataset.__getitem__ is a placeholder that raises NotImplementedError.
    method = getattr(type(dataset), name, None)
    return method is not None and method is not getattr(Dataset, name, None)


def data_source(
    given: Any,
    *,
    micro_batch: int,
    collate: Callable[[Sequence[Any]], Any] | None = None,
    options: LoaderOptions | None = None,
) -> DataSource:
    """What to load from, given a map-style dataset or a DataLoader over one.

    A dataset is used with ``collate`` (default :func:`default_collate`) and
    ``options``. A ``torch.utils.data.DataLoader`` brings its dataset,
    ``collate_fn`` and worker settings instead (then ``collate`` and
    ``options`` must not be given: :class:`LoaderMisconfigured`); its
    ``batch_size`` must be ``micro_batch`` or None; its order
    (``SequentialSampler``, ``shuffle=True``, a ``DistributedSampler``) and
    ``drop_last`` are replaced by the plan, said once at INFO. Any other
    sampler or a ``batch_sampler`` is refused: each chooses samples (weights,
    subsets, buckets) that the plan would silently not reproduce. An
    iterable source raises :class:`UnindexableDataset`.
    """
    if isinstance(given, DataLoader):
        return _from_dataloader(given, micro_batch, collate, options)
    require_indexable(given)
    return DataSource(given, collate or default_collate, options or LoaderOptions())


def _from_dataloader(
    loader: DataLoader[Any],
    micro_batch: int,
    collate: Callable[[Sequence[Any]], Any] | None,
    options: LoaderOptions | None,
) -> DataSource:
    dataset: Any = loader.dataset  # Dataset[Any] to mypy; checked to be Sized here
    require_indexable(dataset, "the DataLoader's dataset")
    given = [] if collate is None else ["collate"]
    if options is not None:
        given += [f.name for f in fields(options) if getattr(options, f.name) != f.default]
    if given:
        named = ", ".join(f"{name}=" for name in given)
        raise LoaderMisconfigured(
            f"a DataLoader and {named} were both given: set collate_fn and worker settings on "
            f"the DataLoader (DataLoader(dataset, batch_size={micro_batch}, num_workers=..., "
            "collate_fn=...)), or pass the dataset itself with those arguments"
        )
    if loader.batch_size is not None and loader.batch_size != micro_batch:
        raise LoaderMisconfigured(
            f"the DataLoader's batch_size is {loader.batch_size} but micro_batch is "
            f"{micro_batch}: each DataLoader batch is one microbatch, so pass "
            f"DataLoader(..., batch_size={micro_batch}) (or batch_size=None)"
        )
    if loader.batch_size is None and loader.batch_sampler is not None:
        raise LoaderMisconfigured(
            f"the DataLoader has its own batch_sampler ({type(loader.batch_sampler).__name__}): "
            "the data plan decides which samples form each microbatch, and would silently not "
            f"do what it does. Pass DataLoader(dataset, batch_size={micro_batch}) without it; "
            "to train on part of the data, pass torch.utils.data.Subset(dataset, indices)"
        )
    if not _replaced_by_the_plan(loader):
        raise LoaderMisconfigured(
            f"the DataLoader has its own sampler ({type(loader.sampler).__name__}): it chooses "
            "samples (weights, repetitions or a subset) that the data plan would silently not "
            "reproduce. Pass the DataLoader without sampler= (shuffle and DistributedSampler "
            "are fine: the plan replaces them); to train on part of the data, pass "
            "torch.utils.data.Subset(dataset, indices)"
        )
    collate_fn: Callable[..., Any] = loader.collate_fn
    if loader.batch_size is None:
        if collate_fn is not default_convert:
            raise LoaderMisconfigured(
                "the DataLoader has batch_size=None and a collate_fn: such a DataLoader applies "
                "collate_fn to one sample at a time, but here it would get micro_batch "
                f"samples. Pass DataLoader(..., batch_size={micro_batch}, collate_fn=...)"
            )
        collate_fn = torch_default_collate  # what batch_size=micro_batch would have used
    chosen = LoaderOptions(
        num_workers=loader.num_workers,
        prefetch_factor=loader.prefetch_factor or LoaderOptions.prefetch_factor,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
    )
    log.info(
        "using the DataLoader's dataset (%d samples), collate_fn and worker settings "
        "(num_workers=%d, prefetch_factor=%d, pin_memory=%s, timeout=%s); its sampler (%s), "
        "shuffle and drop_last are replaced by the data plan: one seeded order for the whole "
        "job, cut into microbatches of %d that are divided among the ranks",
        len(dataset), chosen.num_workers, chosen.prefetch_factor, chosen.pin_memory,
        chosen.timeout, type(loader.sampler).__name__, micro_batch,
    )  # fmt: skip
    return DataSource(dataset, collate_fn, chosen)


def _replaced_by_the_plan(loader: DataLoader[Any]) -> bool:
    """Whether the DataLoader's sampler only orders or shards the whole
    dataset (which the plan does instead), choosing nothing of its own."""
    sampler, dataset = loader.sampler, loader.dataset
    if type(sampler) is SequentialSampler or isinstance(sampler, DistributedSampler):
        return True
    return (
        type(sampler) is RandomSampler
        and not sampler.replacement
        and sampler.num_samples == len(dataset)  # type: ignore[arg-type]
    )


# --- the shell: worker processes through a DataLoader ----------------------------------


class _Task(NamedTuple):
    """One microbatch to load, as sent to a worker process."""

    key: Key
    sample_ids: tuple[int, ...]
    seed: int
    """:func:`rollcall.worker.plan.load_seed` of the microbatch."""
    probe: bool = False
    """Loaded for :meth:`MicrobatchLoader.probe`, not for a step."""


class _Loaded(NamedTuple):
    """A loaded microbatch, as a worker process returns it (a named tuple:
    the DataLoader's pinning rebuilds those)."""

    key: Key
    data: Any
    probe: bool = False


class _Microbatches(Dataset[Any]):
    """The dataset as the DataLoader sees it: indexed by :class:`_Task`
    (``None`` for an idle slot), each item a whole collated microbatch.
    Pickled into each worker process under the spawn and forkserver start
    methods, so it holds only the user's dataset and collate function; the
    generators they hold are found again in each process (a pickled copy
    holds copies of them)."""

    def __init__(self, dataset: Any, collate: Callable[[Sequence[Any]], Any]) -> None:
        self.dataset = dataset
        self.collate = collate
        self.held = held_generators(dataset, collate)

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "collate": self.collate}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["dataset"], state["collate"])  # type: ignore[misc]

    def __getitem__(self, task: _Task | None) -> _Loaded | None:
        if task is None:
            return None
        data = _load_seeded(self.dataset, self.collate, task.sample_ids, task.seed, self.held)
        return _Loaded(task.key, data, task.probe)


class _Tasks:
    """The DataLoader's sampler: each item it pulls is the next task of the
    schedule, computed from the rank's position at that moment. It never ends:
    the DataLoader pulls only when a slot frees, which bounds the prefetch."""

    def __init__(self, next_task: Callable[[], _Task | None]) -> None:
        self._next_task = next_task

    def __iter__(self) -> Iterator[_Task | None]:
        return self

    def __next__(self) -> _Task | None:
        return self._next_task()


class _WorkerStart:
    """The DataLoader's worker_init_fn: the worker closes the descriptors it
    must not keep, ignores SIGINT and SIGTERM, then runs the user's
    ``worker_init_fn``.

    Ctrl-C in a terminal, or a supervisor signalling the process group
    (SIGINT or SIGTERM), reaches the loader workers too: a worker would
    quietly end its loop, or die and make the DataLoader's SIGCHLD handler
    raise in the middle of the training process's clean leave. The training
    process decides how to stop (it may finish its step first, which needs
    microbatches) and stops its workers itself; a worker whose training
    process died ends on its own (the DataLoader's watchdog, within 5 s).
    Picklable, for the spawn and forkserver start methods.
    """

    def __init__(
        self, user: Callable[[int], None] | None, not_inherited: tuple[int, ...] = ()
    ) -> None:
        self.user = user
        self.not_inherited = not_inherited

    def __call__(self, worker_id: int) -> None:
        for fd in self.not_inherited:
            with contextlib.suppress(OSError):  # not inherited (spawn): nothing to close
                os.close(fd)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.user is not None:
            self.user(worker_id)
            # A generator the user's init made (numpy-based augmentation's
            # per-worker generator) is seeded per microbatch too.
            info = get_worker_info()
            if info is not None and isinstance(info.dataset, _Microbatches):
                info.dataset.held = held_generators(info.dataset.dataset, info.dataset.collate)


def _as_is(item: T) -> T:
    """The DataLoader's collate_fn: items are collated in the worker already."""
    return item


#: How long a worker whose connection was reset is given to be seen dead.
_DEATH_SEEN_S = 1.0


def _raise_if_a_worker_died(pipeline: Any, exc: BaseException) -> None:
    """The DataLoader's own error for a worker process that died (the one
    its SIGCHLD handler raises), from ``exc``, if one of ``pipeline``'s
    workers has exited within ``_DEATH_SEEN_S``; else nothing."""
    workers = list(getattr(pipeline, "_workers", ()))
    deadline = time.monotonic() + _DEATH_SEEN_S
    while workers:
        dead = [w for w in workers if not w.is_alive()]
        if dead:
            raise RuntimeError(
                f"DataLoader worker (pid {dead[0].pid}) exited unexpectedly with exit code "
                f"{dead[0].exitcode}: a batch it had queued could not be received ({exc!r})"
            ) from exc
        if time.monotonic() >= deadline:
            return
        time.sleep(0.01)


class MicrobatchLoader:
    """This rank's microbatches, loaded ahead in worker processes.

    ``get(step, index)`` returns exactly
    ``collate([dataset[i] for i in plan.microbatches(step)[index].sample_ids])``,
    loaded with torch's CPU generator, ``random`` and numpy seeded from
    :func:`rollcall.worker.plan.load_seed`; the caller's RNG states are left alone.
    The caller says where the rank stands: :meth:`enter_view` on entering a
    view, :meth:`step_committed` after each commit. Microbatches loaded ahead
    that the new position does not run are dropped, never handed out; those
    it still runs are kept. At most ``num_workers * prefetch_factor`` are in
    flight and as many kept.

    With ``num_workers=0`` every microbatch is loaded by :meth:`get` on the
    calling thread. Otherwise the first :meth:`start` (or :meth:`enter_view`)
    starts the workers; :meth:`close` stops them. An error of a worker (an
    exception in the dataset, a process that died, the timeout) is raised by
    :meth:`get` as the DataLoader raises it, and the loader stops: the next
    call raises :class:`LoaderClosed`. Single-threaded: call it from one
    thread (the training thread). ``config`` (default: ``Config()``) says
    how long closing waits for a worker it killed (``loader_kill_wait``).
    """

    def __init__(
        self,
        dataset: Any,
        plan: DataPlan,
        collate: Callable[[Sequence[Any]], Any] = default_collate,
        options: LoaderOptions | None = None,
        config: Config | None = None,
    ) -> None:
        require_indexable(dataset)
        self.plan = plan
        self.options = options or LoaderOptions()
        self._config = config or Config()
        self._source = _Microbatches(dataset, collate)
        self._schedule = PrefetchSchedule(plan, capacity=self.options.window)
        self._loaded: dict[Key, Any] = {}
        self._pipeline: Iterator[_Loaded | None] | None = None
        self._closed: str | None = None  # why, once closed
        self._probes_to_issue = 0
        self._probed: list[Any] = []
        self._pin_device = self._pinning_device()

    @classmethod
    def open(
        cls,
        given: Any,
        *,
        global_batch: int,
        micro_batch: int,
        seed: int,
        collate: Callable[[Sequence[Any]], Any] | None = None,
        options: LoaderOptions | None = None,
        config: Config | None = None,
    ) -> MicrobatchLoader:
        """A loader for what the user passed as the dataset (see
        :func:`data_source`), with the plan over its length in samples."""
        source = data_source(given, micro_batch=micro_batch, collate=collate, options=options)
        plan = DataPlan(len(source.dataset), global_batch, micro_batch, seed)
        return cls(source.dataset, plan, source.collate, source.options, config)

    @property
    def target(self) -> Target | None:
        """Where the rank stands, as last told."""
        return self._schedule.target

    def start(self, not_inherited: Sequence[int] = ()) -> None:
        """Start the worker processes, if any and not yet started.

        Call it before the process opens sockets or starts threads: with
        the fork start method (Linux's default) each worker inherits a copy
        of every open file descriptor (a copied TCP socket is not reset when
        this process dies) and of the threads' state (gRPC's fork handlers).
        Descriptors already open that a worker must not keep (the
        supervisor's report socket, whose closing tells the supervisor that
        this process ended) are listed in ``not_inherited``: each worker
        closes its copy first.
        """
        self._check_open()
        if self._pipeline is not None or self.options.num_workers == 0:
            return
        options = self.options
        context = options.multiprocessing_context
        method = (
            context if isinstance(context, str)
            else context.get_start_method() if context is not None
            else multiprocessing.get_start_method()
        )  # fmt: skip
        if method != "fork":
            not_inherited = ()  # a started process inherits nothing of ours
        loader: DataLoader[Any] = DataLoader(
            self._source,
            batch_size=None,
            sampler=_Tasks(self._next_task),
            collate_fn=_as_is,
            num_workers=options.num_workers,
            prefetch_factor=options.prefetch_factor,
            worker_init_fn=_WorkerStart(options.worker_init_fn, tuple(not_inherited)),
            multiprocessing_context=options.multiprocessing_context,
            pin_memory=options.pin_memory,
            timeout=options.timeout,
            # Its own generator: creating the iterator draws the workers' base
            # seed, which would otherwise move the caller's torch RNG.
            generator=torch.Generator(),
            in_order=True,  # the schedule models an in-order pipeline
        )
        self._pipeline = iter(loader)

    def enter_view(self, rank: int, world_size: int, next_step: int) -> None:
        """The rank is now ``rank`` of ``world_size`` and runs ``next_step``
        next (a view was entered): drop what it no longer runs."""
        self._check_open()
        self.start()
        self._move(Target(rank, world_size, next_step))

    def step_committed(self, step: int) -> None:
        """``step`` committed: the rank runs ``step + 1`` next, same view."""
        self._check_open()
        target = self._schedule.target
        if target is None:
            raise ValueError("step_committed before enter_view: the loader has no position")
        self._move(Target(target.rank, target.world_size, step + 1))

    def get(self, step: int, index: int) -> Any:
        """The collated microbatch ``index`` of ``step``. With workers, an
        error raised here (theirs, or one loading here) stops the loader."""
        self._check_open()
        key = Key(step, index)
        with self._stopped_by_errors():
            while True:
                take = self._schedule.request(key)
                if take is Take.CACHED:
                    return self._loaded.pop(key)
                if take is Take.LOAD_HERE:
                    return self._load_here(key)
                self._receive()

    @contextlib.contextmanager
    def _stopped_by_errors(self) -> Iterator[None]:
        """With workers, an error raised inside stops the loader. The
        DataLoader's SIGCHLD handler raises a worker's death at any point of
        the main thread, so not only from inside ``_receive``."""
        try:
            yield
        except BaseException as exc:
            if self._pipeline is not None:
                self._stop(f"the loader stopped after an error: {exc!r}")
            raise

    @property
    def user_objects(self) -> tuple[Any, ...]:
        """The user's objects whose code the loader runs: the data set, the
        collate function (a ``DataLoader``'s, given one) and the worker
        init function."""
        return (self._source.dataset, self._source.collate, self.options.worker_init_fn)

    def probe(self, reads: int = 2) -> list[Any]:
        """The plan's first microbatch (step 0, microbatch 0), loaded
        ``reads`` times as steps load theirs, each time seeded alike: by the
        worker processes in turn (so by as many of them as there are reads),
        or on the calling thread without workers. Nothing is kept for a step.
        For the job's fingerprint, which compares what the workers read
        (``rollcall.worker.fingerprint.data_probe``); call it after
        :meth:`start` and before :meth:`enter_view`. An error loading it
        stops the loader, as in :meth:`get`."""
        self._check_open()
        if self._pipeline is None:
            return [self._load_here(Key(0, 0)) for _ in range(reads)]
        self._probes_to_issue, self._probed = reads, []
        with self._stopped_by_errors():
            while len(self._probed) < reads:
                self._receive()
        probed, self._probed = self._probed, []
        return probed

    def cached(self) -> frozenset[Key]:
        """Keys loaded ahead and kept (for tests and diagnostics)."""
        return frozenset(self._loaded)

    def close(self) -> None:
        """Stop the worker processes and free what was loaded ahead. Safe to
        call again; :meth:`get` afterwards raises :class:`LoaderClosed`."""
        self._stop("the loader was closed")

    def __enter__(self) -> MicrobatchLoader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _move(self, target: Target) -> None:
        for key in self._schedule.retarget(target):
            del self._loaded[key]

    def _next_task(self) -> _Task | None:
        # Called by the DataLoader, on the thread calling get() or start().
        key = self._schedule.issue()
        if key is None and self._probes_to_issue:
            # An idle slot to the schedule, which it comes back as (_receive).
            self._probes_to_issue -= 1
            return self._task(Key(0, 0))._replace(probe=True)
        return None if key is None else self._task(key)

    def _task(self, key: Key) -> _Task:
        microbatch = self.plan.microbatches(key.step)[key.index]
        seed = load_seed(self.plan.seed, key.step, key.index)
        return _Task(key, microbatch.sample_ids, seed)

    def _receive(self) -> None:
        assert self._pipeline is not None  # RECEIVE needs something in flight
        try:
            item = next(self._pipeline)
        except (ConnectionError, EOFError) as exc:
            # A batch whose worker died after queueing it: its tensors' file
            # descriptors were to come from that process, and the connection
            # to it is reset, before the DataLoader's SIGCHLD handler says why.
            _raise_if_a_worker_died(self._pipeline, exc)
            raise
        if item is not None and item.probe:
            self._schedule.arrived(None)
            self._probed.append(item.data)
            return
        key = None if item is None else item.key
        if self._schedule.arrived(key):
            assert item is not None and key is not None  # only real keys are kept
            self._loaded[key] = item.data

    def _load_here(self, key: Key) -> Any:
        task = self._task(key)
        source = self._source
        data = load_microbatch(
            source.dataset, source.collate, task.sample_ids, task.seed, source.held
        )
        if self._pin_device is None:
            return data
        # What the DataLoader's pinning thread does to the workers' batches.
        from torch.utils.data._utils.pin_memory import pin_memory

        return pin_memory(data, self._pin_device)

    def _pinning_device(self) -> str | None:
        if not self.options.pin_memory:
            return None
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None or not torch.accelerator.is_available():
            log.info("pin_memory is set but there is no accelerator: batches are not pinned")
            return None
        return accelerator.type

    def _check_open(self) -> None:
        if self._closed is not None:
            raise LoaderClosed(self._closed)

    def _stop(self, reason: str) -> None:
        if self._closed is None:
            self._closed = reason
        pipeline, self._pipeline = self._pipeline, None
        self._loaded.clear()
        if pipeline is not None:
            # Dropping the iterator would shut its workers down only once the
            # last reference goes, and a traceback of its error keeps one.
            shutdown = getattr(pipeline, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            # The workers ignore SIGTERM (see _WorkerStart), so one stuck in
            # user code outlives the DataLoader's terminate(): kill it, or
            # the interpreter's exit would wait for it forever.
            for worker in getattr(pipeline, "_workers", ()):
                if worker.is_alive():
                    worker.kill()
                    worker.join(timeout=self._config.loader_kill_wait)


__all__ = [
    "Batch",
    "DataSource",
    "Key",
    "LoaderClosed",
    "LoaderMisconfigured",
    "LoaderOptions",
    "MicrobatchLoader",
    "NotAPair",
    "PrefetchSchedule",
    "Take",
    "Target",
    "UnindexableDataset",
    "assigned",
    "data_source",
    "default_collate",
    "load_microbatch",
    "next_key",
    "require_indexable",
    "seed_generators",
    "upcoming",
]
