"""Phi-accrual heartbeat failure detection (Hayashibara et al., 2004).

Instead of one fixed timeout, the detector learns the distribution of a
member's heartbeat intervals and reports a suspicion level

    phi = -log10(P(the next heartbeat arrives later than now))

under a normal distribution with the observed mean and standard deviation.
A member whose heartbeats are regular is suspected soon after it falls
silent; one whose heartbeats jitter is given proportionally longer. A hard
bound (``Config.max_silence``) caps the wait whatever the history says.

Pure code: the caller passes the time in (seconds, any monotonic origin);
nothing here reads a clock, sleeps or starts a thread.
"""

from __future__ import annotations

import math
from collections import deque

from rollcall.membership.config import Config
from rollcall.membership.phi import phi

#: A time at most this far before the last heartbeat is taken as that
#: heartbeat's time: callers that read the clock on different threads can see
#: sub-microsecond reorderings, which are noise, not a clock going backwards.
CLOCK_NOISE = 1e-6

def _check_finite(now: float) -> None:
    if not math.isfinite(now):
        raise ValueError(f"time must be a finite number of seconds, got {now!r}")



class PhiAccrualDetector:
    """Heartbeat failure detector for one monitored process that adapts to
    observed jitter.

    It starts with one synthetic interval of ``config.heartbeat_interval``
    and takes ``now`` as the first heartbeat. The last ``config.phi_window``
    intervals are kept. Every method taking ``now`` raises ``ValueError`` if
    it is not finite or lies before the last heartbeat (by more than
    ``CLOCK_NOISE``, which is clamped).
    """

    def __init__(
        self,
        config: Config,
        now: float,
        interval: float | None = None,
        earliest: float | None = None,
    ) -> None:
        """``interval``: the synthetic first interval (default
        ``config.heartbeat_interval``: the interval the member was told);
        ``earliest``: ``config.earliest_suspicion()``, if the caller has it."""
        _check_finite(now)
        self._config = config
        first = config.heartbeat_interval if interval is None else interval
        self._intervals: deque[float] = deque([first], maxlen=config.phi_window)
        self._last = now
        self._mean = first
        self._std = 0.0
        #: Whether mean and deviation are behind the window (computed when
        #: asked: heartbeats arrive far more often than phi is needed).
        self._stale = False
        #: No silence shorter than this is suspected, whatever the history
        #: (``Config.earliest_suspicion``): phi is not computed below it.
        self._earliest = config.earliest_suspicion() if earliest is None else earliest
        self._suspicion_time: float | None = None

    @property
    def last_heartbeat(self) -> float:
        """Time of the last heartbeat (or of construction)."""
        return self._last

    @property
    def mean_interval(self) -> float:
        """Mean of the intervals in the window."""
        self._update()
        return self._mean

    @property
    def std_interval(self) -> float:
        """Observed (population) standard deviation of the intervals in the
        window; phi uses it floored at ``config.phi_min_std``."""
        self._update()
        return self._std

    @property
    def interval_count(self) -> int:
        """Intervals currently in the window (at most ``config.phi_window``)."""
        return len(self._intervals)

    def heartbeat(self, now: float) -> None:
        """Record a heartbeat arriving at ``now``."""
        now = self._checked(now)
        self._intervals.append(now - self._last)
        self._last = now
        self._stale = True
        self._suspicion_time = None

    def _update(self) -> None:
        if not self._stale:
            return
        n = len(self._intervals)
        self._mean = math.fsum(self._intervals) / n
        self._std = math.sqrt(math.fsum((x - self._mean) ** 2 for x in self._intervals) / n)
        self._stale = False

    def phi(self, now: float) -> float:
        """Suspicion level at ``now``: -log10 of the probability that the
        next heartbeat is still to come. Near 0 right after a heartbeat,
        non-decreasing with silence, always finite."""
        return self._phi_at(self._checked(now))

    def suspected(self, now: float) -> bool:
        """Whether phi exceeds ``config.phi_threshold`` at ``now`` or the
        silence exceeds ``config.max_silence``."""
        return self._suspected_at(self._checked(now))

    def time_to_suspicion(self, now: float) -> float:
        """Seconds from ``now`` until ``suspected`` turns true if no heartbeat
        arrives (0 if it already is): when the caller should check again."""
        now = self._checked(now)
        return max(0.0, self.suspicion_time - now)

    @property
    def suspicion_time(self) -> float:
        """Earliest time at which ``suspected`` is true if no heartbeat
        arrives after the last one."""
        if self._suspicion_time is None:
            self._suspicion_time = self._find_suspicion_time()
        return self._suspicion_time

    def _checked(self, now: float) -> float:
        _check_finite(now)
        if now < self._last:
            if self._last - now > CLOCK_NOISE:
                raise ValueError(
                    f"time went backwards: {now!r} is {self._last - now:.6g} s "
                    f"before the last heartbeat at {self._last!r}"
                )
            return self._last
        return now

    def _phi_at(self, now: float) -> float:
        self._update()
        std = max(self._std, self._config.phi_min_std)
        return phi(now - self._last, self._mean, std)

    def _suspected_at(self, now: float) -> bool:
        silence = now - self._last
        if silence < self._earliest:
            # Never suspected yet, whatever phi would say: the mean is at
            # least 0 and the deviation at least phi_min_std, the case
            # earliest_suspicion computes. Spares computing phi for every
            # member at every look.
            return False
        return silence > self._config.max_silence or self._phi_at(now) > self._config.phi_threshold

    def _find_suspicion_time(self) -> float:
        # suspected() is monotone in time, so its switch point can be found
        # by bisecting the very predicate it evaluates: time_to_suspicion
        # then agrees with suspected() to the last float, which inverting
        # phi analytically would not guarantee.
        if self._suspected_at(self._last):
            return self._last
        lo = self._last
        step = self._config.max_silence
        hi = self._last + step
        while not self._suspected_at(hi):
            # Only rounding of last + max_silence can leave hi unsuspected.
            step *= 2.0
            hi = self._last + step
        while True:
            mid = lo + (hi - lo) / 2.0
            if mid <= lo or mid >= hi:
                return hi
            if self._suspected_at(mid):
                hi = mid
            else:
                lo = mid


class FailureDetector:
    """One ``PhiAccrualDetector`` per member id."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._detectors: dict[str, PhiAccrualDetector] = {}
        self._earliest = config.earliest_suspicion()
        #: The heartbeat interval the members were told (``set_interval``).
        self.interval = config.heartbeat_interval

    def set_interval(self, interval: float) -> None:
        """The members were told to heartbeat every ``interval`` seconds:
        members watched from now on start with it as their first interval
        (those watched already learn it from their heartbeats)."""
        if not math.isfinite(interval) or interval <= 0:
            raise ValueError(f"heartbeat interval must be positive, got {interval!r}")
        self.interval = interval

    def watch(self, member_id: str, now: float) -> None:
        """Start monitoring ``member_id``, taking ``now`` as its first
        heartbeat; a member already watched starts over with no history."""
        self._detectors[member_id] = PhiAccrualDetector(
            self._config, now, self.interval, self._earliest
        )

    def forget(self, member_id: str) -> None:
        """Stop monitoring ``member_id``; unknown ids are ignored."""
        self._detectors.pop(member_id, None)

    def heartbeat(self, member_id: str, now: float) -> None:
        """Record a heartbeat of ``member_id``. Heartbeats of members not
        watched (late ones from a forgotten member) are ignored."""
        _check_finite(now)
        detector = self._detectors.get(member_id)
        if detector is not None:
            detector.heartbeat(now)

    def suspects(self, now: float) -> list[str]:
        """Ids of the watched members suspected at ``now``, sorted."""
        _check_finite(now)
        return sorted(m for m, d in self._detectors.items() if d.suspected(now))

    def suspected(self, member_id: str, now: float) -> bool:
        """Whether ``member_id`` is suspected; ``KeyError`` if not watched."""
        return self._detector(member_id).suspected(now)

    def silence(self, member_id: str, now: float) -> float:
        """Seconds since ``member_id``'s last heartbeat (0 if not watched)."""
        detector = self._detectors.get(member_id)
        return 0.0 if detector is None else max(0.0, now - detector.last_heartbeat)

    def phi(self, member_id: str, now: float) -> float:
        """Suspicion level of ``member_id``; ``KeyError`` if not watched."""
        return self._detector(member_id).phi(now)

    def next_check(self, now: float) -> float | None:
        """Earliest time at which a watched member becomes suspect if no
        more heartbeats arrive, never before ``now`` (so it is ``now`` while
        a suspect is still watched); ``None`` if no member is watched."""
        _check_finite(now)
        if not self._detectors:
            return None
        return now + min(d.time_to_suspicion(now) for d in self._detectors.values())

    def next_scan(self, now: float) -> float | None:
        """A time, never before ``now``, at or before which to look for
        suspects again (``suspects``) if no more heartbeats arrive: no
        member becomes suspect earlier. Cheaper than ``next_check``, which
        it equals when a member is already silent for the detector's
        earliest suspicion: for the others it takes their last heartbeat
        plus that earliest suspicion, which costs no phi. ``None`` if no
        member is watched."""
        _check_finite(now)
        if not self._detectors:
            return None
        earliest = self._earliest
        soonest = math.inf
        for detector in self._detectors.values():
            bound = detector.last_heartbeat + earliest
            if bound <= now:
                bound = now + detector.time_to_suspicion(now)
            soonest = min(soonest, bound)
        return max(now, soonest)

    def watched(self) -> list[str]:
        """Ids of the watched members, sorted."""
        return sorted(self._detectors)

    def __contains__(self, member_id: object) -> bool:
        return member_id in self._detectors

    def __len__(self) -> int:
        return len(self._detectors)

    def _detector(self, member_id: str) -> PhiAccrualDetector:
        try:
            return self._detectors[member_id]
        except KeyError:
            raise KeyError(f"member {member_id!r} is not watched") from None
