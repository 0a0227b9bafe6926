"""View-change latency, join throughput and idle cost of the control plane.

    .venv/bin/python bench/view_change.py [--sizes 64,512,2048,4096] [--repeats 5]
        [--processes 8] [--idle-window 10] [--json FILE]
    .venv/bin/python bench/view_change.py --idle-check 300 [--sizes 2048]

For each size N: a fresh real etcd and one rendezvous replica (the
`rollcall` CLI, its own process) on loopback, and N lightweight members
(``RendezvousClient``, no torch) spread over ``--processes`` child processes
(multiprocessing, spawn), so that no single harness process has to carry
every session. Once in a view, each member holds step 1 (as a worker that
trained would, so that roll calls check every member's claim). Each member
stamps the arrival of every view with ``time.monotonic()`` (CLOCK_MONOTONIC
is system-wide on Linux, so stamps of different processes compare) and the
parent, which triggers the events, computes the latencies from them:

- join burst: N members join at once; throughput = N / (time until every
  member holds a view with all N);
- idle: the rendezvous process's CPU seconds per second over
  ``--idle-window`` seconds with every member idle (from /proc/PID/stat),
  per member; the harness processes' CPU over the same window is reported
  beside it (they share the machine's cores);
- leave: one member leaves cleanly; latency = Leave call -> new view;
- crash: one member's session is dropped without a Leave (as a killed
  process would); latency = drop -> new view;
- join: one member joins; latency = Join call -> the view with it (includes
  the `join_settle` batching window, 50 ms by default).

Beside each, the time from the trigger to the commit in etcd as the
service logged it (the leader's own part: roll call and commit; the rest
is announcing and the members taking the view in).

"first" is the first member to receive the new view, "last" the last one.
Every event must produce exactly one view change that removes or adds the
member concerned; anything else is counted as an anomaly and printed.

``--profile DIR`` samples the service with py-spy (only samples holding
the GIL: its Python CPU) during the join burst, the idle window and the
events, and
prints the share of samples per function of interest (``PROFILE_KEYS``).

``--idle-check SECONDS`` holds the members (of the first size, 2048 by
default in this mode) idle for that long after the burst and fails (exit 1)
if any view change happened or any member's session ended meanwhile: no
healthy member may be suspected.

Prints a table and writes JSON (default bench/results/view_change.json, or
bench/results/view_change-idle.json for --idle-check). A size that fails (a
burst that does not complete, a view that does not reach every member in
time) is said, listed under "failed" and the next size runs; the exit
status is then 1. Every loop is bounded
in count and time (--repeats, timeouts per event and per size).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rollcall.etcd_local import LocalEtcd, free_ports  # noqa: E402
from rollcall.membership.config import Config  # noqa: E402
from rollcall.membership.view import View  # noqa: E402
from rollcall.protocol.carrier import SessionCarrier  # noqa: E402
from rollcall.protocol.client import RendezvousClient  # noqa: E402

JOB = "bench"
#: Longest wait for one event's view to reach every member.
EVENT_TIMEOUT = 60.0
#: Longest wait for a join burst to end (every member holding the full view).
BURST_TIMEOUT = 300.0
#: Longest the service may take to start.
START_TIMEOUT = 30.0
MAX_SIZE = 8192
MAX_IDLE_CHECK = 900.0
#: Longest a profile records (a safety bound; each is stopped after its phase).
MAX_PROFILE_S = 900.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: What the service logs when the heartbeat detector suspects a member, and
#: when its loop woke up late (suspicions deferred).
DETECTOR_SUSPICION = ": heartbeat detector"
LAG_WARNING = "replica lagging"
#: The service's log line of a commit (its default format starts with asctime).
COMMITTED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .* committed epoch (\d+):")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50_ms": statistics.median(values) * 1000,
        "p90_ms": percentile(values, 0.9) * 1000,
        "max_ms": max(values) * 1000,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (/proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


# --- a host process: its share of the members --------------------------------------


@dataclass
class Hosted:
    """One member of a host process and the views it received."""

    client: RendezvousClient
    #: (epoch, size, arrival) of every view received, in order.
    views: list[tuple[int, int, float]] = field(default_factory=list)


class Host:
    """The members of one child process, driven by commands from the parent."""

    def __init__(self, address: str, token: str, index: int, shared: bool) -> None:
        self.address, self.token, self.index = address, token, index
        self.members: list[Hosted] = []
        self._port = 20000 + index * 1000
        #: The host's shared session stream (``--sessions shared``), made
        #: inside the event loop on first use.
        self._shared = shared
        self._carrier: SessionCarrier | None = None

    async def join_one(self) -> Hosted:
        if self._shared and self._carrier is None:
            self._carrier = SessionCarrier([self.address], JOB, self.token, Config())
        client = RendezvousClient([self.address], JOB, self.token, Config(), carrier=self._carrier)
        hosted = Hosted(client)

        def on_view(view: View) -> None:
            hosted.views.append((view.epoch, view.size, time.monotonic()))
            if client.step is None and client.member_id in view:
                # Holds step 1 from now on (reported with its next
                # heartbeat), as a worker that trained would: roll calls
                # then check every member's claim, as in a real job.
                client.note_progress(1)

        self._port += 1
        await client.join(f"127.0.0.1:{self._port}", name=f"h{self.index}", on_view=on_view)
        self.members.append(hosted)
        return hosted

    def ended(self) -> list[str]:
        return [f"{m.client.member_id}: {m.client.ended}" for m in self.members if m.client.ended]

    async def _until(self, done: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline or self.ended():
                return False
            await asyncio.sleep(0.005)
        return True

    async def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command["op"]
        if op == "burst":
            count = command["count"]
            await asyncio.gather(*(self.join_one() for _ in range(count)))
            return {"ids": [m.client.member_id for m in self.members]}
        if op == "await_size":
            size = command["size"]

            def full() -> bool:
                return all(m.client.view.size >= size for m in self.members)

            ok = await self._until(full, command["timeout"])
            arrivals = [next((t for _, s, t in m.views if s >= size), None) for m in self.members]
            epochs = [e for m in self.members for e, _, _ in m.views]
            return {"ok": ok, "arrivals": arrivals, "epochs": sorted(set(epochs)),
                    "ended": self.ended()}  # fmt: skip
        if op == "await_epoch":
            after = command["after"]

            def moved() -> bool:
                return all(m.client.view.epoch > after for m in self.members)

            ok = await self._until(moved, command["timeout"])
            firsts = []
            for m in self.members:
                first = next(((e, t) for e, _, t in m.views if e > after), None)
                firsts.append(first)
            return {
                "ok": ok,
                "arrivals": firsts,
                "views": [list(m.client.view.ids) for m in self.members[:1]],
                "ended": self.ended(),
            }
        if op in ("leave", "crash"):
            victim = self.members.pop() if op == "leave" else self.members.pop(0)
            member_id = victim.client.member_id
            t0 = time.monotonic()
            if op == "leave":
                await victim.client.leave()
            await victim.client.close()
            return {"t0": t0, "id": member_id}
        if op == "join":
            t0 = time.monotonic()
            hosted = await self.join_one()
            return {"t0": t0, "id": hosted.client.member_id}
        if op == "state":
            return {
                "epochs": sorted({m.client.view.epoch for m in self.members}),
                "ended": self.ended(),
                "count": len(self.members),
            }
        if op == "close":
            await asyncio.gather(*(m.client.close() for m in self.members))
            self.members.clear()
            if self._carrier is not None:
                await self._carrier.close()
            return {}
        raise ValueError(f"unknown command {op!r}")


def host_main(conn: Connection, address: str, token: str, index: int, shared: bool) -> None:
    """Entry point of a child process: run its members until told to close."""

    async def serve() -> None:
        host = Host(address, token, index, shared)
        loop = asyncio.get_running_loop()
        commands: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        def read() -> None:  # a thread: Connection.recv blocks
            while True:
                try:
                    command = conn.recv()
                except EOFError:
                    command = None
                loop.call_soon_threadsafe(commands.put_nowait, command)
                if command is None or command["op"] == "close":
                    return

        threading.Thread(target=read, daemon=True).start()
        while True:
            command = await commands.get()
            if command is None:
                await host.handle({"op": "close"})
                return
            try:
                reply = await host.handle(command)
            except Exception as exc:  # reported to the parent, which stops
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            conn.send(reply)
            if command["op"] == "close":
                return

    asyncio.run(serve())


# --- the parent ----------------------------------------------------------------------


class Fleet:
    """The child processes and the commands sent to them."""

    def __init__(self, address: str, token: str, processes: int, shared: bool) -> None:
        context = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for index in range(processes):
            parent, child = context.Pipe()
            proc = context.Process(
                target=host_main, args=(child, address, token, index, shared), daemon=True
            )
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self._turn = 0

    def ask(self, index: int, command: dict[str, Any], timeout: float) -> dict[str, Any]:
        conn = self.conns[index]
        conn.send(command)
        if not conn.poll(timeout):
            raise TimeoutError(f"host {index} did not answer {command['op']} in {timeout:.0f} s")
        reply = conn.recv()
        if "error" in reply:
            raise RuntimeError(f"host {index}: {reply['error']}")
        return reply

    def ask_all(self, command: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        for conn in self.conns:
            conn.send(command)
        deadline = time.monotonic() + timeout
        replies = []
        for index, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"host {index} did not answer {command['op']}")
            reply = conn.recv()
            if "error" in reply:
                raise RuntimeError(f"host {index}: {reply['error']}")
            replies.append(reply)
        return replies

    def next_host(self) -> int:
        self._turn = (self._turn + 1) % len(self.conns)
        return self._turn

    def harness_cpu(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.procs if p.pid is not None)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send({"op": "close"})
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


class Service:
    """A fresh etcd and one rendezvous replica, in a temporary directory."""

    def __init__(self, settings: list[str]) -> None:
        self.settings = settings
        self.token = secrets.token_urlsafe(16)
        self._tmp = tempfile.TemporaryDirectory(prefix="rollcall-bench-")
        tmp = Path(self._tmp.name)
        client, peer, self.port = free_ports(3)
        self.etcd = LocalEtcd(data_dir=tmp / "etcd", client_port=client, peer_port=peer)
        self.log_path = tmp / "rendezvous.log"
        self.address = f"127.0.0.1:{self.port}"
        self.replica: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        tmp = Path(self._tmp.name)
        self.etcd.start()
        token_file = tmp / "token"
        token_file.write_text(self.token)
        self._log = open(self.log_path, "wb")
        self.replica = subprocess.Popen(
            [
                sys.executable, "-m", "rollcall.cli", "rendezvous",
                "--etcd", self.etcd.endpoint, "--listen", self.address, "--job", JOB,
                "--token-file", str(token_file), "--log-level", "info",
                *(arg for item in self.settings for arg in ("--set", item)),
            ],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=self._log,
        )  # fmt: skip
        assert self.replica.stdout is not None
        ready = threading.Event()
        line: list[str] = []

        def read_line() -> None:
            assert self.replica is not None and self.replica.stdout is not None
            line.append(self.replica.stdout.readline().decode())
            ready.set()

        threading.Thread(target=read_line, daemon=True).start()
        if not ready.wait(START_TIMEOUT) or not line[0].startswith("rendezvous ready"):
            raise SystemExit(f"rendezvous did not start: {line!r}")

    @property
    def pid(self) -> int:
        assert self.replica is not None
        return self.replica.pid

    def log_tail(self, lines: int = 40) -> list[str]:
        self._log.flush()
        return self.log_path.read_text(errors="replace").splitlines()[-lines:]

    def log_count(self, needle: str) -> int:
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return sum(needle in line for line in lines)

    def committed_at(self) -> dict[int, float]:
        """Epoch -> when the service logged its commit, on this machine's
        monotonic clock (the log's wall-clock stamps have millisecond
        resolution)."""
        self._log.flush()
        offset = time.time() - time.monotonic()
        found = {}
        for line in self.log_path.read_text(errors="replace").splitlines():
            match = COMMITTED.match(line)
            if match:
                wall = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found[int(match[2])] = wall - offset
        return found

    def stop(self, keep_log: Path | None = None) -> None:
        if self.replica is not None:
            self.replica.terminate()
            try:
                self.replica.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.replica.kill()
                self.replica.wait(timeout=10)
            self._log.close()
            if keep_log is not None:
                keep_log.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(self.log_path, keep_log)
        self.etcd.stop()
        self._tmp.cleanup()


#: Where the leader spends its time, by the functions a sample passes
#: through (a sample counts for every one it passes through; py-spy names
#: methods Class.name).
PROFILE_KEYS = {
    "session message handled (_on_message)": "_on_message",
    "  of which the detector (heard)": "heard",
    "session send loop (Session)": "Session",
    "session read loop (_read_session)": "_read_session",
    "session opened (_open)": "_open",
    "leader's loop (_drive)": "_drive",
    "roll-call requests (_ask)": "_ask",
    "view commit (_commit)": "_commit",
    "announcement (_announce)": "_announce",
    "join (Join)": "Join",
    "  of which recording the member (_enrol)": "_enrol",
    "etcd requests, in the etcd threads (EtcdClient.call)": "EtcdClient.call",
    "view to protobuf (view_to_pb)": "view_to_pb",
    "view to JSON (View.to_json)": "View.to_json",
    "etcd keep-alive round (_keep_alive)": "_keep_alive",
    "  of which member leases (_keep_members)": "_keep_members",
    "view guard poll (_poll_view_forever)": "_poll_view_forever",
    "logging (emit)": "emit",
}


class Profile:
    """py-spy sampling the service (only samples holding the GIL: the
    Python CPU) into collapsed stacks, while a phase runs."""

    def __init__(self, pid: int, path: Path) -> None:
        self.path = path
        spy = Path(sys.executable).with_name("py-spy")
        if not spy.exists():
            raise SystemExit(f"--profile needs py-spy beside {sys.executable}: pip install py-spy")
        self._proc = subprocess.Popen(
            [str(spy), "record", "-p", str(pid), "-f", "raw", "-o", str(path), "--gil",
             "--nolineno", "--nonblocking", "-r", "200", "-d", str(int(MAX_PROFILE_S))],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self._started = time.monotonic()

    def stop(self) -> dict[str, Any]:
        """End the recording; the share of samples per ``PROFILE_KEYS`` entry
        and the functions most often on top of the stack."""
        elapsed = time.monotonic() - self._started
        self._proc.send_signal(signal.SIGINT)
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        stacks: list[tuple[list[str], int]] = []
        if self.path.exists():
            for line in self.path.read_text(errors="replace").splitlines():
                frames, _, count = line.rpartition(" ")
                if frames and count.isdigit():
                    names = [f.split(" (")[0] for f in frames.split(";")]
                    stacks.append((names, int(count)))
        total = sum(count for _, count in stacks) or 1
        def passes(names: list[str], key: str) -> bool:
            return any(n == key or n.endswith("." + key) for n in names)

        shares = {
            label: sum(c for names, c in stacks if passes(names, key)) / total
            for label, key in PROFILE_KEYS.items()
        }
        tops: dict[str, int] = {}
        for names, count in stacks:
            frame = names[-1] if names else "?"
            tops[frame] = tops.get(frame, 0) + count
        top = sorted(tops.items(), key=lambda item: -item[1])[:12]
        return {
            "seconds": elapsed,
            "samples": total,
            "gil_share": total / (elapsed * 200),
            "shares": shares,
            "top_self": [(name, count / total) for name, count in top],
            "file": str(self.path),
        }


def print_profile(title: str, profile: dict[str, Any]) -> None:
    print(f"  profile {title}: {profile['samples']} samples holding the GIL in "
          f"{profile['seconds']:.0f} s ({profile['gil_share']:.0%} of the time)")  # fmt: skip
    for label, share in profile["shares"].items():
        if share >= 0.005:
            print(f"    {share:6.1%}  {label}")
    print("    on top of the stack: " + ", ".join(
        f"{name} {share:.0%}" for name, share in profile["top_self"][:8]))  # fmt: skip


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


class Run:
    """One size: the burst, the idle window and the events."""

    def __init__(self, service: Service, fleet: Fleet, size: int) -> None:
        self.service, self.fleet, self.size = service, fleet, size
        self.first: dict[str, list[float]] = {"leave": [], "crash": [], "join": []}
        self.last: dict[str, list[float]] = {"leave": [], "crash": [], "join": []}
        #: Trigger -> the service logged the commit in etcd (the leader's part).
        self.commit: dict[str, list[float]] = {"leave": [], "crash": [], "join": []}
        self.anomalies: list[str] = []
        self.epoch = 0

    def burst(self) -> dict[str, Any]:
        counts = split(self.size, len(self.fleet.conns))
        t0 = time.monotonic()
        for conn, count in zip(self.fleet.conns, counts, strict=True):
            conn.send({"op": "burst", "count": count})
        deadline = t0 + BURST_TIMEOUT
        for index, conn in enumerate(self.fleet.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"host {index}: joins did not end in {BURST_TIMEOUT:.0f} s")
            reply = conn.recv()
            if "error" in reply:
                raise RuntimeError(f"host {index}: {reply['error']}")
        joined = time.monotonic() - t0
        replies = self.fleet.ask_all(
            {"op": "await_size", "size": self.size,
             "timeout": max(1.0, deadline - time.monotonic())},
            BURST_TIMEOUT,
        )  # fmt: skip
        if not all(r["ok"] for r in replies):
            ended = [e for r in replies for e in r["ended"]]
            raise RuntimeError(f"join burst of {self.size} did not complete; ended: {ended[:5]}")
        last = max(t for r in replies for t in r["arrivals"])
        epochs = sorted({e for r in replies for e in r["epochs"]})
        self.epoch = self.state()
        return {
            "join_burst_s": last - t0,
            "join_calls_s": joined,
            "join_throughput_per_s": self.size / (last - t0),
            "views_during_burst": len(epochs),
        }

    def state(self) -> int:
        replies = self.fleet.ask_all({"op": "state"}, EVENT_TIMEOUT)
        epochs = sorted({e for r in replies for e in r["epochs"]})
        ended = [e for r in replies for e in r["ended"]]
        if len(epochs) != 1 or ended:
            raise RuntimeError(f"members disagree: epochs {epochs}, ended {ended[:5]}")
        return epochs[0]

    def idle(self, window: float) -> dict[str, float]:
        """CPU of the service and of the harness over ``window`` seconds
        of idle members."""
        pid = self.service.pid
        service0, harness0, t0 = cpu_seconds(pid), self.fleet.harness_cpu(), time.monotonic()
        time.sleep(window)
        elapsed = time.monotonic() - t0
        service = (cpu_seconds(pid) - service0) / elapsed
        harness = (self.fleet.harness_cpu() - harness0) / elapsed
        if self.state() != self.epoch:
            self.anomalies.append(f"a view change during the idle window at {self.size}")
        return {
            "idle_window_s": elapsed,
            "leader_cpu_per_s": service,
            "leader_cpu_per_s_per_member": service / self.size,
            "harness_cpu_per_s": harness,
        }

    def event(self, kind: str) -> str:
        """One event of ``kind`` on the next host; returns the member concerned."""
        before = self.epoch
        host = self.fleet.next_host()
        started = self.fleet.ask(host, {"op": kind}, EVENT_TIMEOUT)
        replies = self.fleet.ask_all(
            {"op": "await_epoch", "after": before, "timeout": EVENT_TIMEOUT}, EVENT_TIMEOUT + 10
        )
        if not all(r["ok"] for r in replies):
            ended = [e for r in replies for e in r["ended"]]
            raise RuntimeError(f"{kind} at {self.size}: the view did not reach every member; "
                               f"ended: {ended[:5]}")  # fmt: skip
        arrivals = [a for r in replies for a in r["arrivals"]]
        epochs = {e for e, _ in arrivals}
        ids = set(replies[0]["views"][0])
        self.epoch = self.state()
        expected = (started["id"] in ids) == (kind == "join")
        if epochs != {before + 1} or self.epoch != before + 1 or not expected:
            self.anomalies.append(
                f"{kind} at {self.size}: views {sorted(epochs)} after epoch {before}, "
                f"now {self.epoch}, {started['id']} {'in' if started['id'] in ids else 'not in'} "
                "the view"
            )
        times = [t for _, t in arrivals]
        self.first[kind].append(min(times) - started["t0"])
        self.last[kind].append(max(times) - started["t0"])
        committed = self.service.committed_at().get(before + 1)
        if committed is not None:
            self.commit[kind].append(committed - started["t0"])
        return str(started["id"])

    def events(self, repeats: int) -> None:
        for _ in range(repeats):
            self.event("leave")
            self.event("join")  # restores the size
            self.event("crash")
            self.event("join")


def run_size(args: argparse.Namespace, size: int) -> dict[str, Any]:
    service = Service(args.settings)
    fleet: Fleet | None = None
    try:
        service.start()
        fleet = Fleet(service.address, service.token, args.processes, args.sessions == "shared")
        fleet.ask_all({"op": "state"}, START_TIMEOUT)  # every host started
        run = Run(service, fleet, size)
        row: dict[str, Any] = {"members": size, "processes": args.processes,
                               "sessions": args.sessions}  # fmt: skip
        profile_dir: Path | None = args.profile
        if profile_dir is not None:
            profile_dir.mkdir(parents=True, exist_ok=True)
            spy = Profile(service.pid, profile_dir / f"leader-{size}-burst.txt")
        cpu0, t0 = cpu_seconds(service.pid), time.monotonic()
        row.update(run.burst())
        row["burst_leader_cpu_per_s"] = (cpu_seconds(service.pid) - cpu0) / (
            time.monotonic() - t0
        )
        if profile_dir is not None:
            row["profile_burst"] = spy.stop()
        if args.idle_check:
            row["idle_check"] = idle_check(run, args.idle_check)
            return row
        if profile_dir is not None:
            spy = Profile(service.pid, profile_dir / f"leader-{size}-idle.txt")
        row.update(run.idle(args.idle_window))
        if profile_dir is not None:
            row["profile_idle"] = spy.stop()
            spy = Profile(service.pid, profile_dir / f"leader-{size}-events.txt")
            cpu0, t0 = cpu_seconds(service.pid), time.monotonic()
        run.events(args.repeats)
        if profile_dir is not None:
            row["profile_events"] = spy.stop()
            row["profile_events"]["leader_cpu_per_s"] = (cpu_seconds(service.pid) - cpu0) / (
                time.monotonic() - t0
            )
        row.update(
            {f"{kind}_first": summary(v) for kind, v in run.first.items()},
            **{f"{kind}_all": summary(v) for kind, v in run.last.items()},
            **{f"{kind}_commit": summary(v) for kind, v in run.commit.items()},
            anomalies=run.anomalies,
            detector_suspicions=service.log_count(DETECTOR_SUSPICION),
            lag_warnings=service.log_count(LAG_WARNING),
            claims_refused=service.log_count("claims step"),
        )
        return row
    except BaseException:
        print("rendezvous log (last lines):", *service.log_tail(), sep="\n  ", file=sys.stderr)
        raise
    finally:
        if fleet is not None:
            fleet.close()
        service.stop(args.logs / f"rendezvous-{size}.log" if args.logs else None)


def idle_check(run: Run, seconds: float) -> dict[str, Any]:
    """Hold the members idle for ``seconds``: no view change, no session ended."""
    start_epoch = run.epoch
    pid = run.service.pid
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    samples = []
    deadline = t0 + seconds
    while time.monotonic() < deadline:
        time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
        replies = run.fleet.ask_all({"op": "state"}, EVENT_TIMEOUT)
        epochs = sorted({e for r in replies for e in r["epochs"]})
        ended = [e for r in replies for e in r["ended"]]
        samples.append({"t_s": round(time.monotonic() - t0, 1), "epochs": epochs,
                        "ended": len(ended), "members": sum(r["count"] for r in replies)})
        print(f"  idle {samples[-1]['t_s']:6.1f} s: epochs {epochs}, sessions ended "
              f"{len(ended)}", flush=True)  # fmt: skip
    elapsed = time.monotonic() - t0
    suspected = run.service.log_count("suspect ")
    lagging = run.service.log_count(LAG_WARNING)
    passed = all(s["epochs"] == [start_epoch] and s["ended"] == 0 for s in samples)
    return {
        "seconds": elapsed,
        "epoch": start_epoch,
        "samples": samples,
        "suspicions_logged": suspected,
        "lag_warnings": lagging,
        "leader_cpu_per_s": (cpu_seconds(pid) - cpu0) / elapsed,
        "passed": passed and suspected == 0,
    }


HEADER = (
    "view change = trigger -> new view received; first / last member, p50 (p90) in ms\n"
    f"{'members':>7} | {'burst':>7} | {'joins/s':>7} | {'leader CPU idle':>20} | "
    f"{'leave':>23} | {'crash':>23} | {'join':>23}"
)


def format_row(row: dict[str, Any]) -> str:
    def cell(kind: str) -> str:
        a, b = row[f"{kind}_first"], row[f"{kind}_all"]
        if not a.get("n"):
            return f"{'-':>23}"
        return f"{a['p50_ms']:5.0f} ({a['p90_ms']:4.0f}) / {b['p50_ms']:5.0f} ({b['p90_ms']:4.0f})"

    idle = (
        f"{row['leader_cpu_per_s']:5.3f} s/s {row['leader_cpu_per_s_per_member'] * 1e6:5.0f} us/m"
    )
    return (
        f"{row['members']:>7} | {row['join_burst_s']:6.2f}s | "
        f"{row['join_throughput_per_s']:7.0f} | {idle:>20} | "
        f"{cell('leave')} | {cell('crash')} | {cell('join')}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None,
                        help="member counts, comma-separated (default 64,512,2048,4096; "
                             "2048 with --idle-check)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5,
                        help="rounds per size, each a leave, a join, a crash and a join")
    parser.add_argument("--processes", type=int, default=8,
                        help="child processes hosting the members")
    parser.add_argument("--sessions", choices=("shared", "own"), default="shared",
                        help="each host process's members on one shared session stream "
                             "(default), or each on a stream of its own")  # fmt: skip
    parser.add_argument("--idle-window", type=float, default=10.0,
                        help="seconds of idle members over which the leader's CPU is measured")
    parser.add_argument("--idle-check", type=float, default=0.0, metavar="SECONDS",
                        help=f"hold the members idle this long (at most {MAX_IDLE_CHECK:.0f}) "
                             "and fail if any view change happened or any session ended")
    parser.add_argument(
        "--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
        help="config override for the service (as `rollcall rendezvous --set`)",
    )  # fmt: skip
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="sample the service with py-spy (in the venv) during the burst, "
                             "the idle window and the events; collapsed stacks into DIR, shares "
                             "by function in the table and the JSON")  # fmt: skip
    parser.add_argument("--logs", type=Path, default=None, metavar="DIR",
                        help="keep the service's log of each size in DIR")
    parser.add_argument("--json", type=Path, default=None,
                        help="default bench/results/view_change.json "
                             "(view_change-idle.json with --idle-check)")  # fmt: skip
    args = parser.parse_args()
    default_sizes = "2048" if args.idle_check else "64,512,2048,4096"
    sizes = [int(s) for s in (args.sizes or default_sizes).split(",")]
    if not 1 <= args.repeats <= 1000:
        parser.error("--repeats must be 1..1000")
    if not 1 <= args.processes <= 64:
        parser.error("--processes must be 1..64")
    if any(not 2 <= s <= MAX_SIZE for s in sizes) or any(s < args.processes for s in sizes):
        parser.error(f"sizes must be 2..{MAX_SIZE} and at least --processes")
    if not 0 <= args.idle_check <= MAX_IDLE_CHECK or not 0.5 <= args.idle_window <= 600:
        parser.error(f"--idle-check must be 0..{MAX_IDLE_CHECK:.0f}, --idle-window 0.5..600")
    results = ROOT / "bench" / "results"
    out = args.json or results / ("view_change-idle.json" if args.idle_check else
                                  "view_change.json")  # fmt: skip
    if not args.idle_check:
        print(HEADER, flush=True)
    rows = []
    failed = []
    for size in sizes:
        try:
            row = run_size(args, size)
        except (RuntimeError, TimeoutError, EOFError, OSError) as exc:
            # Said and recorded; the next size still runs.
            print(f"{size:>7} | failed: {exc}", flush=True)
            failed.append({"members": size, "error": str(exc)})
            continue
        rows.append(row)
        if args.idle_check:
            check = row["idle_check"]
            verdict = "PASSED" if check["passed"] else "FAILED"
            print(f"idle check at {size} members for {check['seconds']:.0f} s: {verdict} "
                  f"(epoch {check['epoch']}, suspicions logged {check['suspicions_logged']}, "
                  f"leader CPU {check['leader_cpu_per_s']:.3f} s/s)", flush=True)  # fmt: skip
        else:
            print(format_row(row), flush=True)
            commits = ", ".join(
                f"{kind} {row[f'{kind}_commit'].get('p50_ms', float('nan')):.0f} "
                f"({row[f'{kind}_commit'].get('p90_ms', float('nan')):.0f})"
                for kind in ("leave", "crash", "join")
            )
            harness = row["harness_cpu_per_s"]
            print(f"  trigger -> committed in etcd (service log), p50 (p90) ms: {commits}; "
                  f"harness CPU at idle {harness:.2f} s/s; leader CPU in the burst "
                  f"{row['burst_leader_cpu_per_s']:.2f} s/s", flush=True)  # fmt: skip
            for anomaly in row["anomalies"]:
                print(f"  anomaly: {anomaly}", flush=True)
            if "profile_idle" in row:
                print_profile("during the join burst", row["profile_burst"])
                print_profile("at idle", row["profile_idle"])
                print_profile("during the events", row["profile_events"])
            if row["detector_suspicions"] or row["lag_warnings"]:
                print(f"  the service logged {row['detector_suspicions']} detector suspicions "
                      f"and {row['lag_warnings']} lag warnings", flush=True)  # fmt: skip
    result = {
        "rows": rows,
        "failed": failed,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},  # fmt: skip
        "parameters": {
            "sizes": sizes, "repeats": args.repeats, "processes": args.processes,
            "sessions": args.sessions,
            "idle_window_s": args.idle_window, "idle_check_s": args.idle_check,
            "overrides": args.settings, "config": Config().__dict__,
        },  # fmt: skip
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if args.idle_check:
        return 0 if rows and not failed and all(r["idle_check"]["passed"] for r in rows) else 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
