"""Choosing a detector timeout and a checkpoint interval by simulation, and
the classic checkpoint interval to compare with.

Every candidate is played against the same drawn trace (common random
numbers), so the differences between candidates are the settings', not
the luck's. The launcher's checkpoint interval is searched around Daly's
estimate; rollcall keeps the launcher's interval (its failures never need
a checkpoint: live peers hold the state, so the interval only bounds what
losing every replica at once would cost, which this model does not draw),
and the detector timeout is searched for each.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from rollcall.planning.costs import Costs
from rollcall.planning.job import FaultMix, Host, Job, System
from rollcall.planning.simulate import Outcome, simulate
from rollcall.planning.trace import Trace

#: The detector timeouts tried: from SHORTEST, by factors of sqrt(2), up
#: to LONGEST_PAUSES times the longest pause of the mix.
SHORTEST_TIMEOUT_S = 0.1
LONGEST_PAUSES = 4.0
#: Checkpoint intervals tried: Daly's estimate times 2**(k/2), |k| <= this.
INTERVAL_HALF_OCTAVES = 4
#: Goodputs closer than this are equal (a flat stretch of the curve, where
#: no fault tells two settings apart): the tie goes to the shorter timeout
#: and to the interval nearer Daly's.
TIE = 1e-12


def young_s(write_s: float, mtbf_s: float) -> float:
    """Young's interval between checkpoints, sqrt(2 C M) (1974)."""
    return math.sqrt(2.0 * write_s * mtbf_s)


def daly_s(write_s: float, mtbf_s: float) -> float:
    """Daly's higher-order estimate of the optimum interval (2006):
    sqrt(2CM) [1 + sqrt(C/2M)/3 + (C/2M)/9] - C for C < 2M, else M."""
    if write_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = write_s / (2.0 * mtbf_s)
    return young_s(write_s, mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - write_s


def interval_steps(seconds: float, step_s: float) -> int:
    """Seconds of training between checkpoints as a whole number of steps."""
    return max(1, round(seconds / step_s))


def timeout_grid(mix: FaultMix) -> tuple[float, ...]:
    out = []
    t = SHORTEST_TIMEOUT_S
    while t <= LONGEST_PAUSES * mix.pause_max_s * (1 + 1e-9):
        out.append(round(t, 4))
        t *= math.sqrt(2.0)
    return tuple(out)


def interval_grid(daly: float, step_s: float) -> tuple[int, ...]:
    span = range(-INTERVAL_HALF_OCTAVES, INTERVAL_HALF_OCTAVES + 1)
    return tuple(sorted({interval_steps(daly * 2 ** (k / 2), step_s) for k in span}))


def goodput_by_timeout(
    system: System, job: Job, host: Host, costs: Costs, trace: Trace, timeouts: Sequence[float]
) -> list[tuple[float, Outcome]]:
    return [
        (t, simulate(system, job, host, costs, t, trace, until=trace.horizon)) for t in timeouts
    ]


def goodput_by_interval(
    system: System, job: Job, host: Host, costs: Costs, timeout: float, trace: Trace,
    intervals: Sequence[int],
) -> list[tuple[int, Outcome]]:  # fmt: skip
    return [
        (k, simulate(system, replace(job, checkpoint_every=k), host, costs, timeout, trace,
                     until=trace.horizon))  # fmt: skip
        for k in intervals
    ]


_Setting = TypeVar("_Setting", int, float)


def best(
    points: Sequence[tuple[_Setting, Outcome]], preference: Callable[[_Setting], float]
) -> tuple[_Setting, Outcome]:
    """The setting with the highest goodput; among those within ``TIE`` of
    it, the one ``preference`` ranks lowest."""
    top = max(o.goodput for _, o in points)
    return min((p for p in points if p[1].goodput >= top - TIE), key=lambda p: preference(p[0]))


@dataclass(frozen=True)
class Choice:
    system: System
    timeout_s: float
    checkpoint_every: int
    outcome: Outcome


@dataclass(frozen=True)
class Plan:
    mtbf_s: float
    young_s: float
    daly_s: float
    rollcall: Choice
    launcher: Choice
    trace: Trace


def recommend(job: Job, mix: FaultMix, host: Host, costs: Costs, trace: Trace) -> Plan:
    """The best detector timeout and checkpoint interval found for rollcall
    and for a restart-from-checkpoint launcher, on ``trace``."""
    mtbf = mix.job_mtbf_s(job.ranks)
    daly = daly_s(job.checkpoint_write_s, mtbf)
    timeouts = timeout_grid(mix)
    first = replace(job, checkpoint_every=interval_steps(daly, job.step_s))

    def best_timeout(system: System, j: Job) -> tuple[float, Outcome]:
        points = goodput_by_timeout(system, j, host, costs, trace, timeouts)
        return best(points, lambda t: t)

    t_launcher, _ = best_timeout(System.LAUNCHER, first)
    k_launcher, _ = best(
        goodput_by_interval(System.LAUNCHER, first, host, costs, t_launcher, trace,
                            interval_grid(daly, job.step_s)),  # fmt: skip
        lambda k: abs(math.log(k * job.step_s / daly)) if daly > 0 else k,
    )
    chosen = replace(job, checkpoint_every=k_launcher)
    t_launcher, launcher = best_timeout(System.LAUNCHER, chosen)
    t_rollcall, rollcall = best_timeout(System.ROLLCALL, chosen)
    return Plan(
        mtbf_s=mtbf,
        young_s=young_s(job.checkpoint_write_s, mtbf),
        daly_s=daly,
        rollcall=Choice(System.ROLLCALL, t_rollcall, k_launcher, rollcall),
        launcher=Choice(System.LAUNCHER, t_launcher, k_launcher, launcher),
        trace=trace,
    )
