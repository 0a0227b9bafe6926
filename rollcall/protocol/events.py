"""The events file's schema (docs/events.md), defined once: the rendezvous
service writes its records with it (``rollcall.rendezvous.events``) and
``rollcall report`` and ``rollcall up`` read them back with it.

Each kind of record is a frozen dataclass whose fields are the record's
fields, in the order they are written; :func:`to_record` makes the JSON
object of one (the common header ``schema``, ``kind``, ``time``, ``job``
first) and :func:`from_record` checks and reads one back. Reading is
forgiving where the schema says to be: unknown fields are ignored, a list
of ids that is missing is empty, and an optional value that is missing is
None. A field of the wrong type is :class:`MalformedEvent`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, TypeVar

#: The ``schema`` of every record; a later version that changes a field
#: changes it.
SCHEMA = "rollcall.events/1"


class Kind(StrEnum):
    """The ``kind`` of a record."""

    VIEW_CHANGE = "view_change"
    PROGRESS = "progress"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINTS_FORGOTTEN = "checkpoints_forgotten"


class Cause(StrEnum):
    """The one-word ``cause`` of a view change."""

    START = "start"
    JOIN = "join"
    LEAVE = "leave"
    CRASH = "crash"
    SUSPECTED = "suspected"
    REPORT = "report"
    TAKEOVER = "takeover"
    MIXED = "mixed"


#: The causes that are a kind of trigger the leader notes (the others say
#: there was none, or several).
TRIGGERS = (Cause.JOIN, Cause.LEAVE, Cause.CRASH, Cause.SUSPECTED, Cause.REPORT, Cause.TAKEOVER)


class MalformedEvent(ValueError):
    """A record of a known kind has a field of the wrong type, or lacks a
    required one."""


@dataclass(frozen=True)
class Phases:
    """A view change's stall broken down, seconds (None: not reported)."""

    detect_s: float | None = None
    rollcall_s: float | None = None
    fetch_s: float | None = None
    rebuild_s: float | None = None
    first_step_s: float | None = None


@dataclass(frozen=True)
class ViewChange:
    """A view change, written once it is over."""

    KIND: ClassVar[Kind] = Kind.VIEW_CHANGE

    time: float
    epoch: int
    #: A :class:`Cause`, or a cause of a later version (read as it is).
    cause: str
    causes: tuple[str, ...]
    members_before: tuple[str, ...]
    members_after: tuple[str, ...]
    joined: tuple[str, ...]
    removed: tuple[str, ...]
    resume_step: int | None
    global_batch: int | None
    samples: int | None
    stall_s: float | None
    phases: Phases
    lost_work_s: float | None
    restart_cost_s: float | None

    @property
    def end(self) -> float | None:
        """When the stall ends: the last member committed its first step."""
        return None if self.stall_s is None else self.time + self.stall_s


@dataclass(frozen=True)
class Progress:
    """The job's progress, about once a second while steps commit."""

    KIND: ClassVar[Kind] = Kind.PROGRESS

    time: float
    epoch: int
    step: int
    members: int
    samples: int | None


@dataclass(frozen=True)
class Checkpoint:
    """A durable checkpoint was recorded."""

    KIND: ClassVar[Kind] = Kind.CHECKPOINT

    time: float
    step: int
    epoch: int
    writer: str
    uri: str
    size: int


@dataclass(frozen=True)
class CheckpointFailed:
    """A member could not make a checkpoint durable."""

    KIND: ClassVar[Kind] = Kind.CHECKPOINT_FAILED

    time: float
    step: int
    reason: str
    writer: str
    failures: int
    since: float
    durable_step: int | None


@dataclass(frozen=True)
class CheckpointsForgotten:
    """An operator removed manifests from the job's checkpoint record."""

    KIND: ClassVar[Kind] = Kind.CHECKPOINTS_FORGOTTEN

    time: float
    steps: tuple[int, ...]
    uris: tuple[str, ...]
    durable_step: int | None


#: A record of any kind.
Event = ViewChange | Progress | Checkpoint | CheckpointFailed | CheckpointsForgotten
T = TypeVar("T")


def to_record(event: Event, job: str) -> dict[str, Any]:
    """The JSON object of ``event``: the header, then its fields in order
    (tuples as lists, the phases as an object)."""
    record: dict[str, Any] = {"schema": SCHEMA, "kind": str(event.KIND), "time": event.time}
    record["job"] = job
    for field in dataclasses.fields(event):
        if field.name != "time":
            record[field.name] = _json_value(getattr(event, field.name))
    return record


def _json_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Phases):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, StrEnum):
        return str(value)
    return value


def from_record(kind: type[T], record: dict[str, Any], **known: Any) -> T:
    """Read a record of ``kind`` (one of the dataclasses above, or a
    subclass whose own fields are given in ``known``; its ``schema`` and
    ``kind`` already checked by the caller), or ``Phases``;
    :class:`MalformedEvent` says what is wrong."""
    values = {
        field.name: _READERS[str(field.type)](record, field.name)
        for field in dataclasses.fields(kind)  # type: ignore[arg-type]
        if field.name not in known
    }
    return kind(**values, **known)


def _number(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise MalformedEvent(f"{key!r} must be a number, got {value!r}")
    return float(value)


def _integer(record: dict[str, Any], key: str) -> int | None:
    value = record.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedEvent(f"{key!r} must be an integer, got {value!r}")
    return value


def _text(record: dict[str, Any], key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise MalformedEvent(f"{key!r} must be a string, got {value!r}")
    return value


def _required(read: Callable[[dict[str, Any], str], Any]) -> Callable[[dict[str, Any], str], Any]:
    def required(record: dict[str, Any], key: str) -> Any:
        if record.get(key) is None:
            raise MalformedEvent(f"{key!r} is missing")
        return read(record, key)

    return required


def _ids(record: dict[str, Any], key: str) -> tuple[str, ...]:
    value = record.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise MalformedEvent(f"{key!r} must be a list of member ids")
    return tuple(value)


def _integers(record: dict[str, Any], key: str) -> tuple[int, ...]:
    value = record.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise MalformedEvent(f"{key!r} must be a list of integers")
    return tuple(value)


def _phases(record: dict[str, Any], key: str) -> Phases:
    value = record.get(key)
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise MalformedEvent(f"{key!r} must be an object, got {value!r}")
    return from_record(Phases, value)


#: How a field is read, by its declared type.
_READERS: dict[str, Callable[[dict[str, Any], str], Any]] = {
    "float": _required(_number),
    "float | None": _number,
    "int": _required(_integer),
    "int | None": _integer,
    "str": _text,
    "tuple[str, ...]": _ids,
    "tuple[int, ...]": _integers,
    "Phases": _phases,
}
