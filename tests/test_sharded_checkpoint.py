"""Durable checkpoints of sharded optimizer state (docs/sharding.md,
"Checkpoints"): each rank that sends partitions writes their state to a part
file of its own, rank 0 writes the rest of the state with a manifest naming
every part, published only once every part is there. Ranks are simulated in
this process (the fast lane; tests/test_sharded_e2e.py runs real workers):
what a resuming worker loads is the replicated optimizer's own state, at
any world size, and a missing, torn or lying part is named, never used."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rollcall.membership.checkpoint import (
    CheckpointManifest,
    CheckpointPart,
    file_name,
    parse_file_name,
    parse_part_name,
    part_file_name,
    record,
)
from rollcall.membership.errors import InvalidRequest
from rollcall.membership.shards import place
from rollcall.protocol.wire import manifest_from_pb, manifest_to_pb
from rollcall.worker.checkpoint import (
    CheckpointUnusable,
    CheckpointWriter,
    Orphans,
    describe_part,
    find_orphans,
    load_newest,
    part_bytes,
    state_problem,
)
from rollcall.worker.sharded import LAYOUT_KEY, PartitionState, ShardedOptimizer
from rollcall.worker.state import capture
from rollcall.worker.state_bytes import from_bytes

JOB = "shjob"
MEMBERS = ["w-a", "w-b", "w-c"]
COUNT = 6


class Published:
    def __init__(self, keep: int = 3) -> None:
        self.keep = keep
        self.kept: list[CheckpointManifest] = []

    def __call__(self, m: CheckpointManifest) -> tuple[bool, Sequence[CheckpointManifest]]:
        accepted, self.kept = record(self.kept, m, self.keep)
        return accepted, self.kept


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}],
                             lr=1e-2, weight_decay=0.1)  # fmt: skip


class Job:
    """Three sharded ranks and the replicated run they stand for."""

    def __init__(self) -> None:
        self.reference = _model()
        self.replicated = _optimizer(self.reference)
        self.plan = place(MEMBERS, {}, COUNT, 2)
        self.ranks: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer, ShardedOptimizer]] = {}
        for member in MEMBERS:
            model = _model()
            optimizer = _optimizer(model)
            self.ranks[member] = (model, optimizer, ShardedOptimizer(optimizer, self.plan, member))
        self.steps = 0
        #: Each rank's checkpoint writer, by directory: kept across
        #: checkpoints, as the runtime keeps it.
        self.writers: dict[tuple[Path, str], CheckpointWriter] = {}

    def writer(self, directory: Path, member: str, published: Published, wait: float):
        key = (directory, member)
        if key not in self.writers:
            self.writers[key] = CheckpointWriter(directory, JOB, published, part_wait=wait)
        return self.writers[key]

    def step(self) -> None:
        generator = torch.Generator().manual_seed(self.steps)
        x, y = torch.randn(8, 5, generator=generator), torch.randn(8, 2, generator=generator)
        self.reference.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(self.reference(x), y).backward()
        for model, _, sharded in self.ranks.values():
            for p, q in zip(model.parameters(), self.reference.parameters(), strict=True):
                p.grad = q.grad.clone()
            sharded.update()
        payloads = [sharded.payload(MEMBERS) for _, _, sharded in self.ranks.values()]
        for _, _, sharded in self.ranks.values():
            sharded.receive(payloads, MEMBERS)
        self.replicated.step()
        self.steps += 1

    def write(
        self, directory: Path, published: Published, skip: str | None = None, wait: float = 30.0
    ) -> CheckpointWriter:
        """The checkpoint of the last step as the runtime writes it: each rank
        its part (but ``skip``), rank 0 (w-a) the rest and the manifest."""
        step = self.steps - 1
        writers, blobs, parts = {}, {}, []
        for member, (_, _, sharded) in self.ranks.items():
            writers[member] = self.writer(directory, member, published, wait)
            mine = [sharded.export(p) for p in sharded.sent_by_me(MEMBERS)]
            blobs[member] = part_bytes(mine)
            path = writers[member].part_path(step, member)
            parts.append(describe_part(str(path), blobs[member], mine))
        for member in MEMBERS[1:]:
            if member != skip:
                assert writers[member].submit_part(step, member, blobs[member])
                assert writers[member].wait(30)
        model, optimizer, sharded = self.ranks["w-a"]
        state = capture(step, model, optimizer)
        state.optimizer = sharded.checkpoint_entry()
        first = writers["w-a"]
        assert first.submit(state, 1, "w-a", 0.05, parts=parts, own_part=blobs["w-a"])
        assert first.wait(60)
        return first


def same_state(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(
        a["state"][i].keys() == b["state"][i].keys()
        and all(torch.equal(a["state"][i][k], b["state"][i][k]) for k in a["state"][i])
        for i in a["state"]
    )


def trained(steps: int = 3) -> Job:
    job = Job()
    for _ in range(steps):
        job.step()
    return job


def test_each_owner_writes_its_partitions_and_the_loaded_state_is_the_replicated_optimizers(
    tmp_path: Path,
) -> None:
    job = trained()
    published = Published()
    first = job.write(tmp_path, published)
    assert first.written == 1 and first.last_error is None
    (manifest,) = published.kept
    # One part per rank that sends partitions, each in a file of its writer.
    writers = {Path(part.uri).name.split("+")[3].removesuffix(".rcs") for part in manifest.parts}
    assert writers == set(MEMBERS)
    assert sorted(p for part in manifest.parts for p in part.partitions) == list(range(COUNT))
    # The main file holds no optimizer state, only its groups and the layout.
    main = from_bytes(Path(manifest.uri).read_bytes())
    assert set(main.optimizer) == {"state", "param_groups", LAYOUT_KEY}
    assert main.optimizer["state"] == {}
    loaded = load_newest(published.kept)
    assert same_state(loaded.state.optimizer, job.replicated.state_dict())
    for p, q in zip(job.reference.state_dict().values(), loaded.state.model.values(), strict=True):
        assert torch.equal(p, q)


def test_a_sharded_checkpoint_loads_at_another_world_size_and_in_replicated_mode(
    tmp_path: Path,
) -> None:
    job = trained()
    published = Published()
    job.write(tmp_path, published)
    state = load_newest(published.kept).state
    # Two ranks now: each takes its partitions of the new plan.
    plan = place(["w-x", "w-y"], {}, COUNT, 2)
    for member in ("w-x", "w-y"):
        model = _model()
        model.load_state_dict(state.model)
        sharded = ShardedOptimizer(_optimizer(model), plan, member)
        sharded.load_state(state.optimizer)
        for p in plan.owned_by(member):
            mine = sharded.export(p)
            rank_a = job.ranks[job.plan.owners[p][0]][2].export(p)
            assert all(
                torch.equal(x[k], y[k])
                for x, y in zip(mine.segments, rank_a.segments, strict=True)
                for k in x
            )
    # And a replicated optimizer takes it whole.
    replicated = _optimizer(_model())
    replicated.load_state_dict(state.optimizer)
    assert same_state(replicated.state_dict(), job.replicated.state_dict())


def test_a_part_that_never_appears_keeps_the_checkpoint_unpublished_and_says_why(
    tmp_path: Path,
) -> None:
    job = trained()
    published = Published()
    first = job.write(tmp_path, published, skip="w-c", wait=0.3)
    assert published.kept == [] and first.written == 0
    error = first.last_error or ""
    assert part_file_name(JOB, 2, "w-c") in error and "shared" in error
    # Nothing of the attempt is left to be taken for a checkpoint (a copy of
    # its manifest naming a part that is not there) or to pile up unpruned:
    # the main file, the writer's own part and the part it found are gone.
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert find_orphans(tmp_path, JOB) == Orphans((), (), {})


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete"])
def test_a_damaged_part_is_named_and_an_older_checkpoint_is_loaded(
    tmp_path: Path, damage: str
) -> None:
    job = trained(2)
    published = Published()
    job.write(tmp_path, published)
    older = dict(job.replicated.state_dict())
    older = {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in older["state"].items()},
             "param_groups": older["param_groups"]}  # fmt: skip
    job.step()
    job.write(tmp_path, published)
    newest = published.kept[0]
    victim = Path(newest.parts[1].uri)
    if damage == "flip_byte":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-5])
    else:
        victim.unlink()
    _, problem = state_problem(newest)
    assert problem is not None and str(victim) in problem
    loaded = load_newest(published.kept)
    assert loaded.manifest.step == 1 and str(victim) in loaded.skipped[0]
    assert same_state(loaded.state.optimizer, older)


def test_a_part_whose_partitions_are_not_the_ones_it_claims_is_refused(tmp_path: Path) -> None:
    # The file matches the size and SHA-256 its manifest says, but holds
    # other partitions' state under the numbers it claims.
    job = trained()
    published = Published()
    job.write(tmp_path, published)
    manifest = published.kept[0]
    part = manifest.parts[0]
    sender = job.ranks[MEMBERS[0]][2]
    others = [p for p in range(COUNT) if p not in part.partitions and sender.holds(p)]
    assert others, "the first rank holds a partition it does not send"
    swapped = [PartitionState(p, sender.export(others[0]).segments) for p in part.partitions]
    blob = part_bytes(swapped)
    Path(part.uri).write_bytes(blob)
    forged = replace(part, size=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    lying = replace(manifest, parts=(forged, *manifest.parts[1:]))
    _, problem = state_problem(lying)
    assert problem is not None and "fails its digest" in problem and part.uri in problem
    with pytest.raises(CheckpointUnusable):
        load_newest([lying])


def test_superseded_checkpoints_take_their_parts_with_them(tmp_path: Path) -> None:
    job = Job()
    published = Published(keep=2)
    for _ in range(3):
        job.step()
        job.write(tmp_path, published)
    kept = {uri for m in published.kept for uri in m.files}
    on_disk = {str(p) for p in tmp_path.iterdir() if not p.name.endswith(".manifest.json")}
    assert on_disk == kept
    assert {parse_part_name(Path(u).name, JOB) or parse_file_name(Path(u).name, JOB)
            for u in on_disk} == {1, 2}  # fmt: skip


def _part(uri: str, *partitions: int) -> CheckpointPart:
    return CheckpointPart(uri, 10, "1" * 64, partitions, tuple(f"sha256:{p}" for p in partitions))


def _manifest(*parts: CheckpointPart) -> CheckpointManifest:
    return CheckpointManifest(
        step=3, digest="sha256:ab", uri=f"/c/{file_name(JOB, 3, 'w-a')}", size=10,
        sha256="0" * 64, epoch=1, writer="w-a", created_unix=1.0, step_seconds=0.1, parts=parts,
    )  # fmt: skip


def test_a_manifests_parts_round_trip_through_etcds_json_and_the_wire() -> None:
    manifest = _manifest(_part("/c/p1", 2, 0), _part("/c/p2", 1))
    assert CheckpointManifest.from_dict(manifest.to_dict()) == manifest
    assert manifest_from_pb(manifest_to_pb(manifest)) == manifest
    plain = _manifest()
    record_without_parts = {k: v for k, v in plain.to_dict().items() if k != "parts"}
    assert CheckpointManifest.from_dict(record_without_parts) == plain  # written before parts


@pytest.mark.parametrize(
    "parts, why",
    [
        ((("/c/p1", (0,)), ("/c/p2", (2,))), "a partition missing"),
        ((("/c/p1", (0, 1)), ("/c/p2", (1,))), "a partition twice"),
        ((("/c/p1", (0,)), ("/c/p1", (1,))), "two parts in one file"),
        ((("/c/p1", ()),), "a part of no partition"),
    ],
)
def test_a_manifest_whose_parts_do_not_hold_every_partition_once_is_refused(
    parts: tuple, why: str
) -> None:
    with pytest.raises(InvalidRequest):
        _manifest(*(_part(uri, *ps) for uri, ps in parts))
