"""The phi-accrual failure detector, driven by explicit times (no sleeps)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from statistics import NormalDist

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcall.membership.config import Config
from rollcall.membership.detector import CLOCK_NOISE, FailureDetector, PhiAccrualDetector

DEFAULT = Config()
#: The default detector with a fence short enough for every threshold these
#: tests try (Config refuses a fence_window that is not below the earliest
#: suspicion, which a low threshold brings down to ~0.1 s).
LOOSE = DEFAULT.replace(fence_window=0.01)
# Far below any latency in these tests, far above float rounding of the times
# they use (at most a few thousand seconds).
EPS = 1e-9


def z_for_threshold(threshold: float) -> float:
    """Standard-normal distance at which the tail probability is 10^-threshold."""
    return -NormalDist().inv_cdf(10.0**-threshold)


def expected_latency(mean: float, std: float, config: Config = DEFAULT) -> float:
    """Silence after which phi crosses the threshold, from the formula."""
    std = max(std, config.phi_min_std)
    return min(mean + z_for_threshold(config.phi_threshold) * std, config.max_silence)


def fed(intervals: Iterable[float], config: Config = DEFAULT) -> PhiAccrualDetector:
    """A detector created at time 0 that then saw heartbeats ``intervals`` apart."""
    detector = PhiAccrualDetector(config, 0.0)
    now = 0.0
    for interval in intervals:
        now += interval
        detector.heartbeat(now)
    return detector


def latency(detector: PhiAccrualDetector) -> float:
    return detector.time_to_suspicion(detector.last_heartbeat)


intervals_st = st.lists(st.floats(0.0, 1.0), max_size=40)
thresholds_st = st.floats(0.5, 40.0)


# --- starting state --------------------------------------------------------


def test_new_detector_holds_one_synthetic_interval_and_takes_now_as_a_heartbeat() -> None:
    detector = PhiAccrualDetector(DEFAULT, 12.5)
    assert detector.last_heartbeat == 12.5
    assert detector.mean_interval == DEFAULT.heartbeat_interval
    assert detector.std_interval == 0.0
    assert detector.interval_count == 1


def test_phi_at_the_mean_interval_is_log10_of_2() -> None:
    detector = fed([0.1] * 10)
    assert detector.phi(detector.last_heartbeat + 0.1) == pytest.approx(math.log10(2.0))


# --- regular heartbeats ----------------------------------------------------


def test_regular_heartbeats_are_never_suspected() -> None:
    detector = PhiAccrualDetector(DEFAULT, 0.0)
    for beat in range(1, 1001):
        now = beat * 0.1
        assert not detector.suspected(now), beat
        detector.heartbeat(now)
        assert not detector.suspected(now)


@given(period=st.floats(0.005, 1.0), beats=st.integers(1, 200))
def test_heartbeats_at_the_configured_period_are_never_suspected(period: float, beats: int) -> None:
    config = DEFAULT.replace(heartbeat_interval=period)
    detector = PhiAccrualDetector(config, 0.0)
    for beat in range(1, beats + 1):
        assert not detector.suspected(beat * period)
        detector.heartbeat(beat * period)


def test_silence_after_regular_100ms_heartbeats_is_suspected_at_the_phi_latency() -> None:
    # Regular intervals have std 0, floored at phi_min_std = 250 ms: phi
    # crosses 8 at 100 ms + 5.612 * 250 ms = 1.503 s, before max_silence.
    assert DEFAULT.phi_min_std == 0.25
    detector = fed([0.1] * 200)
    expected = 0.1 + z_for_threshold(8.0) * 0.25
    assert expected == pytest.approx(1.503, abs=1e-3)
    assert latency(detector) == pytest.approx(expected, abs=1e-9)
    last = detector.last_heartbeat
    assert not detector.suspected(last + expected - 1e-6)
    assert detector.suspected(last + expected + 1e-6)
    assert expected < DEFAULT.max_silence
    # A worker's fence gives up on a step before anyone may suspect it.
    assert DEFAULT.fence_window < expected


# --- adaptation to jitter --------------------------------------------------


def test_jitter_below_the_std_floor_does_not_delay_suspicion() -> None:
    # 100 ms +- 30 ms uniform has a std of about 17 ms, below the floor.
    rng = random.Random(7)
    detector = fed([0.1 + rng.uniform(-0.03, 0.03) for _ in range(200)])
    assert detector.std_interval < DEFAULT.phi_min_std
    assert latency(detector) == pytest.approx(
        expected_latency(detector.mean_interval, 0.0), abs=1e-9
    )


def test_jitter_above_the_std_floor_delays_suspicion() -> None:
    config = DEFAULT.replace(phi_min_std=0.1)
    regular = fed([0.1] * 200, config)
    jittery = fed([0.0, 0.3] * 100, config)
    assert jittery.mean_interval == pytest.approx(0.15)
    assert jittery.std_interval == pytest.approx(0.15, rel=0.01)
    assert jittery.std_interval > config.phi_min_std
    assert latency(jittery) == pytest.approx(
        expected_latency(0.15, jittery.std_interval, config), abs=1e-9
    )
    assert latency(jittery) > latency(regular) + 0.1


@given(
    small=st.floats(0.0, 0.1),
    extra=st.floats(0.0, 0.1),
    beats=st.integers(1, 100),
)
def test_more_jitter_in_history_never_means_earlier_suspicion(
    small: float, extra: float, beats: int
) -> None:
    large = min(small + extra, 0.1)
    calm = fed([0.1 - small, 0.1 + small] * beats)
    wild = fed([0.1 - large, 0.1 + large] * beats)
    assert latency(wild) >= latency(calm) - EPS


# --- the max_silence bound -------------------------------------------------


def test_max_silence_bounds_suspicion_when_phi_would_wait_longer() -> None:
    config = DEFAULT.replace(phi_min_std=1.0)  # phi alone would wait ~5.7 s
    detector = fed([0.1] * 20, config)
    assert latency(detector) == pytest.approx(config.max_silence, abs=1e-9)
    last = detector.last_heartbeat
    assert detector.phi(last + config.max_silence + 1e-6) < config.phi_threshold
    assert detector.suspected(last + config.max_silence + 1e-6)


@given(intervals=intervals_st, threshold=thresholds_st)
def test_suspicion_comes_no_later_than_max_silence(
    intervals: list[float], threshold: float
) -> None:
    detector = fed(intervals, LOOSE.replace(phi_threshold=threshold))
    assert latency(detector) <= DEFAULT.max_silence + EPS
    assert detector.suspected(detector.last_heartbeat + DEFAULT.max_silence + EPS)


# --- phi and time_to_suspicion ---------------------------------------------


@given(intervals=intervals_st, t1=st.floats(0.0, 1000.0), t2=st.floats(0.0, 1000.0))
def test_phi_never_decreases_as_silence_grows(intervals: list[float], t1: float, t2: float) -> None:
    detector = fed(intervals)
    early, late = sorted((t1, t2))
    last = detector.last_heartbeat
    assert 0.0 <= detector.phi(last + early) <= detector.phi(last + late)


@given(intervals=intervals_st, since=st.floats(0.0, 3.0), threshold=thresholds_st)
def test_time_to_suspicion_agrees_with_suspected(
    intervals: list[float], since: float, threshold: float
) -> None:
    detector = fed(intervals, LOOSE.replace(phi_threshold=threshold))
    now = detector.last_heartbeat + since
    wait = detector.time_to_suspicion(now)
    assert wait >= 0.0
    assert detector.suspected(now) == (wait == 0.0)
    assert detector.suspected(now + wait + EPS)
    if wait > 0.0:
        assert not detector.suspected(now + wait - EPS)


@given(intervals=intervals_st, low=thresholds_st, high=thresholds_st)
def test_a_higher_threshold_never_suspects_earlier(
    intervals: list[float], low: float, high: float
) -> None:
    low, high = sorted((low, high))
    eager = fed(intervals, LOOSE.replace(phi_threshold=low))
    patient = fed(intervals, LOOSE.replace(phi_threshold=high))
    assert latency(patient) >= latency(eager)


@given(intervals=intervals_st, threshold=thresholds_st)
def test_latency_follows_the_normal_distribution_of_the_window(
    intervals: list[float], threshold: float
) -> None:
    config = LOOSE.replace(phi_threshold=threshold)
    detector = fed(intervals, config)
    expected = expected_latency(detector.mean_interval, detector.std_interval, config)
    assert latency(detector) == pytest.approx(max(expected, 0.0), abs=1e-9)


def test_phi_never_decreases_across_the_switch_to_its_tail_series() -> None:
    detector = fed([0.1] * 10)
    last = detector.last_heartbeat
    silence = 0.1 + 20.0 * math.sqrt(2.0) * 0.05
    silence = silence - 1000 * (math.nextafter(silence, math.inf) - silence)
    previous = detector.phi(last + silence)
    for _ in range(2000):
        silence = math.nextafter(silence, math.inf)
        phi = detector.phi(last + silence)
        assert phi >= previous
        previous = phi


def test_the_configured_threshold_sets_the_latency() -> None:
    for threshold in (1.0, 8.0, 12.0):
        config = LOOSE.replace(phi_threshold=threshold)
        expected = 0.1 + z_for_threshold(threshold) * DEFAULT.phi_min_std
        assert latency(fed([0.1] * 50, config)) == pytest.approx(expected, abs=1e-9)


def test_phi_in_the_far_tail_matches_the_normal_distribution() -> None:
    # Past z = 20 phi comes from an asymptotic series, not from erfc; up to
    # z = 26 erfc is still representable and serves as the reference.
    detector = fed([0.1] * 10)
    for z in (19.0, 20.0, 20.5, 22.0, 24.0, 26.0):
        silence = 0.1 + z * math.sqrt(2.0) * DEFAULT.phi_min_std
        reference = -math.log10(0.5 * math.erfc(z))
        assert detector.phi(silence + 1.0) == pytest.approx(reference, rel=1e-12)


def test_phi_stays_finite_after_any_silence() -> None:
    detector = fed([0.1] * 10)
    for silence in (1e3, 1e10, 1e100, 1e300):
        phi = detector.phi(detector.last_heartbeat + silence)
        assert math.isfinite(phi) and phi > DEFAULT.phi_threshold


def test_a_threshold_that_phi_exceeds_at_once_means_immediate_suspicion() -> None:
    # Config refuses such a threshold (no fence fits below a suspicion at
    # once): force it past the check to see that the detector still copes.
    config = Config()
    object.__setattr__(config, "phi_threshold", 1e-3)
    detector = fed([0.1] * 10, config)
    assert detector.suspected(detector.last_heartbeat)
    assert latency(detector) == 0.0


# --- the earliest suspicion: the bound of a worker's fence ---------------------


def test_the_default_earliest_suspicion_is_about_5_6_floors_of_the_std() -> None:
    earliest = DEFAULT.earliest_suspicion()
    assert earliest == pytest.approx(z_for_threshold(8.0) * DEFAULT.phi_min_std, abs=1e-9)
    assert earliest == pytest.approx(1.403, abs=1e-3)
    assert DEFAULT.fence_window < earliest


def test_a_member_whose_messages_come_in_bursts_is_suspected_at_the_earliest_suspicion() -> None:
    # Progress reports and answers count as heartbeats too, so the mean
    # interval can fall far below heartbeat_interval: suspicion then comes
    # before heartbeat_interval + 5.6 x phi_min_std (1.503 s).
    detector = fed([0.0] * DEFAULT.phi_window)
    assert detector.mean_interval == 0.0
    assert latency(detector) == pytest.approx(DEFAULT.earliest_suspicion(), abs=1e-9)
    assert latency(detector) < DEFAULT.heartbeat_interval + z_for_threshold(8.0) * 0.25 - 0.09


@given(intervals=intervals_st, threshold=thresholds_st)
def test_no_history_is_suspected_before_the_earliest_suspicion(
    intervals: list[float], threshold: float
) -> None:
    config = LOOSE.replace(phi_threshold=threshold)
    assert latency(fed(intervals, config)) >= config.earliest_suspicion() - EPS


def test_the_earliest_suspicion_is_never_later_than_max_silence() -> None:
    config = DEFAULT.replace(phi_min_std=1.0)  # phi alone would wait ~5.6 s
    assert config.earliest_suspicion() == config.max_silence


def test_config_refuses_a_fence_window_that_is_not_below_the_earliest_suspicion() -> None:
    with pytest.raises(ValueError, match=r"fence_window \(1.5 s\) must be below the detector's "
                       r"earliest suspicion \(1.403 s"):  # fmt: skip
        Config(fence_window=1.5)
    with pytest.raises(ValueError, match=r"earliest suspicion \(0.2806 s"):
        Config(phi_min_std=0.05)  # the default fence, 0.5 s, is too long for it
    assert Config(phi_min_std=0.05, fence_window=0.2).fence_window == 0.2


# --- the window --------------------------------------------------------------


def test_the_window_keeps_only_the_latest_intervals() -> None:
    config = DEFAULT.replace(phi_window=5)
    detector = fed([1.0] * 10 + [0.1] * 5, config)
    assert detector.interval_count == 5
    assert detector.mean_interval == pytest.approx(0.1)
    assert detector.std_interval == pytest.approx(0.0, abs=1e-12)


@given(window=st.integers(1, 20), intervals=intervals_st)
def test_the_window_never_exceeds_its_size(window: int, intervals: list[float]) -> None:
    detector = fed(intervals, DEFAULT.replace(phi_window=window))
    assert detector.interval_count == min(window, len(intervals) + 1)
    recent = ([DEFAULT.heartbeat_interval] + intervals)[-window:]
    assert detector.mean_interval == pytest.approx(math.fsum(recent) / len(recent), abs=1e-12)


# --- invalid times -----------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_times_are_rejected(bad: float) -> None:
    with pytest.raises(ValueError, match="finite"):
        PhiAccrualDetector(DEFAULT, bad)
    detector = PhiAccrualDetector(DEFAULT, 0.0)
    for method in (
        detector.heartbeat,
        detector.phi,
        detector.suspected,
        detector.time_to_suspicion,
    ):
        with pytest.raises(ValueError, match="finite"):
            method(bad)


def test_time_before_the_last_heartbeat_is_rejected() -> None:
    detector = fed([0.1] * 3)
    last = detector.last_heartbeat
    for method in (
        detector.heartbeat,
        detector.phi,
        detector.suspected,
        detector.time_to_suspicion,
    ):
        with pytest.raises(ValueError, match="backwards"):
            method(last - 0.01)


def test_time_a_hair_before_the_last_heartbeat_is_taken_as_that_heartbeat() -> None:
    detector = fed([0.1] * 3)
    last = detector.last_heartbeat
    hair = last - CLOCK_NOISE / 2
    assert detector.phi(hair) == detector.phi(last)
    assert detector.time_to_suspicion(hair) == detector.time_to_suspicion(last)
    detector.heartbeat(hair)
    assert detector.last_heartbeat == last
    assert detector.interval_count == 5


# --- FailureDetector ---------------------------------------------------------


def test_watch_forget_and_membership() -> None:
    fd = FailureDetector(DEFAULT)
    fd.watch("b", 0.0)
    fd.watch("a", 0.0)
    assert fd.watched() == ["a", "b"]
    assert "a" in fd and "c" not in fd
    assert len(fd) == 2
    fd.forget("a")
    fd.forget("never-watched")
    assert fd.watched() == ["b"]
    assert "a" not in fd


def test_heartbeats_of_unwatched_members_are_ignored() -> None:
    fd = FailureDetector(DEFAULT)
    fd.heartbeat("ghost", 1.0)
    assert fd.watched() == []
    with pytest.raises(ValueError, match="finite"):
        fd.heartbeat("ghost", math.nan)


def test_suspects_are_the_silent_members_sorted() -> None:
    fd = FailureDetector(DEFAULT)
    for member in ("c", "a", "b"):
        fd.watch(member, 0.0)
    assert fd.suspects(0.3) == []
    for beat in range(1, 11):
        fd.heartbeat("b", beat * 0.1)
    assert fd.suspects(1.6) == ["a", "c"]  # silent 1.6 s; b 0.6 s
    assert fd.phi("b", 1.6) < DEFAULT.phi_threshold < fd.phi("a", 1.6)


def test_watching_again_restarts_from_a_fresh_history() -> None:
    fd = FailureDetector(DEFAULT)
    fd.watch("a", 0.0)
    for beat in range(1, 11):
        fd.heartbeat("a", beat * 0.3)
    fd.watch("a", 5.0)
    assert fd.phi("a", 5.0) == PhiAccrualDetector(DEFAULT, 5.0).phi(5.0)
    assert fd.next_check(5.0) == pytest.approx(5.0 + expected_latency(0.1, 0.0))


def test_phi_of_an_unwatched_member_is_a_key_error() -> None:
    with pytest.raises(KeyError, match="not watched"):
        FailureDetector(DEFAULT).phi("nobody", 0.0)


def test_next_check_is_none_with_nobody_watched() -> None:
    assert FailureDetector(DEFAULT).next_check(0.0) is None


def test_next_check_is_the_earliest_suspicion() -> None:
    fd = FailureDetector(DEFAULT)
    fd.watch("early", 0.0)
    fd.watch("late", 0.2)
    assert fd.next_check(0.2) == pytest.approx(expected_latency(0.1, 0.0), abs=1e-9)
    fd.forget("early")
    assert fd.next_check(0.2) == pytest.approx(0.2 + expected_latency(0.1, 0.0), abs=1e-9)


def test_next_check_is_now_while_a_suspect_is_still_watched() -> None:
    fd = FailureDetector(DEFAULT)
    fd.watch("a", 0.0)
    assert fd.next_check(10.0) == 10.0


@given(
    starts=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=5),
    beats=st.lists(st.tuples(st.integers(0, 4), st.floats(0.0, 0.5)), max_size=30),
    since=st.floats(0.0, 3.0),
)
def test_next_check_is_when_the_first_suspect_appears(
    starts: list[float], beats: list[tuple[int, float]], since: float
) -> None:
    fd = FailureDetector(DEFAULT)
    last = {}
    for index, start in enumerate(starts):
        fd.watch(f"m{index}", start)
        last[f"m{index}"] = start
    for index, gap in beats:
        member = f"m{index % len(starts)}"
        last[member] += gap
        fd.heartbeat(member, last[member])
    now = max(last.values()) + since
    check = fd.next_check(now)
    assert check is not None and check >= now
    if check > now:
        assert fd.suspects(check - EPS) == []
    assert fd.suspects(check + EPS) != []


@settings(max_examples=100, deadline=None)
@given(
    lasts=st.lists(st.floats(0.0, 3.0), min_size=1, max_size=8),
    now=st.floats(0.0, 6.0),
)
def test_the_next_scan_is_never_after_the_first_suspicion_nor_before_now(
    lasts: list[float], now: float
) -> None:
    fd = FailureDetector(DEFAULT)
    for n, last in enumerate(lasts):
        fd.watch(f"m{n}", 0.0)
        if last > 0:
            fd.heartbeat(f"m{n}", last / 2)
            fd.heartbeat(f"m{n}", last)
    now = max(now, max(lasts))
    scan = fd.next_scan(now)
    assert scan is not None and scan >= now
    assert scan <= fd.next_check(now) + 1e-9


def test_a_member_silent_for_less_than_the_earliest_suspicion_costs_no_phi() -> None:
    fd = FailureDetector(DEFAULT)
    fd.watch("a", 0.0)
    for n in range(1, 50):
        fd.heartbeat("a", n * 0.1)
    detector = fd._detectors["a"]
    assert detector._stale  # statistics not computed for the heartbeats
    assert fd.suspects(4.9 + DEFAULT.earliest_suspicion() * 0.99) == []
    assert detector._stale
    assert fd.suspects(4.9 + 1.6) == ["a"]
