"""The training loop of the built-in example job (``rollcall worker``): the
model and data of ``lm.py`` trained under ``Elastic``, an ordinary PyTorch
loop with a few added lines.

What happens is told to a ``say`` callback as records (``event`` = joined,
resumed, step, aborted, done, and their fields); how they are printed, and
what an error means for the exit code, is the command line's business.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rollcall.worker.digest import digest
from rollcall.worker.examples.lm import LMConfig, build, loss_sum
from rollcall.worker.runtime import Elastic
from rollcall.worker.state import capture

#: Receives one record (keyword arguments) per thing that happened.
Say = Callable[..., None]


@dataclass(frozen=True)
class LMRun:
    """What the example trains, and how long."""

    steps: int
    global_batch: int
    micro_batch: int
    seed: int
    model: LMConfig = field(default_factory=LMConfig)
    #: Include the state digest in every N-th step's record (0: never).
    digest_every: int = 0
    #: torch intra-op threads.
    threads: int = 1


def train(run: LMRun, say: Say, **elastic: Any) -> None:
    """Join the job and train until ``run.steps`` steps are committed.

    ``elastic`` are ``Elastic``'s job and runtime settings (rendezvous,
    job, token, host, name, ledger, checkpoints, metrics, config, ...). Its
    errors (``Evicted``, ``CannotResume``, ...) propagate.
    """
    torch.set_num_threads(run.threads)
    model, optimizer, corpus = build(run.model, run.seed)
    with Elastic(
        model, optimizer, corpus, global_batch=run.global_batch, micro_batch=run.micro_batch,
        seed=run.seed, **elastic,
    ) as job:  # fmt: skip
        say(event="joined", member_id=job.member_id, pid=os.getpid(), address=job.address)
        last = time.perf_counter()
        resumed_said = False
        for step in job.steps(run.steps):
            if job.resumed is not None and not resumed_said:
                resumed_said = True
                say(event="resumed", **job.resumed.to_dict())
            for batch in step.microbatches():
                loss, count = loss_sum(model, batch.inputs, batch.targets)
                step.backward(loss, count)
            if not step.commit():
                say(event="aborted", step=step.number, epoch=step.epoch)
                continue
            now = time.perf_counter()
            record: dict[str, Any] = {
                "event": "step", "step": step.number, "loss": step.loss,
                "epoch": step.epoch, "rank": step.rank, "world": step.world_size,
                "samples_s": run.global_batch / max(now - last, 1e-9),
            }  # fmt: skip
            last = now
            if run.digest_every and step.number % run.digest_every == 0:
                # A sharded job's optimizer object holds none of the state:
                # the runtime's digest (without it) is what its ranks share.
                record["digest"] = (
                    job.state_digest() if job.sharding is not None
                    else digest(capture(step.number, model, optimizer))
                )  # fmt: skip
            say(**record)
        say(event="done", step=job.committed_step)
