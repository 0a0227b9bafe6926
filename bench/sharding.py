"""Sharded optimizer state (rollcall.worker.sharded, docs/sharding.md): how
much state does a rank hold, and what does the update cost, against the
replicated optimizer?

    .venv/bin/python bench/sharding.py [--workers 4] [--redundancy 2]
        [--partitions 64] [--steps 12] [--quick]

Per model size (the example LM at its default size, and at ``--d-model 256
--layers 8``, ~47x the parameters; ``--quick``: the default size only), one
gloo group of ``--workers`` spawned processes on loopback trains the LM's
AdamW on random token batches, each rank its own, with the gradients
all-reduced as the runtime does, in two modes side by side, interleaved
step by step on the same gradients:

- replicated: every rank runs the whole AdamW update;
- sharded: every rank updates the partitions the plan gives it
  (``--redundancy`` copies of each of ``--partitions``) and one all-gather
  hands the new parameters to everyone.

Per rank and mode: optimizer-state bytes, parameter bytes, the median wall
time of the update (sharded: its own update and the all-gather) and the
bytes this rank sends in the all-gather per step; and whether the two
modes' parameters were bit-identical after every step. The aim is r/W of
the replicated state per rank (plus the parameters, which every rank keeps
whole).

Everything runs in this machine's loopback; every wait is bounded (the
ranks are joined with a timeout and killed otherwise).
Results: bench/results/sharding.{json,md} (``--quick``: sharding-quick.*).
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

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench.peers import git_commit  # noqa: E402
from rollcall.etcd_local import free_port  # noqa: E402
from rollcall.membership.shards import place  # noqa: E402
from rollcall.worker.examples.lm import VOCAB_SIZE, CharTransformer, LMConfig  # noqa: E402
from rollcall.worker.sharded import ShardedOptimizer, state_bytes  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SIZES = {"default": {}, "large": {"d_model": 256, "layers": 8}}
#: Longest wait for the ranks of one size.
RANK_TIMEOUT = 900.0


def _rank(rank: int, args: dict[str, Any], out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    world = args["workers"]
    store = dist.TCPStore("127.0.0.1", args["port"], world, rank == 0, use_libuv=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    config = LMConfig(**args["size"])
    members = [f"w{i}" for i in range(world)]
    plan = place(members, {}, args["partitions"], args["redundancy"])

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = CharTransformer(config)
        return model, torch.optim.AdamW(model.parameters(), lr=config.lr)

    model, optimizer = build()
    reference, replicated = build()
    sharded = ShardedOptimizer(optimizer, plan, members[rank])
    sent: list[int] = []

    def gather(tensor: torch.Tensor) -> list[torch.Tensor]:
        sent.append(tensor.numel() * tensor.element_size())
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor)
        return parts

    times: dict[str, list[float]] = {"replicated": [], "sharded": []}
    equal = []
    for step in range(args["steps"]):
        generator = torch.Generator().manual_seed(7919 * step + rank)
        tokens = torch.randint(0, VOCAB_SIZE, (4, config.context + 1), generator=generator)
        model.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB_SIZE), tokens[:, 1:].reshape(-1), reduction="sum"
        )
        loss.backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= world * tokens[:, 1:].numel()
        for p, q in zip(reference.parameters(), model.parameters(), strict=True):
            assert q.grad is not None
            p.grad = q.grad.clone()
        dist.barrier()
        started = time.perf_counter()
        replicated.step()
        times["replicated"].append(time.perf_counter() - started)
        dist.barrier()
        started = time.perf_counter()
        sharded.step(gather, members)
        times["sharded"].append(time.perf_counter() - started)
        pairs = zip(model.parameters(), reference.parameters(), strict=True)
        equal.append(all(torch.equal(p, q) for p, q in pairs))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    warm = max(1, args["steps"] // 4)
    result = {
        "rank": rank,
        "parameters": sum(p.numel() for p in model.parameters()),
        "parameter_bytes": params,
        "replicated_state_bytes": state_bytes(replicated),
        "sharded_state_bytes": sharded.state_bytes(),
        "owned_partitions": len(sharded.owned),
        "replicated_update_s": statistics.median(times["replicated"][warm:]),
        "sharded_update_s": statistics.median(times["sharded"][warm:]),
        "gather_bytes_sent_per_step": sent[-1],
        "bit_identical_steps": sum(equal),
        "steps": len(equal),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    # Without the interpreter's teardown, which gloo's threads can still race
    # (SIGABRT in about one exit in a few hundred; tests/test_sharded.py).
    os._exit(0)


def run_size(name: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rollcall-sharding-") as out:
        settings = {
            "workers": args.workers, "port": free_port(), "size": SIZES[name],
            "partitions": args.partitions, "redundancy": args.redundancy, "steps": args.steps,
        }  # fmt: skip
        context = mp.start_processes(
            _rank, args=(settings, out), nprocs=args.workers, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + RANK_TIMEOUT
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for process in context.processes:
                    process.kill()
                raise RuntimeError(f"size {name}: the ranks did not finish in {RANK_TIMEOUT:g} s")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.workers)]
    replicated = ranks[0]["replicated_state_bytes"]
    held = [r["sharded_state_bytes"] for r in ranks]
    return {
        "size": name,
        "settings": SIZES[name],
        "parameters": ranks[0]["parameters"],
        "parameter_bytes": ranks[0]["parameter_bytes"],
        "replicated_state_bytes_per_rank": replicated,
        "sharded_state_bytes_per_rank": held,
        "sharded_over_replicated_max": max(held) / replicated,
        "aim_r_over_w": args.redundancy / args.workers,
        "replicated_update_s": statistics.median(r["replicated_update_s"] for r in ranks),
        "sharded_update_s": statistics.median(r["sharded_update_s"] for r in ranks),
        "gather_bytes_sent_per_step": [r["gather_bytes_sent_per_step"] for r in ranks],
        "bit_identical": all(r["bit_identical_steps"] == r["steps"] for r in ranks),
        "ranks": ranks,
    }


def render(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Sharded optimizer state, {args.workers} ranks, redundancy {args.redundancy}, "
        f"{args.partitions} partitions, AdamW (aim: r/W = {args.redundancy / args.workers:.2f} "
        "of the replicated state per rank)",
        "",
        "| size | parameters | param bytes/rank | replicated state/rank | sharded state/rank "
        "(max) | ratio | update replicated | update sharded (+ all-gather) | gather sent/rank/step "
        "| bit-identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['size']} | {row['parameters']:,} | {row['parameter_bytes']:,} | "
            f"{row['replicated_state_bytes_per_rank']:,} | "
            f"{max(row['sharded_state_bytes_per_rank']):,} | "
            f"{row['sharded_over_replicated_max']:.3f} | "
            f"{row['replicated_update_s'] * 1000:.2f} ms | "
            f"{row['sharded_update_s'] * 1000:.2f} ms | "
            f"{max(row['gather_bytes_sent_per_step']):,} B | "
            f"{'yes' if row['bit_identical'] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--redundancy", type=int, default=2, help="copies (default 2)")
    parser.add_argument("--partitions", type=int, default=64, help="partitions (default 64)")
    parser.add_argument("--steps", type=int, default=12, help="steps per size (default 12)")
    parser.add_argument("--quick", action="store_true", help="the default size only")
    args = parser.parse_args()
    sizes = ["default"] if args.quick else list(SIZES)
    rows = [run_size(name, args) for name in sizes]
    text = render(rows, args)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "sharding-quick" if args.quick else "sharding"
    payload = {
        "benchmark": "sharding",
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},  # fmt: skip
        "settings": vars(args),
        "sizes": rows,
    }
    (RESULTS / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(text + "\n")
    print(f"\nwritten: bench/results/{stem}.json, bench/results/{stem}.md")


if __name__ == "__main__":
    main()
