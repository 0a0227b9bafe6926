"""`rollcall checkpoints list|verify|forget` against a real job (real etcd,
rendezvous and workers), and the way out of "no usable checkpoint" (exit 4)
without etcdctl."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rollcall.membership.checkpoint import (
    MANIFEST_SUFFIX,
    manifest_file_name,
    started_over_file_name,
)
from tests.harness import ROOT, ControlPlane, WorkerProcess, wait_for
from tests.test_checkpoint_trust import EVERY, etcdctl_put, start
from tests.test_worker_e2e import PATIENCE, wait_step


def command(plane: ControlPlane, *argv: str) -> subprocess.CompletedProcess[str]:
    flags = ["--rendezvous", ",".join(plane.addresses), "--job", plane.job,
             "--token-file", str(plane.token_file)]  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "rollcall.cli", "checkpoints", *argv, *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def listed(plane: ControlPlane) -> dict[str, Any]:
    result = command(plane, "list", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_an_operator_inspects_repairs_and_gets_a_job_out_of_exit_4(
    control_plane: ControlPlane, tmp_path: Path
):
    plane = control_plane
    directory = tmp_path / "ckpt"
    workers: list[WorkerProcess] = []
    try:
        workers.append(start(plane, tmp_path, "w0", directory))
        wait_for(lambda: len(listed(plane)["checkpoints"]) == 3, "three checkpoints", PATIENCE)
        workers[0].kill()
        wait_for(lambda: not plane.status_json()["members"], "the view to empty", PATIENCE)

        record = listed(plane)
        assert [m["file"] for m in record["checkpoints"]] == ["present"] * 3
        # A kill between publishing a fourth checkpoint and deleting the file
        # it superseded leaves that file behind, named in no record: the
        # commands below never touch it (a worker adopts such files only when
        # etcd lost the job's record).
        recorded = {m["uri"] for m in record["checkpoints"]}
        files = [str(directory / p) for p in os.listdir(directory) if p.endswith(".rcs")]
        unrecorded = sorted(set(files) - recorded)
        # Likewise a kill between deleting a superseded file and the manifest
        # copy beside it leaves that copy alone (inert: a worker adopts files,
        # never bare copies), and one between writing a file and its copy
        # leaves a file with none.
        copies_at_kill = {p for p in os.listdir(directory) if p.endswith(MANIFEST_SUFFIX)}
        stray = {c for c in copies_at_kill if not (directory / c[: -len(MANIFEST_SUFFIX)]).exists()}
        assert len(unrecorded) + len(stray) <= 1, (unrecorded, stray)
        assert {manifest_file_name(Path(u).name) for u in recorded} <= copies_at_kill
        steps = [m["step"] for m in record["checkpoints"]]
        text = command(plane, "list")
        assert text.returncode == 0 and f"step {steps[0]:>8}" in text.stdout, text.stdout
        # Files of this job no record names are shown (the kill's, if any,
        # and one planted), never another job's or a file of another name.
        planted = directory / "ckpt+job1+000000000999+w-planted.rcs"
        others = [directory / "ckpt+job2+000000000999+w-planted.rcs", directory / "notes.txt"]
        planted.write_bytes(b"x" * 1000)
        for other in others:
            other.write_bytes(b"x")
        shown = listed(plane)["unrecorded"]
        assert sorted(u["path"] for u in shown) == sorted([*unrecorded, str(planted)])
        assert {u["path"]: u["size"] for u in shown}[str(planted)] == 1000
        text = command(plane, "list")
        assert f"{len(shown)} files of job job1 beside them are named in no record" in text.stdout
        assert f"      {planted}\n" in text.stdout, text.stdout
        # Beside a list of a run's files started over, the text says those
        # are never adopted.
        started_over = directory / started_over_file_name("job1")
        started_over.write_text("{}")
        text = command(plane, "list")
        assert f"(never those {started_over} lists: they are of a run started over)" in text.stdout
        started_over.unlink()
        for extra in (planted, *others):
            extra.unlink()
        verified = command(plane, "verify")
        assert verified.returncode == 0 and "all 3 checkpoints of job job1 verify" in (
            verified.stdout
        ), verified.stdout + verified.stderr

        for m in record["checkpoints"]:  # damaged in place: same size, one byte flipped
            data = Path(m["uri"]).read_bytes()
            Path(m["uri"]).write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
        verified = command(plane, "verify")
        assert verified.returncode == 1 and verified.stdout.count("SHA-256 differs") == 3
        assert "3 of 3 checkpoints of job job1 are unusable" in verified.stderr

        # A worker cannot resume, says so, and says what to do.
        workers.append(start(plane, tmp_path, "w1", directory, 1000))
        assert workers[1].proc.wait(timeout=PATIENCE) == 4
        error = [line for line in workers[1].log_tail(50).splitlines() if "rollcall: error" in line]
        assert error and "rollcall checkpoints forget" in error[0], error

        missing = command(plane, "forget", "123456")
        assert missing.returncode == 1 and "no checkpoint of step 123456 is recorded" in (
            missing.stderr
        ), missing.stderr
        usage = command(plane, "forget")
        assert usage.returncode == 2 and "give the STEPs to forget, or --all" in usage.stderr

        forgot = command(plane, "forget", str(steps[0]))
        assert forgot.returncode == 0, forgot.stderr
        assert f"forgot the checkpoint of step {steps[0]} (file kept" in forgot.stdout
        assert Path(record["checkpoints"][0]["uri"]).exists()
        assert [m["step"] for m in listed(plane)["checkpoints"]] == steps[1:]

        # A forged manifest naming a file that is no checkpoint: --delete-files
        # deletes the real checkpoints' files, never that one.
        victim = tmp_path / "victim"
        victim.write_text("not a checkpoint")
        forged = {**record["checkpoints"][1], "uri": str(victim), "step": steps[1] + 1}
        kept = [{k: v for k, v in m.items() if k != "file"} for m in record["checkpoints"][1:]]
        forged.pop("file")
        key = f"/rollcall/jobs/{plane.job}/checkpoints"
        etcdctl_put(plane.etcd[0], key, json.dumps([forged, *kept]))
        everything = command(plane, "forget", "--all", "--delete-files")
        assert everything.returncode == 0, everything.stderr
        assert everything.stdout.count("file deleted") == 2 and victim.exists()
        assert "not named as job job1's checkpoint" in everything.stdout
        assert listed(plane)["checkpoints"] == []
        left = sorted(str(directory / p) for p in os.listdir(directory) if p.endswith(".rcs"))
        # The one forgotten earlier keeps its file, as does one no record named.
        assert left == sorted([record["checkpoints"][0]["uri"], *unrecorded])
        copies = [p for p in os.listdir(directory) if p.endswith(MANIFEST_SUFFIX)]
        # deleted with their files
        kept_copies = {manifest_file_name(Path(f).name) for f in left} & copies_at_kill
        assert set(copies) == kept_copies | stray

        # No checkpoint, progress recorded: no silent restart, until asked.
        workers.append(start(plane, tmp_path, "w2", directory, 1000))
        assert workers[2].proc.wait(timeout=PATIENCE) == 4
        assert "--start-over" in workers[2].log_tail(20)
        workers.append(start(plane, tmp_path, "w3", directory, 1000, "--start-over"))
        assert min(e["step"] for e in [wait_step(workers[3], lambda e: True)]) == 0
        wait_for(lambda: listed(plane)["checkpoints"], "a checkpoint of the new run", PATIENCE)
        assert listed(plane)["checkpoints"][0]["step"] % EVERY == EVERY - 1
    finally:
        for worker in workers:
            with contextlib.suppress(Exception):
                worker.stop(timeout=20)
