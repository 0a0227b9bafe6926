"""The churn simulator (rollcall.planning): where a job's time goes under
failures and pauses, for rollcall, a restart-from-checkpoint launcher and
replica groups, with costs read from benchmark results.

Costs here come from a crafted set of benchmark results with round numbers
(``crafted_results``), read through the same mapping as the real ones, so
every expected figure below is worked out by hand from them."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcall.planning.costs import (
    RESULT_FILES,
    ByMembers,
    costs_from_dict,
    costs_from_results,
    costs_to_dict,
    with_flat_roll_call,
)
from rollcall.planning.errors import BadJob, CostsUnreadable
from rollcall.planning.job import FaultMix, Host, Job, System
from rollcall.planning.plan import (
    daly_s,
    goodput_by_interval,
    goodput_by_timeout,
    interval_grid,
    interval_steps,
    young_s,
)
from rollcall.planning.simulate import compare, drawn_trace, simulate
from rollcall.planning.timeline import Category, Timeline
from rollcall.planning.trace import Failure, FailureKind, Pause, Trace, draw_trace, scripted
from rollcall.planning.validation import adaptive_timeout, peers_cases, sweep_cases

ROOT = Path(__file__).resolve().parent.parent


def crafted_results() -> dict[str, Any]:
    """Benchmark results with round numbers, shaped like bench/results/."""
    return {
        "recovery.json": {
            "date": "2026-01-01T00:00:00+00:00",
            "crash": {"detect_s": {"median": 0.0625}, "group_rebuild_s": {"median": 0.125}},
            "hot_add": {"bytes": 1_000_000},
        },
        "recovery-transfer.json": {
            "state_transfer_alone": [
                {"bytes": 1_000_000, "fetch_s": {"median": 0.02}},
                {"bytes": 101_000_000, "fetch_s": {"median": 1.02}},
            ],
        },
        "view_change.json": {
            "rows": [
                {"members": 4, "crash_first": {"p50_ms": 10.0}, "join_first": {"p50_ms": 60.0}},
                {"members": 64, "crash_first": {"p50_ms": 70.0}, "join_first": {"p50_ms": 120.0}},
            ],
            "parameters": {"config": {"rollcall_deadline": 1.0}},
        },
        "peers.json": {
            "date": "2026-01-02T00:00:00+00:00",
            "versions": {"rollcall_commit": "0123456789abcdef"},
            "machine": {"cpus": 2},
            "parameters": {
                "workers": 3, "global_batch": 32, "checkpoint_every_steps": 20,
                "churn_duration_s": 30.0,
                "churn": [{"kill_every_s": 15.0, "rejoin_after_s": 2.0, "failures_per_min": 4.0}],
            },
            "systems": {
                "rollcall": {
                    "throughput_samples_per_s": 320.0, "hot_add_stall_s": 0.25,
                    "spread": {"hot_add_join_to_first_step_s": {"median": 3.25},
                               "goodput": {"4": {"median": 0.9, "min": 0.8, "max": 1.0}}},
                },
                "torchrun": {
                    "description": "torchrun agents (..., last_call_timeout=3, ...)",
                    "throughput_samples_per_s": 320.0, "crash_stall_s": 12.0,
                    "hot_add_stall_s": 10.0,
                    "spread": {"hot_add_join_to_first_step_s": {"median": 11.0},
                               "goodput": {"4": {"median": 0.5, "min": 0.4, "max": 0.6}}},
                },
                "torchft": {
                    "description": "torchft_lighthouse ...; heartbeat timeout 1 s, gloo 5 s",
                    "throughput_samples_per_s": 320.0, "hot_add_stall_s": 0.5,
                    "spread": {"crash_stall_s": {"min": 1.25},
                               "hot_add_join_to_first_step_s": {"median": 2.5},
                               "goodput": {"4": {"median": 0.8, "min": 0.7, "max": 0.9}}},
                },
            },
        },
        "detector-sweep.json": {
            "date": "2026-01-03T00:00:00+00:00",
            "machine": {"cpus": 2},
            "parameters": {
                "workers": 4, "checkpoint_every_steps": 20, "duration_s": 60.0,
                "adaptive_config": {"heartbeat_interval": 0.1, "phi_threshold": 8.0,
                                    "phi_min_std": 0.1, "max_silence": 2.0},
            },
            "faults": {
                "kill_mode": "alternate", "pause_every_s": 8.0, "kill_every_s": 16.0,
                "pause_median_s": 0.25, "pause_sigma": 1.0, "pause_max_s": 8.0,
                "rejoin_after_s": 1.0,
                "schedule": [
                    {"at": 1.0, "kind": "silent", "slot": 0, "seconds": 0.0},
                    {"at": 5.0, "kind": "pause", "slot": 1, "seconds": 0.5},
                    {"at": 9.0, "kind": "sigkill", "slot": 2, "seconds": 0.0},
                ],
            },
            "settings": [{
                "detector": "fixed 1 s", "timeout_s": 1.0, "quiet_step_interval_s": 0.0625,
                "goodput_lost": 0.25, "goodput_lost_one_device_per_worker": 0.375,
                "skipped_faults": [],
                "pause_records": [
                    {"fault": 1, "seconds": 0.5, "stall_s": 0.625, "evicted": False,
                     "resumed": 100.0},
                    {"fault": 2, "seconds": 3.0, "stall_s": None, "evicted": True,
                     "resumed": 203.0},
                ],
                "evictions": [{"pause": 2, "evicted_at": 201.0, "exited_at": 204.5}],
            }],
        },
    }  # fmt: skip


@pytest.fixture(scope="module")
def costs():
    return costs_from_results(crafted_results())


def quiet_mix(**changes: float) -> FaultMix:
    values = {"failure_rate": 1e-6, "silent_share": 0.0, "pauses_per_failure": 0.0,
              "pause_median_s": 0.25, "pause_sigma": 1.0, "pause_max_s": 8.0}  # fmt: skip
    values.update(changes)
    return FaultMix(**values)


def job(**changes: Any) -> Job:
    base = Job(ranks=4, step_s=1.0, checkpoint_every=None, checkpoint_write_s=0.0,
               checkpoint_load_s=0.0, state_bytes=1_000_000)  # fmt: skip
    return replace(base, **changes)


# ------------------------------------------------------------------ the costs


def test_costs_are_read_from_the_benchmark_fields_they_name(costs):
    rc, la, rg = costs.rollcall, costs.launcher, costs.replica_groups
    assert rc.crash_detect.value == 0.0625
    assert rc.crash_detect.source == "recovery.json: crash.detect_s.median"
    assert rc.group_rebuild.value == 0.125
    assert rc.roll_call.at(4) == pytest.approx(0.010)
    assert rc.join_roll_call.at(64) == pytest.approx(0.120)
    assert rc.transfer_bandwidth.value == pytest.approx(1e8)
    assert rc.transfer_fixed.value == pytest.approx(0.01)
    assert rc.startup.value == 3.0  # join to first step 3.25 - its stall 0.25
    assert rc.roll_call_deadline.value == 1.0
    assert rc.exit_after_eviction.value == 1.5  # exited 204.5 - resumed 203
    assert la.crash_detect.value == 2.0  # crash stall 12 - relaunch 10
    assert la.relaunch.value == 10.0
    assert la.join_arrival.value == 1.0
    assert la.round_window.value == 3.0
    assert "last_call_timeout=3" in la.round_window.source
    assert rg.heartbeat_setting.value == 1.0
    assert rg.quorum_overhead.value == 0.25
    assert rg.heal_stall.value == 0.5
    assert rg.startup.value == 2.0
    assert costs.pause_overhead.value == 0.125
    assert costs.fault_mix.pauses_per_failure.value == 8.0  # 16 s x 4 workers / 8 s
    assert costs.fault_mix.silent_share.value == 0.5
    assert dict(costs.runs)["peers.json"] == "2026-01-02T00:00:00+00:00, rollcall 0123456789"


def test_a_missing_field_is_named_with_its_file():
    results = crafted_results()
    del results["recovery.json"]["crash"]["group_rebuild_s"]
    with pytest.raises(CostsUnreadable, match=r"recovery.json has no field "
                                              r"'crash.group_rebuild_s.median'"):  # fmt: skip
        costs_from_results(results)


def test_a_missing_file_and_a_non_number_are_refused():
    results = crafted_results()
    del results["peers.json"]
    with pytest.raises(CostsUnreadable, match="peers.json is missing"):
        costs_from_results(results)
    results = crafted_results()
    results["recovery.json"]["crash"]["detect_s"]["median"] = "fast"
    with pytest.raises(CostsUnreadable, match="crash.detect_s.median is not a number"):
        costs_from_results(results)


def test_costs_survive_the_shipped_file_format(costs):
    text = json.dumps(costs_to_dict(costs, "2026-01-04"))
    assert costs_from_dict(json.loads(text)) == costs
    broken = json.loads(text)
    del broken["launcher"]["relaunch"]
    with pytest.raises(CostsUnreadable, match=r"launcher.relaunch is missing"):
        costs_from_dict(broken)


def test_the_shipped_costs_are_those_of_the_benchmark_results():
    """rollcall/planning/measured_costs.json is regenerated by bench/simulate.py
    whenever bench/results/ changes."""
    shipped = json.loads((ROOT / "rollcall" / "planning" / "measured_costs.json").read_text())
    results = {f: json.loads((ROOT / "bench" / "results" / f).read_text()) for f in RESULT_FILES}
    assert costs_from_dict(shipped) == costs_from_results(results)


def test_roll_call_latency_is_linear_between_measured_counts_and_beyond():
    curve = ByMembers((4, 64, 512), (0.01, 0.07, 0.5), "crafted")
    assert curve.at(1) == 0.01
    assert curve.at(34) == pytest.approx(0.04)
    assert curve.at(1024) == pytest.approx(0.5 + 512 * (0.43 / 448))
    assert curve.extrapolated(1024) and not curve.extrapolated(512)
    assert curve.flat_beyond().at(100_000) == pytest.approx(0.5)


def test_flat_roll_call_changes_only_rollcall_beyond_the_measured_counts(costs):
    flat = with_flat_roll_call(costs)
    assert flat.rollcall.roll_call.at(64) == costs.rollcall.roll_call.at(64)
    assert flat.rollcall.roll_call.at(10_000) < costs.rollcall.roll_call.at(10_000)
    assert flat.launcher == costs.launcher


# ---------------------------------------------------------------- the timeline


@settings(max_examples=60, deadline=None)
@given(
    cuts=st.lists(st.floats(0.0, 500.0, allow_nan=False), max_size=12),
    every=st.integers(1, 40),
    write=st.sampled_from([0.0, 0.5, 3.0]),
    capacity=st.sampled_from([1.0, 0.75, 0.5]),
)
def test_advancing_in_one_go_or_in_pieces_spends_time_alike(cuts, every, write, capacity):
    """Whole checkpoint cycles are skipped in closed form; the result must
    be the same as walking through them."""
    whole, pieces = Timeline(0.5, every, write), Timeline(0.5, every, write)
    whole.capacity = pieces.capacity = capacity
    whole.advance(500.0)
    for t in sorted(cuts) + [500.0]:
        pieces.advance(t)
    a, b = whole.breakdown(), pieces.breakdown()
    for category in Category:
        assert a.of(category) == pytest.approx(b.of(category), abs=1e-6)
    assert a.wall_s == pytest.approx(500.0)
    assert whole.durable == pieces.durable


def test_with_no_fault_goodput_is_one_less_the_checkpoint_writes(costs):
    """K steps of s seconds, then C seconds of writing: goodput K s / (K s + C)."""
    every, write = 30, 5.0
    j = job(checkpoint_every=every, checkpoint_write_s=write)
    horizon = 7 * (every * j.step_s + write)
    trace = Trace(j.ranks, horizon, ())
    for system in System:
        outcome = simulate(system, j, Host(), costs, 1.0, trace, until=horizon)
        assert outcome.goodput == pytest.approx(every / (every + write))
        checkpointing = outcome.breakdown.share(Category.CHECKPOINT)
        assert checkpointing == pytest.approx(write / (every + write))


def test_with_fewer_ranks_on_a_shared_host_the_rate_follows_the_cores():
    host = Host(cores=2)
    assert host.capacity(3, 3) == 1.0
    assert host.capacity(2, 3) == 1.0
    assert host.capacity(1, 3) == 0.5
    assert Host().capacity(3, 4) == 0.75


# ------------------------------------------------------------------- systems


def test_launcher_loss_per_failure_is_the_restart_formula(costs):
    """DESIGN.md: T_restart = (s_done - s_ckpt) T_step + T_launch + T_load.
    Checkpoint at step 100, failure after step 104 with 8 s steps: 4 x 8
    replayed, plus the crafted relaunch (10 s) and crash detection (2 s),
    plus a 12 s load."""
    j = job(step_s=8.0, checkpoint_every=100, checkpoint_load_s=12.0, ranks=8)
    crash_at = 104 * 8.0
    horizon = 2000.0
    trace = scripted(8, horizon, [Failure(crash_at, 3, FailureKind.CRASH)])
    outcome = simulate(System.LAUNCHER, j, Host(), costs, 30.0, trace, until=horizon)
    b = outcome.breakdown
    restart = (104 - 100) * 8.0 + costs.launcher.relaunch.value + 12.0
    assert b.of(Category.REPLAY) == pytest.approx(32.0)
    assert b.of(Category.DETECTION) == pytest.approx(costs.launcher.crash_detect.value)
    assert b.of(Category.RECONFIGURATION) == pytest.approx(costs.launcher.relaunch.value + 12.0)
    lost = horizon - b.of(Category.USEFUL)
    assert lost == pytest.approx(restart + costs.launcher.crash_detect.value)


def test_a_launcher_replacement_after_the_rendezvous_closed_restarts_everyone_again(costs):
    """Crash at 100 s (a checkpoint was just written): detected 2 s later,
    relaunched by 112 s; the replacement, started 20 s after the crash,
    reaches the rendezvous at 121 s, long after the round closed (105 s):
    everyone restarts again and replays the 9 s trained at 3/4 of the rate."""
    j = job(checkpoint_every=50)
    trace = scripted(4, 500.0, [Failure(100.0, 0, FailureKind.CRASH)])
    late = simulate(System.LAUNCHER, j, Host(replace_after_s=20.0), costs, 30.0, trace,
                    until=500.0).breakdown  # fmt: skip
    assert late.of(Category.DETECTION) == pytest.approx(2.0)
    assert late.of(Category.RECONFIGURATION) == pytest.approx(2 * costs.launcher.relaunch.value)
    assert late.of(Category.REPLAY) == pytest.approx(9.0 * 0.75)
    assert late.of(Category.MISSING) == pytest.approx(9.0 * 0.25)
    # Within the round (started at once, there 1 s later): one restart only.
    merged = simulate(System.LAUNCHER, j, Host(replace_after_s=0.0), costs, 30.0, trace,
                      until=500.0).breakdown  # fmt: skip
    assert merged.of(Category.RECONFIGURATION) == pytest.approx(costs.launcher.relaunch.value)
    assert merged.of(Category.REPLAY) == 0.0


def test_a_rollcall_crash_costs_detection_a_view_change_and_half_a_step(costs):
    j = job(ranks=4, step_s=1.0)
    trace = scripted(4, 200.0, [Failure(50.0, 1, FailureKind.CRASH)])
    b = simulate(System.ROLLCALL, j, Host(replace_after_s=1000.0), costs, 5.0, trace,
                 until=200.0).breakdown  # fmt: skip
    rc = costs.rollcall
    assert b.of(Category.DETECTION) == pytest.approx(rc.crash_detect.value)
    assert b.of(Category.RECONFIGURATION) == pytest.approx(
        rc.roll_call.at(3) + rc.group_rebuild.value + 0.5)
    assert b.of(Category.REPLAY) == 0.0
    # Three of four ranks train on: a quarter of the rate is missing after.
    assert b.of(Category.MISSING) == pytest.approx(
        0.25 * (200.0 - 50.0 - b.of(Category.DETECTION) - b.of(Category.RECONFIGURATION)))


def test_a_silent_failure_is_found_after_the_timeout(costs):
    trace = scripted(4, 200.0, [Failure(50.0, 1, FailureKind.SILENT)])
    for timeout in (0.5, 4.0):
        b = simulate(System.ROLLCALL, job(), Host(replace_after_s=1000.0), costs, timeout, trace,
                     until=200.0).breakdown  # fmt: skip
        assert b.of(Category.DETECTION) == pytest.approx(timeout)


def test_a_pause_shorter_than_the_timeout_is_sat_out_a_longer_one_evicts(costs):
    trace = scripted(4, 300.0, [Pause(50.0, 2, 1.5)])
    sat = simulate(System.ROLLCALL, job(), Host(), costs, 2.0, trace, until=300.0).breakdown
    assert sat.of(Category.PAUSES) == pytest.approx(1.5 + costs.pause_overhead.value)
    assert sat.of(Category.FALSE_EVICTION) == 0.0
    evicted = simulate(System.ROLLCALL, job(), Host(), costs, 1.0, trace, until=300.0).breakdown
    assert evicted.of(Category.PAUSES) == 0.0
    # The wait, the view change without it, and its replacement's join.
    rc = costs.rollcall
    expected = (1.0 + rc.roll_call.at(3) + rc.group_rebuild.value + 0.5
                + rc.join_roll_call.at(4) + rc.group_rebuild.value + rc.transfer_s(1_000_000)
                + 0.5)  # fmt: skip
    assert evicted.of(Category.FALSE_EVICTION) == pytest.approx(expected)


def test_replica_groups_replay_nothing_and_lose_the_group_until_it_heals(costs):
    j = job(ranks=8, replica_group=2, checkpoint_every=50)
    trace = scripted(8, 400.0, [Failure(100.0, 5, FailureKind.CRASH)])
    b = simulate(System.REPLICA_GROUPS, j, Host(), costs, 1.0, trace, until=400.0).breakdown
    rg = costs.replica_groups
    assert b.of(Category.REPLAY) == 0.0
    assert b.of(Category.DETECTION) == pytest.approx(1.0)  # the heartbeat timeout
    # The others train at 3/4 of the rate from the end of the quorum (the
    # drop at 101 s, its overhead and the aborted half step) until the
    # replacement, started at once, heals (its fetch ends within the heal stall).
    trained_without = (100.0 + rg.startup.value) - (101.0 + rg.quorum_overhead.value + 0.5)
    assert b.of(Category.MISSING) == pytest.approx(0.25 * trained_without)
    assert b.of(Category.RECONFIGURATION) == pytest.approx(
        rg.quorum_overhead.value + 0.5 + rg.heal_stall.value)


def test_a_job_left_with_no_member_resumes_from_its_checkpoint(costs):
    j = job(ranks=2, checkpoint_every=10, checkpoint_load_s=3.0)
    faults = [Failure(25.0, 0, FailureKind.CRASH), Failure(26.0, 1, FailureKind.CRASH)]
    b = simulate(System.ROLLCALL, j, Host(), costs, 1.0, scripted(2, 200.0, faults),
                 until=200.0).breakdown  # fmt: skip
    assert b.of(Category.REPLAY) == pytest.approx(5.0, abs=1.0)  # back from ~25 to 20


# ------------------------------------------------------------ traces and seeds


def test_the_same_seed_draws_the_same_trace_and_the_same_result(costs):
    mix = quiet_mix(failure_rate=1e-4, silent_share=0.5, pauses_per_failure=5.0)
    a = drawn_trace(mix, 64, 50, np.random.default_rng(7))
    b = drawn_trace(mix, 64, 50, np.random.default_rng(7))
    c = drawn_trace(mix, 64, 50, np.random.default_rng(8))
    assert a == b and a != c
    j = job(ranks=64, checkpoint_every=100, checkpoint_write_s=2.0)
    one = compare(System, j, Host(), costs, 2.0, a)
    two = compare(System, j, Host(), costs, 2.0, b)
    assert one == two


def test_a_drawn_trace_scales_with_ranks_and_keeps_pauses_within_the_cap():
    mix = quiet_mix(failure_rate=1e-6, pauses_per_failure=4.0, pause_max_s=2.0)
    trace = draw_trace(mix, 100_000, 3600.0, np.random.default_rng(1))
    expected = mix.failure_rate * 100_000 * 3600.0  # 360 failures
    assert abs(trace.failures - expected) < 5 * math.sqrt(expected)
    assert abs(trace.pauses - 4 * expected) < 5 * math.sqrt(4 * expected)
    assert max(f.seconds for f in trace.faults if isinstance(f, Pause)) <= 2.0
    assert len({f.slot for f in trace.faults}) > 0.9 * len(trace.faults)


def test_the_three_systems_meet_the_same_failures(costs):
    mix = quiet_mix(failure_rate=1e-5, silent_share=0.5, pauses_per_failure=3.0)
    trace = drawn_trace(mix, 1024, 40, np.random.default_rng(3))
    outcomes = compare(System, job(ranks=1024, checkpoint_every=500, checkpoint_write_s=1.0,
                                   replica_group=8), Host(), costs, 2.0, trace)  # fmt: skip
    assert {o.failures_hit for o in outcomes.values()} == {trace.failures}
    assert outcomes[System.ROLLCALL].goodput > outcomes[System.LAUNCHER].goodput


def test_a_bad_setting_is_a_named_error():
    with pytest.raises(BadJob, match="at least 1 rank"):
        job(ranks=0)
    with pytest.raises(BadJob, match="share of silent failures"):
        quiet_mix(silent_share=1.5)
    with pytest.raises(BadJob, match="time order"):
        Trace(4, 10.0, (Pause(5.0, 0, 1.0), Pause(1.0, 0, 1.0)))


# ------------------------------------------------------------------ the search


def test_goodput_against_the_detector_timeout_is_u_shaped(costs):
    """Short timeouts evict paused ranks, long ones sit out silent failures
    and long pauses: the middle beats both ends."""
    mix = quiet_mix(failure_rate=2e-5, silent_share=0.5, pauses_per_failure=8.0,
                    pause_median_s=0.3, pause_sigma=1.2)  # fmt: skip
    j = job(ranks=64, checkpoint_every=200, checkpoint_write_s=1.0)
    trace = drawn_trace(mix, 64, 200, np.random.default_rng(11))
    for system in System:
        curve = dict((t, o.goodput) for t, o in goodput_by_timeout(
            system, j, Host(), costs, trace, (0.1, 1.0, 2.0, 10.0, 120.0)))  # fmt: skip
        middle = max(curve[1.0], curve[2.0], curve[10.0])
        assert middle > curve[0.1], (system, curve)
        assert middle > curve[120.0], (system, curve)


def test_young_and_daly():
    assert young_s(10.0, 3600.0) == pytest.approx(math.sqrt(72_000))
    # Daly's estimate tends to Young's minus C when C << M.
    assert daly_s(1.0, 1e8) == pytest.approx(young_s(1.0, 1e8) - 1.0, rel=1e-3)
    assert daly_s(100.0, 10.0) == 10.0


def test_the_best_checkpoint_interval_is_near_young_daly_when_checkpoints_are_cheap(costs):
    mix = quiet_mix(failure_rate=1.0 / (64 * 4 * 3600.0))  # a job MTBF of 4 h
    write = 10.0
    j = job(ranks=64, checkpoint_write_s=write, checkpoint_load_s=20.0)
    daly = daly_s(write, mix.job_mtbf_s(64))
    trace = drawn_trace(mix, 64, 600, np.random.default_rng(5))
    points = goodput_by_interval(System.LAUNCHER, j, Host(), costs, 30.0, trace,
                                 interval_grid(daly, j.step_s))  # fmt: skip
    best, _ = max(points, key=lambda p: p[1].goodput)
    assert 0.5 < best / interval_steps(daly, j.step_s) < 2.0, points


# ------------------------------------------------------------------ validation


def test_the_peers_churn_runs_become_their_job_and_schedule(costs):
    (rollcall, torchrun, torchft) = peers_cases(crafted_results(), costs)
    assert rollcall.system is System.ROLLCALL and torchft.system is System.REPLICA_GROUPS
    assert rollcall.job.ranks == 3 and rollcall.host == Host(cores=2, replace_after_s=2.0)
    assert rollcall.job.step_s == pytest.approx(0.1)  # 32 samples at 320/s
    assert [f.at for f in rollcall.trace.faults] == [7.5, 22.5]
    assert (rollcall.measured, rollcall.measured_range) == (0.9, (0.8, 1.0))
    assert torchrun.until == 30.0


def test_the_sweep_setting_plays_its_recorded_schedule(costs):
    (case,) = sweep_cases(crafted_results(), steady_steps=3)
    assert [type(f).__name__ for f in case.trace.faults] == ["Failure", "Pause", "Failure"]
    assert case.trace.faults[0].at == 0.0 and case.trace.faults[2].at == 8.0
    assert case.measured == 0.75 and case.timeout == 1.0
    assert case.settle_s == pytest.approx(3 * 0.0625)


def test_the_adaptive_detector_is_its_suspicion_time_under_regular_heartbeats():
    """bench/README.md: phi 8 fires ~0.66 s after the last heartbeat with
    phi_min_std 0.1, ~1.5 s with 0.25."""
    config = {"heartbeat_interval": 0.1, "phi_threshold": 8.0, "phi_min_std": 0.1,
              "max_silence": 2.0}  # fmt: skip
    assert adaptive_timeout(config) == pytest.approx(0.66, abs=0.01)
    assert adaptive_timeout({**config, "phi_min_std": 0.25}) == pytest.approx(1.5, abs=0.02)
    assert adaptive_timeout({**config, "phi_min_std": 1.0}) == 2.0  # max_silence first

