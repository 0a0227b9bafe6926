"""`rollcall report`: an events file in, one PNG and a text summary out.

The numbers (goodput, the stall table, the members and samples series) are
checked exactly through the pure functions on event files built here; the
command is run through click's runner inside rollcall's own error-handling
group, so a bad file must end as one `rollcall: error:` line and no picture.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import matplotlib.font_manager  # noqa: F401  (see below)
import pytest
from click.testing import CliRunner, Result

from rollcall.cli.group import RollcallGroup
from rollcall.protocol.events import SCHEMA
from rollcall.report.command import report as report_command
from rollcall.report.run import (
    TABLE_ROWS,
    ReportError,
    goodput,
    largest_stalls,
    members_series,
    parse_events,
    samples_series,
    stall_stats,
)
from rollcall.report.text import TABLE_HEADER, table_cells

# matplotlib builds its font cache on first use, running `fc-list` once: on a
# fresh machine that is a process started by the first test that draws, which
# the fast lane refuses. Importing the font manager here, at collection, builds
# the cache before any test runs.

T0 = 1_700_000_000.0
GLOBAL_BATCH = 32
STEPS_PER_SECOND = 10
W1, W2, W3, W4, W5 = "w-0a1b", "w-2c3d", "w-4e5f", "w-6a7b", "w-8c9d"

# A 60-second run of 4 members: started at T0 (training from T0+3), W3
# crashes at T0+20.5, W5 joins at T0+35, W2 leaves at T0+48.5. Times and
# phases are binary fractions so that sums are exact.
START = {
    "epoch": 1, "cause": "start", "time": T0, "before": [], "after": [W1, W2, W3, W4],
    "stall_s": 3.0, "detect_s": 0.0, "rollcall_s": 0.25, "fetch_s": 1.5, "rebuild_s": 0.5,
    "first_step_s": 0.75, "lost_work_s": 0.0, "restart_cost_s": None,
}  # fmt: skip
CRASH = {
    "epoch": 2, "cause": "crash", "time": T0 + 20.5, "before": [W1, W2, W3, W4],
    "after": [W1, W2, W4], "stall_s": 1.5, "detect_s": 0.75, "rollcall_s": 0.25,
    "fetch_s": 0.0, "rebuild_s": 0.25, "first_step_s": None, "lost_work_s": 2.25,
    "restart_cost_s": 41.5,
}  # fmt: skip
JOIN = {
    "epoch": 3, "cause": "join", "time": T0 + 35.0, "before": [W1, W2, W4],
    "after": [W1, W2, W4, W5], "stall_s": 2.0, "detect_s": 0.0, "rollcall_s": 0.25,
    "fetch_s": 1.0, "rebuild_s": 0.5, "first_step_s": 0.25, "lost_work_s": 0.5,
    "restart_cost_s": 50.0,
}  # fmt: skip
LEAVE = {
    "epoch": 4, "cause": "leave", "time": T0 + 48.5, "before": [W1, W2, W4, W5],
    "after": [W1, W4, W5], "stall_s": 0.5, "detect_s": 0.0, "rollcall_s": 0.125,
    "fetch_s": 0.0, "rebuild_s": 0.25, "first_step_s": 0.125, "lost_work_s": 0.375,
    "restart_cost_s": None,
}  # fmt: skip
RUN = (START, CRASH, JOIN, LEAVE)
Changes = Sequence[dict[str, Any]]
PHASES = ("detect_s", "rollcall_s", "fetch_s", "rebuild_s", "first_step_s")
TORN = '{"schema": "rollcall.events/1", "kind": "progress", "ti'


def committed_step(t: float, changes: Changes = RUN) -> int:
    """Last committed step at time t: steps run at a steady rate except
    inside the stall bands."""
    productive = t - T0
    for v in changes:
        productive -= min(max(t - v["time"], 0.0), v["stall_s"])
    return round(productive * STEPS_PER_SECOND) - 1


def samples_at(t: float) -> int:
    return (committed_step(t) + 1) * GLOBAL_BATCH


def members_at(t: float, changes: Changes = RUN) -> int:
    """Members in the view at time t (a view is committed after detection
    and the roll call)."""
    count = 0
    for v in changes:
        if v["time"] + v["detect_s"] + v["rollcall_s"] <= t:
            count = len(v["after"])
    return count


def view_change(v: dict[str, Any], changes: Changes = RUN, **extra: Any) -> dict[str, Any]:
    resume_step = committed_step(v["time"], changes)
    record = {
        "schema": SCHEMA,
        "kind": "view_change",
        "time": v["time"],
        "job": "demo",
        "epoch": v["epoch"],
        "cause": v["cause"],
        "causes": [f"{v['cause']}:{m}" for m in set(v["before"]) ^ set(v["after"])],
        "members_before": v["before"],
        "members_after": v["after"],
        "joined": sorted(set(v["after"]) - set(v["before"])),
        "removed": sorted(set(v["before"]) - set(v["after"])),
        "resume_step": resume_step,
        "global_batch": GLOBAL_BATCH,
        "samples": (resume_step + 1) * GLOBAL_BATCH,
        "stall_s": v["stall_s"],
        "phases": {k: v[k] for k in PHASES},
        "lost_work_s": v["lost_work_s"],
        "restart_cost_s": v["restart_cost_s"],
    }  # fmt: skip
    record.update(extra)
    return record


def progress(t: float, changes: Changes = RUN, **extra: Any) -> dict[str, Any]:
    step = committed_step(t, changes)
    epoch = max((v["epoch"] for v in changes if v["time"] <= t), default=1)
    record = {
        "schema": SCHEMA,
        "kind": "progress",
        "time": t,
        "job": "demo",
        "epoch": epoch,
        "step": step,
        "members": members_at(t, changes),
        "samples": (step + 1) * GLOBAL_BATCH,
    }
    record.update(extra)
    return record


def as_written(changes: Changes, progress_at: Sequence[float]) -> list[dict[str, Any]]:
    """The records in the order the leader writes them: a view change once
    it is over, progress at the given times."""
    written = [(v["time"] + v["stall_s"], view_change(v, changes)) for v in changes]
    written += [(t, progress(t, changes)) for t in progress_at]
    written.sort(key=lambda item: item[0])
    return [record for _, record in written]


def realistic_lines() -> list[str]:
    """RUN with progress every second from T0+4 to T0+60, an unknown kind
    and unknown fields (a torn last line is added by ``write``)."""
    records = as_written(RUN, [T0 + s for s in range(4, 61)])
    records.insert(30, {"schema": SCHEMA, "kind": "checkpoint", "time": T0 + 30.0})
    lines = [json.dumps(record) for record in records]
    lines[5] = json.dumps({**json.loads(lines[5]), "rack": "b2", "host": {"name": "n1"}})
    return lines


def write_text(lines: Sequence[str], torn: str | None) -> str:
    return "".join(line + "\n" for line in lines) + (torn or "")


def write(path: Path, lines: Sequence[str], torn: str | None = TORN) -> Path:
    path.write_text(write_text(lines, torn))
    return path


def events_text(records: Sequence[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk; fails on anything else."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", head
    assert head[12:16] == b"IHDR", head
    width, height = struct.unpack(">II", head[16:24])
    return width, height


@pytest.fixture
def cli() -> click.Group:
    """`rollcall` with only the report command, under rollcall's own error
    handling (one line on stderr, exit code)."""
    group = RollcallGroup(name="rollcall")
    group.add_command(report_command)
    return group


def run_cli(cli: click.Group, *args: str) -> Result:
    return CliRunner().invoke(cli, list(args), prog_name="rollcall")


# ------------------------------------------------------------ parsing


def test_a_torn_last_line_is_skipped_silently():
    run = parse_events(write_text(realistic_lines(), TORN), "run.jsonl")
    assert run.skipped == 0
    assert len(run.progress) == 57
    assert len(run.view_changes) == 4
    assert run.job == "demo"


def test_unknown_kinds_and_fields_are_ignored():
    run = parse_events(write_text(realistic_lines(), None), "run.jsonl")
    assert run.skipped == 0
    assert [v.cause for v in run.view_changes] == ["start", "crash", "join", "leave"]


def test_records_are_ordered_by_time_not_by_line():
    run = parse_events(write_text(realistic_lines(), None), "run.jsonl")
    assert [v.epoch for v in run.view_changes] == [1, 2, 3, 4]
    times = [p.time for p in run.progress]
    assert times == sorted(times)
    # The crash's record comes after the progress written during its stall.
    assert run.view_changes[1].line > next(p.line for p in run.progress if p.time == T0 + 21)


def test_garbage_and_malformed_lines_inside_the_file_are_counted_and_skipped():
    lines = realistic_lines()
    lines.insert(3, "not json at all")
    lines.insert(7, json.dumps(progress(T0 + 4.5, step="four")))
    lines.insert(9, "[1, 2, 3]")
    run = parse_events(write_text(lines, None), "run.jsonl")
    assert run.skipped == 3
    assert len(run.progress) == 57


def test_null_fields_are_read_as_not_reported():
    record = view_change(CRASH, stall_s=None, lost_work_s=None, samples=None, phases=None)
    run = parse_events(events_text([record]), "run.jsonl")
    (v,) = run.view_changes
    assert (v.stall_s, v.lost_work_s, v.samples, v.end) == (None, None, None, None)
    assert v.phases.detect_s is None and v.commit_time == v.time


# -------------------------------------------------------- aggregation


def test_goodput_is_one_minus_stalled_over_first_progress_to_last_record():
    run = parse_events(write_text(realistic_lines(), TORN), "run.jsonl")
    g = goodput(run)
    # The start stall (T0..T0+3) is before the first progress (T0+4).
    assert (g.start, g.end, g.duration_s) == (T0 + 4, T0 + 60, 56.0)
    assert g.stalled_s == 1.5 + 2.0 + 0.5
    assert g.fraction == 1 - 4.0 / 56.0


def test_goodput_counts_overlapping_bands_once_and_clips_to_the_run():
    records = [
        progress(T0 + 10, step=0, members=3, samples=32),
        view_change(CRASH, time=T0 + 20.0, stall_s=2.0),
        view_change(JOIN, time=T0 + 21.0, stall_s=2.0),  # overlaps the crash by 1 s
        progress(T0 + 30, step=1, members=3, samples=64),
        view_change(LEAVE, time=T0 + 29.0, stall_s=4.0),  # runs 3 s past the last record
    ]
    g = goodput(parse_events(events_text(records), "run.jsonl"))
    assert (g.duration_s, g.stalled_s) == (20.0, 3.0 + 1.0)
    assert g.fraction == 1 - 4.0 / 20.0


def test_goodput_needs_a_progress_record():
    g = goodput(parse_events(events_text([view_change(START)]), "run.jsonl"))
    assert g.fraction is None


def test_members_change_when_each_view_is_committed():
    run = parse_events(write_text(realistic_lines(), TORN), "run.jsonl")
    assert members_series(run) == [
        (T0, 0),
        (T0 + 0.25, 4),  # start: roll call 0.25 s
        (T0 + 21.5, 3),  # crash at 20.5: detect 0.75 + roll call 0.25
        (T0 + 35.25, 4),  # join at 35: roll call 0.25
        (T0 + 48.625, 3),  # leave at 48.5: roll call 0.125
    ]


def test_samples_are_flat_across_every_band():
    run = parse_events(write_text(realistic_lines(), TORN), "run.jsonl")
    bands = [
        (T0, 0),
        (T0 + 3.0, 0),
        (T0 + 20.5, 5600),  # 17.5 s of steps at 10 steps/s, 32 samples each
        (T0 + 22.0, 5600),
        (T0 + 35.0, 9760),
        (T0 + 37.0, 9760),
        (T0 + 48.5, 13440),
        (T0 + 49.0, 13440),
    ]
    from_progress = [(T0 + s, samples_at(T0 + s)) for s in range(4, 61)]
    series = samples_series(run)
    assert sorted(series) == sorted(bands + from_progress)
    assert [t for t, _ in series] == sorted(t for t, _ in series)
    for v in run.view_changes:
        assert v.end is not None
        inside = {s for t, s in series if v.time <= t <= v.end}
        assert inside == {v.samples}, v


def test_a_band_without_samples_holds_the_last_known_value():
    records = [
        progress(T0 + 10, step=9, members=4, samples=320),
        view_change(CRASH, time=T0 + 10.5, stall_s=1.0, samples=None),
        progress(T0 + 12, step=14, members=3, samples=480),
    ]
    series = samples_series(parse_events(events_text(records), "run.jsonl"))
    assert series == [(T0 + 10, 320), (T0 + 10.5, 320), (T0 + 11.5, 320), (T0 + 12, 480)]


def test_the_table_lists_every_view_change_with_its_phases():
    run = parse_events(write_text(realistic_lines(), TORN), "run.jsonl")
    assert len(TABLE_HEADER) == 13
    assert table_cells(run) == [
        ["#1", "0.0 s", "start", "1", "0 → 4", "3.00 s", "0 ms", "250 ms", "1.50 s",
         "500 ms", "750 ms", "0 ms", "—"],
        ["#2", "20.5 s", "crash", "2", "4 → 3", "1.50 s", "750 ms", "250 ms", "0 ms",
         "250 ms", "—", "2.25 s", "41.50 s"],
        ["#3", "35.0 s", "join", "3", "3 → 4", "2.00 s", "0 ms", "250 ms", "1.00 s",
         "500 ms", "250 ms", "500 ms", "50.00 s"],
        ["#4", "48.5 s", "leave", "4", "4 → 3", "500 ms", "0 ms", "125 ms", "0 ms",
         "250 ms", "125 ms", "375 ms", "—"],
    ]  # fmt: skip


def test_stall_statistics_cover_every_view_change():
    stats = stall_stats(parse_events(write_text(realistic_lines(), TORN), "run.jsonl"))
    assert (stats.count, stats.with_stall, stats.median_s, stats.max_s) == (4, 4, 1.75, 3.0)


def chaos(count: int) -> list[dict[str, Any]]:
    """A start then `count - 1` view changes 10 s apart, W3 crashing and
    joining again in turn, with distinct stalls (7 is coprime to 40)."""
    changes = [START]
    for i in range(1, count):
        template = CRASH if i % 2 else JOIN
        before, after = [W1, W2, W3, W4], [W1, W2, W4]
        if template is JOIN:
            before, after = after, before
        stall = 1.0 + (7 * i) % count / 10
        changes.append(
            {**template, "epoch": i + 1, "time": T0 + 10.0 * i, "before": before,
             "after": after, "stall_s": stall}
        )  # fmt: skip
    return as_written(changes, [T0 + 4.0 + 2 * k for k in range(5 * count - 2)])


def test_a_long_run_tables_only_the_largest_stalls_in_time_order():
    run = parse_events(events_text(chaos(40)), "run.jsonl")
    chosen = largest_stalls(run)
    assert len(chosen) == TABLE_ROWS
    numbers = [n for n, _ in chosen]
    assert numbers == sorted(numbers)
    smallest_shown = min(v.stall_s or 0.0 for _, v in chosen)
    left_out = [v.stall_s for n, v in enumerate(run.view_changes, 1) if n not in numbers]
    assert all(s is not None and s < smallest_shown for s in left_out)
    assert stall_stats(run).count == 40


# --------------------------------------------------------- the command


def test_report_writes_a_png_and_prints_a_summary(cli, tmp_path):
    events = write(tmp_path / "run.jsonl", realistic_lines())
    output = tmp_path / "report.png"
    result = run_cli(cli, "report", str(events), "-o", str(output), "--title", "demo run")
    assert result.exit_code == 0, result.output + result.stderr
    width, height = png_size(output)
    assert 1000 <= width <= 2000 and 700 <= height <= 2000, (width, height)
    assert output.stat().st_size > 20_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.png", "run.jsonl"]
    assert "goodput 92.9% over 56.00 s (4.00 s stalled)" in result.stdout
    assert "view changes: 4 (crash 1, join 1, leave 1, start 1)" in result.stdout
    assert "stall: median 1.75 s, max 3.00 s" in result.stdout
    assert result.stderr == ""


def test_report_draws_a_long_run_with_null_fields(cli, tmp_path):
    records = chaos(40)
    first_crash = next(i for i, r in enumerate(records) if r.get("cause") == "crash")
    records[first_crash].update(stall_s=None, samples=None, phases=None)
    a_progress = [i for i, r in enumerate(records) if r["kind"] == "progress"][10]
    records[a_progress].update(samples=None)
    events = tmp_path / "long.jsonl"
    events.write_text(events_text(records))
    output = tmp_path / "long.png"
    result = run_cli(cli, "report", str(events), "-o", str(output))
    assert result.exit_code == 0, result.output + result.stderr
    png_size(output)
    assert "view changes: 40 (crash 20, join 19, start 1)" in result.stdout
    assert "(1 without a stall)" in result.stdout


def test_report_writes_report_png_by_default(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "run.jsonl", realistic_lines())
    result = run_cli(cli, "report", "run.jsonl")
    assert result.exit_code == 0, result.output + result.stderr
    png_size(tmp_path / "report.png")


BAD_FILES = {
    "missing": (None, "does not exist"),
    "empty": ("", "is empty"),
    "blank": ("\n\n  \n", "is empty"),
    "garbage": ("hello\n\x00\x01\x02\n{{{\n[1, 2]\n", "no usable record"),
    "only-unknown-kinds": (
        json.dumps({"schema": SCHEMA, "kind": "checkpoint", "time": T0}) + "\n",
        "no usable record",
    ),
    "malformed": (
        json.dumps({"schema": SCHEMA, "kind": "progress", "time": "noon"}) + "\n",
        "'time' must be a number",
    ),
    "ledger": ('{"step": 0, "samples": [1, 2, 3]}\n', "not a rollcall events file"),
    "newer-schema": (
        json.dumps({**progress(T0 + 4), "schema": "rollcall.events/2"}) + "\n",
        "has schema 'rollcall.events/2'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_events_file_is_one_error_line_and_no_picture(cli, tmp_path, case):
    content, reason = BAD_FILES[case]
    events = tmp_path / "run.jsonl"
    if content is not None:
        events.write_bytes(content.encode())
    output = tmp_path / "report.png"
    result = run_cli(cli, "report", str(events), "-o", str(output))
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("rollcall: error: "), lines[0]
    assert reason in lines[0]
    assert "Traceback" not in result.output
    assert not output.exists()


def test_a_directory_is_not_an_events_file(cli, tmp_path):
    result = run_cli(cli, "report", str(tmp_path), "-o", str(tmp_path / "r.png"))
    assert result.exit_code == 1
    assert result.stderr.startswith("rollcall: error: ") and "is a directory" in result.stderr


def test_an_output_in_a_missing_directory_is_refused(cli, tmp_path):
    events = write(tmp_path / "run.jsonl", realistic_lines())
    result = run_cli(cli, "report", str(events), "-o", str(tmp_path / "no" / "r.png"))
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "no directory" in result.stderr
    assert not (tmp_path / "no").exists()


def test_the_events_file_is_never_overwritten(cli, tmp_path):
    events = write(tmp_path / "run.jsonl", realistic_lines())
    before = events.read_bytes()
    result = run_cli(cli, "report", str(events), "-o", str(events))
    assert result.exit_code == 1 and "refusing to overwrite" in result.stderr
    assert events.read_bytes() == before


def test_report_error_is_a_click_exception():
    # RollcallGroup prints a ClickException as one line with its exit code.
    assert issubclass(ReportError, click.ClickException)


@pytest.mark.parametrize(
    "records",
    [[progress(T0 + 4)], [view_change(START)]],
    ids=["one-progress-record", "one-view-change"],
)
def test_a_run_of_one_record_still_draws(cli, tmp_path, records):
    events = tmp_path / "run.jsonl"
    events.write_text(events_text(records))
    result = run_cli(cli, "report", str(events), "-o", str(tmp_path / "r.png"))
    assert result.exit_code == 0, result.output + result.stderr
    png_size(tmp_path / "r.png")
    assert "goodput n/a" in result.stdout
