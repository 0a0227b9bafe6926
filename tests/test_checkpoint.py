"""Durable checkpoints: the manifest rules, the background writer (names,
modes, pruning only what it verified, surviving a full or read-only disk),
the loader that trusts nothing it has not checked, and the etcd record
(validated, bounded by the job's progress, repaired by forgetting)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from rollcall.membership.checkpoint import (
    MANIFEST_SUFFIX,
    CheckpointFailure,
    CheckpointManifest,
    ReplayCost,
    beyond_progress,
    durability,
    file_name,
    manifest_file_name,
    next_failure,
    parse_file_name,
    part_file_name,
    progress_limit,
    record,
    started_over_file_name,
    superseded,
)
from rollcall.membership.config import Config
from rollcall.membership.errors import (
    CannotResume,
    InvalidRequest,
    NoSuchCheckpoint,
    ProgressLost,
)
from rollcall.membership.fingerprint import JobFingerprint
from rollcall.membership.view import View
from rollcall.protocol.client import Status
from rollcall.rendezvous.store import EtcdStore
from rollcall.worker.checkpoint import (
    CheckpointUnusable,
    CheckpointWriter,
    find_orphans,
    load_newest,
    process_age,
)
from rollcall.worker.digest import digest
from rollcall.worker.resume import choose
from rollcall.worker.state import capture
from rollcall.worker.state_bytes import to_bytes

JOB = "ckjob"


def manifest(at: int, **changes: object) -> CheckpointManifest:
    step = at
    fields: dict[str, object] = {
        "step": step, "digest": "sha256:ab", "uri": f"/ckpt/{file_name(JOB, step, 'w-1')}",
        "size": 10, "sha256": "0" * 64, "epoch": 1, "writer": "w-1", "created_unix": 1.0,
        "step_seconds": 0.05,
    }  # fmt: skip
    fields.update(changes)
    return CheckpointManifest(**fields)  # type: ignore[arg-type]


def make_state(step: int, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return capture(step, model, optimizer)


class Published:
    """Stands in for the rendezvous call: keeps manifests by the store's rule."""

    def __init__(self, keep: int = 3) -> None:
        self.keep = keep
        self.kept: list[CheckpointManifest] = []

    def __call__(self, m: CheckpointManifest) -> tuple[bool, Sequence[CheckpointManifest]]:
        accepted, self.kept = record(self.kept, m, self.keep)
        return accepted, self.kept


# --- the manifest ------------------------------------------------------------------


def test_a_manifest_is_recorded_only_if_newer_than_every_kept_one():
    kept: list[CheckpointManifest] = []
    for step in (4, 9, 14, 19):
        accepted, kept = record(kept, manifest(step), keep=3)
        assert accepted
    assert [m.step for m in kept] == [19, 14, 9]
    accepted, after = record(kept, manifest(14), keep=3)
    assert not accepted and after == kept


@pytest.mark.parametrize(
    "changes",
    [
        {"step": -1},
        {"uri": ""},
        {"uri": "a\x00b"},
        {"uri": "x" * 5000},
        {"size": 0},
        {"sha256": "XYZ"},
        {"sha256": "A" * 64},
        {"digest": ""},
        {"step_seconds": float("nan")},
    ],
)
def test_a_malformed_manifest_is_refused_with_a_named_error(changes):
    with pytest.raises(InvalidRequest):
        manifest(3, **changes)


def test_manifest_round_trips_through_a_dict():
    m = manifest(7)
    assert CheckpointManifest.from_dict(m.to_dict()) == m


def test_replay_cost_is_replayed_steps_times_step_time_plus_launch_and_load():
    cost = ReplayCost(s_done=27, s_ckpt=19, t_step=0.05, t_launch=2.0, t_load=0.1)
    assert cost.replay_steps == 8
    assert cost.seconds == pytest.approx(8 * 0.05 + 2.0 + 0.1)
    assert cost.to_dict()["replay_cost_s"] == pytest.approx(cost.seconds)


# --- writer and loader ------------------------------------------------------------


def test_the_writer_publishes_only_a_complete_synced_file(tmp_path: Path):
    published = Published()
    writer = CheckpointWriter(tmp_path, JOB, published)
    state = make_state(4)
    assert writer.submit(state, epoch=2, writer="w-1", step_seconds=0.05)
    assert writer.wait(30)
    assert writer.written == 1 and writer.last_error is None
    (m,) = published.kept
    blob = Path(m.uri).read_bytes()
    assert m.step == 4 and m.epoch == 2 and m.size == len(blob)
    assert m.sha256 == hashlib.sha256(blob).hexdigest()
    assert m.digest == digest(state)
    # No temporary is left; the manifest's copy lies beside the file.
    name = file_name(JOB, 4, "w-1")
    assert sorted(p.name for p in tmp_path.iterdir()) == [name, manifest_file_name(name)]
    copy = json.loads((tmp_path / manifest_file_name(name)).read_text())
    assert CheckpointManifest.from_dict(copy) == m


def test_the_writer_deletes_its_files_the_record_no_longer_names(tmp_path: Path):
    published = Published(keep=2)
    writer = CheckpointWriter(tmp_path, JOB, published)
    for step in (4, 9, 14):
        assert writer.submit(make_state(step), 1, "w-1", 0.05)
        assert writer.wait(30)
    names = sorted(p.name for p in tmp_path.iterdir())
    kept = [file_name(JOB, 9, "w-1"), file_name(JOB, 14, "w-1")]
    assert names == sorted([*kept, *map(manifest_file_name, kept)])  # the copies go too


def test_a_new_writer_removes_what_kills_left_of_its_job_and_nothing_else(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """A worker killed while it wrote a checkpoint leaves its temporary
    (checkpoint-sized), one killed between deleting a superseded file and
    its manifest copy leaves a bare copy. Nothing names either and nobody
    else would delete them: over a run with many kills they would fill the
    disk. A writer removes them when it starts, once they are an hour old
    (a temporary younger may be another worker's write in progress)."""
    name = file_name(JOB, 8, "w-1")
    hour = 3600.0

    def put(file: str, data: bytes = b"x" * 100, age: float = 2 * hour) -> Path:
        path = tmp_path / file
        path.write_bytes(data)
        os.utime(path, (time.time() - age, time.time() - age))
        return path

    stale = [
        put(f".{name}.4242.0badc0de.tmp"),  # a checkpoint file being written
        put(f".{manifest_file_name(name)}.4242.0badc0de.tmp"),  # its manifest copy
        put(f".{part_file_name(JOB, 8, 'w-2')}.77.12345678.tmp"),  # a sharded part
        put(manifest_file_name(file_name(JOB, 3, "w-1"))),  # a copy whose file is gone
    ]
    kept = [
        put(f".{name}.4243.0badc0de.tmp", age=60.0),  # young: maybe a write in progress
        put(name),  # a checkpoint named in no record: kept for adoption
        put(manifest_file_name(name)),  # and its copy
        put(f".{file_name('other', 8, 'w-1')}.1.0badc0de.tmp"),  # another job's
        put(manifest_file_name(file_name("other", 3, "w-1"))),
        put(".notes.1.0badc0de.tmp"),  # not a checkpoint's
        put("mine.txt"),
    ]
    directory = tmp_path / f".{file_name(JOB, 10, 'w-1')}.1.0badc0de.tmp"
    directory.mkdir()  # not a regular file
    link = tmp_path / f".{file_name(JOB, 9, 'w-1')}.5.0badc0de.tmp"
    link.symlink_to(tmp_path / "mine.txt")
    with caplog.at_level("INFO", logger="rollcall.checkpoint"):
        CheckpointWriter(tmp_path, JOB, Published())
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in kept) and link.is_symlink() and directory.is_dir()
    said = [r.getMessage() for r in caplog.records if "left by" in r.getMessage()]
    assert said == [
        f"removed 4 files of job {JOB} left by killed writers (400 bytes) in {tmp_path}"
    ]


def test_a_failed_publish_is_reported_and_the_next_checkpoint_still_written(tmp_path: Path):
    calls = []

    def refuse(m: CheckpointManifest) -> tuple[bool, Sequence[CheckpointManifest]]:
        calls.append(m.step)
        if len(calls) == 1:
            raise InvalidRequest("stale epoch")
        return True, [m]

    writer = CheckpointWriter(tmp_path, JOB, refuse)
    writer.submit(make_state(4), 1, "w-1", 0.05)
    writer.wait(30)
    assert writer.written == 0 and "stale epoch" in (writer.last_error or "")
    writer.submit(make_state(9), 1, "w-1", 0.05)
    writer.wait(30)
    assert writer.written == 1 and writer.last_error is None


def write_checkpoints(tmp_path: Path, steps: Sequence[int]) -> list[CheckpointManifest]:
    published = Published(keep=len(steps))
    writer = CheckpointWriter(tmp_path, JOB, published)
    for step in steps:
        writer.submit(make_state(step, seed=step), 1, "w-1", 0.05)
        assert writer.wait(30)
    return published.kept


def test_the_loader_takes_the_newest_checkpoint_and_verifies_it(tmp_path: Path):
    kept = write_checkpoints(tmp_path, [4, 9])
    loaded = load_newest(kept)
    assert loaded.manifest.step == 9 and loaded.state.step == 9
    assert digest(loaded.state) == kept[0].digest and loaded.skipped == ()


@pytest.mark.parametrize(
    "damage",
    ["flip_byte", "truncate", "delete", "swap_for_older"],
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, damage):
    kept = write_checkpoints(tmp_path, [4, 9])
    newest = Path(kept[0].uri)
    data = newest.read_bytes()
    if damage == "flip_byte":
        newest.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "delete":
        newest.unlink()
    else:
        newest.write_bytes(Path(kept[1].uri).read_bytes())
    loaded = load_newest(kept)
    assert loaded.manifest.step == 4
    assert len(loaded.skipped) == 1 and "step 9" in loaded.skipped[0]


def test_a_file_that_matches_its_sha_but_not_the_state_digest_is_refused(tmp_path: Path):
    (m,) = write_checkpoints(tmp_path, [4])
    forged = CheckpointManifest(**{**m.to_dict(), "digest": "sha256:" + "1" * 64})
    with pytest.raises(CheckpointUnusable, match="step 4"):
        load_newest([forged])


def test_no_usable_checkpoint_is_a_named_error_and_the_files_are_left_alone(tmp_path: Path):
    kept = write_checkpoints(tmp_path, [4, 9])
    for m in kept:
        Path(m.uri).write_bytes(b"garbage")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(CheckpointUnusable) as error:
        load_newest(kept)
    assert "step 9" in str(error.value) and "step 4" in str(error.value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_process_age_is_the_time_since_this_process_started():
    age = process_age()
    assert 0 < age < 24 * 3600


# --- files etcd no longer names (etcd lost the job's data) ------------------------


def test_orphaned_files_are_read_with_their_manifest_copies_newest_written_first(
    tmp_path: Path,
):
    old = tmp_path / "old"
    written(old, [4, 9, 14], keep=10)
    moved = tmp_path / "moved"
    old.rename(moved)  # the directory is mounted elsewhere now
    orphans = find_orphans(moved, JOB)
    assert [m.step for m in orphans.manifests] == [14, 9, 4] and not orphans.unchecked
    assert all(Path(m.uri).parent == moved for m in orphans.manifests)
    loaded = load_newest(orphans.manifests)
    assert loaded.manifest.step == 14 and loaded.state.step == 14
    assert digest(loaded.state) == orphans.manifests[0].digest
    assert find_orphans(moved, "another-job").manifests == ()


def test_an_earlier_run_under_the_same_job_name_does_not_win_by_its_higher_step(
    tmp_path: Path,
):
    written(tmp_path, [900], keep=10, name="w-old")  # a run later started over on purpose
    copy = tmp_path / manifest_file_name(file_name(JOB, 900, "w-old"))
    record_ = json.loads(copy.read_text())
    copy.write_text(json.dumps({**record_, "created_unix": record_["created_unix"] - 3600}))
    written(tmp_path, [300], keep=10, name="w-new")
    assert [m.step for m in find_orphans(tmp_path, JOB).manifests] == [300, 900]


def _no_record() -> Status:
    """What Status answers for a job etcd holds no record of."""
    return Status(View(epoch=0, members=()), leader="", step=None, replica="r", rollcall_epoch=0)


def _resume(directory: Path, start_over: bool = False) -> int | None:
    chosen = choose(_no_record(), job=JOB, directory=directory, start_over=start_over,
                    fingerprint=JobFingerprint.of({}))  # fmt: skip
    return None if chosen is None else chosen.loaded.manifest.step


def _corrupt(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF
    path.write_bytes(bytes(blob))


def test_the_files_of_a_run_started_over_are_never_resumed_from_after_another_loss(
    tmp_path: Path,
):
    # etcd lost the job's record; the operator started over on purpose
    # (--start-over) with the old run's files still in the directory. Then
    # etcd lost the record again: at eed8d21 the restarted workers resumed
    # the old run at step 900 (no file of the new run yet, or the new run's
    # newest corrupt), a model the operator had discarded, said only as
    # "resumed from the newest written one".
    written(tmp_path, [600, 900], keep=10, name="w-old")
    assert _resume(tmp_path) == 900  # no start-over: the files are adopted
    assert _resume(tmp_path, start_over=True) is None
    with pytest.raises(ProgressLost, match="all of a run that was started over") as caught:
        _resume(tmp_path)  # lost again before the new run wrote a checkpoint
    assert f"delete {tmp_path / started_over_file_name(JOB)}" in str(caught.value)
    written(tmp_path, [100, 200], keep=10, name="w-new")
    assert _resume(tmp_path) == 200
    _corrupt(tmp_path / file_name(JOB, 200, "w-new"))
    assert _resume(tmp_path) == 100
    _corrupt(tmp_path / file_name(JOB, 100, "w-new"))
    with pytest.raises(CheckpointUnusable):
        _resume(tmp_path)  # not the old run's 900
    (tmp_path / started_over_file_name(JOB)).unlink()  # the operator's way back to it
    assert _resume(tmp_path) == 900


def test_a_malformed_list_of_started_over_files_is_refused_rather_than_guessed(tmp_path: Path):
    written(tmp_path, [600], keep=10, name="w-old")
    assert _resume(tmp_path, start_over=True) is None
    written(tmp_path, [100], keep=10, name="w-new")
    marker = tmp_path / started_over_file_name(JOB)
    for text in ("{not json", "[]", '{"job": "other", "at": 1.0, "files": {}}',
                 f'{{"job": "{JOB}", "at": 1.0, "files": {{"a": "yesterday"}}}}'):  # fmt: skip
        marker.write_text(text)
        with pytest.raises(ProgressLost, match="is malformed"):
            _resume(tmp_path)
    assert _resume(tmp_path, start_over=True) is None  # listed anew: both runs' files
    assert set(json.loads(marker.read_text())["files"]) == set(_ckpt_names(tmp_path))


def test_starting_over_where_the_files_cannot_be_listed_as_discarded_changes_nothing(
    tmp_path: Path,
):
    written(tmp_path, [600], keep=10, name="w-old")
    blocked = tmp_path / started_over_file_name(JOB)
    blocked.mkdir()  # the list cannot be written (a read-only directory stops no root)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(CannotResume, match="cannot be listed as the discarded run's"):
        _resume(tmp_path, start_over=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    blocked.rmdir()
    assert _resume(tmp_path) == 600


def _ckpt_names(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith("ckpt+")
            and not p.name.endswith(MANIFEST_SUFFIX)]  # fmt: skip


def test_orphaned_files_that_cannot_be_checked_are_named_with_the_reason(tmp_path: Path):
    written(tmp_path, [4, 9, 14, 19], keep=10)
    (tmp_path / manifest_file_name(file_name(JOB, 4, "w-1"))).unlink()
    (tmp_path / manifest_file_name(file_name(JOB, 9, "w-1"))).write_text("{not json")
    lying = tmp_path / manifest_file_name(file_name(JOB, 14, "w-1"))
    lying.write_text(json.dumps({**json.loads(lying.read_text()), "step": 19}))
    os.chown(tmp_path / file_name(JOB, 19, "w-1"), 4321, 4321)
    orphans = find_orphans(tmp_path, JOB)
    assert orphans.manifests == ()
    reasons = "\n".join(orphans.unchecked)
    assert len(orphans.unchecked) == 4, reasons
    for words in ("no manifest copy", "malformed", "claims step 19", "owned by uid 4321"):
        assert words in reasons, reasons


def test_a_corrupt_orphaned_file_is_passed_over_for_an_older_one_that_verifies(
    tmp_path: Path,
):
    written(tmp_path, [4, 9], keep=10)
    newest = tmp_path / file_name(JOB, 9, "w-1")
    blob = bytearray(newest.read_bytes())
    blob[-1] ^= 0xFF  # same size, one byte flipped
    newest.write_bytes(bytes(blob))
    loaded = load_newest(find_orphans(tmp_path, JOB).manifests)
    assert loaded.manifest.step == 4
    assert len(loaded.skipped) == 1 and "SHA-256" in loaded.skipped[0]


def test_an_adopted_checkpoint_is_published_and_older_orphans_pruned_once_superseded(
    tmp_path: Path,
):
    written(tmp_path, [4, 9, 14], keep=10)
    orphans = find_orphans(tmp_path, JOB).manifests
    published = Published(keep=1)
    writer = CheckpointWriter(tmp_path, JOB, published)
    writer.adopt(orphans[0], orphans)
    assert writer.wait(30)
    assert [m.step for m in published.kept] == [14] and writer.durable_step == 14
    assert names(tmp_path) == [file_name(JOB, 14, "w-1")]  # 4 and 9 pruned with their copies
    written(tmp_path, [19], writer=writer)
    assert names(tmp_path) == [file_name(JOB, 19, "w-1")]


# --- the etcd record ------------------------------------------------------------------


def test_etcd_keeps_the_newest_manifests_and_refuses_older_ones(etcd):
    with EtcdStore([etcd.endpoint], "ckjob", Config()) as store:
        assert store.read_checkpoints() == []
        for step in (4, 9, 14, 19):
            accepted, kept = store.publish_checkpoint(manifest(step), keep=3)
            assert accepted
        assert [m.step for m in store.read_checkpoints()] == [19, 14, 9]
        accepted, kept = store.publish_checkpoint(manifest(9), keep=3)
        assert not accepted and [m.step for m in kept] == [19, 14, 9]
        again, _ = store.publish_checkpoint(manifest(19), keep=3)
        assert again  # the same manifest again (a retried call) counts as recorded


def test_a_checkpoint_due_while_the_previous_one_is_written_is_skipped(tmp_path: Path):
    release = threading.Event()

    def slow(m: CheckpointManifest) -> tuple[bool, Sequence[CheckpointManifest]]:
        release.wait(30)
        return True, [m]

    writer = CheckpointWriter(tmp_path, JOB, slow)
    assert writer.submit(make_state(4), 1, "w-1", 0.05)
    assert not writer.ready(9) and not writer.submit(make_state(9), 1, "w-1", 0.05)
    assert writer.skipped == 2
    release.set()
    assert writer.wait(30) and writer.written == 1 and writer.ready(14)


# --- trusting the record: names, pruning, forged manifests -------------------------


def written(
    tmp_path: Path, steps: Sequence[int], keep: int = 3, job: str = JOB,
    writer: CheckpointWriter | None = None, name: str = "w-1",
) -> CheckpointWriter:  # fmt: skip
    """A writer (new, or ``writer``) that wrote ``steps`` into ``tmp_path``."""
    if writer is None:
        writer = CheckpointWriter(tmp_path, job, Published(keep))
    for step in steps:
        assert writer.submit(make_state(step, seed=step), 1, name, 0.05)
        assert writer.wait(30)
    return writer


def names(directory: Path) -> list[str]:
    """The files in ``directory`` but the manifest copies, after checking
    that every copy lies beside its file (none outlives it)."""
    every = sorted(p.name for p in directory.iterdir())
    files = [name for name in every if not name.endswith(MANIFEST_SUFFIX)]
    stale = [name for name in every if name.endswith(MANIFEST_SUFFIX)
             and name.removesuffix(MANIFEST_SUFFIX) not in files]  # fmt: skip
    assert not stale, f"manifest copies without their file: {stale}"
    return files


def test_file_names_carry_the_job_the_step_and_the_writer():
    name = file_name("run1", 299, "w0-1a2b")
    assert name == "ckpt+run1+000000000299+w0-1a2b.rcs"
    assert parse_file_name(name, "run1") == 299
    assert parse_file_name(name, "run") is None and parse_file_name(name, "run1+") is None
    # '+' is no id character: a job named like another's prefix never matches.
    assert parse_file_name(file_name("a-000000000001", 5, "w"), "a") is None
    assert parse_file_name(".ckpt+run1+000000000299+w0.rcs.12.ab.tmp", "run1") is None


def test_checkpoint_files_and_their_directory_are_private(tmp_path: Path):
    directory = tmp_path / "new" / "ckpt"
    old = os.umask(0)  # what the file is created with, not what a umask leaves of it
    try:
        written(directory, [4])
    finally:
        os.umask(old)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    paths = list(directory.iterdir())
    assert len(paths) == 2  # the file and its manifest's copy
    assert [stat.S_IMODE(path.stat().st_mode) for path in paths] == [0o600, 0o600]


def forged_record(steps: Sequence[int], directory: Path) -> list[CheckpointManifest]:
    return [
        manifest(step, uri=str(directory / f"forged-{step}"), size=1000, writer="evil-1")
        for step in steps
    ]


def test_forged_manifests_make_the_writer_delete_nothing_and_it_reports_them(tmp_path: Path):
    writer = written(tmp_path, [4, 9])
    before = names(tmp_path)
    failures: list[tuple[int, str]] = []
    published = Published()
    published.kept = forged_record([10**12, 10**12 - 1, 10**12 - 2], tmp_path)
    writer._publish, writer._on_failure = published, lambda s, r: failures.append((s, r))
    written(tmp_path, [14, 19], writer=writer)
    new = [file_name(JOB, 14, "w-1"), file_name(JOB, 19, "w-1")]
    assert names(tmp_path) == sorted([*before, *new])
    assert [s for s, _ in failures] == [14, 19]
    assert "cannot verify" in failures[0][1] and writer.failing == 2


def test_a_manifest_that_lies_about_a_real_files_step_counts_for_nothing(tmp_path: Path):
    writer = written(tmp_path, [4, 9, 14])
    own = {m.step: m for m in writer._publish.kept}  # type: ignore[attr-defined]
    # The file of step 4, claimed to hold step 13: deleting 9 on its account
    # would keep nothing newer that is real.
    liar = CheckpointManifest(**{**own[4].to_dict(), "step": 13})
    writer._settle(own[14], False, [liar])
    assert names(tmp_path) == [file_name(JOB, s, "w-1") for s in (4, 9, 14)]


def test_a_manifest_beyond_the_written_step_is_not_believed_even_for_a_real_file(tmp_path: Path):
    writer = written(tmp_path, [4, 9])
    own = {m.step: m for m in writer._publish.kept}  # type: ignore[attr-defined]
    elsewhere = tmp_path / "elsewhere.rcs"  # a real file, outside the job's names
    elsewhere.write_bytes(Path(own[9].uri).read_bytes())
    ahead = CheckpointManifest(**{**own[9].to_dict(), "step": 500, "uri": str(elsewhere)})
    writer._settle(own[9], False, [ahead])
    assert file_name(JOB, 4, "w-1") in names(tmp_path)


def test_another_jobs_files_in_the_same_directory_are_never_touched(tmp_path: Path):
    other = written(tmp_path, [4, 9], job="other")
    theirs = names(tmp_path)
    ours = Published(keep=2)
    # Even a record of ours that names the other job's file does not make it ours.
    ours.kept = list(other._publish.kept)  # type: ignore[attr-defined]
    written(tmp_path, [14, 19, 24], writer=CheckpointWriter(tmp_path, JOB, ours))
    assert set(theirs) <= set(names(tmp_path))
    assert [n for n in names(tmp_path) if n not in theirs] == [
        file_name(JOB, 19, "w-1"), file_name(JOB, 24, "w-1")
    ]  # fmt: skip


def test_a_new_writer_prunes_the_files_its_jobs_record_named(tmp_path: Path):
    """Rank 0 changed: the new writer deletes the old one's files once the
    record it saw naming them no longer does. (A file that left the record
    before the new writer first saw it stays: it was never named to it.)"""
    published = Published(keep=2)
    written(tmp_path, [4, 9], writer=CheckpointWriter(tmp_path, JOB, published), name="w-old")
    successor = CheckpointWriter(tmp_path, JOB, published)
    written(tmp_path, [14], writer=successor, name="w-new")  # record: 14 (new), 9 (old)
    assert file_name(JOB, 9, "w-old") in names(tmp_path)
    written(tmp_path, [19], writer=successor, name="w-new")  # record: 19, 14
    assert names(tmp_path) == sorted(
        [file_name(JOB, 4, "w-old"), file_name(JOB, 14, "w-new"), file_name(JOB, 19, "w-new")]
    )


def test_the_newest_complete_checkpoint_is_never_superseded_by_unverified_ones():
    files = {"/d/a": 4, "/d/b": 9}
    kept = [manifest(20, uri="/d/forged"), manifest(9, uri="/d/b")]
    assert superseded(files, kept, verified=set(), written_step=9) == []
    assert superseded(files, kept, verified={"/d/forged"}, written_step=9) == []  # beyond 9
    assert superseded(files, kept, verified={"/d/b"}, written_step=9) == ["/d/a"]


@contextlib.contextmanager
def filesystem(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` at ``where``, unmounted afterwards (always)."""
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                   check=True, capture_output=True, timeout=30)  # fmt: skip
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def remount(where: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True,
                   capture_output=True, timeout=30)  # fmt: skip


class Outcomes:
    """What a writer reports, and any exception that ends one of its threads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.failures: list[tuple[int, str]] = []
        self.durable: list[int] = []
        self.crashes: list[BaseException | None] = []
        monkeypatch.setattr(threading, "excepthook", lambda a: self.crashes.append(a.exc_value))

    def writer(self, directory: Path) -> CheckpointWriter:
        return CheckpointWriter(
            directory, JOB, Published(), on_failure=lambda s, r: self.failures.append((s, r)),
            on_durable=self.durable.append,
        )  # fmt: skip


@pytest.mark.integration  # mounts a tmpfs (mount(8))
def test_a_read_only_directory_fails_each_checkpoint_without_ending_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    seen = Outcomes(monkeypatch)
    with filesystem(tmp_path / "disk", "16m") as disk:
        writer = written(disk / "ckpt", [4], writer=seen.writer(disk / "ckpt"))
        remount(disk, "ro")
        written(disk / "ckpt", [9, 14], writer=writer)
        assert [s for s, _ in seen.failures] == [9, 14]
        assert all("Read-only file system (EROFS)" in r for _, r in seen.failures)
        assert writer.failing == 2 and writer.durable_step == 4 and writer.failing_since
        remount(disk, "rw")
        written(disk / "ckpt", [19], writer=writer)
        assert seen.durable == [4, 19] and writer.failing == 0 and writer.last_error is None
    assert seen.crashes == []


@pytest.mark.integration  # mounts a tmpfs (mount(8))
def test_a_full_disk_fails_cleanly_and_the_writer_recovers_when_it_has_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    seen = Outcomes(monkeypatch)
    size = len(to_bytes(make_state(4)))
    with filesystem(tmp_path / "disk", str(size * 3 // 2)) as disk:
        writer = written(disk, [4], writer=seen.writer(disk))
        written(disk, [9], writer=writer)
        assert seen.failures and "No space left on device (ENOSPC)" in seen.failures[0][1]
        assert names(disk) == [file_name(JOB, 4, "w-1")]  # no temporary file left behind
        remount(disk, f"size={size * 4}")
        written(disk, [14], writer=writer)
        assert seen.durable == [4, 14] and writer.failing == 0
    assert seen.crashes == []


def test_a_failure_report_that_raises_does_not_end_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    seen = Outcomes(monkeypatch)

    def broken(step: int, reason: str) -> None:
        raise RuntimeError("the service is gone")

    def refuse(m: CheckpointManifest) -> tuple[bool, Sequence[CheckpointManifest]]:
        raise InvalidRequest("no")

    writer = CheckpointWriter(tmp_path, JOB, refuse, on_failure=broken)
    written(tmp_path, [4, 9], writer=writer)
    assert writer.failing == 2 and "written but not published: no" in (writer.last_error or "")
    assert seen.crashes == []


# --- the record's pure rules ----------------------------------------------------------


def test_the_jobs_progress_bounds_the_steps_a_manifest_may_hold():
    assert progress_limit(None, None) is None  # never trained: no checkpoint can exist
    assert progress_limit(None, 40, 38) == 41
    trusted, beyond = beyond_progress([manifest(10**12), manifest(41), manifest(39)], 41)
    assert [m.step for m in trusted] == [41, 39] and [m.step for m in beyond] == [10**12]
    assert beyond_progress([manifest(3)], None) == ([], [manifest(3)])


def test_a_failure_streak_keeps_its_start_until_a_later_checkpoint_is_recorded():
    first = next_failure(None, 99, 199, "disk full", "w-1", now_unix=100.0)
    assert (first.failures, first.since_unix, first.step) == (1, 100.0, 199)
    second = next_failure(first, 99, 299, "still full", "w-1", now_unix=160.0)
    assert (second.failures, second.since_unix, second.reason) == (2, 100.0, "still full")
    assert durability([manifest(99)], second, limit=400).failure == second
    assert not durability([manifest(399), manifest(99)], second, limit=400).stuck
    again = next_failure(second, 399, 499, "read-only", "w-1", now_unix=300.0)
    assert (again.failures, again.since_unix) == (1, 300.0)
    # A forged manifest beyond the job's progress is not durability.
    assert durability([manifest(10**12), manifest(99)], second, 400).durable_step == 99


def test_a_failure_record_round_trips_and_a_malformed_one_is_refused():
    failure = CheckpointFailure(299, "No space left on device (ENOSPC)", 12.5, 3, "w-1")
    assert CheckpointFailure.from_dict(failure.to_dict()) == failure
    for bad in ({}, {**failure.to_dict(), "failures": "3"}, {**failure.to_dict(), "since_unix":
                float("nan")}, [1]):  # fmt: skip
        with pytest.raises(InvalidRequest):
            CheckpointFailure.from_dict(bad)


# --- the etcd record, read and repaired --------------------------------------------------


def put(endpoint: str, key: str, value: str) -> None:
    subprocess.run(["etcdctl", f"--endpoints={endpoint}", "put", key, value],
                   env={**os.environ, "ETCDCTL_API": "3"}, check=True, capture_output=True,
                   timeout=30)  # fmt: skip


def test_a_malformed_record_in_etcd_is_ignored_and_the_next_publication_replaces_it(etcd):
    put(etcd.endpoint, f"/rollcall/jobs/{JOB}/checkpoints", "[{not json")
    with EtcdStore([etcd.endpoint], JOB, Config()) as store:
        assert store.read_checkpoints() == []
        accepted, kept = store.publish_checkpoint(manifest(4), keep=3, limit=5)
        assert accepted and store.read_checkpoints() == [manifest(4)]


def test_publishing_drops_recorded_manifests_beyond_the_jobs_progress(etcd):
    with EtcdStore([etcd.endpoint], JOB, Config()) as store:
        for m in (manifest(4), manifest(10**12)):
            store.publish_checkpoint(m, keep=3)  # no limit: as a forger writing etcd would
        accepted, kept = store.publish_checkpoint(manifest(9), keep=3, limit=10)
        assert accepted and [m.step for m in kept] == [9, 4] == [
            m.step for m in store.read_checkpoints()
        ]
        # Not newer than what is left, but the forged one still goes.
        store.publish_checkpoint(manifest(10**12), keep=3)
        accepted, kept = store.publish_checkpoint(manifest(9), keep=3, limit=10)
        assert accepted and [m.step for m in store.read_checkpoints()] == [9, 4]


def test_forgetting_removes_the_named_steps_or_the_whole_record(etcd):
    with EtcdStore([etcd.endpoint], JOB, Config()) as store:
        for step in (4, 9, 14):
            store.publish_checkpoint(manifest(step), keep=3)
        with pytest.raises(NoSuchCheckpoint, match="no checkpoint of step 5 is recorded"):
            store.forget_checkpoints([9, 5])
        assert [m.step for m in store.read_checkpoints()] == [14, 9, 4]
        forgotten, kept = store.forget_checkpoints([9])
        assert [m.step for m in forgotten] == [9] and [m.step for m in kept] == [14, 4]
        put(etcd.endpoint, f"/rollcall/jobs/{JOB}/checkpoints", '[{"step": "bad"}]')
        forgotten, kept = store.forget_checkpoints(None)
        assert (forgotten, kept) == ([], []) and store.read_checkpoints() == []
        assert not store.read_fingerprint().checkpoints  # the key is gone, not an empty list


def test_the_failure_record_is_kept_in_etcd_and_a_malformed_one_ignored(etcd):
    failure = CheckpointFailure(299, "Read-only file system (EROFS)", 12.5, 3, "w-1")
    with EtcdStore([etcd.endpoint], JOB, Config()) as store:
        assert store.read_checkpoint_failure() is None
        store.write_checkpoint_failure(failure)
        assert store.read_checkpoint_failure() == failure
        put(etcd.endpoint, f"/rollcall/jobs/{JOB}/checkpoint_failure", "nonsense")
        assert store.read_checkpoint_failure() is None
        store.write_checkpoint_failure(None)
        assert store.read_checkpoint_failure() is None


def test_the_live_view_and_status_warn_while_durability_is_stuck():
    from types import SimpleNamespace

    from rollcall.checkpoints import durability_line
    from rollcall.live import headline
    from rollcall.membership.checkpoint import CheckpointFailure, Durability

    failure = CheckpointFailure(349, "No space left on device (ENOSPC): /d/x", 1.0e9, 4, "w-1")
    cluster = SimpleNamespace(workers=[], options=SimpleNamespace(steps=None))
    summary = {"goodput": None, "view_changes": []}

    def status(durability: Durability) -> SimpleNamespace:
        view = SimpleNamespace(epoch=3, size=2)
        return SimpleNamespace(step=400, view=view, checkpoints=[], durability=durability)

    assert durability_line(Durability(299)) is None
    assert "\n" not in headline(cluster, status(Durability(299)), summary)  # type: ignore[arg-type]
    line = durability_line(Durability(299, failure))
    assert line is not None and line.startswith("durability stuck at step 299 since ")
    assert "No space left on device (ENOSPC)" in line and "4 failed attempts" in line
    shown = headline(cluster, status(Durability(299, failure)), summary)  # type: ignore[arg-type]
    assert shown.splitlines()[1] == f"warning: {line}"
    assert durability_line(Durability(None, failure)).startswith(  # type: ignore[union-attr]
        "durability stuck at no checkpoint since "
    )


def test_a_resuming_worker_passes_over_checkpoints_beyond_the_jobs_progress(tmp_path: Path):
    published, forged = Published(), Published()
    written(tmp_path / "real", [4, 9], writer=CheckpointWriter(tmp_path / "real", JOB, published))
    # A file that passes every check of its own manifest, of a step the job never reached.
    written(tmp_path / "lure", [10**11], writer=CheckpointWriter(tmp_path / "lure", JOB, forged))
    real, lure = published.kept[0], forged.kept[0]
    assert load_newest([lure, real]).manifest == lure  # what the progress check stops
    loaded = load_newest([lure, real], limit=real.step + 1)
    assert loaded.manifest == real and "beyond the job's recorded progress" in loaded.skipped[0]
    assert load_newest([real], limit=None).manifest == real  # no progress known: none checked
    with pytest.raises(CheckpointUnusable, match="beyond the job's recorded progress"):
        load_newest([real], limit=real.step - 1)


def test_when_no_orphaned_file_loads_the_error_says_where_they_were_and_what_to_do(
    tmp_path: Path,
):
    written(tmp_path, [4], keep=10)
    path = tmp_path / file_name(JOB, 4, "w-1")
    path.write_bytes(b"\0" * path.stat().st_size)  # same size, nothing of the state left
    with pytest.raises(CheckpointUnusable) as caught:
        load_newest(find_orphans(tmp_path, JOB).manifests, found="files here", recovery="do X")
    text = str(caught.value)
    assert "among the 1 files here" in text and "SHA-256" in text and text.endswith("do X")
    assert "checkpoints forget" not in text  # the record's repair does not apply here


def test_a_manifest_copy_keeps_the_fingerprint_of_the_job_that_wrote_the_file(tmp_path: Path):
    fingerprint = JobFingerprint.of({"global_batch": "32", "seed": "0"})
    writer = CheckpointWriter(tmp_path, JOB, Published(), fingerprint=fingerprint)
    written(tmp_path, [4], writer=writer)
    written(tmp_path / "none", [4])  # a writer told no fingerprint keeps none
    orphans = find_orphans(tmp_path, JOB)
    assert list(orphans.fingerprints.values()) == [fingerprint]
    assert list(find_orphans(tmp_path / "none", JOB).fingerprints.values()) == [None]
