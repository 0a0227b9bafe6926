"""The configuration fingerprint end to end: a real etcd, real `rollcall
rendezvous` processes and real `rollcall worker` processes (or clients of
the real service). A worker whose settings differ from its job's is refused
at join, before anything changes, while the job trains on."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pyetcd.client import Endpoint, MultiEndpointEtcd3Client

from rollcall.etcd_local import LocalEtcd
from rollcall.membership.config import Config
from rollcall.membership.errors import ConfigurationMismatch
from rollcall.membership.fingerprint import JobFingerprint
from rollcall.membership.view import View
from rollcall.protocol.client import RendezvousClient
from rollcall.worker.examples.lm import LMConfig, build
from rollcall.worker.fingerprint import code_digests, data_probe, job_fingerprint
from rollcall.worker.loader import MicrobatchLoader
from rollcall.worker.plan import DIVISION, DataPlan
from rollcall.worker.runtime import REDUCTION
from tests.harness import ControlPlane, WorkerProcess, wait_for

pytestmark = pytest.mark.integration  # starts processes

#: Generous bound for waits on a loaded 2-core machine.
PATIENCE = 60.0
#: A refusal is one answer, not a retry loop (the client's deadline is 30 s).
PROMPT = 5.0
#: The first worker's settings (the CLI's defaults but for the global batch).
GLOBAL_BATCH, MICRO_BATCH, SEED = 48, 8, 0
#: A fingerprint for clients that stand in for workers.
RUN1 = JobFingerprint.of({"global_batch": "48", "micro_batch": "8", "seed": "0"})
RUN2 = JobFingerprint.of({"global_batch": "96", "micro_batch": "8", "seed": "0"})


def raw_etcd(endpoint: str) -> MultiEndpointEtcd3Client:
    """A plain etcd client, independent of the code under test."""
    host, _, port = endpoint.removeprefix("http://").rpartition(":")
    return MultiEndpointEtcd3Client([Endpoint(host, int(port), secure=False)], timeout=5)


def stored(plane: ControlPlane, key: str) -> bytes | None:
    client = raw_etcd(plane.etcd[0])
    try:
        value, _ = client.get(f"/rollcall/jobs/{plane.job}/{key}")
        return value
    finally:
        client.close()


def member_records(plane: ControlPlane) -> list[str]:
    client = raw_etcd(plane.etcd[0])
    try:
        prefix = f"/rollcall/jobs/{plane.job}/members/"
        return sorted(meta.key.decode()[len(prefix) :] for _, meta in client.get_prefix(prefix))
    finally:
        client.close()


def replica_log(plane: ControlPlane) -> str:
    return (plane.workdir / "replica0.log").read_text(errors="replace")


def stderr_lines(worker: WorkerProcess) -> list[str]:
    return worker.log_path.read_text(errors="replace").strip().splitlines()


def example_fingerprint() -> JobFingerprint:
    """What the first worker computes (`rollcall worker` builds this)."""
    model, optimizer, corpus = build(LMConfig(), SEED)
    plan = DataPlan(len(corpus), GLOBAL_BATCH, MICRO_BATCH, SEED)
    with MicrobatchLoader(corpus, plan) as loader:
        data = data_probe(loader.probe())
    # Its code is rollcall's own: no module of it is compared.
    code = code_digests([*model.modules(), optimizer, corpus], "rollcall.worker.examples.lm_loop")
    assert code == "none"
    return job_fingerprint(
        model, optimizer, plan, data=data, code=code,
        flags={"min_workers": "1", "sync_buffers": "true", "exact": "false",
               "data_division": DIVISION, "reduction": REDUCTION,
               "drift_check": str(Config().drift_check_every)},
    )  # fmt: skip


@pytest.fixture(scope="module")
def training(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ControlPlane, Any]]:
    """A job with one `rollcall worker` training, global batch 48."""
    workdir = tmp_path_factory.mktemp("fingerprint")
    with LocalEtcd() as etcd:
        plane = ControlPlane([etcd.endpoint], workdir)
        first = None
        try:
            first = WorkerProcess(
                plane, workdir / "first.log", steps=100_000,
                extra=("--global-batch", str(GLOBAL_BATCH), "--micro-batch", str(MICRO_BATCH)),
            )  # fmt: skip
            first.wait_event(lambda e: e["event"] == "step", PATIENCE)
            yield plane, first
        finally:
            if first is not None:
                first.stop(timeout=20)
            plane.close()


def refused_worker(plane: ControlPlane, log: Path, *flags: str) -> WorkerProcess:
    """A `rollcall worker` with ``flags`` that must exit by itself."""
    worker = WorkerProcess(
        plane, log, steps=100_000, wait_joined=False, extra=(*flags, "--log-level", "warning")
    )
    try:
        worker.proc.wait(timeout=PATIENCE)
    finally:
        worker.stop(timeout=5)
    return worker


def assert_trains_on_alone(plane: ControlPlane, first: Any, epoch: int, after: int) -> None:
    """``first`` commits more steps after ``after``, in the same view, alone."""
    later = first.wait_event(lambda e: e["event"] == "step" and e["step"] > after + 3, PATIENCE)
    assert later["epoch"] == epoch, "the refused worker caused a view change"
    assert later["world"] == 1
    assert member_records(plane) == [first.member_id]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (
            ("--global-batch", "96"),
            "this worker's global_batch is 96 but job job1's is 48: every worker of a job "
            "must use the same settings; fix this worker's settings, or start a new job "
            "under another name",
        ),
        (("--seed", "1", "--global-batch", "48"), "its initial_state is sha256:"),
        (("--d-model", "32", "--global-batch", "48"), "this worker's model is "),
    ],
    ids=["global batch", "model seed", "model"],
)
def test_a_worker_with_other_settings_is_refused_at_join_while_the_job_trains(
    training: tuple[ControlPlane, Any], tmp_path: Path, flags: tuple[str, ...], says: str
) -> None:
    plane, first = training
    before = first.steps()[-1]
    refused = refused_worker(plane, tmp_path / "refused.log", *flags)
    assert refused.proc.returncode == 5, refused.log_tail()
    lines = stderr_lines(refused)
    assert len(lines) == 1, lines
    assert lines[0].startswith("rollcall: error: job job1 refused this worker: this worker's ")
    assert says in lines[0]
    if "--seed" in flags:
        assert "this worker's seed is 1 but job job1's is 0" in lines[0]
    assert not [e for e in refused.events() if e["event"] == "joined"]
    assert_trains_on_alone(plane, first, before["epoch"], before["step"])
    assert "refused: this worker's" in replica_log(plane)


def test_the_job_records_the_first_workers_fingerprint(training: tuple[ControlPlane, Any]) -> None:
    plane, _ = training
    value = stored(plane, "fingerprint")
    assert value is not None
    assert json.loads(value) == example_fingerprint().as_dict()


def test_a_refused_join_raises_configuration_mismatch_at_once(
    training: tuple[ControlPlane, Any],
) -> None:
    plane, first = training
    other = JobFingerprint.of({**example_fingerprint().as_dict(), "micro_batch": "16"})

    async def join() -> float:
        client = RendezvousClient(plane.addresses, plane.job, plane.token, Config())
        started = time.monotonic()
        try:
            with pytest.raises(ConfigurationMismatch, match="micro_batch is 16 but job job1's"):
                await client.join("127.0.0.1:1", name="other", fingerprint=other)
            return time.monotonic() - started
        finally:
            await client.close()

    assert asyncio.run(join()) < PROMPT
    assert member_records(plane) == [first.member_id]


def test_an_exact_mode_worker_is_refused_by_a_default_mode_job(
    training: tuple[ControlPlane, Any],
) -> None:
    plane, first = training
    exact = JobFingerprint.of({**example_fingerprint().as_dict(), "exact": "true"})

    async def join() -> None:
        client = RendezvousClient(plane.addresses, plane.job, plane.token, Config())
        try:
            with pytest.raises(ConfigurationMismatch, match="exact is true but job job1's"):
                await client.join("127.0.0.1:1", name="exact", fingerprint=exact)
        finally:
            await client.close()

    asyncio.run(join())
    assert member_records(plane) == [first.member_id]


@pytest.mark.parametrize(
    ("field", "value"), [("data_division", DIVISION), ("reduction", REDUCTION)]
)
def test_a_worker_that_divides_or_reduces_steps_by_an_older_rule_is_refused(
    training: tuple[ControlPlane, Any], field: str, value: str
) -> None:
    """A worker of a rollcall version from before the members fetching
    state sat out their view's first step (no ``data_division`` field)
    would run its share of that step too; one from before the step's
    reduction carried which parameters got a gradient (no ``reduction``)
    would all-reduce tensors of another size: refused, not trained with."""
    plane, first = training
    older = {k: v for k, v in example_fingerprint().as_dict().items() if k != field}

    async def join() -> None:
        client = RendezvousClient(plane.addresses, plane.job, plane.token, Config())
        try:
            with pytest.raises(
                ConfigurationMismatch, match=f"{field} is unset but job job1's is {value}"
            ):
                await client.join("127.0.0.1:1", name="older", fingerprint=JobFingerprint.of(older))
        finally:
            await client.close()

    asyncio.run(join())
    assert member_records(plane) == [first.member_id]


def test_a_worker_with_the_same_settings_joins_and_trains(
    training: tuple[ControlPlane, Any], tmp_path: Path
) -> None:
    plane, first = training
    second = WorkerProcess(
        plane, tmp_path / "second.log", steps=100_000,
        extra=("--global-batch", str(GLOBAL_BATCH), "--micro-batch", str(MICRO_BATCH)),
    )  # fmt: skip
    try:
        step = second.wait_event(lambda e: e["event"] == "step", PATIENCE)
        assert step["world"] == 2
    finally:
        second.stop(timeout=20)


# --- when the job's fingerprint is recorded and replaced ------------------------------


async def join_and_leave(
    plane: ControlPlane, fingerprint: JobFingerprint, progress: int | None = None
) -> None:
    """A member with ``fingerprint`` enters the view (and reports ``progress``)
    and leaves cleanly."""
    client = RendezvousClient(plane.addresses, plane.job, plane.token, Config())
    try:
        await client.join("127.0.0.1:1", name="run", fingerprint=fingerprint)
        await client.wait_member(PATIENCE)
        if progress is not None:
            client.report_progress(progress)
            await asyncio.sleep(0.2)
        await client.leave()
    finally:
        await client.close()


async def join_with(
    plane: ControlPlane, fingerprint: JobFingerprint, then: JobFingerprint | None = None
) -> str:
    """A member with ``fingerprint`` enters the view; while it is there, one
    with ``then`` (if given) tries to join. Then it drops its session."""
    client = RendezvousClient(plane.addresses, plane.job, plane.token, Config())
    try:
        member_id = await client.join("127.0.0.1:1", name="next", fingerprint=fingerprint)
        await client.wait_member(PATIENCE)
        if then is not None:
            await join_with(plane, then)
        return member_id
    finally:
        await client.close()


def test_a_fresh_empty_job_takes_a_new_runs_fingerprint(control_plane: ControlPlane) -> None:
    plane = control_plane
    asyncio.run(join_and_leave(plane, RUN1))
    assert json.loads(stored(plane, "fingerprint") or b"") == RUN1.as_dict()
    wait_for(lambda: not member_records(plane), "the first run's member record to go")
    asyncio.run(join_with(plane, RUN2))
    assert json.loads(stored(plane, "fingerprint") or b"") == RUN2.as_dict()
    assert (
        "INFO job job1 is empty and has never trained: its fingerprint is replaced by a new "
        "run's (global_batch 48 -> 96)" in replica_log(plane)
    )


def test_an_empty_job_that_trained_keeps_its_fingerprint(control_plane: ControlPlane) -> None:
    plane = control_plane
    asyncio.run(join_and_leave(plane, RUN1, progress=5))
    # At once: before the progress record may even have reached etcd.
    with pytest.raises(ConfigurationMismatch, match="global_batch is 96 but job job1's is 48"):
        asyncio.run(join_with(plane, RUN2))
    assert json.loads(stored(plane, "fingerprint") or b"") == RUN1.as_dict()
    assert member_records(plane) == []


def test_a_new_leader_keeps_the_fingerprint_of_a_job_that_trained(
    control_plane: ControlPlane,
) -> None:
    plane = control_plane
    asyncio.run(join_and_leave(plane, RUN1, progress=5))
    wait_for(lambda: stored(plane, "progress"), "the job's progress to be recorded")
    plane.replicas[0].stop()
    plane.add_replica()  # knows the job's history only from etcd
    with pytest.raises(ConfigurationMismatch, match="global_batch is 96 but job job1's is 48"):
        asyncio.run(join_with(plane, RUN2))
    assert member_records(plane) == []


def test_a_join_without_a_fingerprint_is_not_checked(control_plane: ControlPlane) -> None:
    plane = control_plane
    asyncio.run(join_and_leave(plane, RUN1, progress=5))
    member = plane.add_member("tool")  # tests/member_process.py sends none
    member.wait_event(lambda e: e["event"] == "view" and member.member_id in e["members"], 30)
    assert json.loads(stored(plane, "fingerprint") or b"") == RUN1.as_dict()


@pytest.mark.parametrize(
    "value",
    [
        b"not json",
        b"\xff\xfe",
        b'["global_batch", "48"]',
        b'{"global_batch": 48}',
        b'{"Global Batch": "48"}',
        json.dumps({f"f{i}": "1" for i in range(40)}).encode(),
        b"[" * 100_000,
    ],
    ids=["not json", "not utf-8", "a list", "a number", "a bad name", "too many", "deep"],
)
def test_a_malformed_stored_fingerprint_is_ignored_with_a_log_line(
    control_plane: ControlPlane, value: bytes
) -> None:
    plane = control_plane
    client = raw_etcd(plane.etcd[0])
    try:
        client.put(f"/rollcall/jobs/{plane.job}/fingerprint", value)
    finally:
        client.close()
    # The joiner's fingerprint takes its place, and is checked from then on.
    with pytest.raises(ConfigurationMismatch, match="global_batch is 96 but job job1's is 48"):
        asyncio.run(join_with(plane, RUN1, then=RUN2))
    assert "the fingerprint stored in etcd is malformed" in replica_log(plane)
    assert json.loads(stored(plane, "fingerprint") or b"") == RUN1.as_dict()
    assert plane.replicas[0].proc.poll() is None


# --- the fence window against the service's bound -------------------------------------


def test_a_worker_whose_fence_window_is_not_below_the_services_bound_leaves_and_exits_5(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    plane = control_plane
    # Safe for its own (slow) detector, not for the service's default one.
    loose = ("--set", "phi_min_std=1", "--set", "max_silence=5", "--set", "fence_window=2")
    refused = refused_worker(plane, tmp_path / "unsafe.log", *loose)
    assert refused.proc.returncode == 5, refused.log_tail()
    lines = stderr_lines(refused)
    assert len(lines) == 1, lines
    assert lines[0].startswith("rollcall: error: left job job1 at once: this worker's ")
    assert "fence_window is 2 s but the rendezvous service may suspect a silent member " \
        "1.403 s after its last heartbeat" in lines[0]  # fmt: skip
    # It left cleanly: its record is gone at once, not when its lease expires.
    assert member_records(plane) == []
    assert "leave " in replica_log(plane)


def test_a_worker_that_would_wait_longer_for_a_step_end_than_the_service_leaves_and_exits_5(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    # Under the service's default (0.5 s), a worker told to wait 4 s for its
    # step to end would answer a join's roll call after the service stopped
    # waiting for it, and be evicted at the first join.
    plane = control_plane
    refused = refused_worker(plane, tmp_path / "long-wait.log", "--set", "rollcall_step_end_wait=4")
    assert refused.proc.returncode == 5, refused.log_tail()
    lines = stderr_lines(refused)
    assert len(lines) == 1, lines
    assert lines[0].startswith("rollcall: error: left job job1 at once: this worker waits ")
    assert "rollcall_step_end_wait=4" in lines[0] and "0.5 s" in lines[0], lines[0]
    assert member_records(plane) == []
    assert "leave " in replica_log(plane)


def test_a_worker_that_waits_less_for_a_step_end_than_the_service_joins(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    # Giving a step up sooner than the service would wait is safe.
    worker = WorkerProcess(
        control_plane, tmp_path / "short-wait.log", steps=3,
        extra=("--set", "rollcall_step_end_wait=0.2"),
    )  # fmt: skip
    try:
        assert worker.proc.wait(timeout=PATIENCE) == 0, worker.log_tail()
    finally:
        worker.stop(timeout=5)


def test_a_member_times_its_answers_by_the_services_roll_call_deadline(
    control_plane: ControlPlane,
) -> None:
    # The service decides when an answer is too late: a member's warnings
    # about slow answers go by its deadlines, not the member's own settings.
    async def joined_deadlines() -> tuple[float, float]:
        own = Config(rollcall_deadline=7.0, rollcall_step_end_wait=0.25)
        client = RendezvousClient(control_plane.addresses, control_plane.job,
                                  control_plane.token, own)  # fmt: skip
        assert client.answer_deadline(at_step_end=True) == 7.25  # before the join: its own
        try:
            await client.join("127.0.0.1:1", name="timed", fingerprint=RUN1)
            return client.answer_deadline(False), client.answer_deadline(True)
        finally:
            await client.close()

    service = Config()
    assert asyncio.run(joined_deadlines()) == (
        service.rollcall_deadline,
        service.answer_deadline(at_step_end=True),
    )


def test_joiners_of_the_jobs_run_are_admitted_together_and_another_run_still_refused(
    control_plane: ControlPlane,
) -> None:
    """After the first joiner, joiners with the job's fingerprint are
    recorded side by side (in batches); one of another run arriving among
    them is refused all the same."""
    plane = control_plane

    async def scenario() -> tuple[list[str], BaseException | str, int]:
        clients = [RendezvousClient(plane.addresses, plane.job, plane.token, Config())
                   for _ in range(25)]  # fmt: skip
        other = RendezvousClient(plane.addresses, plane.job, plane.token, Config())
        try:
            await clients[0].join("127.0.0.1:1", name="first", fingerprint=RUN1)
            await clients[0].wait_member(PATIENCE)
            outcomes = await asyncio.gather(
                *(c.join(f"127.0.0.1:{10 + n}", name="same", fingerprint=RUN1)
                  for n, c in enumerate(clients[1:])),
                other.join("127.0.0.1:9", name="other", fingerprint=RUN2),
                return_exceptions=True,
            )  # fmt: skip
            ids = {c.member_id for c in clients}
            view = await clients[0].wait_view(lambda v: ids <= set(v.ids), PATIENCE)
            refusal = outcomes[-1]
            return list(view.ids), refusal, len(member_records(plane))
        finally:
            for client in (*clients, other):
                await client.close()

    members, refusal, records = asyncio.run(scenario())

    assert isinstance(refusal, ConfigurationMismatch), refusal
    assert len(members) == 25 and records >= 25
    assert json.loads(stored(plane, "fingerprint") or b"") == RUN1.as_dict()


def test_a_job_whose_last_member_left_is_empty_before_the_empty_view_commits(
    etcd: LocalEtcd,
) -> None:
    """Seen once in CI (``test_a_fresh_empty_job_takes_a_new_runs_fingerprint``):
    the first run's member record was gone from etcd, but the view that
    drops it was not committed yet, and the new run was refused as if the
    member were still there. A member that left cleanly is in no later
    view. Here the empty view's commit is held until the new run's join is
    answered; real etcd, real gRPC, an in-process replica."""
    from rollcall.rendezvous.server import ReplicaOptions, start_replica

    held, release = threading.Event(), threading.Event()

    async def run() -> None:
        running = await start_replica(
            ReplicaOptions([etcd.endpoint], "job1", "127.0.0.1:0", "secret")
        )
        store = running.replica._store
        commit_view = store.commit_view

        def held_commit_view(view: View, *args: Any) -> int | None:
            if view.size == 0 and not release.is_set():
                held.set()
                release.wait(PATIENCE)
            return commit_view(view, *args)

        store.commit_view = held_commit_view  # type: ignore[method-assign]
        # What the module's helpers use of a ControlPlane.
        plane: Any = SimpleNamespace(
            etcd=[etcd.endpoint], job="job1", addresses=[running.address], token="secret"
        )
        try:
            await join_and_leave(plane, RUN1)
            assert await asyncio.to_thread(held.wait, PATIENCE), "the empty view never came"
            await asyncio.to_thread(wait_for, lambda: not member_records(plane), "the record to go")
            client = RendezvousClient(plane.addresses, "job1", "secret", Config())
            try:
                await client.join("127.0.0.1:1", name="next", fingerprint=RUN2)
                release.set()
                await client.wait_member(PATIENCE)
            finally:
                await client.close()
        finally:
            release.set()
            await running.stop()

    asyncio.run(run())
    plane: Any = SimpleNamespace(etcd=[etcd.endpoint], job="job1")
    assert json.loads(stored(plane, "fingerprint") or b"") == RUN2.as_dict()
