"""One simulated run: a system, a job on a host, a detector timeout and a
trace in; where the time went out. ``compare`` plays one trace against
every system."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from rollcall.planning.costs import Costs
from rollcall.planning.errors import BadJob
from rollcall.planning.job import FaultMix, Host, Job, System
from rollcall.planning.systems import ENGINES
from rollcall.planning.timeline import Breakdown
from rollcall.planning.trace import Trace, draw_trace


@dataclass(frozen=True)
class Outcome:
    system: System
    breakdown: Breakdown
    #: Faults that found a rank to hit (the others found none training).
    failures_hit: int
    pauses_hit: int

    @property
    def goodput(self) -> float:
        return self.breakdown.goodput


def simulate(
    system: System,
    job: Job,
    host: Host,
    costs: Costs,
    timeout: float,
    trace: Trace,
    *,
    until: float | None = None,
    not_before: float = 0.0,
    settle_s: float = 0.0,
) -> Outcome:
    """Play ``trace`` against ``system``. The window ends at ``until``, or
    (``None``) once nothing is left to happen but not before ``not_before``,
    plus ``settle_s``."""
    if not (math.isfinite(timeout) and timeout > 0):
        raise BadJob(f"the detector timeout must be a positive number of seconds, got {timeout!r}")
    engine = ENGINES[system](job, host, costs, timeout, trace)
    end = max(engine.run(until), not_before)
    engine.timeline.advance(end + settle_s)
    return Outcome(system, engine.timeline.breakdown(), engine.failures_hit, engine.pauses_hit)


def compare(
    systems: Iterable[System],
    job: Job,
    host: Host,
    costs: Costs,
    timeout: float,
    trace: Trace,
) -> dict[System, Outcome]:
    """The same trace, to its horizon, against each system."""
    return {s: simulate(s, job, host, costs, timeout, trace, until=trace.horizon) for s in systems}


def horizon_for(mix: FaultMix, ranks: int, failures: int) -> float:
    """Long enough for ``failures`` failures of the job on average."""
    if failures < 1:
        raise BadJob(f"simulate at least 1 failure, got {failures}")
    return failures * mix.job_mtbf_s(ranks)


def drawn_trace(mix: FaultMix, ranks: int, failures: int, rng: np.random.Generator) -> Trace:
    return draw_trace(mix, ranks, horizon_for(mix, ranks, failures), rng)
