"""The real runs as simulation cases: each churn run of bench/peers.py and
each detector setting of bench/detector_sweep.py becomes the job, host and
fault trace that run had, with the goodput it measured beside what the
simulator predicts for it.

- peers.json churn: 3 workers on the machine's cores, each system's own
  failure-free step time, a crash every T s from T/2 on (the victim drawn
  here, the run's own draw not being recorded), the replacement started R s
  after each kill; goodput over the D-s window.
- detector-sweep.json: 4 workers, the recorded fault schedule itself
  (pauses, silent failures, SIGKILLs, by slot), a replacement R s after a
  worker is gone; goodput from the first fault until the job is whole
  again plus the benchmark's steady steps. A fixed timeout is itself; the
  adaptive detector is taken as the fixed timeout at which phi crosses its
  threshold under regular heartbeats (its floor on the deviation), which
  is how it behaved in the sweep.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollcall.membership.phi import phi
from rollcall.planning.costs import PEERS, RECOVERY, SWEEP, Costs
from rollcall.planning.errors import CostsUnreadable
from rollcall.planning.job import Host, Job, System
from rollcall.planning.simulate import Outcome, simulate
from rollcall.planning.trace import (
    Failure,
    FailureKind,
    Fault,
    Pause,
    Trace,
    periodic_kills,
    scripted,
)

#: bench/peers.py's names of the systems.
PEER_SYSTEMS = {"rollcall": System.ROLLCALL, "torchrun": System.LAUNCHER,
                "torchft": System.REPLICA_GROUPS}  # fmt: skip
SWEEP_KINDS = {"silent": FailureKind.SILENT, "sigkill": FailureKind.CRASH}
#: A sweep setting in which more than this share of the scheduled faults
#: found no ready worker kept its job in turmoil: workers evicted over and
#: over, the job down to one member or none. The model does not follow the
#: real job there (evicted workers took tens of seconds to exit, steps were
#: refused by a fence window of 0.6 T), so such runs are reported apart.
TURMOIL_SKIPPED = 0.25


@dataclass(frozen=True)
class Case:
    source: str
    label: str
    system: System
    job: Job
    host: Host
    timeout: float
    trace: Trace
    #: Window: to ``until``; or (None) until all is settled, at least to
    #: ``not_before``, plus ``settle_s``.
    until: float | None
    not_before: float
    settle_s: float
    measured: float
    measured_range: tuple[float, float] | None
    #: Why this run is outside what the model covers, if it is.
    outside: str = ""


@dataclass(frozen=True)
class Row:
    case: Case
    outcome: Outcome

    @property
    def simulated(self) -> float:
        return self.outcome.goodput

    @property
    def error(self) -> float:
        return self.simulated - self.case.measured


def _get(data: Any, path: str, where: str) -> Any:
    node = data
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise CostsUnreadable(f"{where} has no field {path!r}")
        node = node[part]
    return node


def _num(data: Any, path: str, where: str) -> float:
    value = _get(data, path, where)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CostsUnreadable(f"{where}: {path} is not a number")
    return float(value)


def adaptive_timeout(config: Mapping[str, Any]) -> float:
    """The silence after which the phi detector of ``config`` suspects a
    member whose heartbeats came exactly every ``heartbeat_interval`` (so
    its deviation sits at the floor ``phi_min_std``), or ``max_silence``."""
    mean = float(config["heartbeat_interval"])
    std = float(config["phi_min_std"])
    threshold = float(config["phi_threshold"])
    ceiling = float(config["max_silence"])
    if phi(ceiling, mean, std) <= threshold:
        return ceiling
    lo, hi = mean, ceiling
    for _ in range(60):
        mid = (lo + hi) / 2.0
        lo, hi = (lo, mid) if phi(mid, mean, std) > threshold else (mid, hi)
    return hi


def peers_cases(results: Mapping[str, Any], costs: Costs, seed: int = 0) -> list[Case]:
    peers = results.get(PEERS)
    if not isinstance(peers, Mapping):
        raise CostsUnreadable(f"{PEERS} is missing (bench/peers.py)")
    params = _get(peers, "parameters", PEERS)
    workers = int(_num(params, "workers", PEERS))
    batch = _num(params, "global_batch", PEERS)
    every_steps = int(_num(params, "checkpoint_every_steps", PEERS))
    duration = _num(params, "churn_duration_s", PEERS)
    state = int(_num(results.get(RECOVERY), "hot_add.bytes", RECOVERY))
    cores = int(_num(peers, "machine.cpus", PEERS))
    cases = []
    for name, system in PEER_SYSTEMS.items():
        run = _get(peers, f"systems.{name}", PEERS)
        step = batch / _num(run, "throughput_samples_per_s", PEERS)
        job = Job(workers, step, every_steps, 0.0, 0.0, state)
        for i, churn in enumerate(_get(params, "churn", PEERS)):
            every = _num(churn, "kill_every_s", PEERS)
            rate = _num(churn, "failures_per_min", PEERS)
            spread = _get(run, f"spread.goodput.{rate:g}", f"{PEERS} systems.{name}")
            cases.append(Case(
                source="peers.json churn", label=f"{name} @{rate:g}/min", system=system,
                job=job, host=Host(cores, _num(churn, "rejoin_after_s", PEERS)),
                timeout=costs.replica_groups.heartbeat_setting.value,
                trace=periodic_kills(workers, every, duration, np.random.default_rng(seed + i)),
                until=duration,
                not_before=0.0, settle_s=0.0,
                measured=_num(spread, "median", PEERS),
                measured_range=(_num(spread, "min", PEERS), _num(spread, "max", PEERS)),
            ))  # fmt: skip
    return cases


def _schedule(sweep: Mapping[str, Any]) -> tuple[list[Fault], float]:
    """The sweep's fault schedule, times from its first fault."""
    schedule = _get(sweep, "faults.schedule", SWEEP)
    if not isinstance(schedule, list) or not schedule:
        raise CostsUnreadable(f"{SWEEP}: faults.schedule is empty")
    first = min(_num(f, "at", SWEEP) for f in schedule)
    faults: list[Fault] = []
    for f in schedule:
        at, slot, kind = _num(f, "at", SWEEP) - first, int(_num(f, "slot", SWEEP)), f.get("kind")
        if kind == "pause":
            faults.append(Pause(at, slot, _num(f, "seconds", SWEEP)))
        elif kind in SWEEP_KINDS:
            faults.append(Failure(at, slot, SWEEP_KINDS[kind]))
        else:
            raise CostsUnreadable(f"{SWEEP}: fault kind {kind!r}")
    return faults, first


def sweep_cases(
    results: Mapping[str, Any], steady_steps: int, one_device_per_worker: bool = False
) -> list[Case]:
    """Every setting of the sweep; ``one_device_per_worker``: against the
    sweep's model of a worker per accelerator (a smaller view trains
    proportionally slower) instead of what the 2-core machine did."""
    sweep = results.get(SWEEP)
    if not isinstance(sweep, Mapping):
        raise CostsUnreadable(f"{SWEEP} is missing (bench/detector_sweep.py)")
    workers = int(_num(sweep, "parameters.workers", SWEEP))
    every_steps = int(_num(sweep, "parameters.checkpoint_every_steps", SWEEP))
    state = int(_num(results.get(RECOVERY), "hot_add.bytes", RECOVERY))
    cores = None if one_device_per_worker else int(_num(sweep, "machine.cpus", SWEEP))
    host = Host(cores, _num(sweep, "faults.rejoin_after_s", SWEEP))
    adaptive = adaptive_timeout(_get(sweep, "parameters.adaptive_config", SWEEP))
    faults, first = _schedule(sweep)
    duration = _num(sweep, "parameters.duration_s", SWEEP)
    trace = scripted(workers, duration, faults)
    lost_field = "goodput_lost_one_device_per_worker" if one_device_per_worker else "goodput_lost"
    cases = []
    for setting in _get(sweep, "settings", SWEEP):
        step = _num(setting, "quiet_step_interval_s", SWEEP)
        fixed = setting.get("timeout_s")
        timeout = adaptive if fixed is None else float(fixed)
        name = str(setting.get("detector"))
        if fixed is None:
            name += f" (as fixed {timeout:.2f} s)"
        skipped = len(setting.get("skipped_faults", []))
        outside = ""
        if skipped > TURMOIL_SKIPPED * len(faults):
            outside = (f"in turmoil: {skipped} of {len(faults)} faults found no ready worker; "
                       "evicted workers took up to "
                       f"{_slowest_exit(setting):.0f} s to exit")  # fmt: skip
        cases.append(Case(
            source="detector-sweep.json" + (" (1 device/worker)" if one_device_per_worker else ""),
            label=name, system=System.ROLLCALL,
            job=Job(workers, step, every_steps, 0.0, 0.0, state), host=host,
            timeout=timeout, trace=trace,
            until=None, not_before=duration - first, settle_s=steady_steps * step,
            measured=1.0 - _num(setting, lost_field, SWEEP), measured_range=None,
            outside=outside,
        ))  # fmt: skip
    return sorted(cases, key=lambda c: c.timeout)


def _slowest_exit(setting: Mapping[str, Any]) -> float:
    delays = [float(e["exited_at"]) - float(e["evicted_at"]) for e in setting.get("evictions", [])
              if isinstance(e, Mapping) and "exited_at" in e and "evicted_at" in e]  # fmt: skip
    return max(delays, default=0.0)


def run_case(case: Case, costs: Costs) -> Row:
    outcome = simulate(case.system, case.job, case.host, costs, case.timeout, case.trace,
                       until=case.until, not_before=case.not_before,
                       settle_s=case.settle_s)  # fmt: skip
    return Row(case, outcome)


@dataclass(frozen=True)
class Errors:
    """Simulated minus measured goodput over a set of rows."""

    rows: int
    mean_abs: float
    max_abs: float
    bias: float


def errors(rows: Sequence[Row]) -> Errors:
    if not rows:
        return Errors(0, math.nan, math.nan, math.nan)
    errs = [r.error for r in rows]
    return Errors(len(rows), statistics.fmean(abs(e) for e in errs), max(abs(e) for e in errs),
                  statistics.fmean(errs))  # fmt: skip
