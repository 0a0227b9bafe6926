"""Sharded optimizer state with spare copies (ZeRO stage 1, redundancy r):
each rank keeps the optimizer state of the partitions a ``ShardPlan`` gives
it, and only those (``docs/sharding.md``).

After the gradients are reduced (every rank holds the same sum, as in
replicated mode), every owner of a partition runs the user's optimizer
update on that partition: the update is element-wise and deterministic, so
the ``r`` copies of a partition's state stay identical without ever being
sent. Then the new parameters travel: one all-gather in which each rank
sends the partitions it is the first owner of, so that every rank holds
the whole model for the next forward pass. Nothing is summed on the way, so
the parameters are the bits their owner computed.

The state space is the flat concatenation of the parameters of every
parameter group in order; partition ``p`` is the range
``partition_bounds(numel, count)[p]`` of it, cut at group boundaries into
segments. Each segment is a leaf tensor of this rank's own optimizer (the
user's optimizer class, with the hyperparameters of the segment's group),
so Adam's moments exist for owned elements only.

Refused (``UsageError``): optimizers other than SGD, Adam and AdamW (with
any of their options but ``differentiable``), because LAMB, LARS,
Adafactor and their kind use per-tensor quantities, so updating a flat
range of their parameters would not be their update, and an unknown
optimizer might; complex or sparse parameters; parameters of more than one
dtype or device; an optimizer that already holds state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollcall.membership.errors import UsageError
from rollcall.membership.shards import ShardPlan, partition_bounds

__all__ = ["ELEMENTWISE", "Segment", "ShardedOptimizer", "state_bytes"]

#: Optimizers whose update of one element depends on that element's
#: parameter, gradient and state alone.
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
)

#: all_gather over the view's group: this rank's tensor in, every rank's
#: tensor (in rank order) out.
Gather = Callable[[torch.Tensor], list[torch.Tensor]]


@dataclass(frozen=True)
class Segment:
    """The part of partition ``partition`` inside parameter group ``group``:
    the flat range ``[start, stop)`` of the whole state space."""

    partition: int
    group: int
    start: int
    stop: int


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer``'s state."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def _check(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    if type(optimizer) not in ELEMENTWISE:
        allowed = ", ".join(t.__name__ for t in ELEMENTWISE)
        raise UsageError(
            f"sharded optimizer state supports {allowed} (updates that are element-wise); "
            f"{type(optimizer).__name__} may use per-tensor quantities, so updating a "
            "flat range of its parameters would not be its update: train it replicated"
        )
    groups = [list(group["params"]) for group in optimizer.param_groups]
    params = [p for group in groups for p in group]
    if not params:
        raise UsageError("sharded optimizer state: the optimizer has no parameters")
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        raise UsageError(
            "sharded optimizer state needs every parameter of one dtype and device, got "
            + ", ".join(sorted(f"{d} on {v}" for d, v in kinds))
        )
    for p in params:
        if p.is_complex() or p.is_sparse:
            raise UsageError("sharded optimizer state: complex and sparse parameters are refused")
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            raise UsageError("sharded optimizer state: differentiable=True is refused")
    if optimizer.state:
        raise UsageError(
            "sharded optimizer state: the optimizer already holds state (it has stepped); "
            "shard it before the first step"
        )
    return groups


class ShardedOptimizer:
    """This rank's part of the optimizer state under ``plan``.

    ``optimizer`` is the user's, never stepped: its class and each group's
    hyperparameters are used to build this rank's own optimizer over the
    segments it owns; the user's optimizer itself keeps no state.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, plan: ShardPlan, me: str) -> None:
        self._groups = _check(optimizer)
        self._template = optimizer
        self._plan = plan
        self._me = me
        first = self._groups[0][0]
        self._dtype, self._device = first.dtype, first.device
        sizes = [sum(p.numel() for p in group) for group in self._groups]
        self.numel = sum(sizes)
        self._group_starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self._bounds = partition_bounds(self.numel, plan.count)
        self.segments = self._cut(sizes)
        self._owned = set(plan.owned_by(me))
        self._local, self._leaves = self._build()

    def _cut(self, sizes: Sequence[int]) -> tuple[Segment, ...]:
        """Every partition's segments, cut at group boundaries."""
        segments = []
        for p, (start, stop) in enumerate(self._bounds):
            for g, size in enumerate(sizes):
                lo, hi = self._group_starts[g], self._group_starts[g] + size
                a, b = max(start, lo), min(stop, hi)
                if a < b:
                    segments.append(Segment(p, g, a, b))
        return tuple(segments)

    def _build(self) -> tuple[torch.optim.Optimizer | None, dict[Segment, torch.Tensor]]:
        flat = self._flat_params()
        leaves: dict[Segment, torch.Tensor] = {}
        groups: list[dict[str, Any]] = []
        for g, group in enumerate(self._template.param_groups):
            mine = [s for s in self.segments if s.group == g and s.partition in self._owned]
            if not mine:
                continue
            tensors = []
            for segment in mine:
                leaf = flat[segment.start : segment.stop].clone().requires_grad_(True)
                leaves[segment] = leaf
                tensors.append(leaf)
            settings = {k: v for k, v in group.items() if k != "params"}
            groups.append({"params": tensors, **settings})
        if not groups:
            return None, leaves
        # Each group carries all its settings: the constructor's defaults are unused.
        kind: Any = type(self._template)
        return kind(groups), leaves

    def _flat_params(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1) for g in self._groups for p in g])

    def _flat_grads(self) -> torch.Tensor:
        parts = []
        for group in self._groups:
            for p in group:
                grad = p.grad
                parts.append(
                    torch.zeros(p.numel(), dtype=self._dtype, device=self._device)
                    if grad is None
                    else grad.detach().reshape(-1)
                )
        return torch.cat(parts)

    @property
    def owned(self) -> tuple[int, ...]:
        return tuple(sorted(self._owned))

    @property
    def tensors(self) -> int:
        """How many tensors (segments) this rank's optimizer updates."""
        return len(self._leaves)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return 0 if self._local is None else state_bytes(self._local)

    def step(self, gather: Gather, ranks: Sequence[str]) -> None:
        """Update the owned partitions from the parameters' (reduced)
        ``.grad`` and give every rank the new parameters: ``gather`` is an
        all-gather over the members ``ranks`` (the view, in rank order)."""
        if self._local is not None:
            grads = self._flat_grads()
            for segment, leaf in self._leaves.items():
                leaf.grad = grads[segment.start : segment.stop].clone()
            self._local.step()
        self._distribute(gather, ranks)

    def _distribute(self, gather: Gather, ranks: Sequence[str]) -> None:
        """Each rank sends the partitions it is the first live owner of,
        padded to the longest such list; all write them into the model."""
        alive = set(ranks)
        sender = {
            p: next(m for m in owners if m in alive) for p, owners in enumerate(self._plan.owners)
        }
        sends = {m: [p for p in range(self._plan.count) if sender[p] == m] for m in ranks}
        width = max(sum(self._size(p) for p in ps) for ps in sends.values())
        payload = torch.zeros(width, dtype=self._dtype, device=self._device)
        offset = 0
        for p in sends[self._me]:
            for segment in self._of(p):
                leaf = self._leaves[segment]
                payload[offset : offset + leaf.numel()] = leaf.detach()
                offset += leaf.numel()
        received = gather(payload)
        flat = torch.empty(self.numel, dtype=self._dtype, device=self._device)
        for member, tensor in zip(ranks, received, strict=True):
            offset = 0
            for p in sends[member]:
                start, stop = self._bounds[p]
                flat[start:stop] = tensor[offset : offset + stop - start]
                offset += stop - start
        with torch.no_grad():
            offset = 0
            for group in self._groups:
                for param in group:
                    param.copy_(flat[offset : offset + param.numel()].view_as(param))
                    offset += param.numel()

    def _size(self, partition: int) -> int:
        start, stop = self._bounds[partition]
        return stop - start

    def _of(self, partition: int) -> list[Segment]:
        return [s for s in self.segments if s.partition == partition]
