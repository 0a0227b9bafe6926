"""The runtime's failure-free tax, measured where it is paid: CPU time of the
training thread per step under ``Elastic`` against the same loop without it,
in alternating rounds inside one process, plus the CPU the runtime's control
thread (heartbeats, session) spends per second.

    .venv/bin/python bench/tax.py [--rounds 9] [--steps 40] [--json FILE]

One process, world size 1: the built-in example (worker/examples/lm.py,
default LMConfig, AdamW), global batch 32 in microbatches of 8, one torch
thread. The "plain" loop is what a user writes without rollcall: the same
microbatches of the same ``DataPlan``, ``torch.manual_seed`` per
microbatch, losses summed, the gradients flattened into one buffer (what an
all-reduce would sum) and divided by the step's count, AdamW. The Elastic
loop is joined to a real etcd and rendezvous replica (started here, on
loopback), so its heartbeats, fencing and bookkeeping all run; with one
member its all-reduce is a gloo collective over a group of one.

Why this and not processes side by side (``bench/recovery.py --only
overhead``): on this shared 2-core machine the wall-clock rate and even the
CPU per step of several processes move by more than the effect; the CPU
time of one thread, in rounds that alternate within a process, moves far
less. The training thread is where a per-step cost is paid; the control
thread's cost is time-based (per heartbeat), reported per second.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from recovery import JOB, Cluster  # noqa: E402


def thread_cpu_s(name: str) -> float:
    """User + system CPU seconds of this process's threads whose name
    contains ``name``."""
    total = 0.0
    for thread in threading.enumerate():
        if name in thread.name and thread.native_id is not None:
            stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
            fields = stat.rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def measure(rounds: int, steps: int) -> dict[str, Any]:
    import torch

    from rollcall.worker.examples.lm import LMConfig, build, loss_sum
    from rollcall.worker.plan import DataPlan
    from rollcall.worker.runtime import Elastic

    torch.set_num_threads(1)
    plain_model, plain_optimizer, corpus = build(LMConfig(), 0)
    plan = DataPlan(len(corpus), 32, 8, 0)
    params = [p for p in plain_model.parameters() if p.requires_grad]

    def plain_round(first: int) -> float:
        started = time.thread_time()
        for number in range(first, first + steps):
            count = 0
            for mb in plan.for_rank(number, 0, 1):
                torch.manual_seed(mb.seed)
                samples = [corpus[i] for i in mb.sample_ids]
                inputs = torch.stack([s[0] for s in samples])
                targets = torch.stack([s[1] for s in samples])
                loss, n = loss_sum(plain_model, inputs, targets)
                loss.backward()
                count += n
            flat = torch.cat([*(p.grad.reshape(-1) for p in params), torch.tensor([count, 0.0])])
            offset = 0
            for p in params:
                size = p.numel()
                p.grad = (flat[offset : offset + size] / count).view_as(p).clone()
                offset += size
            plain_optimizer.step()
            plain_optimizer.zero_grad(set_to_none=True)
        return (time.thread_time() - started) / steps

    with tempfile.TemporaryDirectory(prefix="rollcall-tax-") as tmp_name:
        with Cluster(Path(tmp_name)) as cluster:
            model, optimizer, _ = build(LMConfig(), 0)
            with Elastic(
                model, optimizer, corpus, global_batch=32, micro_batch=8, seed=0,
                rendezvous=[cluster.address], job=JOB, token=cluster.token_file.read_text(),
                messages=False,
            ) as job:  # fmt: skip
                loop = job.steps(10**9)

                def elastic_round() -> float:
                    started = time.thread_time()
                    for _ in range(steps):
                        step = next(loop)
                        for batch in step.microbatches():
                            loss, count = loss_sum(model, batch.inputs, batch.targets)
                            step.backward(loss, count)
                        if not step.commit():
                            raise RuntimeError(f"step {step.number} was aborted")
                    return (time.thread_time() - started) / steps

                elastic_round()  # warm-up of both
                plain_round(0)
                control0, wall0 = thread_cpu_s("rollcall"), time.perf_counter()
                elastic, plain = [], []
                for index in range(rounds):
                    # Alternate which goes first, so that drift favours neither.
                    if index % 2 == 0:
                        elastic.append(elastic_round())
                        plain.append(plain_round((index + 1) * steps))
                    else:
                        plain.append(plain_round((index + 1) * steps))
                        elastic.append(elastic_round())
                control = (thread_cpu_s("rollcall") - control0) / (time.perf_counter() - wall0)
    extra = [(e - p) * 1000 for e, p in zip(elastic, plain, strict=True)]
    percent = [(e / p - 1) * 100 for e, p in zip(elastic, plain, strict=True)]
    return {
        "rounds": [{"elastic_ms": e * 1000, "plain_ms": p * 1000} for e, p in zip(elastic, plain,
                                                                                 strict=True)],
        "elastic_ms_per_step": statistics.median(elastic) * 1000,
        "plain_ms_per_step": statistics.median(plain) * 1000,
        "extra_ms_per_step": {"median": statistics.median(extra), "min": min(extra),
                              "max": max(extra)},
        "extra_pct": {"median": statistics.median(percent), "min": min(percent),
                      "max": max(percent)},
        "control_thread_ms_per_s": control * 1000,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="alternating pairs of rounds")
    parser.add_argument("--steps", type=int, default=40, help="steps per round")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "tax.json")
    args = parser.parse_args()
    if not 3 <= args.rounds <= 50 or not 5 <= args.steps <= 1000:
        parser.error("--rounds must be 3..50 and --steps 5..1000")
    started = time.monotonic()
    result = measure(args.rounds, args.steps)
    extra, pct = result["extra_ms_per_step"], result["extra_pct"]
    print(f"training thread, CPU per step   | Elastic {result['elastic_ms_per_step']:.2f} ms, "
          f"plain {result['plain_ms_per_step']:.2f} ms (median of {args.rounds} rounds)")
    print(f"  extra per round                 | {extra['median']:+.2f} ms "
          f"[{extra['min']:+.2f} .. {extra['max']:+.2f}], {pct['median']:+.1f} % "
          f"[{pct['min']:+.1f} .. {pct['max']:+.1f}]")
    print(f"control thread                  | {result['control_thread_ms_per_s']:.1f} ms CPU "
          "per second")
    import torch

    result.update(
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        wall_s=time.monotonic() - started,
        machine={"cpus": os.cpu_count(), "platform": platform.platform(),
                 "python": platform.python_version(), "load_avg": os.getloadavg()},
        versions={"torch": torch.__version__},
        parameters={"rounds": args.rounds, "steps": args.steps, "world": 1,
                    "example": "lm (default LMConfig)", "global_batch": 32, "micro_batch": 8,
                    "threads": 1},
    )  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
