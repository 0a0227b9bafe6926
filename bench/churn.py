"""Churn: hundreds of view changes, with etcd's database size and the
long-lived processes' resources sampled, to show that nothing grows.

    .venv/bin/python bench/churn.py [--changes 300] [--members 8] [--every 25]
        [--compaction-retention 10s] [--max-seconds 900] [--json FILE]

Starts a real etcd (``LocalEtcd``: rollcall's own flags, periodic
auto-compaction, here with a short ``--compaction-retention`` so that
compaction acts within the run; rollcall's default is 5 minutes) and one
rendezvous replica (the ``rollcall`` CLI, its own process) on loopback, and
``--members`` lightweight members (plain gRPC clients in this process, no
torch). Then, until ``--changes`` views were committed (bounded by
``--max-seconds``), one member after another leaves cleanly, crashes (its
session dropped without a Leave) or joins, round-robin, keeping the size
between ``members - 1`` and ``members``. Every ``--every`` view changes it
samples:

- etcd: ``dbSize`` and ``dbSizeInUse`` (``etcdctl endpoint status -w
  json``), its revision, and its process's RSS;
- the replica's process (the survivor of every change): RSS, threads, open
  file descriptors;
- this process (where the surviving members live): RSS, threads, fds.

Prints the samples as a table, writes them as JSON (default
bench/results/churn.json), and checks the bounds (exit 1 if one fails):
over the second half of the run, dbSizeInUse stays within 2x its
first-half maximum plus 256 KiB, and the replica's and this process's RSS
within their first-half maximum plus 32 MiB, threads plus 4 and fds plus 16.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peers import git_commit  # noqa: E402
from rollcall.etcd_local import LocalEtcd, free_port  # noqa: E402
from rollcall.membership.config import Config  # noqa: E402
from rollcall.protocol.client import RendezvousClient  # noqa: E402

JOB = "churn"
EVENT_TIMEOUT = 60.0
MiB = 1024 * 1024


def etcd_status(endpoint: str) -> dict[str, int]:
    etcdctl = shutil.which("etcdctl")
    if etcdctl is None:
        raise SystemExit("etcdctl is missing: apt-get install etcd-client")
    out = subprocess.run(
        [etcdctl, f"--endpoints={endpoint}", "endpoint", "status", "-w", "json"],
        capture_output=True, text=True, timeout=10, check=True,
        env={**os.environ, "ETCDCTL_API": "3"},
    ).stdout  # fmt: skip
    status = json.loads(out)[0]["Status"]
    return {
        "db_size": int(status["dbSize"]),
        "db_in_use": int(status.get("dbSizeInUse", status["dbSize"])),
        "revision": int(status["header"]["revision"]),
    }


def resources(process: psutil.Process) -> dict[str, int]:
    with process.oneshot():
        return {
            "rss": process.memory_info().rss,
            "threads": process.num_threads(),
            "fds": process.num_fds(),
        }


class Fleet:
    def __init__(self, address: str, token: str) -> None:
        self.address, self.token = address, token
        self.clients: list[RendezvousClient] = []
        self._port = 30000

    async def join(self) -> RendezvousClient:
        client = RendezvousClient([self.address], JOB, self.token, Config())
        self._port += 1
        await client.join(f"127.0.0.1:{self._port}", name="c")
        self.clients.append(client)
        return client

    def epoch(self) -> int:
        return max(c.view.epoch for c in self.clients)

    async def settle(self, predicate: Any) -> None:
        await asyncio.gather(*(c.wait_view(predicate, EVENT_TIMEOUT) for c in self.clients))


async def churn(args: argparse.Namespace, etcd: LocalEtcd, address: str, token: str,
                replica: psutil.Process) -> list[dict[str, Any]]:  # fmt: skip
    fleet = Fleet(address, token)
    await asyncio.gather(*(fleet.join() for _ in range(args.members)))
    ids = {c.member_id for c in fleet.clients}
    await fleet.settle(lambda v: ids <= set(v.ids))
    etcd_proc = psutil.Process(etcd.pid)
    me = psutil.Process()
    start_epoch = fleet.epoch()
    started = time.monotonic()
    samples: list[dict[str, Any]] = []

    def sample(changes: int) -> None:
        row: dict[str, Any] = {"changes": changes, "seconds": time.monotonic() - started}
        row.update(etcd_status(etcd.endpoint))
        row["etcd_rss"] = etcd_proc.memory_info().rss
        row.update({f"replica_{k}": v for k, v in resources(replica).items()})
        row.update({f"bench_{k}": v for k, v in resources(me).items()})
        samples.append(row)
        print(format_row(row), flush=True)

    print(HEADER, flush=True)
    sample(0)
    kind = 0
    while fleet.epoch() - start_epoch < args.changes:
        if time.monotonic() - started > args.max_seconds:
            print(f"stopped after {args.max_seconds} s", file=sys.stderr)
            break
        before = fleet.epoch()
        if len(fleet.clients) < args.members:
            joiner = await fleet.join()
            await fleet.settle(lambda v, m=joiner.member_id: m in v)
        else:
            victim = fleet.clients.pop(kind % len(fleet.clients))
            if kind % 2 == 0:
                await victim.leave()
            await victim.close()  # without a Leave: a crash
            kind += 1
            await fleet.settle(lambda v, e=before, m=victim.member_id: v.epoch > e and m not in v)
        done = fleet.epoch() - start_epoch
        if done // args.every > (before - start_epoch) // args.every:
            sample(done)
    for client in fleet.clients:
        await client.leave()
        await client.close()
    return samples


HEADER = (
    f"{'changes':>7} {'s':>6} {'revision':>8} {'db KiB':>7} {'in use KiB':>10} "
    f"{'etcd MiB':>8} {'rdv MiB':>7} {'rdv thr':>7} {'rdv fds':>7} "
    f"{'bench MiB':>9} {'thr':>4} {'fds':>4}"
)


def format_row(r: dict[str, Any]) -> str:
    return (
        f"{r['changes']:>7} {r['seconds']:>6.0f} {r['revision']:>8} {r['db_size'] // 1024:>7} "
        f"{r['db_in_use'] // 1024:>10} {r['etcd_rss'] / MiB:>8.1f} "
        f"{r['replica_rss'] / MiB:>7.1f} {r['replica_threads']:>7} {r['replica_fds']:>7} "
        f"{r['bench_rss'] / MiB:>9.1f} {r['bench_threads']:>4} {r['bench_fds']:>4}"
    )


def check_bounds(samples: list[dict[str, Any]]) -> list[str]:
    """The bounds of the module docstring; the failures, if any."""
    if len(samples) < 4:
        return [f"only {len(samples)} samples: run more changes"]
    half = len(samples) // 2
    first, second = samples[:half], samples[half:]
    limits = {
        "db_in_use": lambda m: 2 * m + 256 * 1024,
        "replica_rss": lambda m: m + 32 * MiB,
        "bench_rss": lambda m: m + 32 * MiB,
        "replica_threads": lambda m: m + 4,
        "bench_threads": lambda m: m + 4,
        "replica_fds": lambda m: m + 16,
        "bench_fds": lambda m: m + 16,
    }
    failures = []
    for key, limit in limits.items():
        bound = limit(max(s[key] for s in first))
        worst = max(s[key] for s in second)
        if worst > bound:
            failures.append(f"{key}: {worst} in the second half, bound {bound}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--changes", type=int, default=300)
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--compaction-retention", default="10s")
    parser.add_argument("--max-seconds", type=float, default=900.0)
    parser.add_argument("--json", type=Path, default=ROOT / "bench/results/churn.json")
    args = parser.parse_args()
    if args.changes < 1 or args.members < 2 or args.every < 1:
        parser.error("--changes and --every must be positive, --members at least 2")
    token = secrets.token_urlsafe(16)
    with tempfile.TemporaryDirectory(prefix="rollcall-churn-") as tmp:
        etcd = LocalEtcd(
            data_dir=Path(tmp) / "etcd", compaction_retention=args.compaction_retention,
        )  # fmt: skip
        etcd.start()
        port = free_port()
        token_file = Path(tmp) / "token"
        token_file.write_text(token)
        log = open(Path(tmp) / "rendezvous.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollcall.cli", "rendezvous", "--etcd", etcd.endpoint,
             "--listen", f"127.0.0.1:{port}", "--job", JOB, "--token-file", str(token_file),
             "--log-level", "warning"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=log,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().decode()
            if not line.startswith("rendezvous ready"):
                raise SystemExit(f"rendezvous did not start: {line!r}")
            samples = asyncio.run(
                churn(args, etcd, f"127.0.0.1:{port}", token, psutil.Process(proc.pid))
            )
        except BaseException:
            log.flush()
            tail = (Path(tmp) / "rendezvous.log").read_text(errors="replace").splitlines()[-30:]
            print("rendezvous log (last lines):", *tail, sep="\n  ", file=sys.stderr)
            raise
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            log.close()
            etcd.stop()
    failures = check_bounds(samples)
    result = {
        "bench": "churn",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "changes": samples[-1]["changes"] if samples else 0,
        "members": args.members,
        "compaction_retention": args.compaction_retention,
        "samples": samples,
        "bounded": not failures,
        "failures": failures,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print("bounded" if not failures else "NOT bounded: " + "; ".join(failures))
    print(f"written to {args.json}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
