"""The built-in example job (worker/examples/lm.py) as a plain torchrun
elastic script, for bench/peers.py.

    torchrun --nnodes=1:3 --nproc-per-node=1 --rdzv-backend=c10d \
        --rdzv-endpoint=127.0.0.1:PORT --max-restarts=N bench/jobs/torchrun_lm.py \
        --checkpoint-dir DIR --checkpoint-every 20

Same model, optimizer, data and plan as `rollcall worker`: `build(LMConfig(),
seed)`, `rollcall.worker.plan.DataPlan` (global batch 32 split into microbatches of 8,
divided over whatever world size this restart has), the torch RNG seeded per
microbatch, losses summed and the all-reduced gradient divided by the step's
global token count. One flat all-reduce of the gradients per step over the
default gloo group (no DDP wrapper, whose constructor would add ~1.3 s to
every restart).

Fault tolerance is torchrun's own recipe: on any failure the agents stop every
worker, re-rendezvous and start them all again; the script loads the newest
checkpoint at start and rank 0 writes one (temporary file, rename) after every
K-th committed step, so a restart replays the steps since then.

Prints one JSON line per committed step on stdout:
{"event": "step", "step", "world", "rank", "restart"}; and
{"event": "started", ...} with the time spent importing and loading.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import time
from datetime import timedelta

T0 = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from rollcall.worker.examples.lm import LMConfig, build, loss_sum  # noqa: E402
from rollcall.worker.plan import DataPlan  # noqa: E402

CHECKPOINT = "ckpt.pt"


def say(**record: object) -> None:
    print(json.dumps(record), flush=True)


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The next step to run: 0 without a checkpoint, else the saved step + 1."""
    if not os.path.exists(path):
        return 0
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    return int(saved["step"]) + 1


def save_checkpoint(
    path: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    tmp = f"{path}.tmp"
    torch.save({"step": step, "model": model.state_dict(),
                "optimizer": optimizer.state_dict()}, tmp)  # fmt: skip
    os.replace(tmp, path)


def die_with_agent() -> None:
    """torchrun starts workers in their own session, so a SIGKILLed agent
    would leave its worker training; the benchmark kills whole nodes."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def main() -> None:
    die_with_agent()
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10_000_000)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="gloo timeout, seconds")
    args = parser.parse_args()

    torch.set_num_threads(1)
    t_imported = time.time()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    t_group = time.time()

    model, optimizer, corpus = build(LMConfig(), args.seed)
    plan = DataPlan(len(corpus), args.global_batch, args.micro_batch, args.seed)
    path = os.path.join(args.checkpoint_dir, CHECKPOINT)
    step = load_checkpoint(path, model, optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    say(event="started", rank=rank, world=world, restart=restart, resume_step=step,
        import_s=t_imported - T0, group_s=t_group - t_imported,
        load_s=time.time() - t_group)  # fmt: skip

    model.train()
    while step < args.steps:
        count = 0
        for mb in plan.for_rank(step, rank, world):
            torch.manual_seed(mb.seed)
            samples = [corpus[i] for i in mb.sample_ids]
            inputs = torch.stack([s[0] for s in samples])
            targets = torch.stack([s[1] for s in samples])
            loss, n = loss_sum(model, inputs, targets)
            loss.backward()
            count += n
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                 for p in params]  # fmt: skip
        flat = torch.cat([*grads, torch.tensor([float(count)])])
        dist.all_reduce(flat)
        total = float(flat[-1])
        offset = 0
        for p in params:
            k = p.numel()
            p.grad = (flat[offset : offset + k] / total).view_as(p).clone()
            offset += k
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        say(event="step", step=step, world=world, rank=rank, restart=restart)
        if rank == 0 and (step + 1) % args.checkpoint_every == 0:
            save_checkpoint(path, step, model, optimizer)
        step += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
