"""A view as a change of the view before it, and back.

A roll call keeps the survivors in their order and appends the joiners
(``rollcall.membership.coordinator.decide_view``), so a view is fully said
by the ranks of the previous view's members it no longer holds and the
members it appends: a few bytes for a leave, a crash or a join, where the
whole view of 2,048 members is about 77 kB, sent on every session.

Rebuilding is checked, never trusted: a change applies only to the view it
was made against (its epoch), and the rebuilt member list must hash to the
one the leader hashed (``View.members_sha256``). Anything else is refused
(``None``), and the member asks for the whole view instead of acting on a
wrong member list.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

from rollcall.membership.view import Member, View

#: A fetch plan group by ranks in the new view: (sources, fetching members).
RankGroup = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class ViewDelta:
    """View ``epoch`` as a change of view ``base_epoch``."""

    epoch: int
    base_epoch: int
    #: Ranks in the base view of the members the view no longer holds, ascending.
    removed: tuple[int, ...]
    #: Members appended after the remaining ones.
    added: tuple[Member, ...]
    #: ``View.members_sha256`` of the new view.
    members_sha256: bytes
    resume_step: int | None = None
    digest: str = ""
    #: ``View.fetch_groups`` with members named by their rank in the new view.
    fetch_groups: tuple[RankGroup, ...] = ()


def delta_between(base: View, view: View) -> ViewDelta | None:
    """``view`` as a change of ``base``, or None when it cannot be one: it
    is not newer, it reorders members of ``base`` (only removals and
    appended members can be said), or it has a shard plan (sent whole)."""
    if view.epoch <= base.epoch or view.shards is not None:
        return None
    kept = frozenset(view.ids)
    removed = tuple(rank for rank, member in enumerate(base.members) if member.id not in kept)
    survivors = tuple(member for member in base.members if member.id in kept)
    if view.members[: len(survivors)] != survivors:
        return None
    ranks = {member_id: rank for rank, member_id in enumerate(view.ids)}
    groups = []
    for sources, fetchers in view.fetch_groups():
        if any(m not in ranks for m in (*sources, *fetchers)):
            return None
        groups.append((tuple(ranks[m] for m in sources), tuple(ranks[m] for m in fetchers)))
    return ViewDelta(
        epoch=view.epoch,
        base_epoch=base.epoch,
        removed=removed,
        added=view.members[len(survivors) :],
        members_sha256=view.members_sha256,
        resume_step=view.resume_step,
        digest=view.digest,
        fetch_groups=tuple(groups),
    )


def apply_delta(base: View, delta: ViewDelta) -> View | None:
    """The view ``delta`` says, rebuilt from ``base``; None if it does not
    apply: ``base`` is not the view it was made against, a rank is out of
    place, or the result is not the list the leader hashed."""
    if delta.base_epoch != base.epoch or delta.epoch <= base.epoch:
        return None
    previous = -1
    for rank in delta.removed:
        if not previous < rank < base.size:
            return None
        previous = rank
    kept = []
    start = 0
    for rank in delta.removed:
        kept.append(base.members[start:rank])
        start = rank + 1
    kept.append(base.members[start:])
    members = tuple(chain(*kept, delta.added))
    fetch: dict[str, tuple[str, ...]] = {}
    for sources, fetchers in delta.fetch_groups:
        if any(not 0 <= rank < len(members) for rank in (*sources, *fetchers)):
            return None
        named = tuple(members[rank].id for rank in sources)
        fetch.update(dict.fromkeys((members[rank].id for rank in fetchers), named))
    try:
        view = View(delta.epoch, members, delta.resume_step, delta.digest, fetch)
    except ValueError:  # a member twice
        return None
    if view.members_sha256 != delta.members_sha256:
        return None
    return view
