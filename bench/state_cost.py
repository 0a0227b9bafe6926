"""What capturing, digesting, serialising and restoring a replica state costs.

    .venv/bin/python bench/state_cost.py [--repeats 3] [--width 1024 --layers 3] [--json FILE]

One process, no etcd: a 10 MB model (three linear layers, by default) with AdamW moments
after one step, the operations of :mod:`rollcall.worker.state` each timed best of
``--repeats``. These are the costs a state transfer and a durable checkpoint
pay on top of the wire and the disk. ``capture_live`` is the capture a
roll call's answer makes (parameters and optimizer moments shared, not
cloned: ``capture(..., live=True)``); ``digest_threads`` is its digest,
hashed by as many threads as the process has cores (``hash_threads``), as
an answer hashes it. ``--width``/``--layers`` make the model larger.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rollcall.worker.digest import digest, hash_threads  # noqa: E402
from rollcall.worker.state import capture, restore  # noqa: E402
from rollcall.worker.state_bytes import from_bytes, to_bytes  # noqa: E402


def best_of(repeats: int, action: Callable[[], Any]) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = action()
        times.append(time.perf_counter() - started)
    return min(times), result


def measure(repeats: int, width: int, layers: int) -> dict[str, float]:
    torch.manual_seed(0)
    sizes = [width] * layers + [width // 2]
    model = nn.Sequential(*(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:], strict=False)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    t_capture, state = best_of(repeats, lambda: capture(0, model, optimizer))
    t_live, _ = best_of(repeats, lambda: capture(0, model, optimizer, live=True))
    t_digest, _ = best_of(repeats, lambda: digest(state))
    threads = hash_threads()
    t_threads, _ = best_of(repeats, lambda: digest(state, threads=threads))
    t_save, blob = best_of(repeats, lambda: to_bytes(state))
    t_load, _ = best_of(repeats, lambda: from_bytes(blob))
    t_restore, _ = best_of(repeats, lambda: restore(state, model, optimizer))
    return {
        "model_mb": model_bytes / 1e6,
        "blob_mb": len(blob) / 1e6,
        "capture_ms": t_capture * 1e3,
        "capture_live_ms": t_live * 1e3,
        "digest_ms": t_digest * 1e3,
        "hash_threads": threads,
        "digest_threads_ms": t_threads * 1e3,
        "to_bytes_ms": t_save * 1e3,
        "from_bytes_ms": t_load * 1e3,
        "restore_ms": t_restore * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="Runs per operation (best counts).")
    parser.add_argument("--width", type=int, default=1024, help="Linear layers' width.")
    parser.add_argument("--layers", type=int, default=3, help="Linear layers.")
    parser.add_argument("--json", type=Path, default=ROOT / "bench/results/state_cost.json")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.width < 2 or args.layers < 1:
        parser.error("--width must be at least 2 and --layers at least 1")
    result = measure(args.repeats, args.width, args.layers)
    print(
        f"replica state: model {result['model_mb']:.1f} MB, blob {result['blob_mb']:.1f} MB "
        f"(model + AdamW moments), best of {args.repeats}; digest_threads: "
        f"{result['hash_threads']} threads"
    )
    print(f"{'operation':<16} {'ms':>8}")
    for key in (
        "capture", "capture_live", "digest", "digest_threads", "to_bytes", "from_bytes", "restore",
    ):  # fmt: skip
        print(f"{key:<16} {result[key + '_ms']:>8.1f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"repeats": args.repeats, **result}, indent=2) + "\n")
    print(f"written {args.json}")


if __name__ == "__main__":
    main()
