"""The view-change event records (docs/events.md), driven by hand with
invented times: the leader's EventLog is pure."""

from __future__ import annotations

import json

import pytest

from rollcall.membership.cause import Cause
from rollcall.membership.config import Config
from rollcall.membership.view import Member, View
from rollcall.protocol.events import (
    SCHEMA,
    MalformedEvent,
    Progress,
    ViewChange,
    from_record,
    to_record,
)
from rollcall.protocol.events import Cause as EventCause
from rollcall.rendezvous.events import EventLog, MemberReport

EVENT_TIMEOUT = Config().event_timeout

WALL = 1_700_000_000.0


def view(epoch: int, *ids: str, resume: int | None = None) -> View:
    return View(epoch, tuple(Member(i, f"127.0.0.1:{1000 + n}") for n, i in enumerate(ids)),
                resume_step=resume)  # fmt: skip


def report(fetch: float = 0.0, rebuild: float = 0.02, first: float = 0.05, lost: float = 0.0):
    return MemberReport(fetch, rebuild, first, lost, step_s=0.1, launch_s=3.0, global_batch=32)


def test_a_crash_is_one_record_with_its_stall_and_phases():
    log = EventLog("job1", WALL)
    before, after = view(3, "a", "b", "c"), view(4, "a", "b", resume=99)
    log.cause(10.0, "crash", detect_s=0.04)
    log.rollcall(10.001)
    assert log.committed(after, before, [Cause.suspect("c")], now=10.03) == []
    assert log.report("a", 4, report(rebuild=0.02, first=0.06, lost=0.01), now=10.11) == []
    (record,) = log.report("b", 4, report(rebuild=0.03, first=0.05, lost=0.02), now=10.12)
    assert record["schema"] == SCHEMA and record["kind"] == "view_change"
    assert record["time"] == pytest.approx(WALL + 9.96)
    assert record["cause"] == "crash" and record["epoch"] == 4
    assert record["members_before"] == ["a", "b", "c"] and record["members_after"] == ["a", "b"]
    assert record["removed"] == ["c"] and record["joined"] == []
    assert record["stall_s"] == pytest.approx(10.12 - 9.96)
    assert record["phases"] == pytest.approx(
        {
            "detect_s": 0.04,
            "rollcall_s": 0.029,
            "fetch_s": 0.0,
            "rebuild_s": 0.03,
            "first_step_s": 0.06,
        }  # fmt: skip
    )
    assert record["lost_work_s"] == pytest.approx(0.03)
    assert record["samples"] == 100 * 32 and record["resume_step"] == 99
    # No checkpoint: a restart would relaunch and redo steps 0..99.
    assert record["restart_cost_s"] == pytest.approx(3.0 + 100 * 0.1)


def test_restart_cost_counts_only_the_steps_since_the_last_checkpoint():
    log = EventLog("job1", WALL)
    log.checkpoint_step = 89
    log.cause(1.0, "leave")
    log.committed(view(2, "a", resume=99), view(1, "a", "b"), [Cause.leave("b")], now=1.01)
    (record,) = log.report("a", 2, report(), now=1.1)
    assert record["cause"] == "leave"
    assert record["restart_cost_s"] == pytest.approx(3.0 + 10 * 0.1)


def test_a_member_that_never_reports_leaves_the_stall_unknown():
    log = EventLog("job1", WALL)
    log.cause(1.0, "join")
    log.committed(view(2, "a", "b", resume=5), view(1, "a"), [Cause.join("b")], now=1.05)
    assert log.report("a", 2, report(), now=1.2) == []
    (record,) = log.committed(
        view(3, "a", resume=7), view(2, "a", "b"), [Cause.suspect("b")], now=5.0
    )
    assert record["epoch"] == 2 and record["joined"] == ["b"]
    assert record["stall_s"] is None and record["phases"]["rebuild_s"] is None


def test_an_open_record_is_written_after_the_timeout():
    log = EventLog("job1", WALL)
    log.cause(1.0, "join")
    log.committed(view(1, "a"), view(0), [Cause.join("a")], now=1.05)
    assert log.tick(1.05 + EVENT_TIMEOUT - 1) == []
    (record,) = log.tick(1.05 + EVENT_TIMEOUT)
    assert record["epoch"] == 1 and record["stall_s"] is None


def test_the_timeout_of_an_open_record_is_the_configs_event_timeout():
    log = EventLog("job1", WALL, Config(event_timeout=4.0))
    log.cause(1.0, "join")
    log.committed(view(1, "a"), view(0), [Cause.join("a")], now=1.05)
    assert log.tick(1.05 + 3.9) == []
    (record,) = log.tick(1.05 + 4.0)
    assert record["epoch"] == 1


def test_reports_for_another_epoch_or_from_non_members_are_ignored():
    log = EventLog("job1", WALL)
    log.cause(1.0, "join")
    log.committed(view(2, "a", resume=1), view(1, "a"), [Cause.join("a")], now=1.05)
    assert log.report("a", 1, report(), now=1.1) == []
    assert log.report("z", 2, report(), now=1.1) == []
    assert len(log.report("a", 2, report(), now=1.2)) == 1


def test_several_kinds_of_trigger_make_a_mixed_cause():
    log = EventLog("job1", WALL)
    log.cause(1.0, "join")
    log.cause(1.01, "crash")
    log.committed(
        view(2, "a", resume=1), view(1, "a", "c"), [Cause.join("x"), Cause.suspect("c")], now=1.05
    )
    (record,) = log.flush()
    assert record["cause"] == "mixed"


def test_a_view_after_a_takeover_takes_its_cause_from_the_coordinator():
    log = EventLog("job1", WALL)
    log.committed(view(5, "a", resume=1), view(4, "a", "b"), [Cause.suspect("b")], now=1.0)
    (record,) = log.flush()
    assert record["cause"] == "suspected"


def test_a_view_changes_causes_are_written_as_their_wire_text():
    log = EventLog("job1", WALL)
    log.cause(1.0, "report")
    causes = [Cause.report("b", "a"), Cause.join("c")]
    log.committed(view(2, "a", "c", resume=1), view(1, "a", "b"), causes, now=1.05)
    (record,) = log.flush()
    assert record["causes"] == ["report:b by a", "join:c"]


def test_progress_records_are_throttled_and_count_samples():
    log = EventLog("job1", WALL)
    current = view(1, "a", "b", resume=0)
    log.committed(current, view(0), [Cause.join("a"), Cause.join("b")], now=0.0)
    log.report("a", 1, report(), now=0.1)
    (first,) = log.progress(1.0, current, 9)
    assert first["kind"] == "progress" and first["samples"] == 320 and first["members"] == 2
    assert log.progress(1.5, current, 14) == []  # within a second of the last
    assert log.progress(2.5, current, 9) == []  # no new step
    assert len(log.progress(2.5, current, 20)) == 1


def test_what_the_leader_writes_reads_back_by_the_one_schema():
    log = EventLog("job1", WALL)
    before, after = view(3, "a", "b", "c"), view(4, "a", "b", resume=99)
    log.cause(10.0, "crash", detect_s=0.04)
    log.committed(after, before, ["suspect:c"], now=10.03)
    log.report("a", 4, report(), now=10.11)
    (written,) = log.report("b", 4, report(), now=10.12)
    (progress,) = log.progress(11.0, after, 120)
    line = json.loads(json.dumps(written))
    change = from_record(ViewChange, line)
    assert to_record(change, "job1") == line
    assert change.cause == EventCause.CRASH and change.removed == ("c",)
    assert change.phases.detect_s == pytest.approx(0.04)
    assert from_record(Progress, progress).step == 120


def test_a_record_field_of_the_wrong_type_is_malformed():
    with pytest.raises(MalformedEvent, match="'members' must be an integer"):
        from_record(Progress, {"time": WALL, "epoch": 1, "step": 2, "members": "two"})
    with pytest.raises(MalformedEvent, match="'step' is missing"):
        from_record(Progress, {"time": WALL, "epoch": 1, "members": 2})
