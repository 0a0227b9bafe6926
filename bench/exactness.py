"""Exact mode (Elastic(exact=True), docs/exactness.md): is it bit-exact
across world sizes and membership changes, and what does it cost?

    .venv/bin/python bench/exactness.py [--part compare|cost|all] [--quick]
        [--repeats 2] [--logs DIR]

One LocalEtcd for the whole run and, per run, a fresh `rollcall rendezvous`
process and job. Two parts:

- **compare**: per program and mode (exact, default) runs of the same number
  of steps with 1 worker, 2 and 4 workers uninterrupted (``--min-workers`` =
  the count, so every step runs at that size), and 3 workers of which two are
  SIGKILLed and replaced by joiners at different steps, as
  tests/test_exact_e2e.py does (the first kill at step 8, the second 15
  steps after the first joiner arrived; joiners use the same settings,
  ``--min-workers 3`` included). Programs: the built-in LM (`rollcall worker
  --digest-every 1 --json`, global batch 32, micro batch 8) and the CNN with
  BatchNorm (tests/programs/cnn_train.py --digests --save-state, global batch
  48, micro batch 8, no loader processes). Per run: the steps whose digest
  equals the 1-worker run's at that step (n/N; a step counts only if every
  worker that committed it had that digest) and, for the CNN, max |Δ| of
  every tensor of the saved final state (model, optimizer, scheduler) of
  every worker that finished against the 1-worker run's.
- **cost**: 3 workers of the LM at its default size and at ``--d-model 256
  --layers 8`` (~47x the parameters), exact mode vs default mode, and at the
  default size a plain gloo loop of the same LM (bench/jobs/torchrun_lm.py
  under `torchrun --standalone --nproc-per-node 3`; that script has no size
  flags, so at the large size only exact vs default). The configurations of
  one size are interleaved, and the order rotates between repeats. Per run,
  after a warm-up: committed steps/s over a window (first commit of each step
  by any worker) and the CPU time per step of the 3 training processes (all
  their threads, from /proc). Ratios are exact/default and default/plain of
  neighbouring runs (same repeat). Then, for where the time goes: a
  micro-benchmark in this process of rollcall.worker.exact.ExactStep's parts
  on the large model's gradients (2 ranks' share of 4 microbatches) and of
  gloo all-reduces of the same sizes between 2 spawned processes (float32
  as default mode sends, int64 as exact mode does, and the small MAX), and,
  if py-spy is installed, a sampled profile of one exact worker at the large
  size.

Every wait is bounded; everything started is killed at the end.
Results: bench/results/exactness-{compare,cost}.{json,md} (``--quick``:
exactness-{compare,cost}-quick.*).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peers import Child, descendants, git_commit, spread  # noqa: E402
from rollcall.etcd_local import LocalEtcd, free_port  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PROGRAMS = ("lm", "cnn")
MODES = ("exact", "default")
#: (label, workers, churn)
LAYOUTS = (("1 worker", 1, False), ("2 workers", 2, False), ("4 workers", 4, False),
           ("3 workers, 2 kills + 2 joins", 3, True))  # fmt: skip
LARGE = (256, 8)
COST_WORKERS = 3
PATIENCE = 240.0
FB = "forward + backward (one microbatch)"
PY_SPY = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")


@dataclass(frozen=True)
class Settings:
    quick: bool
    repeats: int
    steps: dict[str, int]
    #: per size: (warm-up steps, window seconds, minimum window steps)
    window: dict[str, tuple[int, float, int]]
    micro_repeats: int


def settings_for(quick: bool, repeats: int) -> Settings:
    if quick:
        return Settings(True, repeats, {"lm": 200, "cnn": 400},
                        {"default": (10, 8.0, 20), "large": (2, 15.0, 4)}, 3)  # fmt: skip
    return Settings(False, repeats, {"lm": 300, "cnn": 600},
                    {"default": (10, 15.0, 40), "large": (3, 30.0, 8)}, 5)  # fmt: skip


# -------------------------------------------------------------------- a job


@dataclass
class Proc:
    key: str
    child: Child
    records: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    killed: bool = False

    def steps(self) -> list[dict[str, Any]]:
        return [r for _, r in list(self.records) if r.get("event") == "step"]

    def last_step(self) -> int:
        return max((int(r["step"]) for r in self.steps()), default=-1)

    def world(self) -> int:
        steps = self.steps()
        return int(steps[-1]["world"]) if steps else 0


class Job:
    """One rendezvous process and one job on the shared etcd; workers of one
    program started into it."""

    def __init__(self, etcd: LocalEtcd, tmp: Path, name: str) -> None:
        self.tmp, self.name = tmp, name
        tmp.mkdir(parents=True, exist_ok=True)
        self.token = os.urandom(16).hex()
        self.token_file = tmp / "token"
        self.token_file.write_text(self.token)
        self.address = f"127.0.0.1:{free_port()}"
        self.procs: list[Proc] = []
        self.infra: list[Child] = []
        replica = Child(
            [sys.executable, "-m", "rollcall.cli", "rendezvous", "--etcd", etcd.endpoint,
             "--listen", self.address, "--job", name, "--token-file", str(self.token_file),
             "--log-level", "info"],
            tmp / "rendezvous.log", {}, lambda t, r: None,
        )  # fmt: skip
        self.infra.append(replica)
        deadline = time.monotonic() + 60
        while not any(x.startswith("rendezvous ready") for x in replica.lines):
            if time.monotonic() > deadline or not replica.alive():
                self.close()
                raise RuntimeError("rendezvous did not start")
            time.sleep(0.05)

    def spawn(self, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        key = f"{self.name}-{len(self.procs)}"
        holder: list[Proc] = []

        def on_record(t: float, record: dict[str, Any]) -> None:
            if holder:
                holder[0].records.append((t, record))

        child = Child(argv, self.tmp / f"{key}.log", env or {}, on_record)
        proc = Proc(key, child)
        holder.append(proc)
        self.procs.append(proc)
        return proc

    def worker_argv(
        self, program: str, mode: str, steps: int, min_workers: int, extra: list[str],
        states: Path | None,
    ) -> tuple[list[str], dict[str, str]]:  # fmt: skip
        exact = ["--exact"] if mode == "exact" else []
        if program == "lm":
            return [
                sys.executable, "-m", "rollcall.cli", "worker", "--rendezvous", self.address,
                "--job", self.name, "--token-file", str(self.token_file), "--json",
                "--steps", str(steps), "--threads", "1", "--min-workers", str(min_workers),
                "--global-batch", "32", "--micro-batch", "8", *exact, *extra,
            ], {}  # fmt: skip
        assert states is not None
        return [
            sys.executable, str(ROOT / "tests" / "programs" / "cnn_train.py"),
            "--steps", str(steps), "--digests", "--save-state", str(states),
            "--min-workers", str(min_workers), "--loader-workers", "0", *exact, *extra,
        ], {"ROLLCALL_RENDEZVOUS": self.address, "ROLLCALL_JOB": self.name,
            "ROLLCALL_TOKEN": self.token}  # fmt: skip

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.child.kill()
        for c in reversed(self.infra):
            with contextlib.suppress(Exception):
                c.kill()


def wait_for(check: Callable[[], Any], what: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what} ({timeout:.0f} s)")


def wait_exits(job: Job, procs: list[Proc], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        left = max(1.0, deadline - time.monotonic())
        try:
            code = p.child.proc.wait(timeout=left)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"{p.key} did not finish within {timeout:.0f} s") from exc
        if code != 0:
            raise RuntimeError(f"{p.key} exited with {code} (log {p.child.log})")


# ------------------------------------------------------------------- compare


def tensors(tree: object, prefix: str = "") -> Iterator[tuple[str, Any]]:
    import torch

    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key in sorted(tree, key=str):
            yield from tensors(tree[key], f"{prefix}/{key}")
    elif isinstance(tree, (list, tuple)):
        for index, item in enumerate(tree):
            yield from tensors(item, f"{prefix}/{index}")


def compare_run(etcd: LocalEtcd, tmp: Path, program: str, mode: str, layout: tuple[str, int, bool],
                steps: int, index: int) -> dict[str, Any]:  # fmt: skip
    label, workers, churn = layout
    name = f"cmp{index}-{program}-{mode}-{workers}{'c' if churn else ''}"
    states = tmp / name / "states"
    states.mkdir(parents=True)
    job = Job(etcd, tmp / name, name)
    out: dict[str, Any] = {"layout": label, "workers": workers, "churn": churn}
    started = time.monotonic()

    def start() -> Proc:
        extra = ["--digest-every", "1"] if program == "lm" else []
        argv, env = job.worker_argv(program, mode, steps, workers, extra, states)
        return job.spawn(argv, env)

    try:
        team = [start() for _ in range(workers)]
        if churn:
            events = []
            kill_at = 8
            for _ in range(2):
                wait_for(lambda at=kill_at: min(p.last_step() for p in team) >= at,
                         f"step {kill_at}", PATIENCE)  # fmt: skip
                victim = team.pop(0)  # rank 0 first, then a survivor
                killed_after = victim.last_step()
                victim.killed = True
                victim.child.proc.send_signal(signal.SIGKILL)
                wait_for(lambda: all(p.world() == 2 for p in team), "the view to shrink", PATIENCE)
                team.append(start())
                wait_for(lambda: all(p.world() == 3 for p in team), "the joiner", PATIENCE)
                joined_at = min(int(r["step"]) for r in team[-1].steps())
                events.append({"killed_after_step": killed_after, "joiner_first_step": joined_at})
                kill_at = max(p.last_step() for p in team) + 15
            out["events"] = events
        wait_exits(job, [p for p in job.procs if not p.killed], PATIENCE)
    except Exception as exc:  # noqa: BLE001 - recorded, the next run goes on
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(f"    FAILED: {out['error']}", flush=True)
    finally:
        job.close()
    by_step: dict[int, set[str]] = {}
    worlds: set[int] = set()
    for p in job.procs:
        for r in p.steps():
            by_step.setdefault(int(r["step"]), set()).add(str(r.get("digest")))
            worlds.add(int(r["world"]))
    out["digests"] = {str(s): sorted(d) for s, d in sorted(by_step.items())}
    out["worlds"] = sorted(worlds)
    out["states"] = sorted(str(p) for p in states.glob("*.pt"))
    out["seconds"] = time.monotonic() - started
    return out


def state_diff(reference: Path, others: list[str]) -> dict[str, Any]:
    """max |Δ| over every tensor of each saved state against ``reference``."""
    import torch

    want = dict(tensors(torch.load(reference, weights_only=True)))
    worst, worst_name, unequal, total = 0.0, "", 0, 0
    for path in others:
        got = dict(tensors(torch.load(path, weights_only=True)))
        if got.keys() != want.keys():
            return {"error": f"{path}: different tensors"}
        for name, value in want.items():
            total += 1
            if torch.equal(got[name], value):
                continue
            unequal += 1
            delta = float((got[name].double() - value.double()).abs().max())
            if delta > worst:
                worst, worst_name = delta, name
    return {"max_abs_delta": worst, "worst_tensor": worst_name, "unequal_tensors": unequal,
            "tensors_compared": total, "states": len(others)}  # fmt: skip


def run_compare(etcd: LocalEtcd, tmp: Path, settings: Settings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    index = 0
    for program in PROGRAMS:
        steps = settings.steps[program]
        for mode in MODES:
            runs = []
            for layout in LAYOUTS:
                print(f"  {program} {mode}: {layout[0]} ({steps} steps)", flush=True)
                runs.append(compare_run(etcd, tmp, program, mode, layout, steps, index))
                index += 1
            out[f"{program}/{mode}"] = summarize_compare(program, mode, steps, runs)
            for run in runs:  # compared in full above; the JSON keeps 16 hex digits of each
                run["digests"] = {k: [d[:23] for d in v] for k, v in run["digests"].items()}
            for row in out[f"{program}/{mode}"]["rows"]:
                print(f"    {row['layout']}: {row['equal_steps']}/{steps} steps equal"
                      + (f", max |Δ| {row['max_abs_delta']:.3g}"
                         if row.get("max_abs_delta") is not None else ""), flush=True)  # fmt: skip
    return out


def summarize_compare(
    program: str, mode: str, steps: int, runs: list[dict[str, Any]]
) -> dict[str, Any]:
    reference = runs[0]
    ref = reference["digests"]
    rows = []
    for run in runs:
        got = run["digests"]
        equal = sum(1 for s in map(str, range(steps))
                    if got.get(s) == ref.get(s) and len(ref.get(s, [])) == 1)  # fmt: skip
        first_diff = next((s for s in range(steps) if got.get(str(s)) != ref.get(str(s))), None)
        row: dict[str, Any] = {
            "layout": run["layout"], "equal_steps": equal, "steps": steps,
            "committed_steps": len(run["digests"]), "first_differing_step": first_diff,
            "worlds": run["worlds"], "events": run.get("events"), "error": run.get("error"),
            "seconds": run["seconds"],
            "ranks_disagree_steps": sum(1 for d in run["digests"].values() if len(d) > 1),
        }  # fmt: skip
        if program == "cnn" and reference["states"] and run["states"]:
            row.update(state_diff(Path(reference["states"][0]), run["states"]))
        rows.append(row)
    return {"program": program, "mode": mode, "steps": steps, "rows": rows, "runs": runs}


def compare_table(result: dict[str, Any]) -> str:
    head = ["program", "mode", *[label for label, _, _ in LAYOUTS]]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * len(LAYOUTS)]
    for s in result.values():
        cells = []
        for row in s["rows"]:
            cell = f"{row['equal_steps']}/{row['steps']}"
            if row.get("max_abs_delta") is not None:
                cell += f", max \\|Δ\\| {row['max_abs_delta']:.3g}"
            if row.get("error"):
                cell += " (failed)"
            cells.append(cell)
        lines.append(f"| {s['program']} | {s['mode']} | " + " | ".join(cells) + " |")
    notes = []
    for s in result.values():
        for row in s["rows"]:
            if row["events"]:
                ev = "; ".join(f"killed after step {e['killed_after_step']}, joiner's first step "
                               f"{e['joiner_first_step']}" for e in row["events"])  # fmt: skip
                notes.append(f"- {s['program']} {s['mode']}, churn: {ev}; worlds seen "
                             f"{row['worlds']}")  # fmt: skip
            if row["first_differing_step"] is not None and row["layout"] != LAYOUTS[0][0]:
                notes.append(f"- {s['program']} {s['mode']}, {row['layout']}: first differing "
                             f"step {row['first_differing_step']}")  # fmt: skip
            if row.get("error"):
                notes.append(f"- {s['program']} {s['mode']}, {row['layout']}: {row['error']}")
    return "\n".join(lines + ([""] + notes if notes else []))


# ---------------------------------------------------------------------- cost


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def training_pids(job: Job, plain: bool) -> list[int]:
    if not plain:
        return [p.child.proc.pid for p in job.procs]
    pids = []
    for pid in descendants(job.procs[0].child.proc.pid):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if any(c.endswith(b"torchrun_lm.py") for c in cmd[:3]):
                pids.append(pid)
    return pids


def cost_run(etcd: LocalEtcd, tmp: Path, config: str, size: str, settings: Settings,
             index: int, profile: Path | None) -> dict[str, Any]:  # fmt: skip
    warmup, seconds, min_steps = settings.window[size]
    d_model, layers = LARGE if size == "large" else (64, 2)
    name = f"cost{index}-{size}-{config}"
    out: dict[str, Any] = {"config": config, "size": size}
    plain = config == "plain"
    if plain:
        job = Job.__new__(Job)
        job.tmp, job.name, job.procs, job.infra = tmp / name, name, [], []
        job.tmp.mkdir(parents=True)
        (job.tmp / "ckpt").mkdir()
        job.spawn([
            str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nnodes=1",
            f"--nproc-per-node={COST_WORKERS}", str(ROOT / "bench" / "jobs" / "torchrun_lm.py"),
            "--checkpoint-dir", str(job.tmp / "ckpt"), "--checkpoint-every", "1000000000",
            "--global-batch", "32", "--micro-batch", "8",
        ], {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})  # fmt: skip
    else:
        job = Job(etcd, tmp / name, name)
        size_flags = ["--d-model", str(d_model), "--layers", str(layers)]
        for _ in range(COST_WORKERS):
            argv, env = job.worker_argv("lm", config, 10_000_000, COST_WORKERS, size_flags, None)
            job.spawn(argv, env)
    try:

        def first_commits() -> dict[int, float]:
            first: dict[int, float] = {}
            for p in job.procs:
                for t, r in list(p.records):
                    if r.get("event") == "step":
                        s = int(r["step"])
                        first[s] = min(t, first.get(s, t))
            return first

        wait_for(lambda: len(first_commits()) > warmup, f"{warmup} warm-up steps", PATIENCE)
        pids = training_pids(job, plain)
        if len(pids) != COST_WORKERS:
            raise RuntimeError(f"found {len(pids)} training processes")
        t0 = time.time()
        cpu0 = sum(cpu_seconds(pid) for pid in pids)
        s0 = max(first_commits())
        wait_for(lambda: time.time() - t0 >= seconds and max(first_commits()) - s0 >= min_steps,
                 "the window", PATIENCE)  # fmt: skip
        cpu1 = sum(cpu_seconds(pid) for pid in pids)
        first = first_commits()
        s1 = max(first)
        times = [first[s] for s in range(s0, s1 + 1) if s in first]
        intervals = [b - a for a, b in zip(times, times[1:], strict=False)]
        out.update({
            "steps": s1 - s0, "window_s": first[s1] - first[s0],
            "steps_per_s": (s1 - s0) / (first[s1] - first[s0]),
            "samples_per_s": 32 * (s1 - s0) / (first[s1] - first[s0]),
            "median_step_s": statistics.median(intervals),
            "cpu_s_per_step": (cpu1 - cpu0) / (s1 - s0),
            "load_average": os.getloadavg()[0],
        })  # fmt: skip
        if profile is not None:  # after the window: py-spy's sampling slows the process
            out["profile"] = py_spy(pids[-1], min(seconds, 20.0), profile)
    except Exception as exc:  # noqa: BLE001 - recorded, the next run goes on
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(f"    FAILED: {out['error']}", flush=True)
    finally:
        job.close()
    return out


def py_spy(pid: int, seconds: float, path: Path) -> dict[str, Any]:
    """Sample ``pid`` for ``seconds``; the functions with most samples
    (self time, and inclusive time for the exact mode's parts)."""
    raw = path.with_suffix(".txt")
    argv = [PY_SPY, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "50",
            "--format", "raw", "--output", str(raw), "--nonblocking", "--threads"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60)
    if proc.returncode != 0 or not raw.exists():
        return {"error": (proc.stderr or proc.stdout)[-500:]}
    self_time: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    training = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        count = int(count_text)
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        total += count
        if not any("train" in f or "steps" in f or "commit" in f for f in frames):
            continue  # another thread (control, gRPC)
        training += count
        leaf = frames[-1]
        self_time[leaf] = self_time.get(leaf, 0) + count
        for f in set(frames):
            inclusive[f] = inclusive.get(f, 0) + count
    top_self = sorted(self_time.items(), key=lambda x: -x[1])[:12]
    top_incl = sorted(((f, n) for f, n in inclusive.items() if "exact.py" in f or "group.py" in f
                       or "runtime.py" in f), key=lambda x: -x[1])[:15]  # fmt: skip
    return {"samples": total, "training_thread_samples": training,
            "self": [{"frame": f, "share": n / max(1, training)} for f, n in top_self],
            "inclusive": [{"frame": f, "share": n / max(1, training)} for f, n in top_incl],
            "raw": str(raw)}  # fmt: skip


# ------------------------------------------------------------ micro-benchmark


def flat_divide(grads: list[Any]) -> Any:
    import torch

    return torch.cat(grads) / 8.0


def _allreduce_rank(rank: int, port: int, numel: int, count: int, repeats: int, out: Any) -> None:
    import torch
    from torch.distributed import ProcessGroupGloo, ReduceOp, TCPStore

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, 2, rank == 0, wait_for_workers=True)
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    group = ProcessGroupGloo(store, rank, 2, options)
    cases = {
        "float32 SUM (default mode)": (torch.zeros(numel, dtype=torch.float32), ReduceOp.SUM),
        "int64 SUM (exact mode)": (torch.zeros(numel, dtype=torch.int64), ReduceOp.SUM),
        "int64 MAX of exponents": (torch.zeros(count, dtype=torch.int64), ReduceOp.MAX),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):
        for key, (tensor, op) in cases.items():
            opts = torch.distributed.AllreduceOptions()
            opts.reduceOp = op
            group.allreduce([tensor], opts).wait()  # both ranks in step
            t0 = time.perf_counter()
            group.allreduce([tensor], opts).wait()
            times[key].append(time.perf_counter() - t0)
    out.put((rank, times))


def allreduce_micro(numel: int, count: int, repeats: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, numel, count, repeats, out),
                         daemon=True) for r in range(2)]  # fmt: skip
    try:
        for p in procs:
            p.start()
        results = dict(out.get(timeout=300) for _ in range(2))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return {k: statistics.median(v) for k, v in results[0].items()}


def exact_micro(repeats: int) -> dict[str, Any]:
    """ExactStep's parts on the large LM: one rank holding 2 of 4
    microbatches (as rank 0 of 3 workers does), a collective that returns at
    once (the all-reduces are timed apart, over gloo)."""
    import torch

    from rollcall.worker.exact import ExactStep
    from rollcall.worker.examples.lm import LMConfig, build, loss_sum

    torch.set_num_threads(1)
    model, _, corpus = build(LMConfig(d_model=LARGE[0], layers=LARGE[1]), 0)
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    exact = ExactStep(params, None, 4)
    gen = torch.Generator().manual_seed(0)
    timings: dict[str, list[float]] = {}

    def timed(key: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        value = fn()
        timings.setdefault(key, []).append(time.perf_counter() - t0)
        return value

    for _ in range(repeats):
        exact.begin()
        for index in range(2):
            ids = torch.randint(len(corpus), (8,), generator=gen).tolist()
            inputs = torch.stack([corpus[i][0] for i in ids])
            targets = torch.stack([corpus[i][1] for i in ids])
            exact.start(index)
            t0 = time.perf_counter()
            loss, n = loss_sum(model, inputs, targets)
            loss.backward()
            timings.setdefault(FB, []).append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            exact.took(index, float(loss.detach()), n)
            timings.setdefault("took: keep the microbatch's gradients", []).append(
                time.perf_counter() - t0
            )
        exponents = timed("exponents (abs max per tensor and microbatch)", exact._exponents)
        scales = [int(e) for e in exponents[:-1]]
        payload = timed("quantise to int64 and sum locally", partial(exact._payload, scales))
        count = int(payload[-3].sum()) or 1

        def back(
            payload: list[Any] = payload, scales: list[int] = scales, count: int = count
        ) -> None:
            for summed, e in zip(payload[: len(params)], scales, strict=True):
                exact._gradient(summed, e, count, False).to(torch.float32)

        timed("back to float, divide (per tensor)", back)
        exact._taken.clear()
        # what default mode does instead, on gradients of the same sizes
        grads = [torch.randn(p.numel()) for p in params]
        timed("default mode: flatten (torch.cat) + divide", partial(flat_divide, grads))
    parts = {k: statistics.median(v) for k, v in timings.items()}
    return {"parameters": numel, "tensors": len(params), "median_s": parts}


# ------------------------------------------------------------------ cost run


def run_cost(
    etcd: LocalEtcd, tmp: Path, settings: Settings, profile_dir: Path | None
) -> dict[str, Any]:
    sizes = {"default": ("plain", "default", "exact"), "large": ("default", "exact")}
    runs: dict[str, list[dict[str, Any]]] = {}
    index = 0
    for repeat in range(settings.repeats):
        for size, configs in sizes.items():
            shift = repeat % len(configs)
            for config in configs[shift:] + configs[:shift]:
                profile = None
                if profile_dir and repeat == 0 and size == "large" and config == "exact":
                    profile = profile_dir / "py-spy-exact-large"
                print(f"  repeat {repeat + 1}, {size} size, {config}", flush=True)
                run = cost_run(etcd, tmp, config, size, settings, index, profile)
                run["repeat"] = repeat
                index += 1
                runs.setdefault(size, []).append(run)
                if "steps_per_s" in run:
                    print(f"    {run['samples_per_s']:.1f} samples/s, median step "
                          f"{run['median_step_s'] * 1000:.0f} ms, CPU "
                          f"{run['cpu_s_per_step'] * 1000:.0f} ms/step, "
                          f"load {run['load_average']:.1f}", flush=True)  # fmt: skip
    out: dict[str, Any] = {"sizes": {}}
    for size, size_runs in runs.items():
        by: dict[str, dict[int, dict[str, Any]]] = {}
        for r in size_runs:
            if "steps_per_s" in r:
                by.setdefault(r["config"], {})[r["repeat"]] = r

        def ratios(a: str, b: str, key: str, higher_is_faster: bool, by: Any = by) -> list[float]:
            pairs = [(by[a][k], by[b][k]) for k in by.get(a, {}) if k in by.get(b, {})]
            if higher_is_faster:
                return [y[key] / x[key] for x, y in pairs]  # time(a)/time(b)
            return [x[key] / y[key] for x, y in pairs]

        summary: dict[str, Any] = {
            c: {"samples_per_s": spread([r["samples_per_s"] for r in rs.values()]),
                "median_step_s": spread([r["median_step_s"] for r in rs.values()]),
                "cpu_s_per_step": spread([r["cpu_s_per_step"] for r in rs.values()])}
            for c, rs in by.items()
        }  # fmt: skip
        for a, b in (("exact", "default"), ("default", "plain"), ("exact", "plain")):
            summary[f"{a}_over_{b}_time"] = spread(ratios(a, b, "steps_per_s", True))
            summary[f"{a}_over_{b}_cpu"] = spread(ratios(a, b, "cpu_s_per_step", False))
        out["sizes"][size] = {"summary": summary, "runs": size_runs}
    print("  micro-benchmark: ExactStep's parts (large LM)", flush=True)
    try:
        out["micro_exact"] = exact_micro(settings.micro_repeats)
        numel = out["micro_exact"]["parameters"]
        print("  micro-benchmark: gloo all-reduce, 2 processes", flush=True)
        out["micro_allreduce"] = {"numel": numel, "median_s": allreduce_micro(
            numel, out["micro_exact"]["tensors"] + 1, settings.micro_repeats)}  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        out["micro_error"] = f"{type(exc).__name__}: {exc}"
    return out


def fmt(s: dict[str, float] | None, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
    if not s:
        return "—"
    med = s["median"] * scale
    if s["n"] == 1 or s["min"] == s["max"]:
        return f"{med:.{digits}f}{unit}"
    return f"{med:.{digits}f}{unit} [{s['min'] * scale:.{digits}f}–{s['max'] * scale:.{digits}f}]"


def pct(s: dict[str, float] | None) -> str:
    if not s:
        return "—"

    def p(x: float) -> str:
        return f"{(x - 1) * 100:+.1f} %"

    if s["n"] == 1:
        return p(s["median"])
    return f"{p(s['median'])} [{p(s['min'])} … {p(s['max'])}]"


def cost_table(result: dict[str, Any], params: dict[str, int]) -> str:
    lines = ["| size | config | samples/s | median step | CPU per step (3 processes) |",
             "|---|---|---:|---:|---:|"]  # fmt: skip
    for size, s in result["sizes"].items():
        for config in ("plain", "default", "exact"):
            c = s["summary"].get(config)
            if not c:
                continue
            label = f"{size} ({params[size] / 1e6:.2f} M parameters)"
            lines.append(f"| {label} | {config} | {fmt(c['samples_per_s'], digits=1)} | "
                         f"{fmt(c['median_step_s'], 1000, 0, ' ms')} | "
                         f"{fmt(c['cpu_s_per_step'], 1000, 0, ' ms')} |")  # fmt: skip
    lines += ["", "| size | exact vs default, time per step | exact vs default, CPU per step | "
              "default vs plain, time | default vs plain, CPU | exact vs plain, time |",
              "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for size, s in result["sizes"].items():
        m = s["summary"]
        keys = ("exact_over_default_time", "exact_over_default_cpu", "default_over_plain_time",
                "default_over_plain_cpu", "exact_over_plain_time")  # fmt: skip
        lines.append(f"| {size} | " + " | ".join(pct(m[k]) for k in keys) + " |")
    if "micro_exact" in result:
        me = result["micro_exact"]
        lines += ["", f"ExactStep's parts, in this process, large LM ({me['parameters']:,} "
                  f"parameters in {me['tensors']} tensors), one rank with 2 of 4 microbatches, "
                  "median:", "", "| part | ms |", "|---|---:|"]  # fmt: skip
        for k, v in me["median_s"].items():
            lines.append(f"| {k} | {v * 1000:.1f} |")
    if "micro_allreduce" in result:
        ma = result["micro_allreduce"]
        lines += ["", f"gloo all-reduce between 2 processes, {ma['numel']:,} elements, median:",
                  "", "| all-reduce | ms |", "|---|---:|"]  # fmt: skip
        for k, v in ma["median_s"].items():
            lines.append(f"| {k} | {v * 1000:.1f} |")
    for size, s in result["sizes"].items():
        for r in s["runs"]:
            prof = r.get("profile")
            if prof and "self" in prof:
                lines += ["", f"py-spy, one exact worker at the {size} size, "
                          f"{prof['training_thread_samples']} samples of the training thread; "
                          "share of them:", "", "| frame (self) | share |",
                          "|---|---:|"]  # fmt: skip
                lines += [f"| `{x['frame']}` | {x['share'] * 100:.1f} % |"
                          for x in prof["self"][:8]]  # fmt: skip
                lines += ["", "| frame (inclusive) | share |", "|---|---:|"]
                lines += [f"| `{x['frame']}` | {x['share'] * 100:.1f} % |"
                          for x in prof["inclusive"][:10]]  # fmt: skip
            if r.get("error"):
                lines.append(f"- {size} {r['config']} (repeat {r['repeat'] + 1}): {r['error']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- main


def param_counts() -> dict[str, int]:
    from rollcall.worker.examples.lm import LMConfig, build

    counts = {}
    for size, (d, layers) in {"default": (64, 2), "large": LARGE}.items():
        model, _, _ = build(LMConfig(d_model=d, layers=layers), 0)
        counts[size] = sum(p.numel() for p in model.parameters())
    return counts


def header(result: dict[str, Any], settings: Settings) -> str:
    m = result["machine"]
    return (f"Measured {result['date']}, {m['cpus']} cores, load average "
            f"{m['load_average_start'][0]:.1f} at start, {m['load_average_end'][0]:.1f} at end "
            f"(the machine was shared); {'quick' if settings.quick else 'full'} run; "
            f"torch {result['versions']['torch']}, rollcall "
            f"{str(result['versions']['rollcall_commit'])[:10]}.\n\n")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("compare", "cost", "all"), default="all")
    parser.add_argument(
        "--quick", action="store_true",
        help="compare: 200/400 steps, not 300/600; cost: shorter windows",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=2, help="cost: rounds of each config")
    parser.add_argument("--logs", type=Path, default=None, help="keep every process's log here")
    args = parser.parse_args()
    if not 1 <= args.repeats <= 10:
        parser.error("--repeats must be 1..10")
    settings = settings_for(args.quick, args.repeats)
    suffix = "-quick" if args.quick else ""
    import torch

    with contextlib.ExitStack() as stack:
        if args.logs is None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="exactness-")))
        else:
            tmp = args.logs
            tmp.mkdir(parents=True, exist_ok=True)
        etcd = LocalEtcd(data_dir=tmp / "etcd")
        etcd.start()
        stack.callback(etcd.stop)
        for part in ("compare", "cost") if args.part == "all" else (args.part,):
            started = time.monotonic()
            result: dict[str, Any] = {
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": {
                    "cpus": os.cpu_count(),
                    "load_average_start": list(os.getloadavg()),
                    "platform": platform.platform(),
                },  # fmt: skip
                "versions": {
                    "torch": torch.__version__,
                    "rollcall_commit": git_commit(),
                    "python": platform.python_version(),
                },  # fmt: skip
                "parameters": {"quick": settings.quick, "part": part},
            }
            print(f"{part}:", flush=True)
            if part == "compare":
                result["parameters"].update({"steps": settings.steps, "layouts": LAYOUTS,
                                             "lm": "rollcall worker, global batch 32, micro 8",
                                             "cnn": "tests/programs/cnn_train.py, global batch 48, "
                                                    "micro batch 8"})  # fmt: skip
                result["programs"] = run_compare(etcd, tmp, settings)
                md = compare_table(result["programs"])
            else:
                counts = param_counts()
                result["parameters"].update({"workers": COST_WORKERS, "repeats": settings.repeats,
                                             "window": settings.window, "large": LARGE,
                                             "parameter_counts": counts})  # fmt: skip
                profile_dir = tmp if Path(PY_SPY).exists() else None
                result.update(run_cost(etcd, tmp, settings, profile_dir))
                md = cost_table(result, counts)
            result["machine"]["load_average_end"] = list(os.getloadavg())
            result["wall_s"] = time.monotonic() - started
            print()
            print(md)
            path = RESULTS / f"exactness-{part}{suffix}.json"
            path.write_text(json.dumps(result, indent=2, default=str) + "\n")
            path.with_suffix(".md").write_text(header(result, settings) + md + "\n")
            print(f"wrote {path} and .md ({result['wall_s']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
