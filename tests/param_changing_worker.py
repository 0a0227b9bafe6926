"""A training process of a sharded job (redundancy 2, the check every 5
steps) whose loop, if told to, scales the model's parameters after every
commit, as a clamp or a renormalisation would change them:
python -m tests.param_changing_worker RENDEZVOUS JOB CHANGE (1 or 0).
Token from $ROLLCALL_TOKEN. Prints the JSON step events `rollcall worker
--json` does."""

from __future__ import annotations

import sys

import torch

from rollcall.membership.config import Config
from rollcall.worker.examples.lm import LMConfig, build
from rollcall.worker.runtime import Elastic, Step
from tests.raising_worker import train


def main() -> None:
    rendezvous, job, change = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    model, optimizer, corpus = build(LMConfig(), seed=0)

    def scale(step: Step) -> None:
        if change:
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.mul_(0.5)

    with Elastic(
        model, optimizer, corpus, global_batch=32, micro_batch=8, rendezvous=rendezvous,
        job=job, shard_redundancy=2, config=Config(drift_check_every=5),
    ) as elastic:  # fmt: skip
        train(elastic, model, scale)


if __name__ == "__main__":
    main()
