"""``rollcall plan``: the detector timeout and checkpoint interval for a job,
and the goodput to expect with rollcall and with a restart-from-checkpoint
launcher, from a simulation of the job under its failure rate with the
costs this project measured (``rollcall.planning``).

The costs come from the file shipped in the package
(``rollcall/planning/measured_costs.json``, written by bench/simulate.py
from bench/results/), or with ``--costs-from`` from a directory of benchmark
results or another such file. The simulation is imported inside the command,
so that ``rollcall --help`` stays instant.
"""

from __future__ import annotations

import json
import math
import re
from importlib import resources
from pathlib import Path
from typing import Any

import click

SHIPPED_COSTS = "measured_costs.json"

_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_AMOUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


class Duration(click.ParamType):
    """Seconds, or a number with a unit: 500ms, 30s, 2m (or 2min), 7.9h, 1d."""

    name = "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None
                ) -> float:  # fmt: skip
        if isinstance(value, float):
            return value
        match = _AMOUNT.match(str(value))
        unit = match.group(2).lower() if match else ""
        if match is None or (unit and unit not in _DURATION_UNITS):
            self.fail(f"{value!r} is not a duration (e.g. 500ms, 30s, 2m, 7.9h, 1d)", param, ctx)
        seconds = float(match.group(1)) * _DURATION_UNITS.get(unit or "s", 1.0)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a finite duration", param, ctx)
        return seconds


class Size(click.ParamType):
    """Bytes, or a number with a unit: 20GB, 1.5GiB, 500MB, 2T."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None
                ) -> int:  # fmt: skip
        if isinstance(value, int):
            return value
        match = _AMOUNT.match(str(value))
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _SIZE_UNITS:
            self.fail(f"{value!r} is not a size (e.g. 20GB, 1.5GiB, 500MB)", param, ctx)
        return round(float(match.group(1)) * _SIZE_UNITS[unit])


DURATION = Duration()
SIZE = Size()


def _load_costs(source: Path | None) -> tuple[Any, str]:
    from rollcall.planning.costs import RESULT_FILES, costs_from_dict, costs_from_results

    if source is None:
        text = resources.files("rollcall.planning").joinpath(SHIPPED_COSTS).read_text()
        data = json.loads(text)
        costs = costs_from_dict(data)
        return costs, f"measured in runs of {_run_dates(data)} (shipped with rollcall)"
    if source.is_dir():
        results = {f: json.loads((source / f).read_text()) for f in RESULT_FILES
                   if (source / f).exists()}  # fmt: skip
        return costs_from_results(results), f"from the benchmark results in {source}"
    data = json.loads(source.read_text())
    return costs_from_dict(data), f"from {source} ({_run_dates(data)})"


def _failure_rate(ranks: int, mtbf: float | None, rank_mtbf: float | None,
                  per_hour: float | None) -> float:  # fmt: skip
    """Failures per rank per second, from whichever of the three was given."""
    given = {"--mtbf": mtbf, "--rank-mtbf": rank_mtbf, "--failure-rate": per_hour}
    named = [name for name, value in given.items() if value is not None]
    if len(named) != 1:
        raise click.UsageError("give the failure rate exactly one way: --mtbf, --rank-mtbf or "
                               f"--failure-rate (got {', '.join(named) or 'none'})")  # fmt: skip
    value = given[named[0]]
    assert value is not None
    if not value > 0:
        raise click.UsageError(f"{named[0]} must be positive, got {value:g}")
    if mtbf is not None:
        return 1.0 / (mtbf * ranks)
    if rank_mtbf is not None:
        return 1.0 / rank_mtbf
    return value / 3600.0


def _run_dates(data: Any) -> str:
    runs = data.get("runs", {}) if isinstance(data, dict) else {}
    days = sorted({str(v)[:10] for v in runs.values()})
    return ", ".join(days) or "unknown dates"


@click.command()
@click.option("--ranks", type=click.IntRange(min=1), required=True,
              help="Ranks (data-parallel replicas, one device each).")
@click.option("--mtbf", type=DURATION,
              help="Mean time between failures of the whole job (e.g. 7.9h).")
@click.option("--rank-mtbf", type=DURATION,
              help="Mean time between failures of one rank (e.g. 8000h).")
@click.option("--failure-rate", type=click.FloatRange(min=0, min_open=True),
              help="Failures per rank per hour.")
@click.option("--step", "step_s", type=DURATION, required=True,
              help="Time of one training step at full size (e.g. 2s).")
@click.option("--checkpoint-write", type=DURATION, required=True,
              help="Time a checkpoint blocks training while it is written.")
@click.option("--checkpoint-load", type=DURATION, required=True,
              help="Time to load a checkpoint after a restart.")
@click.option("--state", "state_bytes", type=SIZE, required=True,
              help="Size of one replica's state, what a joiner fetches (e.g. 20GB).")
@click.option("--silent-share", type=click.FloatRange(0, 1),
              help="Share of failures that leave no TCP reset (default: the detector "
                   "sweep's mix).")
@click.option("--pauses-per-failure", type=click.FloatRange(min=0),
              help="Pauses of healthy ranks per failure (default: the detector sweep's mix).")
@click.option("--replace-after", type=DURATION, default="0s", show_default=True,
              help="How long after a rank is gone its replacement starts.")
@click.option("--failures", type=click.IntRange(min=10), default=300, show_default=True,
              help="Failures to simulate (more: steadier answer, slower).")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--costs-from", type=click.Path(exists=True, path_type=Path),
              help="A directory of benchmark results (bench/results) or a costs file "
                   "written by bench/simulate.py, instead of the costs shipped with rollcall.")
@click.option("--show-costs", is_flag=True, help="List every measured cost and its source.")
def plan(ranks: int, mtbf: float | None, rank_mtbf: float | None, failure_rate: float | None,
         step_s: float, checkpoint_write: float, checkpoint_load: float, state_bytes: int,
         silent_share: float | None, pauses_per_failure: float | None, replace_after: float,
         failures: int, seed: int, costs_from: Path | None, show_costs: bool) -> None:  # fmt: skip
    """Recommend a detector timeout and a checkpoint interval for a job, and
    predict its goodput with rollcall and with a restart-from-checkpoint
    launcher (torchrun-like), by simulating the job under its failure rate
    with costs measured by this project's benchmarks.

    Give the failure rate one way: --mtbf (the job's), --rank-mtbf or
    --failure-rate (per rank per hour).
    """
    import numpy as np

    from rollcall.planning.errors import BadJob
    from rollcall.planning.job import FaultMix, Host, Job
    from rollcall.planning.plan import recommend
    from rollcall.planning.simulate import drawn_trace
    from rollcall.planning.text import plan_text

    per_rank = _failure_rate(ranks, mtbf, rank_mtbf, failure_rate)
    costs, source = _load_costs(costs_from)
    m = costs.fault_mix
    try:
        mix = FaultMix(
            failure_rate=per_rank,
            silent_share=m.silent_share.value if silent_share is None else silent_share,
            pauses_per_failure=(m.pauses_per_failure.value if pauses_per_failure is None
                                else pauses_per_failure),  # fmt: skip
            pause_median_s=m.pause_median_s.value,
            pause_sigma=m.pause_sigma.value,
            pause_max_s=m.pause_max_s.value,
        )
        job = Job(ranks, step_s, None, checkpoint_write, checkpoint_load, state_bytes)
        host = Host(None, replace_after)
    except BadJob as exc:
        raise click.UsageError(str(exc)) from None
    trace = drawn_trace(mix, ranks, failures, np.random.default_rng(seed))
    result = recommend(job, mix, host, costs, trace)
    click.echo(plan_text(result, job, mix, costs, source, seed, show_costs))

