"""The failure detector's timeout trade-off, measured: detection stall, false
evictions and goodput lost, for fixed timeouts and for the adaptive detector.

    .venv/bin/python bench/detector_sweep.py [--quick] [--thresholds 0.3,0.5,...]
        [--duration 60] [--seed 1] [--json FILE]

Every detector setting gets a fresh cluster on loopback: one embedded etcd
(shared by all settings, one job name each), one `rollcall rendezvous`
process and WORKERS (4) `rollcall worker --json` processes of the example LM
(global batch 32, micro batch 8, one torch thread each, a durable checkpoint
every 20 steps as in bench/peers.py), all started with the same `--set`
overrides:

- fixed timeout T: `phi_threshold=1e300` (phi never gets there: it is capped
  near 4e299, see membership/detector.py) and `max_silence=T`, so a member is
  suspected exactly T s after its last heartbeat; the workers' `fence_window`
  becomes min(0.5, 0.6 T), since it must stay below the earliest suspicion;
- adaptive: the defaults (phi threshold 8, phi_min_std 0.25, max_silence 2 s:
  suspicion ~1.5 s after the last heartbeat when heartbeats are regular,
  later when they jitter; runs before the default changed used 0.1, ~0.66 s;
  the JSON's `parameters.adaptive_config` says which).

Phases, per setting: start the workers and wait until each has committed
3 steps at full size; a quiet warm-up (no faults) gives the steady-state rate;
then DURATION seconds of faults, all from one schedule drawn from --seed and
replayed identically for every setting (times relative to the start of the
phase; the worker slot a fault hits is fixed too, the process in it changes):

- pauses of healthy workers: SIGSTOP, SIGCONT after a lognormal duration
  (median --pause-median, shape --pause-sigma, capped at --pause-max), at a
  Poisson rate of one per --pause-every seconds per worker. The default
  (median 0.3 s, sigma 1.2, one per 8 s per worker) stands for GC, swap, I/O
  and scheduler stalls: most are short, the tail is long. Half are over
  0.3 s, a quarter over 0.66 s, 16 % over 1 s, 6 %
  over 2 s, 3 % over 3 s (then capped at 8 s);
- real failures at a Poisson rate of one per --kill-every seconds, alternating
  (--kill-mode) between
  * "sigkill": SIGKILL. On loopback the kernel closes the dead process's
    sockets at once, so its session stream breaks and the leader suspects it
    without waiting for any timeout;
  * "silent": SIGSTOP, then SIGKILL once the others commit without it. This is
    a machine that dies or drops off the network without closing its
    connections (power loss, kernel panic, partition): only the detector's
    timeout finds it.

A worker that is gone (killed, or exited by itself, e.g. with code 3 after a
pause got it evicted) is replaced by a new `rollcall worker` in its slot
--rejoin-after seconds after its eviction was seen (a supervisor's restart);
the replacement must join, fetch the state and enter a view, which costs the
others a view change too. A fault aimed at a slot whose worker is paused,
doomed or has not trained yet goes to the next slot that is ready (skipped if
none is).

After the fault phase no new faults come, gone workers are still replaced,
and the run ends when the job is whole again (WORKERS workers, each with
3 steps at full size since it started or was last paused; at most 60 s), so
that the faults near the end cost in full. Measured from the first fault to
that end (arrival times of the workers' step lines, the replica's log; "new
step" = a step number committed for the first time, so steps replayed after
a resume from a checkpoint do not count twice):

- goodput lost = 1 - samples committed / (warm-up samples/s x wall time);
- goodput lost, one device per worker (a model, not a measurement): as
  above, but a step committed by w < WORKERS workers counts as w / WORKERS
  of a step, as if each worker brought its own accelerator and a smaller
  view trained proportionally slower. Here on 2 cores 3 workers train about
  as fast as 4 (the global batch is fixed), so the measured figure does not
  charge a missing worker anything;
- stalled = the sum, over consecutive new steps, of the gap beyond the
  warm-up's median step interval;
- detection stall of a failure = fault -> the first step committed in a
  newer epoch than the one in force at the fault (the victim is frozen or
  dead, so no view with it can commit a step); detect = fault -> the
  replica's "suspect VICTIM" line;
- false evictions = workers that exited with code 3 (evicted) although
  nobody killed them: paused ones, by the detector (the replica logged
  "suspect ... heartbeat detector") or dropped from a roll call held during
  their pause (they could not answer within `rollcall_deadline`), and ones
  nobody paused either (heartbeats late because the machine is loaded);
- pause stall (pauses that did not end in an eviction) = the paused
  worker's own gap between its last step before the pause and its next one,
  beyond the warm-up's median step interval (the others wait for it in the
  all-reduce, so this is the job's stall too, unless more went on);
- faults applied: a fault finds no ready worker while the job is
  recovering (everyone paused, doomed or starting), and is skipped; a
  setting that keeps the job in turmoil therefore takes fewer faults.
- other CPU = cores kept busy by processes that are not this benchmark's
  (on a shared machine: other people's work), averaged over the setting;
- mean world = members of the view, time-weighted.

The settings run in a seeded random order, so that a drift of the machine's
load does not line up with the threshold. Every wait is bounded; everything
started is killed at the end, on Ctrl-C and on failure (children are
tethered: they die with this process).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peers import Child, Tracker, kill_tree, spread, versions  # noqa: E402
from bench.recovery import log_lines  # noqa: E402
from rollcall.etcd_local import LocalEtcd, free_port  # noqa: E402
from rollcall.membership.config import Config  # noqa: E402

WORKERS = 4
GLOBAL_BATCH = 32
MICRO_BATCH = 8
#: Durable checkpoints, as in bench/peers.py: if false evictions and a
#: failure leave no worker, the job resumes from one instead of step 0.
CKPT_EVERY = 20
DEFAULT_THRESHOLDS = (0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
#: Above phi's ceiling (about 4e299): with it phi never suspects anyone.
PHI_OFF = 1e300
#: A fixed-timeout worker's fence window, as a share of T (capped at the
#: default): it must stay below the earliest suspicion, which is T.
FENCE_SHARE = 0.6
#: Steps every worker commits at full size before the warm-up starts.
STEADY_STEPS = 3
#: A silently failed worker the others never commit without is SIGKILLed
#: after this long anyway (and its replacement started).
KILL_BOUND = 20.0
#: Restarts (replacements and re-starts after exits) allowed per setting.
MAX_SPAWNS = 60
START_TIMEOUT = 120.0
#: After the fault phase, wait at most this long for the job to be whole.
RECOVERY_TIMEOUT = 60.0
#: A paused worker dropped by a roll call learns it within this long of its
#: SIGCONT.
EVICTION_SEEN_WITHIN = 1.0
POLL = 0.01
#: Evicted workers exit with this code (`rollcall worker --help`).
EXIT_EVICTED = 3
KILL_KINDS = ("silent", "sigkill")
SUSPECT = re.compile(r"suspect (\S+): (.*)$")
SESSION_ENDED = re.compile(r"session of (\S+) ended: (.*)$")


class SweepFailed(Exception):
    """A setting could not be measured (start-up or a bound exceeded)."""


# ------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Detector:
    """One detector setting: the `--set` overrides of replica and workers."""

    name: str
    #: Fixed timeout T in seconds; None for the adaptive (default) detector.
    timeout: float | None
    overrides: tuple[tuple[str, float], ...]

    def set_args(self) -> list[str]:
        out: list[str] = []
        for name, value in self.overrides:
            out += ["--set", f"{name}={value!r}"]
        return out

    def config(self) -> Config:
        return Config().replace(**dict(self.overrides))


def fixed(timeout: float) -> Detector:
    fence = round(min(Config().fence_window, FENCE_SHARE * timeout), 3)
    overrides = (("phi_threshold", PHI_OFF), ("max_silence", timeout), ("fence_window", fence))
    return Detector(f"fixed {timeout:g} s", timeout, overrides)


ADAPTIVE = Detector("adaptive", None, ())


def adaptive_detector(overrides: list[str]) -> Detector:
    """The adaptive detector with ``NAME=VALUE`` overrides of its own
    settings (phi_threshold, phi_min_std, phi_window, max_silence)."""
    if not overrides:
        return ADAPTIVE
    pairs = []
    for item in overrides:
        name, sep, value = item.partition("=")
        if not sep or name not in ADAPTIVE_KNOBS:
            raise ValueError(f"{item!r} is not NAME=VALUE with NAME one of {ADAPTIVE_KNOBS}")
        pairs.append((name, type(getattr(Config(), name))(value)))
    detector = Detector(f"adaptive ({', '.join(overrides)})", None, tuple(pairs))
    detector.config()  # raises ValueError for an invalid combination
    return detector


ADAPTIVE_KNOBS = ("phi_threshold", "phi_min_std", "phi_window", "max_silence")


@dataclass(frozen=True)
class FaultModel:
    #: Mean seconds between pauses of one worker (Poisson).
    pause_every: float
    #: Pause length: lognormal with this median and shape, capped.
    pause_median: float
    pause_sigma: float
    pause_max: float
    #: Mean seconds between failures in the whole cluster (Poisson).
    kill_every: float
    #: "silent", "sigkill" or "alternate" (the two in turn, silent first).
    kill_mode: str
    #: A gone worker's replacement starts this long after its eviction.
    rejoin_after: float

    def pause_share_over(self, seconds: float) -> float:
        """P(pause > seconds), before the cap."""
        z = (math.log(seconds) - math.log(self.pause_median)) / self.pause_sigma
        return 0.5 * math.erfc(z / math.sqrt(2.0))


@dataclass(frozen=True)
class Fault:
    #: Seconds after the start of the fault phase.
    at: float
    #: "pause", "silent" or "sigkill".
    kind: str
    slot: int
    #: Pause length (0 for failures).
    seconds: float = 0.0


def schedule(model: FaultModel, duration: float, workers: int, seed: int) -> list[Fault]:
    """The fault schedule of every setting: the same for the same arguments."""
    pauses = random.Random(f"{seed}/pauses")
    faults = []
    t = pauses.expovariate(workers / model.pause_every)
    while t < duration:
        length = pauses.lognormvariate(math.log(model.pause_median), model.pause_sigma)
        slot = pauses.randrange(workers)
        faults.append(Fault(round(t, 3), "pause", slot, round(min(length, model.pause_max), 3)))
        t += pauses.expovariate(workers / model.pause_every)
    kills = random.Random(f"{seed}/kills")
    t = kills.expovariate(1.0 / model.kill_every)
    index = 0
    while t < duration:
        kind = model.kill_mode if model.kill_mode in KILL_KINDS else KILL_KINDS[index % 2]
        faults.append(Fault(round(t, 3), kind, kills.randrange(workers)))
        index += 1
        t += kills.expovariate(1.0 / model.kill_every)
    return sorted(faults, key=lambda f: f.at)


# -------------------------------------------------------------------- cluster


@dataclass
class Worker:
    key: str
    slot: int
    child: Child
    started: float
    member_id: str | None = None
    first_step: float | None = None
    #: Time its current pause ends (SIGCONT due), if paused.
    paused_until: float | None = None
    #: A silent failure was injected: SIGKILL once the others go on without it.
    doomed: bool = False
    #: Set when this benchmark killed it.
    killed: float | None = None
    #: Set when its exit was noticed (by itself: evicted, failed).
    exited: float | None = None

    def ready(self) -> bool:
        """Trains and may take a fault (reads its log: call it seldom)."""
        return (
            self.child.alive() and self.first_step is not None and self.paused_until is None
            and not self.doomed and self.killed is None and self.session_end() is None
        )  # fmt: skip

    def session_end(self) -> tuple[float, str] | None:
        """When and why its session ended, from its log (an evicted worker
        takes a second or two more to exit)."""
        for t, line in log_lines(self.child.log):
            m = SESSION_ENDED.search(line)
            if m and m[1] == self.member_id:
                return t, m[2]
        return None


class Steps(Tracker):
    """Every step line of every worker (bench/peers.py's tracker), with the
    queries the sweep needs."""

    def epoch_at(self, until: float) -> int:
        """Newest epoch a step was committed in at or before ``until``."""
        return max((e for t, _, _, _, e in self.snapshot() if t <= until), default=0)

    def new(self, after: float, before: float) -> list[tuple[float, int, int]]:
        """(first commit time, step, world) of each step above the progress at
        ``after`` first committed in (after, before], by time."""
        return self.first_commits(after, before, self.progress(after))

    def first_after(self, after: float, epoch_above: int) -> float | None:
        """First commit after ``after`` in an epoch above ``epoch_above``."""
        return min(
            (t for t, _, _, _, e in self.snapshot() if t > after and e > epoch_above),
            default=None,
        )

    def count(self, key: str, world: int, after: float = 0.0) -> int:
        """Steps ``key`` committed in a view of ``world`` members after ``after``."""
        return sum(1 for t, _, w in self.of(key) if w == world and t > after)


class Cluster:
    """One rendezvous replica and its workers for one detector setting."""

    def __init__(self, etcd: str, detector: Detector, job: str, tmp: Path) -> None:
        self.detector = detector
        self.job = job
        self.tmp = tmp
        self.steps = Steps()
        self.workers: list[Worker] = []
        self.spawned = 0
        self.token = tmp / "token"
        self.token.write_text(os.urandom(16).hex())
        self.address = f"127.0.0.1:{free_port()}"
        self.etcd = etcd
        self.replica: Child | None = None

    def start(self) -> None:
        self.replica = Child(
            [sys.executable, "-m", "rollcall.cli", "rendezvous", "--etcd", self.etcd,
             "--listen", self.address, "--job", self.job, "--token-file", str(self.token),
             "--log-level", "info", *self.detector.set_args()],
            self.tmp / "rendezvous.log", {}, lambda t, r: None,
        )  # fmt: skip
        replica = self.replica
        wait_until(lambda: any(x.startswith("rendezvous ready") for x in replica.lines)
                   or not replica.alive(), 60, "rendezvous start")  # fmt: skip
        if not replica.alive():
            raise SweepFailed(f"rendezvous exited (see {self.tmp / 'rendezvous.log'})")

    def spawn(self, slot: int) -> Worker:
        if self.spawned >= MAX_SPAWNS:
            raise SweepFailed(f"more than {MAX_SPAWNS} worker starts")
        key = f"w{self.spawned}-slot{slot}"
        self.spawned += 1
        holder: list[Worker] = []

        def on_record(t: float, record: dict[str, Any]) -> None:
            worker = holder[0]
            if record.get("event") == "joined":
                worker.member_id = record["member_id"]
            elif record.get("event") == "step":
                if worker.first_step is None:
                    worker.first_step = t
                self.steps.add(t, key, int(record["step"]), int(record["world"]),
                               int(record["epoch"]))  # fmt: skip

        argv = [
            sys.executable, "-m", "rollcall.cli", "worker", "--rendezvous", self.address,
            "--job", self.job, "--token-file", str(self.token), "--json",
            "--steps", "10000000", "--threads", "1", "--log-level", "info",
            "--global-batch", str(GLOBAL_BATCH), "--micro-batch", str(MICRO_BATCH),
            "--checkpoint-dir", str(self.tmp / "ckpt"), "--checkpoint-every", str(CKPT_EVERY),
            *self.detector.set_args(),
        ]  # fmt: skip
        worker = Worker(key, slot, Child(argv, self.tmp / f"{key}.log", {}, on_record), time.time())
        holder.append(worker)
        self.workers.append(worker)
        return worker

    def occupant(self, slot: int) -> Worker | None:
        """The newest worker started in ``slot``."""
        return next((w for w in reversed(self.workers) if w.slot == slot), None)

    def suspicions(self) -> list[tuple[float, str, str]]:
        """(time, member id, reason) of every "suspect" line of the replica."""
        out = []
        for t, line in log_lines(self.tmp / "rendezvous.log"):
            m = SUSPECT.search(line)
            if m:
                out.append((t, m[1], m[2]))
        return out

    def close(self) -> None:
        for w in self.workers:
            with contextlib.suppress(Exception):
                w.child.kill()
        if self.replica is not None:
            with contextlib.suppress(Exception):
                self.replica.kill()


# ------------------------------------------------------------------ the run


@dataclass
class PauseRecord:
    fault: int
    worker: str
    member_id: str | None
    stopped: float
    seconds: float
    resumed: float | None = None
    evicted: bool = False
    by: str | None = None


@dataclass
class FailureRecord:
    fault: int
    kind: str
    worker: str
    member_id: str | None
    at: float
    epoch: int
    #: The first step committed in a newer epoch (without the victim).
    recovered: float | None = None
    sigkilled: float | None = None
    #: Recovered, or given up on after KILL_BOUND; the victim is dead.
    settled: bool = False


@dataclass
class Run:
    """What happened during one setting's fault phase."""

    pauses: list[PauseRecord] = field(default_factory=list)
    failures: list[FailureRecord] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    #: (worker key, exit time, return code) of workers that exited by themselves.
    exits: list[tuple[str, float, int | None]] = field(default_factory=list)
    #: Pending replacements: (due time, slot).
    restarts: list[tuple[float, int]] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)


class Injector:
    """Applies the fault schedule to a cluster and keeps it at full size."""

    def __init__(self, cluster: Cluster, model: FaultModel) -> None:
        self.cluster = cluster
        self.model = model
        self.run = Run()

    def target(self, slot: int) -> Worker | None:
        for i in range(WORKERS):
            worker = self.cluster.occupant((slot + i) % WORKERS)
            if worker is not None and worker.ready():
                return worker
        return None

    def apply(self, index: int, fault: Fault, now: float) -> None:
        worker = self.target(fault.slot)
        if worker is None:
            self.run.skipped.append(index)
            return
        pid = worker.child.proc.pid
        if fault.kind == "pause":
            os.kill(pid, signal.SIGSTOP)
            worker.paused_until = now + fault.seconds
            self.run.pauses.append(
                PauseRecord(index, worker.key, worker.member_id, now, fault.seconds)
            )
            return
        epoch = self.cluster.steps.epoch_at(now)
        record = FailureRecord(index, fault.kind, worker.key, worker.member_id, now, epoch)
        self.run.failures.append(record)
        if fault.kind == "sigkill":
            worker.killed = now
            record.sigkilled = now
            kill_tree(worker.child.proc)
        else:
            os.kill(pid, signal.SIGSTOP)
            worker.doomed = True

    def tend(self, now: float, restart: bool) -> None:
        """Resume pauses that are over, finish silent failures the others
        went on without, notice exits, start due replacements."""
        cluster, run = self.cluster, self.run
        for worker in cluster.workers:
            if worker.paused_until is not None and now >= worker.paused_until:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.child.proc.pid, signal.SIGCONT)
                worker.paused_until = None
                for p in run.pauses:
                    if p.worker == worker.key and p.resumed is None:
                        p.resumed = now
        for record in run.failures:
            if record.settled:
                continue
            recovered = cluster.steps.first_after(record.at, record.epoch)
            if recovered is None and now < record.at + KILL_BOUND:
                continue
            record.recovered = recovered
            record.settled = True
            victim = next(w for w in cluster.workers if w.key == record.worker)
            if victim.killed is None:
                victim.killed = now
                record.sigkilled = now
                kill_tree(victim.child.proc)
            if restart:
                run.restarts.append((now + self.model.rejoin_after, victim.slot))
        for worker in cluster.workers:
            if worker.killed is None and worker.exited is None and not worker.child.alive():
                worker.exited = now
                run.exits.append((worker.key, now, worker.child.proc.returncode))
                if restart:
                    run.restarts.append((now + self.model.rejoin_after, worker.slot))
        for due, slot in [r for r in run.restarts if r[0] <= now]:
            run.restarts.remove((due, slot))
            run.replaced.append(cluster.spawn(slot).key)


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               tend: Callable[[], None] | None = None) -> Any:  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tend is not None:
            tend()
        value = predicate()
        if value:
            return value
        time.sleep(POLL)
    raise SweepFailed(f"{what}: not within {timeout:.0f} s")


@dataclass
class Phases:
    """Times and rates of one setting's phases."""

    started: float
    #: Warm-up: steady-state steps/s and median step interval.
    rate: float = 0.0
    step_interval: float = 0.0
    warmup_exits: list[tuple[str, float, int | None]] = field(default_factory=list)
    #: The fault phase, and the end of the recovery after it.
    t0: float = 0.0
    t1: float = 0.0
    end: float = 0.0
    whole: bool = False
    start_s: float = 0.0


def whole(cluster: Cluster, run: Run, since: float) -> bool:
    """WORKERS workers, none paused, doomed or about to be replaced, each
    with STEADY_STEPS steps at full size since ``since``, its start and the
    end of the last pause."""
    live = [w for w in cluster.workers if w.child.alive() and w.killed is None]
    if len(live) != WORKERS or run.restarts or any(w.paused_until or w.doomed for w in live):
        return False
    since = max([since, *(w.started for w in live), *(p.resumed or 0.0 for p in run.pauses)])
    return all(cluster.steps.count(w.key, WORKERS, since) >= STEADY_STEPS for w in live)


def cpu_seconds(etcd_pid: int | None) -> tuple[float, float]:
    """(CPU seconds the whole machine has been busy, hypervisor steal
    included; CPU seconds of this process, its reaped children and the
    shared etcd)."""
    tick = os.sysconf("SC_CLK_TCK")
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    busy = (user + nice + system + irq + softirq + steal) / tick
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    if etcd_pid is not None:
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{etcd_pid}/stat").read_text()
            utime, stime = stat[stat.rindex(")") + 2 :].split()[11:13]
            own += (int(utime) + int(stime)) / tick
    return busy, own


def run_setting(
    etcd: LocalEtcd, detector: Detector, faults: list[Fault], model: FaultModel,
    duration: float, warmup: float, job: str, tmp: Path,
) -> dict[str, Any]:  # fmt: skip
    load = [os.getloadavg()[0]]
    cpu_start, wall_start = cpu_seconds(etcd.pid), time.monotonic()
    cluster = Cluster(etcd.endpoint, detector, job, tmp)
    injector = Injector(cluster, model)
    phases = Phases(time.time())
    try:
        cluster.start()
        for slot in range(WORKERS):
            cluster.spawn(slot)

        def tend() -> None:
            injector.tend(time.time(), True)

        def steady() -> bool:
            live = [w for w in cluster.workers if w.child.alive() and w.killed is None]
            return len(live) == WORKERS and all(
                cluster.steps.count(w.key, WORKERS) >= STEADY_STEPS for w in live
            )

        # Start-up and warm-up replace workers that exit, as the fault phase does.
        wait_until(steady, START_TIMEOUT, f"{WORKERS} workers steady", tend)
        warm_start = time.time()
        phases.start_s = warm_start - phases.started
        wait_until(lambda: time.time() >= warm_start + warmup, warmup + 5, "warm-up", tend)
        warm = cluster.steps.new(warm_start, time.time())
        if len(warm) < 3:
            raise SweepFailed("fewer than 3 steps in the warm-up")
        phases.rate = (len(warm) - 1) / (warm[-1][0] - warm[0][0])
        phases.step_interval = statistics.median(
            b[0] - a[0] for a, b in zip(warm, warm[1:], strict=False)
        )
        phases.warmup_exits = injector.run.exits
        injector.run = Run(restarts=injector.run.restarts)

        phases.t0 = time.time()
        phases.t1 = phases.t0 + duration
        pending = list(enumerate(faults))
        while (now := time.time()) < phases.t1:
            while pending and phases.t0 + pending[0][1].at <= now:
                index, fault = pending.pop(0)
                injector.apply(index, fault, now)
            injector.tend(now, True)
            time.sleep(POLL)
        # Recovery: no new faults, gone workers are still replaced. The run
        # ends when the job is whole again, so that the cost of the last
        # faults counts in full.
        with contextlib.suppress(SweepFailed):
            wait_until(lambda: whole(cluster, injector.run, phases.t1), RECOVERY_TIMEOUT,
                       "whole again", tend)  # fmt: skip
        phases.end = time.time()
        phases.whole = whole(cluster, injector.run, phases.t1)
        suspicions = cluster.suspicions()
    finally:
        cluster.close()
    load.append(os.getloadavg()[0])
    cpu_end, wall = cpu_seconds(etcd.pid), time.monotonic() - wall_start
    other = ((cpu_end[0] - cpu_start[0]) - (cpu_end[1] - cpu_start[1])) / wall
    result = analyse(detector, cluster, injector.run, suspicions, phases)
    result.update(
        start_s=phases.start_s, setting_wall_s=wall, load_average=load,
        other_cpu_cores=max(0.0, other), logs=str(tmp),
    )  # fmt: skip
    return result


def evictions(
    cluster: Cluster, run: Run, suspicions: list[tuple[float, str, str]]
) -> list[dict[str, Any]]:
    """Every exit with code 3, with when and why the worker was evicted and
    the pause it was caught in (None: nobody paused it)."""
    workers = {w.key: w for w in cluster.workers}
    out = []
    for key, exited, code in run.exits:
        if code != EXIT_EVICTED:
            continue
        worker = workers[key]
        suspected = next(((t, r) for t, m, r in suspicions if m == worker.member_id), None)
        ended = worker.session_end()
        # The leader's suspicion if there was one; otherwise the worker was
        # dropped by a roll call it could not answer, and learns it as soon
        # as it runs again.
        at = suspected[0] if suspected else ended[0] if ended else exited
        pause = next(
            (p for p in run.pauses if p.worker == key
             and p.stopped - 0.05 <= at <= (p.resumed or at) + EVICTION_SEEN_WITHIN),
            None,
        )  # fmt: skip
        if suspected is None:
            by = "roll call"
        else:
            by = "detector" if "detector" in suspected[1] else suspected[1]
        if pause is not None:
            pause.evicted, pause.by = True, by
        out.append({
            "worker": key, "member_id": worker.member_id, "evicted_at": at, "exited_at": exited,
            "by": by, "pause": None if pause is None else pause.fault,
            "session_end": ended and ended[1],
        })  # fmt: skip
    return out


def analyse(
    detector: Detector,
    cluster: Cluster,
    run: Run,
    suspicions: list[tuple[float, str, str]],
    phases: Phases,
) -> dict[str, Any]:
    t0, end, base = phases.t0, phases.end, phases.step_interval
    new = cluster.steps.new(t0, end)
    wall = end - t0
    times = [t0, *(t for t, _, _ in new), end]
    gaps = list(zip(times, times[1:], strict=False))
    stalled = sum(max(0.0, b - a - base) for a, b in gaps)
    # Each gap carries the world of the step ending it (the last stretch
    # that of the last step).
    worlds = [w for _, _, w in new] or [0]
    mean_world = sum((b - a) * worlds[min(i, len(worlds) - 1)] for i, (a, b) in
                     enumerate(gaps)) / wall  # fmt: skip

    def own_gap(p: PauseRecord) -> float | None:
        """The paused worker's own step gap around the pause, beyond the
        quiet step interval (None if it committed nothing after it)."""
        mine = [t for t, _, _ in cluster.steps.of(p.worker)]
        before = max((t for t in mine if t <= p.stopped), default=p.stopped)
        after = min((t for t in mine if t > p.stopped), default=None)
        return None if after is None else max(0.0, after - before - base)

    evicted = evictions(cluster, run, suspicions)
    failures = []
    for f in run.failures:
        suspect = next((t for t, m, _ in suspicions if m == f.member_id and t >= f.at - 0.01),
                       None)  # fmt: skip
        failures.append({
            **asdict(f),
            "stall_s": None if f.recovered is None else f.recovered - f.at,
            "detect_s": None if suspect is None else max(0.0, suspect - f.at),
        })  # fmt: skip
    pauses = [{**asdict(p), "stall_s": None if p.evicted else own_gap(p)} for p in run.pauses]

    def of(kind: str, key: str) -> dict[str, float] | None:
        return spread([f[key] for f in failures if f["kind"] == kind and f[key] is not None])

    survived = [p["stall_s"] for p in pauses if p["stall_s"] is not None]
    false = [e for e in evicted if e["pause"] is not None]  # caught in a pause
    replaced = [w for w in cluster.workers if w.key in run.replaced and w.first_step is not None]
    return {
        "detector": detector.name,
        "timeout_s": detector.timeout,
        "overrides": dict(detector.overrides),
        "quiet_samples_per_s": phases.rate * GLOBAL_BATCH,
        "quiet_step_interval_s": base,
        "duration_s": phases.t1 - t0,
        "recovery_s": end - phases.t1,
        "whole_again": phases.whole,
        "measured_s": wall,
        "samples": len(new) * GLOBAL_BATCH,
        "goodput_lost": 1.0 - len(new) / (phases.rate * wall),
        "goodput_lost_one_device_per_worker": 1.0
        - sum(w for _, _, w in new) / WORKERS / (phases.rate * wall),
        "stalled_s": stalled,
        "mean_world": mean_world,
        "silent_stall_s": of("silent", "stall_s"),
        "sigkill_stall_s": of("sigkill", "stall_s"),
        "silent_detect_s": of("silent", "detect_s"),
        "sigkill_detect_s": of("sigkill", "detect_s"),
        "failures_not_recovered": sum(1 for f in failures if f["stall_s"] is None),
        "false_evictions": len(evicted),
        "false_evictions_by": {
            "paused, detector": sum(1 for e in false if e["by"] == "detector"),
            "paused, roll call": sum(1 for e in false if e["by"] == "roll call"),
            "not paused": len(evicted) - len(false),
        },
        "other_exits": [
            {"worker": k, "returncode": c} for k, _, c in run.exits if c != EXIT_EVICTED
        ],  # fmt: skip
        "pauses": len(run.pauses),
        "faults_applied": len(run.pauses) + len(run.failures),
        "pause_stall_s": spread(survived),
        "pause_stall_total_s": sum(survived),
        "restarts": len(run.replaced),
        "restart_to_first_step_s": spread(
            [w.first_step - w.started for w in replaced if w.first_step is not None]
        ),  # fmt: skip
        "skipped_faults": run.skipped,
        "warmup_exits": [{"worker": k, "returncode": c} for k, _, c in phases.warmup_exits],
        "evictions": evicted,
        "failure_records": failures,
        "pause_records": pauses,
    }


# -------------------------------------------------------------------- results


def fmt(s: dict[str, float] | None, unit: str = " s", digits: int = 2) -> str:
    if not s:
        return "—"
    if s["n"] == 1:
        return f"{s['median']:.{digits}f}{unit}"
    return f"{s['median']:.{digits}f} (max {s['max']:.{digits}f}, n={s['n']}){unit}"


def best_fixed(
    results: list[dict[str, Any]], measure: str = "goodput_lost"
) -> dict[str, Any] | None:
    """The fixed timeout with the least ``measure``."""
    fixed_runs = [r for r in results if r["timeout_s"] is not None and "error" not in r]
    return min(fixed_runs, key=lambda r: r[measure], default=None)


def table(results: list[dict[str, Any]]) -> str:
    head = [
        "detector", "quiet samples/s", "goodput lost", "goodput lost, 1 device/worker (model)",
        "stalled", "silent failure stall", "SIGKILL stall",
        "false evictions = paused: detector + roll call, + not paused",
        "pause stall (not evicted): median, total", "restarts", "mean world", "faults applied",
        "other CPU",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    best = best_fixed(results)
    best_model = best_fixed(results, "goodput_lost_one_device_per_worker")
    ordered = sorted(results, key=lambda r: (r["timeout_s"] is None, r["timeout_s"] or 0.0))
    for r in ordered:
        marks = ["best fixed"] * (r is best) + ["best fixed in the model"] * (r is best_model)
        name = r["detector"] + (f" ({'; '.join(marks)})" if marks else "")
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} |" + " |" * (len(head) - 2))
            continue
        by = r["false_evictions_by"]
        pause = r["pause_stall_s"]
        row = [
            name, f"{r['quiet_samples_per_s']:.0f}", f"{r['goodput_lost']:.1%}",
            f"{r['goodput_lost_one_device_per_worker']:.1%}",
            f"{r['stalled_s']:.1f} s", fmt(r["silent_stall_s"]), fmt(r["sigkill_stall_s"]),
            f"{r['false_evictions']} = {by['paused, detector']} + {by['paused, roll call']} + "
            f"{by['not paused']}",
            "—" if pause is None else f"{pause['median']:.2f} s, {r['pause_stall_total_s']:.1f} s",
            str(r["restarts"]), f"{r['mean_world']:.2f}",
            f"{r['faults_applied']}/{r['faults_applied'] + len(r['skipped_faults'])}",
            f"{r['other_cpu_cores']:.2f} cores",
        ]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["settings"] if "error" not in r]
    fixed_runs = sorted((r for r in runs if r["timeout_s"] is not None),
                        key=lambda r: r["timeout_s"])  # fmt: skip
    adaptive = next((r for r in runs if r["timeout_s"] is None), None)
    xs = [r["timeout_s"] for r in fixed_runs]
    fig, axes = plt.subplots(3, 1, figsize=(7, 9), sharex=True)

    def adaptive_line(ax: Any, value: float | None, label: str) -> None:
        if value is not None:
            ax.axhline(value, color="tab:red", ls="--", lw=1.2, label=label)

    ax = axes[0]
    ax.plot(xs, [100 * r["goodput_lost"] for r in fixed_runs], "o-", label="fixed timeout T")
    ax.plot(
        xs,
        [100 * r["goodput_lost_one_device_per_worker"] for r in fixed_runs],
        "^:",
        color="tab:blue",
        alpha=0.6,
        label="fixed T, 1 device per worker (model)",
    )
    adaptive_name = adaptive["detector"] if adaptive else "adaptive"
    if adaptive_name == "adaptive":
        adaptive_name = "adaptive (phi 8, max 2 s)"
    adaptive_line(ax, adaptive and 100 * adaptive["goodput_lost"], adaptive_name)
    if adaptive is not None:
        ax.axhline(
            100 * adaptive["goodput_lost_one_device_per_worker"],
            color="tab:red",
            ls=":",
            lw=1,
            label="adaptive, 1 device per worker (model)",
        )
    best = best_fixed(runs)
    if best is not None:
        ax.plot([best["timeout_s"]], [100 * best["goodput_lost"]], "*", ms=14, color="tab:green",
                label=f"best fixed: T = {best['timeout_s']:g} s")  # fmt: skip
    best_model = best_fixed(runs, "goodput_lost_one_device_per_worker")
    if best_model is not None:
        ax.plot([best_model["timeout_s"]], [100 * best_model["goodput_lost_one_device_per_worker"]],
                "*", ms=14, mfc="none", color="tab:green",
                label=f"best fixed (model): T = {best_model['timeout_s']:g} s")  # fmt: skip
    ax.set_ylabel("goodput lost (%)")
    ax.legend(fontsize=8)

    ax = axes[1]
    for key, label, marker in (("silent_stall_s", "silent failure", "o-"),
                               ("sigkill_stall_s", "SIGKILL (stream breaks)", "s:")):  # fmt: skip
        pts = [(r["timeout_s"], r[key]) for r in fixed_runs if r[key]]
        if pts:
            med = [s["median"] for _, s in pts]
            ax.errorbar([x for x, _ in pts], med,
                        yerr=[[m - s["min"] for m, (_, s) in zip(med, pts, strict=True)],
                              [s["max"] - m for m, (_, s) in zip(med, pts, strict=True)]],
                        fmt=marker, capsize=3, label=f"{label}, fixed T")  # fmt: skip
    if adaptive is not None and adaptive["silent_stall_s"]:
        adaptive_line(ax, adaptive["silent_stall_s"]["median"], "silent failure, adaptive")
    ax.plot(xs, xs, color="grey", lw=0.8, ls=":", label="y = T")
    ax.set_ylabel("failure -> first step without it (s)\nmedian, min–max")
    ax.legend(fontsize=8)

    ax = axes[2]
    ax.plot(xs, [r["false_evictions"] for r in fixed_runs], "o-", label="false evictions, fixed T")
    ax.plot(xs, [r["false_evictions_by"]["not paused"] for r in fixed_runs], "x:",
            label="of which not paused (load), fixed T")  # fmt: skip
    adaptive_line(ax, adaptive and adaptive["false_evictions"], "false evictions, adaptive")
    ax.set_ylabel(f"evictions in {result['parameters']['duration_s']:g} s")
    ax.set_xlabel("fixed timeout T (s): phi off, max_silence = T")
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_xticks([], minor=True)
    ax.legend(fontsize=8)
    for a in axes:
        a.grid(alpha=0.3)
    f = result["faults"]
    fig.suptitle(
        f"{WORKERS} workers, {result['machine']['cpus']} cores; pauses lognormal(median "
        f"{f['pause_median_s']:g} s, sigma {f['pause_sigma']:g}) every {f['pause_every_s']:g} s "
        f"per worker,\nfailures every {f['kill_every_s']:g} s ({f['kill_mode']}); seed "
        f"{result['parameters']['seed']}", fontsize=9,
    )  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_thresholds(value: str) -> list[float]:
    out = []
    for part in value.split(","):
        t = float(part)
        if not 0.05 <= t <= 30:
            raise ValueError(f"threshold {t:g} s is outside 0.05..30 s")
        fixed(t).config()  # the overrides must make a valid Config
        out.append(t)
    return sorted(set(out))


@contextlib.contextmanager
def shared_etcd(tmp: Path) -> Iterator[LocalEtcd]:
    etcd = LocalEtcd(data_dir=tmp / "etcd")
    etcd.start()
    try:
        yield etcd
    finally:
        etcd.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--thresholds", default=",".join(f"{t:g}" for t in DEFAULT_THRESHOLDS),
                        help="fixed timeouts T to sweep, seconds, comma-separated")  # fmt: skip
    parser.add_argument("--no-adaptive", action="store_true", help="skip the adaptive detector")
    parser.add_argument("--adaptive-set", action="append", default=[], metavar="NAME=VALUE",
                        help="tune the adaptive detector (phi_threshold, phi_min_std, "
                        "phi_window, max_silence); default: the Config defaults")  # fmt: skip
    parser.add_argument("--duration", type=float, default=60.0, help="fault phase per setting, s")
    parser.add_argument("--warmup", type=float, default=6.0, help="quiet phase per setting, s")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pause-every", type=float, default=8.0,
                        help="mean seconds between pauses of one worker")  # fmt: skip
    parser.add_argument("--pause-median", type=float, default=0.3)
    parser.add_argument("--pause-sigma", type=float, default=1.2)
    parser.add_argument("--pause-max", type=float, default=8.0)
    parser.add_argument("--kill-every", type=float, default=15.0,
                        help="mean seconds between failures in the cluster")  # fmt: skip
    parser.add_argument("--kill-mode", choices=("alternate", *KILL_KINDS), default="alternate")
    parser.add_argument(
        "--rejoin-after",
        type=float,
        default=1.0,
        help="a gone worker's replacement starts this long after its eviction",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="T = 0.5 and 2 s plus adaptive, 15 s of faults, 4 s warm-up",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="default: bench/results/detector-sweep[-quick].json"
    )
    parser.add_argument("--logs", type=Path, default=None,
                        help="keep every process's log under this directory")  # fmt: skip
    args = parser.parse_args()
    try:
        thresholds = parse_thresholds("0.5,2" if args.quick else args.thresholds)
    except ValueError as exc:
        parser.error(f"--thresholds: {exc}")
    duration = 15.0 if args.quick else args.duration
    warmup = 4.0 if args.quick else args.warmup
    if not 5 <= duration <= 600 or not 2 <= warmup <= 60:
        parser.error("--duration must be 5..600 s and --warmup 2..60 s")
    for name in ("pause_every", "pause_median", "pause_sigma", "pause_max", "kill_every"):
        if not 0 < getattr(args, name) <= 3600:
            parser.error(f"--{name.replace('_', '-')} must be in (0, 3600]")
    if not 0 <= args.rejoin_after <= 60:
        parser.error("--rejoin-after must be 0..60 s")
    model = FaultModel(args.pause_every, args.pause_median, args.pause_sigma, args.pause_max,
                       args.kill_every, args.kill_mode, args.rejoin_after)  # fmt: skip
    faults = schedule(model, duration, WORKERS, args.seed)
    try:
        tuned = adaptive_detector(args.adaptive_set)
    except ValueError as exc:
        parser.error(f"--adaptive-set: {exc}")
    detectors = [fixed(t) for t in thresholds] + ([] if args.no_adaptive else [tuned])
    random.Random(f"{args.seed}/order").shuffle(detectors)
    out = args.json or ROOT / "bench" / "results" / (
        "detector-sweep-quick.json" if args.quick else "detector-sweep.json")  # fmt: skip

    started = time.monotonic()
    result: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_start": list(os.getloadavg()),
        },  # fmt: skip
        "versions": versions(),
        "parameters": {
            "quick": args.quick,
            "seed": args.seed,
            "workers": WORKERS,
            "duration_s": duration,
            "warmup_s": warmup,
            "thresholds_s": thresholds,
            "adaptive": not args.no_adaptive,
            "order": [d.name for d in detectors],
            "global_batch": GLOBAL_BATCH,
            "micro_batch": MICRO_BATCH,
            "checkpoint_every_steps": CKPT_EVERY,
            "example": "worker/examples/lm.py, default LMConfig, AdamW, 1 torch thread",
            "fixed_overrides": "phi_threshold=1e300, max_silence=T, "
            f"fence_window=min(0.5, {FENCE_SHARE} T)",
            "adaptive_config": {
                k: getattr(tuned.config(), k)
                for k in (
                    "heartbeat_interval",
                    "phi_threshold",
                    "phi_min_std",
                    "phi_window",
                    "max_silence",
                    "fence_window",
                )
            },
            "kill_bound_s": KILL_BOUND,
        },  # fmt: skip
        "faults": {
            "pause_every_s": model.pause_every,
            "pause_median_s": model.pause_median,
            "pause_sigma": model.pause_sigma,
            "pause_max_s": model.pause_max,
            "distribution": "lognormal(ln median, sigma), capped at pause_max; Poisson arrivals",
            "pause_share_over_s": {
                f"{s:g}": round(model.pause_share_over(s), 4) for s in (0.3, 0.5, 0.66, 1, 2, 3)
            },
            "kill_every_s": model.kill_every,
            "kill_mode": model.kill_mode,
            "rejoin_after_s": model.rejoin_after,
            "schedule": [asdict(f) for f in faults],
        },  # fmt: skip
        "settings": [],
    }
    print(f"{len(faults)} faults in {duration:g} s ({sum(f.kind == 'pause' for f in faults)} "
          f"pauses); settings in order: {', '.join(d.name for d in detectors)}",
          flush=True)  # fmt: skip
    with contextlib.ExitStack() as stack:
        base = args.logs or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="rollcall-detector-sweep-")))  # fmt: skip
        base.mkdir(parents=True, exist_ok=True)
        etcd = stack.enter_context(shared_etcd(base))
        try:
            for i, detector in enumerate(detectors):
                tmp = base / f"{i}-{detector.name.replace(' ', '-')}"
                tmp.mkdir(parents=True, exist_ok=True)
                t_setting = time.monotonic()
                try:
                    r = run_setting(etcd, detector, faults, model, duration, warmup,
                                    f"sweep{i}", tmp)  # fmt: skip
                except SweepFailed as exc:
                    r = {"detector": detector.name, "timeout_s": detector.timeout,
                         "error": str(exc)}  # fmt: skip
                    print(f"  {detector.name}: FAILED: {exc}", flush=True)
                else:
                    print(f"  {detector.name}: goodput lost {r['goodput_lost']:.1%}, "
                          f"{r['false_evictions']} false evictions, silent failure stall "
                          f"{fmt(r['silent_stall_s'])} ({time.monotonic() - t_setting:.0f} s)",
                          flush=True)  # fmt: skip
                result["settings"].append(r)
        except KeyboardInterrupt:
            print("interrupted: writing what was measured", flush=True)
    result["machine"]["load_average_end"] = list(os.getloadavg())
    result["wall_s"] = time.monotonic() - started
    adaptive = next((r for r in result["settings"]
                     if r["timeout_s"] is None and "error" not in r), None)  # fmt: skip
    keys = ("goodput_lost", "goodput_lost_one_device_per_worker", "stalled_s", "silent_stall_s",
            "sigkill_stall_s", "false_evictions", "false_evictions_by", "pause_stall_total_s",
            "restarts", "mean_world", "other_cpu_cores")  # fmt: skip
    result["adaptive"] = adaptive and {k: adaptive[k] for k in keys}
    for measure in ("goodput_lost", "goodput_lost_one_device_per_worker"):
        best = best_fixed(result["settings"], measure)
        suffix = "" if measure == "goodput_lost" else "_one_device_per_worker"
        result["best_fixed" + suffix] = best and {
            "timeout_s": best["timeout_s"],
            **{k: best[k] for k in keys},
        }
        if best and adaptive:
            result["adaptive_minus_best_fixed" + suffix] = adaptive[measure] - best[measure]
    md = table(result["settings"])
    print()
    print(md)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    stem = out.with_suffix("")
    m = result["machine"]
    Path(f"{stem}.md").write_text(
        f"Measured {result['date']}, {m['cpus']} cores, load average "
        f"{m['load_average_start'][0]:.1f} at start, {m['load_average_end'][0]:.1f} at end; "
        f"{duration:g} s of faults per setting (seed {args.seed}), "
        f"rollcall {str(result['versions']['rollcall_commit'])[:10]}"
        f"{' (dirty tree)' if result['versions']['rollcall_tree_dirty'] == 'true' else ''}. "
        "Stalls: median (max, n).\n\n" + md + "\n"
    )  # fmt: skip
    if any("error" not in r for r in result["settings"]):
        plot(result, Path(f"{stem}.png"))
    print(f"wrote {out}, {stem}.md, {stem}.png ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
