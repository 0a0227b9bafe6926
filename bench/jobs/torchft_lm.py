"""The built-in example job (worker/examples/lm.py) as a TorchFT replica
group of one process, for bench/peers.py.

    TORCHFT_LIGHTHOUSE=http://127.0.0.1:PORT python bench/jobs/torchft_lm.py \
        --replica-id 3 --gloo-timeout 5 --manager-timeout 10

Same model, optimizer, data and plan as `rollcall worker`: `build(LMConfig(),
seed)`, `rollcall.worker.plan.DataPlan` (global batch 32 split into microbatches of 8,
divided over the replicas that participate in this step's quorum), the torch
RNG seeded per microbatch, losses summed and the all-reduced gradient divided
by the step's global token count (the count travels in the same buffer).

TorchFT's loop: `Manager` (one per replica group; the group's own TCPStore is
started here on 127.0.0.1), its reconfigurable `ProcessGroupGloo`, the
optimizer wrapper (`zero_grad` starts the quorum, `step` asks `should_commit`)
and `Manager.allreduce` for the gradients. A new or restarted replica heals
from a live one (HTTP checkpoint transport) and sits one step out.

Prints one JSON line per committed step on stdout:
{"event": "step", "step", "world", "rank"}; {"event": "aborted", "step"} when
should_commit said no; {"event": "started", ...} once the Manager exists.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from datetime import timedelta

T0 = time.time()

import torch  # noqa: E402
from torch.distributed import ReduceOp, TCPStore  # noqa: E402
from torchft import Manager, Optimizer, ProcessGroupGloo  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from rollcall.worker.examples.lm import LMConfig, build, loss_sum  # noqa: E402
from rollcall.worker.plan import DataPlan  # noqa: E402


def say(**record: object) -> None:
    print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica-id", type=int, required=True)
    parser.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"))
    parser.add_argument("--steps", type=int, default=10_000_000)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument(
        "--gloo-timeout",
        type=float,
        default=None,
        help="ProcessGroupGloo timeout, s (default: TorchFT's)",
    )
    parser.add_argument(
        "--manager-timeout",
        type=float,
        default=None,
        help="Manager timeout, s (default: TorchFT's)",
    )
    parser.add_argument(
        "--quorum-timeout",
        type=float,
        default=None,
        help="Manager quorum timeout, s (default: TorchFT's)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")  # fmt: skip

    torch.set_num_threads(1)
    t_imported = time.time()
    model, optimizer, corpus = build(LMConfig(), args.seed)
    plan = DataPlan(len(corpus), args.global_batch, args.micro_batch, args.seed)
    params = [p for p in model.parameters() if p.requires_grad]

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg_kwargs = {}
    if args.gloo_timeout is not None:
        pg_kwargs["timeout"] = timedelta(seconds=args.gloo_timeout)
    manager_kwargs: dict = {}
    if args.manager_timeout is not None:
        manager_kwargs["timeout"] = timedelta(seconds=args.manager_timeout)
    if args.quorum_timeout is not None:
        manager_kwargs["quorum_timeout"] = timedelta(seconds=args.quorum_timeout)
    manager = Manager(
        pg=ProcessGroupGloo(**pg_kwargs),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replicas,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        replica_id=f"peers_{args.replica_id}",
        hostname="127.0.0.1",
        **manager_kwargs,
    )
    ft_optimizer = Optimizer(manager, optimizer)
    say(event="started", replica=args.replica_id, import_s=t_imported - T0,
        setup_s=time.time() - t_imported)  # fmt: skip

    model.train()
    while manager.current_step() < args.steps:
        ft_optimizer.zero_grad()  # starts this step's quorum
        manager.wait_quorum()
        step = manager.current_step()
        world = manager.num_participants()
        rank = manager.participating_rank()
        count = 0
        if manager.is_participating() and rank is not None:
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
        manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        total = float(flat[-1])
        offset = 0
        for p in params:
            k = p.numel()
            p.grad = (flat[offset : offset + k] / max(total, 1.0)).view_as(p).clone()
            offset += k
        ft_optimizer.step()  # applied only if should_commit agrees
        if manager.current_step() > step:
            say(event="step", step=step, world=world, rank=rank)
        else:
            say(event="aborted", step=step)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
