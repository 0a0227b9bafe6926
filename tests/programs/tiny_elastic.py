"""A user's own training script, as `rollcall up -- python
tests/programs/tiny_elastic.py --steps N` runs it: an ordinary loop over a
small MLP. ``Elastic`` is given no address, job or token: it finds the job
in the environment `up` sets. It prints its final step."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from rollcall import Elastic


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument(
        "--pause",
        type=float,
        default=0.0,
        help="Seconds of pretend compute per step (keeps a short run alive).",
    )
    parser.add_argument(
        "--pause-while",
        type=Path,
        help="Pause only while this file exists (a test ends the pauses once it is done).",
    )
    parser.add_argument(
        "--raise-at", type=int, default=-1, help="a bug in the loop: raise at this step"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every copy builds the same data and initial model
    inputs = torch.randn(256, 8)
    dataset = list(zip(inputs, inputs.sum(dim=1, keepdim=True), strict=True))
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with Elastic(model, optimizer, dataset, global_batch=16, micro_batch=4) as job:
        for step in job.steps(args.steps):
            if step.number == args.raise_at:
                raise RuntimeError(f"a bug in the script at step {step.number}")
            for batch in step.microbatches():
                loss = nn.functional.mse_loss(model(batch.inputs), batch.targets, reduction="sum")
                step.backward(loss, len(batch.inputs))
            if args.pause_while is None or args.pause_while.exists():
                time.sleep(args.pause)
            step.commit()
        print(f"trained to step {job.committed_step}", flush=True)


if __name__ == "__main__":
    main()
