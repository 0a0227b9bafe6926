"""The text of a report: the table of view changes, the summary line under
it, and the summary the command prints (the same facts)."""

from __future__ import annotations

from rollcall.report.run import (
    TABLE_ROWS,
    Run,
    StallStats,
    causes,
    goodput,
    largest_stalls,
    stall_stats,
)

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
