"""Seeded chaos soak: every fault of the design's taxonomy, one after another,
on a cluster of hosts in network namespaces, with the invariants checked
after every fault.

    sudo .venv/bin/python bench/soak.py --duration 600 --seed 1 --json bench/results/soak.json

The cluster (``tests/netns.py``): 3 etcd members, 2 rendezvous replicas and
``--workers`` training workers (``rollcall worker``, the example LM), each on
a host of its own. ``random.Random(seed)`` draws each fault's kind and the
calm after it, so a seed replays the same schedule of faults (their timing
follows the machine); a second stream from the seed draws the victims among
the workers in the job at that moment. One fault at a time; after each one the harness restores what
the fault took away (heals the network, restarts etcd members and replicas,
starts replacement workers on new hosts) until the job trains at full size
again, then checks the invariants of the whole run so far
(``tests.netns.check_invariants``: one view per epoch, nobody commits after
leaving, digests agree, the ledgers hold exactly the samples of an
uninterrupted run, stalls bounded). New violations are charged to the fault
just injected; a fault whose expected outcome does not happen in time (the
survivors do not move on, an evicted worker does not exit 3, the job does
not recover) is a violation too.

The stall of a fault is the longest time with no step committed by any
worker from its injection until the job trains at full size again (joins of
replacements included), so even a fault that needs no view change shows the
step time. For ``quorum_loss`` it includes the deliberate outage.

Prints the fault matrix (kind x count x max / median stall x violations)
and writes the same to ``--json`` with a top-level ``violations`` total and
``faults`` per kind. Exit status 1 if any violation. Needs root (network
namespaces, nftables, cgroups): ``scripts/setup`` installs the tools.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.peers import git_commit  # noqa: E402
from rollcall.worker.faults import ENV as FAULTS_ENV  # noqa: E402
from tests.netns import (  # noqa: E402
    SLOW_ABOVE,
    SLOW_BELOW,
    Cluster,
    Worker,
    check_invariants,
    commit_gaps,
    example_plan,
    freeze,
    kill,
    thaw,
)

#: Longest wait for any expected outcome (survivors move on, an evicted
#: worker exits, a replacement joins): generous for 2 loaded cores.
PATIENCE = 60.0
#: How long a fault that should change nothing is held.
HOLD = 4.0

KINDS = (
    "crash",
    "machine_lost",
    "partition",
    "freeze",
    "slow_below",
    "slow_above",
    "leader_kill",
    "etcd_kill",
    "quorum_loss",
    "etcd_stall",
    "corrupt_chunk",
)
#: An etcd stall (every member SIGSTOPped: a fsync stall of the whole
#: cluster) lasts a seeded draw from this range, in seconds: longer than
#: every lease of the cluster's settings at its upper end.
ETCD_STALL = (5.0, 30.0)
#: The most faults ``--min-episodes`` may ask for: a loop bounded in count.
MAX_MIN_EPISODES = 50
#: A worker's log line when it serves a corrupted state range
#: (rollcall.worker.faults), and the lines of a fetch that caught one.
CORRUPTED = "fault injection: corrupting"
DETECTED = ("corrupt state from", "fails its digest")


def _detections(worker: Worker) -> int:
    """How many times ``worker``'s log says a fetch caught a corrupt range."""
    log = worker.log_tail(100_000)
    return sum(log.count(line) for line in DETECTED)


class Unexpected(Exception):
    """A fault's expected outcome did not happen."""


@dataclass
class Episode:
    number: int
    kind: str
    detail: str = ""
    started: float = 0.0
    recovered: float = 0.0
    stall: float | None = None
    #: (start, end) of the longest commit gap in the episode.
    gap: tuple[float, float] | None = None
    violations: list[str] = field(default_factory=list)
    #: Workers evicted though no fault was aimed at them (host names).
    false_evictions: list[str] = field(default_factory=list)

    def to_dict(self, origin: float) -> dict[str, Any]:
        return {
            "number": self.number,
            "kind": self.kind,
            "detail": self.detail,
            "at_s": round(self.started - origin, 3),
            "recovery_s": round(self.recovered - self.started, 3),
            "stall_s": None if self.stall is None else round(self.stall, 3),
            "stall_from_s": None if self.gap is None else round(self.gap[0] - origin, 3),
            "violations": self.violations,
            "false_evictions": self.false_evictions,
        }


class Soak:
    def __init__(
        self, cluster: Cluster, rng: random.Random, workers: int, plan: Any,
        stall_range: tuple[float, float] = ETCD_STALL,
    ) -> None:  # fmt: skip
        self.cluster = cluster
        self.rng = rng
        self.size = workers
        self.plan = plan
        self.stall_range = stall_range
        #: The workers expected in the current view.
        self.team: list[Worker] = []
        self.seen_violations: set[str] = set()
        #: The episode in progress.
        self.current: Episode | None = None

    # --- helpers ------------------------------------------------------------------
    def epoch(self) -> int:
        return max(e["epoch"] for w in self.team for e in w.steps())

    def last_step(self) -> int:
        return max(e["step"] for w in self.team for e in w.steps())

    def wait_all(self, accept: Callable[[dict[str, Any], int], bool]) -> None:
        """Until every worker of the team committed a step for which
        ``accept(step event, team size)`` holds. A member that exits 3
        (evicted though no fault was aimed at it: a false eviction) is taken
        out of the team and counted, and the others must then satisfy
        ``accept`` with the smaller team."""
        deadline = time.monotonic() + PATIENCE
        pending = list(self.team)
        while pending:
            for worker in list(pending):
                if any(accept(e, len(self.team)) for e in worker.steps()):
                    pending.remove(worker)
                elif worker.proc.poll() is not None:
                    if worker.proc.returncode != 3:
                        raise Unexpected(f"{worker} exited {worker.proc.returncode}")
                    self.false_eviction(worker)
                    pending = list(self.team)
                    break
            if pending and time.monotonic() > deadline:
                raise Unexpected(f"{pending} did not commit as expected within {PATIENCE} s")
            time.sleep(0.05)

    def false_eviction(self, worker: Worker) -> None:
        epochs = [e["epoch"] for e in worker.steps()]
        self.cluster.mark_left(worker, max(epochs, default=0))
        self.team.remove(worker)
        assert self.current is not None
        self.current.false_evictions.append(worker.host.name)
        print(f"           (false eviction of {worker}: {worker.log_tail(1)})", flush=True)

    def leave(self, victims: list[Worker], epoch: int) -> list[Worker]:
        """Mark ``victims`` as leaving after ``epoch``; the others must commit
        in a newer view of just themselves. Returns the others."""
        for victim in victims:
            self.cluster.mark_left(victim, epoch)
        self.team = [w for w in self.team if w not in victims]
        self.wait_all(lambda e, world: e["epoch"] > epoch and e["world"] == world)
        return self.team

    def expect_exit_3(self, workers: list[Worker]) -> None:
        for worker in workers:
            try:
                code = worker.proc.wait(timeout=PATIENCE)
            except Exception:  # noqa: BLE001 - a timeout is the violation
                kill(worker)
                raise Unexpected(f"{worker} did not exit after its eviction") from None
            if code != 3:
                raise Unexpected(f"{worker} exited {code}, not 3 (evicted)")

    def replenish(
        self, env: dict[str, str] | None = None, settings: Sequence[str] = ()
    ) -> list[Worker]:
        """Start workers (``env`` added to their environment, ``settings`` to
        their config) until the team is full again; wait until all of them
        commit in a view of the full team."""
        missing = self.size - len(self.team)
        if missing <= 0:
            return []
        epoch = self.epoch() if self.team else 0
        started = self.cluster.start_workers(missing, env=env, settings=settings)
        self.team += started
        self.wait_all(lambda e, world: e["epoch"] > epoch and e["world"] == world)
        return [w for w in started if w in self.team]

    def victim(self) -> Worker:
        return self.rng.choice(self.team)

    # --- faults -------------------------------------------------------------------
    def crash(self, episode: Episode) -> None:
        victim = self.victim()
        episode.detail = victim.host.name
        epoch = self.epoch()
        kill(victim)
        self.leave([victim], epoch)

    def machine_lost(self, episode: Episode) -> None:
        victim = self.victim()
        episode.detail = victim.host.name
        epoch = self.epoch()
        self.cluster.network.isolate(victim.host)
        try:
            self.leave([victim], epoch)
        finally:
            self.cluster.network.heal()
        self.expect_exit_3([victim])

    def partition(self, episode: Episode) -> None:
        cut = self.rng.sample(self.team, len(self.team) // 2)
        episode.detail = " ".join(w.host.name for w in cut)
        epoch = self.epoch()
        cut_hosts = [w.host for w in cut]
        others = [h for h in self.cluster.network.hosts.values() if h not in cut_hosts]
        self.cluster.network.partition(cut_hosts, others)
        try:
            self.leave(cut, epoch)
            time.sleep(HOLD)  # the cut-off side must not commit meanwhile
        finally:
            self.cluster.network.heal()
        self.expect_exit_3(cut)

    def freeze(self, episode: Episode) -> None:
        victim = self.victim()
        episode.detail = victim.host.name
        epoch = self.epoch()
        freeze(victim)
        try:
            self.leave([victim], epoch)
        finally:
            thaw(victim)
        self.expect_exit_3([victim])

    def slow_below(self, episode: Episode) -> None:
        victim = self.victim()
        episode.detail = f"{victim.host.name} {SLOW_BELOW}"
        epoch, step = self.epoch(), self.last_step()
        victim.host.throttle(*SLOW_BELOW)
        try:
            time.sleep(HOLD)
        finally:
            victim.host.unthrottle()
        self.wait_all(lambda e, world: e["step"] > step)
        if self.epoch() != epoch and not episode.false_evictions:
            raise Unexpected(f"a worker slowed below the threshold changed the view ({epoch})")

    def slow_above(self, episode: Episode) -> None:
        victim = self.victim()
        episode.detail = f"{victim.host.name} {SLOW_ABOVE}"
        epoch = self.epoch()
        victim.host.throttle(*SLOW_ABOVE)
        try:
            self.leave([victim], epoch)
        finally:
            victim.host.unthrottle()
        self.expect_exit_3([victim])

    def leader_kill(self, episode: Episode) -> None:
        leader = self.cluster.rendezvous_leader()
        episode.detail = leader.host.name
        kill(leader)
        successor = self.cluster.rendezvous_leader()
        if successor is leader:
            raise Unexpected("the killed replica still leads")
        step = self.last_step()  # committed with the successor leading
        self.wait_all(lambda e, world: e["step"] > step and e["world"] == world)
        self.cluster.restart_replica(leader).wait_ready()

    def etcd_kill(self, episode: Episode) -> None:
        member = self.cluster.etcd_leader()
        episode.detail = member.host.name
        step = self.last_step()
        member.kill()
        try:
            time.sleep(HOLD)
            self.wait_all(lambda e, world: e["step"] > step)
        finally:
            self.cluster.restart_etcd(member)
        self.cluster.wait_etcd_healthy(member)

    def quorum_loss(self, episode: Episode) -> None:
        members = self.rng.sample(self.cluster.etcd, 2)
        episode.detail = " ".join(m.host.name for m in members)
        epoch = self.epoch()
        self.cluster.outage_begins(f"kill {episode.detail}")
        for member in members:
            member.kill()
        try:
            time.sleep(HOLD)
            if self.epoch() != epoch:
                raise Unexpected("a view was committed while etcd had no quorum")
        finally:
            for member in members:
                self.cluster.restart_etcd(member)
            self.cluster.outage_ends(f"restart {episode.detail}")
        for member in members:
            self.cluster.wait_etcd_healthy(member)
        step = self.last_step()
        self.wait_all(lambda e, world: e["step"] > step)

    def etcd_stall(self, episode: Episode) -> None:
        """Every etcd member frozen for a seeded draw from ``stall_range``
        (5-30 s by default): training goes on
        throughout in the same view, and nobody is evicted afterwards (a
        worker exiting 3 is a false eviction, counted by ``wait_all``)."""
        seconds = self.rng.uniform(*self.stall_range)
        episode.detail = f"{seconds:.1f} s"
        epoch, step = self.epoch(), self.last_step()
        processes = [m.process for m in self.cluster.etcd if m.process is not None]
        self.cluster.outage_begins(f"freeze etcd {episode.detail}")
        for process in processes:
            freeze(process)
        try:
            time.sleep(seconds / 2)
            self.wait_all(lambda e, world: e["step"] > step)  # training goes on
            time.sleep(max(0.0, seconds / 2))
        finally:
            for process in processes:
                thaw(process)
            self.cluster.outage_ends(f"thaw etcd after {episode.detail}")
        step = self.last_step()
        time.sleep(HOLD)  # long enough for an eviction that stale leases would cause
        self.wait_all(lambda e, world: e["step"] > step and e["world"] == world)
        if self.epoch() > epoch + 1:
            raise Unexpected(f"the etcd stall changed the view more than once ({epoch})")

    def corrupt_chunk(self, episode: Episode) -> None:
        # A peer that corrupts the next few state ranges it serves joins and
        # takes the place of a crashed member; whatever it serves next (to
        # the joiner that replaces another crashed member, or to a member
        # behind) must be caught and fetched again elsewhere. The joiner
        # takes the state in pieces striped over every source
        # (transfer_whole_bytes=1): a state small enough to come whole comes
        # from the senior source, never from the newer corrupter.
        epoch = self.epoch()
        outgoing = self.victim()
        kill(outgoing)
        self.leave([outgoing], epoch)
        corrupters = self.replenish(env={FAULTS_ENV: "corrupt_serves=3"})
        if not corrupters:
            raise Unexpected("the corrupting worker was evicted before it served")
        corrupter = corrupters[0]
        epoch = self.epoch()
        victim = self.rng.choice([w for w in self.team if w is not corrupter])
        earlier = {w: _detections(w) for w in self.team}
        kill(victim)
        self.leave([victim], epoch)
        joiners = self.replenish(settings=("transfer_whole_bytes=1",))
        served = corrupter.log_tail(100_000).count(CORRUPTED)
        caught = sum(_detections(w) - earlier.get(w, 0) for w in {*self.team, victim})
        episode.detail = (
            f"{corrupter.host.name} corrupts ({served} served); {victim.host.name} crashes"
        )
        if served and not caught:
            raise Unexpected(
                f"{corrupter.host.name} served {served} corrupt ranges and nobody caught one "
                f"(joiners {joiners})"
            )

    # --- the run ------------------------------------------------------------------
    def episode(self, number: int, kind: str) -> Episode:
        episode = self.current = Episode(number, kind)
        episode.started = self.cluster.note(f"fault {number}: {kind}")
        try:
            getattr(self, kind)(episode)
            self.replenish()
        except Unexpected as exc:
            episode.violations.append(f"{kind}: {exc}")
        except Exception as exc:  # noqa: BLE001 - the harness itself failed: say so
            episode.violations.append(f"{kind}: harness error {exc!r}")
            traceback.print_exc()
        episode.recovered = time.monotonic()
        gaps = [
            (start, end)
            for start, end in commit_gaps(self.cluster)
            if end > episode.started and start < episode.recovered
        ]
        if gaps:
            episode.gap = max(gaps, key=lambda gap: gap[1] - gap[0])
            episode.stall = episode.gap[1] - episode.gap[0]
        found = set(check_invariants(self.cluster, self.plan))
        episode.violations += sorted(found - self.seen_violations)
        self.seen_violations |= found
        return episode


def matrix(episodes: list[Episode]) -> dict[str, dict[str, Any]]:
    faults: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        mine = [e for e in episodes if e.kind == kind]
        stalls = [e.stall for e in mine if e.stall is not None]
        faults[kind] = {
            "count": len(mine),
            "stall_max_s": round(max(stalls), 3) if stalls else None,
            "stall_median_s": round(statistics.median(stalls), 3) if stalls else None,
            "violations": sum(len(e.violations) for e in mine),
            "false_evictions": sum(len(e.false_evictions) for e in mine),
        }
    return faults


def print_matrix(faults: dict[str, dict[str, Any]], total: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fault matrix ({total} violations)")
    columns = ("fault", "count", "max stall s", "median stall s", "violations", "false evictions")
    for column in columns:
        table.add_column(column, justify="left" if column == "fault" else "right")
    for kind, row in faults.items():
        table.add_row(
            kind,
            str(row["count"]),
            "-" if row["stall_max_s"] is None else f"{row['stall_max_s']:.2f}",
            "-" if row["stall_median_s"] is None else f"{row['stall_median_s']:.2f}",
            str(row["violations"]),
            str(row["false_evictions"]),
        )
    Console(width=100).print(table)


def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = example_plan()
    # Two streams: the schedule (kinds, pauses) replays exactly for a seed;
    # victims are drawn from whoever is in the team, which may differ.
    schedule = random.Random(args.seed)
    victims = random.Random(f"{args.seed}/victims")
    kinds = args.kinds.split(",") if args.kinds else list(KINDS)
    episodes: list[Episode] = []
    workdir = Path(tempfile.mkdtemp(prefix="rollcall-soak-"))
    started_wall = datetime.now(UTC).isoformat(timespec="seconds")
    with Cluster(workdir, etcd_members=3, replicas=2, job="soak") as cluster:
        soak = Soak(cluster, victims, args.workers, plan, tuple(args.etcd_stall))
        soak.replenish()
        origin = time.monotonic()
        print(f"soak: {args.workers} workers trained; faults for {args.duration:.0f} s "
              f"(seed {args.seed}, logs in {workdir})", flush=True)  # fmt: skip
        number = 0
        # The schedule's first --min-episodes faults run whatever the
        # machine's speed (a loaded machine fits fewer into the duration).
        while time.monotonic() - origin < args.duration or number < args.min_episodes:
            number += 1
            kind = schedule.choice(kinds)
            episode = soak.episode(number, kind)
            episodes.append(episode)
            stall = "-" if episode.stall is None else f"{episode.stall:.2f} s"
            print(f"{time.monotonic() - origin:7.1f} s  #{number:<3} {kind:<13} "
                  f"{episode.detail:<28} stall {stall:>8}  violations {len(episode.violations)}",
                  flush=True)  # fmt: skip
            for violation in episode.violations:
                print(f"           ! {violation}", flush=True)
            time.sleep(schedule.uniform(0.5, args.gap))
        elapsed = time.monotonic() - origin
        steps = soak.last_step()
        cluster.stop_workers()
    left = cluster.leftovers()
    faults = matrix(episodes)
    total = sum(len(e.violations) for e in episodes) + len(left)
    return {
        "benchmark": "soak",
        "started": started_wall,
        "commit": git_commit(),
        "seed": args.seed,
        "duration_s": args.duration,
        "elapsed_s": round(elapsed, 1),
        "workers": args.workers,
        "steps_committed": steps + 1,
        "violations": total,
        "left_behind": left,
        "faults": faults,
        "episodes": [e.to_dict(origin) for e in episodes],
        "timeline": [(round(at - origin, 3), what) for at, what in cluster.timeline],
        "load_average": os.getloadavg(),
        "logs": str(workdir),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--duration",
        type=float,
        required=True,
        help="seconds of faults (the fault in progress then finishes)",
    )
    parser.add_argument("--seed", type=int, default=0, help="schedule seed (default 0)")
    parser.add_argument(
        "--min-episodes", type=int, default=0,
        help="run at least this many faults of the schedule even past the duration "
        f"(at most {MAX_MIN_EPISODES}; default 0)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--workers", type=int, default=4, help="training workers (default 4)")
    parser.add_argument(
        "--gap",
        type=float,
        default=3.0,
        help="up to this many seconds of calm between faults (default 3)",
    )
    parser.add_argument("--kinds", help=f"comma-separated subset of: {','.join(KINDS)}")
    parser.add_argument(
        "--etcd-stall",
        type=float,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=ETCD_STALL,
        help="an etcd stall freezes etcd for a draw from MIN-MAX seconds (default 5 30)",
    )
    args = parser.parse_args()  # fmt: skip
    if args.duration <= 0 or args.workers < 2 or args.gap < 0.5:
        parser.error("--duration must be positive, --workers at least 2, --gap at least 0.5")
    if not 0 <= args.min_episodes <= MAX_MIN_EPISODES:
        parser.error(f"--min-episodes must be within 0-{MAX_MIN_EPISODES}")
    if not 0 < args.etcd_stall[0] <= args.etcd_stall[1] <= 600:
        parser.error("--etcd-stall needs 0 < MIN <= MAX <= 600 seconds")
    if args.kinds and not set(args.kinds.split(",")) <= set(KINDS):
        parser.error(f"--kinds must name faults among {','.join(KINDS)}")
    result = run(args)
    print_matrix(result["faults"], result["violations"])
    if result["left_behind"]:
        print(f"left behind: {result['left_behind']}")
    print(f"{result['steps_committed']} steps in {result['elapsed_s']} s; logs: {result['logs']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
