"""The churn simulator (rollcall.planning) checked against the real runs,
and its curves at scale.

    .venv/bin/python bench/simulate.py [--results DIR] [--out DIR] [--failures 300] [--seed 1]

1. Reads the cost model from the benchmarks' JSON in --results
   (bench/results: peers.json, recovery.json, recovery-transfer.json,
   view_change*.json, detector-sweep.json) and writes it, with its sources
   and the runs' dates, to rollcall/planning/measured_costs.json, which is
   what an installed `rollcall plan` reads.
2. Validation: every churn run of peers.json and every setting of
   detector-sweep.json, simulated with that run's job, host and faults;
   measured and simulated goodput side by side, and the errors.
3. Curves at 8, 1,024, 10,000 and 100,000 ranks for the three systems, on
   one drawn trace per rank count (--failures failures of the job): goodput
   against the detector timeout (per-rank failure rate from Meta's 7.9 h
   MTTF of a 1,024-GPU job, arXiv 2410.21680), and against the per-rank
   MTBF (each system at its best timeout of the first curve). The job is
   EXAMPLE_JOB below (a stated example, not a measurement); the fault mix
   is detector_sweep.py's. Checkpoints every Daly interval for all three.

Writes simulate.json, simulate.md, simulate-validation.png,
simulate-detector.png and simulate-mtbf.png into --out (bench/results).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.detector_sweep import STEADY_STEPS  # noqa: E402
from rollcall.planning.costs import (  # noqa: E402
    RESULT_FILES,
    Costs,
    cost_lines,
    costs_from_results,
    costs_to_dict,
    with_flat_roll_call,
)
from rollcall.planning.job import FaultMix, Host, Job, System  # noqa: E402
from rollcall.planning.plan import (  # noqa: E402
    best,
    daly_s,
    goodput_by_timeout,
    interval_steps,
    timeout_grid,
)
from rollcall.planning.simulate import drawn_trace, simulate  # noqa: E402
from rollcall.planning.timeline import LOSSES, Breakdown  # noqa: E402
from rollcall.planning.trace import draw_trace  # noqa: E402
from rollcall.planning.validation import (  # noqa: E402
    Row,
    errors,
    peers_cases,
    run_case,
    sweep_cases,
)

SHIPPED = ROOT / "rollcall" / "planning" / "measured_costs.json"
RANKS = (8, 1024, 10_000, 100_000)
#: Meta (arXiv 2410.21680): mean time to failure of a 1,024-GPU job, 7.9 h.
META_JOB_MTTF_H = 7.9
META_JOB_RANKS = 1024
#: The example job of the curves (stated, not measured): 2 s steps, a
#: 20 GB replica state, checkpoints that block 20 s to write and take 60 s
#: to load, replica groups of 8 ranks (one node) for the TorchFT-like system
#: (of 1 rank in a job of fewer than 16, so that it has replicas at all).
EXAMPLE_JOB = Job(ranks=8, step_s=2.0, checkpoint_every=None, checkpoint_write_s=20.0,
                  checkpoint_load_s=60.0, state_bytes=20 * 10**9, replica_group=8)  # fmt: skip
#: Per-rank MTBF of the second curve, hours.
MTBF_HOURS = (1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000, 128_000)
#: Schedules drawn from detector_sweep.py's fault model for the mean curve.
SWEEP_SCHEDULES = 30
SYSTEMS = (System.ROLLCALL, System.LAUNCHER, System.REPLICA_GROUPS)
COLOURS = {System.ROLLCALL: "#2ca02c", System.LAUNCHER: "#d62728",
           System.REPLICA_GROUPS: "#1f77b4"}  # fmt: skip


def load_results(directory: Path) -> dict[str, Any]:
    return {f: json.loads((directory / f).read_text()) for f in RESULT_FILES
            if (directory / f).exists()}  # fmt: skip


def mix_of(costs: Costs, per_rank_mtbf_s: float) -> FaultMix:
    m = costs.fault_mix
    return FaultMix(1.0 / per_rank_mtbf_s, m.silent_share.value, m.pauses_per_failure.value,
                    m.pause_median_s.value, m.pause_sigma.value, m.pause_max_s.value)  # fmt: skip


def job_at(ranks: int, mix: FaultMix) -> Job:
    every = interval_steps(daly_s(EXAMPLE_JOB.checkpoint_write_s, mix.job_mtbf_s(ranks)),
                           EXAMPLE_JOB.step_s)  # fmt: skip
    group = EXAMPLE_JOB.replica_group if ranks >= 2 * EXAMPLE_JOB.replica_group else 1
    return replace(EXAMPLE_JOB, ranks=ranks, checkpoint_every=every, replica_group=group)


def eviction_cost(system: System, job: Job, costs: Costs) -> float:
    """What evicting a healthy rank costs the job beyond the wait: its
    "reconfiguration time" (for the U curve's 2x marker)."""
    if system is System.ROLLCALL:
        c = costs.rollcall
        return (c.roll_call.at(job.ranks - 1) + c.join_roll_call.at(job.ranks)
                + 2 * c.group_rebuild.value + c.transfer_s(job.state_bytes) + job.step_s)
    if system is System.LAUNCHER:
        return (costs.launcher.relaunch.value + job.checkpoint_load_s
                + (job.checkpoint_every or 0) * job.step_s / 2)
    c2 = costs.replica_groups
    return c2.quorum_overhead.value + c2.heal_stall.value + job.step_s / 2


# ------------------------------------------------------------------ validation


def validate(results: dict[str, Any], costs: Costs) -> dict[str, list[Row]]:
    return {
        "peers.json churn": [run_case(c, costs) for c in peers_cases(results, costs)],
        "detector-sweep.json": [run_case(c, costs) for c in sweep_cases(results, STEADY_STEPS)],
        "detector-sweep.json, 1 device/worker (model)": [
            run_case(c, costs) for c in sweep_cases(results, STEADY_STEPS, True)
        ],
    }


def fmt_measured(row: Row) -> str:
    r = row.case.measured_range
    text = f"{row.case.measured:.3f}"
    return text + (f" [{r[0]:.2f}–{r[1]:.2f}]" if r else "")


def validation_table(groups: dict[str, list[Row]]) -> str:
    lines = ["| source | run | measured | simulated | error | note |",
             "|---|---|---:|---:|---:|---|"]  # fmt: skip
    for source, rows in groups.items():
        for r in rows:
            lines.append(f"| {source} | {r.case.label} | {fmt_measured(r)} | "
                         f"{r.simulated:.3f} | {r.error:+.3f} | {r.case.outside} |")  # fmt: skip
    return "\n".join(lines)


def error_summary(groups: dict[str, list[Row]]) -> list[dict[str, Any]]:
    out = []
    for source, rows in groups.items():
        inside = [r for r in rows if not r.case.outside]
        outside = [r for r in rows if r.case.outside]
        for part, chosen in (("covered", inside), ("in turmoil", outside)):
            if chosen:
                e = errors(chosen)
                out.append({"source": source, "runs": part, "n": e.rows,
                            "mean_abs_error": e.mean_abs, "max_abs_error": e.max_abs,
                            "bias": e.bias})  # fmt: skip
    return out


def error_table(summary: list[dict[str, Any]]) -> str:
    lines = ["| source | runs | n | mean \\|error\\| | max \\|error\\| | mean error (bias) |",
             "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for s in summary:
        lines.append(f"| {s['source']} | {s['runs']} | {s['n']} | {s['mean_abs_error']:.3f} | "
                     f"{s['max_abs_error']:.3f} | {s['bias']:+.3f} |")  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------------- curves


@dataclass
class Curves:
    timeouts: tuple[float, ...]
    #: ranks -> system -> goodput per timeout (and with a flat roll call)
    by_timeout: dict[int, dict[str, list[float]]]
    best_timeout: dict[int, dict[str, float]]
    eviction_cost: dict[int, dict[str, float]]
    breakdown_at_best: dict[int, dict[str, dict[str, float]]]
    by_mtbf: dict[int, dict[str, list[float]]]


FLAT = "rollcall, roll call held at 512 members"


def curves(costs: Costs, failures: int, seed: int) -> Curves:
    meta_rank_mtbf = META_JOB_MTTF_H * 3600 * META_JOB_RANKS
    flat = with_flat_roll_call(costs)
    mix0 = mix_of(costs, meta_rank_mtbf)
    grid = timeout_grid(mix0)
    out = Curves(grid, {}, {}, {}, {}, {})
    for ranks in RANKS:
        mix = mix_of(costs, meta_rank_mtbf)
        job = job_at(ranks, mix)
        trace = drawn_trace(mix, ranks, failures, np.random.default_rng(seed))
        out.by_timeout[ranks] = {}
        out.best_timeout[ranks] = {}
        out.eviction_cost[ranks] = {}
        out.breakdown_at_best[ranks] = {}
        variants = [(s.value, s, costs) for s in SYSTEMS] + [(FLAT, System.ROLLCALL, flat)]
        for name, system, c in variants:
            points = goodput_by_timeout(system, job, Host(), c, trace, grid)
            out.by_timeout[ranks][name] = [o.goodput for _, o in points]
            best_t, at_best = best(points, lambda t: t)
            out.best_timeout[ranks][name] = best_t
            out.eviction_cost[ranks][name] = eviction_cost(system, job, c)
            out.breakdown_at_best[ranks][name] = shares(at_best.breakdown)
        out.by_mtbf[ranks] = {}
        for name, system, c in variants:
            values = []
            for hours in MTBF_HOURS:
                m = mix_of(costs, hours * 3600)
                j = job_at(ranks, m)
                tr = drawn_trace(m, ranks, failures, np.random.default_rng(seed))
                o = simulate(system, j, Host(), c, out.best_timeout[ranks][name], tr,
                             until=tr.horizon)  # fmt: skip
                values.append(o.goodput)
            out.by_mtbf[ranks][name] = values
    return out


def shares(b: Breakdown) -> dict[str, float]:
    return {"goodput": b.goodput, **{c.value: b.share(c) for c in LOSSES}}


def curves_table(c: Curves) -> str:
    lines = ["| ranks | system | best timeout | goodput there | eviction cost R | best / R |",
             "|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for ranks in RANKS:
        for name, chosen in c.best_timeout[ranks].items():
            r = c.eviction_cost[ranks][name]
            g = c.breakdown_at_best[ranks][name]["goodput"]
            lines.append(f"| {ranks:,} | {name} | {chosen:g} s | {g:.4f} | {r:.2f} s | "
                         f"{chosen / r:.2f} |")  # fmt: skip
    return "\n".join(lines)


# ----------------------------------------------------------------------- plots


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_validation(groups: dict[str, list[Row]], costs: Costs, results: dict[str, Any],
                    path: Path) -> None:  # fmt: skip
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    sweep_rows = groups["detector-sweep.json"]
    # The simulated U on the sweep's own schedule, on a finer grid.
    base = sweep_rows[0].case
    fine = np.geomspace(0.2, 6.0, 40)
    sim = [simulate(base.system, base.job, base.host, costs, float(t), base.trace, until=None,
                    not_before=base.not_before, settle_s=base.settle_s).goodput
           for t in fine]  # fmt: skip
    left.plot(fine, sim, color="#2ca02c", lw=0.8, label="simulated, the sweep's own schedule")
    # The same fault model, many schedules: what one schedule's luck hides.
    faults = results["detector-sweep.json"]["faults"]
    per_worker = 1.0 / (faults["kill_every_s"] * base.job.ranks)
    mix = mix_of(costs, 1.0 / per_worker)
    drawn = [draw_trace(mix, base.job.ranks, base.trace.horizon, np.random.default_rng(s))
             for s in range(SWEEP_SCHEDULES)]  # fmt: skip
    mean = [float(np.mean([simulate(base.system, base.job, base.host, costs, float(t), tr,
                                    until=None, not_before=tr.horizon,
                                    settle_s=base.settle_s).goodput for tr in drawn]))
            for t in fine]  # fmt: skip
    expected = base.trace.horizon * per_worker * base.job.ranks
    left.plot(fine, mean, color="#2ca02c", lw=2.2,
              label=f"simulated, mean of {SWEEP_SCHEDULES} schedules drawn from its fault model\n"
                    f"({expected:.0f} failures expected; the recorded schedule had "
                    f"{base.trace.failures})")  # fmt: skip
    for r in sweep_rows:
        marker = "x" if r.case.outside else "o"
        left.scatter([r.case.timeout], [r.case.measured], color="black", marker=marker, zorder=3)
        if "adaptive" in r.case.label:
            left.annotate("adaptive", (r.case.timeout, r.case.measured),
                          textcoords="offset points", xytext=(4, -12), fontsize=8)  # fmt: skip
    left.scatter([], [], color="black", marker="o", label="measured (detector_sweep.py)")
    left.scatter([], [], color="black", marker="x", label="measured, job in turmoil")
    _log_seconds(left, (0.2, 0.3, 0.5, 1, 2, 3, 5))
    left.set_xlabel("detector timeout (s)")
    left.set_ylabel("goodput")
    left.set_ylim(0, 1)
    left.set_title("4 workers, 2 cores: pauses, silent failures, SIGKILLs", fontsize=10)
    left.grid(alpha=0.3)
    left.legend(fontsize=8, loc="lower right")
    names = {System.ROLLCALL: "rollcall", System.LAUNCHER: "torchrun",
             System.REPLICA_GROUPS: "torchft"}  # fmt: skip
    for system in SYSTEMS:
        rows = [r for r in groups["peers.json churn"] if r.case.system is system]
        rates = [float(c["failures_per_min"]) for c in results["peers.json"]["parameters"]["churn"]]
        med = [r.case.measured for r in rows]
        low = [r.case.measured - r.case.measured_range[0] for r in rows if r.case.measured_range]
        high = [r.case.measured_range[1] - r.case.measured for r in rows if r.case.measured_range]
        right.errorbar(rates, med, yerr=[low, high], color=COLOURS[system], marker="o",
                       ls="none", capsize=4, label=f"{names[system]} measured")  # fmt: skip
        right.plot(rates, [r.simulated for r in rows], color=COLOURS[system], ls="--",
                   marker="s", mfc="none", label=f"{names[system]} simulated")  # fmt: skip
    right.set_xlabel("failures per minute (peers.py churn: SIGKILL, replacement 2 s later)")
    right.set_ylabel("goodput")
    right.set_ylim(0, 1.1)
    right.set_title("3 workers, 2 cores: rollcall, torchrun, TorchFT", fontsize=10)
    right.grid(alpha=0.3)
    right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _log_seconds(ax: Any, ticks: Sequence[float]) -> None:
    from matplotlib.ticker import FixedLocator, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(list(ticks)))
    ax.set_xticklabels([f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())


def _panel_style(name: str) -> dict[str, Any]:
    if name == FLAT:
        return {"color": COLOURS[System.ROLLCALL], "ls": ":", "label": FLAT}
    system = System(name)
    return {"color": COLOURS[system], "ls": "-", "label": system.label}


def plot_detector(c: Curves, path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, len(RANKS), figsize=(16, 4.4))
    for ax, ranks in zip(axes, RANKS, strict=True):
        for name, values in c.by_timeout[ranks].items():
            ax.plot(c.timeouts, values, **_panel_style(name))
            best = c.best_timeout[ranks][name]
            ax.scatter([best], [max(values)], color=_panel_style(name)["color"], s=18, zorder=3)
        notes = []
        for system in SYSTEMS:
            r = c.eviction_cost[ranks][system.value]
            if 2 * r <= c.timeouts[-1]:
                ax.axvline(2 * r, color=COLOURS[system], lw=0.8, ls="--")
            notes.append(f"{system.value}: R {r:.3g} s, 2R {2 * r:.3g} s")
        ax.text(0.98, 0.02, "eviction cost R (dashed: 2R)\n" + "\n".join(notes),
                transform=ax.transAxes, ha="right", va="bottom", fontsize=6.5,
                bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})  # fmt: skip
        _log_seconds(ax, (0.1, 0.3, 1, 3, 10, 30))
        ax.set_title(f"{ranks:,} ranks (job MTBF {hours(ranks):.3g} h)", fontsize=10)
        ax.set_xlabel("detector timeout (s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("goodput")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle("Goodput against the detector timeout (Meta's failure rate, "
                 "detector_sweep.py's pause and failure mix; example job: 2 s steps, 20 GB "
                 "state, checkpoint 20 s / 60 s)", fontsize=10)  # fmt: skip
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def hours(ranks: int) -> float:
    return META_JOB_MTTF_H * META_JOB_RANKS / ranks


def plot_mtbf(c: Curves, path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, len(RANKS), figsize=(16, 4.4), sharey=True)
    meta = META_JOB_MTTF_H * META_JOB_RANKS
    for ax, ranks in zip(axes, RANKS, strict=True):
        for name, values in c.by_mtbf[ranks].items():
            ax.plot(MTBF_HOURS, values, marker="o", ms=3, **_panel_style(name))
        ax.axvline(meta, color="grey", lw=0.8, ls="--", label="Meta: 7.9 h x 1,024 GPUs")
        ax.set_xscale("log")
        ax.set_title(f"{ranks:,} ranks", fontsize=10)
        ax.set_xlabel("MTBF of one rank (hours)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("goodput")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    fig.suptitle("Goodput against the mean time between failures (each system at its best "
                 "detector timeout; checkpoints every Daly interval)", fontsize=10)  # fmt: skip
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------ main


def row_json(r: Row) -> dict[str, Any]:
    return {"source": r.case.source, "run": r.case.label, "system": r.case.system.value,
            "measured": r.case.measured, "measured_range": r.case.measured_range,
            "simulated": r.simulated, "error": r.error, "outside": r.case.outside or None,
            "timeout_s": r.case.timeout, "breakdown": shares(r.outcome.breakdown)}  # fmt: skip


def markdown(groups: dict[str, list[Row]], summary: list[dict[str, Any]], c: Curves,
             costs: Costs, stamp: str) -> str:  # fmt: skip
    cost_rows = "\n".join(f"| {w} | {v} | {s} |" for w, v, s in cost_lines(costs))
    return "\n\n".join([
        f"# Simulated goodput under churn, checked against the real runs\n\nGenerated {stamp} "
        "by `bench/simulate.py` (`rollcall.planning`).",
        "## Validation: simulated against measured goodput\n\n" + validation_table(groups),
        "## Errors (simulated minus measured)\n\n" + error_table(summary),
        "## Best detector timeout at scale (example job, Meta's failure rate)\n\n"
        + curves_table(c),
        "## Costs used\n\n| cost | value | from |\n|---|---|---|\n" + cost_rows,
    ]) + "\n"  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--failures", type=int, default=300,
                        help="failures per drawn trace of the curves (default 300)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-shipped-costs", action="store_true",
                        help=f"do not rewrite {SHIPPED.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    started = time.monotonic()
    stamp = datetime.now(UTC).strftime("%Y-%m-%d")
    results = load_results(args.results)
    costs = costs_from_results(results)
    if not args.no_shipped_costs:
        SHIPPED.write_text(json.dumps(costs_to_dict(costs, stamp), indent=1) + "\n")
        print(f"wrote {SHIPPED.relative_to(ROOT)} (costs from {len(costs.runs)} result files)")
    groups = validate(results, costs)
    summary = error_summary(groups)
    print("\n" + validation_table(groups) + "\n\n" + error_table(summary) + "\n", flush=True)
    c = curves(costs, args.failures, args.seed)
    print(curves_table(c) + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    plot_validation(groups, costs, results, args.out / "simulate-validation.png")
    plot_detector(c, args.out / "simulate-detector.png")
    plot_mtbf(c, args.out / "simulate-mtbf.png")
    (args.out / "simulate.md").write_text(markdown(groups, summary, c, costs, stamp))
    payload = {
        "date": stamp,
        "parameters": {"failures_per_trace": args.failures, "seed": args.seed,
                       "ranks": list(RANKS), "mtbf_hours": list(MTBF_HOURS),
                       "example_job": {k: v for k, v in vars(EXAMPLE_JOB).items()},
                       "meta_job_mttf_h": META_JOB_MTTF_H, "meta_job_ranks": META_JOB_RANKS},
        "validation": {source: [row_json(r) for r in rows] for source, rows in groups.items()},
        "errors": summary,
        "curves": {"timeouts_s": list(c.timeouts), "by_timeout": c.by_timeout,
                   "best_timeout_s": c.best_timeout, "eviction_cost_s": c.eviction_cost,
                   "breakdown_at_best": c.breakdown_at_best, "by_mtbf": c.by_mtbf},
        "costs": costs_to_dict(costs, stamp),
        "wall_s": time.monotonic() - started,
    }  # fmt: skip
    (args.out / "simulate.json").write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote simulate.json, simulate.md and 3 PNGs to {args.out} "
          f"in {time.monotonic() - started:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
