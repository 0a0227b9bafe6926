"""``rollcall report EVENTS.jsonl -o report.png``: one picture of a run.

The input is the events file the rendezvous service writes
(``docs/events.md``, schema ``rollcall.events/1``). The picture has three
parts sharing one story, read top to bottom:

1. **Members over time**, a step line. The count changes when a new view is
   committed (the view change's ``time + detect_s + rollcall_s``), and the
   ``members`` of every ``progress`` record pins it in between.
2. **Cumulative committed samples over time**, from the ``samples`` of the
   ``progress`` records and of the view changes. Nothing is committed while
   a view change stalls, so the line is flat across each band.

   On both plots every view change is a band shaded by its cause, from its
   ``time`` (the trigger) to ``time + stall_s``, numbered ``#1, #2, ...`` in
   time order. Bands are drawn to scale; an edge line keeps a band of a few
   milliseconds visible on a run of minutes. A view change without a stall
   (``stall_s`` null) is a dashed line.
3. **A table** of the view changes with their stall and its phases (detect,
   roll call, state fetch, group rebuild, first step), the compute thrown
   away (lost work) and what a restart from the last checkpoint would have
   cost instead. A long run shows only its ``TABLE_ROWS`` largest stalls,
   still in time order; the line under the table sums up every event
   (count, causes, median and maximum stall) and gives the goodput.

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

Everything but ``read_events``, ``draw`` and the ``report`` command is pure:
text in, numbers out.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from matplotlib.axes import Axes

#: The only schema this reader understands.
SCHEMA = "rollcall.events/1"
#: The table lists at most this many view changes (the largest stalls).
TABLE_ROWS = 12

#: Band colour for each cause (docs/events.md); anything else is "other".
CAUSE_COLOURS = {
    "crash": "#d62728",
    "suspected": "#ff7f0e",
    "report": "#e377c2",
    "leave": "#1f77b4",
    "join": "#2ca02c",
    "start": "#7f7f7f",
    "takeover": "#9467bd",
    "mixed": "#8c564b",
}
OTHER_COLOUR = "#bcbd22"
#: Relative widths of the table's columns (the numbers need less room).
COLUMN_WIDTHS = (0.5, 0.8, 1.0, 0.7, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.15)
#: Height of a table row and of the summary line under the table, inches.
ROW_INCHES = 0.3
FOOTER_INCHES = 0.4

#: Column headings of the table, in order (see ``table_cells``).
TABLE_HEADER = (
    "#",
    "at",
    "cause",
    "epoch",
    "members",
    "stall",
    "detect",
    "roll call",
    "fetch",
    "rebuild",
    "first step",
    "lost work",
    "restart cost",
)


class ReportError(click.ClickException):
    """The events file cannot be drawn; the message says why."""


class _Malformed(Exception):
    """A record of the right schema and a known kind has a field of the wrong type."""


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
    """One ``view_change`` record; ``line`` is its 1-based line in the file."""

    line: int
    time: float
    epoch: int
    cause: str
    members_before: tuple[str, ...]
    members_after: tuple[str, ...]
    stall_s: float | None
    phases: Phases
    lost_work_s: float | None
    restart_cost_s: float | None
    samples: int | None

    @property
    def end(self) -> float | None:
        """When the band ends: the last member committed its first step."""
        return None if self.stall_s is None else self.time + self.stall_s

    @property
    def commit_time(self) -> float:
        """When the new view was committed (the member count changes), kept
        inside the band."""
        at = self.time + (self.phases.detect_s or 0.0) + (self.phases.rollcall_s or 0.0)
        end = self.end
        return at if end is None else min(at, end)


@dataclass(frozen=True)
class Progress:
    """One ``progress`` record."""

    line: int
    time: float
    epoch: int
    step: int
    members: int
    samples: int | None


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
            if kind == "view_change":
                view_changes.append(_view_change(record, number))
            elif kind == "progress":
                progress.append(_progress(record, number))
            else:
                continue  # a kind from a later version: ignore it
        except _Malformed as exc:
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


def _number(record: dict[str, Any], key: str, *, required: bool = False) -> float | None:
    value = record.get(key)
    if value is None:
        if required:
            raise _Malformed(f"{key!r} is missing")
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _Malformed(f"{key!r} must be a number, got {value!r}")
    return float(value)


def _integer(record: dict[str, Any], key: str, *, required: bool = False) -> int | None:
    value = record.get(key)
    if value is None:
        if required:
            raise _Malformed(f"{key!r} is missing")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Malformed(f"{key!r} must be an integer, got {value!r}")
    return value


def _ids(record: dict[str, Any], key: str) -> tuple[str, ...]:
    value = record.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _Malformed(f"{key!r} must be a list of member ids")
    return tuple(value)


def _required_number(record: dict[str, Any], key: str) -> float:
    value = _number(record, key, required=True)
    assert value is not None
    return value


def _required_integer(record: dict[str, Any], key: str) -> int:
    value = _integer(record, key, required=True)
    assert value is not None
    return value


def _view_change(record: dict[str, Any], line: int) -> ViewChange:
    cause = record.get("cause")
    if not isinstance(cause, str):
        raise _Malformed(f"'cause' must be a string, got {cause!r}")
    phases = record.get("phases")
    if phases is None:
        phases = {}
    if not isinstance(phases, dict):
        raise _Malformed(f"'phases' must be an object, got {phases!r}")
    return ViewChange(
        line=line,
        time=_required_number(record, "time"),
        epoch=_required_integer(record, "epoch"),
        cause=cause,
        members_before=_ids(record, "members_before"),
        members_after=_ids(record, "members_after"),
        stall_s=_number(record, "stall_s"),
        phases=Phases(
            detect_s=_number(phases, "detect_s"),
            rollcall_s=_number(phases, "rollcall_s"),
            fetch_s=_number(phases, "fetch_s"),
            rebuild_s=_number(phases, "rebuild_s"),
            first_step_s=_number(phases, "first_step_s"),
        ),
        lost_work_s=_number(record, "lost_work_s"),
        restart_cost_s=_number(record, "restart_cost_s"),
        samples=_integer(record, "samples"),
    )


def _progress(record: dict[str, Any], line: int) -> Progress:
    return Progress(
        line=line,
        time=_required_number(record, "time"),
        epoch=_required_integer(record, "epoch"),
        step=_required_integer(record, "step"),
        members=_required_integer(record, "members"),
        samples=_integer(record, "samples"),
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


def format_seconds(value: float | None) -> str:
    """``412 ms``, ``2.10 s``, ``305 s``; ``—`` when not reported."""
    if value is None:
        return "—"
    if abs(value) < 1.0:
        return f"{value * 1000:.0f} ms"
    if abs(value) < 100.0:
        return f"{value:.2f} s"
    return f"{value:.0f} s"


def table_cells(run: Run, limit: int = TABLE_ROWS) -> list[list[str]]:
    """The table's rows (columns as in ``TABLE_HEADER``)."""
    origin = run.start
    rows = []
    for number, v in largest_stalls(run, limit):
        rows.append(
            [
                f"#{number}",
                f"{v.time - origin:.1f} s",
                v.cause,
                str(v.epoch),
                f"{len(v.members_before)} → {len(v.members_after)}",
                format_seconds(v.stall_s),
                format_seconds(v.phases.detect_s),
                format_seconds(v.phases.rollcall_s),
                format_seconds(v.phases.fetch_s),
                format_seconds(v.phases.rebuild_s),
                format_seconds(v.phases.first_step_s),
                format_seconds(v.lost_work_s),
                format_seconds(v.restart_cost_s),
            ]
        )
    return rows


def format_goodput(run: Run) -> str:
    g = goodput(run)
    if g.start is None:
        return "goodput n/a (no progress record starts the run)"
    if g.fraction is None:
        return "goodput n/a (the run has no duration yet)"
    return (
        f"goodput {g.fraction:.1%} over {format_seconds(g.duration_s)} "
        f"({format_seconds(g.stalled_s)} stalled)"
    )


def _by_cause(run: Run) -> str:
    return ", ".join(f"{cause} {n}" for cause, n in causes(run).items()) or "none"


def _stall_range(stats: StallStats) -> str:
    return f"median {format_seconds(stats.median_s)}, max {format_seconds(stats.max_s)}"


def summary_line(run: Run) -> str:
    """One line: goodput, view changes by cause, median and maximum stall."""
    stats = stall_stats(run)
    parts = [format_goodput(run), f"{stats.count} view changes ({_by_cause(run)})"]
    if stats.with_stall:
        parts.append(f"stall {_stall_range(stats)}")
    return " · ".join(parts)


def summary_text(run: Run) -> str:
    """The text the command prints: the same facts as the picture's footer."""
    stats = stall_stats(run)
    lines = [f"rollcall report: {run.source}" + (f" (job {run.job})" if run.job else "")]
    lines.append(f"  {format_goodput(run)}")
    lines.append(f"  view changes: {stats.count} ({_by_cause(run)})")
    if stats.with_stall:
        missing = stats.count - stats.with_stall
        lines.append(
            f"  stall: {_stall_range(stats)}" + (f" ({missing} without a stall)" if missing else "")
        )
    lines.append(f"  progress records: {len(run.progress)}")
    if run.skipped:
        lines.append(f"  skipped {run.skipped} unreadable or malformed line(s)")
    return "\n".join(lines)


# ---------------------------------------------------------------- drawing


def draw(run: Run, output: Path, title: str | None = None) -> None:
    """Draw the run as a PNG at ``output``, replaced atomically (a failure
    leaves no partial file)."""
    # Imported here: matplotlib is slow to import, and `rollcall --help`
    # must stay instant. Figure without pyplot: no global state, no display.
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import EngFormatter, MaxNLocator

    origin = run.start
    shown = largest_stalls(run)
    numbers = {number for number, _ in shown}
    cells = table_cells(run)
    table_height = ROW_INCHES * (len(cells) + 1) + FOOTER_INCHES
    fig = Figure(figsize=(13.0, 6.8 + table_height), dpi=100, layout="constrained")
    grid = fig.add_gridspec(3, 1, height_ratios=[2.4, 3.0, table_height])
    ax_members = fig.add_subplot(grid[0])
    ax_samples = fig.add_subplot(grid[1], sharex=ax_members)
    ax_table = fig.add_subplot(grid[2])

    started = datetime.fromtimestamp(origin, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    heading = title or ("rollcall run" + (f" · job {run.job}" if run.job else ""))
    fig.suptitle(f"{heading}\n{format_goodput(run)} · started {started}", fontsize=12)

    for number, v in enumerate(run.view_changes, start=1):
        colour = CAUSE_COLOURS.get(v.cause, OTHER_COLOUR)
        for ax in (ax_members, ax_samples):
            _draw_band(ax, v, origin, colour)
        if number in numbers:
            ax_members.annotate(
                f"#{number}",
                xy=(v.time - origin, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
                color=colour,
            )

    members = members_series(run)
    if members:
        xs = [t - origin for t, _ in members] + [run.end - origin]
        ys = [n for _, n in members] + [members[-1][1]]
        ax_members.step(xs, ys, where="post", color="black", linewidth=1.6)
        ax_members.set_ylim(0, max(ys) + 1)
    ax_members.set_ylabel("members")
    ax_members.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_members.grid(axis="y", alpha=0.3)
    ax_members.tick_params(labelbottom=False)

    samples = samples_series(run)
    if samples:
        ax_samples.plot(
            [t - origin for t, _ in samples],
            [s for _, s in samples],
            color="#17becf",
            linewidth=1.6,
        )
        ax_samples.set_ylim(bottom=0)
    else:
        ax_samples.text(
            0.5, 0.5, "no samples reported", transform=ax_samples.transAxes, ha="center"
        )
    ax_samples.set_ylabel("committed samples")
    ax_samples.yaxis.set_major_formatter(EngFormatter(sep=""))
    ax_samples.set_xlabel("seconds since the first record")
    ax_samples.grid(axis="y", alpha=0.3)
    ax_samples.set_xlim(0, max(_latest(run) - origin, 1e-3))

    present = list(causes(run))
    handles = [
        Line2D([], [], color="black", linewidth=1.6, label="members"),
        Line2D([], [], color="#17becf", linewidth=1.6, label="committed samples"),
    ] + [
        Patch(
            facecolor=CAUSE_COLOURS.get(c, OTHER_COLOUR),
            alpha=0.35,
            label=f"view change: {c} (width = stall)",
        )
        for c in present
    ]
    # Upper left of the samples plot: the cumulative line starts low there.
    ax_samples.legend(
        handles=handles, loc="upper left", ncols=1 if len(handles) <= 5 else 2, fontsize=9
    )

    _draw_table(ax_table, run, cells, len(shown), footer=FOOTER_INCHES / table_height)

    fd, temporary = tempfile.mkstemp(prefix=".report-", suffix=".png", dir=output.parent)
    os.close(fd)
    try:
        fig.savefig(temporary, format="png")
        os.replace(temporary, output)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _latest(run: Run) -> float:
    """The right edge of the plots: the last record or the end of the last band."""
    ends = [v.end for v in run.view_changes if v.end is not None]
    return max([run.end, *ends])


def _draw_band(ax: Axes, v: ViewChange, origin: float, colour: str) -> None:
    start = v.time - origin
    if v.stall_s is None:
        ax.axvline(start, color=colour, linestyle="--", linewidth=1.0, alpha=0.8)
        return
    ax.axvspan(start, start + v.stall_s, facecolor=colour, alpha=0.25, linewidth=0)
    # The edge keeps a band of a few milliseconds visible on a long run.
    ax.axvline(start, color=colour, linewidth=0.8, alpha=0.8)


def _draw_table(
    ax: Axes, run: Run, cells: Sequence[Sequence[str]], shown: int, footer: float
) -> None:
    """The table over the top of ``ax``, the summary line in its bottom
    ``footer`` fraction."""
    from matplotlib.transforms import Bbox

    ax.axis("off")
    total = len(run.view_changes)
    if total > shown:
        heading = f"view changes: the {shown} largest stalls of {total}, in time order"
    else:
        heading = "view changes, in time order"
    ax.set_title(heading, fontsize=10, loc="left")
    if cells:
        table = ax.table(
            cellText=[list(row) for row in cells],
            colLabels=list(TABLE_HEADER),
            colWidths=[w / sum(COLUMN_WIDTHS) for w in COLUMN_WIDTHS],
            cellLoc="right",
            colLoc="right",
            bbox=Bbox.from_bounds(0.0, footer, 1.0, 1.0 - footer),
        )
        table.auto_set_font_size(False)
        table.set_fontsize(9)
        for (row, _col), cell in table.get_celld().items():
            cell.set_edgecolor("#cccccc")
            if row == 0:
                cell.set_facecolor("#eeeeee")
                cell.set_text_props(fontweight="bold")
    ax.text(0.0, 0.0, summary_line(run), transform=ax.transAxes, fontsize=9.5, va="bottom")


# ---------------------------------------------------------------- command


@click.command()
@click.argument("events", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("report.png"),
    show_default=True,
    help="Where to write the PNG.",
)
@click.option("--title", help="Title of the picture (default: the job's name).")
def report(events: Path, output: Path, title: str | None) -> None:
    """Draw a run's events file (JSON lines) as one PNG and print a summary.

    The picture shows the members over time, the committed samples, each
    view change as a band as wide as its stall, and a table of goodput and
    stalls broken down by phase.
    """
    run = read_events(events)
    if not output.parent.is_dir():
        raise ReportError(f"cannot write {str(output)!r}: no directory {str(output.parent)!r}")
    if output.exists() and output.resolve() == events.resolve():
        raise ReportError(f"refusing to overwrite the events file {str(events)!r} with the picture")
    draw(run, output, title)
    click.echo(summary_text(run))
    click.echo(f"  wrote {output}")
