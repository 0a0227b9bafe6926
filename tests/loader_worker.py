"""A training process fed by a DataLoader with worker processes (for the
end-to-end loader test): python -m tests.loader_worker RENDEZVOUS JOB LEDGER
[mutate|nudge] [overlap]; with "mutate" the loop counts its steps in
registered state before commit(), with "nudge" it moves a parameter before
commit() (both of which the state contract refuses), with "overlap" it
trains with Elastic(overlap=True).
Token from $ROLLCALL_TOKEN. Prints JSON lines: "joined" (with the pids of
its loader workers) and, for every committed step, the sample ids of each
microbatch it trained on, as read from the batches themselves (including
those finished before an abort of the step and kept). Ctrl-C
(SIGINT) leaves the job cleanly and exits with 130."""

from __future__ import annotations

import json
import multiprocessing
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

from rollcall.worker.runtime import Elastic

#: Samples in the dataset; global and micro batch of the job.
SAMPLES, GLOBAL_BATCH, MICRO_BATCH = 512, 16, 4


class Counter:
    """Registered user state."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


class Identified(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample ``i`` is ``(features of i, i)``; reading one takes 1 ms."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.001)
        return torch.linspace(0.0, 1.0, 4) * (i % 17), torch.tensor(i)


def main() -> None:
    rendezvous, job, ledger = sys.argv[1], sys.argv[2], sys.argv[3]
    options = set(sys.argv[4:])
    known = {"mutate", "nudge", "overlap"}
    if options - known:
        sys.exit(f"unknown options {sorted(options - known)}")
    mutate = "mutate" in options
    counter = Counter()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(Identified(), batch_size=MICRO_BATCH, shuffle=True, num_workers=2)
    try:
        with Elastic(
            model, optimizer, loader, global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH,
            rendezvous=rendezvous, job=job, ledger=ledger,  # a str: Path or str are both fine
            state={"counter": counter} if mutate else None, overlap="overlap" in options,
        ) as elastic:  # fmt: skip
            loader_pids = [child.pid for child in multiprocessing.active_children()]
            say(event="joined", member_id=elastic.member_id, loader_pids=loader_pids)
            last: tuple[int, dict[int, list[int]]] = (-1, {})
            for step in elastic.steps(1_000_000):
                # Microbatches finished before an abort of this same step and
                # kept for it (step.done) are not handed out again: carry
                # their ids over from the aborted attempt.
                earlier = last[1] if last[0] == step.number else {}
                seen = {index: earlier[index] for index in step.done}
                last = (step.number, seen)
                for batch in step.microbatches():
                    features, ids = batch.inputs, batch.targets
                    seen[batch.microbatch.index] = ids.tolist()
                    loss = ((model(features).squeeze(-1) - features.sum(-1)) ** 2).sum()
                    step.backward(loss, len(ids))
                if mutate:
                    counter.n += 1  # before commit(): what the contract refuses
                if "nudge" in options:
                    with torch.no_grad():
                        model.bias.add_(1e-3)  # likewise
                if step.commit():
                    say(event="step", step=step.number, epoch=step.epoch, rank=step.rank,
                        world=step.world_size, idle=sorted(step.idle),
                        microbatches=seen, digest=elastic.state_digest())  # fmt: skip
    except KeyboardInterrupt:
        sys.exit(130)


def say(**record: object) -> None:
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
