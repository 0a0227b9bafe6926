"""Elastic's sharding options are checked before anything starts: bad
values, a grad scaler and optimizers whose update is not element-wise are
refused with what to do instead."""

from __future__ import annotations

import pytest
import torch

from rollcall.membership.errors import UsageError
from rollcall.membership.shards import Sharding
from rollcall.worker.contract import ShardedStateGuard
from rollcall.worker.runtime import _check_sharding


def _adamw() -> torch.optim.Optimizer:
    return torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=1e-3)


def test_replicated_by_default_and_the_setting_when_asked() -> None:
    assert _check_sharding(None, 64, _adamw(), None) is None
    assert _check_sharding(2, 16, _adamw(), None) == Sharding(16, 2)


@pytest.mark.parametrize("redundancy, partitions", [(0, 64), (True, 64), (2, 0), (2, 1.5)])
def test_bad_values_are_refused(redundancy: object, partitions: object) -> None:
    with pytest.raises(ValueError, match="must be an int >= 1"):
        _check_sharding(redundancy, partitions, _adamw(), None)  # type: ignore[arg-type]


def test_a_grad_scaler_is_refused() -> None:
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(UsageError, match="grad scaler"):
        _check_sharding(2, 64, _adamw(), scaler)


def test_an_optimizer_whose_update_is_not_element_wise_is_refused() -> None:
    lbfgs = torch.optim.LBFGS(torch.nn.Linear(3, 2).parameters())
    with pytest.raises(UsageError, match="train it replicated"):
        _check_sharding(2, 64, lbfgs, None)


def test_the_users_optimizer_state_dict_is_refused_outside_the_runtime() -> None:
    optimizer = _adamw()
    guard = ShardedStateGuard(optimizer)
    with pytest.raises(UsageError, match="silently restart the moments"):
        optimizer.state_dict()
    with guard.allowed():
        saved = optimizer.state_dict()
    with pytest.raises(UsageError, match="would be ignored"):
        optimizer.load_state_dict(saved)
    guard.release()
    optimizer.load_state_dict(optimizer.state_dict())
