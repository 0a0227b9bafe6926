"""Checks of the values read from etcd, before anything acts on them.

etcd is the job's truth, but what it holds was not necessarily written by
rollcall: a holder of etcd's credentials (or anyone, where etcd runs without
authentication) can plant any bytes under ``/rollcall/``. Every record the
store reads goes through one of these functions, which return the value
only if it has the shape rollcall writes (types, ranges, the id and address
rules of ``rollcall.protocol.validation``) and raise :class:`MalformedRecord`
naming what is wrong otherwise. They are pure: the store decides what a
malformed value means (ignored and logged, or a refusal to lead).

Fields that rollcall does not know are let through, so that a newer
version's records can be read by an older one.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

from rollcall.membership.checkpoint import CheckpointManifest
from rollcall.membership.config import Config
from rollcall.membership.errors import InvalidRequest, MalformedRecord
from rollcall.membership.shards import ShardedView, ShardPlan
from rollcall.membership.view import Member, View
from rollcall.protocol.validation import MAX_COUNTER, check_digest, check_id

#: Longest replica id accepted in a leader record (``<advertise>-<6 hex>``).
_MAX_REPLICA_ID = 300


def load_json(value: bytes) -> Any:
    """``value`` as JSON, or :class:`MalformedRecord` ("not JSON")."""
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise MalformedRecord(f"not JSON: {str(exc)[:80]}") from None


def _object(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise MalformedRecord(f"{what} is a JSON {type(data).__name__}, not an object")
    return data


def _counter(data: dict[str, Any], name: str, *, optional: bool = False) -> int | None:
    value = data.get(name)
    if value is None and optional:
        return None
    if type(value) is not int or not 0 <= value <= MAX_COUNTER:
        raise MalformedRecord(f"{name} is {str(value)[:40]!r}, not an integer in 0..2^63-1")
    return value


def _text(data: dict[str, Any], name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str):
        raise MalformedRecord(f"{name} is {str(value)[:40]!r}, not a string")
    return value


def _address(data: dict[str, Any], name: str, config: Config) -> str:
    """An address as rollcall stores it: printable text without spaces, of
    at most ``max_address_length`` characters. (Not the full ``host:port``
    check of a request: what reached etcd passed it already, and a record
    is refused for what could hurt, not for its style.)"""
    value = _text(data, name)
    if not value or len(value) > config.max_address_length:
        raise MalformedRecord(f"{name} is empty or longer than {config.max_address_length}")
    if not value.isprintable() or any(c.isspace() for c in value):
        raise MalformedRecord(f"{name} {value[:40]!r} has spaces or unprintable characters")
    return value


def _checked(check: Any, *args: Any) -> Any:
    """A ``rollcall.protocol.validation`` check, its refusal as MalformedRecord."""
    try:
        return check(*args)
    except InvalidRequest as exc:
        raise MalformedRecord(str(exc)) from None


def check_member(data: Any, config: Config) -> Member:
    """``{"id", "address"}``, both valid."""
    data = _object(data, "member")
    member_id = _checked(check_id, _text(data, "id"), "member id", config)
    return Member(member_id, _address(data, "address", config))


def check_view(value: bytes, config: Config) -> View:
    """A view as ``View.to_json`` writes it: a non-negative epoch, members
    with valid and distinct ids and valid addresses (ranks, if given, equal
    to their positions), a non-negative ``resume_step`` or null, a valid
    digest, and a fetch plan naming members only."""
    data = _object(load_json(value), "view")
    epoch = _counter(data, "epoch")
    raw_members = data.get("members")
    if not isinstance(raw_members, list):
        raise MalformedRecord("members is not a list")
    members = []
    for rank, raw in enumerate(raw_members):
        members.append(check_member(raw, config))
        if raw.get("rank", rank) != rank:
            raise MalformedRecord(f"member {members[-1].id} has rank {raw['rank']!r}, not {rank}")
    ids = [m.id for m in members]
    duplicates = sorted(i for i, n in Counter(ids).items() if n > 1)
    if duplicates:
        raise MalformedRecord(f"duplicate member ids {', '.join(duplicates)}")
    known = set(ids)
    digest = data.get("digest", "")
    if not isinstance(digest, str):
        raise MalformedRecord("digest is not a string")
    _checked(check_digest, digest, config)
    fetch = data.get("fetch", {})
    if not isinstance(fetch, dict):
        raise MalformedRecord("fetch is not an object")
    groups = data.get("fetch_groups", [])
    if not isinstance(groups, list):
        raise MalformedRecord("fetch_groups is not a list")
    plan: dict[str, tuple[str, ...]] = {}
    # Views written before the groups hold a plan per member ("fetch").
    entries: list[tuple[Any, Any]] = [([fetcher], sources) for fetcher, sources in fetch.items()]
    for group in groups:
        if not isinstance(group, dict):
            raise MalformedRecord("a fetch group is not an object")
        entries.append((group.get("members"), group.get("sources")))
    for fetchers, sources in entries:
        for what in (fetchers, sources):
            if not isinstance(what, list) or not all(isinstance(s, str) for s in what):
                raise MalformedRecord("a fetch plan's members and sources are not lists of ids")
        strangers = sorted({*fetchers, *sources} - known)
        if strangers:
            raise MalformedRecord(f"fetch plan names non-members {', '.join(strangers)[:80]}")
        shared = tuple(sources)
        for fetcher in fetchers:
            if fetcher in plan:
                raise MalformedRecord(f"fetch plan names {fetcher[:40]!r} twice")
            plan[fetcher] = shared
    assert epoch is not None
    shards = None if data.get("shards") is None else _check_shards(data["shards"], ids, config)
    return View(epoch, tuple(members), _counter(data, "resume_step", optional=True), digest, plan,
                shards)  # fmt: skip


def _check_shards(data: Any, ids: list[str], config: Config) -> ShardedView:
    """A view's shard plan: owners (members of the view) and sources per
    partition, lost partitions in range, a base plan naming valid ids (its
    owners may have left since)."""
    if not isinstance(data, dict):
        raise MalformedRecord("shards is not an object")
    redundancy = data.get("redundancy")
    if type(redundancy) is not int or not 1 <= redundancy <= MAX_COUNTER:
        raise MalformedRecord(f"shards redundancy {str(redundancy)[:40]!r} is not a count >= 1")

    def tables(name: str, members_only: bool) -> tuple[tuple[str, ...], ...]:
        raw = data.get(name, [])
        if not isinstance(raw, list) or not all(
            isinstance(e, list) and all(isinstance(m, str) for m in e) for e in raw
        ):
            raise MalformedRecord(f"shards {name} is not a list of lists of member ids")
        for entry in raw:
            for member_id in entry:
                _checked(check_id, member_id, "member id", config)
        strangers = sorted({m for e in raw for m in e} - set(ids)) if members_only else []
        if strangers:
            raise MalformedRecord(f"shards {name} names non-members {', '.join(strangers)[:80]}")
        return tuple(tuple(e) for e in raw)

    owners, sources = tables("owners", True), tables("sources", True)
    base = None if data.get("base") is None else tables("base", False)
    lost = data.get("lost", [])
    if not isinstance(lost, list) or not all(
        type(p) is int and 0 <= p < len(owners) for p in lost
    ):
        raise MalformedRecord(f"shards lost is not a list of partitions of 0..{len(owners) - 1}")
    if base is not None and len(base) != len(owners):
        raise MalformedRecord(f"shards base names {len(base)} partitions, owners {len(owners)}")
    try:
        plan = ShardPlan(owners, redundancy)
        return ShardedView(
            plan, sources, tuple(lost), None if base is None else ShardPlan(base, redundancy)
        )
    except ValueError as exc:
        raise MalformedRecord(f"shards: {exc}") from None


#: The names of a leader record's timing settings (``Config.service_timing``).
_TIMING_NAMES = frozenset(Config().service_timing())


def timing_pairs(timing: Any) -> tuple[tuple[str, float], ...]:
    """A leader record's timing settings (``Config.service_timing``) as
    sorted (name, seconds) pairs; anything but a map of those names to
    finite numbers reads as none of them (a replica of another version may
    write other things: its record is still a leader's)."""
    if not isinstance(timing, dict):
        return ()
    return tuple(sorted(
        (name, float(value)) for name, value in timing.items()
        if name in _TIMING_NAMES and isinstance(value, int | float) and not isinstance(value, bool)
        and math.isfinite(value)
    ))  # fmt: skip


def check_leader(value: bytes, lease: int) -> tuple[str, str, int, tuple[tuple[str, float], ...]]:
    """``(replica_id, address, lease_id, timing)`` of a leader record: the
    lease it names is the one the key is tied to (a leader key always has
    one); ``timing`` as ``timing_pairs`` reads it."""
    data = _object(load_json(value), "leader record")
    replica_id = _text(data, "replica_id")
    if not replica_id or len(replica_id) > _MAX_REPLICA_ID or not replica_id.isprintable():
        raise MalformedRecord("replica_id is empty, too long or not printable")
    address = _address(data, "address", Config())
    lease_id = _counter(data, "lease_id")
    if lease == 0:
        raise MalformedRecord("the key is not tied to a lease, as every leader key is")
    if lease_id != lease:
        raise MalformedRecord(f"it names lease {lease_id}, but the key is tied to lease {lease}")
    assert lease_id is not None
    return replica_id, address, lease_id, timing_pairs(data.get("timing"))


def check_member_record(member_id: str, value: bytes, lease: int, config: Config) -> Member:
    """A member record stored under ``members/<member_id>``: its own id, a
    valid address, and tied to a lease."""
    member = check_member(load_json(value), config)
    if member.id != member_id:
        raise MalformedRecord(f"it holds member {member.id!r}, not {member_id!r}")
    if lease == 0:
        raise MalformedRecord("the key is not tied to a lease, as every member record is")
    return member


def check_progress(value: bytes) -> tuple[int, int]:
    """``(epoch, step)`` of a progress record."""
    data = _object(load_json(value), "progress record")
    epoch, step = _counter(data, "epoch"), _counter(data, "step")
    assert epoch is not None and step is not None
    return epoch, step


def check_lost(value: bytes) -> int:
    """The epoch of a lost-history record (``{"epoch"}``)."""
    epoch = _counter(_object(load_json(value), "lost-history record"), "epoch")
    assert epoch is not None
    return epoch


def check_checkpoints(value: bytes, config: Config) -> tuple[list[CheckpointManifest], list[str]]:
    """The valid manifests of a checkpoint list, newest first, and why each
    other entry was left out."""
    data = load_json(value)
    if not isinstance(data, list):
        raise MalformedRecord(f"a JSON {type(data).__name__}, not a list of manifests")
    kept: list[CheckpointManifest] = []
    skipped: list[str] = []
    for index, entry in enumerate(data):
        try:
            kept.append(check_manifest(entry, config))
        except MalformedRecord as exc:
            skipped.append(f"entry {index}: {exc}")
    kept.sort(key=lambda m: m.step, reverse=True)
    return kept, skipped


def check_manifest(entry: Any, config: Config) -> CheckpointManifest:
    entry = _object(entry, "manifest")
    for name in ("step", "size", "epoch"):
        _counter(entry, name)
    for name in ("digest", "uri", "sha256", "writer"):
        _text(entry, name)
    for name in ("created_unix", "step_seconds"):
        if type(entry.get(name)) not in (int, float):
            raise MalformedRecord(f"{name} is not a number")
    try:
        manifest = CheckpointManifest.from_dict(entry)
    except (InvalidRequest, KeyError, TypeError, ValueError) as exc:
        raise MalformedRecord(str(exc)[:120]) from None
    for digest in (manifest.digest, *(d for part in manifest.parts for d in part.digests)):
        _checked(check_digest, digest, config)
    _checked(check_id, manifest.writer, "checkpoint writer", config)
    return manifest
