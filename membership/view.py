"""The view: one committed, authoritative member list per epoch."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from rollcall.membership.shards import ShardedView


@dataclass(frozen=True)
class Member:
    """A worker in a view: its id and the address peers reach it at."""

    id: str
    address: str


@dataclass(frozen=True)
class View:
    """``(epoch, members)``; a member's rank is its position in ``members``.

    ``resume_step`` is the highest committed step any member of the view holds
    (``None`` before anyone committed a step); ``fetch`` maps each member that
    must pull state before its first step to the ids it may pull from, and
    ``digest`` is the state digest those sources agreed on. ``shards``: in
    a job with sharded optimizer state, who owns which partition in this
    view and where each is held (``membership/shards.py``); None otherwise.
    """

    epoch: int
    members: tuple[Member, ...]
    resume_step: int | None = None
    digest: str = ""
    fetch: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    shards: ShardedView | None = None

    def __post_init__(self) -> None:
        if self.epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {self.epoch}")
        ids = tuple([m.id for m in self.members])
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate member ids in view {self.epoch}: {list(ids)}")
        self.__dict__["ids"] = ids  # the cached property, computed once

    @cached_property
    def ids(self) -> tuple[str, ...]:
        return tuple(m.id for m in self.members)

    @cached_property
    def _id_set(self) -> frozenset[str]:
        return frozenset(self.ids)

    @cached_property
    def members_sha256(self) -> bytes:
        """SHA-256 of the member list: the ids in rank order joined by NUL,
        two NULs, then the addresses in rank order joined by NUL (neither
        holds a NUL, and an id is never empty, so this says the list and
        nothing else). A member that rebuilt a view from a change of the
        previous one (``rollcall.membership.delta``) checks its list
        against it."""
        ids = "\0".join(self.ids)
        addresses = "\0".join([member.address for member in self.members])
        return hashlib.sha256(f"{ids}\0\0{addresses}".encode()).digest()

    @property
    def size(self) -> int:
        return len(self.members)

    def rank_of(self, member_id: str) -> int | None:
        for rank, member in enumerate(self.members):
            if member.id == member_id:
                return rank
        return None

    def __contains__(self, member_id: object) -> bool:
        return member_id in self._id_set

    def fetch_groups(self) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
        """The fetch plan as (sources, members fetching from them) groups,
        in a fixed order: how it is written, once per set of sources (half
        of a 10,000-member view fetching from the other half is 10,000 ids,
        not 25 million)."""
        groups: dict[tuple[str, ...], list[str]] = {}
        for fetcher, sources in sorted(self.fetch.items()):
            groups.setdefault(tuple(sources), []).append(fetcher)
        return sorted((sources, tuple(fetchers)) for sources, fetchers in groups.items())

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "members": [
                {"id": m.id, "address": m.address, "rank": r} for r, m in enumerate(self.members)
            ],
            "resume_step": self.resume_step,
            "digest": self.digest,
            "fetch_groups": [
                {"sources": list(sources), "members": list(fetchers)}
                for sources, fetchers in self.fetch_groups()
            ],
            **({} if self.shards is None else {"shards": self.shards.to_dict()}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> View:
        members = tuple(Member(str(m["id"]), str(m["address"])) for m in data["members"])
        # Views written before the groups hold a plan per member ("fetch").
        fetch = {str(k): tuple(str(x) for x in v) for k, v in data.get("fetch", {}).items()}
        for group in data.get("fetch_groups", []):
            sources = tuple(str(x) for x in group["sources"])
            fetch.update(dict.fromkeys((str(m) for m in group["members"]), sources))
        return cls(
            epoch=int(data["epoch"]),
            members=members,
            resume_step=None if data.get("resume_step") is None else int(data["resume_step"]),
            digest=str(data.get("digest", "")),
            fetch=fetch,
            shards=None if data.get("shards") is None else ShardedView.from_dict(data["shards"]),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> View:
        return cls.from_dict(json.loads(text))


#: The view before anyone joined.
EMPTY_VIEW = View(epoch=0, members=())
