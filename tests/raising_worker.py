"""A training process whose user code raises at a given step (for the test
that the others continue): python -m tests.raising_worker RENDEZVOUS JOB STEP.
Token from $ROLLCALL_TOKEN. Prints the JSON events `rollcall worker --json` does."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch

from rollcall.worker.examples.lm import LMConfig, build, loss_sum
from rollcall.worker.runtime import Elastic, Step


def train(elastic: Elastic, model: torch.nn.Module, after: Callable[[Step], None]) -> None:
    """The example's loop; after each committed step, its event is printed
    and ``after`` runs (the user's code after ``commit()``)."""
    for step in elastic.steps(1_000_000):
        for batch in step.microbatches():
            loss, count = loss_sum(model, batch.inputs, batch.targets)
            step.backward(loss, count)
        if step.commit():
            record = {"event": "step", "step": step.number, "epoch": step.epoch,
                      "world": step.world_size}  # fmt: skip
            print(json.dumps(record), flush=True)
            after(step)


def main() -> None:
    rendezvous, job, fail_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)  # as `rollcall worker` does: several share the 2 cores
    model, optimizer, corpus = build(LMConfig(), seed=0)

    def fail(step: Step) -> None:
        if step.number >= fail_at:
            raise RuntimeError(f"a bug in user code at step {step.number}")

    with Elastic(
        model, optimizer, corpus, global_batch=32, micro_batch=8, rendezvous=rendezvous, job=job
    ) as elastic:
        print(json.dumps({"event": "joined", "member_id": elastic.member_id}), flush=True)
        train(elastic, model, fail)


if __name__ == "__main__":
    main()
