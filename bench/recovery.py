"""Recovery cost of real training workers: crash stall, hot-add stall, state
transfer throughput and failure-free per-step overhead.

    .venv/bin/python bench/recovery.py [--repeats 3] [--json FILE] [--quick]

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
   "entered view N"), first step (-> last survivor's first step event).
   A replacement is started after each repeat (its state fetch is also a
   throughput sample).
2. hot-add: a 5th worker joins while 4 train. stall = largest gap between
   consecutive step events of an existing worker around the join minus that
   worker's median step interval before the join (max over workers). Also the
   joiner's "pulled step ... (B bytes) ... in S s" log line. The 5th worker
   then leaves with SIGINT (clean Leave).
3. state transfer: B / S from every "pulled" line, next to a raw loopback TCP
   transfer of the same B (server thread + client thread in this process,
   connect included), measured in the same run while no worker runs.
4. overhead: steps/s of 4 failure-free rollcall workers (step events over a
   window) vs a plain loop: 4 spawned processes, same model/optimizer
   (`build(LMConfig(), 0)`), plain ProcessGroupGloo over a loopback TCPStore,
   same global batch 32 / micro batch 8 split (4 microbatches -> one per rank
   at 4 ranks), loss_sum + backward, one flat allreduce, divide, step;
   torch.set_num_threads(1).

Every wait is bounded; every process is killed in `finally`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rendezvous.etcd_local import LocalEtcd, free_port  # noqa: E402
from rollcall.tether import tethered  # noqa: E402

JOB = "recovery"
WORKERS = 4
TIMEOUT = 90.0
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
    def __init__(self, address: str, token_file: Path, log_path: Path) -> None:
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
                       if f"entered view {new_epoch} " in line), None)  # fmt: skip
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


def hot_add_once(workers: list[Worker], address: str, token_file: Path, log: Path) -> dict:
    wait_steady(workers, WORKERS, 3, 0)
    time.sleep(1.0)  # a baseline of step intervals
    t_start = time.time()
    joiner = Worker(address, token_file, log)
    try:
        joiner.wait_joined()
        first = joiner.wait_for(lambda: joiner.steps_in(WORKERS + 1, 0), "joiner step")
        t_first = first[0][0]
        for w in workers:  # a few steps after the join
            w.wait_for(lambda w=w: len(w.steps_in(WORKERS + 1, t_first)) >= 3, "post-join steps")
        stalls = []
        for w in workers:
            times = [t for t, _ in w.steps()]
            before = [b - a for a, b in zip(times, times[1:], strict=False) if b < t_start]
            median = statistics.median(before[-20:])
            around = [
                b - a
                for a, b in zip(times, times[1:], strict=False)
                if b > t_start and a < t_first + 1
            ]
            stalls.append(max(around) - median)
        pulled = joiner.wait_for(joiner.pulled, "joiner pulled line", timeout=10)[-1]
        return {
            "stall_s": max(stalls),
            "join_to_first_step_s": t_first - t_start,
            "fetch_s": pulled["seconds"],
            "bytes": pulled["bytes"],
            "peers": pulled["peers"],
        }
    finally:
        joiner.interrupt()


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


def plain_rank(rank: int, world: int, port: int, duration: float, out: Any) -> None:
    import torch
    from torch.distributed import ProcessGroupGloo, TCPStore

    from worker.examples.lm import LMConfig, build, loss_sum

    torch.set_num_threads(1)
    model, optimizer, corpus = build(LMConfig(), 0)
    params = [p for p in model.parameters() if p.requires_grad]
    store = TCPStore("127.0.0.1", port, world, rank == 0, wait_for_workers=True)
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    group = ProcessGroupGloo(store, rank, world, options)
    global_batch, micro = 32, 8
    n_micro = global_batch // micro
    mine = [i for i in range(n_micro) if i % world == rank]
    gen = torch.Generator().manual_seed(1)
    model.train()
    warmup, step, t0, stop = 3, 0, 0.0, False
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
            t0 = time.perf_counter()
        stop = float(flat[-1]) > 0
    if rank == 0:
        out.put((step - warmup) / (time.perf_counter() - t0))


def plain_loop(world: int, duration: float) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=plain_rank, args=(r, world, port, duration, out)) for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        return float(out.get(timeout=duration + 120))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def rollcall_rate(workers: list[Worker], duration: float) -> float:
    epoch = wait_steady(workers, WORKERS, 3, 0)
    t0 = time.time()
    time.sleep(duration)
    rates = []
    for w in workers:
        s = [(t, e) for t, e in w.steps_in(WORKERS, t0) if e["epoch"] == epoch]
        if len(s) < 2:
            raise RuntimeError("too few steps in the overhead window")
        rates.append((s[-1][1]["step"] - s[0][1]["step"]) / (s[-1][0] - s[0][0]))
    return statistics.median(rates)


def summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "median": statistics.median(values), "min": min(values),
            "max": max(values)}  # fmt: skip


def run(repeats: int, window: float) -> dict[str, Any]:
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rollcall-recovery-") as tmp_name:
        tmp = Path(tmp_name)
        etcd = LocalEtcd(data_dir=tmp / "etcd", client_port=free_port(), peer_port=free_port())
        etcd.start()
        procs: list[Proc] = []
        workers: list[Worker] = []
        counter = [0]

        def new_worker() -> Worker:
            counter[0] += 1
            w = Worker(address, token_file, tmp / f"worker{counter[0]}.log")
            procs.append(w)
            w.wait_joined()
            return w

        try:
            token_file = tmp / "token"
            token_file.write_text(os.urandom(16).hex())
            port = free_port()
            address = f"127.0.0.1:{port}"
            replica = Proc(
                [
                    sys.executable,
                    "-m",
                    "rollcall.cli",
                    "rendezvous",
                    "--etcd",
                    etcd.endpoint,
                    "--listen",
                    address,
                    "--job",
                    JOB,
                    "--token-file",
                    str(token_file),
                    "--log-level",
                    "info",
                ],  # fmt: skip
                tmp / "replica.log",
            )
            procs.append(replica)
            replica.wait_for(
                lambda: any(x.startswith("rendezvous ready") for _, x in replica.lines),
                "replica ready", 30,
            )  # fmt: skip
            for _ in range(WORKERS):
                workers.append(new_worker())
            print(f"{WORKERS} workers joined; waiting for steady training", flush=True)

            crashes = []
            for i in range(repeats):
                # Kill a different position each time (rank 0 is often the store host).
                crashes.append(crash_once(workers, replica, i % WORKERS))
                print(f"  crash {i + 1}: stall {crashes[-1]['stall_s']:.3f} s", flush=True)
                workers.append(new_worker())
            adds = []
            for i in range(repeats):
                adds.append(hot_add_once(workers, address, token_file, tmp / f"joiner{i}.log"))
                print(f"  hot-add {i + 1}: stall {adds[-1]['stall_s']:.3f} s, "
                      f"fetch {adds[-1]['fetch_s']:.3f} s", flush=True)  # fmt: skip
            rate = rollcall_rate(workers, window)
            print(f"  rollcall: {rate:.2f} steps/s", flush=True)
            pulled = []
            for p in procs:
                if isinstance(p, Worker):
                    pulled += p.pulled()
            for i in range(repeats):
                pulled += [
                    {"t": 0, "step": int(m[1]), "bytes": int(m[2]), "peers": int(m[3]),
                     "seconds": float(m[4])}
                    for m in PULLED.finditer((tmp / f"joiner{i}.log").read_text(errors="replace"))
                ]  # fmt: skip
        finally:
            for p in procs:
                try:
                    p.kill()
                except Exception:  # noqa: BLE001 - reach every process
                    pass
            etcd.stop()

    # Nothing of rollcall runs from here on.
    nbytes = int(statistics.median([p["bytes"] for p in pulled]))
    raw = raw_tcp(nbytes)
    fetch_mbs = [p["bytes"] / p["seconds"] / 1e6 for p in pulled if p["seconds"] > 0]
    raw_mbs = [nbytes / s / 1e6 for s in raw]
    plain = plain_loop(WORKERS, window)
    print(f"  plain loop: {plain:.2f} steps/s", flush=True)

    keys = ("stall_s", "detect_s", "rollcall_commit_s", "group_rebuild_s", "first_step_s")
    result["crash"] = {
        "samples": crashes,
        **{k: summary([c[k] for c in crashes if k in c]) for k in keys
           if any(k in c for c in crashes)},
    }  # fmt: skip
    result["hot_add"] = {
        "samples": adds,
        **{
            k: summary([a[k] for a in adds]) for k in ("stall_s", "join_to_first_step_s", "fetch_s")
        },  # fmt: skip
        "bytes": nbytes,
    }
    result["state_transfer"] = {
        "pulled": pulled,
        "bytes": nbytes,
        "fetch_MBps": summary(fetch_mbs),
        "raw_tcp_seconds": raw,
        "raw_tcp_MBps": summary(raw_mbs),
        "ratio": statistics.median(fetch_mbs) / statistics.median(raw_mbs),
    }
    result["overhead"] = {
        "rollcall_steps_s": rate,
        "plain_steps_s": plain,
        "overhead_pct": (plain / rate - 1) * 100,
        "window_s": window,
    }
    return result


def print_table(r: dict[str, Any]) -> None:
    def ms(d: dict[str, Any], key: str) -> str:
        if key not in d:
            return "n/a"
        s = d[key]
        return (f"{s['median'] * 1000:7.0f} ms (min {s['min'] * 1000:.0f}, "
                f"max {s['max'] * 1000:.0f}, n={s['n']})")  # fmt: skip

    c, a, t, o = r["crash"], r["hot_add"], r["state_transfer"], r["overhead"]
    rows = [
        ("crash: stall (kill -> step on every survivor)", ms(c, "stall_s")),
        ("  detect (kill -> replica 'suspect')", ms(c, "detect_s")),
        ("  roll call + commit (-> 'committed epoch')", ms(c, "rollcall_commit_s")),
        ("  group rebuild (-> last 'entered view')", ms(c, "group_rebuild_s")),
        ("  first step (-> last survivor's step)", ms(c, "first_step_s")),
        ("hot-add: stall of existing workers", ms(a, "stall_s")),
        ("  joiner start -> its first step", ms(a, "join_to_first_step_s")),
        ("  joiner state fetch", ms(a, "fetch_s") + f", {a['bytes']} bytes"),
        ("state transfer: fetch throughput",
         f"{t['fetch_MBps']['median']:7.1f} MB/s (n={t['fetch_MBps']['n']})"),
        ("  raw loopback TCP, same bytes",
         f"{t['raw_tcp_MBps']['median']:7.1f} MB/s (connect incl., n={t['raw_tcp_MBps']['n']})"),
        ("  ratio fetch / raw", f"{t['ratio']:7.2f} (aim >= 0.5)"),
        ("overhead: rollcall 4 workers", f"{o['rollcall_steps_s']:7.2f} steps/s"),
        ("  plain gloo loop, 4 processes", f"{o['plain_steps_s']:7.2f} steps/s"),
        ("  overhead", f"{o['overhead_pct']:7.1f} % (aim < 3 %)"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"{k:<{width}} | {v}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="crashes and hot-adds each")
    parser.add_argument("--quick", action="store_true", help="1 repeat, 5 s rate windows")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "recovery.json")
    args = parser.parse_args()
    if not 1 <= args.repeats <= 20:
        parser.error("--repeats must be 1..20")
    repeats = 1 if args.quick else args.repeats
    window = 5.0 if args.quick else 10.0
    import torch

    started = time.monotonic()
    result = run(repeats, window)
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
            "workers": WORKERS,
            "repeats": repeats,
            "quick": args.quick,
            "rate_window_s": window,
            "example": "lm (default LMConfig)",
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
