"""Gradient reduction overlapped with the backward pass (worker/overlap.py)
on real gloo groups in real processes: the gradients are views into their
buckets, a bucket's all-reduce starts during the last backward pass as soon
as it and those before it are done, the sums equal those of the flat
all-reduce after backward, a second backward pass of the last
microbatch is refused before it adds to sums under way, and a parameter
accumulated more than once within one pass (reentrant checkpointing) is
summed whole or refused. Every member is a "spawn" child
(tests/test_group.py's Members)."""

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

    # Two microbatches: the first accumulates, the second is the last (the
    # worker's first pass starts nothing before it returns).
    torch.nn.functional.mse_loss(model(x[:8]), y[:8], reduction="sum").backward()
    buckets.passed()
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


class _Reused(torch.nn.Module):
    """One block run twice, each time under reentrant checkpointing
    (``torch.utils.checkpoint(..., use_reentrant=True)``, the default of
    many model libraries' "gradient checkpointing"): each run's backward is
    a backward pass of its own, so the block's parameters accumulate their
    gradient twice in one ``loss.backward()`` (DDP refuses that: "mark a
    variable ready only once")."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(32, 64)
        self.block = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 4)

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.block(h))

    def forward(self, x: torch.Tensor, runs: int) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(runs):
            h = torch.utils.checkpoint.checkpoint(self._block, h, use_reentrant=True)
        return self.out(h)


def _reused(channels: Channels, rank: int, size: int, runs: list[int], idle: bool) -> None:
    """Backward passes of ``_Reused`` run ``runs[i]`` times in microbatch i,
    the last pass armed, with buckets of about one layer each (the block's
    parameters are done after the first of its runs' backward passes);
    ``idle``: after a step in which the rank ran no microbatch (a joiner's
    first, while it fetches), its buckets started at commit."""
    _started(channels, rank)
    group = _join_epoch(1, rank, size, channels.ports, threading.Event())
    generator = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(8 * len(runs), 32, generator=generator), torch.randn(8 * len(runs), 4)

    def loss(model: _Reused, i: int) -> torch.Tensor:
        part = slice(8 * i, 8 * i + 8)
        return torch.nn.functional.mse_loss(model(x[part], runs[i]), y[part], reduction="sum")

    model = _Reused()
    params = list(model.parameters())
    buckets = Buckets(params, cap_bytes=64 * 65 * 4, names=[n for n, _ in model.named_parameters()])
    if idle:
        buckets.attach()
        group.finish(buckets.flush(group.start_allreduce_sum))
    buckets.attach()
    refused, pending = "", []
    try:
        for i in range(len(runs) - 1):
            loss(model, i).backward()
            buckets.passed()
        buckets.arm(group.start_allreduce_sum)
        loss(model, len(runs) - 1).backward()
    except UsageError as exc:
        refused = str(exc)
    pending = buckets.flush(group.start_allreduce_sum)
    buckets.passed()
    group.finish(pending)
    overlapped = [p.grad.clone() for p in params]

    reference = _Reused()
    for i in range(len(runs)):
        loss(reference, i).backward()
    flat = [p.grad for p in reference.parameters()]
    group.allreduce_sum(flat)
    group.close()
    channels.reports.put({
        "rank": rank, "refused": refused,
        "equal": all(torch.equal(a, b) for a, b in zip(overlapped, flat, strict=True)),
    })  # fmt: skip


@pytest.mark.parametrize(
    ("runs", "idle"),
    [([2], False), ([2], True), ([2, 2], False)],
    ids=["the worker's first pass", "the first after an idle step",
         "a repeat seen in an earlier pass"],
)  # fmt: skip
def test_a_parameter_accumulated_twice_in_one_backward_pass_is_reduced_whole(
    members: Members, runs: list[int], idle: bool
) -> None:
    # Started as soon as the block's first backward pass is done, its
    # buckets would be summed while the second adds to them: each rank's
    # gradient would miss the others' second part. The worker's first pass
    # starts every bucket after backward returns; later passes hold back
    # the buckets of parameters an earlier pass accumulated twice.
    processes = members.start(_reused, [0, 1], 2, runs, idle)
    for result in members.collect(2, "equal"):
        assert result["refused"] == ""
        assert result["equal"], "the overlapped sums differ from the flat all-reduce's"
    assert members.exit_codes(processes, START_BOUND) == [0, 0]


def test_a_parameter_accumulated_again_after_its_bucket_started_is_refused(
    members: Members,
) -> None:
    # The first pass runs the block once (nothing repeats), the last twice:
    # its bucket is under way when the second run's backward adds to it,
    # which the runtime cannot undo. Refused, naming the parameter and what to do.
    processes = members.start(_reused, [0, 1], 2, [1, 2], False)
    for result in members.collect(2, "equal"):
        assert "block.weight" in result["refused"] or "block.bias" in result["refused"]
        assert "use_reentrant=False" in result["refused"], result["refused"]
        assert "accumulated again after its bucket's all-reduce" in result["refused"]
    assert members.exit_codes(processes, START_BOUND) == [0, 0]
