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
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rollcall.etcd_local import LocalEtcd, free_port  # noqa: E402
from rollcall.membership.config import Config  # noqa: E402
from rollcall.membership.view import View  # noqa: E402
from rollcall.protocol.client import RendezvousClient  # noqa: E402

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


class Fleet:
    """Lightweight members in this process, with the time each view reached
    each of them (so "first member" and "all members" can be told apart: the
    members share one Python process here, so the last arrival also measures
    this process working through hundreds of sessions one after another)."""

    def __init__(self, address: str, token: str) -> None:
        self.address, self.token = address, token
        self.clients: list[RendezvousClient] = []
        self.arrivals: dict[int, list[float]] = {}
        self._port = 20000

    def _on_view(self, view: View) -> None:
        self.arrivals.setdefault(view.epoch, []).append(time.perf_counter())

    async def join(self) -> RendezvousClient:
        client = RendezvousClient([self.address], JOB, self.token, Config())
        self._port += 1
        await client.join(f"127.0.0.1:{self._port}", name="b", on_view=self._on_view)
        self.clients.append(client)
        return client

    async def wait(self, predicate: Callable[[View], bool]) -> View:
        views = await asyncio.gather(*(c.wait_view(predicate, EVENT_TIMEOUT) for c in self.clients))
        return views[0]

    def spread(self, epoch: int, t0: float) -> tuple[float, float]:
        """(first, last) arrival of view ``epoch`` after ``t0``, in seconds."""
        times = self.arrivals[epoch]
        return min(times) - t0, max(times) - t0


async def run_size(address: str, token: str, size: int, repeats: int) -> dict[str, object]:
    fleet = Fleet(address, token)
    start = time.perf_counter()
    await asyncio.gather(*(fleet.join() for _ in range(size)))
    ids = {c.member_id for c in fleet.clients}
    burst_view = await fleet.wait(lambda v: ids <= set(v.ids))
    burst = time.perf_counter() - start
    first: dict[str, list[float]] = {"leave": [], "crash": [], "join": []}
    everyone: dict[str, list[float]] = {"leave": [], "crash": [], "join": []}

    def record(kind: str, epoch: int, t0: float) -> None:
        a, b = fleet.spread(epoch, t0)
        first[kind].append(a)
        everyone[kind].append(b)

    for _ in range(repeats):
        # A clean leave.
        epoch = fleet.clients[0].view.epoch
        leaver = fleet.clients.pop()
        t0 = time.perf_counter()
        await leaver.leave()
        record("leave", (await fleet.wait(lambda v, e=epoch: v.epoch > e)).epoch, t0)
        await leaver.close()
        # A join (restores the size).
        t0 = time.perf_counter()
        joiner = await fleet.join()
        view = await fleet.wait(lambda v, m=joiner.member_id: m in v)
        record("join", view.epoch, t0)
        # A crash: a session dropped without a Leave.
        epoch = fleet.clients[0].view.epoch
        victim = fleet.clients.pop(0)
        t0 = time.perf_counter()
        await victim.close()
        record("crash", (await fleet.wait(lambda v, e=epoch: v.epoch > e)).epoch, t0)
        replacement = await fleet.join()
        await fleet.wait(lambda v, m=replacement.member_id: m in v)
    for client in fleet.clients:
        await client.leave()
        await client.close()
    return {
        "members": size,
        "join_burst_s": burst,
        "join_throughput_per_s": size / burst,
        "views_during_burst": burst_view.epoch - min(fleet.arrivals),
        **{f"{kind}_first": summary(values) for kind, values in first.items()},
        **{f"{kind}_all": summary(values) for kind, values in everyone.items()},
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
                "info",
                *(arg for item in settings for arg in ("--set", item)),
            ],  # fmt: skip
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
        except BaseException:
            log.flush()
            tail = (Path(tmp) / "rendezvous.log").read_text(errors="replace").splitlines()[-40:]
            print("rendezvous log (last lines):", *tail, sep="\n  ", file=sys.stderr)
            raise
        finally:
            replica.terminate()
            replica.wait(timeout=10)
            log.close()
            etcd.stop()


HEADER = (
    "view change = trigger -> new view received; first member / all members, p50 (p90) in ms\n"
    f"{'members':>7} | {'join burst':>10} | {'joins/s':>7} | {'leave':>23} | "
    f"{'crash':>23} | {'join':>23}"
)


def format_row(row: dict[str, object]) -> str:
    def cell(kind: str) -> str:
        a, b = row[f"{kind}_first"], row[f"{kind}_all"]
        assert isinstance(a, dict) and isinstance(b, dict)
        return f"{a['p50_ms']:5.0f} ({a['p90_ms']:4.0f}) / {b['p50_ms']:5.0f} ({b['p90_ms']:4.0f})"

    return (
        f"{row['members']:>7} | {row['join_burst_s']:9.2f}s | "
        f"{row['join_throughput_per_s']:7.0f} | {cell('leave')} | {cell('crash')} | {cell('join')}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,64,512", help="member counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=10, help="events of each kind per size")
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="config override for the service (as `rollcall rendezvous --set`)",
    )
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
