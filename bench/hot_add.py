"""The hot-add stall, side by side: the job of ``bench/peers.py`` (the
example LM, global batch 32 in microbatches of 8, one torch thread per
worker) at 2 workers, to which a third is added, several times per round.

    .venv/bin/python bench/hot_add.py [--rounds 3] [--adds 4] [--together K]
        [--before DIR] [--torchft] [--worker-args ARGS]
        [--rollcall-set NAME=VALUE ...] [--json FILE]

Each round starts every system afresh with 2 workers, waits until they are
steady, then ``--adds`` times: starts a third worker and measures, as
``peers.hot_add`` does, the stall of the two already there (the largest gap
between their consecutive steps from the start of the new worker until 1 s
after its first full-size step, minus their median step interval before)
and the new worker's start to first step; then kills it and waits until the
two are steady again. The systems alternate their order from round to
round; the table gives medians and ranges over every add.

``--together K`` starts K workers at each add instead of one (a burst, as
an operator scaling a compose service up by K makes): their joins come
as their processes finish starting, often less than
``rollcall_step_end_wait`` apart. The stall is then measured from the
first one's start until 1 s after the last one's first full-size step.
For rollcall the table also counts the steps in flight that the ones
already there aborted during the adds (their "finished before it was
aborted" lines: a step whose microbatches were all still to run leaves
none, so this is a floor), each a step's work thrown away.

``--before DIR`` adds rollcall as checked out in DIR (a ``git worktree`` of
an earlier commit; its workers import its own code), for the A/B of a
change. ``--torchft`` adds TorchFT (``pip install torchft==0.2.0``).
``--worker-args`` appends arguments to every rollcall worker's command
line (both checkouts), e.g. ``"--overlap --d-model 512 --layers 8"`` for a
25 M-parameter model whose state takes longer to fetch, and
``--rollcall-set NAME=VALUE`` (repeatable) gives both checkouts' replica
and workers a config override (before 2026-12-04 that model needed
``rollcall_deadline=5``: its members' answers to a roll call took longer
than the default 1 s);
neither with ``--torchft``, whose job would then be another one.
Results: ``results/hot_add.json``.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import peers  # noqa: E402

RESULTS = ROOT / "bench" / "results"
#: Workers before each add.
BASE = 2
TIMEOUT = 120.0


class _WithArgs(peers.Rollcall):
    """rollcall's workers with arguments of their own (here, not in
    peers.py: an earlier checkout's peers.py runs it too)."""

    worker_args: tuple[str, ...] = ()

    def argv(self, index: int) -> tuple[list[str], dict[str, str]]:
        command, env = super().argv(index)
        return [*command, *self.worker_args], env


def hot_add_together(system: peers.System, count: int, timeout: float) -> dict[str, Any]:
    """``peers.hot_add`` (the same for ``count`` 1) for ``count`` workers
    started at once (here, not in peers.py: an earlier checkout's peers.py
    runs it too): the largest gap of the workers already there from the
    first start until 1 s after the last joiner's first full-size step,
    minus their median step interval before; the steps in flight they
    aborted meanwhile (rollcall's log)."""
    existing = system.live()
    world = len(existing) + count
    time.sleep(1.0)  # a baseline of step intervals
    aborted_before = sum(_aborted_steps(system, w) for w in existing)
    joiners = [system.spawn() for _ in range(count)]
    t_start = joiners[0].started

    def last_first() -> float | None:
        firsts = [
            next((t for t, _, w in system.tracker.of(j.key) if w == world), None) for j in joiners
        ]
        return None if None in firsts else max(firsts)  # type: ignore[type-var]

    t_first = peers.wait_until(last_first, timeout, "every joiner's first full-size step")
    peers.wait_until(lambda: time.time() > t_first + 1.0 and all(
        sum(1 for t, _, w in system.tracker.of(x.key) if t > t_first and w == world) >= 3
        for x in existing), timeout, "steps after the joins")  # fmt: skip
    stalls = []
    for w in existing:
        times = [t for t, _, _ in system.tracker.of(w.key)]
        base = [b - a for a, b in peers.intervals(times) if b < t_start][-20:]
        around = [b - a for a, b in peers.intervals(times) if b > t_start and a < t_first + 1.0]
        if base and around:
            stalls.append(max(around) - statistics.median(base))
    if not stalls:
        raise peers.ScenarioFailed("no step intervals around the joins")
    return {
        "stall_s": max(stalls),
        "join_to_first_step_s": t_first - t_start,
        "aborted_steps": sum(_aborted_steps(system, w) for w in existing) - aborted_before,
    }


def _aborted_steps(system: peers.System, worker: peers.Worker) -> int:
    """Steps in flight ``worker`` aborted with some microbatches done (its log)."""
    try:
        text = (system.tmp / f"{worker.key}.log").read_text(errors="replace")
    except OSError:
        return 0
    return text.count("finished before it was aborted")


def measure_once(
    name: str, adds: str, settings: str = "", together: str = "1", *worker_args: str
) -> list[dict[str, Any]]:
    """One fresh system of ``name`` at ``BASE`` workers, ``adds`` hot-adds
    of ``together`` workers each; ``settings`` (";"-separated NAME=VALUE)
    given to rollcall's replica and workers, ``worker_args`` appended to
    each worker's command line."""
    kind = _WithArgs if settings or worker_args else peers.SYSTEMS[name]
    system = kind(Path(tempfile.mkdtemp(prefix=f"hot-add-{name}-")))
    if isinstance(system, _WithArgs):
        assert name == "rollcall", name
        system.settings = tuple(setting for setting in settings.split(";") if setting)
        system.worker_args = worker_args
    system.start()
    out = []
    try:
        for _ in range(BASE):
            system.spawn()
        peers.wait_steady(system, BASE, 10, time.time(), 180)
        for _ in range(int(adds)):
            out.append(hot_add_together(system, int(together), TIMEOUT))
            for added in system.workers[-int(together):]:
                system.kill(added)
            peers.wait_steady(system, BASE, 5, time.time(), TIMEOUT)
    finally:
        system.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds (1..20)")
    parser.add_argument("--adds", type=int, default=4, help="hot-adds per round (1..20)")
    parser.add_argument("--together", type=int, default=1,
                        help="workers started at once at each add (1..4)")  # fmt: skip
    parser.add_argument("--before", type=Path, default=None,
                        help="an earlier rollcall checkout, another system")  # fmt: skip
    parser.add_argument("--torchft", action="store_true", help="TorchFT too")
    parser.add_argument("--worker-args", default="",
                        help="appended to every rollcall worker's command line")  # fmt: skip
    parser.add_argument("--rollcall-set", action="append", default=[], metavar="NAME=VALUE",
                        help="a config override for rollcall's replica and workers "
                             "(repeatable)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=RESULTS / "hot_add.json")
    args = parser.parse_args()
    worker_args = shlex.split(args.worker_args)
    peers.settings_argument(parser, args.rollcall_set)
    if (worker_args or args.rollcall_set) and args.torchft:
        parser.error("--worker-args and --rollcall-set change rollcall's job only: not with "
                     "--torchft")  # fmt: skip
    if not 1 <= args.rounds <= 20:
        parser.error("--rounds must be 1..20")
    if not 1 <= args.adds <= 20:
        parser.error("--adds must be 1..20")
    if not 1 <= args.together <= 4:
        parser.error("--together must be 1..4")
    peers.checkout_argument(parser, args.before)
    if args.torchft and not (peers.VENV_BIN / "torchft_lighthouse").exists():
        parser.error("--torchft: torchft is not installed: .venv/bin/pip install -e '.[bench]'")

    # (label, system name, the checkout it runs from (None: this one))
    runs: list[tuple[str, str, Path | None]] = [("rollcall", "rollcall", None)]
    if args.before is not None:
        runs.insert(0, ("rollcall before", "rollcall", args.before.resolve()))
    if args.torchft:
        runs.append(("torchft", "torchft", None))
    started = time.monotonic()
    rows: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in runs}
    for round_ in range(args.rounds):
        for label, name, directory in runs if round_ % 2 == 0 else reversed(runs):
            extra = [";".join(args.rollcall_set), str(args.together), *worker_args] if (
                name == "rollcall"
            ) else ["", str(args.together)]  # fmt: skip
            results = peers.measured_in(directory, Path(__file__), measure_once, name,
                                        str(args.adds), *extra)  # fmt: skip
            rows[label].extend(results)
            stalls = ", ".join(f"{r['stall_s']:.3f}" for r in results)
            print(f"round {round_ + 1}/{args.rounds} {label:16s} stalls {stalls} s", flush=True)

    keys = ("stall_s", "join_to_first_step_s")
    table = {
        label: {key: peers.spread_of([r[key] for r in results]) for key in keys}
        for label, results in rows.items()
    }
    aborted = {
        label: sum(r.get("aborted_steps", 0) for r in results) for label, results in rows.items()
    }
    print()
    print("| system | hot-add stall of the others | new worker's start to first step "
          "| others' aborted steps, all adds |")  # fmt: skip
    print("|---|---:|---:|---:|")
    for label, t in table.items():
        s, j = t["stall_s"], t["join_to_first_step_s"]
        counted = aborted[label] if label != "torchft" else "-"
        print(f"| {label} | {s['median']:.3f} s [{s['min']:.3f}-{s['max']:.3f}] "
              f"| {j['median']:.2f} s [{j['min']:.2f}-{j['max']:.2f}] | {counted} |")  # fmt: skip
    parameters = {
        "rounds": args.rounds,
        "adds_per_round": args.adds,
        "workers_per_add": args.together,
        "workers_before_each_add": BASE,
        "global_batch": peers.GLOBAL_BATCH,
        "micro_batch": peers.MICRO_BATCH,
        "before": str(args.before) if args.before else None,
        "worker_args": worker_args,
        "rollcall_set": args.rollcall_set,
    }
    peers.write_results(args.json, parameters, adds=rows, summary=table,
                        wall_s=time.monotonic() - started)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
