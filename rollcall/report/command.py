"""``rollcall report EVENTS.jsonl -o report.png``: one picture of a run,
and its summary as text.

The input is the events file the rendezvous service writes
(``docs/events.md``, schema ``rollcall.events/1``): read by
``rollcall.report.run``, drawn by ``rollcall.report.plot``, summed up by
``rollcall.report.text``.
"""

from __future__ import annotations

from pathlib import Path

import click

from rollcall.report.plot import draw
from rollcall.report.run import ReportError, read_events
from rollcall.report.text import summary_text


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
