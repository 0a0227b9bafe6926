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
thread's cost is time-based (per heartbeat), reported per second. Each
round's training-thread CPU is also split by part of the step (``PARTS``),
for both loops.
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


#: The parts of a step the rounds time: taking the next step (Elastic only),
#: loading a microbatch (the plain loop: its samples stacked; Elastic: the
#: runtime's loader, seeding included), the forward pass, the backward pass
#: (Elastic: ``step.backward`` with its checks), and the rest of the step
#: (the plain loop: flatten, divide, optimizer; Elastic: ``commit()``).
PARTS = ("next step", "load", "forward", "backward", "commit")


class Sections:
    """CPU time of this thread split by part of the step: each ``mark``
    charges the time since the previous one to the part it names."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self._last = 0.0

    def start(self) -> float:
        self._last = time.thread_time()
        return self._last

    def mark(self, part: str) -> None:
        now = time.thread_time()
        self.spent[part] = self.spent.get(part, 0.0) + now - self._last
        self._last = now

    def per_step(self, steps: int) -> dict[str, float]:
        return {part: spent / steps * 1000 for part, spent in self.spent.items()}


def measure(rounds: int, steps: int) -> dict[str, Any]:
    import torch

    from rollcall.worker.examples.lm import LMConfig, build, loss_sum
    from rollcall.worker.plan import DataPlan
    from rollcall.worker.runtime import Elastic

    torch.set_num_threads(1)
    plain_model, plain_optimizer, corpus = build(LMConfig(), 0)
    plan = DataPlan(len(corpus), 32, 8, 0)
    params = [p for p in plain_model.parameters() if p.requires_grad]

    def plain_round(first: int, parts: Sections) -> float:
        started = parts.start()
        for number in range(first, first + steps):
            count = 0
            for mb in plan.for_rank(number, 0, 1):
                torch.manual_seed(mb.seed)
                samples = [corpus[i] for i in mb.sample_ids]
                inputs = torch.stack([s[0] for s in samples])
                targets = torch.stack([s[1] for s in samples])
                parts.mark("load")
                loss, n = loss_sum(plain_model, inputs, targets)
                parts.mark("forward")
                loss.backward()
                count += n
                parts.mark("backward")
            flat = torch.cat([*(p.grad.reshape(-1) for p in params), torch.tensor([count, 0.0])])
            offset = 0
            for p in params:
                size = p.numel()
                p.grad = (flat[offset : offset + size] / count).view_as(p).clone()
                offset += size
            plain_optimizer.step()
            plain_optimizer.zero_grad(set_to_none=True)
            parts.mark("commit")
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

                def elastic_round(parts: Sections) -> float:
                    started = parts.start()
                    for _ in range(steps):
                        step = next(loop)
                        parts.mark("next step")
                        for batch in step.microbatches():
                            parts.mark("load")
                            loss, count = loss_sum(model, batch.inputs, batch.targets)
                            parts.mark("forward")
                            step.backward(loss, count)
                            parts.mark("backward")
                        parts.mark("load")  # the loop's end: the next microbatch asked for
                        if not step.commit():
                            raise RuntimeError(f"step {step.number} was aborted")
                        parts.mark("commit")
                    return (time.thread_time() - started) / steps

                elastic_round(Sections())  # warm-up of both
                plain_round(0, Sections())
                control0, wall0 = thread_cpu_s("rollcall"), time.perf_counter()
                elastic, plain = [], []
                elastic_parts: list[dict[str, float]] = []
                plain_parts: list[dict[str, float]] = []
                for index in range(rounds):
                    # Alternate which goes first, so that drift favours neither.
                    mine, theirs = Sections(), Sections()
                    if index % 2 == 0:
                        elastic.append(elastic_round(mine))
                        plain.append(plain_round((index + 1) * steps, theirs))
                    else:
                        plain.append(plain_round((index + 1) * steps, theirs))
                        elastic.append(elastic_round(mine))
                    elastic_parts.append(mine.per_step(steps))
                    plain_parts.append(theirs.per_step(steps))
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
        # By part of the step: the median over rounds of each round's CPU
        # per step in it (ms), for each loop.
        "parts_ms_per_step": {
            "elastic": {k: statistics.median(r.get(k, 0.0) for r in elastic_parts)
                        for k in PARTS},
            "plain": {k: statistics.median(r.get(k, 0.0) for r in plain_parts) for k in PARTS},
        },
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
    parts = result["parts_ms_per_step"]
    print("\n| part of the step | Elastic, ms | plain, ms | difference |\n|---|---:|---:|---:|")
    for part in PARTS:
        mine, theirs = parts["elastic"][part], parts["plain"][part]
        print(f"| {part} | {mine:.2f} | {theirs:.2f} | {mine - theirs:+.2f} |")
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
