"""The picture of a run, drawn with matplotlib (Agg, no display). It has
three parts sharing one story, read top to bottom:

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
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from rollcall.protocol.events import Cause
from rollcall.report.run import (
    Run,
    ViewChange,
    causes,
    largest_stalls,
    members_series,
    samples_series,
)
from rollcall.report.text import TABLE_HEADER, format_goodput, summary_line, table_cells

if TYPE_CHECKING:
    from matplotlib.axes import Axes

#: Band colour for each cause; anything else (a later version's) is "other".
CAUSE_COLOURS: dict[str, str] = {
    Cause.CRASH: "#d62728",
    Cause.SUSPECTED: "#ff7f0e",
    Cause.REPORT: "#e377c2",
    Cause.LEAVE: "#1f77b4",
    Cause.JOIN: "#2ca02c",
    Cause.START: "#7f7f7f",
    Cause.TAKEOVER: "#9467bd",
    Cause.MIXED: "#8c564b",
}
OTHER_COLOUR = "#bcbd22"
#: Relative widths of the table's columns (the numbers need less room).
COLUMN_WIDTHS = (0.5, 0.8, 1.0, 0.7, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.15)
#: Height of a table row and of the summary line under the table, inches.
ROW_INCHES = 0.3
FOOTER_INCHES = 0.4


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
