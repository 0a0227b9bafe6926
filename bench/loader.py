"""Step time with a slow dataset, loading on the training thread or ahead.

    .venv/bin/python bench/loader.py [--workers 0,1,2] [--steps 40] [--delay-ms 2] [--json FILE]

One rank alone (no etcd, no process group): the example LM (one torch
thread) trains global batch 32, micro batch 8, from its corpus behind a
``__getitem__`` that sleeps ``--delay-ms`` per sample (a disk or network
read), through :class:`rollcall.worker.loader.MicrobatchLoader` exactly as
``Elastic`` drives it (``enter_view``, ``get`` per microbatch,
``step_committed``). For each worker count it reports the median step time
and, of it, the time the training thread waited in ``get`` (step time minus
that is compute, which a busy shared machine makes noisy), and the first
step after a view change (the rank moves to rank 1 of 2 at the next step, so what was
loaded ahead for its old share is dropped).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rollcall.worker.examples.lm import CharCorpus, LMConfig, build, loss_sum  # noqa: E402
from rollcall.worker.loader import LoaderOptions, MicrobatchLoader  # noqa: E402
from rollcall.worker.plan import DataPlan  # noqa: E402

GLOBAL_BATCH, MICRO_BATCH = 32, 8


class SlowCorpus(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The example corpus, each read taking ``delay`` seconds."""

    def __init__(self, corpus: CharCorpus, delay: float) -> None:
        self.corpus, self.delay = corpus, delay

    def __len__(self) -> int:
        return len(self.corpus)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        return self.corpus[i]


def run(workers: int, steps: int, delay: float) -> dict[str, Any]:
    model, optimizer, corpus = build(LMConfig(), seed=0)
    dataset = SlowCorpus(corpus, delay)
    plan = DataPlan(len(dataset), GLOBAL_BATCH, MICRO_BATCH, seed=0)
    options = LoaderOptions(num_workers=workers)
    step_s, wait_s, after_change_s = [], [], []
    with MicrobatchLoader(dataset, plan, options=options) as loader:
        loader.enter_view(rank=0, world_size=1, next_step=0)
        for number in range(steps + 1):
            if number == steps:  # a view change: half the microbatches, others' share dropped
                loader.enter_view(rank=1, world_size=2, next_step=number)
            began, waiting = time.perf_counter(), 0.0
            rank, world = loader.target.rank, loader.target.world_size  # type: ignore[union-attr]
            for index in plan.assignment(number, world)[rank]:
                asked = time.perf_counter()
                inputs, targets = loader.get(number, index)
                waiting += time.perf_counter() - asked
                loss, _count = loss_sum(model, inputs, targets)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loader.step_committed(number)
            took = time.perf_counter() - began
            if number == steps:
                after_change_s.append(took)
            elif number >= 3:  # after the workers' start and the first prefetch
                step_s.append(took)
                wait_s.append(waiting)
    return {
        "num_workers": workers,
        "step_ms": round(statistics.median(step_s) * 1000, 1),
        "data_wait_ms": round(statistics.median(wait_s) * 1000, 1),
        "first_step_after_view_change_ms": round(after_change_s[0] * 1000, 1),
        "steps": len(step_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="0,1,2")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--delay-ms", type=float, default=2.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [
        run(int(w), args.steps, args.delay_ms / 1000) for w in args.workers.split(",") if w
    ]
    loading = MICRO_BATCH * args.delay_ms * GLOBAL_BATCH // MICRO_BATCH
    print(f"global batch {GLOBAL_BATCH}, micro batch {MICRO_BATCH}, one rank, "
          f"{args.delay_ms} ms per sample ({loading:.0f} ms of reads per step)")  # fmt: skip
    print("| num_workers | step (median) | of which waiting for data | first step after a view "
          "change (half the microbatches) |")  # fmt: skip
    print("|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['num_workers']} | {r['step_ms']} ms | {r['data_wait_ms']} ms "
              f"| {r['first_step_after_view_change_ms']} ms |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
