"""Checkpoints a job can trust, end to end (real etcd, real rendezvous, real
workers): forged manifests delete nothing real and do not stop durability,
two jobs sharing a checkpoint directory leave each other's files alone, and
a full or read-only disk is surfaced while training goes on."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.harness import ROOT, ControlPlane, Process, ReplicaProcess, WorkerProcess, wait_for
from tests.test_worker_e2e import PATIENCE, wait_step

EVERY = 5
#: The step of the forged manifests (finding 2 of issue 12).
FORGED_STEP = 10**12


def start(
    plane: ControlPlane, tmp_path: Path, name: str, directory: Path, steps: int = 100_000,
    *extra: str,
) -> WorkerProcess:  # fmt: skip
    return WorkerProcess(
        plane, tmp_path / f"{name}.log", steps=steps,
        extra=["--checkpoint-dir", str(directory), "--checkpoint-every", str(EVERY), *extra],
    )  # fmt: skip


def etcdctl_put(endpoint: str, key: str, value: str) -> None:
    subprocess.run(
        ["etcdctl", f"--endpoints={endpoint}", "put", key, value],
        env={**os.environ, "ETCDCTL_API": "3"}, check=True, capture_output=True, timeout=30,
    )  # fmt: skip


def forged(step: int, directory: Path) -> dict[str, Any]:
    """A well-formed manifest naming a file that does not exist."""
    return {
        "step": step, "digest": "sha256:" + "0" * 64, "uri": str(directory / f"forged-{step}"),
        "size": 1000, "sha256": "0" * 64, "epoch": 1, "writer": "evil-1",
        "created_unix": 1.0, "step_seconds": 0.01,
    }  # fmt: skip


def verifies(manifest: dict[str, Any]) -> bool:
    """The file a manifest names exists with its size and SHA-256."""
    try:
        blob = Path(manifest["uri"]).read_bytes()
    except OSError:
        return False
    return len(blob) == manifest["size"] and hashlib.sha256(blob).hexdigest() == manifest["sha256"]


def self_consistent_forgery(real: dict[str, Any], path: Path) -> dict[str, Any]:
    """A manifest of step 10^12 and a file matching it in every check a
    reader makes (size, SHA-256, loads, digest, step): the real state
    relabelled."""
    from dataclasses import replace

    from rollcall.worker.digest import digest
    from rollcall.worker.state_bytes import from_bytes, to_bytes

    state = replace(from_bytes(Path(real["uri"]).read_bytes()), step=FORGED_STEP)
    blob = to_bytes(state)
    path.write_bytes(blob)
    return {
        **{k: v for k, v in real.items() if k != "file"}, "step": FORGED_STEP,
        "digest": digest(state), "uri": str(path), "size": len(blob),
        "sha256": hashlib.sha256(blob).hexdigest(),
    }  # fmt: skip


def real_checkpoints(plane: ControlPlane) -> list[dict[str, Any]]:
    return [m for m in plane.status_json()["checkpoints"] if m["step"] < FORGED_STEP - 10]


def test_forged_manifests_in_etcd_delete_no_real_checkpoint_and_durability_goes_on(
    control_plane: ControlPlane, tmp_path: Path
):
    plane = control_plane
    directory = tmp_path / "ckpt"
    workers = [start(plane, tmp_path, "w0", directory)]
    try:
        wait_for(lambda: real_checkpoints(plane), "a first real checkpoint", PATIENCE)
        assert verifies(real_checkpoints(plane)[0])
        files_before = sorted(p.name for p in directory.iterdir())
        # Three manifests with step 10^12, straight into etcd (no token needed).
        record = [forged(FORGED_STEP - i, directory) for i in range(3)]
        etcdctl_put(plane.etcd[0], f"/rollcall/jobs/{plane.job}/checkpoints", json.dumps(record))
        forged_at = workers[0].steps()[-1]["step"]

        # Durability goes on: a real checkpoint newer than the forgery is
        # published, and the forged ones are no longer in the record. Nothing
        # real is deleted on the strength of the forged manifests: the
        # directory always holds a complete checkpoint.
        def published_after_forgery() -> list[dict[str, Any]]:
            present = [p.name for p in directory.iterdir() if p.name.endswith(".rcs")]
            assert present, f"every checkpoint file was deleted (there were {files_before})"
            kept = plane.status_json()["checkpoints"]
            newer = [m for m in kept if forged_at < m["step"] < FORGED_STEP - 10]
            return kept if newer and all(m["step"] < FORGED_STEP - 10 for m in kept) else []

        kept = wait_for(published_after_forgery, "a real checkpoint after the forgery", PATIENCE)
        assert all(verifies(m) for m in kept), (kept, sorted(os.listdir(directory)))
        # No checkpoint of the worker's was refused for the forged ones
        # (worker/checkpoint.py, _settle: "... not recorded: ...").
        assert " not recorded: " not in workers[0].log_tail(10_000)

        # Every replica lost: a new worker resumes from the newest real one,
        # even when a forged manifest beyond the job's progress names a file
        # that passes every check of its own (a state file of step 10^12).
        workers[0].kill()
        wait_for(lambda: not plane.status_json()["members"], "the view to empty", PATIENCE)
        status = plane.status_json()
        newest = real_checkpoints(plane)[0]
        assert status["last_step"] >= newest["step"], status  # progress covers the checkpoint
        lure = self_consistent_forgery(newest, tmp_path / "lure.rcs")
        etcdctl_put(
            plane.etcd[0], f"/rollcall/jobs/{plane.job}/checkpoints",
            json.dumps([lure, *status["checkpoints"]]),
        )  # fmt: skip
        workers.append(start(plane, tmp_path, "w1", directory))
        resumed = workers[1].wait_event(lambda e: e["event"] == "resumed", PATIENCE)
        assert resumed["s_ckpt"] == newest["step"]
        assert "beyond the job's recorded progress" in workers[1].log_tail(20_000)
        wait_step(workers[1], lambda e: e["step"] > newest["step"])
    finally:
        for worker in workers:
            with contextlib.suppress(Exception):
                worker.stop(timeout=20)


def test_two_jobs_sharing_a_checkpoint_directory_never_touch_each_others_files(
    etcd, tmp_path: Path
):
    directory = tmp_path / "shared-ckpt"
    planes = []
    workers: list[WorkerProcess] = []
    try:
        for job in ("ja", "jb"):
            (tmp_path / job).mkdir()
            planes.append(ControlPlane([etcd.endpoint], tmp_path / job, job=job))
        # Different seeds: the two jobs' states (and files) differ.
        for seed, plane in enumerate(planes):
            workers.append(
                start(plane, tmp_path, plane.job, directory, 12 * EVERY, "--seed", str(seed))
            )
        for worker in workers:
            assert worker.proc.wait(timeout=PATIENCE * 2) == 0, worker.log_tail()
        records = {plane.job: plane.status_json()["checkpoints"] for plane in planes}
        for job, kept in records.items():
            assert [m["step"] for m in kept] == [59, 54, 49], (job, kept)
            for manifest in kept:
                assert verifies(manifest), (job, manifest, sorted(os.listdir(directory)))
        uris = {job: {m["uri"] for m in kept} for job, kept in records.items()}
        assert not uris["ja"] & uris["jb"], "the two jobs' manifests name the same files"
    finally:
        for worker in workers:
            with contextlib.suppress(Exception):
                worker.stop(timeout=20)
        for plane in planes:
            plane.close()


# --- durability failing is surfaced (finding 6) ----------------------------------


class MeteredReplica(ReplicaProcess):
    """``rollcall rendezvous`` with an events file and a metrics port."""

    def __init__(self, plane: ControlPlane, events: Path, metrics_port: int) -> None:
        from rollcall.etcd_local import free_port

        port = free_port()
        argv = [
            sys.executable, "-m", "rollcall.cli", "rendezvous", "--etcd", ",".join(plane.etcd),
            "--listen", f"127.0.0.1:{port}", "--job", plane.job,
            "--token-file", str(plane.token_file), "--log-level", "info",
            "--events", str(events), "--metrics-port", str(metrics_port),
            *(f"--set={item}" for item in plane.settings),
        ]  # fmt: skip
        Process.__init__(self, argv, None, plane.workdir / "replica0.log")
        self.address = f"127.0.0.1:{port}"
        self.wait_line(lambda line: line.startswith("rendezvous ready at"), timeout=30)


@dataclass
class Observed:
    """One worker writing checkpoints to ``disk``, and what shows its durability."""

    plane: ControlPlane
    disk: Path
    worker: WorkerProcess
    events: Path
    service_metrics: int
    worker_metrics: int

    def durability(self) -> dict[str, Any]:
        return self.plane.status_json()["durability"]

    def status_text(self) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "rollcall.cli", "status", "--rendezvous",
             ",".join(self.plane.addresses), "--job", self.plane.job,
             "--token-file", str(self.plane.token_file)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return result.stdout

    def records(self, kind: str) -> list[dict[str, Any]]:
        lines = self.events.read_text().splitlines() if self.events.exists() else []
        found = []
        for line in lines:
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
        return [r for r in found if r.get("kind") == kind]


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def mount(*argv: str) -> None:
    subprocess.run(["mount", *argv], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def small_filesystem(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (unmounted afterwards, always)."""
    where.mkdir()
    mount("-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where))
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


@contextlib.contextmanager
def observed_worker(etcd: Any, tmp_path: Path, size: str) -> Iterator[Observed]:
    from rollcall.etcd_local import free_ports

    plane = ControlPlane([etcd.endpoint], tmp_path, replicas=0)
    worker = None
    with small_filesystem(tmp_path / "disk", size) as disk:
        try:
            events, (service_port, worker_port) = tmp_path / "events.jsonl", free_ports(2)
            plane.replicas.append(MeteredReplica(plane, events, service_port))
            worker = start(
                plane, tmp_path, "w0", disk / "ckpt", 100_000, "--metrics-port", str(worker_port)
            )
            yield Observed(plane, disk, worker, events, service_port, worker_port)
        finally:
            if worker is not None:
                with contextlib.suppress(Exception):
                    worker.stop(timeout=20)
            plane.close()


def assert_stuck(observed: Observed, durable: int, says: str) -> dict[str, Any]:
    """Durability is reported stuck at ``durable`` with reason ``says`` by
    the status field, `rollcall status`, the events file and both metrics."""

    def stuck() -> dict[str, Any] | None:
        record = observed.durability()
        return record if record["failures"] >= 2 and says in (record["reason"] or "") else None

    record = wait_for(stuck, f"durability reported stuck ({says})", PATIENCE)
    assert record["durable_step"] == durable and record["failed_step"] > durable, record
    assert record["since"] is not None and record["since"] <= time.time()
    text = observed.status_text()
    assert f"durability stuck at step {durable} since " in text and says in text, text
    failed = observed.records("checkpoint_failed")
    assert failed and says in failed[0]["reason"] and failed[0]["durable_step"] == durable, failed
    service = metrics(observed.service_metrics)
    assert service["rollcall_checkpoint_failures_total"] >= 1, service
    assert service["rollcall_durable_step"] == durable
    worker = metrics(observed.worker_metrics)
    assert worker["rollcall_worker_checkpoint_failures_total"] >= 2, worker
    assert worker["rollcall_worker_durable_step"] == durable
    return record


def assert_training_goes_on_then_recovers(observed: Observed, durable: int, repair: str) -> None:
    at = observed.worker.steps()[-1]["step"]
    wait_step(observed.worker, lambda e: e["step"] >= at + 4 * EVERY)
    mount("-o", f"remount,{repair}", str(observed.disk))

    def recovered() -> dict[str, Any] | None:
        record = observed.durability()
        return record if record["failures"] == 0 and record["durable_step"] > durable else None

    wait_for(recovered, "durability to recover once the disk does", PATIENCE)
    assert "durability stuck" not in observed.status_text()
    assert observed.records("checkpoint")[-1]["step"] > durable
    assert "Traceback" not in observed.worker.log_tail(100_000)


def test_a_full_checkpoint_disk_is_surfaced_and_training_goes_on(etcd, tmp_path: Path):
    # Room for one checkpoint of the example (1.7 MB), not for a second one.
    with observed_worker(etcd, tmp_path, "2600k") as observed:
        first = wait_for(lambda: observed.plane.status_json()["checkpoints"], "a checkpoint")
        durable = first[0]["step"]
        assert_stuck(observed, durable, "No space left on device")
        assert_training_goes_on_then_recovers(observed, durable, "size=64m")


def test_a_read_only_checkpoint_directory_is_surfaced_and_the_writer_survives(
    etcd, tmp_path: Path
):
    with observed_worker(etcd, tmp_path, "64m") as observed:
        first = wait_for(lambda: observed.plane.status_json()["checkpoints"], "a checkpoint")
        mount("-o", "remount,ro", str(observed.disk))
        durable = observed.plane.status_json()["checkpoints"][0]["step"]
        assert durable >= first[0]["step"]
        assert_stuck(observed, durable, "Read-only file system")
        # The writer's error path (removing the temporary file) raised on a
        # read-only directory and killed it: it keeps trying instead.
        assert "Traceback" not in observed.worker.log_tail(100_000)
        assert_training_goes_on_then_recovers(observed, durable, "rw")
