"""How many roll calls one member's reports may start: a token bucket per
member, with time passed in.

A failure report (a peer failing, or a member asking for a roll call about
itself) aborts every member's step and rebuilds the group, so a member
flooding them could keep the job from training. Each member may start
``burst`` roll calls in a row; after that one more per ``interval``. What is
over the limit is ignored: the leader's own detector and the members'
sessions still find real failures.

``LogThrottle`` is the same idea for log lines: an event any token holder
can repeat (a refused claim) is logged once per interval at most.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass


class Admission(enum.Enum):
    """Whether a report may start a roll call."""

    TAKEN = "within the member's limit"
    REFUSED = "over the member's limit: the first refusal since it was last within it"
    STILL_REFUSED = "over the member's limit again"


@dataclass
class _Bucket:
    tokens: float
    at: float
    refusing: bool = False


class ReportLimiter:
    """Per-member token bucket: ``burst`` at once, then one per ``interval`` seconds."""

    def __init__(self, burst: int, interval: float) -> None:
        if burst < 1 or not interval > 0:
            raise ValueError(f"a report limit needs burst >= 1 and interval > 0, got {burst}, "
                             f"{interval}")  # fmt: skip
        self._burst = burst
        self._interval = interval
        self._buckets: dict[str, _Bucket] = {}

    def take(self, member_id: str, now: float) -> Admission:
        """Spend one of ``member_id``'s roll calls at ``now``, if it has one left."""
        bucket = self._buckets.get(member_id)
        if bucket is None:
            bucket = self._buckets[member_id] = _Bucket(float(self._burst), now)
        refill = max(0.0, now - bucket.at) / self._interval
        bucket.tokens, bucket.at = min(float(self._burst), bucket.tokens + refill), now
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            bucket.refusing = False
            return Admission.TAKEN
        if bucket.refusing:
            return Admission.STILL_REFUSED
        bucket.refusing = True
        return Admission.REFUSED

    def keep_only(self, member_ids: Collection[str]) -> None:
        """Forget every member not in ``member_ids`` (memory stays bounded by
        the view)."""
        for member_id in [m for m in self._buckets if m not in member_ids]:
            del self._buckets[member_id]

    def __contains__(self, member_id: object) -> bool:
        return member_id in self._buckets


class LogThrottle:
    """At most one log line per ``interval`` seconds for an event anyone
    can cause again and again (a refused claim, say), with time passed in:
    a flood of requests must not fill the log's disk, and the line after
    a quiet spell says how many were left out."""

    def __init__(self, interval: float) -> None:
        if not interval > 0:
            raise ValueError(f"a log throttle needs interval > 0, got {interval}")
        self._interval = interval
        self._last: float | None = None
        self._left_out = 0

    def due(self, now: float) -> int | None:
        """None: leave this event's line out. Otherwise log it now, saying
        that this many were left out since the last line."""
        if self._last is not None and now - self._last < self._interval:
            self._left_out += 1
            return None
        left_out, self._left_out, self._last = self._left_out, 0, now
        return left_out
