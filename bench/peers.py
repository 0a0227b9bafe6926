"""The same training job under rollcall, torchrun elastic and TorchFT:
failure-free throughput, crash stall, goodput under churn, hot-add stall.

    .venv/bin/python bench/peers.py [--quick] [--repeats 3] [--json FILE]
        [--systems rollcall,torchrun,torchft,torchft_defaults,torchrun_defaults]

The job is the built-in example (worker/examples/lm.py, default LMConfig,
AdamW), global batch 32 in microbatches of 8 split over the live workers by
rollcall.worker.plan.DataPlan, one torch thread per worker, WORKERS (3) workers on
loopback. Systems:

- rollcall: LocalEtcd, one `rollcall rendezvous` process, `rollcall worker
  --json` processes (durable checkpoints every CKPT_EVERY steps, as torchrun).
- torchrun: one `torchrun --nnodes=1:3 --nproc-per-node=1 --rdzv-backend=c10d
  --max-restarts=...` agent per worker ("node") running bench/jobs/torchrun_lm.py,
  which checkpoints every CKPT_EVERY steps and resumes from it. The c10d
  rendezvous store runs in its own process (`is_host=false`), like rollcall's
  etcd; `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` and `last_call_timeout=1`
  (torchrun_defaults: neither, crash only).
- torchft: one `torchft_lighthouse` (bound to 127.0.0.1) and one replica
  group of one process per worker (bench/jobs/torchft_lm.py: Manager, its
  ProcessGroupGloo, the optimizer wrapper), tuned as TorchFT's examples do:
  heartbeat timeout 1 s, gloo timeout 5 s, Manager timeout 10 s, join timeout
  10 s; torchft_defaults leaves every timeout at TorchFT's default.

The whole benchmark re-executes itself inside a new network namespace that has
only loopback (`unshare -n`, needs root), because TorchFT's servers listen on
all interfaces; `--no-netns` skips that.

Every stdout line of every worker is time-stamped on arrival by a reader
thread. "Progress" is the highest global step committed by any worker, so
steps replayed after a torchrun restart count once. One repeat, per system, on
one fresh cluster:

1. start WORKERS workers, wait until each has committed 3 steps at full size;
2. throughput: committed samples/s over a window;
3. crash: SIGKILL one worker (for torchrun the whole node: agent and worker).
   stall = kill -> the first step committed at the smaller world size on every
   survivor (max over survivors); steps lost = steps committed before the kill
   that were committed again after it; full speed = kill -> the first new step
   that starts 5 new steps at >= 90 % of the failure-free step rate;
4. hot-add: start a replacement. stall = the largest gap between consecutive
   step events of an existing worker from the start until 1 s after the
   joiner's first full-size step, minus that worker's median step interval;
5. churn, per failure rate: a random trained worker SIGKILLed every T s and a
   replacement started R s later, for D s; goodput = progress samples/s in
   those D s / the failure-free samples/s of this repeat.

Every wait is bounded (a scenario that does not finish is recorded as failed,
with the reason); everything started is killed at the end, on Ctrl-C and on
failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rollcall.etcd_local import LocalEtcd, child_processes, free_port  # noqa: E402
from rollcall.tether import tethered  # noqa: E402

WORKERS = 3
GLOBAL_BATCH = 32
MICRO_BATCH = 8
CKPT_EVERY = 20
#: Step rate that counts as "full speed again", relative to failure-free.
FULL_SPEED = 0.9
FULL_SPEED_STEPS = 5
VENV_BIN = Path(sys.executable).parent
NETNS_ENV = "ROLLCALL_PEERS_NETNS"


@dataclass(frozen=True)
class Settings:
    quick: bool
    repeats: int
    throughput_window: float
    #: (kill every T s, replacement after R s), one churn run each, D s long.
    churn: tuple[tuple[float, float], ...]
    churn_duration: float
    start_timeout: float
    recover_timeout: float


def settings_for(quick: bool, repeats: int) -> Settings:
    if quick:
        return Settings(True, 1, 2.0, ((3.0, 1.0),), 6.0, 60.0, 30.0)
    return Settings(False, repeats, 10.0, ((15.0, 2.0), (7.5, 2.0), (4.0, 2.0)), 30.0,
                    120.0, 70.0)  # fmt: skip


# ------------------------------------------------------------------ processes


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid``, children first."""
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = list(child_processes(todo.pop()))
        out += kids
        todo += kids
    return out


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc`` and every process below it, by pid."""
    pids = descendants(proc.pid) if proc.poll() is None else []
    for pid in [proc.pid, *pids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


class Tracker:
    """Committed step events of every worker of one cluster: (arrival time,
    worker key, step, world, epoch); the epoch is 0 for systems without one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps: list[tuple[float, str, int, int, int]] = []

    def add(self, t: float, key: str, step: int, world: int, epoch: int = 0) -> None:
        with self.lock:
            self.steps.append((t, key, step, world, epoch))

    def snapshot(self) -> list[tuple[float, str, int, int, int]]:
        with self.lock:
            return list(self.steps)

    def of(self, key: str) -> list[tuple[float, int, int]]:
        """(time, step, world) of ``key``'s commits."""
        return [(t, s, w) for t, k, s, w, _ in self.snapshot() if k == key]

    def progress(self, until: float) -> int:
        """Highest step committed by any worker at or before ``until`` (-1: none)."""
        return max((s for t, _, s, _, _ in self.snapshot() if t <= until), default=-1)

    def first_commits(
        self, after: float, before: float, above: int
    ) -> list[tuple[float, int, int]]:
        """(first commit time, step, world) of every step above ``above``
        first committed in (after, before], by time."""
        first: dict[int, tuple[float, int]] = {}
        for t, _, s, w, _ in self.snapshot():
            if after < t <= before and s > above and (s not in first or t < first[s][0]):
                first[s] = (t, w)
        return sorted((t, s, w) for s, (t, w) in first.items())

    def new_steps(self, after: float, before: float, above: int) -> list[tuple[float, int]]:
        """First commit time of every step above ``above`` in (after, before], sorted."""
        return [(t, s) for t, s, _ in self.first_commits(after, before, above)]


class Child:
    """A tethered child process; JSON stdout lines go to a callback with their
    arrival time, stderr to a log file."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str],
                 on_record: Callable[[float, dict[str, Any]], None]) -> None:  # fmt: skip
        self.log = log
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(tethered(argv), stdout=subprocess.PIPE, stderr=self._log,
                                     cwd=ROOT, env={**os.environ, **env})  # fmt: skip
        self.lines: list[str] = []
        self._on_record = on_record
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            now = time.time()
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            with contextlib.suppress(ValueError):  # closed by kill()
                self._log.write(f"{now:.3f} stdout: {line}\n".encode())
                self._log.flush()
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                self._on_record(now, record)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        kill_tree(self.proc)
        self._log.close()


@dataclass
class Worker:
    key: str
    child: Child
    started: float
    killed: float | None = None
    records: list[tuple[float, dict[str, Any]]] = field(default_factory=list)


# -------------------------------------------------------------------- systems


class System:
    """A cluster of one system: infrastructure plus workers."""

    name = ""
    description = ""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.tracker = Tracker()
        self.workers: list[Worker] = []
        self.infra: list[Child] = []
        self.count = 0

    def argv(self, index: int) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    def start(self) -> None:
        """Start the infrastructure (not the workers)."""

    def spawn(self) -> Worker:
        index = self.count
        self.count += 1
        key = f"{self.name}-{index}"
        argv, env = self.argv(index)
        holder: list[Worker] = []

        def on_record(t: float, record: dict[str, Any]) -> None:
            if holder:
                holder[0].records.append((t, record))
            if record.get("event") == "step":
                self.tracker.add(t, key, int(record["step"]), int(record["world"]))

        child = Child(argv, self.tmp / f"{key}.log", env, on_record)
        worker = Worker(key, child, time.time())
        holder.append(worker)
        self.workers.append(worker)
        return worker

    def live(self) -> list[Worker]:
        """Workers neither killed by the benchmark nor exited by themselves."""
        return [w for w in self.workers if w.killed is None and w.child.alive()]

    def exits(self) -> list[dict[str, Any]]:
        """Workers that ended by themselves (e.g. rollcall's eviction, exit 3)."""
        return [{"worker": w.key, "returncode": w.child.proc.returncode}
                for w in self.workers if w.killed is None and not w.child.alive()]  # fmt: skip

    def kill(self, worker: Worker) -> float:
        worker.killed = time.time()
        worker.child.kill()
        return worker.killed

    def close(self) -> None:
        for w in self.workers:
            with contextlib.suppress(Exception):
                w.child.kill()
        for c in reversed(self.infra):
            with contextlib.suppress(Exception):
                c.kill()


class Rollcall(System):
    name = "rollcall"
    description = ("`rollcall worker` processes, LocalEtcd + one `rollcall rendezvous`; "
                   f"durable checkpoint every {CKPT_EVERY} steps")  # fmt: skip
    job = "peers"
    #: Config overrides ("NAME=VALUE", as `--set` takes them) given to the
    #: replica and to every worker.
    settings: tuple[str, ...] = ()

    def _set(self) -> list[str]:
        return [arg for setting in self.settings for arg in ("--set", setting)]

    def start(self) -> None:
        self.etcd = LocalEtcd(data_dir=self.tmp / "etcd")
        self.etcd.start()
        self.token = self.tmp / "token"
        self.token.write_text(os.urandom(16).hex())
        self.address = f"127.0.0.1:{free_port()}"
        ready = threading.Event()
        replica = Child(
            [sys.executable, "-m", "rollcall.cli", "rendezvous", "--etcd", self.etcd.endpoint,
             "--listen", self.address, "--job", self.job, "--token-file", str(self.token),
             "--log-level", "info", *self._set()],
            self.tmp / "rendezvous.log", {}, lambda t, r: None,
        )  # fmt: skip
        self.infra.append(replica)
        deadline = time.monotonic() + 60
        while not any(x.startswith("rendezvous ready") for x in replica.lines):
            if time.monotonic() > deadline or not replica.alive():
                raise RuntimeError("rendezvous did not start")
            time.sleep(0.05)
        ready.set()

    def argv(self, index: int) -> tuple[list[str], dict[str, str]]:
        return [
            sys.executable, "-m", "rollcall.cli", "worker", "--rendezvous", self.address,
            "--job", self.job, "--token-file", str(self.token), "--json",
            "--steps", "10000000", "--threads", "1", "--log-level", "info",
            "--global-batch", str(GLOBAL_BATCH), "--micro-batch", str(MICRO_BATCH),
            "--checkpoint-dir", str(self.tmp / "ckpt"), "--checkpoint-every", str(CKPT_EVERY),
            *self._set(),
        ], {}  # fmt: skip

    def close(self) -> None:
        super().close()
        with contextlib.suppress(Exception):
            self.etcd.stop()


STORE_SCRIPT = """
import sys, time
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False)
print("store ready", flush=True)
while True:
    time.sleep(3600)
"""


class Torchrun(System):
    name = "torchrun"
    description = ("torchrun agents (c10d rendezvous, store in its own process, "
                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, last_call_timeout=1, keep-alive "
                   "1 s x 3), "
                   f"checkpoint every {CKPT_EVERY} steps, resume after restart")  # fmt: skip
    share_store = False
    rdzv_conf = "is_host=false,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"

    def start(self) -> None:
        self.port = free_port()
        store = Child([sys.executable, "-c", STORE_SCRIPT, str(self.port)],
                      self.tmp / "store.log", {}, lambda t, r: None)  # fmt: skip
        self.infra.append(store)
        deadline = time.monotonic() + 60
        while "store ready" not in store.lines:
            if time.monotonic() > deadline or not store.alive():
                raise RuntimeError("rendezvous store did not start")
            time.sleep(0.05)
        (self.tmp / "ckpt").mkdir()

    def argv(self, index: int) -> tuple[list[str], dict[str, str]]:
        env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "LOGLEVEL": "INFO"}  # fmt: skip
        if not self.share_store:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        return [
            str(VENV_BIN / "torchrun"), f"--nnodes=1:{WORKERS}", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=peers",
            f"--rdzv-conf={self.rdzv_conf}", "--local-addr=127.0.0.1",
            "--max-restarts=1000", "--monitor-interval=0.1",
            str(ROOT / "bench" / "jobs" / "torchrun_lm.py"),
            "--checkpoint-dir", str(self.tmp / "ckpt"), "--checkpoint-every", str(CKPT_EVERY),
            "--global-batch", str(GLOBAL_BATCH), "--micro-batch", str(MICRO_BATCH),
        ], env  # fmt: skip


class TorchrunDefaults(Torchrun):
    name = "torchrun_defaults"
    description = ("torchrun as above but with its defaults: the rendezvous TCP store shared "
                   "with the workers, last_call_timeout 30 s, keep-alive 5 s x 3")  # fmt: skip
    share_store = True
    rdzv_conf = "is_host=false"


class TorchFT(System):
    name = "torchft"
    description = ("torchft_lighthouse + one replica group (1 process) per worker: Manager, "
                   "optimizer wrapper, gloo; heartbeat timeout 1 s, gloo 5 s, Manager 10 s, "
                   "join 10 s")  # fmt: skip
    lighthouse_flags = ["--heartbeat_timeout_ms", "1000", "--quorum_tick_ms", "100",
                        "--join_timeout_ms", "10000"]  # fmt: skip
    job_flags = ["--gloo-timeout", "5", "--manager-timeout", "10"]

    def start(self) -> None:
        if not (VENV_BIN / "torchft_lighthouse").exists():
            raise RuntimeError(
                "torchft is not installed here (no torchft_lighthouse in "
                f"{VENV_BIN}): .venv/bin/pip install -e '.[bench]'"
            )
        self.address = f"127.0.0.1:{free_port()}"
        lighthouse = Child(
            [str(VENV_BIN / "torchft_lighthouse"), "--min_replicas", "1",
             "--bind", self.address, *self.lighthouse_flags],
            self.tmp / "lighthouse.log", {}, lambda t, r: None,
        )  # fmt: skip
        self.infra.append(lighthouse)
        time.sleep(0.5)
        if not lighthouse.alive():
            raise RuntimeError("lighthouse did not start")

    def argv(self, index: int) -> tuple[list[str], dict[str, str]]:
        env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        return [
            sys.executable, str(ROOT / "bench" / "jobs" / "torchft_lm.py"),
            "--replica-id", str(index), "--lighthouse", f"http://{self.address}",
            "--global-batch", str(GLOBAL_BATCH), "--micro-batch", str(MICRO_BATCH),
            *self.job_flags,
        ], env  # fmt: skip


class TorchFTDefaults(TorchFT):
    name = "torchft_defaults"
    description = ("torchft as above with TorchFT's default timeouts (heartbeat 5 s, join 60 s, "
                   "gloo 60 s, Manager 60 s)")  # fmt: skip
    lighthouse_flags: list[str] = []
    job_flags: list[str] = []


SYSTEMS: dict[str, type[System]] = {
    s.name: s for s in (Rollcall, Torchrun, TorchFT, TorchFTDefaults, TorchrunDefaults)
}
#: Scenarios each system runs (the "defaults" variants: fewer, see PEERS.md).
SCENARIOS = {
    "rollcall": ("throughput", "crash", "hot_add", "churn"),
    "torchrun": ("throughput", "crash", "hot_add", "churn"),
    "torchft": ("throughput", "crash", "hot_add", "churn"),
    "torchft_defaults": ("throughput", "crash", "hot_add", "churn1"),
    "torchrun_defaults": ("throughput", "crash"),
}


# ------------------------------------------------------------------ scenarios


class ScenarioFailed(Exception):
    pass


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise ScenarioFailed(f"{what}: not within {timeout:.0f} s")


def wait_steady(system: System, world: int, steps: int, after: float, timeout: float) -> None:
    """Every live worker committed ``steps`` steps at size ``world`` after ``after``.
    A worker that exited by itself is replaced, as an operator would."""

    def ready() -> bool:
        live = system.live()
        for _ in range(world - len(live)):
            system.spawn()
        if len(live) != world:
            return False
        return all(
            sum(1 for t, _, w in system.tracker.of(x.key) if t > after and w == world) >= steps
            for x in live
        )

    wait_until(ready, timeout, f"{world} workers steady")


def throughput(system: System, window: float) -> dict[str, float]:
    t0 = time.time()
    time.sleep(window)
    t1 = time.time()
    new = system.tracker.new_steps(t0, t1, system.tracker.progress(t0))
    if len(new) < 2:
        raise ScenarioFailed("fewer than 2 steps in the throughput window")
    rate = (len(new) - 1) / (new[-1][0] - new[0][0])
    return {"samples_per_s": rate * GLOBAL_BATCH, "steps_per_s": rate, "steps": len(new)}


def crash(system: System, victim: Worker, step_rate: float, timeout: float) -> dict[str, Any]:
    survivors = [w for w in system.live() if w is not victim]
    world = len(survivors)
    t_kill = system.kill(victim)
    before = system.tracker.progress(t_kill)

    def firsts() -> list[tuple[float, int]] | None:
        out = []
        for w in survivors:
            mine = [(t, s) for t, s, wd in system.tracker.of(w.key) if t > t_kill and wd == world]
            if not mine:
                return None
            out.append(mine[0])
        return out

    first = wait_until(firsts, timeout, "survivors' first step after the kill")
    t_first = max(t for t, _ in first)
    resumed_at = min(s for _, s in first)
    # Let a few new steps arrive for the "full speed" measure.
    need = FULL_SPEED_STEPS + 3
    with contextlib.suppress(ScenarioFailed):
        wait_until(lambda: len(system.tracker.new_steps(t_kill, time.time(), before)) >= need,
                   timeout, "steps after the kill")  # fmt: skip
    new = system.tracker.new_steps(t_kill, time.time(), before)
    full_speed = None
    limit = FULL_SPEED_STEPS / (FULL_SPEED * step_rate)
    for i in range(len(new) - FULL_SPEED_STEPS):
        if new[i + FULL_SPEED_STEPS][0] - new[i][0] <= limit:
            full_speed = new[i][0] - t_kill
            break
    return {
        "stall_s": t_first - t_kill,
        "steps_lost": max(0, before + 1 - resumed_at),
        "full_speed_s": full_speed,
        "last_step_before": before,
        "resumed_at_step": resumed_at,
        "victim": victim.key,
    }


def intervals(times: list[float]) -> list[tuple[float, float]]:
    return [(a, b) for a, b in zip(times, times[1:], strict=False)]


def hot_add(system: System, timeout: float) -> dict[str, Any]:
    existing = system.live()
    world = len(existing) + 1
    time.sleep(1.0)  # a baseline of step intervals
    joiner = system.spawn()
    t_start = joiner.started

    def joiner_first() -> float | None:
        mine = [t for t, _, w in system.tracker.of(joiner.key) if w == world]
        return mine[0] if mine else None

    t_first = wait_until(joiner_first, timeout, "joiner's first full-size step")
    wait_until(lambda: time.time() > t_first + 1.0 and all(
        sum(1 for t, _, w in system.tracker.of(x.key) if t > t_first and w == world) >= 3
        for x in existing), timeout, "steps after the join")  # fmt: skip
    stalls = []
    for w in existing:
        times = [t for t, _, _ in system.tracker.of(w.key)]
        base = [b - a for a, b in intervals(times) if b < t_start][-20:]
        around = [b - a for a, b in intervals(times) if b > t_start and a < t_first + 1.0]
        if base and around:
            stalls.append(max(around) - statistics.median(base))
    if not stalls:
        raise ScenarioFailed("no step intervals around the join")
    return {"stall_s": max(stalls), "join_to_first_step_s": t_first - t_start}


def churn(system: System, every: float, rejoin: float, duration: float, seed: int,
          baseline: float) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(seed)
    t0 = time.time()
    p0 = system.tracker.progress(t0)
    kills, starts = 0, 0
    pending: list[float] = []  # replacement start times
    next_kill = t0 + every / 2
    while True:
        now = time.time()
        if now >= t0 + duration:
            break
        if now >= next_kill:
            trained = [w for w in system.live() if system.tracker.of(w.key)]
            pool = trained or system.live()
            if pool:
                system.kill(rng.choice(pool))
                kills += 1
                pending.append(now + rejoin)
            next_kill += every
        for due in [d for d in pending if d <= now]:
            pending.remove(due)
            system.spawn()
            starts += 1
        time.sleep(0.02)
    t1 = t0 + duration
    progress = system.tracker.progress(t1) - p0
    rate = progress * GLOBAL_BATCH / duration
    for _ in pending:  # back to full size for what follows
        system.spawn()
    return {
        "kill_every_s": every, "rejoin_after_s": rejoin, "duration_s": duration,
        "failures_per_min": 60.0 / every, "kills": kills, "replacements": starts,
        "samples_per_s": rate, "goodput": rate / baseline,
    }  # fmt: skip


def one_repeat(name: str, settings: Settings, repeat: int, tmp: Path) -> dict[str, Any]:
    scenarios = SCENARIOS[name]
    system = SYSTEMS[name](tmp)
    out: dict[str, Any] = {"repeat": repeat}
    try:
        system.start()
        t_start = time.time()
        for _ in range(WORKERS):
            system.spawn()
        wait_steady(system, WORKERS, 3, 0, settings.start_timeout)
        out["start_to_steady_s"] = time.time() - t_start
        tp = throughput(system, settings.throughput_window)
        out["throughput"] = tp
        print(f"  {name} #{repeat + 1}: {tp['samples_per_s']:.0f} samples/s", flush=True)
        if "crash" in scenarios:
            live = system.live()
            victim = live[(repeat + 1) % len(live)]
            out["crash"] = crash(system, victim, tp["steps_per_s"], settings.recover_timeout)
            c = out["crash"]
            print(f"  {name} #{repeat + 1}: crash stall {c['stall_s']:.2f} s, "
                  f"{c['steps_lost']} steps lost", flush=True)  # fmt: skip
        if "hot_add" in scenarios:
            wait_steady(system, WORKERS - 1, 3, 0, settings.recover_timeout)
            out["hot_add"] = hot_add(system, settings.recover_timeout)
            print(f"  {name} #{repeat + 1}: hot-add stall {out['hot_add']['stall_s']:.2f} s",
                  flush=True)  # fmt: skip
        rates = settings.churn[:1] if "churn1" in scenarios else settings.churn
        if "churn" in scenarios or "churn1" in scenarios:
            out["churn"] = []
            for i, (every, rejoin) in enumerate(rates):
                wait_steady(system, WORKERS, 3, time.time(), settings.recover_timeout)
                result = churn(system, every, rejoin, settings.churn_duration,
                               1000 * repeat + i, tp["samples_per_s"])  # fmt: skip
                out["churn"].append(result)
                print(f"  {name} #{repeat + 1}: churn every {every:g} s: goodput "
                      f"{result['goodput']:.2f} ({result['kills']} kills)", flush=True)  # fmt: skip
    except ScenarioFailed as exc:
        out["error"] = str(exc)
        print(f"  {name} #{repeat + 1}: FAILED: {exc}", flush=True)
    except Exception as exc:  # noqa: BLE001 - record and go on with the next system
        out["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        # Before close(), which kills every worker still running.
        out["worker_exits"] = system.exits()
        system.close()
    out["workers_started"] = system.count
    return out


# -------------------------------------------------------------------- results


def write_results(path: Path, parameters: dict[str, Any], **results: Any) -> None:
    """Write an A/B bench's results as JSON to ``path``: the date, the
    machine (with its load average at the end), ``parameters`` and
    ``results``."""
    document = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_end": os.getloadavg(),
        },
        "parameters": parameters,
        **results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {path}")


def checkout_argument(parser: argparse.ArgumentParser, before: Path | None) -> None:
    """Refuse ``--before`` naming no rollcall checkout (``measured_in``)."""
    if before is not None and not (before / "bench" / "peers.py").is_file():
        parser.error(f"--before {before}: no rollcall checkout there (bench/peers.py)")


def settings_argument(parser: argparse.ArgumentParser, settings: Sequence[str]) -> None:
    """Refuse a ``--rollcall-set`` that is not NAME=VALUE (``Rollcall.settings``;
    no ";", which ``measured_in``'s string arguments may join them by)."""
    for setting in settings:
        name, sep, _ = setting.partition("=")
        if not sep or not name.isidentifier() or ";" in setting:
            parser.error(f"--rollcall-set {setting!r}: expected NAME=VALUE")


def measured_in(
    directory: Path | None, script: Path, function: Callable[..., Any], *args: str
) -> Any:
    """``function(*args)`` (a function of the bench script ``script``)
    here, or, given a checkout ``directory``, as ``call_in_checkout`` runs
    it there: one call for both sides of an A/B."""
    if directory is None:
        return function(*args)
    return call_in_checkout(directory, script, function.__name__, *args)


def call_in_checkout(directory: Path, script: Path, function: str, *args: str) -> Any:
    """``function(*args)`` of the bench script ``script`` (a module name
    from its file name), run in a child process that imports rollcall and
    ``bench/peers.py`` from the rollcall checkout ``directory`` (a ``git
    worktree`` of an earlier commit: the A/B of a change) and ``script``
    from where it is (the checkout may not have it). Its result, which it
    prints as JSON on its last line."""
    call = (
        "import json, sys; sys.path.insert(0, sys.argv[1] + '/bench'); import peers;"
        "sys.path.insert(0, sys.argv[2]); import importlib;"
        "module = importlib.import_module(sys.argv[3]);"
        "print(json.dumps(getattr(module, sys.argv[4])(*sys.argv[5:])))"
    )
    env = {**os.environ, "PYTHONPATH": str(directory)}
    argv = [sys.executable, "-c", call, str(directory), str(script.parent), script.stem,
            function, *args]  # fmt: skip
    done = subprocess.run(
        argv, cwd=directory, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{script.stem}.{function} from {directory} failed:\n"
                           f"{done.stderr[-2000:]}")  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}  # fmt: skip


def spread_of(values: list[float]) -> dict[str, float]:
    """``spread`` of values of which some are known."""
    found = spread(values)
    if found is None:
        raise ValueError("no values")
    return found


def summarize(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    def pick(scenario: str, key: str) -> list[float]:
        return [r[scenario][key] for r in runs
                if scenario in r and r[scenario].get(key) is not None]  # fmt: skip

    tp = spread(pick("throughput", "samples_per_s"))
    crash_stall = spread(pick("crash", "stall_s"))
    hot = spread(pick("hot_add", "stall_s"))
    goodput: dict[str, Any] = {}
    for r in runs:
        for c in r.get("churn", []):
            goodput.setdefault(f"{c['failures_per_min']:g}", []).append(c["goodput"])
    return {
        "description": SYSTEMS[name].description,
        "throughput_samples_per_s": tp and tp["median"],
        "crash_stall_s": crash_stall and crash_stall["median"],
        "goodput": {k: statistics.median(v) for k, v in goodput.items()},
        "hot_add_stall_s": hot and hot["median"],
        "spread": {
            "throughput_samples_per_s": tp,
            "crash_stall_s": crash_stall,
            "crash_steps_lost": spread(pick("crash", "steps_lost")),
            "crash_full_speed_s": spread(pick("crash", "full_speed_s")),
            "hot_add_stall_s": hot,
            "hot_add_join_to_first_step_s": spread(pick("hot_add", "join_to_first_step_s")),
            "goodput": {k: spread(v) for k, v in goodput.items()},
        },
        "failed_repeats": [r["error"] for r in runs if "error" in r],
        "repeats": runs,
    }


def fmt(s: dict[str, float] | None, unit: str = "", digits: int = 2) -> str:
    if not s:
        return "—"
    if s["n"] == 1 or s["min"] == s["max"]:
        return f"{s['median']:.{digits}f}{unit}"
    return f"{s['median']:.{digits}f}{unit} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def table(result: dict[str, Any]) -> str:
    rates = sorted({float(k) for s in result["systems"].values() for k in s["goodput"]})
    head = ["system", "samples/s", "crash stall", "steps lost", "to full speed",
            *[f"goodput @{r:g}/min" for r in rates], "hot-add stall"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in result["systems"].items():
        sp = s["spread"]
        row = [name, fmt(sp["throughput_samples_per_s"], "", 0), fmt(sp["crash_stall_s"], " s"),
               fmt(sp["crash_steps_lost"], "", 0), fmt(sp["crash_full_speed_s"], " s")]  # fmt: skip
        row += [fmt(sp["goodput"].get(f"{r:g}")) for r in rates]
        row.append(fmt(sp["hot_add_stall_s"], " s"))
        if s["failed_repeats"]:
            row[0] += f" ({len(s['failed_repeats'])} failed)"
        lines.append("| " + " | ".join(row) + " |")
    notes = []
    for name, s in result["systems"].items():
        exits = [e for r in s["repeats"] for e in r.get("worker_exits", [])]
        if exits:
            codes = sorted({str(e["returncode"]) for e in exits})
            notes.append(f"- {name}: {len(exits)} worker(s) exited by themselves "
                         f"(exit code {', '.join(codes)}) and were replaced")  # fmt: skip
        for error in s["failed_repeats"]:
            notes.append(f"- {name}: a repeat failed: {error}")
    return "\n".join(lines + ([""] + notes if notes else []))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, s in result["systems"].items():
        g = s["spread"]["goodput"]
        if not g:
            continue
        xs = sorted(g, key=float)
        med = [g[x]["median"] for x in xs]
        low = [g[x]["median"] - g[x]["min"] for x in xs]
        high = [g[x]["max"] - g[x]["median"] for x in xs]
        ax.errorbar([float(x) for x in xs], med, yerr=[low, high], marker="o", capsize=4,
                    label=name)  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("failures per minute (SIGKILL of one worker; replacement started later)")
    ax.set_ylabel("goodput (samples/s under churn ÷ failure-free)")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    p = result["parameters"]
    ax.set_title(f"{p['workers']} workers, example LM, global batch {p['global_batch']}, "
                 f"{result['machine']['cpus']} cores", fontsize=10)  # fmt: skip
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def git_commit() -> str:
    """The checked-out commit (full hash), with ``+dirty`` if the tree has
    changes; ``unknown`` outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not head:
        return "unknown"
    return f"{head}+dirty" if dirty else head


def versions() -> dict[str, str | None]:
    import torch

    try:
        from importlib.metadata import version

        torchft = version("torchft")
    except Exception:  # noqa: BLE001 - not installed
        torchft = None
    commit = git_commit()
    return {"torch": torch.__version__, "torchft": torchft,
            "rollcall_commit": commit.removesuffix("+dirty"),
            "rollcall_tree_dirty": str(commit.endswith("+dirty")).lower(),
            "python": platform.python_version()}  # fmt: skip


def enter_netns(argv: list[str]) -> None:
    """Re-execute inside a fresh network namespace with only loopback, up."""
    os.environ[NETNS_ENV] = "1"
    script = 'ip link set lo up && exec "$@"'
    os.execvp("unshare", ["unshare", "-n", "--", "sh", "-c", script, "sh",
                          sys.executable, *argv])  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1 repeat, short windows, one churn rate (about a minute)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--systems", default=None, help=f"comma-separated, from {','.join(SYSTEMS)}"
    )
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "peers.json")
    parser.add_argument(
        "--logs", type=Path, default=None, help="keep every process's log under this directory"
    )
    parser.add_argument(
        "--no-netns", action="store_true", help="do not enter a loopback-only network namespace"
    )
    args = parser.parse_args()
    if not 1 <= args.repeats <= 20:
        parser.error("--repeats must be 1..20")
    default_systems = "rollcall,torchrun,torchft" if args.quick else ",".join(SYSTEMS)
    names = (args.systems or default_systems).split(",")
    for n in names:
        if n not in SYSTEMS:
            parser.error(f"unknown system {n!r}")
    if not args.no_netns and os.environ.get(NETNS_ENV) != "1":
        enter_netns([str(Path(__file__).resolve()), *sys.argv[1:]])
    settings = settings_for(args.quick, args.repeats)
    load_start = os.getloadavg()
    started = time.monotonic()
    result: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_start": list(load_start),
            "platform": platform.platform(),
            "netns": os.environ.get(NETNS_ENV) == "1",
        },  # fmt: skip
        "versions": versions(),
        "parameters": {
            "quick": settings.quick,
            "repeats": settings.repeats,
            "workers": WORKERS,
            "example": "worker/examples/lm.py, default LMConfig (137k parameters), AdamW",
            "global_batch": GLOBAL_BATCH,
            "micro_batch": MICRO_BATCH,
            "threads_per_worker": 1,
            "checkpoint_every_steps": CKPT_EVERY,
            "throughput_window_s": settings.throughput_window,
            "churn": [
                {"kill_every_s": e, "rejoin_after_s": r, "failures_per_min": 60 / e}
                for e, r in settings.churn
            ],
            "churn_duration_s": settings.churn_duration,
            "full_speed": f"{FULL_SPEED_STEPS} new steps at >= {FULL_SPEED:.0%} of the "
            "failure-free step rate",
            "systems": names,
        },  # fmt: skip
        "systems": {},
    }
    try:
        for name in names:
            runs = []
            for repeat in range(settings.repeats):
                if args.logs is not None:
                    tmp = args.logs / f"{name}-{repeat}"
                    tmp.mkdir(parents=True, exist_ok=True)
                    runs.append(one_repeat(name, settings, repeat, tmp))
                    continue
                with tempfile.TemporaryDirectory(prefix=f"peers-{name}-") as tmp_name:
                    runs.append(one_repeat(name, settings, repeat, Path(tmp_name)))
            result["systems"][name] = summarize(name, runs)
    except KeyboardInterrupt:
        print("interrupted: writing what was measured", flush=True)
    result["machine"]["load_average_end"] = list(os.getloadavg())
    result["wall_s"] = time.monotonic() - started
    md = table(result)
    print()
    print(md)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    stem = args.json.with_suffix("")
    la = result["machine"]
    header = (f"Measured {result['date']}, {la['cpus']} cores, load average "
              f"{la['load_average_start'][0]:.1f} at start, "
              f"{la['load_average_end'][0]:.1f} at end; "
              f"{'quick' if settings.quick else 'full'} run, {settings.repeats} repeat(s); "
              f"torch {result['versions']['torch']}, torchft {result['versions']['torchft']}, "
              f"rollcall {str(result['versions']['rollcall_commit'])[:10]}. "
              "Median [min–max].\n\n")  # fmt: skip
    Path(f"{stem}.md").write_text(header + md + "\n")
    if result["systems"]:
        plot(result, Path(f"{stem}-goodput.png"))
    print(f"wrote {args.json}, {stem}.md, {stem}-goodput.png ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
