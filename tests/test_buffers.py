"""BatchNorm running statistics kept identical across replicas: two replicas
that ran different microbatches end a step with the same buffers, the
combination is the microbatch-weighted average of their changes, counters add
up, untouched buffers keep their bits, and an aborted step leaves no trace."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rollcall.worker.buffers import BufferSync


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1))


def _forward(model: nn.Module, batches: list[torch.Tensor]) -> None:
    for batch in batches:
        model(batch)


def _step(replicas: list[nn.Module], shares: list[list[torch.Tensor]], total: int) -> None:
    """One step of a view whose ranks are ``replicas``: forward, contribute,
    sum (the all-reduce), apply."""
    syncs = [model.sync for model in replicas]
    for model, share in zip(replicas, shares, strict=True):
        _forward(model, share)
    parts = [
        sync.contributions(len(share), torch.float32)
        for sync, share in zip(syncs, shares, strict=True)
    ]
    summed = [torch.stack([p[i] for p in parts]).sum(0) for i in range(len(parts[0]))]
    for sync in syncs:
        sync.apply(summed, total)


def _replicas(count: int) -> list[nn.Module]:
    base = _net()
    replicas = [copy.deepcopy(base) for _ in range(count)]
    for model in replicas:
        model.train()
        model.sync = BufferSync(model)  # type: ignore[assignment]
    return replicas


def _batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(5, 3, generator=generator) * (i + 1) for i in range(count)]


def test_replicas_that_ran_different_microbatches_end_with_identical_buffers() -> None:
    replicas = _replicas(3)
    batches = _batches(6)
    _step(replicas, [batches[0:3], batches[3:5], batches[5:6]], total=6)
    first = replicas[0].state_dict()
    for other in replicas[1:]:
        for name, value in other.state_dict().items():
            assert torch.equal(value, first[name]), name


def test_running_statistics_move_by_the_microbatch_weighted_average() -> None:
    replicas = _replicas(2)
    before = replicas[0][1].running_mean.clone()
    batches = _batches(3)
    alone = [copy.deepcopy(replicas[0]) for _ in range(2)]
    _forward(alone[0], batches[0:2])
    _forward(alone[1], batches[2:3])
    expected = (
        before
        + (2 * (alone[0][1].running_mean - before) + 1 * (alone[1][1].running_mean - before)) / 3
    )
    _step(replicas, [batches[0:2], batches[2:3]], total=3)
    assert torch.allclose(replicas[0][1].running_mean, expected, atol=1e-6)


def test_counters_add_up_to_what_one_process_would_count() -> None:
    replicas = _replicas(3)
    batches = _batches(4)
    _step(replicas, [batches[0:2], batches[2:3], batches[3:4]], total=4)
    assert all(int(r[1].num_batches_tracked) == 4 for r in replicas)


def test_a_buffer_no_rank_changed_keeps_its_exact_bits() -> None:
    replicas = _replicas(2)
    for model in replicas:
        model.eval()  # BatchNorm in eval mode updates nothing
    before = replicas[0][1].running_var.clone()
    _step(replicas, [_batches(2)[0:1], _batches(2)[1:2]], total=2)
    assert torch.equal(replicas[0][1].running_var, before)


def test_a_rank_without_microbatches_changes_nothing() -> None:
    replicas = _replicas(2)
    batches = _batches(2)
    alone = copy.deepcopy(replicas[0])
    _forward(alone, batches)
    _step(replicas, [batches, []], total=2)
    assert torch.allclose(replicas[1][1].running_mean, alone[1].running_mean, atol=1e-6)


def test_rollback_undoes_an_uncommitted_steps_forward_passes() -> None:
    model = _replicas(1)[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _forward(model, _batches(3))
    model.sync.rollback()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_committed_state_is_the_last_commit_whatever_a_step_in_flight_did() -> None:
    model = _replicas(1)[0]
    before = model.sync.committed_state()
    _forward(model, _batches(2))
    assert all(torch.equal(v, before[k]) for k, v in model.sync.committed_state().items())
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])


def test_a_boolean_buffer_is_refused_with_the_way_out() -> None:
    model = nn.Module()
    model.register_buffer("mask", torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="sync_buffers=False"):
        BufferSync(model)
