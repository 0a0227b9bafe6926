"""Overlapped gradient reduction against reduce-after-backward, in the running
job: steps/s of `rollcall worker` teams with and without `--overlap`, in
alternating rounds, at the example's default size and at ~26 M parameters.

    .venv/bin/python bench/overlap.py [--rounds 3] [--window 20] [--json FILE]

Each round starts a fresh cluster (real etcd, one rendezvous replica) per
mode and measures the steps/s of WORKERS workers (one torch thread each)
over a window of steady training; the two modes alternate which goes first.
On this 2-core machine the workers, their gloo threads and the reduction
share two cores, so what overlap can hide is bounded by the idle time of the
reduction's wait, not its arithmetic (docs/worker.md, "Overlapped
reduction").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import recovery  # noqa: E402

#: Workers per team.
WORKERS = 2
#: (d_model, layers): the default (0.14 M parameters) and ~26 M.
MODELS = ((64, 2), (512, 8))


def parameters(d_model: int, layers: int) -> int:
    from rollcall.worker.examples.lm import LMConfig, build

    config = LMConfig(d_model=d_model, layers=layers)
    model, _, _ = build(config, 0)
    return sum(p.numel() for p in model.parameters())


def rate(d_model: int, layers: int, overlap: bool, window: float) -> float:
    extra = ["--d-model", str(d_model), "--layers", str(layers)]
    if overlap:
        extra.append("--overlap")
    # recovery's helpers count steps of teams of its WORKERS members.
    recovery.WORKERS = WORKERS
    with tempfile.TemporaryDirectory(prefix="rollcall-overlap-") as tmp_name:
        with recovery.Cluster(Path(tmp_name), extra, ("--set", "rollcall_deadline=5")) as cluster:
            workers = [cluster.new_worker() for _ in range(WORKERS)]
            steps_s, _ = recovery.rollcall_rate(workers, window)
    return steps_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=20.0, help="seconds of steady training")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "overlap.json")
    args = parser.parse_args()
    if not 1 <= args.rounds <= 10 or not 2 <= args.window <= 300:
        parser.error("--rounds must be 1..10 and --window 2..300")
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    for d_model, layers in MODELS:
        size = parameters(d_model, layers)
        pairs = []
        for index in range(args.rounds):
            order = (True, False) if index % 2 == 0 else (False, True)
            measured = {mode: rate(d_model, layers, mode, args.window) for mode in order}
            pairs.append({"overlap": measured[True], "after_backward": measured[False]})
            print(f"  {d_model} x {layers} ({size / 1e6:.2f} M), round {index + 1}: overlap "
                  f"{measured[True]:.3f}, after backward {measured[False]:.3f} steps/s",
                  flush=True)  # fmt: skip
        gains = [(p["overlap"] / p["after_backward"] - 1) * 100 for p in pairs]
        runs.append({
            "d_model": d_model, "layers": layers, "parameters": size, "rounds": pairs,
            "overlap_steps_s": statistics.median(p["overlap"] for p in pairs),
            "after_backward_steps_s": statistics.median(p["after_backward"] for p in pairs),
            "gain_pct": {"median": statistics.median(gains), "min": min(gains),
                         "max": max(gains)},
        })  # fmt: skip
    for run in runs:
        gain = run["gain_pct"]
        print(f"{run['d_model']} x {run['layers']} ({run['parameters'] / 1e6:.2f} M parameters) | "
              f"overlap {run['overlap_steps_s']:.3f}, after backward "
              f"{run['after_backward_steps_s']:.3f} steps/s: {gain['median']:+.1f} % "
              f"[{gain['min']:+.1f} .. {gain['max']:+.1f}]")  # fmt: skip
    import torch

    result = {
        "runs": runs,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "wall_s": time.monotonic() - started,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "versions": {"torch": torch.__version__},
        "parameters": {"workers": WORKERS, "rounds": args.rounds, "window_s": args.window,
                       "threads": 1, "global_batch": 32, "micro_batch": 8,
                       "bucket_bytes": "Config.overlap_bucket_bytes (default)"},
    }  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
