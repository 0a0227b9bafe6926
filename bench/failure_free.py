"""Failure-free throughput of rollcall against torchrun, and where the CPU
goes: the job of ``bench/peers.py`` (3 workers, the example LM, global batch
32 in microbatches of 8, a durable checkpoint every 20 steps, one torch
thread each), nothing killed.

    .venv/bin/python bench/failure_free.py [--rounds 5] [--window 20]
        [--before DIR] [--rollcall-set NAME=VALUE ...] [--json FILE]

Each round starts every system afresh, waits until all 3 workers are
steady, then measures over ``--window`` seconds: samples/s (as
``peers.throughput``), the CPU of the workers' process trees per step
(rollcall's workers; torchrun's agents and the trainers they run), that of
the busiest worker alone (the one the data plan gives the most
microbatches: the step's longest path), the CPU of the rest of each
system (rollcall's etcd and rendezvous replica, torchrun's rendezvous
store) and the machine's idle share; and the workers' CPU per step by
thread kind (``THREAD_KINDS``: the training thread, the other Python
threads, gloo's, gRPC's), read from ``/proc/PID/task``. The systems
alternate their order from round to round, so that a drift of the
machine's load hits all alike; the tables give medians and ranges.

``--before DIR`` adds rollcall as checked out in DIR (a ``git worktree`` of
an earlier commit; its workers import its own code) as a third system, for
an A/B of a change. ``--rollcall-set NAME=VALUE`` (repeatable) adds
rollcall with these config overrides (``--set`` of its replica and its
workers; membership/config.py) as another system, for an A/B of a
setting. Results: ``results/failure_free.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import peers  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SYSTEMS = {"rollcall": peers.Rollcall, "torchrun": peers.Torchrun}


def _cpu(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


#: The workers' threads, by kind: the process's main thread (the training
#: loop), the other Python threads (rollcall's control thread, its
#: checkpoint writer and loaders; torchrun's agent), gloo's and gRPC's
#: threads (named by their libraries), and any other.
THREAD_KINDS = ("main", "other Python", "gloo", "gRPC", "other")


def _thread_kind(pid: int, tid: int, name: str) -> str:
    if tid == pid:
        return "main"
    if name.startswith(("gloo", "pt_gloo")):
        return "gloo"
    if name.startswith(("event_engine", "grpc", "default-executo", "resolver", "lifeguard")):
        return "gRPC"
    if name.startswith(("python", "pt_elastic")):
        return "other Python"
    return "other"


def _threads_cpu(processes: list[psutil.Process]) -> dict[str, float]:
    """CPU seconds of the processes' threads, summed by ``THREAD_KINDS``."""
    kinds = dict.fromkeys(THREAD_KINDS, 0.0)
    for process in processes:
        try:
            for tid in Path(f"/proc/{process.pid}/task").iterdir():
                name = (tid / "comm").read_text().strip()
                fields = (tid / "stat").read_text().rpartition(")")[2].split()
                seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
                kinds[_thread_kind(process.pid, int(tid.name), name)] += seconds
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread or process that ended: its time is lost to both ends
    return kinds


def measure_once(name: str, window: str, *settings: str) -> dict[str, float]:
    """One fresh system of ``name``, steady with 3 workers, measured over
    ``window`` seconds; rollcall's replica and workers given ``settings``
    (config overrides, "NAME=VALUE")."""
    seconds = float(window)
    system = SYSTEMS[name](Path(tempfile.mkdtemp(prefix=f"ff-{name}-")))
    if settings:
        assert isinstance(system, peers.Rollcall)
        system.settings = settings
    system.start()
    try:
        for _ in range(peers.WORKERS):
            system.spawn()
        peers.wait_steady(system, peers.WORKERS, 10, time.time(), 180)
        time.sleep(2)
        trees: list[list[psutil.Process]] = []
        for worker in system.workers:
            process = psutil.Process(worker.child.proc.pid)
            trees.append([process, *process.children(recursive=True)])
        rest = [psutil.Process(child.proc.pid) for child in system.infra if child.alive()]
        etcd = getattr(system, "etcd", None)
        if etcd is not None and etcd.pid:
            rest.append(psutil.Process(etcd.pid))
        everyone = [process for tree in trees for process in tree]
        trees_0, rest_0, machine_0 = [_cpu(t) for t in trees], _cpu(rest), psutil.cpu_times()
        threads_0 = _threads_cpu(everyone)
        rate = peers.throughput(system, seconds)
        trees_1, rest_1, machine_1 = [_cpu(t) for t in trees], _cpu(rest), psutil.cpu_times()
        threads_1 = _threads_cpu(everyone)
        steps = rate["steps_per_s"] * seconds
        machine = sum(machine_1) - sum(machine_0)
        spent = [after - before for before, after in zip(trees_0, trees_1, strict=True)]
        return {
            "samples_per_s": rate["samples_per_s"],
            "worker_cpu_ms_per_step": sum(spent) / steps * 1000,
            "busiest_worker_cpu_ms_per_step": max(spent) / steps * 1000,
            "rest_cpu_share": (rest_1 - rest_0) / seconds,
            "idle_share": (machine_1.idle - machine_0.idle) / machine,
            **{f"threads_{kind}_cpu_ms_per_step": (threads_1[kind] - threads_0[kind]) / steps
               * 1000 for kind in THREAD_KINDS},
        }  # fmt: skip
    finally:
        system.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds (1..20)")
    parser.add_argument("--window", type=float, default=20.0, help="seconds measured (5..120)")
    parser.add_argument("--before", type=Path, default=None,
                        help="an earlier rollcall checkout, a third system")  # fmt: skip
    parser.add_argument("--rollcall-set", action="append", default=[], metavar="NAME=VALUE",
                        help="rollcall with this config override too, another system "
                             "(repeatable: all in the one system)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=RESULTS / "failure_free.json")
    args = parser.parse_args()
    if not 1 <= args.rounds <= 20:
        parser.error("--rounds must be 1..20")
    if not 5 <= args.window <= 120:
        parser.error("--window must be 5..120 seconds")
    peers.checkout_argument(parser, args.before)
    peers.settings_argument(parser, args.rollcall_set)
    settings = tuple(args.rollcall_set)

    # (label, the checkout it runs from (None: this one), config overrides)
    runs: list[tuple[str, Path | None, tuple[str, ...]]] = [
        ("rollcall", None, ()),
        ("torchrun", None, ()),
    ]
    if args.before is not None:
        runs.insert(0, ("rollcall before", args.before.resolve(), ()))
    if settings:
        runs.insert(1, (f"rollcall {','.join(settings)}", None, settings))
    started = time.monotonic()
    rows: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in runs}
    for round_ in range(args.rounds):
        for label, directory, overrides in runs if round_ % 2 == 0 else reversed(runs):
            name = label.split()[0]
            result = peers.measured_in(
                directory, Path(__file__), measure_once, name, str(args.window), *overrides
            )
            rows[label].append(result)
            print(f"round {round_ + 1}/{args.rounds} {label:16s} "
                  f"{result['samples_per_s']:6.1f} samples/s, workers "
                  f"{result['worker_cpu_ms_per_step']:5.1f} ms CPU/step", flush=True)  # fmt: skip

    table = {label: {key: peers.spread_of([r[key] for r in results]) for key in results[0]}
             for label, results in rows.items()}  # fmt: skip
    print()
    print(
        "| system | samples/s | workers' CPU per step | the busiest worker's "
        "| rest of the system | machine idle |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for label, t in table.items():
        s, c = t["samples_per_s"], t["worker_cpu_ms_per_step"]
        b = t["busiest_worker_cpu_ms_per_step"]
        print(f"| {label} | {s['median']:.0f} [{s['min']:.0f}-{s['max']:.0f}] "
              f"| {c['median']:.1f} ms [{c['min']:.1f}-{c['max']:.1f}] "
              f"| {b['median']:.1f} ms [{b['min']:.1f}-{b['max']:.1f}] "
              f"| {t['rest_cpu_share']['median'] * 100:.1f} % of a core "
              f"| {t['idle_share']['median'] * 100:.0f} % |")  # fmt: skip
    print("\nThe workers' CPU per step by thread (medians, ms, all workers):\n")
    print("| system | " + " | ".join(THREAD_KINDS) + " |")
    print("|---|" + "---:|" * len(THREAD_KINDS))
    for label, t in table.items():
        cells = [f"{t[f'threads_{kind}_cpu_ms_per_step']['median']:.2f}" for kind in THREAD_KINDS]
        print(f"| {label} | " + " | ".join(cells) + " |")
    rollcall, torchrun = table["rollcall"], table["torchrun"]
    ratio = rollcall["samples_per_s"]["median"] / torchrun["samples_per_s"]["median"]
    print(f"\nrollcall / torchrun samples/s (medians): {ratio:.3f}")
    parameters = {
        "rounds": args.rounds,
        "window_s": args.window,
        "workers": peers.WORKERS,
        "global_batch": peers.GLOBAL_BATCH,
        "micro_batch": peers.MICRO_BATCH,
        "checkpoint_every_steps": peers.CKPT_EVERY,
        "before": str(args.before) if args.before else None,
        "rollcall_set": list(settings),
    }
    peers.write_results(
        args.json, parameters, rounds=rows, summary=table, rollcall_over_torchrun=ratio,
        wall_s=time.monotonic() - started,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
