"""Why a roll call is held: typed causes, carried from the trigger to the
committed view, the members' roll-call requests and the events file."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CauseKind(enum.Enum):
    """What happened to the member a cause names."""

    #: A new member asked to join.
    JOIN = "join"
    #: A member left cleanly.
    LEAVE = "leave"
    #: The leader suspects the member dead (stream broken, detector, no
    #: session after a join or a takeover).
    SUSPECT = "suspect"
    #: A member reported the member failing (or, naming itself, asked for a
    #: roll call): it is called again, and keeps its place if it answers.
    REPORT = "report"


@dataclass(frozen=True)
class Cause:
    """One reason for a roll call: what happened to which member, and for
    a report, who reported it. ``str`` gives its wire text (the roll-call
    request's ``causes`` and the events file's ``causes``), e.g.
    ``"join:w-1a2b"`` or ``"report:w-1a2b by w-3c4d"``."""

    kind: CauseKind
    member_id: str
    reporter: str | None = None

    @classmethod
    def join(cls, member_id: str) -> Cause:
        return cls(CauseKind.JOIN, member_id)

    @classmethod
    def leave(cls, member_id: str) -> Cause:
        return cls(CauseKind.LEAVE, member_id)

    @classmethod
    def suspect(cls, member_id: str) -> Cause:
        return cls(CauseKind.SUSPECT, member_id)

    @classmethod
    def report(cls, member_id: str, reporter: str) -> Cause:
        return cls(CauseKind.REPORT, member_id, reporter)

    def __str__(self) -> str:
        text = f"{self.kind.value}:{self.member_id}"
        return text if self.reporter is None else f"{text} by {self.reporter}"

    @classmethod
    def parse(cls, text: str) -> Cause | None:
        """The cause whose wire text is ``text`` (the inverse of ``str``),
        or None if it is not one (a leader of another version, or noise)."""
        head, _, rest = text.partition(":")
        try:
            kind = CauseKind(head)
        except ValueError:
            return None
        member_id, by, reporter = rest.partition(" by ")
        if not member_id or " " in member_id:
            return None
        if kind is CauseKind.REPORT:
            return cls(kind, member_id, reporter) if by and reporter else None
        return None if by else cls(kind, member_id)
