"""The run an events file records (``docs/events.md``, read by the schema
of ``rollcall.protocol.events``), and what it adds up to: goodput, the
members and committed samples over time, stalls.

Goodput follows ``docs/events.md``: ``1 - stalled / duration``, the duration
running from the first ``progress`` record to the last record. A stall is
counted for the part of its band that falls within that window (a ``start``
view change stalls before the first step, so before the window), and
overlapping bands are counted once. For bands inside the window, which is
the normal case, this is exactly ``1 - sum(stall_s) / duration``.

Reading is forgiving where the schema says to be (a torn last line, unknown
fields, unknown kinds) and strict elsewhere: a missing or empty file, a file
of another schema, or one with no usable record is a ``ReportError`` that
the command line prints as one line.

Everything but ``read_events`` is pure: text in, numbers out.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import click

from rollcall.protocol import events
from rollcall.protocol.events import SCHEMA, Kind, MalformedEvent, from_record

#: The table lists at most this many view changes (the largest stalls).
TABLE_ROWS = 12


class ReportError(click.ClickException):
    """The events file cannot be drawn; the message says why."""


@dataclass(frozen=True)
class ViewChange(events.ViewChange):
    """One ``view_change`` record; ``line`` is its 1-based line in the file."""

    line: int

    @property
    def commit_time(self) -> float:
        """When the new view was committed (the member count changes), kept
        inside the band."""
        at = self.time + (self.phases.detect_s or 0.0) + (self.phases.rollcall_s or 0.0)
        end = self.end
        return at if end is None else min(at, end)


@dataclass(frozen=True)
class Progress(events.Progress):
    """One ``progress`` record; ``line`` is its 1-based line in the file."""

    line: int


@dataclass(frozen=True)
class Run:
    """The usable records of an events file, each kind sorted by time
    (a view change is written when it is over, so the file is not)."""

    source: str
    job: str | None
    view_changes: tuple[ViewChange, ...]
    progress: tuple[Progress, ...]
    #: Complete lines that were not JSON objects or were malformed records
    #: (a torn last line is expected and not counted).
    skipped: int

    @property
    def start(self) -> float:
        """Time of the earliest record (the origin of the plots' x axis)."""
        return min(self._times())

    @property
    def end(self) -> float:
        """Time of the latest record."""
        return max(self._times())

    def _times(self) -> list[float]:
        return [v.time for v in self.view_changes] + [p.time for p in self.progress]


@dataclass(frozen=True)
class Goodput:
    """Goodput over ``[start, end]``; ``fraction`` is None without a duration."""

    start: float | None
    end: float
    stalled_s: float

    @property
    def duration_s(self) -> float:
        return 0.0 if self.start is None else self.end - self.start

    @property
    def fraction(self) -> float | None:
        if self.duration_s <= 0:
            return None
        return 1.0 - self.stalled_s / self.duration_s


@dataclass(frozen=True)
class StallStats:
    """Stalls over every view change of a run (None: no stall reported)."""

    count: int
    with_stall: int
    median_s: float | None
    max_s: float | None


# ---------------------------------------------------------------- reading


def read_events(path: Path) -> Run:
    """Read and parse an events file, or raise ``ReportError``."""
    if not path.exists():
        raise ReportError(f"events file {str(path)!r} does not exist")
    if path.is_dir():
        raise ReportError(f"{str(path)!r} is a directory, not an events file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ReportError(f"cannot read {str(path)!r}: {exc.strerror}") from None
    return parse_events(data.decode("utf-8", errors="replace"), str(path))


def parse_events(text: str, source: str) -> Run:
    """Parse the text of an events file (``source`` names it in errors)."""
    if not text.strip():
        raise ReportError(f"events file {source!r} is empty")
    lines = text.split("\n")
    # A file being appended to may end in a line still being written: no
    # newline after it yet. Only that line may be torn without complaint.
    last_is_partial = not text.endswith("\n")
    view_changes: list[ViewChange] = []
    progress: list[Progress] = []
    unreadable = 0
    malformed: list[str] = []
    job: str | None = None
    for index, raw in enumerate(lines):
        number = index + 1
        line = raw.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if not (last_is_partial and index == len(lines) - 1):
                unreadable += 1
            continue
        if not isinstance(record, dict):
            unreadable += 1
            continue
        schema = record.get("schema")
        if schema != SCHEMA:
            found = "has no schema" if schema is None else f"has schema {schema!r}"
            raise ReportError(
                f"{source!r} is not a rollcall events file: line {number} {found}, "
                f"expected {SCHEMA!r}"
            )
        kind = record.get("kind")
        try:
            if kind == Kind.VIEW_CHANGE:
                view_changes.append(from_record(ViewChange, record, line=number))
            elif kind == Kind.PROGRESS:
                progress.append(from_record(Progress, record, line=number))
            else:
                continue  # a kind the report does not draw: ignore it
        except MalformedEvent as exc:
            malformed.append(f"line {number}: {exc}")
            continue
        if job is None and isinstance(record.get("job"), str):
            job = record["job"]
    if not view_changes and not progress:
        reasons = []
        if unreadable:
            reasons.append(f"{unreadable} line(s) are not JSON objects")
        if malformed:
            reasons.append(f"{len(malformed)} record(s) are malformed (first: {malformed[0]})")
        why = "; ".join(reasons) if reasons else "no view_change or progress record"
        raise ReportError(f"no usable record in {source!r}: {why}")
    return Run(
        source=source,
        job=job,
        view_changes=tuple(sorted(view_changes, key=lambda v: v.time)),
        progress=tuple(sorted(progress, key=lambda p: p.time)),
        skipped=unreadable + len(malformed),
    )


# ------------------------------------------------------------ aggregation


def goodput(run: Run) -> Goodput:
    """Goodput as docs/events.md defines it (see the module docstring for
    bands that reach outside the window or overlap)."""
    start = run.progress[0].time if run.progress else None
    end = run.end
    if start is None or end <= start:
        return Goodput(start=start, end=end, stalled_s=0.0)
    bands = sorted(
        (max(v.time, start), min(v.time + v.stall_s, end))
        for v in run.view_changes
        if v.stall_s is not None
    )
    stalled = 0.0
    reach = start
    for low, high in bands:
        low = max(low, reach)
        if high > low:
            stalled += high - low
            reach = high
    return Goodput(start=start, end=end, stalled_s=stalled)


def members_series(run: Run) -> list[tuple[float, int]]:
    """The member count as ``(time, count)`` steps: each view change's old
    count at its trigger and new count at its commit, and each progress
    record's count; consecutive repeats dropped."""
    points: list[tuple[float, int]] = []
    for v in run.view_changes:
        points.append((v.time, len(v.members_before)))
        points.append((v.commit_time, len(v.members_after)))
    points.extend((p.time, p.members) for p in run.progress)
    points.sort(key=lambda point: point[0])
    series: list[tuple[float, int]] = []
    for time, count in points:
        if not series or series[-1][1] != count:
            series.append((time, count))
    return series


def samples_series(run: Run) -> list[tuple[float, int]]:
    """Cumulative committed samples as ``(time, samples)`` points, to be
    joined by straight lines. Each view change with a stall adds the same
    value at both ends of its band; if its ``samples`` is null, the last
    value known before it (a lower bound) holds the band flat."""
    events: list[tuple[float, int, ViewChange | Progress]] = [(p.time, 1, p) for p in run.progress]
    events.extend((v.time, 0, v) for v in run.view_changes)
    events.sort(key=lambda e: (e[0], e[1]))
    points: list[tuple[float, int]] = []
    known: int | None = None
    for _time, _order, record in events:
        if isinstance(record, Progress):
            if record.samples is not None:
                points.append((record.time, record.samples))
                known = record.samples
            continue
        value = record.samples if record.samples is not None else known
        if value is None:
            continue
        points.append((record.time, value))
        if record.end is not None:
            points.append((record.end, value))
        known = value
    points.sort(key=lambda point: point[0])
    return points


def stall_stats(run: Run) -> StallStats:
    stalls = [v.stall_s for v in run.view_changes if v.stall_s is not None]
    return StallStats(
        count=len(run.view_changes),
        with_stall=len(stalls),
        median_s=statistics.median(stalls) if stalls else None,
        max_s=max(stalls) if stalls else None,
    )


def causes(run: Run) -> dict[str, int]:
    """Number of view changes by cause, causes in alphabetical order."""
    counts = Counter(v.cause for v in run.view_changes)
    return dict(sorted(counts.items()))


def largest_stalls(run: Run, limit: int = TABLE_ROWS) -> list[tuple[int, ViewChange]]:
    """The view changes for the table as ``(number, view change)``, numbered
    from 1 in time order: all of them, or the ``limit`` largest stalls (a
    null stall counts as smallest), kept in time order."""
    numbered = list(enumerate(run.view_changes, start=1))
    if len(numbered) <= limit:
        return numbered
    by_stall = sorted(
        numbered,
        key=lambda item: (item[1].stall_s if item[1].stall_s is not None else -1.0, -item[0]),
        reverse=True,
    )
    return sorted(by_stall[:limit], key=lambda item: item[0])
