"""Faults in time: which rank fails or pauses, when, and how. One trace is
played against every system, so that they are compared on the same luck.

A drawn trace samples the whole job's faults as one superposed Poisson
process (its rate is the per-rank rate times the ranks) and picks a rank
for each, so its cost grows with the number of faults, not of ranks."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from rollcall.planning.errors import BadJob
from rollcall.planning.job import FaultMix


class FailureKind(enum.Enum):
    #: The process or machine died and its TCP connections were reset: peers
    #: notice within milliseconds (SIGKILL on one host).
    CRASH = "crash"
    #: The machine stopped answering without closing anything (power loss,
    #: kernel panic, a partition): only a timeout finds it.
    SILENT = "silent"


@dataclass(frozen=True)
class Failure:
    at: float
    slot: int
    kind: FailureKind


@dataclass(frozen=True)
class Pause:
    """A healthy rank stops for ``seconds`` (GC, swap, I/O, a network blip)
    and then carries on as if nothing happened."""

    at: float
    slot: int
    seconds: float


Fault = Failure | Pause


@dataclass(frozen=True)
class Trace:
    """Faults of a job of ``slots`` ranks, in time order, within
    ``[0, horizon]``. A fault names a slot; if that slot's rank is not
    training (already failed, paused, starting) it hits the next slot that
    is, as bench/detector_sweep.py does."""

    slots: int
    horizon: float
    faults: tuple[Fault, ...]

    def __post_init__(self) -> None:
        times = [f.at for f in self.faults]
        if any(b < a for a, b in zip(times, times[1:], strict=False)):
            raise BadJob("a trace's faults must be in time order")
        if any(not 0 <= f.slot < self.slots for f in self.faults):
            raise BadJob(f"a trace's faults must name slots 0..{self.slots - 1}")

    @property
    def failures(self) -> int:
        return sum(1 for f in self.faults if isinstance(f, Failure))

    @property
    def pauses(self) -> int:
        return sum(1 for f in self.faults if isinstance(f, Pause))


def draw_trace(mix: FaultMix, ranks: int, horizon: float, rng: np.random.Generator) -> Trace:
    """Failures and pauses of a ``ranks``-rank job over ``horizon`` seconds."""
    if not (math.isfinite(horizon) and horizon > 0):
        raise BadJob(f"a trace needs a positive horizon, got {horizon!r}")
    n_failures = int(rng.poisson(mix.failure_rate * ranks * horizon))
    failure_at = np.sort(rng.uniform(0.0, horizon, n_failures))
    failure_slot = rng.integers(0, ranks, n_failures)
    silent = rng.random(n_failures) < mix.silent_share
    n_pauses = int(rng.poisson(mix.pause_rate * ranks * horizon))
    pause_at = np.sort(rng.uniform(0.0, horizon, n_pauses))
    pause_slot = rng.integers(0, ranks, n_pauses)
    lengths = np.exp(math.log(mix.pause_median_s) + mix.pause_sigma * rng.standard_normal(n_pauses))
    lengths = np.minimum(lengths, mix.pause_max_s)
    faults: list[Fault] = [
        Failure(float(t), int(s), FailureKind.SILENT if q else FailureKind.CRASH)
        for t, s, q in zip(failure_at, failure_slot, silent, strict=True)
    ]
    faults += [
        Pause(float(t), int(s), float(d))
        for t, s, d in zip(pause_at, pause_slot, lengths, strict=True)
    ]
    faults.sort(key=lambda f: f.at)
    return Trace(ranks, horizon, tuple(faults))


def periodic_kills(
    slots: int, every: float, duration: float, rng: np.random.Generator
) -> Trace:
    """A crash every ``every`` seconds from ``every / 2`` on, each of a rank
    picked at random, for ``duration`` seconds: bench/peers.py's churn."""
    if not (every > 0 and duration > 0):
        raise BadJob(f"kill every {every!r} s for {duration!r} s: both must be positive")
    faults: list[Fault] = []
    at = every / 2.0
    while at < duration:
        faults.append(Failure(at, int(rng.integers(0, slots)), FailureKind.CRASH))
        at += every
    return Trace(slots, duration, tuple(faults))


def scripted(slots: int, horizon: float, faults: Iterable[Fault]) -> Trace:
    """A trace from faults given one by one (sorted here)."""
    ordered: Sequence[Fault] = sorted(faults, key=lambda f: f.at)
    return Trace(slots, horizon, tuple(ordered))
