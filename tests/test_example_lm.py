"""The built-in example job: its corpus, model, summed loss and seeding."""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Iterator

import pytest
import torch

from rollcall.worker.examples.lm import (
    VOCAB_SIZE,
    CharCorpus,
    CharTransformer,
    LMConfig,
    build,
    loss_sum,
)

CONFIG = LMConfig()
MICRO_BATCH = 8


@pytest.fixture(scope="module")
def corpus() -> CharCorpus:
    return CharCorpus(CONFIG)


def batch(corpus: CharCorpus, size: int = MICRO_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    samples = [corpus[i] for i in range(size)]
    return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_corpus_is_the_same_text_every_time(corpus: CharCorpus) -> None:
    again = CharCorpus(CONFIG)

    assert again.fingerprint == corpus.fingerprint
    assert len(again) == len(corpus)
    assert torch.equal(again[len(again) - 1][0], corpus[len(corpus) - 1][0])


def test_corpus_is_real_text_of_the_configured_size(corpus: CharCorpus) -> None:
    assert corpus.num_bytes > 100_000
    assert corpus.num_bytes <= CONFIG.corpus_bytes
    assert len(corpus) == corpus.num_bytes // (CONFIG.context + 1)


def test_corpus_size_follows_the_byte_cap() -> None:
    small = CharCorpus(LMConfig(corpus_bytes=10_000))

    assert small.num_bytes == 10_000


def test_sample_is_context_bytes_and_targets_are_inputs_shifted_by_one(
    corpus: CharCorpus,
) -> None:
    inputs, targets = corpus[3]

    assert inputs.shape == targets.shape == (CONFIG.context,)
    assert inputs.dtype == targets.dtype == torch.long
    assert torch.equal(inputs[1:], targets[:-1])
    assert 0 <= int(inputs.min()) and int(inputs.max()) < VOCAB_SIZE


def test_samples_tile_the_text_without_gap_or_overlap() -> None:
    tiny = LMConfig(corpus_bytes=10 * (CONFIG.context + 1))
    corpus = CharCorpus(tiny)

    chunks = [torch.cat([corpus[i][0][:1], corpus[i][1]]) for i in range(len(corpus))]
    text = bytes(torch.cat(chunks).to(torch.uint8).tolist())

    assert len(corpus) == 10
    assert hashlib.sha256(text).hexdigest() == corpus.fingerprint
    assert b"import " in text  # Python source, not noise


def test_index_past_the_end_raises_index_error(corpus: CharCorpus) -> None:
    with pytest.raises(IndexError):
        corpus[len(corpus)]


def test_model_outputs_logits_over_bytes_at_every_position(corpus: CharCorpus) -> None:
    model = CharTransformer(CONFIG)
    inputs, _ = batch(corpus)

    assert model(inputs).shape == (MICRO_BATCH, CONFIG.context, VOCAB_SIZE)


def test_model_is_causal(corpus: CharCorpus) -> None:
    model = CharTransformer(CONFIG).eval()
    inputs, _ = batch(corpus, 2)
    changed = inputs.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % VOCAB_SIZE

    with torch.no_grad():
        before, after = model(inputs), model(changed)

    torch.testing.assert_close(before[:, :40], after[:, :40])
    assert not torch.allclose(before[:, 40:], after[:, 40:])


def test_loss_sum_is_mean_times_token_count(corpus: CharCorpus) -> None:
    model = CharTransformer(CONFIG).eval()
    inputs, targets = batch(corpus)

    with torch.no_grad():
        total, count = loss_sum(model, inputs, targets)
        mean = torch.nn.functional.cross_entropy(
            model(inputs).reshape(-1, VOCAB_SIZE), targets.reshape(-1)
        )

    assert count == MICRO_BATCH * CONFIG.context
    torch.testing.assert_close(total, mean * count)


def test_a_few_optimizer_steps_on_a_fixed_batch_reduce_the_loss(corpus: CharCorpus) -> None:
    model, optimizer, _ = build(CONFIG, seed=0)
    inputs, targets = batch(corpus)
    losses = []

    for step in range(10):
        torch.manual_seed(step)
        optimizer.zero_grad()
        total, count = loss_sum(model, inputs, targets)
        (total / count).backward()
        optimizer.step()
        losses.append(total.item() / count)

    assert losses[-1] < losses[0] - 0.5, losses


def test_build_uses_adamw_at_the_documented_learning_rate() -> None:
    _, optimizer, _ = build(CONFIG, seed=0)

    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.param_groups[0]["lr"] == CONFIG.lr == 3e-3


def test_same_seed_builds_identical_models() -> None:
    first, _, _ = build(CONFIG, seed=7)
    torch.manual_seed(12345)  # whatever the global RNG did in between
    second, _, _ = build(CONFIG, seed=7)

    for (name, a), (_, b) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_different_seeds_build_different_models() -> None:
    first, _, _ = build(CONFIG, seed=1)
    second, _, _ = build(CONFIG, seed=2)

    assert not torch.equal(first.head.weight, second.head.weight)


def test_dropout_is_reproducible_from_the_global_seed(corpus: CharCorpus) -> None:
    model = CharTransformer(CONFIG).train()
    inputs, _ = batch(corpus)

    torch.manual_seed(42)
    first = model(inputs)
    torch.manual_seed(42)
    second = model(inputs)
    torch.manual_seed(43)
    other = model(inputs)

    assert torch.equal(first, second)
    assert not torch.equal(first, other)


def test_one_micro_batch_forward_backward_is_fast_on_one_thread(
    corpus: CharCorpus, one_thread: None
) -> None:
    model, _, _ = build(CONFIG, seed=0)
    inputs, targets = batch(corpus)

    def forward_backward() -> float:
        start = time.perf_counter()
        total, _ = loss_sum(model, inputs, targets)
        total.backward()
        return time.perf_counter() - start

    forward_backward()  # warm-up: first call allocates and picks kernels
    times = [forward_backward() for _ in range(20)]
    median = statistics.median(times)
    print(
        f"\nforward+backward, micro-batch {MICRO_BATCH}, context {CONFIG.context}, 1 thread: "
        f"median {median * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms, "
        f"max {max(times) * 1e3:.1f} ms"
    )

    # Four workers on two cores get half a core each; several steps per second
    # leaves each worker well over 100 ms of one core per step.
    assert median < 0.1
