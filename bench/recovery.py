"""Recovery cost of real training workers: crash stall, hot-add stall, state
transfer throughput and failure-free per-step overhead.

    .venv/bin/python bench/recovery.py [--repeats 3] [--rounds 5] [--json FILE] [--quick]
        [--only recovery|transfer|overhead|sharding ...]

Starts a real etcd and one rendezvous replica (the `rollcall` CLI) on
loopback, then WORKERS (4) `rollcall worker --example lm` processes (default
model sizes, --threads 1, --steps very large, token in a file). Every stdout
line of every process is time-stamped (time.time()) by a reader thread when it
arrives; logs (--log-level info) are parsed for their own timestamps
("%Y-%m-%d %H:%M:%S,mmm", local time, ms resolution).

1. crash: after every worker has committed a few steps in the 4-member view,
   SIGKILL one. stall = kill -> the first step committed in a newer view on
   *every* survivor (max over survivors). Breakdown from the logs: detect
   (kill -> replica "suspect <victim>"), roll call + commit (suspect ->
   replica "committed epoch N"), group rebuild (commit -> last survivor's
   "view N: ..." line, logged once its group is built), first step (-> last
   survivor's first step event).
   A replacement is started after each repeat (its state fetch is also a
   throughput sample). Each part is printed next to its floor, measured in
   the same run once no worker runs: detect, SIGKILL of a process holding
   a loopback TCP connection -> this process's recv sees it end; commit,
   one etcd transaction like a view commit on a fresh etcd; rebuild, a gloo
   group of 3 ranks over a fresh TCPStore with one all-reduce (processes
   already up); first step, a whole step in the new view (what is left when
   no microbatch of the aborted step is kept).
2. hot-add: a 5th worker joins while 4 train. stall = largest gap between
   consecutive step events of an existing worker around the join minus that
   worker's median step interval before the join (max over workers). Also the
   joiner's "pulled step ... (B bytes) ... in S s" log line. The 5th worker
   then leaves with SIGINT (clean Leave): the stall of the others, measured
   as the hot-add's, and the signal -> every worker's first step in the
   smaller view.
3. state transfer in the job: B / S from every "pulled" line, next to a raw
   loopback TCP transfer of the same B (server thread + client thread in this
   process, connect included), measured in the same run while no worker runs.
   (Parts 1-3 are `--only recovery`.)
4. state transfer alone (`--only transfer`): a StateServer in a child
   process serves the example LM's state at TRANSFER_MODELS sizes (1.7 MB,
   78 MB and 533 MB); this process fetches it with a fresh StateFetcher each
   time (channel set-up, describe, data channel, pieces checked as they
   arrive), interleaved with raw TCP of the same bytes from the same child
   process over one connection (connect included), received into fresh
   memory as a fetch must: transparent huge pages faulted in by the receive
   (the fetch's landing asks for them too; the fastest fresh memory here),
   and for contrast 4 KiB pages populated at once (MAP_POPULATE, the fastest
   way without huge pages) and, for the wire alone, memory already touched;
   and the floor of any fetch that checks what it receives: raw TCP into
   fresh huge pages over 2 connections at once, SHA-256 of each piece as it
   lands (``raw_checked_from``), printed with fetch / that floor.
   The decode and one digest pass over the whole state, which the fetch no
   longer makes, are timed after each fetch.
5. overhead (`--only overhead`): rounds of 4 fresh rollcall workers (own
   etcd and replica; step events over a window, CPU time of the 4 processes
   from /proc) and a plain loop, alternating which runs first: 4 spawned
   processes, same model/optimizer (`build(LMConfig(), 0)`), plain
   ProcessGroupGloo over a loopback TCPStore, same global batch 32 / micro
   batch 8 split (4 microbatches -> one per rank at 4 ranks), loss_sum +
   backward, one flat allreduce, divide, step; torch.set_num_threads(1).
   Reported per round and as median/min/max: steps/s and CPU ms per step.

6. sharding (`--only sharding`, not run by default; results in
   results/recovery-sharding.json unless --json says otherwise): at the
   example's default size and at d_model 256 x 8 layers (~47x the
   parameters), 4 workers replicated and 4 with `--shard-redundancy 2`,
   each on a fresh cluster: steps/s and CPU per step over a window, the
   bytes each rank sends per step (all-reduce, and the sharded all-gather
   at the exact payload width), the crash stall and the hot-add stall as
   in parts 1 and 2.

Every wait is bounded; every process is killed in `finally`.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import platform
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rollcall.etcd_local import LocalEtcd, free_port, free_ports  # noqa: E402
from rollcall.tether import tethered  # noqa: E402

JOB = "recovery"
#: The epoch secret the transfer benchmark's server and fetcher share.
EPOCH_SECRET = "5e" * 32
WORKERS = 4
TIMEOUT = 300.0
STEPS = 10_000_000
PULLED = re.compile(r"pulled step (\d+) \((\d+) bytes\) from (\d+) peers in ([0-9.]+) s")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def log_time(line: str) -> float | None:
    m = STAMP.match(line)
    if not m:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def log_lines(path: Path) -> list[tuple[float, str]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        t = log_time(line)
        if t is not None:
            out.append((t, line))
    return out


class Proc:
    """A tethered child; stdout lines collected with arrival times."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            tethered(argv), stdout=subprocess.PIPE, stderr=self._log, cwd=ROOT
        )
        self.lock = threading.Lock()
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            now = time.time()
            with self.lock:
                self.lines.append((now, raw.decode(errors="replace").rstrip("\n")))

    def events(self) -> list[tuple[float, dict[str, Any]]]:
        with self.lock:
            lines = list(self.lines)
        out = []
        for t, line in lines:
            if line.startswith("{"):
                try:
                    out.append((t, json.loads(line)))
                except ValueError:
                    pass
        return out

    def steps(self) -> list[tuple[float, dict[str, Any]]]:
        return [(t, e) for t, e in self.events() if e.get("event") == "step"]

    def wait_for(self, predicate: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what}: process exited ({self.proc.returncode})")
            time.sleep(0.01)
        raise TimeoutError(f"{what}: not within {timeout} s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        finally:
            self._log.close()

    def interrupt(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


class Worker(Proc):
    def __init__(
        self, address: str, token_file: Path, log_path: Path, extra: Sequence[str] = ()
    ) -> None:
        super().__init__(
            [
                sys.executable,
                "-m",
                "rollcall.cli",
                "worker",
                "--example",
                "lm",
                "--rendezvous",
                address,
                "--job",
                JOB,
                "--token-file",
                str(token_file),
                "--json",
                "--steps",
                str(STEPS),
                "--threads",
                "1",
                "--log-level",
                "info",
                *extra,
            ],  # fmt: skip
            log_path,
        )
        self.member_id = ""

    def wait_joined(self) -> None:
        joined = self.wait_for(
            lambda: next((e for _, e in self.events() if e["event"] == "joined"), None),
            "worker join",
        )
        self.member_id: str = joined["member_id"]

    def steps_in(self, world: int, after: float, epoch_above: int = -1) -> list[tuple[float, dict]]:
        return [
            (t, e) for t, e in self.steps()
            if t > after and e["world"] == world and e["epoch"] > epoch_above
        ]  # fmt: skip

    def pulled(self) -> list[dict[str, float]]:
        out = []
        for t, line in log_lines(self.log_path):
            m = PULLED.search(line)
            if m:
                out.append({"t": t, "step": int(m[1]), "bytes": int(m[2]),
                            "peers": int(m[3]), "seconds": float(m[4])})  # fmt: skip
        return out


def wait_steady(workers: list[Worker], world: int, steps: int, after: float) -> int:
    """Every worker has committed ``steps`` steps in a view of ``world``
    members after ``after``; return that epoch (the newest seen)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        epochs = []
        for w in workers:
            if w.proc.poll() is not None:
                raise RuntimeError(f"worker {w.member_id} exited ({w.proc.returncode})")
            mine = w.steps_in(world, after)
            if not mine:
                break
            last = mine[-1][1]["epoch"]
            if sum(1 for _, e in mine if e["epoch"] == last) < steps:
                break
            epochs.append(last)
        else:
            if len(set(epochs)) == 1:
                return epochs[0]
        time.sleep(0.05)
    raise TimeoutError(f"{len(workers)} workers not steady in a {world}-member view")


def crash_once(workers: list[Worker], replica: Proc, index: int) -> dict[str, float]:
    epoch = wait_steady(workers, WORKERS, 3, 0)
    victim = workers.pop(index)
    t_kill = time.time()
    victim.kill()
    firsts = []
    for w in workers:
        first = w.wait_for(lambda w=w: w.steps_in(WORKERS - 1, t_kill, epoch), "survivor step")
        firsts.append(first[0][0])
    t_step = max(firsts)
    result = {"stall_s": t_step - t_kill}
    # One whole step in the new view, for the first step's floor: the median
    # gap between a survivor's next steps there.
    after = workers[0].wait_for(
        lambda: (s := workers[0].steps_in(WORKERS - 1, t_kill, epoch))[4:] and s,
        "survivor steps in the new view",
    )
    gaps = [b[0] - a[0] for a, b in zip(after[1:], after[2:], strict=False)]
    result["step_s"] = statistics.median(gaps)
    # Breakdown from the logs (ms timestamps).
    rlog = log_lines(replica.log_path)
    suspect = next((t for t, line in rlog if t >= t_kill - 0.002 and
                    f"suspect {victim.member_id}" in line), None)  # fmt: skip
    committed = None
    new_epoch = None
    if suspect is not None:
        for t, line in rlog:
            m = re.search(r"committed epoch (\d+)", line)
            if m and t >= suspect and int(m[1]) > epoch:
                committed, new_epoch = t, int(m[1])
                break
    entered = []
    if new_epoch is not None:
        for w in workers:
            te = next((t for t, line in log_lines(w.log_path)
                       if f"rollcall.worker INFO view {new_epoch}: " in line), None)  # fmt: skip
            if te is not None:
                entered.append(te)
    if suspect is not None:
        result["detect_s"] = max(0.0, suspect - t_kill)
        if committed is not None:
            result["rollcall_commit_s"] = committed - suspect
            if len(entered) == len(workers):
                result["group_rebuild_s"] = max(entered) - committed
                result["first_step_s"] = t_step - max(entered)
    return result


def hot_add_once(
    workers: list[Worker], address: str, token_file: Path, log: Path, extra: Sequence[str] = ()
) -> dict:
    wait_steady(workers, WORKERS, 3, 0)
    time.sleep(1.0)  # a baseline of step intervals
    t_start = time.time()
    joiner = Worker(address, token_file, log, extra)
    try:
        joiner.wait_joined()
        first = joiner.wait_for(lambda: joiner.steps_in(WORKERS + 1, 0), "joiner step")
        t_first = first[0][0]
        for w in workers:  # a few steps after the join
            w.wait_for(lambda w=w: len(w.steps_in(WORKERS + 1, t_first)) >= 3, "post-join steps")
        pulled = joiner.wait_for(joiner.pulled, "joiner pulled line", timeout=10)[-1]
        result = {
            "stall_s": stall_of(workers, t_start, t_first + 1),
            "join_to_first_step_s": t_first - t_start,
            "fetch_s": pulled["seconds"],
            "bytes": pulled["bytes"],
            "peers": pulled["peers"],
        }
        time.sleep(1.0)  # a baseline of step intervals in the larger view
        result.update(leave_once(workers, joiner))
        return result
    finally:
        joiner.interrupt()


def leave_once(workers: list[Worker], leaver: Worker) -> dict[str, float]:
    """``leaver`` leaves cleanly (SIGINT) while ``workers`` train with it.
    leave_stall_s: as the hot-add stall, the largest gap between an
    existing worker's consecutive steps from the signal until 1 s after
    its first step in the smaller view, minus its median step interval
    before (max over workers); leave_to_view_s: the signal -> every
    worker's first step in the smaller view."""
    t_leave = time.time()
    leaver.interrupt()
    firsts = []
    for w in workers:
        first = w.wait_for(lambda w=w: w.steps_in(WORKERS, t_leave), "step after the leave")
        firsts.append(first[0][0])
    t_view = max(firsts)
    for w in workers:
        w.wait_for(lambda w=w: len(w.steps_in(WORKERS, t_view + 1)) >= 1, "steps after the leave")
    return {
        "leave_stall_s": stall_of(workers, t_leave, t_view + 1),
        "leave_to_view_s": t_view - t_leave,
    }


def stall_of(workers: list[Worker], start: float, end: float) -> float:
    """The largest gap between a worker's consecutive steps that ends after
    ``start`` and begins before ``end``, minus its median step interval
    before ``start`` (its last 20); the largest over ``workers``."""
    stalls = []
    for w in workers:
        times = [t for t, _ in w.steps()]
        gaps = list(zip(times, times[1:], strict=False))
        median = statistics.median([b - a for a, b in gaps if b < start][-20:])
        stalls.append(max(b - a for a, b in gaps if b > start and a < end) - median)
    return max(stalls)


def raw_tcp(nbytes: int, repeats: int = 5) -> list[float]:
    """Seconds to move ``nbytes`` over loopback TCP (connect included)."""
    payload = os.urandom(nbytes)
    results = []
    for _ in range(repeats):
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]

        def serve(server: socket.socket = server) -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(payload)

        thread = threading.Thread(target=serve, daemon=True)
        t0 = time.perf_counter()
        thread.start()
        buf = bytearray(nbytes)
        view = memoryview(buf)
        got = 0
        with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
            while got < nbytes:
                n = client.recv_into(view[got:], nbytes - got)
                if n == 0:
                    break
                got += n
        results.append(time.perf_counter() - t0)
        thread.join(timeout=30)
        server.close()
        assert got == nbytes
    return results


def plain_group(rank: int, world: int, port: int) -> Any:
    """(Child process.) A plain gloo group over a TCPStore on loopback that
    rank 0 hosts on ``port``."""
    from torch.distributed import ProcessGroupGloo, TCPStore

    store = TCPStore("127.0.0.1", port, world, rank == 0, wait_for_workers=True,
                     timeout=timedelta(seconds=30))  # fmt: skip
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return ProcessGroupGloo(store, rank, world, options)


def plain_rank(rank: int, world: int, port: int, duration: float, out: Any) -> None:
    import torch

    from rollcall.worker.examples.lm import LMConfig, build, loss_sum

    torch.set_num_threads(1)
    model, optimizer, corpus = build(LMConfig(), 0)
    params = [p for p in model.parameters() if p.requires_grad]
    group = plain_group(rank, world, port)
    global_batch, micro = 32, 8
    n_micro = global_batch // micro
    mine = [i for i in range(n_micro) if i % world == rank]
    gen = torch.Generator().manual_seed(1)
    model.train()
    warmup, step, t0, cpu0, stop = 3, 0, 0.0, 0.0, False
    while not stop and step < 100_000:
        ids = torch.randint(len(corpus), (global_batch,), generator=gen).tolist()
        count, total = 0, 0.0
        for m in mine:
            torch.manual_seed(step * 1000 + m)
            samples = [corpus[i] for i in ids[m * micro : (m + 1) * micro]]
            inputs = torch.stack([s[0] for s in samples])
            targets = torch.stack([s[1] for s in samples])
            loss, n = loss_sum(model, inputs, targets)
            loss.backward()
            count += n
            total += float(loss.detach())
        grads = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in params
        ]
        done = 1.0 if rank == 0 and step >= warmup and time.perf_counter() - t0 > duration else 0.0
        flat = torch.cat([*grads, torch.tensor([float(count), total, done])])
        group.allreduce([flat]).wait()
        count_all = float(flat[-3])
        offset = 0
        for p in params:
            k = p.numel()
            p.grad = (flat[offset : offset + k] / count_all).view_as(p).clone()
            offset += k
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step == warmup:
            t0, cpu0 = time.perf_counter(), time.process_time()
        stop = float(flat[-1]) > 0
    out.put((rank, step - warmup, time.perf_counter() - t0, time.process_time() - cpu0))


def plain_loop(world: int, duration: float) -> tuple[float, float]:
    """Steps/s of rank 0 and CPU seconds per step of all ranks together."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=plain_rank, args=(r, world, port, duration, out), daemon=True)
        for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        ranks = sorted(out.get(timeout=duration + 120) for _ in range(world))
        _, steps, wall, _ = ranks[0]
        return steps / wall, sum(cpu for *_, cpu in ranks) / steps
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rollcall_rate(workers: list[Worker], duration: float) -> tuple[float, float]:
    """Steps/s (median over workers) and CPU seconds per step of all
    workers together, over ``duration`` seconds of steady training."""
    epoch = wait_steady(workers, WORKERS, 3, 0)
    t0 = time.time()
    cpu0 = sum(cpu_seconds(w.proc.pid) for w in workers)
    time.sleep(duration)
    cpu = sum(cpu_seconds(w.proc.pid) for w in workers) - cpu0
    t1 = time.time()
    rates, counts = [], []
    for w in workers:
        s = [(t, e) for t, e in w.steps_in(WORKERS, t0) if e["epoch"] == epoch and t <= t1]
        if len(s) < 2:
            raise RuntimeError("too few steps in the overhead window")
        rates.append((s[-1][1]["step"] - s[0][1]["step"]) / (s[-1][0] - s[0][0]))
        counts.append(len(s))
    return statistics.median(rates), cpu / statistics.median(counts)


def summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "median": statistics.median(values), "min": min(values),
            "max": max(values)}  # fmt: skip


class Cluster:
    """A real etcd and one rendezvous replica on loopback, and the workers
    started against them; everything is killed on exit."""

    def __init__(
        self, tmp: Path, extra: Sequence[str] = (), replica_extra: Sequence[str] = ()
    ) -> None:
        self.tmp = tmp
        #: Arguments every worker gets (model size, sharding), and the replica.
        self.extra = tuple(extra)
        self.replica_extra = tuple(replica_extra)
        self.procs: list[Proc] = []
        self.counter = 0
        client, peer, port = free_ports(3)
        self.etcd = LocalEtcd(data_dir=tmp / "etcd", client_port=client, peer_port=peer)
        self.token_file = tmp / "token"
        self.token_file.write_text(os.urandom(16).hex())
        self.address = f"127.0.0.1:{port}"

    def __enter__(self) -> Cluster:
        self.etcd.start()
        try:
            self.replica = Proc(
                [
                    sys.executable, "-m", "rollcall.cli", "rendezvous",
                    "--etcd", self.etcd.endpoint, "--listen", self.address, "--job", JOB,
                    "--token-file", str(self.token_file), "--log-level", "info",
                    *self.replica_extra,
                ],
                self.tmp / "replica.log",
            )  # fmt: skip
            self.procs.append(self.replica)
            self.replica.wait_for(
                lambda: any(x.startswith("rendezvous ready") for _, x in self.replica.lines),
                "replica ready", 30,
            )  # fmt: skip
        except BaseException:
            self.__exit__()
            raise
        return self

    def new_worker(self) -> Worker:
        self.counter += 1
        w = Worker(self.address, self.token_file, self.tmp / f"worker{self.counter}.log",
                   self.extra)  # fmt: skip
        self.procs.append(w)
        w.wait_joined()
        return w

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            try:
                p.kill()
            except Exception:  # noqa: BLE001 - reach every process
                pass
        self.etcd.stop()


def recovery(repeats: int) -> dict[str, Any]:
    """Crash and hot-add stalls; the state pulls they cause."""
    with tempfile.TemporaryDirectory(prefix="rollcall-recovery-") as tmp_name:
        tmp = Path(tmp_name)
        with Cluster(tmp) as cluster:
            workers = [cluster.new_worker() for _ in range(WORKERS)]
            print(f"{WORKERS} workers joined; waiting for steady training", flush=True)
            crashes = []
            for i in range(repeats):
                # Kill a different position each time (rank 0 is often the store host).
                crashes.append(crash_once(workers, cluster.replica, i % WORKERS))
                print(f"  crash {i + 1}: stall {crashes[-1]['stall_s']:.3f} s", flush=True)
                workers.append(cluster.new_worker())
            adds = []
            for i in range(repeats):
                adds.append(
                    hot_add_once(
                        workers, cluster.address, cluster.token_file, tmp / f"joiner{i}.log"
                    )
                )
                print(f"  hot-add {i + 1}: stall {adds[-1]['stall_s']:.3f} s, "
                      f"fetch {adds[-1]['fetch_s']:.3f} s", flush=True)  # fmt: skip
            pulled = []
            for p in cluster.procs:
                if isinstance(p, Worker):
                    pulled += p.pulled()
            for i in range(repeats):
                pulled += [
                    {"t": 0, "step": int(m[1]), "bytes": int(m[2]), "peers": int(m[3]),
                     "seconds": float(m[4])}
                    for m in PULLED.finditer((tmp / f"joiner{i}.log").read_text(errors="replace"))
                ]  # fmt: skip

    # Nothing of rollcall runs from here on: the raw TCP reference and the
    # floors run alone.
    nbytes = int(statistics.median([p["bytes"] for p in pulled]))
    raw = raw_tcp(nbytes)
    floor = floors(max(10, repeats))
    fetch_mbs = [p["bytes"] / p["seconds"] / 1e6 for p in pulled if p["seconds"] > 0]
    raw_mbs = [nbytes / s / 1e6 for s in raw]
    keys = ("stall_s", "detect_s", "rollcall_commit_s", "group_rebuild_s", "first_step_s",
            "step_s")  # fmt: skip
    return {
        "crash": {
            "samples": crashes,
            **{
                k: summary([c[k] for c in crashes if k in c])
                for k in keys
                if any(k in c for c in crashes)
            },
            "floors": floor,
        },  # fmt: skip
        "hot_add": {
            "samples": adds,
            **{
                k: summary([a[k] for a in adds])
                for k in ("stall_s", "join_to_first_step_s", "fetch_s")
            },
            "bytes": nbytes,
        },
        "leave": {
            k: summary([a[k] for a in adds]) for k in ("leave_stall_s", "leave_to_view_s")
        },
        "state_transfer_in_job": {
            "pulled": pulled,
            "bytes": nbytes,
            "fetch_MBps": summary(fetch_mbs),
            "raw_tcp_seconds": raw,
            "raw_tcp_MBps": summary(raw_mbs),
            "ratio": statistics.median(fetch_mbs) / statistics.median(raw_mbs),
        },
    }


# ------------------------------------------------------------- floors of the crash stall


def floor_detect(repeats: int, megabytes: int = 0) -> list[float]:
    """Seconds from SIGKILL of a process holding a loopback TCP connection
    to this process's blocked ``recv`` seeing the connection end: the floor
    of detecting a killed peer by its socket (the leader's session stream,
    a gloo neighbour). With ``megabytes``, the process has imported torch
    and touched that much memory first, as a worker has: the kernel frees a
    killed process's memory before it closes its sockets."""
    holder = "import socket, sys, time\n" \
        "if int(sys.argv[2]):\n" \
        "    import torch; ballast = torch.ones(int(sys.argv[2]) << 18)\n" \
        "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n" \
        "s.sendall(b'x'); time.sleep(120)\n"
    took = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(30)
        for _ in range(repeats):
            port = str(server.getsockname()[1])
            proc = subprocess.Popen([sys.executable, "-c", holder, port, str(megabytes)])
            try:
                conn, _ = server.accept()
                with conn:
                    conn.settimeout(30)
                    assert conn.recv(1) == b"x"
                    started = time.perf_counter()
                    proc.kill()
                    try:
                        end = conn.recv(1)
                    except ConnectionResetError:
                        end = b""
                    took.append(time.perf_counter() - started)
                    assert end == b""
            finally:
                proc.kill()
                proc.wait(timeout=10)
    return took


def floor_commit(repeats: int) -> list[float]:
    """Seconds of one etcd transaction like a view commit (compare a key's
    revision, put a 2 KiB record), on a fresh local etcd: the floor of the
    roll call's commit (the roll call adds one round trip over the members'
    session streams)."""
    import grpc
    from pyetcd import etcdrpc

    took = []
    with tempfile.TemporaryDirectory(prefix="rollcall-floor-") as tmp:
        etcd = LocalEtcd(data_dir=Path(tmp) / "etcd")
        etcd.start()
        try:
            with grpc.insecure_channel(etcd.endpoint.removeprefix("http://")) as channel:
                kv = etcdrpc.KVStub(channel)
                key, record = b"/floor/view", os.urandom(2048)
                revision = kv.Put(etcdrpc.PutRequest(key=key, value=record)).header.revision
                for _ in range(repeats + 3):  # three to warm up
                    compare = etcdrpc.Compare(
                        key=key, result=etcdrpc.Compare.EQUAL,
                        target=etcdrpc.Compare.MOD, mod_revision=revision,
                    )  # fmt: skip
                    put = etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key, value=record))
                    started = time.perf_counter()
                    answer = kv.Txn(etcdrpc.TxnRequest(compare=[compare], success=[put]))
                    took.append(time.perf_counter() - started)
                    assert answer.succeeded
                    revision = answer.header.revision
        finally:
            etcd.stop()
    return took[3:]


def rebuild_rank(rank: int, world: int, ports: list[int], start: Any, out: Any) -> None:
    """(Child process.) Build a fresh gloo group over a fresh TCPStore on
    each of ``ports`` in turn (rank 0 hosts it, as a rollcall rebuild), one
    1-element all-reduce each; the seconds each build took."""
    import torch

    torch.set_num_threads(1)
    took = []
    for port in ports:
        start.wait(timeout=60)
        started = time.perf_counter()
        group = plain_group(rank, world, port)
        group.allreduce([torch.zeros(1)]).wait()
        took.append(time.perf_counter() - started)
        start.wait(timeout=60)  # every rank done before the store goes
        del group
    out.put((rank, took))


def floor_rebuild(world: int, repeats: int) -> list[float]:
    """Seconds to build a gloo group of ``world`` ranks over a fresh TCPStore
    and complete one all-reduce (the slowest rank, each time), the ranks
    already started and torch imported: the floor of the group rebuild."""
    ctx = mp.get_context("spawn")
    out, start = ctx.Queue(), ctx.Barrier(world)
    ports = free_ports(repeats + 1)  # the first one warms up
    procs = [ctx.Process(target=rebuild_rank, args=(r, world, ports, start, out), daemon=True)
             for r in range(world)]  # fmt: skip
    try:
        for p in procs:
            p.start()
        ranks = [out.get(timeout=120 + 30 * repeats)[1] for _ in range(world)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [max(times) for times in zip(*ranks, strict=True)][1:]


#: Memory a worker of the default example holds (its RSS here, ~380 MB).
WORKER_MEGABYTES = 384


def floors(repeats: int) -> dict[str, Any]:
    """The floors of the crash stall's parts, measured alone (nothing of
    rollcall running)."""
    return {
        "detect_s": summary(floor_detect(repeats)),
        "detect_worker_sized_s": summary(floor_detect(repeats, WORKER_MEGABYTES)),
        "commit_s": summary(floor_commit(repeats)),
        "group_rebuild_s": summary(floor_rebuild(WORKERS - 1, repeats)),
    }


# ------------------------------------------------------------- sharded against replicated


#: The sharding part's models: the example's default and ~47x its parameters.
SHARD_MODELS = ((64, 2), (256, 8))
#: Replica settings per model. A member answers a roll call with the digest
#: of its state, which takes longer than the default 1 s deadline for the
#: larger model's 78 MB on this loaded 2-core machine: a member late with its
#: answer is left out of the view (and evicted). Both modes get the same.
SHARD_REPLICA = {(256, 8): ("--set", "rollcall_deadline=5")}
SHARD_REDUNDANCY = 2


def bytes_per_step(d_model: int, layers: int, sharded: bool) -> dict[str, int]:
    """What one rank sends per step at WORKERS ranks: the ring all-reduce of
    the gradients (2 (W-1)/W of them) and, sharded, its all-gather payload
    (the exact width ``ShardedOptimizer.payload`` pads to), sent to each of
    the W-1 others by gloo's ring."""
    import torch

    from rollcall.membership.shards import place
    from rollcall.worker.examples.lm import LMConfig, build
    from rollcall.worker.sharded import ShardedOptimizer

    model, optimizer, _ = build(LMConfig(d_model=d_model, layers=layers), 0)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    allreduce = 2 * (WORKERS - 1) * numel * 4 // WORKERS
    if not sharded:
        return {"parameters": numel, "allreduce": allreduce, "allgather": 0}
    ranks = [f"r{i}" for i in range(WORKERS)]
    plan = place(ranks, {}, 64, SHARD_REDUNDANCY)
    with torch.no_grad():
        width = ShardedOptimizer(optimizer, plan, ranks[0]).payload(ranks).numel()
    return {"parameters": numel, "allreduce": allreduce,
            "allgather": (WORKERS - 1) * width * 4}  # fmt: skip


def sharding(repeats: int, window: float) -> list[dict[str, Any]]:
    """Replicated and sharded (redundancy 2) runs of the same job, side by
    side at each of SHARD_MODELS: steps/s, bytes sent per rank per step, the
    crash and hot-add stalls."""
    runs = []
    for d_model, layers in SHARD_MODELS:
        size = ["--d-model", str(d_model), "--layers", str(layers)]
        for mode in ("replicated", "sharded"):
            extra = size + (["--shard-redundancy", str(SHARD_REDUNDANCY)]
                            if mode == "sharded" else [])  # fmt: skip
            with tempfile.TemporaryDirectory(prefix="rollcall-sharding-") as tmp_name:
                tmp = Path(tmp_name)
                with Cluster(tmp, extra, SHARD_REPLICA.get((d_model, layers), ())) as cluster:
                    workers = [cluster.new_worker() for _ in range(WORKERS)]
                    rate, cpu = rollcall_rate(workers, window)
                    crashes, adds = [], []
                    for i in range(repeats):
                        crashes.append(crash_once(workers, cluster.replica, i % WORKERS))
                        workers.append(cluster.new_worker())
                        adds.append(hot_add_once(workers, cluster.address, cluster.token_file,
                                                 tmp / f"joiner{i}.log", extra))  # fmt: skip
                    print(f"  d_model {d_model} x {layers}, {mode}: {rate:.2f} steps/s, crash "
                          f"{crashes[-1]['stall_s']:.3f} s, hot-add {adds[-1]['stall_s']:.3f} s",
                          flush=True)  # fmt: skip
            runs.append({
                "d_model": d_model, "layers": layers, "mode": mode,
                "steps_s": rate, "cpu_s_per_step": cpu,
                "bytes_per_rank_per_step": bytes_per_step(d_model, layers, mode == "sharded"),
                "crash_stall_s": summary([c["stall_s"] for c in crashes]),
                "hot_add_stall_s": summary([a["stall_s"] for a in adds]),
                "crashes": crashes, "hot_adds": adds,
            })  # fmt: skip
    return runs


# ----------------------------------------------------------- state transfer alone


def serve_state(d_model: int, layers: int, out: Any, stop: Any) -> None:
    """(Child process.) Serve the example LM's state, as a worker's state
    server would (gRPC and its data channel), and the same bytes over raw
    TCP (each connection gets the whole blob), until ``stop`` is set."""
    import asyncio

    import grpc
    import torch

    from rollcall.membership.config import Config
    from rollcall.membership.view import Member, View
    from rollcall.pb import state_pb2_grpc
    from rollcall.protocol.wire import TokenInterceptor
    from rollcall.worker.digest import digest
    from rollcall.worker.examples.lm import LMConfig, build, loss_sum
    from rollcall.worker.state import capture
    from rollcall.worker.state_bytes import to_bytes
    from rollcall.worker.transfer import Snapshot, StateServer

    torch.set_num_threads(1)
    model, optimizer, corpus = build(LMConfig(d_model=d_model, layers=layers), 0)
    inputs, targets = (torch.stack(t) for t in zip(*(corpus[i] for i in range(8)), strict=True))
    loss_sum(model, inputs, targets)[0].backward()
    optimizer.step()  # the AdamW moments exist from the first step on
    state = capture(1, model, optimizer, with_rng=False)  # as a worker serves it
    snap = Snapshot(1, digest(state), to_bytes(state))
    del model, optimizer, state
    view = View(epoch=1, members=(Member("source", "127.0.0.1:1"), Member("joiner", "x:2")))
    raw = socket.create_server(("127.0.0.1", 0))
    raw.settimeout(0.2)

    payload = memoryview(snap.data)

    def send_range(conn: socket.socket) -> None:
        with conn:
            asked = b""
            while len(asked) < RANGE.size:
                more = conn.recv(RANGE.size - len(asked))
                if not more:
                    return
                asked += more
            start, length = RANGE.unpack(asked)
            conn.sendall(payload[start : start + length])

    def send_raw() -> None:
        while not stop.is_set():
            try:
                conn, _ = raw.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            threading.Thread(target=send_range, args=(conn,), daemon=True).start()

    threading.Thread(target=send_raw, daemon=True).start()

    async def main() -> None:
        server = grpc.aio.server(interceptors=[TokenInterceptor(JOB)])

        async def no_store(epoch: int) -> int:
            raise RuntimeError("not hosted here")

        servicer = StateServer(
            JOB, Config(), lambda: "source", lambda: view, lambda: snap, no_store,
            epoch_secret=lambda _: EPOCH_SECRET,
        )  # fmt: skip
        state_pb2_grpc.add_StateTransferServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        out.put((port, raw.getsockname()[1], snap.digest, len(snap.data)))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        servicer.close()
        await server.stop(0)

    asyncio.run(main())


#: A raw receiver's request to ``serve_state``: (offset, length) of the blob.
RANGE = struct.Struct("<QQ")


def _fresh(nbytes: int, huge: bool = True) -> mmap.mmap:
    """Private memory not touched yet: huge pages advised (as the fetch's
    landing asks), or 4 KiB pages populated at once."""
    from rollcall.worker.landing import advise_huge_pages

    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if not huge:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    buffer = mmap.mmap(-1, nbytes, flags=flags)
    if huge:
        advise_huge_pages(buffer)
    return buffer


def _receive(port: int, view: memoryview, start: int, piece: int = 0) -> None:
    """Bytes [start, start + len(view)) of the blob into ``view`` over one
    connection (connect included); with ``piece``, the SHA-256 of each
    ``piece`` bytes as soon as they are in, as a fetch checks them."""
    from rollcall.worker.digest import piece_hash

    total = len(view)
    got = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        client.sendall(RANGE.pack(start, total))
        while got < total:
            begin, end = got, min(got + (piece or total), total)
            while got < end:
                n = client.recv_into(view[got:end], end - got, socket.MSG_WAITALL)
                if n == 0:
                    raise ConnectionError(f"raw receive ended after {got} of {total} bytes")
                got += n
            if piece:
                piece_hash(view[begin:end])


def raw_from(port: int, nbytes: int, buffer: Any = None, huge: bool = True) -> float:
    """Seconds to receive ``nbytes`` over one loopback TCP connection from
    another process (connect included), into ``buffer`` or, as a fetch
    must, into fresh memory: with ``huge``, private memory advised to use
    transparent huge pages (``advise_huge_pages``, as the fetch's landing
    does), faulted in by the receive; else 4 KiB pages populated at once
    (``MAP_POPULATE``), the fastest way measured without huge pages for
    one receiving thread here (a ``bytearray`` is close)."""
    started = time.perf_counter()
    if buffer is None:
        buffer = _fresh(nbytes, huge)
    _receive(port, memoryview(buffer)[:nbytes], 0)
    return time.perf_counter() - started


def raw_checked_from(port: int, nbytes: int, streams: int = 2) -> float:
    """Seconds to receive ``nbytes`` into fresh huge pages over ``streams``
    connections at once (a thread each, connects included), each hashing
    every ``PIECE_BYTES`` piece (SHA-256) as it lands: the least any fetch
    that checks what it receives costs on this machine, without the
    fetch's protocol (describe, admission, header, decode)."""
    from rollcall.worker.digest import PIECE_BYTES

    started = time.perf_counter()
    view = memoryview(_fresh(nbytes))
    pieces = -(-nbytes // PIECE_BYTES)
    bounds = [min(nbytes, pieces * i // streams * PIECE_BYTES) for i in range(streams + 1)]
    failures: list[BaseException] = []

    def receive(a: int, b: int) -> None:
        try:
            _receive(port, view[a:b], a, PIECE_BYTES)
        except BaseException as exc:  # a timing of bytes not all received is no figure
            failures.append(exc)

    threads = [
        threading.Thread(target=receive, args=(a, b))
        for a, b in zip(bounds, bounds[1:], strict=False)
        if b > a
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return time.perf_counter() - started


def transfer_alone(d_model: int, layers: int, repeats: int) -> dict[str, Any]:
    """A joiner's fetch (new channel, describe, data channel, pieces checked
    as they arrive) from a state server in another process, nothing else
    running, next to raw loopback TCP of the same bytes from that process."""
    import asyncio

    from rollcall.worker.state_bytes import from_bytes
    from rollcall.worker.transfer import StateFetcher

    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve_state, args=(d_model, layers, out, stop))
    server.start()
    try:
        port, raw_port, expected, nbytes = out.get(timeout=300)

        async def fetch_once() -> tuple[float, float]:
            fetcher = StateFetcher(JOB, "joiner", JOB, epoch_secret=lambda _: EPOCH_SECRET)
            try:
                blob, _, report = await fetcher.fetch([f"127.0.0.1:{port}"], 1, expected, 120)
            finally:
                await fetcher.close()
            started = time.perf_counter()  # the one pass at the end the fetch no longer makes
            from_bytes(blob, expect_digest=expected)
            return report.seconds, time.perf_counter() - started

        fetches, decodes, raw, small_pages, warm, checked = [], [], [], [], [], []
        reused = bytearray(nbytes)
        raw_from(raw_port, nbytes, reused)  # its pages touched once, before the first timing
        for _ in range(repeats):  # interleaved, so drifts hit all alike
            fetch_s, decode_s = asyncio.run(fetch_once())
            fetches.append(fetch_s)
            decodes.append(decode_s)
            raw.append(raw_from(raw_port, nbytes))
            small_pages.append(raw_from(raw_port, nbytes, huge=False))
            warm.append(raw_from(raw_port, nbytes, reused))
            checked.append(raw_checked_from(raw_port, nbytes))
        del reused
    finally:
        stop.set()
        server.join(timeout=10)
        if server.is_alive():
            server.kill()
            server.join(timeout=5)
    fetch_mbs = [nbytes / s / 1e6 for s in fetches]
    raw_mbs = [nbytes / s / 1e6 for s in raw]
    return {
        "d_model": d_model,
        "layers": layers,
        "bytes": nbytes,
        "fetch_s": summary(fetches),
        "decode_verify_s": summary(decodes),
        "fetch_MBps": summary(fetch_mbs),
        "raw_tcp_MBps": summary(raw_mbs),
        "raw_tcp_small_pages_MBps": summary([nbytes / s / 1e6 for s in small_pages]),
        "raw_tcp_warm_MBps": summary([nbytes / s / 1e6 for s in warm]),
        "raw_checked_MBps": summary([nbytes / s / 1e6 for s in checked]),
        "ratio_to_checked": statistics.median(fetch_mbs)
        / statistics.median(nbytes / s / 1e6 for s in checked),
        "ratio": statistics.median(fetch_mbs) / statistics.median(raw_mbs),
        "ratios": summary([f / r for f, r in zip(fetch_mbs, raw_mbs, strict=True)]),
    }


# ------------------------------------------------------------- per-step overhead


def overhead(rounds: int, window: float) -> dict[str, Any]:
    """Steps/s and CPU seconds per step of 4 fresh rollcall workers vs the
    plain gloo loop, in alternating order, one pair per round. On a shared
    machine the wall-clock rate moves with whatever else runs; CPU time per
    step (all processes, all threads) much less, so both are reported."""
    pairs = []
    for index in range(rounds):
        measured: dict[str, tuple[float, float]] = {}
        order = ("rollcall", "plain") if index % 2 == 0 else ("plain", "rollcall")
        for kind in order:
            if kind == "plain":
                measured[kind] = plain_loop(WORKERS, window)
                continue
            with tempfile.TemporaryDirectory(prefix="rollcall-overhead-") as tmp_name:
                with Cluster(Path(tmp_name)) as cluster:
                    workers = [cluster.new_worker() for _ in range(WORKERS)]
                    measured[kind] = rollcall_rate(workers, window)
        (rate, cpu), (plain_rate, plain_cpu) = measured["rollcall"], measured["plain"]
        pair = {
            "rollcall_steps_s": rate, "plain_steps_s": plain_rate,
            "overhead_pct": (plain_rate / rate - 1) * 100,
            "rollcall_cpu_ms_per_step": cpu * 1000, "plain_cpu_ms_per_step": plain_cpu * 1000,
            "cpu_overhead_pct": (cpu / plain_cpu - 1) * 100,
        }  # fmt: skip
        pairs.append(pair)
        print(f"  round {index + 1}: rollcall {rate:.2f}, plain {plain_rate:.2f} steps/s "
              f"({pair['overhead_pct']:+.1f} %); CPU {cpu * 1000:.0f} vs "
              f"{plain_cpu * 1000:.0f} ms/step ({pair['cpu_overhead_pct']:+.1f} %)",
              flush=True)  # fmt: skip
    return {
        "rounds": pairs,
        **{key: summary([p[key] for p in pairs]) for key in pairs[0]},
        "window_s": window,
    }


def print_table(r: dict[str, Any]) -> None:
    def ms(d: dict[str, Any], key: str) -> str:
        if key not in d:
            return "n/a"
        s = d[key]
        return (f"{s['median'] * 1000:7.1f} ms (min {s['min'] * 1000:.1f}, "
                f"max {s['max'] * 1000:.1f}, n={s['n']})")  # fmt: skip

    def rate(t: dict[str, Any], what: str) -> list[tuple[str, str]]:
        f, raw = t["fetch_MBps"], t["raw_tcp_MBps"]
        rows = [
            (f"state transfer {what}, {t['bytes'] / 1e6:.1f} MB: fetch",
             f"{f['median']:7.1f} MB/s (min {f['min']:.0f}, max {f['max']:.0f}, n={f['n']})"),
            ("  raw loopback TCP, same bytes",
             f"{raw['median']:7.1f} MB/s (min {raw['min']:.0f}, max {raw['max']:.0f}, "
             f"connect incl.{', fresh buffer' if 'raw_tcp_warm_MBps' in t else ''}"
             f"{', huge pages' if 'raw_tcp_small_pages_MBps' in t else ''})"),
        ]  # fmt: skip
        if "raw_tcp_small_pages_MBps" in t:
            small = t["raw_tcp_small_pages_MBps"]
            rows.append(("  raw, fresh 4 KiB pages (MAP_POPULATE)",
                         f"{small['median']:7.1f} MB/s (min {small['min']:.0f}, "
                         f"max {small['max']:.0f})"))  # fmt: skip
        if "raw_tcp_warm_MBps" in t:
            warm = t["raw_tcp_warm_MBps"]
            rows.append(("  raw, into a buffer already touched",
                         f"{warm['median']:7.1f} MB/s (min {warm['min']:.0f}, "
                         f"max {warm['max']:.0f})"))  # fmt: skip
        if "raw_checked_MBps" in t:
            c = t["raw_checked_MBps"]
            rows.append(("  raw + SHA-256 of each piece, 2 connections",
                         f"{c['median']:7.1f} MB/s (min {c['min']:.0f}, max {c['max']:.0f}; "
                         f"fetch / this {t['ratio_to_checked']:.2f})"))  # fmt: skip
        spread = t.get("ratios")
        rows.append(("  ratio fetch / raw",
                     f"{t['ratio']:7.2f} (aim >= 0.5"
                     + (", >= 1 GB/s" if t["bytes"] >= 5e8 else "") + ")"
                     + ("" if spread is None else
                        f"; per repeat {spread['min']:.2f}-{spread['max']:.2f}")))  # fmt: skip
        return rows

    def floor(c: dict[str, Any], key: str) -> str:
        return ms(c["floors"], key) if key in c.get("floors", {}) else "not measured"

    rows: list[tuple[str, str]] = []
    if "crash" in r:
        c, a = r["crash"], r["hot_add"]
        rows += [
            ("crash: stall (kill -> step on every survivor)", ms(c, "stall_s")),
            ("  detect (kill -> replica 'suspect')", ms(c, "detect_s")),
            ("    floor: kill -> peer's recv sees the socket end", floor(c, "detect_s")),
            (f"    same, the process holding {WORKER_MEGABYTES} MB",
             floor(c, "detect_worker_sized_s")),
            ("  roll call + commit (-> 'committed epoch')", ms(c, "rollcall_commit_s")),
            ("    floor: one etcd transaction (commit alone)", floor(c, "commit_s")),
            ("  group rebuild (-> last 'entered view')", ms(c, "group_rebuild_s")),
            ("    floor: gloo group of 3 on a fresh TCPStore", floor(c, "group_rebuild_s")),
            ("  first step (-> last survivor's step)", ms(c, "first_step_s")),
            ("    floor: a whole step in the new view (nothing kept)", ms(c, "step_s")),
            ("hot-add: stall of existing workers", ms(a, "stall_s")),
            ("  joiner start -> its first step", ms(a, "join_to_first_step_s")),
            ("  joiner state fetch", ms(a, "fetch_s") + f", {a['bytes']} bytes"),
        ]
        if "leave" in r:
            rows += [
                ("clean leave (SIGINT of the 5th): stall of the others",
                 ms(r["leave"], "leave_stall_s")),
                ("  signal -> every worker's step in the smaller view",
                 ms(r["leave"], "leave_to_view_s")),
            ]  # fmt: skip
        rows += rate(r["state_transfer_in_job"], "in the job")
    for t in r.get("state_transfer_alone", []):
        rows += rate(t, f"alone (d_model {t['d_model']}, {t['layers']} layers)")
        rows.append(("  decode + one digest pass (no longer in the fetch)",
                     ms(t, "decode_verify_s")))  # fmt: skip
    for run in r.get("sharding", []):
        b = run["bytes_per_rank_per_step"]
        sent = (b["allreduce"] + b["allgather"]) / 1e6
        rows += [
            (f"{run['mode']}, d_model {run['d_model']} x {run['layers']} "
             f"({b['parameters'] / 1e6:.2f} M parameters)",
             f"{run['steps_s']:7.2f} steps/s, {sent:.1f} MB sent per rank per step"),
            ("  crash stall / hot-add stall",
             f"{run['crash_stall_s']['median'] * 1000:7.1f} ms / "
             f"{run['hot_add_stall_s']['median'] * 1000:.1f} ms (median of "
             f"{run['crash_stall_s']['n']})"),
        ]  # fmt: skip
    if "overhead" in r:
        o = r["overhead"]
        pct, cpu = o["overhead_pct"], o["cpu_overhead_pct"]
        rows += [
            ("overhead: rollcall 4 workers",
             f"{o['rollcall_steps_s']['median']:7.2f} steps/s, "
             f"{o['rollcall_cpu_ms_per_step']['median']:.0f} CPU ms/step "
             f"(median of {pct['n']} rounds)"),
            ("  plain gloo loop, 4 processes",
             f"{o['plain_steps_s']['median']:7.2f} steps/s, "
             f"{o['plain_cpu_ms_per_step']['median']:.0f} CPU ms/step"),
            ("  overhead per round, steps/s",
             f"{pct['median']:7.1f} % (min {pct['min']:.1f}, max {pct['max']:.1f}; aim < 3 %)"),
            ("  overhead per round, CPU time per step",
             f"{cpu['median']:7.1f} % (min {cpu['min']:.1f}, max {cpu['max']:.1f})"),
        ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"{k:<{width}} | {v}")


#: State sizes of the stand-alone transfer (d_model, layers, fetches): the
#: example's default model (1.7 MB with its AdamW moments), a wider, deeper
#: one (~78 MB) and one of ~533 MB (fewer repeats: each moves ~1.6 GB).
TRANSFER_MODELS = ((64, 2, 10), (256, 8, 10), (512, 14, 5))
#: Parts run by default; "sharding" runs only when asked (--only sharding).
PARTS = ("recovery", "transfer", "overhead")
ALL_PARTS = (*PARTS, "sharding")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="crashes and hot-adds each")
    parser.add_argument("--rounds", type=int, default=5, help="overhead rounds (pairs)")
    parser.add_argument("--quick", action="store_true",
                        help="1 repeat, 2 overhead rounds of 5 s windows")  # fmt: skip
    parser.add_argument("--only", choices=ALL_PARTS, action="append",
                        help="run only this part (repeatable)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None,
                        help="where the results go (default results/recovery.json; "
                        "results/recovery-sharding.json for --only sharding, "
                        "results/recovery-transfer.json for --only transfer)")  # fmt: skip
    args = parser.parse_args()
    if not 1 <= args.repeats <= 20:
        parser.error("--repeats must be 1..20")
    if not 1 <= args.rounds <= 20:
        parser.error("--rounds must be 1..20")
    repeats = 1 if args.quick else args.repeats
    rounds = 2 if args.quick else args.rounds
    window = 5.0 if args.quick else 10.0
    parts = args.only or PARTS
    if args.json is None:
        alone = {("sharding",): "recovery-sharding.json", ("transfer",): "recovery-transfer.json"}
        args.json = ROOT / "bench" / "results" / alone.get(tuple(parts), "recovery.json")
    import torch

    started = time.monotonic()
    result: dict[str, Any] = {}
    if "recovery" in parts:
        result.update(recovery(repeats))
    if "transfer" in parts:
        result["state_transfer_alone"] = [
            transfer_alone(d_model, layers, 3 if args.quick else fetches)
            for d_model, layers, fetches in TRANSFER_MODELS
        ]
    if "overhead" in parts:
        result["overhead"] = overhead(rounds, window)
    if "sharding" in parts:
        result["sharding"] = sharding(repeats, window)
    print_table(result)
    result.update(
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        wall_s=time.monotonic() - started,
        machine={
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },  # fmt: skip
        versions={"torch": torch.__version__},
        parameters={
            "parts": list(parts),
            "workers": WORKERS,
            "repeats": repeats,
            "overhead_rounds": rounds,
            "quick": args.quick,
            "rate_window_s": window,
            "example": "lm (default LMConfig)",
            "transfer_models": [list(m) for m in TRANSFER_MODELS],  # d_model, layers, fetches
            "shard_models": [list(m) for m in SHARD_MODELS],
            "shard_redundancy": SHARD_REDUNDANCY,
            "shard_replica_settings": {f"{d}x{n}": list(v) for (d, n), v in SHARD_REPLICA.items()},
            "global_batch": 32,
            "micro_batch": 8,
            "threads": 1,
        },  # fmt: skip
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
