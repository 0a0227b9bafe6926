"""Config refuses settings whose relations cannot hold: a back-off that
starts above its cap, a poll interval not below the timeout it polls within,
and an etcd reconnect wait that gRPC's reconnect back-off outlasts."""

from __future__ import annotations

import pytest

from rollcall.membership.config import Config


def test_the_defaults_are_accepted() -> None:
    config = Config()

    assert config.group_abort_poll < config.collective_timeout
    assert config.etcd_reconnect_wait > config.etcd_reconnect_backoff_max


@pytest.mark.parametrize(
    ("initial", "maximum"),
    [
        ("client_retry_initial", "client_retry_max"),
        ("etcd_watch_backoff_initial", "etcd_watch_backoff_max"),
        ("etcd_reconnect_backoff_initial", "etcd_reconnect_backoff_max"),
        ("transfer_retry_initial", "transfer_retry_max"),
    ],
)
def test_a_back_off_may_not_start_above_its_cap(initial: str, maximum: str) -> None:
    cap = getattr(Config(), maximum)

    with pytest.raises(ValueError, match=f"{initial} must not exceed {maximum}"):
        Config(**{initial: cap * 2})
    assert getattr(Config(**{initial: cap}), initial) == cap


@pytest.mark.parametrize(
    ("poll", "bound"),
    [
        ("group_abort_poll", "collective_timeout"),
        ("group_store_probe_interval", "collective_timeout"),
        ("group_abort_settle_poll", "group_abort_settle"),
    ],
)
def test_a_poll_interval_must_be_below_what_it_polls_within(poll: str, bound: str) -> None:
    limit = getattr(Config(), bound)

    with pytest.raises(ValueError, match=f"{poll} must be below {bound}"):
        Config(**{poll: limit})


def test_the_etcd_reconnect_wait_must_outlast_grpcs_reconnect_back_off() -> None:
    with pytest.raises(ValueError, match="etcd_reconnect_wait must exceed"):
        Config(etcd_reconnect_backoff_max=0.25)
    assert Config(etcd_reconnect_backoff_max=0.2, etcd_reconnect_wait=0.3).etcd_reconnect_wait


def test_every_new_timing_field_is_positive() -> None:
    for name in ("group_park_grace", "group_store_probe_attempt", "loader_kill_wait"):
        with pytest.raises(ValueError, match=f"{name} must be positive"):
            Config(**{name: 0.0})


def test_a_steps_patience_for_an_acknowledgement_must_cover_a_leader_failover() -> None:
    with pytest.raises(ValueError, match=r"fence_patience \(2.5 s\) must cover a leader failover"):
        Config(fence_patience=2.5)
    assert Config(fence_patience=2.5, election_ttl=2, session_open_timeout=0.5).fence_patience


def test_the_heartbeat_interval_stays_until_the_rate_is_reached_then_grows_in_steps() -> None:
    config = Config(heartbeat_rate_max=1000.0)
    assert config.heartbeat_interval_for(0) == config.heartbeat_interval
    assert config.heartbeat_interval_for(100) == config.heartbeat_interval
    assert config.heartbeat_interval_for(101) == 0.15
    assert config.heartbeat_interval_for(150) == 0.15
    assert config.heartbeat_interval_for(151) == 0.2
    assert config.heartbeat_interval_for(10**6) == config.heartbeat_interval_max
    sizes = range(0, 5000, 37)
    intervals = [config.heartbeat_interval_for(n) for n in sizes]
    assert intervals == sorted(intervals)
    # Heartbeats of all members stay within the rate until the longest interval.
    for n, interval in zip(sizes, intervals, strict=True):
        assert n / interval <= config.heartbeat_rate_max or interval == 0.3


def test_the_heartbeat_interval_never_exceeds_a_quarter_of_the_earliest_suspicion() -> None:
    config = Config(phi_min_std=0.05, fence_window=0.2)
    assert config.earliest_suspicion() < 0.3
    assert config.heartbeat_interval_for(10**6) == config.heartbeat_interval  # 0.07 < 0.1
    tight = Config(phi_min_std=0.1, fence_window=0.3)
    assert tight.heartbeat_interval_for(10**6) == tight.earliest_suspicion() / 4


def test_a_step_end_wait_longer_than_the_roll_call_deadline_is_taken_for_long_steps() -> None:
    # A job whose steps take seconds waits that long at a join or a clean
    # leave instead of throwing the step in flight away; only roll calls
    # held at the step's end wait for it.
    config = Config(rollcall_step_end_wait=4.0)
    assert config.answer_deadline(at_step_end=True) == config.rollcall_deadline + 4.0
    assert config.answer_deadline(at_step_end=False) == config.rollcall_deadline
