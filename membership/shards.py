"""Who holds which part of the sharded state: a fixed number of partitions,
each owned by ``redundancy`` members of the view, placed away from shared
failure domains and kept where it is across view changes.

Pure: the leader computes the plan of each view from the previous plan and
the new member list, and every member reads it from the view.

The state (a flat vector per dtype of every parameter's optimizer state)
is cut into ``count`` contiguous partitions of near-equal size
(``partition_bounds``); the count is fixed for the life of the job, so a
view change moves whole partitions from owner to owner and never cuts them
anew. Every owner of a partition holds an identical copy: each runs the
same update on the same reduced gradient.

Placement (``place``):

- the first plan deals the copies out over the members ordered by host in
  turn (one of each host, then the second of each, ...): partition ``p``'s
  owners are the ``redundancy`` members after those of partition ``p - 1``
  in that ring, so loads differ by at most one, and when hosts hold equal
  numbers of members and there are at least ``redundancy`` of them, no two
  copies of a partition share a host;
- a later plan keeps every live owner's copy, gives each partition that
  lost owners new ones (members below their share first, then below the
  ceiling of it; among those, members not on a host its owners use, then
  the least loaded), evens loads out by handing those new copies on, and
  moves a kept copy only to bring a joiner up to its share. Loads then
  differ by at most one unless the copies lost could only go to a few
  members; nothing else moves (``moves``; ``least_moves`` is the least
  any such plan moves).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SHARD_PARTITIONS",
    "SHARD_REDUNDANCY",
    "ShardPlan",
    "Sharding",
    "ShardedView",
    "decide_shards",
    "host_of",
    "least_moves",
    "moves",
    "partition_bounds",
    "place",
]


@dataclass(frozen=True)
class ShardPlan:
    """The owners of each partition, in the order they were given it."""

    owners: tuple[tuple[str, ...], ...]
    redundancy: int

    def __post_init__(self) -> None:
        if self.redundancy < 1:
            raise ValueError(f"redundancy must be at least 1, got {self.redundancy}")
        for index, owners in enumerate(self.owners):
            if not owners:
                raise ValueError(f"partition {index} has no owner")
            if len(set(owners)) != len(owners):
                raise ValueError(f"partition {index} names an owner twice: {owners}")

    @property
    def count(self) -> int:
        return len(self.owners)

    def owned_by(self, member_id: str) -> tuple[int, ...]:
        """The partitions ``member_id`` holds a copy of."""
        return tuple(p for p, owners in enumerate(self.owners) if member_id in owners)

    def load(self) -> dict[str, int]:
        """Member id -> how many partitions it holds."""
        counts: dict[str, int] = {}
        for owners in self.owners:
            for member_id in owners:
                counts[member_id] = counts.get(member_id, 0) + 1
        return counts

    def uncovered(self, alive: Collection[str]) -> tuple[int, ...]:
        """The partitions no member of ``alive`` holds: lost with the others."""
        return tuple(p for p, owners in enumerate(self.owners) if not set(owners) & set(alive))

    def to_dict(self) -> dict[str, Any]:
        return {"redundancy": self.redundancy, "owners": [list(o) for o in self.owners]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardPlan:
        owners = tuple(tuple(str(m) for m in entry) for entry in data["owners"])
        return cls(owners=owners, redundancy=int(data["redundancy"]))


def partition_bounds(numel: int, count: int) -> tuple[tuple[int, int], ...]:
    """``count`` contiguous ``[start, stop)`` ranges covering ``numel``
    elements, the first ``numel % count`` one element longer."""
    if count < 1:
        raise ValueError(f"the partition count must be at least 1, got {count}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    base, extra = divmod(numel, count)
    bounds = []
    start = 0
    for index in range(count):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


def _by_host(members: Sequence[str], hosts: Mapping[str, str]) -> list[str]:
    """``members`` ordered one of each host in turn (hosts in order of
    first appearance; a member without a label is a host of its own)."""
    groups: dict[str, list[str]] = {}
    for member_id in members:
        groups.setdefault(hosts.get(member_id, f"\0{member_id}"), []).append(member_id)
    ordered = []
    depth = max((len(g) for g in groups.values()), default=0)
    for level in range(depth):
        ordered += [g[level] for g in groups.values() if level < len(g)]
    return ordered


def place(
    members: Sequence[str],
    hosts: Mapping[str, str],
    count: int,
    redundancy: int,
    previous: ShardPlan | None = None,
) -> ShardPlan:
    """The plan for a view of ``members`` (in rank order), ``hosts``
    mapping member ids to failure-domain labels; each partition gets
    ``min(redundancy, len(members))`` owners. With ``previous``, live
    owners keep their copies (see the module's docstring)."""
    if not members:
        raise ValueError("a shard plan needs at least one member")
    if len(set(members)) != len(members):
        raise ValueError(f"duplicate members: {list(members)}")
    if previous is not None and previous.count != count:
        raise ValueError(f"the partition count is fixed for a job: {previous.count}, not {count}")
    copies = min(redundancy, len(members))
    if previous is None or not set(members) & {m for o in previous.owners for m in o}:
        order = _by_host(members, hosts)
        width = len(order)
        dealt = tuple(
            tuple(order[(p * copies + k) % width] for k in range(copies)) for p in range(count)
        )
        return ShardPlan(dealt, redundancy)

    alive = set(members)
    rank = {m: i for i, m in enumerate(members)}
    table = [[m for m in owners if m in alive][:copies] for owners in previous.owners]
    load = {m: 0 for m in members}
    for owners in table:
        for m in owners:
            load[m] += 1
    total = count * copies
    floor, ceiling = total // len(members), -(-total // len(members))

    def host(member_id: str) -> str:
        return hosts.get(member_id, f"\0{member_id}")

    def best(candidates: Iterable[str], owners: list[str]) -> str | None:
        used = {host(m) for m in owners}
        pool = [m for m in candidates if m not in owners]
        if not pool:
            return None
        return min(pool, key=lambda m: (host(m) in used, load[m], rank[m]))

    # Partitions that lost owners get new ones: members below their share
    # first (a joiner), then below the ceiling, so that balancing after it
    # moves as little as it can.
    for owners in table:
        while len(owners) < copies:
            tiers = (
                [m for m in members if load[m] < floor],
                [m for m in members if load[m] < ceiling],
                list(members),
            )
            chosen = next(c for c in (best(t, owners) for t in tiers) if c is not None)
            owners.append(chosen)
            load[chosen] += 1

    # Then from the most to the least loaded until loads are within one, by
    # handing on copies given out above (a chain of them, found breadth
    # first, costs no transfer more); a kept copy moves only to a member
    # below its share (a joiner). So a re-plan transfers exactly the lost
    # copies, or exactly the joiners' shares.
    fresh = [{m for m in owners if m not in previous.owners[p]} for p, owners in enumerate(table)]
    before = {m for owners in previous.owners for m in owners}
    while True:
        heavy = max(members, key=lambda m: (load[m], -rank[m]))
        light = min(members, key=lambda m: (load[m], rank[m]))
        if load[heavy] - load[light] <= 1:
            break
        path = _hand_on(table, fresh, heavy, light, members)
        if path is None:
            # A kept copy moves only to bring a joiner up to its share.
            short = [m for m in members if m not in before and load[m] < floor]
            if not short:
                break
            light = min(short, key=lambda m: (load[m], rank[m]))
            givers = [m for m in members if any(m in o and light not in o for o in table)]
            heavy = max(givers, key=lambda m: (load[m], -rank[m]))
            choices = [p for p, o in enumerate(table) if heavy in o and light not in o]
            p = min(choices, key=lambda p: (host(light) in {host(m) for m in table[p]}, -p))
            path = [(p, heavy, light)]
        for p, giver, taker in path:
            table[p][table[p].index(giver)] = taker
            if giver in fresh[p] or taker not in previous.owners[p]:
                fresh[p].discard(giver)
                fresh[p].add(taker)
        load[heavy] -= 1
        load[light] += 1
    return ShardPlan(tuple(tuple(o) for o in table), redundancy)


def _hand_on(
    table: list[list[str]],
    fresh: list[set[str]],
    source: str,
    target: str,
    members: Sequence[str],
) -> list[tuple[int, str, str]] | None:
    """A chain of copies given out in this plan that moves one copy's worth
    of load from ``source`` to ``target``: ``(partition, giver, taker)``
    steps, each giver handing a fresh copy to a member not holding that
    partition. None if there is none."""
    came: dict[str, tuple[int, str] | None] = {source: None}
    queue = [source]
    while queue:
        giver = queue.pop(0)
        for p, owners in enumerate(table):
            if giver not in fresh[p]:
                continue
            for taker in members:
                if taker in came or taker in owners:
                    continue
                came[taker] = (p, giver)
                if taker == target:
                    path = []
                    node = taker
                    while came[node] is not None:
                        step = came[node]
                        assert step is not None
                        path.append((step[0], step[1], node))
                        node = step[1]
                    return path[::-1]
                queue.append(taker)
    return None


def moves(previous: ShardPlan, plan: ShardPlan) -> tuple[tuple[int, str], ...]:
    """``(partition, member)`` for every copy ``plan`` gives a member that
    did not hold it in ``previous``: what must be transferred."""
    return tuple(
        (p, m)
        for p, (old, new) in enumerate(zip(previous.owners, plan.owners, strict=True))
        for m in new
        if m not in old
    )


def least_moves(previous: ShardPlan, members: Sequence[str], redundancy: int) -> int:
    """The fewest copies any plan for ``members`` that gives every
    partition its copies and every joiner at least the floor of its share
    must transfer after ``previous``: each copy lost with a dead member, and
    the joiners' shares."""
    alive = set(members)
    copies = min(redundancy, len(members))
    floor = previous.count * copies // len(members)
    before = {m for owners in previous.owners for m in owners}
    deficit = sum(copies - len([x for x in o if x in alive][:copies]) for o in previous.owners)
    joiners = sum(1 for m in members if m not in before)
    return max(deficit, joiners * floor)


#: The job fingerprint's fields that make a job sharded (both or neither).
SHARD_PARTITIONS = "shard_partitions"
SHARD_REDUNDANCY = "shard_redundancy"


@dataclass(frozen=True)
class Sharding:
    """A sharded job's constants: the partition count and the redundancy."""

    count: int
    redundancy: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"the partition count must be at least 1, got {self.count}")
        if self.redundancy < 1:
            raise ValueError(f"the redundancy must be at least 1, got {self.redundancy}")

    def fields(self) -> dict[str, str]:
        """The job fingerprint's fields for this setting."""
        return {SHARD_PARTITIONS: str(self.count), SHARD_REDUNDANCY: str(self.redundancy)}

    @classmethod
    def from_fingerprint(cls, fields: Mapping[str, str]) -> Sharding | None:
        """The setting a job fingerprint records; None for a replicated job
        (or a fingerprint whose fields are not numbers: not ours)."""
        try:
            return cls(int(fields[SHARD_PARTITIONS]), int(fields[SHARD_REDUNDANCY]))
        except (KeyError, ValueError):
            return None


def host_of(address: str) -> str:
    """The failure domain of a member reached at ``address`` (host:port):
    its host part, so that members sharing a machine share a domain."""
    host, _, port = address.rpartition(":")
    return host if host and port else address


@dataclass(frozen=True)
class ShardedView:
    """What a committed view says about the sharded state.

    ``plan``: who owns each partition in this view. ``sources``: per
    partition, the members of this view that hold its state as of the
    view's resume step (owners in the previous view that hold that step);
    empty for a fresh plan. A member gets a partition it does not hold from
    one of them. ``lost``: the partitions no live member holds; non-empty
    means the view resumes from the job's newest durable checkpoint (its
    resume step is unset) and ``plan`` is a fresh one.
    """

    plan: ShardPlan
    sources: tuple[tuple[str, ...], ...] = ()
    lost: tuple[int, ...] = ()
    #: The plan whose copies the members held on entering this view (the
    #: previous view's, or an earlier one's if no step committed since);
    #: None for a fresh plan. Until a step commits in this view, members
    #: keep those copies, so that a view change that aborts the move loses
    #: nothing.
    base: ShardPlan | None = None

    def __post_init__(self) -> None:
        if self.sources and len(self.sources) != self.plan.count:
            raise ValueError(
                f"sources name {len(self.sources)} partitions, the plan has {self.plan.count}"
            )

    @property
    def count(self) -> int:
        return self.plan.count

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.plan.to_dict(),
            "sources": [list(s) for s in self.sources],
            "lost": list(self.lost),
            "base": None if self.base is None else [list(o) for o in self.base.owners],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardedView:
        plan = ShardPlan.from_dict(data)
        base = data.get("base")
        return cls(
            plan=plan,
            sources=tuple(tuple(str(m) for m in entry) for entry in data.get("sources", ())),
            lost=tuple(int(p) for p in data.get("lost", ())),
            base=None if base is None else ShardPlan(
                tuple(tuple(str(m) for m in o) for o in base), plan.redundancy
            ),
        )


def decide_shards(
    sharding: Sharding,
    previous: ShardedView | None,
    advanced: bool,
    members: Sequence[str],
    hosts: Mapping[str, str],
    holders: Collection[str] | None,
    moved: Collection[str] = (),
) -> ShardedView:
    """The sharded part of a new view of ``members`` (rank order).

    ``holders``: the members whose state of the view's resume step is
    believed (None: nobody holds state, the view starts from step 0 or a
    checkpoint). ``advanced``: a step committed in the previous view, so
    its holders hold the previous view's plan. Else they still hold its
    ``base`` (a member keeps the copies it gives up until a step commits),
    and those of them that say they moved to the previous view's plan
    (``moved``: they entered it and took their copies) hold its copies
    too. Copies held by a member that is not a holder (behind by a step,
    or new) do not count. A partition none of the holders holds is lost:
    every partition is then placed afresh and the view must resume from a
    checkpoint (``lost`` says which were lost)."""
    if holders is None:
        return ShardedView(place(members, hosts, sharding.count, sharding.redundancy))
    if previous is None or previous.count != sharding.count:
        # State without a plan (the view's record was lost): no copy is
        # known to be anyone's.
        fresh = place(members, hosts, sharding.count, sharding.redundancy)
        return ShardedView(fresh, lost=tuple(range(sharding.count)))
    held_plan = previous.plan if advanced or previous.base is None else previous.base
    if held_plan is previous.base and set(moved) & set(holders):
        # Those that moved hold the previous plan's copies besides the base's.
        took = set(moved) & set(holders)
        held_plan = ShardPlan(
            tuple(
                (*(m for m in new if m in took), *(m for m in old if m not in new or m not in took))
                for new, old in zip(previous.plan.owners, held_plan.owners, strict=True)
            ),
            held_plan.redundancy,
        )
    held = set(holders) & set(members)
    lost = held_plan.uncovered(held)
    if lost:
        return ShardedView(
            place(members, hosts, sharding.count, sharding.redundancy), lost=lost
        )
    sources = tuple(tuple(m for m in owners if m in held) for owners in held_plan.owners)
    plan = place(members, hosts, sharding.count, sharding.redundancy,
                 ShardPlan(sources, held_plan.redundancy))  # fmt: skip
    return ShardedView(plan, sources, base=held_plan)
