"""Sharded optimizer state with spare copies (ZeRO stage 1, redundancy r):
each rank keeps the optimizer state of the partitions a ``ShardPlan`` gives
it, and only those (``docs/sharding.md``).

After the gradients are reduced (every rank holds the same sum, as in
replicated mode), every owner of a partition runs the user's optimizer
update on that partition: the update is element-wise and deterministic, so
the ``r`` copies of a partition's state stay identical without ever being
sent. Then the new parameters travel: one all-gather in which each partition is sent
by one of its owners (the one sending least so far), so that every rank
holds the whole model for the next forward pass. Nothing is summed on the way, so
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

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollcall.membership.errors import UsageError
from rollcall.membership.shards import ShardPlan, partition_bounds

__all__ = [
    "ELEMENTWISE",
    "LAYOUT_KEY",
    "PartitionState",
    "Segment",
    "ShardLayout",
    "ShardLost",
    "ShardedOptimizer",
    "assemble_state",
    "check_shardable",
    "state_bytes",
]

#: The key of a sharded checkpoint's layout in its optimizer entry, which
#: holds no state (its parts do): ``{"state": {}, "param_groups": ...,
#: LAYOUT_KEY: ...}``.
LAYOUT_KEY = "rollcall_shard_layout"

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


@dataclass(frozen=True)
class ShardLayout:
    """Where the partitions lie: their count and the shape of every
    parameter, group by group, in the optimizer's order. The state space is
    the flat concatenation of those parameters; partition ``p`` is the range
    ``partition_bounds(numel, count)[p]`` of it, cut at group boundaries into
    segments. A sharded checkpoint records it, so that its parts can be put
    together into the optimizer's own ``state_dict`` without the model."""

    count: int
    shapes: tuple[tuple[tuple[int, ...], ...], ...]

    @classmethod
    def of(cls, groups: Sequence[Sequence[torch.Tensor]], count: int) -> ShardLayout:
        return cls(count, tuple(tuple(tuple(p.shape) for p in group) for group in groups))

    @property
    def sizes(self) -> list[int]:
        """Elements per group."""
        return [sum(_numel(shape) for shape in group) for group in self.shapes]

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        return partition_bounds(self.numel, self.count)

    def segments(self) -> tuple[Segment, ...]:
        """Every partition's segments, cut at group boundaries."""
        sizes = self.sizes
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        segments = []
        for p, (start, stop) in enumerate(self.bounds):
            for g, size in enumerate(sizes):
                a, b = max(start, starts[g]), min(stop, starts[g] + size)
                if a < b:
                    segments.append(Segment(p, g, a, b))
        return tuple(segments)

    def to_tree(self) -> dict[str, Any]:
        """As plain ints and lists (a replica state's tree)."""
        return {"count": self.count, "shapes": [[list(s) for s in g] for g in self.shapes]}

    @classmethod
    def from_tree(cls, tree: Any) -> ShardLayout:
        """ValueError if ``tree`` is not a layout."""
        try:
            count = tree["count"]
            shapes = tuple(tuple(tuple(int(d) for d in s) for s in g) for g in tree["shapes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a shard layout: {exc}") from None
        if not isinstance(count, int) or count < 1 or not shapes:
            raise ValueError("not a shard layout: no partitions or no parameters")
        return cls(count, shapes)


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def assemble_state(
    layout: ShardLayout, parts: Sequence[PartitionState], param_groups: Any
) -> dict[str, Any]:
    """The optimizer's ``state_dict`` (replicated form: what a replicated
    optimizer, or a sharded one at any world size, loads) from the state of
    every partition (``parts``, one per partition) and the optimizer's
    ``param_groups``. ValueError if a partition is missing or not of its
    shape."""
    by_partition = {part.partition: part for part in parts}
    missing = sorted(set(range(layout.count)) - set(by_partition))
    if missing:
        raise ValueError(f"partitions {missing} are missing from the optimizer state")
    segments = layout.segments()
    flat: dict[str, torch.Tensor] = {}
    #: (group, key) -> a scalar entry, or None for an element-wise one.
    kinds: dict[tuple[int, str], torch.Tensor | None] = {}
    for p in range(layout.count):
        mine = [s for s in segments if s.partition == p]
        if len(mine) != len(by_partition[p].segments):
            raise ValueError(f"partition {p} has {len(by_partition[p].segments)} segments, "
                             f"the layout {len(mine)}")  # fmt: skip
        for segment, state in zip(mine, by_partition[p].segments, strict=True):
            _check_entries(p, segment, state)
            for key, value in state.items():
                if value.dim() == 0:
                    kinds.setdefault((segment.group, key), value)
                    continue
                kinds[(segment.group, key)] = None
                if key not in flat:
                    flat[key] = torch.zeros(layout.numel, dtype=value.dtype)
                flat[key][segment.start : segment.stop] = value
    states: dict[int, dict[str, torch.Tensor]] = {}
    index, offset = 0, 0
    for g, group in enumerate(layout.shapes):
        keys = sorted(k for (gg, k) in kinds if gg == g)
        for shape in group:
            size = _numel(shape)
            entry: dict[str, torch.Tensor] = {}
            for key in keys:
                scalar = kinds[(g, key)]
                if scalar is not None:
                    entry[key] = scalar.clone()
                else:
                    entry[key] = flat[key][offset : offset + size].clone().view(shape)
            if entry:
                states[index] = entry
            index += 1
            offset += size
    return {"state": states, "param_groups": param_groups}


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer``'s state."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def check_shardable(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """The optimizer's parameter groups if its state can be sharded, else
    ``UsageError`` saying why."""
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
    for g, members in enumerate(groups):
        for i, p in enumerate(members):
            if not p.requires_grad:
                raise UsageError(
                    f"sharded optimizer state: parameter {i} of param group {g} has "
                    "requires_grad=False. Replicated, torch skips a parameter without a "
                    "gradient; a sharded update covers every element of its partitions, so this "
                    "one would still change (weight decay, momentum). Give the optimizer only "
                    "the parameters that train, or to freeze some for a while keep them "
                    "trainable in a param group of their own whose lr is 0"
                )
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            raise UsageError("sharded optimizer state: differentiable=True is refused")
    if optimizer.state:
        raise UsageError(
            "sharded optimizer state: the optimizer already holds state (it has stepped); "
            "shard it before the first step"
        )
    return groups


class ShardLost(UsageError):
    """A plan needs the state of a partition that no live member holds."""


@dataclass(frozen=True)
class PartitionState:
    """The optimizer state of one partition, as an owner hands it to a new
    one: per segment (in order), its optimizer state entries."""

    partition: int
    segments: tuple[dict[str, torch.Tensor], ...]


class ShardedOptimizer:
    """This rank's part of the optimizer state under ``plan``.

    ``optimizer`` is the user's, never stepped: its class and each group's
    hyperparameters are used to build this rank's own optimizer over the
    segments it owns, and the hyperparameters are read from it again at
    every update (a scheduler changes them there); the user's optimizer
    itself keeps no state.

    A step is ``update`` (the owned partitions, from the reduced ``.grad``),
    ``payload`` (what this rank sends) and ``receive`` (everyone's payloads
    into the model); ``step`` does the three with an all-gather. ``replan``
    moves to the plan of a new view.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, plan: ShardPlan, me: str) -> None:
        self._groups = check_shardable(optimizer)
        self._template = optimizer
        self._plan = plan
        self._me = me
        first = self._groups[0][0]
        self._dtype, self._device = first.dtype, first.device
        self.layout = ShardLayout.of(self._groups, plan.count)
        self.numel = self.layout.numel
        self._bounds = self.layout.bounds
        self.segments = self.layout.segments()
        self._owned = set(plan.owned_by(me))
        self._leaves: dict[Segment, torch.Tensor] = {}
        #: Copies kept after a move to a plan that no longer gives them to
        #: this rank, until the next update makes them stale: partition ->
        #: (its state, its segments' parameters).
        self._spare: dict[int, tuple[PartitionState, list[torch.Tensor]]] = {}
        self._local: torch.optim.Optimizer | None = None
        #: Local param group index -> the user's group it was built from.
        self._group_of: list[int] = []
        self._build({})

    def _build(self, states: dict[Segment, dict[str, torch.Tensor]]) -> None:
        """This rank's optimizer over its owned segments, each leaf made from
        the model's parameters, with ``states`` (kept or received) set."""
        flat = self._flat_params()
        leaves: dict[Segment, torch.Tensor] = {}
        groups: list[dict[str, Any]] = []
        self._group_of = []
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
            self._group_of.append(g)
        self._leaves = leaves
        if not groups:
            self._local = None
            return
        # Each group carries all its settings: the constructor's defaults are unused.
        kind: Any = type(self._template)
        self._local = kind(groups)
        for segment, state in states.items():
            self._local.state[leaves[segment]] = {k: v.clone() for k, v in state.items()}

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
    def plan(self) -> ShardPlan:
        return self._plan

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

    def update(self) -> None:
        """Update the owned partitions from the parameters' (reduced)
        ``.grad``, with the hyperparameters the user's optimizer holds now."""
        self.check_groups()
        self._spare = {}
        if self._local is None:
            return
        for local, g in zip(self._local.param_groups, self._group_of, strict=True):
            for key, value in self._template.param_groups[g].items():
                if key != "params":
                    local[key] = value
        grads = self._flat_grads()
        for segment, leaf in self._leaves.items():
            leaf.grad = grads[segment.start : segment.stop]
        self._local.step()
        for leaf in self._leaves.values():
            leaf.grad = None

    def check_groups(self) -> None:
        """The user's optimizer must still hold the parameters it held when
        this was built, group by group: the layout was cut from them, so a
        parameter or group added since would never be updated, and one
        removed still would. ``UsageError`` if not, changing nothing."""
        groups = self._template.param_groups
        same = len(groups) == len(self._groups) and all(
            len(group["params"]) == len(params)
            and all(p is q for p, q in zip(group["params"], params, strict=True))
            for group, params in zip(groups, self._groups, strict=True)
        )
        if not same:
            raise UsageError(
                "the optimizer's param groups changed after its state was sharded (a group or "
                "a parameter added or removed): the sharded state is cut from the parameters "
                "it held then, so an added one would never be updated. Give the optimizer "
                "every group from the start (a group to train later can start with lr 0)"
            )

    def _senders(
        self, ranks: Sequence[str], holders: Sequence[Sequence[str]] | None = None
    ) -> dict[str, list[int]]:
        """Member -> the partitions it sends: each partition's live owner
        (or live member of ``holders[p]``) that sends the fewest elements so
        far (in partition order, so every rank decides alike), so that no
        payload is much longer than another (every payload is padded to the
        longest)."""
        alive = set(ranks)
        sends: dict[str, list[int]] = {m: [] for m in ranks}
        sent = {m: 0 for m in ranks}
        for p, owners in enumerate(self._plan.owners if holders is None else holders):
            live = [m for m in owners if m in alive]
            if not live:
                raise ShardLost(f"partition {p} has no owner among the members {list(ranks)}")
            sender = min(live, key=lambda m: sent[m])
            sends[sender].append(p)
            sent[sender] += self._size(p)
        return sends

    def payload(
        self, ranks: Sequence[str], holders: Sequence[Sequence[str]] | None = None
    ) -> torch.Tensor:
        """The new parameters of the partitions this rank sends (``_senders``),
        padded to the longest of the members' payloads (``ranks``: the view)."""
        sends = self._senders(ranks, holders)
        width = max(sum(self._size(p) for p in ps) for ps in sends.values())
        payload = torch.zeros(width, dtype=self._dtype, device=self._device)
        offset = 0
        for p in sends[self._me]:
            for leaf in self.copy_of(p):
                payload[offset : offset + leaf.numel()] = leaf.detach()
                offset += leaf.numel()
        return payload

    def copy_of(self, partition: int) -> list[torch.Tensor]:
        """This rank's copy of the parameters of a partition it holds, per
        segment (what its optimizer updates, and what it sends)."""
        if partition in self._owned:
            return [self._leaves[segment] for segment in self._of(partition)]
        if partition in self._spare:
            return self._spare[partition][1]
        raise ValueError(f"{self._me} does not hold partition {partition}")

    def holds(self, partition: int) -> bool:
        """Whether this rank holds a copy of ``partition`` (owned or spare)."""
        return partition in self._owned or partition in self._spare

    def receive(
        self,
        payloads: Sequence[torch.Tensor],
        ranks: Sequence[str],
        holders: Sequence[Sequence[str]] | None = None,
        compare: bool = False,
    ) -> tuple[int, ...]:
        """Write every member's payload (in rank order) into the model.
        With ``compare``, returns the partitions this rank owns but another
        member sent whose copy here is not bit for bit what that member
        sent (``_differing``); else ()."""
        sends = self._senders(ranks, holders)
        flat = torch.empty(self.numel, dtype=self._dtype, device=self._device)
        for member, tensor in zip(ranks, payloads, strict=True):
            offset = 0
            for p in sends[member]:
                start, stop = self._bounds[p]
                flat[start:stop] = tensor[offset : offset + stop - start]
                offset += stop - start
        differing = self._differing(flat, sends[self._me]) if compare else ()
        with torch.no_grad():
            offset = 0
            for group in self._groups:
                for param in group:
                    param.copy_(flat[offset : offset + param.numel()].view_as(param))
                    offset += param.numel()
        return differing

    def _differing(self, received: torch.Tensor, sent: Sequence[int]) -> tuple[int, ...]:
        """The partitions this rank owns, not among those it ``sent``, whose
        parameters here differ in any bit from the ``received`` ones (the
        flat parameters of the all-gather): the owners of a partition run
        the same update on the same gradient, so their copies stay
        identical unless one computes differently. The model follows the
        sender's copy; this rank's has drifted from it."""
        return self._copies_differing(
            sorted(self._owned.difference(sent)),
            lambda start, stop: [(0, stop - start, received[start:stop])],
        )

    def changed(self, ranks: Sequence[str]) -> tuple[int, ...]:
        """The partitions this rank sends in an all-gather over ``ranks``
        whose parameters in the model are no longer bit for bit its copy.
        The last all-gather wrote the copy there; something changed the
        model since (the loop, after ``commit()``), and the next update
        starts from the copy, so that change would be lost."""
        sent = [p for p in self._senders(ranks)[self._me] if p in self._owned]
        return self._copies_differing(sent, self._model_pieces)

    def _copies_differing(
        self,
        partitions: Iterable[int],
        pieces: Callable[[int, int], Iterable[tuple[int, int, torch.Tensor]]],
    ) -> tuple[int, ...]:
        """Those of ``partitions`` (owned) whose copy here differs in any bit
        (NaN equal to the same NaN) from ``pieces(start, stop)``: the
        tensors of a flat range, each as (from, to) within the range."""
        differing = []
        for p in partitions:
            for segment in self._of(p):
                mine = self._leaves[segment].detach()
                if any(
                    not torch.equal(_bits(mine[a:b]), _bits(piece))
                    for a, b, piece in pieces(segment.start, segment.stop)
                ):
                    differing.append(p)
                    break
        return tuple(differing)

    def _model_pieces(self, start: int, stop: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        """The model's parameters in the flat range ``[start, stop)``, as
        (from, to) within the range and a flat view of that piece of one
        parameter: no copy of the whole model."""
        offset = 0
        for group in self._groups:
            for param in group:
                end = offset + param.numel()
                if end > start and offset < stop:
                    a, b = max(start, offset), min(stop, end)
                    yield a - start, b - start, param.detach().reshape(-1)[a - offset : b - offset]
                offset = end
                if offset >= stop:
                    return

    def sender_of(self, partition: int, ranks: Sequence[str]) -> str:
        """The member that sends ``partition`` in an all-gather over ``ranks``."""
        sends = self._senders(ranks)
        return next(m for m, ps in sends.items() if partition in ps)

    def step(self, gather: Gather, ranks: Sequence[str]) -> None:
        """``update``, then an all-gather (``gather``, over the members
        ``ranks``, the view in rank order) of the new parameters."""
        self.update()
        self.publish(gather, ranks)

    def publish(
        self,
        gather: Gather,
        ranks: Sequence[str],
        holders: Sequence[Sequence[str]] | None = None,
        compare: bool = False,
    ) -> tuple[int, ...]:
        """The all-gather of the parameters this rank's partitions hold
        (``update`` wrote them there), into the model of every member of
        ``ranks``. With ``holders`` (per partition, the members that hold
        it as of the model's step: a new view's sources), each partition is
        sent by one of them: so a view whose previous all-gather did not
        complete everywhere brings every member's model to that step. With
        ``compare`` (after an ``update``), returns the partitions whose
        copy here differs from the one another owner sent (``receive``)."""
        return self.receive(gather(self.payload(ranks, holders)), ranks, holders, compare)

    def forget(self) -> None:
        """Hold no partition any more (this rank's copies are stale: it is
        behind, or the job resumes from a checkpoint)."""
        self._owned = set()
        self._spare = {}
        self._build({})

    def needs(self, plan: ShardPlan) -> tuple[int, ...]:
        """The partitions ``plan`` gives this rank that it does not hold."""
        return tuple(p for p in plan.owned_by(self._me) if not self.holds(p))

    def export(self, partition: int) -> PartitionState:
        """This rank's optimizer state of an owned ``partition``, for a new
        owner (cloned: the caller may send it anywhere)."""
        if partition in self._spare:
            kept = self._spare[partition][0]
            return PartitionState(
                partition, tuple({k: v.clone() for k, v in st.items()} for st in kept.segments)
            )
        if partition not in self._owned:
            raise ValueError(f"{self._me} does not own partition {partition}")
        assert self._local is not None
        entries = []
        for segment in self._of(partition):
            state = self._local.state.get(self._leaves[segment], {})
            entries.append({k: v.clone() for k, v in state.items()})
        return PartitionState(partition, tuple(entries))

    def replan(
        self,
        plan: ShardPlan,
        survivors: Collection[str],
        fetch: Callable[[int], PartitionState],
    ) -> tuple[int, ...]:
        """Move to ``plan`` (the new view's): keep the state of partitions
        this rank still owns, ``fetch`` that of the ones it newly owns from a
        live previous owner, drop the rest. ``survivors``: the members that
        hold the state of the committed step. The model's parameters must be
        the current ones (every rank holds them whole). Returns the
        partitions fetched. ``ShardLost``, changing nothing, if a partition
        has no owner among the survivors."""
        if plan.count != self._plan.count:
            raise ValueError(f"the partition count is fixed: {self._plan.count}, not {plan.count}")
        lost = self._plan.uncovered(survivors)
        if lost:
            gone = sorted({m for p in lost for m in self._plan.owners[p]})
            raise ShardLost(
                f"partitions {', '.join(map(str, lost))} of the optimizer state have no live "
                f"owner (all their copies were on {', '.join(gone)}): the job must resume from "
                "its newest durable checkpoint"
            )
        return self.move_to(plan, {p: fetch(p) for p in self.needs(plan)})

    def move_to(
        self, plan: ShardPlan, received: Mapping[int, PartitionState], keep: bool = False
    ) -> tuple[int, ...]:
        """Move to ``plan``: keep what this rank holds and still owns, take
        the partitions it newly owns from ``received`` (each partition's
        state from a live holder), drop the rest, or with ``keep`` hold it
        as a spare copy until the next ``update`` (so that it can still be
        handed on if this view is given up before a step). Returns the
        partitions taken. ValueError, changing nothing, if ``received``
        lacks one or holds a partition that is not of this model's shape."""
        if plan.count != self._plan.count:
            raise ValueError(f"the partition count is fixed: {self._plan.count}, not {plan.count}")
        owned = set(plan.owned_by(self._me))
        states: dict[Segment, dict[str, torch.Tensor]] = {}
        fetched = []
        for p in sorted(owned):
            segments = self._of(p)
            if p in self._owned:
                assert self._local is not None
                for segment in segments:
                    states[segment] = dict(self._local.state.get(self._leaves[segment], {}))
                continue
            got = self._spare[p][0] if p in self._spare else received.get(p)
            if got is None:
                raise ValueError(f"partition {p} is this rank's in the new plan, not received")
            if got.partition != p or len(got.segments) != len(segments):
                raise ValueError(f"the state received for partition {p} is not of it")
            for segment, state in zip(segments, got.segments, strict=True):
                _check_entries(p, segment, state)
                states[segment] = dict(state)
            if p not in self._spare:
                fetched.append(p)
        spare = {p: kept for p, kept in self._spare.items() if p not in owned} if keep else {}
        if keep:
            for p in self._owned - owned:
                spare[p] = (self.export(p), [self._leaves[s].detach() for s in self._of(p)])
        self._plan, self._owned, self._spare = plan, owned, spare
        self._build({s: st for s, st in states.items() if st})
        return tuple(fetched)

    def sent_by_me(self, ranks: Sequence[str]) -> tuple[int, ...]:
        """The partitions this rank sends in an all-gather over ``ranks``."""
        return tuple(self._senders(ranks)[self._me])

    def gathered_state(self, parts: Sequence[PartitionState]) -> dict[str, Any]:
        """The user's optimizer's ``state_dict`` (replicated form: what a
        checkpoint holds, loadable at any world size and in replicated mode)
        from every partition's state (``parts``, one per partition)."""
        return assemble_state(self.layout, parts, self._template.state_dict()["param_groups"])

    def checkpoint_entry(self) -> dict[str, Any]:
        """A sharded checkpoint's optimizer entry: a ``state_dict`` with no
        state (it is in the checkpoint's parts) and the layout."""
        return {"state": {}, "param_groups": self._template.state_dict()["param_groups"],
                LAYOUT_KEY: self.layout.to_tree()}  # fmt: skip

    def load_state(self, state_dict: Mapping[str, Any]) -> None:
        """Take this rank's partitions from a replicated-form optimizer
        ``state_dict`` (a checkpoint's), the model's parameters being the
        checkpoint's. ValueError if it does not fit this optimizer."""
        entries = state_dict.get("state", {})
        params = [p for group in self._groups for p in group]
        starts = []
        offset = 0
        for param in params:
            starts.append(offset)
            offset += param.numel()
        states: dict[Segment, dict[str, torch.Tensor]] = {}
        for segment in self.segments:
            if segment.partition not in self._owned:
                continue
            covering = [
                i for i, param in enumerate(params)
                if starts[i] < segment.stop and starts[i] + param.numel() > segment.start
            ]  # fmt: skip
            keys = {k for i in covering for k in entries.get(i, {})}
            state: dict[str, torch.Tensor] = {}
            for key in sorted(keys):
                values = [entries.get(i, {}).get(key) for i in covering]
                if any(v is None for v in values):
                    raise ValueError(f"optimizer state {key!r} is missing for some parameters")
                if all(v.dim() == 0 for v in values):
                    state[key] = values[0].clone()
                    continue
                pieces = []
                for i, value in zip(covering, values, strict=True):
                    if value.numel() != params[i].numel():
                        raise ValueError(
                            f"optimizer state {key!r} of parameter {i} has {value.numel()} "
                            f"elements, the parameter {params[i].numel()}"
                        )
                    a = max(segment.start, starts[i]) - starts[i]
                    b = min(segment.stop, starts[i] + params[i].numel()) - starts[i]
                    pieces.append(value.reshape(-1)[a:b])
                state[key] = torch.cat(pieces)
            if state:
                states[segment] = state
        self._build(states)

    def _size(self, partition: int) -> int:
        start, stop = self._bounds[partition]
        return stop - start

    def _of(self, partition: int) -> list[Segment]:
        return [s for s in self.segments if s.partition == partition]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, to compare bit for bit."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def _check_entries(partition: int, segment: Segment, state: Mapping[str, torch.Tensor]) -> None:
    """A received segment's state: tensors, each either element-wise (one
    value per element of the segment) or a scalar."""
    length = segment.stop - segment.start
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"partition {partition}: state entry {key!r} is not a tensor")
        if value.dim() != 0 and tuple(value.shape) != (length,):
            raise ValueError(
                f"partition {partition}: state entry {key!r} has shape {tuple(value.shape)}, "
                f"not ({length},) or a scalar"
            )
