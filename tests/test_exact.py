"""Exact mode's reduction (worker/exact.py): the step's gradient and buffers
come out bit for bit the same however the microbatches are split between
ranks, and within the documented bound of the exact real sum.

Ranks are simulated in threads of one process, each with its own copy of the
model; their collective is a barrier that sums (or takes the maximum of) what
every rank handed in. The runtime's real gloo collectives are exercised by
tests/test_exact_e2e.py."""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable, Sequence

import pytest
import torch

from rollcall.membership.errors import UsageError
from rollcall.worker.buffers import BufferSync
from rollcall.worker.contract import Agreement, GradientWatch
from rollcall.worker.exact import (
    NO_EXPONENT,
    ExactStep,
    exponent,
    fixed_point,
    fixed_point_bits,
)

MICROBATCHES = 6


class Collective:
    """All-reduce across ``ranks`` threads (element-wise max or sum)."""

    def __init__(self, ranks: int) -> None:
        self._barrier = threading.Barrier(ranks)
        self._lock = threading.Lock()
        self._handed: list[list[torch.Tensor]] = []
        self._result: list[torch.Tensor] = []

    def __call__(self, tensors: Sequence[torch.Tensor], op: str) -> None:
        with self._lock:
            self._handed.append([t.clone() for t in tensors])
        if self._barrier.wait() == 0:  # everyone handed in; the others wait
            columns = zip(*self._handed, strict=True)
            if op == "max":
                self._result = [torch.stack(c).amax(0) for c in columns]
            else:
                self._result = [torch.stack(c).sum(0) for c in columns]
            self._handed = []
        self._barrier.wait()
        for tensor, value in zip(tensors, self._result, strict=True):
            tensor.copy_(value)


def on_ranks(rank: Callable[[int], None], ranks: int = 2) -> None:
    """Run ``rank(0)``, ..., ``rank(ranks - 1)`` at once, as the ranks of a
    view, each in a thread."""
    threads = [threading.Thread(target=rank, args=(i,)) for i in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )


def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + index)
    return torch.randn(5, 8, generator=generator), torch.randint(0, 3, (5,), generator=generator)


def run_rank(model: torch.nn.Module, indices: Sequence[int], reduce: Collective) -> dict:
    params = [p for p in model.parameters()]
    sync = BufferSync(model)
    exact = ExactStep(params, sync, MICROBATCHES)
    exact.begin()
    for index in indices:
        exact.start()
        inputs, targets = batch(index)
        loss = torch.nn.functional.cross_entropy(model(inputs), targets, reduction="sum")
        loss.backward()
        exact.took(index, float(loss.detach()), len(targets))
    reduced = exact.reduce(reduce)
    reduced.apply()
    return {
        "count": reduced.count,
        "loss": reduced.loss,
        "grads": [p.grad.clone() for p in params],
        "buffers": [b.clone() for b in model.buffers()],
    }


def split_run(partition: Sequence[Sequence[int]]) -> list[dict]:
    """One step over ``partition`` (the microbatch indices of each rank)."""
    base = make_model()
    reduce = Collective(len(partition))
    results: list[dict] = [{} for _ in partition]
    errors: list[BaseException] = []

    def rank(i: int) -> None:
        try:
            results[i] = run_rank(copy.deepcopy(base), partition[i], reduce)
        except BaseException as exc:  # reported by the test
            errors.append(exc)
            reduce._barrier.abort()

    on_ranks(rank, len(partition))
    assert not errors, errors
    return results


PARTITIONS = [
    [[0, 1, 2, 3, 4, 5]],
    [[0, 1, 2], [3, 4, 5]],
    [[0, 1], [2, 3], [4, 5]],
    [[0], [1, 2, 3, 4], [5]],
    [[5, 4], [3], [2, 1, 0]],  # another order within a rank, too
    [[0], [1], [2], [3], [4], [5]],
]


def test_every_split_gives_the_same_bits_on_every_rank():
    reference = split_run(PARTITIONS[0])[0]
    for partition in PARTITIONS[1:]:
        for result in split_run(partition):
            assert result["count"] == reference["count"] == 30
            assert result["loss"] == reference["loss"]
            for got, want in zip(result["grads"], reference["grads"], strict=True):
                assert torch.equal(got, want), partition
            for got, want in zip(result["buffers"], reference["buffers"], strict=True):
                assert torch.equal(got, want), partition


def test_a_float_sum_of_the_same_gradients_depends_on_the_split():
    """What exact mode removes: summing the same microbatch gradients in
    another grouping changes bits (the test data is sensitive to it)."""
    model = make_model()
    grads = []
    for index in range(MICROBATCHES):
        model.zero_grad()
        inputs, targets = batch(index)
        torch.nn.functional.cross_entropy(model(inputs), targets, reduction="sum").backward()
        grads.append([p.grad.clone() for p in model.parameters()])

    def grouped(groups: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        partial = [[sum(grads[i][j] for i in g) for j in range(len(grads[0]))] for g in groups]
        return [sum(p[j] for p in partial) for j in range(len(grads[0]))]

    one, three = grouped(PARTITIONS[0]), grouped(PARTITIONS[3])
    assert any(not torch.equal(a, b) for a, b in zip(one, three, strict=True))


def test_the_result_is_within_the_documented_bound_of_the_exact_sum():
    result = split_run(PARTITIONS[2])[0]
    model = make_model()
    exact_sum = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    largest = [0.0 for _ in exact_sum]
    for index in range(MICROBATCHES):
        model.zero_grad()
        inputs, targets = batch(index)
        torch.nn.functional.cross_entropy(model(inputs), targets, reduction="sum").backward()
        for j, p in enumerate(model.parameters()):
            exact_sum[j] += p.grad.to(torch.float64)
            largest[j] = max(largest[j], float(p.grad.abs().max()))
    bits = fixed_point_bits(MICROBATCHES)
    for got, want, top in zip(result["grads"], exact_sum, largest, strict=True):
        e = math.frexp(top)[1]
        bound = MICROBATCHES * 2.0 ** (e - bits - 1) / 30
        # float32 rounding of the final value comes on top of the fixed point's
        float_ulp = torch.finfo(torch.float32).eps * (want / 30).abs()
        assert ((got.double() - want / 30).abs() <= bound + float_ulp).all()


def test_thefixed_point_sum_cannot_overflow():
    for microbatches in (1, 2, 3, 6, 64, 1000):
        assert microbatches * 2 ** fixed_point_bits(microbatches) <= 2**62


def test_exponents_bound_the_values_and_zeros_have_none():
    assert exponent(torch.zeros(4)) == (NO_EXPONENT, False)
    assert exponent(torch.tensor([0.75, -3.0])) == (2, False)  # |x| < 4
    assert exponent(torch.tensor([1.0, float("inf")]))[1]
    assert exponent(torch.tensor([float("nan")]))[1]


def test_a_non_finite_gradient_anywhere_is_seen_by_every_rank():
    base = make_model()
    reduce = Collective(2)
    results: list[list[torch.Tensor]] = [[], []]

    def rank(i: int) -> None:
        model = copy.deepcopy(base)
        params = list(model.parameters())
        exact = ExactStep(params, BufferSync(model), MICROBATCHES)
        exact.begin()
        for index in ((0, 1, 2), (3, 4, 5))[i]:
            exact.start()
            inputs, targets = batch(index)
            loss = torch.nn.functional.cross_entropy(model(inputs), targets, reduction="sum")
            (loss * (math.inf if index == 4 else 1.0)).backward()
            exact.took(index, float(loss.detach()), len(targets))
        reduced = exact.reduce(reduce)
        reduced.apply()
        results[i] = [p.grad for p in params]

    on_ranks(rank)
    for grads in results:
        assert grads and all(not torch.isfinite(g).any() for g in grads)


def test_a_parameter_no_microbatch_of_any_rank_reached_gets_no_gradient():
    """A plain loop gives a parameter the step's forward passes never reach
    no ``.grad`` (so the optimizer leaves it alone): the reduction says
    which, alike on every rank. One reached by a single microbatch of one
    rank, or reached with a zero gradient, counts as reached."""
    reduce = Collective(2)
    results: list[dict[str, tuple[bool, torch.Tensor]]] = [{}, {}]

    def rank(i: int) -> None:
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({name: torch.nn.Linear(8, 3) for name in
                                     ("main", "once", "zero", "never")})  # fmt: skip
        params = list(model.parameters())
        exact = ExactStep(params, None, MICROBATCHES)
        exact.begin()
        for index in ((0, 1, 2), (3, 4, 5))[i]:
            exact.start()
            inputs, targets = batch(index)
            loss = torch.nn.functional.cross_entropy(model["main"](inputs), targets,
                                                     reduction="sum")  # fmt: skip
            if index == 4:  # the second microbatch of rank 1 only
                loss = loss + model["once"](inputs).sum()
            loss = loss + 0.0 * model["zero"](inputs).sum()
            loss.backward()
            exact.took(index, float(loss.detach()), len(targets))
        reduced = exact.reduce(reduce)
        names = [name for name, _ in model.named_parameters()]
        results[i] = dict(zip(names, zip(reduced.used, reduced.grads, strict=True), strict=True))

    on_ranks(rank)
    for grads in results:
        assert sorted(name for name, (used, _) in grads.items() if not used) == [
            "never.bias", "never.weight"]  # fmt: skip
        assert grads["once.bias"][1].abs().sum() > 0
        assert not grads["zero.weight"][1].any()
    assert all(torch.equal(results[0][n][1], results[1][n][1]) for n in results[0])


def test_backward_outside_the_microbatches_is_refused():
    model = make_model()
    exact = ExactStep(list(model.parameters()), BufferSync(model), MICROBATCHES)
    exact.begin()
    with pytest.raises(UsageError, match=r"step\.microbatches\(\)"):
        exact.took(-1, 0.0, 1)


def test_a_gradient_clipped_between_backward_and_commit_is_refused():
    """Exact mode leaves zero gradients between microbatches, not none, so
    that clipping there (which would clip nothing) is seen, as in default
    mode."""
    model = make_model()
    params = list(model.parameters())
    exact = ExactStep(params, BufferSync(model), MICROBATCHES)
    watch = GradientWatch(params)
    exact.begin()
    exact.start()
    inputs, targets = batch(0)
    torch.nn.functional.cross_entropy(model(inputs), targets, reduction="sum").backward()
    exact.took(0, 1.0, len(targets))
    watch.mark()
    watch.check()  # untouched: fine
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    with pytest.raises(UsageError, match="before_update"):
        watch.check()


@pytest.mark.parametrize("shift", [-100, -1, 0, 30, 69, 127, 128, 200])
def testfixed_point_in_float32_is_the_same_integer_as_through_float64(shift: int):
    generator = torch.Generator().manual_seed(shift + 1000)
    values = torch.randn(4096, generator=generator) * torch.logspace(-40, 30, 4096)
    values[:4] = torch.tensor([0.0, -0.0, 1e-45, -3e-39])  # zeros and subnormals
    values = values.to(torch.float32)
    magnitude = float(values.abs().max()) * 2.0**shift
    if magnitude >= 2.0**62:
        values = values / 2.0 ** (math.log2(magnitude) - 61)  # keep it within int64
    through_float64 = torch.round(values.to(torch.float64) * 2.0**shift).to(torch.int64)
    assert torch.equal(fixed_point(values, shift), through_float64)


def test_the_fingerprint_of_exact_mode_names_what_the_bits_depend_on():
    from rollcall.membership.fingerprint import JobFingerprint
    from rollcall.worker.exact import fingerprint_value

    assert fingerprint_value(False) == "false"
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fingerprint_value(True)
        torch.set_num_threads(2)
        two = fingerprint_value(True)
    finally:
        torch.set_num_threads(before)
    assert one.startswith("true (torch ") and "1 intra-op threads" in one
    assert one != two  # workers with other thread counts are refused at join
    JobFingerprint.of({"exact": one})  # a valid field value


@pytest.mark.integration
def test_the_fingerprint_of_exact_mode_names_the_cpu_kernels_torch_picked():
    # torch picks its CPU kernels by the instruction set (AVX512, AVX2, or
    # plain code; ATEN_CPU_CAPABILITY lowers it), and they round
    # differently: a conv's gradient bits differ between AVX512 and AVX2
    # here. At 8183c1c a worker on a host of another kind (or with the
    # variable set) had the same fingerprint, was admitted to an exact job,
    # and its microbatches computed other bits with no word.
    import os
    import subprocess
    import sys

    def field(capability: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if capability is not None:
            env["ATEN_CPU_CAPABILITY"] = capability
        code = "from rollcall.worker.exact import fingerprint_value; print(fingerprint_value(True))"
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120, check=True)  # fmt: skip
        return done.stdout.strip()

    native = field(None)
    assert torch.backends.cpu.get_cpu_capability() != "DEFAULT", "this test needs AVX2 or better"
    lowered = field("default")
    assert f"CPU {torch.backends.cpu.get_cpu_capability()}" in native, native
    assert "CPU DEFAULT" in lowered and lowered != native, lowered


def test_the_fingerprint_of_exact_mode_names_numeric_settings_other_than_torchs_defaults():
    # A worker started with another float32 matmul precision, deterministic
    # algorithms or oneDNN switched off (a flag or an environment variable of
    # one host) computes other bits: at 1cecc27 its fingerprint was the same,
    # so it was admitted and the job's exactness broke with no word.
    from rollcall.membership.fingerprint import JobFingerprint
    from rollcall.worker.exact import fingerprint_value

    default = fingerprint_value(True)
    assert default.count(",") == 3, default  # torch, threads, machine, CPU kernels
    precision = torch.get_float32_matmul_precision()
    deterministic = torch.are_deterministic_algorithms_enabled()
    onednn = torch.backends.mkldnn.enabled
    try:
        torch.set_float32_matmul_precision("medium")
        torch.use_deterministic_algorithms(True)
        torch.backends.mkldnn.enabled = False
        changed = fingerprint_value(True)
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.use_deterministic_algorithms(deterministic)
        torch.backends.mkldnn.enabled = onednn
    assert changed.startswith(default[:-1] + ", ")
    for words in ("float32 matmul precision medium", "deterministic algorithms",
                  "oneDNN off"):  # fmt: skip
        assert words in changed, changed
    JobFingerprint.of({"exact": changed})  # a valid field value
    assert fingerprint_value(True) == default


@pytest.mark.parametrize(
    ("tags", "agreed"),
    [((7, 7, 7), True), ((7, None, 7), True), ((None, None, None), True),
     ((7, 9, 7), False), ((0, None, 65535), False)],
)  # fmt: skip
def test_the_ranks_settings_tags_ride_on_the_max_and_every_rank_reads_one_verdict(
    tags: tuple[int | None, ...], agreed: bool
) -> None:
    base = make_model()
    reduce = Collective(len(tags))
    verdicts: list[bool] = []

    def rank(i: int) -> None:
        model = copy.deepcopy(base)
        exact = ExactStep(list(model.parameters()), BufferSync(model), MICROBATCHES)
        exact.begin()
        exact.start()
        inputs, targets = batch(i)
        loss = torch.nn.functional.cross_entropy(model(inputs), targets, reduction="sum")
        loss.backward()
        exact.took(i, float(loss.detach()), len(targets))
        reduced = exact.reduce(reduce, also_max=Agreement.max_terms(tags[i]))
        verdicts.append(Agreement.agreed_maxima(*reduced.also_max))
        assert reduced.count == 5 * len(tags)  # the step itself reduced as ever

    on_ranks(rank, len(tags))
    assert verdicts == [agreed] * len(tags)
