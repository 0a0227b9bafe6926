"""Durable checkpoints: the manifest rules, the background writer, the loader
that trusts nothing it has not checked, and the etcd record."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from membership.checkpoint import CheckpointManifest, ReplayCost, file_name, record
from membership.config import Config
from membership.errors import InvalidRequest
from rendezvous.store import EtcdStore
from worker.checkpoint import CheckpointUnusable, CheckpointWriter, load_newest, process_age
from worker.state import capture, digest


def manifest(at: int, **changes: object) -> CheckpointManifest:
    step = at
    fields: dict[str, object] = {
        "step": step, "digest": "sha256:ab", "uri": f"/ckpt/{file_name(step)}", "size": 10,
        "sha256": "0" * 64, "epoch": 1, "writer": "w-1", "created_unix": 1.0,
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
    writer = CheckpointWriter(tmp_path, published)
    state = make_state(4)
    assert writer.submit(state, epoch=2, writer="w-1", step_seconds=0.05)
    assert writer.wait(30)
    assert writer.written == 1 and writer.last_error is None
    (m,) = published.kept
    blob = Path(m.uri).read_bytes()
    assert m.step == 4 and m.epoch == 2 and m.size == len(blob)
    assert m.sha256 == hashlib.sha256(blob).hexdigest()
    assert m.digest == digest(state)
    assert [p.name for p in tmp_path.iterdir()] == [file_name(4)]  # no temporary left


def test_the_writer_deletes_files_older_than_the_oldest_kept_manifest(tmp_path: Path):
    published = Published(keep=2)
    writer = CheckpointWriter(tmp_path, published)
    for step in (4, 9, 14):
        assert writer.submit(make_state(step), 1, "w-1", 0.05)
        assert writer.wait(30)
    assert sorted(p.name for p in tmp_path.iterdir()) == [file_name(9), file_name(14)]


def test_a_failed_publish_is_reported_and_the_next_checkpoint_still_written(tmp_path: Path):
    calls = []

    def refuse(m: CheckpointManifest) -> tuple[bool, Sequence[CheckpointManifest]]:
        calls.append(m.step)
        if len(calls) == 1:
            raise InvalidRequest("stale epoch")
        return True, [m]

    writer = CheckpointWriter(tmp_path, refuse)
    writer.submit(make_state(4), 1, "w-1", 0.05)
    writer.wait(30)
    assert writer.written == 0 and "stale epoch" in (writer.last_error or "")
    writer.submit(make_state(9), 1, "w-1", 0.05)
    writer.wait(30)
    assert writer.written == 1 and writer.last_error is None


def write_checkpoints(tmp_path: Path, steps: Sequence[int]) -> list[CheckpointManifest]:
    published = Published(keep=len(steps))
    writer = CheckpointWriter(tmp_path, published)
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

    writer = CheckpointWriter(tmp_path, slow)
    assert writer.submit(make_state(4), 1, "w-1", 0.05)
    assert not writer.ready(9) and not writer.submit(make_state(9), 1, "w-1", 0.05)
    assert writer.skipped == 2
    release.set()
    assert writer.wait(30) and writer.written == 1 and writer.ready(14)
