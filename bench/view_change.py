"""View-change latency and join throughput of the control plane.

    .venv/bin/python bench/view_change.py [--sizes 4,64,512] [--repeats 10] [--json FILE]

Starts a real etcd and one rendezvous replica (the `rollcall` CLI, its own
process) on loopback, then drives N lightweight members (plain gRPC clients
in this process, no torch) through:

- join burst: N members join at once; throughput = N / (time until every
  member holds the view with all N);
- leave: one member leaves cleanly; latency = Leave call -> every survivor
  holds the new view;
- crash: one member's session is dropped without a Leave (as a killed process
  would); latency = drop -> every survivor holds the new view;
- join: one member joins; latency = Join call -> every member (the joiner
  included) holds the view with it (includes the `join_settle` batching
  window, 50 ms by default).

Prints a table and writes JSON (default bench/results/view_change.json).
Every loop is bounded by --repeats and a timeout per event.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from membership.config import Config  # noqa: E402
from rendezvous.client import RendezvousClient  # noqa: E402
from rendezvous.etcd_local import LocalEtcd, free_port  # noqa: E402

JOB = "bench"
EVENT_TIMEOUT = 60.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": statistics.median(values) * 1000,
        "p90_ms": percentile(values, 0.9) * 1000,
        "max_ms": max(values) * 1000,
    }


async def everyone_sees(clients: list[RendezvousClient], epoch: int) -> None:
    await asyncio.gather(*(c.wait_view(lambda v: v.epoch >= epoch, EVENT_TIMEOUT) for c in clients))


async def everyone_has(clients: list[RendezvousClient], member_id: str) -> None:
    await asyncio.gather(*(c.wait_view(lambda v: member_id in v, EVENT_TIMEOUT) for c in clients))


async def new_client(address: str, token: str) -> RendezvousClient:
    return RendezvousClient([address], JOB, token, Config())


async def run_size(address: str, token: str, size: int, repeats: int) -> dict[str, object]:
    clients = [await new_client(address, token) for _ in range(size)]
    start = time.perf_counter()
    await asyncio.gather(
        *(c.join(f"127.0.0.1:{20000 + i}", name="b") for i, c in enumerate(clients))
    )
    ids = {c.member_id for c in clients}
    await asyncio.gather(
        *(c.wait_view(lambda v: ids <= set(v.ids), EVENT_TIMEOUT) for c in clients)
    )
    burst = time.perf_counter() - start
    views_for_burst = clients[0].view.epoch
    results: dict[str, list[float]] = {"leave": [], "crash": [], "join": []}
    for i in range(repeats):
        # leave
        epoch = clients[0].view.epoch
        leaver = clients.pop()
        t0 = time.perf_counter()
        await leaver.leave()
        await everyone_sees(clients, epoch + 1)
        results["leave"].append(time.perf_counter() - t0)
        await leaver.close()
        # join (restores the size)
        joiner = await new_client(address, token)
        t0 = time.perf_counter()
        member_id = await joiner.join(f"127.0.0.1:{30000 + i}", name="b")
        clients.append(joiner)
        await everyone_has(clients, member_id)
        results["join"].append(time.perf_counter() - t0)
        # crash: drop a session without leaving
        epoch = clients[0].view.epoch
        victim = clients.pop(0)
        t0 = time.perf_counter()
        await victim.close()
        await everyone_sees(clients, epoch + 1)
        results["crash"].append(time.perf_counter() - t0)
        replacement = await new_client(address, token)
        member_id = await replacement.join(f"127.0.0.1:{40000 + i}", name="b")
        clients.append(replacement)
        await everyone_has(clients, member_id)
    for client in clients:
        await client.leave()
        await client.close()
    return {
        "members": size,
        "join_burst_s": burst,
        "join_throughput_per_s": size / burst,
        "views_during_burst": views_for_burst,
        **{kind: summary(values) for kind, values in results.items()},
    }


async def bench(sizes: list[int], repeats: int, settings: list[str]) -> dict[str, object]:
    token = secrets.token_urlsafe(16)
    with tempfile.TemporaryDirectory(prefix="rollcall-bench-") as tmp:
        etcd = LocalEtcd(
            data_dir=Path(tmp) / "etcd", client_port=free_port(), peer_port=free_port()
        )
        etcd.start()
        port = free_port()
        token_file = Path(tmp) / "token"
        token_file.write_text(token)
        log = open(Path(tmp) / "rendezvous.log", "wb")
        replica = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rollcall.cli",
                "rendezvous",
                "--etcd",
                etcd.endpoint,
                "--listen",
                f"127.0.0.1:{port}",
                "--job",
                JOB,
                "--token-file",
                str(token_file),
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=log,
        )
        try:
            assert replica.stdout is not None
            line = replica.stdout.readline().decode()
            if not line.startswith("rendezvous ready"):
                raise SystemExit(f"rendezvous did not start: {line!r}")
            rows = []
            for size in sizes:
                # Every member of the previous size has left: the view is empty.
                rows.append(await run_size(f"127.0.0.1:{port}", token, size, repeats))
                print(format_row(rows[-1]), flush=True)
            return {"rows": rows}
        finally:
            replica.terminate()
            replica.wait(timeout=10)
            log.close()
            etcd.stop()


HEADER = (
    f"{'members':>7} | {'join burst':>10} | {'joins/s':>8} | "
    f"{'leave p50/p90 ms':>17} | {'crash p50/p90 ms':>17} | {'join p50/p90 ms':>16}"
)


def format_row(row: dict[str, object]) -> str:
    def pair(kind: str) -> str:
        s = row[kind]
        assert isinstance(s, dict)
        return f"{s['p50_ms']:7.1f}/{s['p90_ms']:7.1f}"

    return (
        f"{row['members']:>7} | {row['join_burst_s']:9.2f}s | "
        f"{row['join_throughput_per_s']:8.1f} | "
        f"{pair('leave'):>17} | {pair('crash'):>17} | {pair('join'):>16}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,64,512", help="member counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=10, help="events of each kind per size")
    parser.add_argument(
        "--json", type=Path, default=ROOT / "bench" / "results" / "view_change.json"
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if not 1 <= args.repeats <= 1000 or any(not 2 <= s <= 2000 for s in sizes):
        parser.error("--repeats must be 1..1000 and sizes 2..2000")
    print(HEADER)
    result = asyncio.run(bench(sizes, args.repeats, args.settings))
    result.update(
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        machine={
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        parameters={
            "sizes": sizes,
            "repeats": args.repeats,
            "overrides": args.settings,
            "config": Config().__dict__,
        },
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
