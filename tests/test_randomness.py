"""Random generators the user's objects hold (rollcall.worker.randomness):
found in the data set, its collate function and the model's modules, and
seeded per microbatch so that what a microbatch computes depends on its
seed alone; and exact mode refusing samples that depend on more."""

from __future__ import annotations

import functools
import pickle
import random
import time
from typing import Any

import numpy
import pytest
import torch
from torch import nn

from rollcall.membership.errors import UsageError
from rollcall.worker.loader import _Microbatches, load_microbatch, seed_generators
from rollcall.worker.randomness import ModelGenerators, held_generators, seed_held


def _kinds() -> list[Any]:
    return [
        torch.Generator().manual_seed(1),
        random.Random(2),
        numpy.random.default_rng(3),
        numpy.random.RandomState(4),
    ]


def _draw(generator: Any) -> float:
    if isinstance(generator, torch.Generator):
        return float(torch.rand((), generator=generator))
    return float(generator.random() if not isinstance(generator, numpy.random.RandomState)
                 else generator.random_sample())  # fmt: skip


class _Flip:
    def __init__(self, rng: Any) -> None:
        self.rng = rng


class _Compose:
    def __init__(self, transforms: list[Any]) -> None:
        self.transforms = transforms


class _Noisy(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples with noise from a numpy generator the data set holds."""

    def __init__(self) -> None:
        self.x = torch.arange(32.0).reshape(8, 4)
        self.rng = numpy.random.default_rng(0)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.from_numpy(self.rng.normal(size=4).astype("float32"))
        return self.x[index] + noise, torch.tensor(index)


def test_the_generators_objects_hold_are_found_once_each_and_the_global_ones_never() -> None:
    torch_gen, python_gen, numpy_gen, legacy_gen = _kinds()
    dataset = _Noisy()
    dataset.transform = _Compose([_Flip(torch_gen), _Flip(python_gen)])  # type: ignore[attr-defined]
    dataset.by_name = {"legacy": legacy_gen, "again": torch_gen}  # type: ignore[attr-defined]
    dataset.globals = [torch.default_generator, random._inst,  # type: ignore[attr-defined]
                       numpy.random.mtrand._rand]  # fmt: skip
    # A large list holds samples, not generators: not looked into.
    dataset.samples = [(i, numpy.random.default_rng(i)) for i in range(1000)]  # type: ignore[attr-defined]
    collate = functools.partial(lambda batch, rng: batch, rng=numpy_gen)
    found = held_generators(dataset, collate)
    assert [id(g) for g in found] == [
        id(dataset.rng), id(torch_gen), id(python_gen), id(legacy_gen), id(numpy_gen)
    ]  # fmt: skip
    masking = _Flip(random.Random(5))  # collate_fn=masking.collate: a bound method
    assert held_generators(masking.__init__) == (masking.rng,)
    assert held_generators(_Noisy().x, [1, "a", None], torch.nn.functional.relu) == ()


def test_an_object_that_answers_for_its_dict_strangely_is_left_alone() -> None:
    class Proxy:  # a lazy proxy: every attribute is looked up elsewhere
        __slots__ = ()

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"not loaded: {name}")

    holder = _Flip(Proxy())
    holder.other = random.Random(1)  # type: ignore[attr-defined]
    assert held_generators(holder) == (holder.other,)  # type: ignore[attr-defined]


def test_a_models_generators_are_found_in_each_module_passed() -> None:
    class Dropping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.noise = torch.Generator().manual_seed(7)

    model = nn.Sequential(nn.Linear(4, 4), Dropping())
    assert held_generators(model) == ()  # submodules are passed one by one
    assert held_generators(*model.modules()) == (model[1].noise,)


def test_seeding_gives_each_kind_the_same_draws_for_a_seed_and_other_draws_elsewhere() -> None:
    generators = _kinds()
    seed_held(generators, 12345)
    first = [_draw(g) for g in generators]
    for g in generators:  # moved on, as a process that loaded more would be
        _draw(g)
    seed_held(generators, 12345)
    assert [_draw(g) for g in generators] == first
    seed_held(generators, 12346)
    assert all(a != b for a, b in zip(first, [_draw(g) for g in generators], strict=True))
    # Two generators of one kind in one list draw differently.
    pair = [numpy.random.default_rng(0), numpy.random.default_rng(0)]
    seed_held(pair, 5)
    assert _draw(pair[0]) != _draw(pair[1])


def test_a_microbatch_loaded_again_after_others_holds_the_same_samples() -> None:
    # At 81d08bc the data set's own generator went on from where the process
    # left it: the same microbatch loaded again after another held other
    # noise, so what a microbatch held depended on what the process loaded
    # before it (its rank, the world size, an abort).
    dataset = _Noisy()
    held = held_generators(dataset)

    def inputs(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return torch.stack([x for x, _ in samples])

    first = load_microbatch(dataset, inputs, [0, 1], seed=99, held=held)
    load_microbatch(dataset, inputs, [2, 3], seed=100, held=held)
    again = load_microbatch(dataset, inputs, [0, 1], seed=99, held=held)
    assert torch.equal(first, again)
    assert not torch.equal(first, dataset.x[:2])  # there is noise to compare


def test_a_loader_workers_copy_finds_the_generators_of_its_own_copy() -> None:
    source = _Microbatches(_Noisy(), list)
    assert source.held == (source.dataset.rng,)
    copy = pickle.loads(pickle.dumps(source))  # as spawn and forkserver hand it over
    assert copy.held == (copy.dataset.rng,)
    assert copy.held[0] is not source.held[0]


class _Clocked(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples that hold the time they were read at."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((4,), float(time.perf_counter_ns() % 100_003)), torch.tensor(index)


def test_exact_mode_refuses_samples_that_depend_on_more_than_index_and_seeded_generators() -> None:
    # At 81d08bc a line at INFO said the first microbatch read twice gave
    # other values, and exact mode went on, computing other bits in another
    # history. Refused at construction, before the job is joined (the
    # rendezvous address is never dialled).
    from rollcall import Elastic

    model = nn.Linear(4, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match="exact=True: the data plan's first microbatch, read"):
        Elastic(model, optimizer, _Clocked(), global_batch=4, micro_batch=2, exact=True,
                rendezvous="127.0.0.1:1", job="j", token="t", messages=False)  # fmt: skip


def test_a_seed_sets_torchs_randoms_and_numpys_global_generators() -> None:
    # A loop drawing a masking ratio from numpy or random: at 52bcac5 only
    # torch's generator was seeded before a microbatch was handed out.
    def draws() -> tuple[float, float, float]:
        return float(torch.rand(())), random.random(), float(numpy.random.rand())

    seed_generators(7)
    first = draws()
    draws()
    seed_generators(7)
    assert draws() == first
    seed_generators(8)
    assert all(a != b for a, b in zip(draws(), first, strict=True))


class _LazyNoise(nn.Module):
    """A dropout whose generator its first forward pass makes."""

    def __init__(self) -> None:
        super().__init__()
        self.rng: torch.Generator | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rng is None:
            self.rng = torch.Generator().manual_seed(7)
        return x * (torch.rand(x.shape, generator=self.rng) > 0.5)


def _microbatch(generators: ModelGenerators, model: nn.Module, seed: int) -> torch.Tensor:
    """What a microbatch of ``seed`` computes, as the runtime hands it out."""
    generators.seed(seed)
    out = model(torch.ones(8))
    generators.check_after_first()
    return out


def test_a_generator_assigned_after_construction_is_seeded_from_the_first_microbatch() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    generators = ModelGenerators(model, exact=True)
    model[0].rng = torch.Generator().manual_seed(1)  # type: ignore[assignment]
    generators.seed(5)
    first = torch.rand(4, generator=model[0].rng)
    generators.seed(5)
    assert torch.equal(torch.rand(4, generator=model[0].rng), first)


def test_a_generator_the_first_microbatch_makes_is_refused_in_exact_mode_with_its_place() -> None:
    model = nn.Sequential(nn.Linear(8, 8), _LazyNoise())
    with pytest.raises(UsageError, match=r"first microbatch \(1\.rng: a torch\.Generator\)"):
        _microbatch(ModelGenerators(model, exact=True), model, seed=5)


def test_a_generator_the_first_microbatch_makes_is_seeded_from_the_next_one_otherwise() -> None:
    # Two processes that ran other microbatches before draw the same
    # numbers for microbatch 9 once the generator is taken in; had it not
    # been, they would go on from where each left it.
    def ninth(firsts: tuple[int, ...], taken_in: bool) -> torch.Tensor:
        model = _LazyNoise()
        generators = ModelGenerators(model, exact=False)
        for seed in firsts:
            generators.seed(seed)
            model(torch.ones(8))
            if taken_in:
                generators.check_after_first()
        return _microbatch(generators, model, seed=9)

    assert torch.equal(ninth((1, 2), taken_in=True), ninth((3,), taken_in=True))
    assert not torch.equal(ninth((1, 2), taken_in=False), ninth((3,), taken_in=False))
