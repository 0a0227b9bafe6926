"""View-change events (docs/events.md): the leader's account of each view
change, completed by the members' own reports, one JSON line each, by the
schema of ``rollcall.protocol.events``.

:class:`EventLog` is pure: the service tells it what happened and when (its
monotonic clock), and takes back the records to write. :class:`EventFile`
appends them to a file.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, cast

from rollcall.membership.cause import Cause as RollCallCause
from rollcall.membership.cause import CauseKind
from rollcall.membership.checkpoint import CheckpointFailure, CheckpointManifest, ReplayCost
from rollcall.membership.config import Config
from rollcall.membership.view import View
from rollcall.private import open_private_append
from rollcall.protocol.events import (
    Cause,
    Checkpoint,
    CheckpointFailed,
    CheckpointsForgotten,
    Event,
    Phases,
    Progress,
    ViewChange,
    to_record,
)

log = logging.getLogger("rollcall.events")


@dataclass(frozen=True)
class MemberReport:
    """A member's account of entering a view (sent after its first commit in it)."""

    fetch_s: float
    rebuild_s: float
    first_step_s: float
    lost_work_s: float
    step_s: float
    launch_s: float
    global_batch: int


#: The event cause each kind of roll-call cause stands for.
_KIND_OF = {
    CauseKind.JOIN: Cause.JOIN,
    CauseKind.LEAVE: Cause.LEAVE,
    CauseKind.SUSPECT: Cause.SUSPECTED,
    CauseKind.REPORT: Cause.REPORT,
}


def cause_kind(kinds: set[str], causes: Sequence[RollCallCause]) -> str:
    """The one-word cause of a view change: the kinds of trigger the leader
    noted, else (after a takeover, say) those of the coordinator's causes."""
    if not kinds:
        kinds = {_KIND_OF[c.kind] for c in causes}
    if not kinds:
        return Cause.START
    return next(iter(kinds)) if len(kinds) == 1 else Cause.MIXED


@dataclass
class _Pending:
    view: View
    before: View
    causes: tuple[RollCallCause, ...]
    cause: str
    trigger: float
    detect_s: float
    rollcall_s: float
    committed: float
    checkpoint_step: int | None
    reports: dict[str, tuple[float, MemberReport]] = field(default_factory=dict)


class EventLog:
    """Collects what the leader sees of view changes into event records."""

    def __init__(self, job: str, wall_offset: float, config: Config | None = None) -> None:
        #: ``event_timeout`` (a view change's record is written at the latest
        #: this long after its commit) and ``progress_event_interval``.
        self._config = config or Config()
        #: Unix time = monotonic time + wall_offset.
        self._job = job
        self._wall_offset = wall_offset
        self._trigger: float | None = None
        self._kinds: set[str] = set()
        self._detect_s = 0.0
        self._rollcall_at: float | None = None
        self._pending: _Pending | None = None
        self._last_progress: tuple[float, int] | None = None
        self._global_batch: int | None = None
        self.checkpoint_step: int | None = None

    def _record(self, event: Event) -> dict[str, Any]:
        return to_record(event, self._job)

    def _time(self, at: float) -> float:
        """Unix time of monotonic time ``at``, as records carry it."""
        return round(at + self._wall_offset, 6)

    @property
    def global_batch(self) -> int | None:
        """Samples per step, as the members reported it."""
        return self._global_batch

    # --- what the leader tells it -------------------------------------------

    def cause(self, now: float, kind: str, detect_s: float = 0.0) -> None:
        """A trigger of ``kind`` (one of ``TRIGGERS``) reached the leader;
        ``detect_s`` is how long the member had been silent before (0 for
        joins, leaves and reports)."""
        self._kinds.add(kind)
        trigger = now - detect_s
        if self._trigger is None or trigger < self._trigger:
            self._trigger = trigger
            self._detect_s = detect_s

    def rollcall(self, now: float) -> None:
        """A roll call was opened."""
        if self._rollcall_at is None:
            self._rollcall_at = now
        if self._trigger is None:
            self._trigger = now

    def committed(
        self, view: View, before: View, causes: Sequence[RollCallCause], now: float
    ) -> list[dict[str, Any]]:
        """A view was committed. Returns the records now complete (the
        previous view change, if still open)."""
        out = self._close() if self._pending is not None else []
        trigger = self._trigger if self._trigger is not None else now
        rollcall_at = self._rollcall_at if self._rollcall_at is not None else trigger
        self._pending = _Pending(
            view=view, before=before, causes=tuple(causes),
            cause=cause_kind(self._kinds, causes), trigger=trigger,
            detect_s=self._detect_s, rollcall_s=max(0.0, now - rollcall_at), committed=now,
            checkpoint_step=self.checkpoint_step,
        )  # fmt: skip
        self._trigger, self._detect_s, self._rollcall_at = None, 0.0, None
        self._kinds = set()
        if not view.members:
            out += self._close()
        return out

    def report(self, member_id: str, epoch: int, report: MemberReport, now: float) -> list[Any]:
        """A member committed its first step in view ``epoch``."""
        self._global_batch = report.global_batch or self._global_batch
        pending = self._pending
        if pending is None or pending.view.epoch != epoch or member_id not in pending.view:
            return []
        pending.reports[member_id] = (now, report)
        if set(pending.reports) >= set(pending.view.ids):
            return self._close()
        return []

    def progress(self, now: float, view: View, step: int | None) -> list[dict[str, Any]]:
        if step is None:
            return []
        last = self._last_progress
        interval = self._config.progress_event_interval
        if last is not None and (last[1] == step or now - last[0] < interval):
            return []
        self._last_progress = (now, step)
        return [
            self._record(
                Progress(
                    time=self._time(now),
                    epoch=view.epoch,
                    step=step,
                    members=view.size,
                    samples=self._samples(step),
                )
            )
        ]

    def checkpoint(self, now: float, manifest: CheckpointManifest) -> list[dict[str, Any]]:
        """A checkpoint was recorded (durability is at its step)."""
        self.checkpoint_step = manifest.step
        return [
            self._record(
                Checkpoint(
                    time=self._time(now),
                    step=manifest.step,
                    epoch=manifest.epoch,
                    writer=manifest.writer,
                    uri=manifest.uri,
                    size=manifest.size,
                )
            )
        ]

    def checkpoint_failed(self, now: float, failure: CheckpointFailure) -> list[dict[str, Any]]:
        """A checkpoint failed to be written or published: durability is
        stuck at the newest recorded one."""
        return [
            self._record(
                CheckpointFailed(
                    time=self._time(now),
                    step=failure.step,
                    reason=failure.reason,
                    writer=failure.writer,
                    failures=failure.failures,
                    since=failure.since_unix,
                    durable_step=self.checkpoint_step,
                )
            )
        ]

    def checkpoints_forgotten(
        self, now: float, forgotten: Sequence[CheckpointManifest], newest: int | None
    ) -> list[dict[str, Any]]:
        """An operator removed manifests from the record (``rollcall
        checkpoints forget``)."""
        self.checkpoint_step = newest
        return [
            self._record(
                CheckpointsForgotten(
                    time=self._time(now),
                    steps=tuple(m.step for m in forgotten),
                    uris=tuple(m.uri for m in forgotten),
                    durable_step=newest,
                )
            )
        ]

    def tick(self, now: float) -> list[dict[str, Any]]:
        pending = self._pending
        if pending is not None and now - pending.committed >= self._config.event_timeout:
            return self._close()
        return []

    def flush(self) -> list[dict[str, Any]]:
        """Everything still open (the leader is stopping)."""
        return self._close() if self._pending is not None else []

    # --- building the record -----------------------------------------------------

    def _samples(self, step: int | None) -> int | None:
        if step is None or self._global_batch is None:
            return None
        return (step + 1) * self._global_batch

    def _close(self) -> list[dict[str, Any]]:
        pending, self._pending = self._pending, None
        assert pending is not None
        reports = [r for _, r in pending.reports.values()]
        complete = bool(reports) and len(reports) == pending.view.size
        last_first_commit = max((t for t, _ in pending.reports.values()), default=None)

        def longest(name: str) -> float | None:
            values = [getattr(r, name) for r in reports]
            return round(max(values), 6) if values and complete else None

        resume = pending.view.resume_step
        restart_cost = None
        if reports:
            launch = sum(r.launch_s for r in reports) / len(reports)
            step_s = sum(r.step_s for r in reports) / len(reports)
            done = resume if resume is not None else -1
            saved = pending.checkpoint_step if pending.checkpoint_step is not None else -1
            restart_cost = round(ReplayCost(done, saved, step_s, launch, 0.0).seconds, 6)
        before_ids, after_ids = pending.before.ids, pending.view.ids
        return [
            self._record(
                ViewChange(
                    time=self._time(pending.trigger),
                    epoch=pending.view.epoch,
                    cause=pending.cause,
                    causes=tuple(str(c) for c in pending.causes),
                    members_before=tuple(before_ids),
                    members_after=tuple(after_ids),
                    joined=tuple(m for m in after_ids if m not in pending.before),
                    removed=tuple(m for m in before_ids if m not in pending.view),
                    resume_step=resume,
                    global_batch=self._global_batch,
                    samples=self._samples(resume),
                    stall_s=(
                        round(last_first_commit - pending.trigger, 6)
                        if complete and last_first_commit is not None
                        else None
                    ),
                    phases=Phases(
                        detect_s=round(pending.detect_s, 6),
                        rollcall_s=round(pending.rollcall_s, 6),
                        fetch_s=longest("fetch_s"),
                        rebuild_s=longest("rebuild_s"),
                        first_step_s=longest("first_step_s"),
                    ),
                    lost_work_s=round(sum(r.lost_work_s for r in reports), 6),
                    restart_cost_s=restart_cost,
                )
            )
        ]


class EventFile:
    """Appends records as JSON lines, flushed one by one."""

    def __init__(self, path: Path) -> None:
        if not path.parent.exists():
            path.parent.mkdir(mode=0o700, parents=True)
        self.path = path
        # Created 0600: the events name every member and its address.
        self._file = cast(TextIO, open_private_append(path))

    def write(self, records: Sequence[dict[str, Any]]) -> None:
        for record in records:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        if records:
            self._file.flush()

    def close(self) -> None:
        self._file.close()
