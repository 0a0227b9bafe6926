"""What ``rollcall up`` shows: a live terminal view (rich) on a terminal, and
plain lines otherwise (one per view change, a progress line now and then)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from rollcall.checkpoints import durability_line
from rollcall.local import LocalCluster
from rollcall.report.run import ViewChange

#: View changes listed in the live view.
SHOWN_EVENTS = 6
#: Operator notices (a resume, a worker ending) listed in the live view.
SHOWN_NOTICES = 4


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


#: Columns of a view change: the live table's headers, in event_cells' order.
EVENT_COLUMNS = ("epoch", "cause", "members", "stall", "detect", "roll call", "fetch",
                 "rebuild", "first step", "lost work", "restart")  # fmt: skip


def event_cells(event: ViewChange) -> list[str]:
    """One view change as EVENT_COLUMNS (durations in ms, restart in s)."""
    phases = event.phases
    restart = event.restart_cost_s
    return [
        str(event.epoch), event.cause,
        f"{len(event.members_before)}->{len(event.members_after)}",
        ms(event.stall_s), ms(phases.detect_s), ms(phases.rollcall_s), ms(phases.fetch_s),
        ms(phases.rebuild_s), ms(phases.first_step_s), ms(event.lost_work_s),
        "-" if restart is None else f"{restart:.1f} s",
    ]  # fmt: skip


def event_line(event: ViewChange) -> str:
    """One view change in a line (the plain, non-terminal output)."""
    return "view change (ms): " + "  ".join(
        f"{column} {cell}" for column, cell in zip(EVENT_COLUMNS, event_cells(event), strict=True)
    )


def events_table(events: Sequence[ViewChange]) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in EVENT_COLUMNS:
        table.add_column(column, justify="left" if column in ("cause", "members") else "right")
    for event in events:
        table.add_row(*event_cells(event))
    return table


def headline(cluster: LocalCluster, status: Any, summary: dict[str, Any]) -> str:
    """The job in a line; a second line warns while durability is stuck."""
    training = [w for w in cluster.workers if w.alive and w.samples_s]
    rate = sum(w.samples_s or 0 for w in training) / max(1, len(training))
    goodput = summary["goodput"]
    step = "-" if status is None or status.step is None else str(status.step)
    epoch = "-" if status is None else str(status.view.epoch)
    members = "-" if status is None else str(status.view.size)
    newest = status.checkpoints[0].step if status is not None and status.checkpoints else None
    if cluster.options.steps is not None:
        step = f"{step}/{cluster.options.steps}"
    line = (
        f"epoch {epoch}  step {step}  members {members}  "
        f"samples/s {rate:.0f}  goodput {'-' if goodput is None else f'{goodput:.3f}'}  "
        f"view changes {len(summary['view_changes'])}  "
        f"checkpoint {'-' if newest is None else newest}"
    )
    stuck = durability_line(status.durability) if status is not None else None
    return line if stuck is None else f"{line}\nwarning: {stuck}"


def render(cluster: LocalCluster, status: Any, summary: dict[str, Any]) -> Group:
    elapsed = time.time() - cluster.started
    title = Text(
        f"rollcall up: job {cluster.job}  rendezvous {cluster.rendezvous}  "
        f"etcd {cluster.etcd}  {elapsed:.0f} s\n"
        f"running {cluster.options.label} in {cluster.workdir}",
        style="bold",
    )
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("rank", "member", "pid", "state", "step", "epoch", "samples/s", "log"):
        table.add_column(column, justify="left" if column in ("member", "log") else "right")
    ranks = {}
    if status is not None:
        ranks = {m.id: r for r, m in enumerate(status.view.members)}
    for worker in sorted(
        cluster.workers, key=lambda w: (ranks.get(w.member_id or "", 10**6), w.index)
    ):
        if not worker.alive and worker.index < len(cluster.workers) - 8:
            continue  # long-gone workers drop off the table
        rank = ranks.get(worker.member_id or "")
        style = {"training": "green", "frozen": "yellow", "joining": "cyan"}.get(
            worker.state, "dim"
        )
        table.add_row(
            "-" if rank is None else str(rank),
            worker.member_id or worker.name,
            str(worker.pid),
            Text(worker.state, style=style),
            "-" if worker.step is None else str(worker.step),
            "-" if worker.epoch is None else str(worker.epoch),
            "-" if worker.samples_s is None else f"{worker.samples_s:.0f}",
            str(worker.log_path.relative_to(cluster.workdir)),
        )
    shown = summary["view_changes"][-SHOWN_EVENTS:]
    notices = [Text(line, style="yellow") for line in cluster.notices[-SHOWN_NOTICES:]]
    return Group(
        title,
        Text(headline(cluster, status, summary)),
        Text(""),
        table,
        *([Text(""), *notices] if notices else []),
        Text(""),
        Text("last view changes (ms):", style="bold"),
        events_table(shown) if shown else Text("  none yet", style="dim"),
        Text(""),
        Text(
            f"operate: rollcall add | rollcall kill --random | rollcall chaos --mtbf 10 "
            f"--duration 60 | rollcall status        events: {cluster.events}",
            style="dim",
        ),
    )
