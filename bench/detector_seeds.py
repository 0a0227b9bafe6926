"""Pool several runs of bench/detector_sweep.py (other seeds, other tunings)
into one table per detector setting: how much each setting loses on average
and how far single runs scatter.

    .venv/bin/python bench/detector_seeds.py RUN.json [RUN.json ...] [--md FILE] [--json FILE]

A setting that appears in several runs (e.g. the fixed 1.5 s baseline run
beside each tuning) is pooled over all of them; its min-max spread is the
run-to-run noise the other rows must beat. The adaptive detector is named by
the settings the run recorded (`parameters.adaptive_config`), so runs made
before and after a change of defaults do not pool under one name.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def load(paths: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """Each setting's per-run results, tagged with the run's seed."""
    by_setting: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in paths:
        try:
            run = json.loads(path.read_text())
            seed = run["parameters"]["seed"]
            settings = run["settings"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            reason = f"not a detector_sweep result ({exc})"
            raise SystemExit(f"detector_seeds: {path}: {reason}") from None
        adaptive = run["parameters"].get("adaptive_config")
        for setting in settings:
            name = setting["detector"]
            if name.startswith("adaptive") and adaptive:
                name = adaptive_label(adaptive)
            by_setting[name].append({**setting, "seed": seed, "file": str(path)})
    return by_setting


def adaptive_label(config: dict[str, Any]) -> str:
    """The adaptive detector named by its effective settings: "adaptive"
    alone meant phi_min_std 0.1 before the default changed, 0.25 after."""
    return (
        f"adaptive (phi {config['phi_threshold']:g}, min std {config['phi_min_std']:g} s, "
        f"max silence {config['max_silence']:g} s)"
    )


def _spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values) * scale
    low, high = min(values) * scale, max(values) * scale
    return f"{mean:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def _medians(runs: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key]["median"] for r in runs if r.get(key) and r[key].get("n")]


def summarize(by_setting: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for name, runs in by_setting.items():
        rows.append({
            "detector": name,
            "runs": len(runs),
            "seeds": sorted({r["seed"] for r in runs}),
            "goodput_lost": [r["goodput_lost"] for r in runs],
            "goodput_lost_one_device_per_worker": [
                r["goodput_lost_one_device_per_worker"] for r in runs],
            "false_evictions": [r["false_evictions"] for r in runs],
            "silent_stall_median_s": _medians(runs, "silent_stall_s"),
            "sigkill_stall_median_s": _medians(runs, "sigkill_stall_s"),
            "failures_not_recovered": sum(r["failures_not_recovered"] for r in runs),
            "goodput_lost_by_seed": {
                str(seed): statistics.fmean(r["goodput_lost"] for r in runs if r["seed"] == seed)
                for seed in sorted({r["seed"] for r in runs})
            },
        })  # fmt: skip
    rows.sort(key=lambda row: statistics.fmean(row["goodput_lost"]))
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| detector | runs (seeds) | goodput lost % | ... one device per worker % "
        "| false evictions | silent failure stall s | SIGKILL stall s | not recovered |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        of_row = ",".join(str(s) for s in row["seeds"])
        lines.append(
            f"| {row['detector']} | {row['runs']} ({of_row}) "
            f"| {_spread(row['goodput_lost'], 100)} "
            f"| {_spread(row['goodput_lost_one_device_per_worker'], 100)} "
            f"| {_spread([float(n) for n in row['false_evictions']])} "
            f"| {_spread(row['silent_stall_median_s'], digits=2)} "
            f"| {_spread(row['sigkill_stall_median_s'], digits=2)} "
            f"| {row['failures_not_recovered']} |"
        )
    lines.append("")
    lines.append("Each cell: mean over the runs (min-max); stalls are each run's median.")
    seeds = sorted({seed for row in rows for seed in row["goodput_lost_by_seed"]}, key=int)
    lines += [
        "",
        "Goodput lost % by seed (the same fault schedule within a column; a setting run twice"
        " on one seed shows its mean):",
        "",
        "| detector | " + " | ".join(f"seed {seed}" for seed in seeds) + " |",
        "|---|" + "---:|" * len(seeds),
    ]
    for row in rows:
        by_seed = row["goodput_lost_by_seed"]
        cells = [f"{by_seed[seed] * 100:.1f}" if seed in by_seed else "-" for seed in seeds]
        lines.append(f"| {row['detector']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="detector_sweep.py --json outputs")
    parser.add_argument("--md", type=Path, help="also write the table here")
    parser.add_argument("--json", type=Path, help="also write the pooled figures here")
    args = parser.parse_args()
    rows = summarize(load(args.runs))
    table = markdown(rows)
    sys.stdout.write(table)
    if args.md:
        args.md.write_text(table)
    if args.json:
        args.json.write_text(json.dumps({"runs": [str(p) for p in args.runs], "settings": rows},
                                        indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
