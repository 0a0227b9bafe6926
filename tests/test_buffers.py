"""BatchNorm running statistics kept identical across replicas: two replicas
that ran different microbatches end a step with the same buffers, the
combination is the microbatch-weighted average of their changes, counters add
up, untouched buffers keep their bits, and an aborted step leaves no trace."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rollcall.membership.errors import UsageError
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


class _Centred(nn.Module):
    """Centres its input by a running mean it updates in the forward pass:
    in place, or by assigning a new tensor (``self.mean = 0.9 * self.mean +
    ...``, as custom layers often do), or kept out of the state
    (``persistent=False``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("mean", torch.zeros(3), persistent=how != "unsaved")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.how == "assign":
                self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
            else:
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.mean


def _centred(how: str, count: int) -> list[nn.Module]:
    replicas = [nn.Sequential(_Centred(how)) for _ in range(count)]
    for model in replicas:
        model.sync = BufferSync(model)  # type: ignore[assignment]
    return replicas


def test_a_buffer_the_forward_pass_replaces_is_kept_identical_as_one_changed_in_place() -> None:
    # At 0785841 the runtime kept the tensor the model held at construction:
    # a buffer assigned anew in each forward pass was never summed, and each
    # replica's followed its own microbatches (silently, until a drift check).
    batches = _batches(3)
    assigned, in_place = _centred("assign", 2), _centred("in_place", 2)
    for replicas in (assigned, in_place):
        _step(replicas, [batches[0:2], batches[2:3]], total=3)
    values = [model[0].mean for model in assigned]
    assert torch.equal(values[0], values[1])
    assert torch.allclose(values[0], in_place[0][0].mean, atol=1e-7)
    assert not torch.equal(values[0], torch.zeros(3))
    model = assigned[0]
    _forward(model, batches)
    model.sync.rollback()  # an aborted step: back to the committed value
    assert torch.equal(model[0].mean, values[1])


def test_a_buffer_replaced_by_one_of_another_shape_is_refused_naming_it() -> None:
    model = _centred("assign", 1)[0]
    model[0].mean = torch.zeros(4)
    replaced = r"buffer 0.mean was replaced by .*shape \[4\] \(it was .*shape \[3\]"
    with pytest.raises(UsageError, match=replaced):
        model.sync.contributions(1, torch.float32)


def test_a_buffer_kept_out_of_the_state_and_changed_in_place_is_refused_naming_it() -> None:
    # A running statistic registered with persistent=False: not in the state
    # a joiner or a checkpoint gets, and not kept identical across replicas.
    model = _centred("unsaved", 1)[0]
    model.sync.contributions(1, torch.float32)  # unchanged: nothing to say
    _forward(model, _batches(1))
    with pytest.raises(UsageError, match=r"buffer 0.mean is not persistent .*changed in place"):
        model.sync.contributions(1, torch.float32)
    with pytest.raises(UsageError, match="register it persistent"):
        model.sync.current()  # exact mode's path
