"""Gradient reduction overlapped with the backward pass (worker/overlap.py)
on real gloo groups in real processes: the gradients are views into their
buckets, a bucket's all-reduce starts during the last backward pass as soon
as it and those before it are done, the sums equal those of the flat
all-reduce after backward, and a second backward pass of the last
microbatch is refused before it adds to sums under way. Every member is a
"spawn" child (tests/test_group.py's Members)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from rollcall.membership.errors import UsageError
from rollcall.worker.overlap import Buckets
from tests.test_group import START_BOUND, Channels, Members, _join_epoch, _started, members

pytestmark = pytest.mark.integration  # starts processes

__all__ = ["members"]  # the fixture, imported for this module's tests


def _model(rank: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 4),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(100 + rank)
    return model, torch.randn(16, 32, generator=generator), torch.randn(16, 4, generator=generator)


def _overlapped(channels: Channels, rank: int, size: int) -> None:
    _started(channels, rank)
    group = _join_epoch(1, rank, size, channels.ports, threading.Event())
    model, x, y = _model(rank)
    params = list(model.parameters())
    # Small buckets (about one layer each), so that several start during backward.
    buckets = Buckets(params, cap_bytes=64 * 65 * 4)
    buckets.attach()
    started_in_backward: list[int] = []

    def launch(buffer: torch.Tensor) -> Any:
        started_in_backward.append(buffer.numel())
        return group.start_allreduce_sum(buffer)

    # Two microbatches: the first accumulates, the second is the last.
    torch.nn.functional.mse_loss(model(x[:8]), y[:8], reduction="sum").backward()
    # Every gradient lives in its bucket: as many storages as buckets.
    views = len({p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None})
    buckets.arm(launch)
    torch.nn.functional.mse_loss(model(x[8:]), y[8:], reduction="sum").backward()
    during = len(started_in_backward)
    pending = buckets.flush(launch)
    buckets.check_views()
    refused = ""
    try:
        buckets.arm(launch)
    except UsageError as exc:
        refused = str(exc)
    group.finish(pending)
    overlapped = [p.grad.clone() for p in params]

    # The reference: the same gradients, all-reduced flat after backward.
    reference, x, y = _model(rank)
    torch.nn.functional.mse_loss(reference(x[:8]), y[:8], reduction="sum").backward()
    torch.nn.functional.mse_loss(reference(x[8:]), y[8:], reduction="sum").backward()
    flat = [p.grad for p in reference.parameters()]
    group.allreduce_sum(flat)
    group.close()
    channels.reports.put({
        "rank": rank,
        "equal": all(torch.equal(a, b) for a, b in zip(overlapped, flat, strict=True)),
        "buckets": buckets.count, "started_in_backward": during, "views": views,
        "refused": refused,
    })  # fmt: skip


def test_buckets_start_during_the_last_backward_pass_and_sum_what_a_flat_all_reduce_does(
    members: Members,
) -> None:
    processes = members.start(_overlapped, [0, 1], 2)
    results = members.collect(2, "equal")
    for result in results:
        assert result["equal"], "the overlapped sums differ from the flat all-reduce's"
        assert result["buckets"] >= 3
        assert result["views"] == result["buckets"]
        # The hooks started buckets before backward returned (the last
        # bucket holds the first layer, which backward reaches last).
        assert 1 <= result["started_in_backward"] <= result["buckets"]
        assert "once per microbatch" in result["refused"]
    assert members.exit_codes(processes, START_BOUND) == [0, 0]
