"""Replica state: capture and restore, canonical digest, byte form, chunks,
stripes and reassembly (worker/state.py, digest.py, state_bytes.py,
stripes.py)."""

from __future__ import annotations

import datetime
import io
import json
import random
import re
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from rollcall.membership.errors import RollcallError
from rollcall.worker import digest as digest_module
from rollcall.worker.digest import PARALLEL_BYTES, PIECE_BYTES, digest
from rollcall.worker.state import CorruptState, ReplicaState, capture, restore
from rollcall.worker.state_bytes import from_bytes, to_bytes
from rollcall.worker.stripes import Assembler, chunks, ranges

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Replica:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def new_replica(seed: int = 0) -> Replica:
    """A small model whose dropout draws from the global torch generator, so
    that a bit-identical next step also needs the RNG state restored."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 4)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return Replica(model, optimizer, scheduler)


def train_step(replica: Replica, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(32, 8, generator=generator)
    targets = torch.randn(32, 4, generator=generator)
    replica.optimizer.zero_grad()
    loss = nn.functional.mse_loss(replica.model(inputs), targets)
    loss.backward()
    replica.optimizer.step()
    replica.scheduler.step()


def trained(steps: int, seed: int = 0) -> Replica:
    replica = new_replica(seed)
    for step in range(steps):
        train_step(replica, step)
    return replica


def capture_replica(replica: Replica, step: int, extras: dict[str, Any] | None = None):
    return capture(step, replica.model, replica.optimizer, replica.scheduler, extras=extras)


def trained_state_digest(steps: int) -> str:
    """Entry point for the two-process test."""
    return digest(capture_replica(trained(steps), steps - 1, extras={"run": "a"}))


def parameters(replica: Replica) -> list[torch.Tensor]:
    return [p.detach().clone() for p in replica.model.parameters()]


def with_dicts_reversed(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: with_dicts_reversed(tree[k]) for k in reversed(list(tree))}
    if isinstance(tree, list):
        return [with_dicts_reversed(item) for item in tree]
    return tree


# ------------------------------------------------------------ capture/restore


@pytest.mark.parametrize("via_bytes", [False, True], ids=["in-memory", "via-bytes"])
def test_restored_replica_takes_a_bit_identical_next_step(via_bytes):
    original = trained(steps=3)
    state = capture_replica(original, step=2)
    if via_bytes:
        state = from_bytes(to_bytes(state))
    # The global generator is shared by both replicas in this process, so the
    # original takes its step before the joiner exists.
    train_step(original, 3)
    joiner = new_replica(seed=99)

    restore(state, joiner.model, joiner.optimizer, joiner.scheduler)
    train_step(joiner, 3)

    for ours, theirs in zip(parameters(original), parameters(joiner), strict=True):
        assert torch.equal(ours, theirs)
    assert original.scheduler.get_last_lr() == joiner.scheduler.get_last_lr()
    assert digest(capture_replica(original, 3)) == digest(capture_replica(joiner, 3))


def test_capture_is_a_snapshot_unaffected_by_later_training():
    replica = trained(steps=2)
    state = capture_replica(replica, step=1)
    before = digest(state)

    train_step(replica, 2)

    assert digest(state) == before


def test_a_live_capture_shares_parameters_and_optimizer_state_and_clones_the_rest():
    """``live``: what only an update changes is shared (no copy on a roll
    call's answer), what a forward pass or the loop changes is cloned; the
    digest is the same as a cloned capture's."""
    replica = trained(steps=2)
    replica.model.append(nn.BatchNorm1d(4))  # a buffer a forward pass changes
    live = capture(1, replica.model, replica.optimizer, replica.scheduler, live=True)
    cloned = capture_replica(replica, step=1)
    assert digest(live) == digest(cloned)
    weight = replica.model[0].weight
    assert live.model["0.weight"].data_ptr() == weight.data_ptr()
    exp_avg = replica.optimizer.state[weight]["exp_avg"]
    assert any(t.data_ptr() == exp_avg.data_ptr() for s in live.optimizer["state"].values()
               for t in s.values())  # fmt: skip
    running = replica.model[5].running_mean
    assert live.model["5.running_mean"].data_ptr() != running.data_ptr()
    replica.model.train()
    replica.model(torch.randn(16, 8))  # changes the running statistics only
    assert digest(live) == digest(cloned)
    train_step(replica, 2)  # an update: the shared tensors follow it
    assert digest(live) != digest(cloned)
    assert torch.equal(live.model["0.weight"], weight)


def test_a_live_capture_clones_a_sparse_tensor_it_cannot_share():
    model = nn.Linear(4, 4)
    model.register_buffer("mask", torch.eye(3).to_sparse())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = capture(0, model, optimizer, with_rng=False, live=True)
    assert state.model["weight"].data_ptr() == model.weight.data_ptr()
    assert torch.equal(state.model["mask"].to_dense(), torch.eye(3))


def test_restore_leaves_the_snapshot_untouched_by_the_joiners_training():
    state = capture_replica(trained(steps=2), step=1)
    before = digest(state)
    joiner = new_replica(seed=5)

    restore(state, joiner.model, joiner.optimizer, joiner.scheduler)
    train_step(joiner, 2)

    assert digest(state) == before


def test_restore_resumes_every_random_sequence():
    replica = trained(steps=1)
    state = capture_replica(replica, step=0)
    expected = (torch.rand(5), random.random(), np.random.rand(3))
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)

    restore(state, replica.model, replica.optimizer, replica.scheduler)

    assert torch.equal(torch.rand(5), expected[0])
    assert random.random() == expected[1]
    assert np.array_equal(np.random.rand(3), expected[2])


def test_restore_returns_the_extras():
    replica = trained(steps=1)
    extras = {"tokens_seen": 4096, "best_loss": 0.25, "ema": torch.ones(3)}
    state = capture_replica(replica, step=0, extras=extras)

    restored = restore(state, replica.model, replica.optimizer, replica.scheduler)

    assert restored.keys() == extras.keys()
    assert restored["tokens_seen"] == 4096 and restored["best_loss"] == 0.25
    assert torch.equal(restored["ema"], torch.ones(3))


def test_capture_records_the_data_position_of_the_step():
    state = capture_replica(trained(steps=1), step=7)

    assert state.step == 7
    assert state.data_position == {"step": 7}


def test_restore_refuses_a_scheduler_the_state_does_not_hold():
    replica = trained(steps=1)
    state = capture(0, replica.model, replica.optimizer)

    with pytest.raises(ValueError, match="configured differently"):
        restore(state, replica.model, replica.optimizer, replica.scheduler)


def test_capture_names_an_extra_that_cannot_be_transferred():
    replica = trained(steps=1)

    with pytest.raises(TypeError, match=r"extras\['hook'\]"):
        capture_replica(replica, step=0, extras={"hook": print})


# --------------------------------------------------------------------- digest


def test_digest_has_the_documented_format():
    value = digest(capture_replica(trained(steps=1), step=0))

    assert re.fullmatch(r"sha256-pieces:[0-9a-f]{64}", value)
    assert re.fullmatch(r"[A-Za-z0-9:+/=_-]{1,128}", value)


def test_digest_is_equal_for_equal_states_built_independently():
    first = capture_replica(trained(steps=3), step=2, extras={"run": "a"})
    second = capture_replica(trained(steps=3), step=2, extras={"run": "a"})

    assert digest(first) == digest(second)


@pytest.mark.integration
def test_digest_is_equal_across_processes():
    here = trained_state_digest(3)
    program = "from tests.test_state import trained_state_digest; print(trained_state_digest(3))"

    there = subprocess.run(
        [sys.executable, "-c", program],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()

    assert there == here


def test_digest_changes_after_one_more_optimizer_step():
    replica = trained(steps=3)
    before = digest(capture_replica(replica, step=2))

    train_step(replica, 3)

    assert digest(capture_replica(replica, step=2)) != before


def test_digest_ignores_dict_insertion_order():
    state = capture_replica(trained(steps=2), step=1, extras={"a": 1, "b": [1, 2], "c": "x"})
    shuffled = replace(
        state,
        model=with_dicts_reversed(state.model),
        optimizer=with_dicts_reversed(state.optimizer),
        scheduler=with_dicts_reversed(state.scheduler),
        extras=with_dicts_reversed(state.extras),
    )

    assert list(shuffled.model) != list(state.model)
    assert digest(shuffled) == digest(state)


def test_digest_depends_on_tensor_values_not_memory_layout():
    state = capture_replica(trained(steps=1), step=0)
    values = torch.arange(12.0).reshape(3, 4)

    contiguous = replace(state, extras={"t": values})
    transposed_twice = replace(state, extras={"t": values.t().contiguous().t()})

    assert not transposed_twice.extras["t"].is_contiguous()
    assert digest(contiguous) == digest(transposed_twice)


def test_sparse_tensors_are_refused_by_digest_and_serialization():
    state = capture_replica(trained(steps=1), step=0)
    sparse = replace(state, extras={"t": torch.eye(3).to_sparse()})
    with pytest.raises(TypeError, match="only dense tensors"):
        digest(sparse)
    with pytest.raises(TypeError, match="only dense tensors"):
        to_bytes(sparse)


def large_state() -> ReplicaState:
    """A state above ``PARALLEL_BYTES``: tensors of one piece, of many
    (one with a short last piece), empty, strided, of other dtypes, and
    one tensor reached twice."""
    state = capture_replica(trained(steps=1), step=0)
    generator = torch.Generator().manual_seed(7)
    big = torch.randn(PARALLEL_BYTES // 4 + 12345, generator=generator)
    shared = torch.randn(300, 301, generator=generator)
    extras = {
        "big": big,
        "strided": torch.randn(700, 900, generator=generator).t(),
        "half": torch.randn(2_000_000, generator=generator).half(),
        "ints": torch.arange(3_000_000, dtype=torch.int64),
        "empty": torch.zeros(0, 5),
        "shared": [shared, {"again": shared}],
    }
    tensors = [t for t in extras.values() if isinstance(t, torch.Tensor)]
    assert sum(t.numel() * t.element_size() for t in tensors) > PARALLEL_BYTES
    return replace(state, extras=extras)


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_a_large_state_hashed_by_several_threads_has_the_one_thread_digest(threads):
    state = large_state()
    assert digest(state, threads=threads) == digest(state)


def hashing_threads(monkeypatch) -> set[str]:
    """The names of the threads that hash pieces from now on (filled in as
    they do)."""
    hashers: set[str] = set()
    plain = digest_module.piece_hash

    def recorded(data):
        hashers.add(threading.current_thread().name)
        return plain(data)

    monkeypatch.setattr(digest_module, "piece_hash", recorded)
    return hashers


def test_several_threads_hash_a_large_state(monkeypatch):
    hashers = hashing_threads(monkeypatch)
    digest(large_state(), threads=3)
    assert threading.current_thread().name in hashers
    assert any(name.startswith("rollcall-digest") for name in hashers), hashers


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_large_state_digest_by_several_threads_sees_every_piece(where):
    state = large_state()
    before = digest(state, threads=2)
    big = state.extras["big"].view(torch.uint8).view(-1)
    index = {"first": 0, "middle": PIECE_BYTES * 3 + 17, "last": big.numel() - 1}[where]
    big[index] ^= 1
    assert digest(state, threads=2) != before
    assert digest(state, threads=2) == digest(state)


def test_several_threads_copy_one_strided_tensor_each_at_a_time(monkeypatch):
    """A tensor whose bytes need a copy is copied by the task that hashes
    it: the threads hold one copy each at most, never the whole state's."""
    lock, live, most = threading.Lock(), [0], [0]
    plain = digest_module.tensor_bytes

    def counted(tensor):
        raw = plain(tensor)
        if not tensor.is_contiguous():
            with lock:
                live[0] += 1
                most[0] = max(most[0], live[0])

            def gone():
                with lock:
                    live[0] -= 1

            weakref.finalize(raw, gone)
        return raw

    monkeypatch.setattr(digest_module, "tensor_bytes", counted)
    generator = torch.Generator().manual_seed(3)
    strided = [torch.randn(1000, 300, generator=generator).t() for _ in range(24)]
    state = replace(capture_replica(trained(steps=1), step=0), extras={"strided": strided})

    assert digest(state, threads=2) == digest(state)
    assert 1 <= most[0] <= 2, most[0]


def test_a_large_state_loaded_with_several_threads_is_checked_against_its_digest():
    state = large_state()
    expected = digest(state)
    blob = bytearray(to_bytes(state))
    assert digest(from_bytes(bytes(blob), expect_digest=expected, threads=2)) == expected
    blob[-(PIECE_BYTES * 2 + 5)] ^= 1  # inside the last tensor's bytes
    with pytest.raises(CorruptState, match="digest is"):
        from_bytes(bytes(blob), expect_digest=expected, threads=2)


def test_a_small_state_is_hashed_by_the_calling_thread_alone(monkeypatch):
    hashers = hashing_threads(monkeypatch)
    digest(capture_replica(trained(steps=1), step=0), threads=4)
    assert hashers == {threading.current_thread().name}


def test_digest_threads_are_checked():
    with pytest.raises(ValueError, match="threads must be at least 1"):
        digest(capture_replica(trained(steps=1), step=0), threads=0)


def test_a_large_state_with_a_sparse_tensor_is_refused_by_several_threads_too():
    state = large_state()
    state.extras["sparse"] = torch.eye(3).to_sparse()
    with pytest.raises(TypeError, match="only dense tensors"):
        digest(state, threads=2)


@pytest.mark.parametrize(
    "one, other",
    [
        (1, 1.0),
        (1, True),
        (1, "1"),
        (0.0, -0.0),
        (None, "None"),
        ([1, 2], [2, 1]),
        (torch.zeros(2, 3), torch.zeros(3, 2)),
        (torch.zeros(4, dtype=torch.float32), torch.zeros(2, dtype=torch.float64)),
        ({"a": 1}, {"a": 1, "b": 2}),
    ],
)
def test_digest_tells_apart_values_that_differ_in_type_shape_or_content(one, other):
    state = capture_replica(trained(steps=1), step=0)

    assert digest(replace(state, extras={"x": one})) != digest(replace(state, extras={"x": other}))


def test_digest_leaves_out_rng_states():
    replica = trained(steps=1)
    state = capture_replica(replica, step=0)
    torch.rand(10)
    random.random()

    later = capture_replica(replica, step=0)

    assert not torch.equal(later.rng["torch"], state.rng["torch"])
    assert digest(later) == digest(state)


def test_digest_rejects_values_that_cannot_be_transferred():
    state = capture_replica(trained(steps=1), step=0)

    with pytest.raises(TypeError):
        digest(replace(state, extras={"x": object()}))


# ---------------------------------------------------------------------- bytes


def test_bytes_round_trip_keeps_the_digest_and_the_rng():
    state = capture_replica(trained(steps=2), step=1, extras={"note": "hi", "t": torch.ones(2)})

    loaded = from_bytes(to_bytes(state), expect_digest=digest(state))

    assert isinstance(loaded, ReplicaState)
    assert digest(loaded) == digest(state)
    assert torch.equal(loaded.rng["torch"], state.rng["torch"])
    assert loaded.rng["python"] == state.rng["python"]


def saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda blob: b"", id="empty"),
        pytest.param(lambda blob: b"certainly not a replica state", id="garbage"),
        pytest.param(lambda blob: blob[:200], id="truncated-head"),
        pytest.param(lambda blob: blob[: len(blob) // 2], id="truncated-half"),
        pytest.param(lambda blob: blob[:-1], id="truncated-last-byte"),
        pytest.param(
            lambda blob: with_header({"tensors": [], "state": {"d": [["x", 1]]}}, b""),
            id="another-structure",
        ),
        pytest.param(lambda blob: saved({"d": datetime.date(2020, 1, 1)}), id="a-pickle"),
    ],
)
def test_from_bytes_raises_corrupt_state_on_bad_bytes(damage):
    blob = to_bytes(capture_replica(trained(steps=1), step=0))

    with pytest.raises(CorruptState) as raised:
        from_bytes(damage(blob))

    assert isinstance(raised.value, RollcallError)
    assert str(raised.value)


def test_from_bytes_detects_a_flipped_tensor_byte_given_the_expected_digest():
    state = capture_replica(trained(steps=1), step=0)
    blob = bytearray(to_bytes(state))
    weight = state.model["0.weight"].numpy().tobytes()
    blob[blob.find(weight) + 1] ^= 0xFF

    with pytest.raises(CorruptState, match="digest"):
        from_bytes(bytes(blob), expect_digest=digest(state))


def test_bytes_keep_types_the_digest_does_not_see():
    extras = {
        "tuple": (1, 2.0, "3"),
        "list": [True, None, -0.0, float("inf")],
        "keys": {1: "int", "1": "str", 2.5: "float", None: "none"},
        "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
    }
    state = capture_replica(trained(steps=1), step=0, extras=extras)

    loaded = from_bytes(to_bytes(state))

    for name in ("tuple", "list", "keys"):
        assert loaded.extras[name] == extras[name]
        assert type(loaded.extras[name]) is type(extras[name])
    assert [type(k) for k in loaded.extras["keys"]] == [int, str, float, type(None)]
    for name in ("bf16", "bool", "scalar", "empty", "strided"):
        assert loaded.extras[name].dtype == extras[name].dtype
        assert torch.equal(loaded.extras[name], extras[name])


def test_equal_states_give_equal_bytes():
    state = capture_replica(trained(steps=2), step=1)

    assert to_bytes(from_bytes(to_bytes(state))) == to_bytes(state)


def test_loaded_tensors_are_views_of_a_bytearray_passed_in_and_copies_of_bytes():
    blob = to_bytes(capture_replica(trained(steps=1), step=0))
    buffer = bytearray(blob)

    shared = from_bytes(buffer).model["0.weight"]
    private = from_bytes(blob).model["0.weight"]
    shared.zero_()
    private.add_(1)

    assert buffer != blob  # the state was decoded in place
    assert from_bytes(blob).model["0.weight"].abs().sum() > 0  # bytes stay untouched


def header_and_tail(blob: bytes) -> tuple[dict[str, Any], bytes]:
    length = int.from_bytes(blob[16:24], "little")
    return json.loads(blob[24 : 24 + length]), blob[24 + length :]


def with_header(header: dict[str, Any], tail: bytes) -> bytes:
    text = json.dumps(header).encode()
    return b"rollcall.state.2" + len(text).to_bytes(8, "little") + text + tail


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda h: h["tensors"][0].__setitem__(1, [10**9]), id="tensor-past-the-end"),
        pytest.param(lambda h: h["tensors"][0].__setitem__(2, -64), id="tensor-before-data"),
        pytest.param(lambda h: h["tensors"][0].__setitem__(2, 3), id="misaligned-tensor"),
        pytest.param(lambda h: h["tensors"][0].__setitem__(0, "torch.storage"), id="bad-dtype"),
        pytest.param(lambda h: h.__setitem__("state", {"t": 10**6}), id="unknown-tensor"),
        pytest.param(lambda h: h["state"].__setitem__("x", 1), id="unknown-node"),
        pytest.param(lambda h: h.__setitem__("state", {"d": [[{"t": 0}, 1]]}), id="tensor-key"),
    ],
)
def test_from_bytes_refuses_a_header_that_lies(tamper):
    header, tail = header_and_tail(to_bytes(capture_replica(trained(steps=1), step=0)))
    tamper(header)

    with pytest.raises(CorruptState):
        from_bytes(with_header(header, tail))


# ---------------------------------------------------------- chunks and stripes


def test_chunks_cover_the_data_exactly_in_order():
    data = bytes(range(256)) * 4

    pieces = list(chunks(data, 100))

    assert [offset for offset, _ in pieces] == list(range(0, 1024, 100))
    assert all(len(piece) == 100 for _, piece in pieces[:-1])
    assert len(pieces[-1][1]) == 24
    assert b"".join(piece for _, piece in pieces) == data


def test_chunks_of_nothing_are_nothing():
    assert list(chunks(b"", 10)) == []


def test_chunks_refuse_a_non_positive_size():
    with pytest.raises(ValueError):
        list(chunks(b"abc", 0))


@pytest.mark.parametrize(
    "total, parts, expected",
    [
        (10, 3, [(0, 4), (4, 3), (7, 3)]),
        (9, 3, [(0, 3), (3, 3), (6, 3)]),
        (2, 5, [(0, 1), (1, 1)]),
        (0, 3, []),
        (7, 1, [(0, 7)]),
    ],
)
def test_ranges_split_as_evenly_as_possible(total, parts, expected):
    assert ranges(total, parts) == expected


@pytest.mark.parametrize("total, parts", [(-1, 2), (10, 0)])
def test_ranges_refuse_bad_arguments(total, parts):
    with pytest.raises(ValueError):
        ranges(total, parts)


@given(total=st.integers(0, 100_000), parts=st.integers(1, 200))
def test_ranges_are_contiguous_even_and_cover_exactly(total, parts):
    result = ranges(total, parts)

    assert len(result) == min(total, parts)
    position = 0
    for offset, length in result:
        assert offset == position and length > 0
        position += length
    assert position == total
    if result:
        lengths = [length for _, length in result]
        assert max(lengths) - min(lengths) <= 1


def test_assembler_reassembles_pieces_out_of_order():
    data = bytes(range(100))
    assembler = Assembler(len(data))

    for offset, length in reversed(ranges(len(data), 7)):
        assembler.add(offset, data[offset : offset + length])

    assert assembler.complete()
    assert assembler.missing() == []
    assert assembler.result() == data


def test_assembler_reports_what_is_missing():
    assembler = Assembler(100)
    assembler.add(10, b"x" * 10)
    assembler.add(50, b"y" * 25)

    assert assembler.missing() == [(0, 10), (20, 30), (75, 25)]
    assert not assembler.complete()
    with pytest.raises(ValueError, match="incomplete"):
        assembler.result()


@pytest.mark.parametrize("offset, length", [(5, 10), (15, 10), (0, 100), (19, 1), (10, 1)], ids=str)
def test_assembler_rejects_a_piece_that_overlaps_one_received(offset, length):
    assembler = Assembler(100)
    assembler.add(10, b"x" * 10)

    with pytest.raises(ValueError, match="overlaps"):
        assembler.add(offset, b"y" * length)
    assert assembler.missing() == [(0, 10), (20, 80)]


@pytest.mark.parametrize("offset, length", [(-1, 1), (95, 6), (100, 1)])
def test_assembler_rejects_a_piece_outside_the_blob(offset, length):
    assembler = Assembler(100)

    with pytest.raises(ValueError, match="outside"):
        assembler.add(offset, b"z" * length)


def test_an_empty_blob_is_complete_at_once():
    assembler = Assembler(0)

    assert assembler.complete()
    assert assembler.result() == b""


@given(data=st.binary(max_size=3000), parts=st.integers(1, 40), draw=st.data())
def test_assembler_rebuilds_any_blob_from_stripes_in_any_order(data, parts, draw):
    stripes = draw.draw(st.permutations(ranges(len(data), parts)))
    assembler = Assembler(len(data))

    for offset, length in stripes:
        assert not assembler.complete()
        assembler.add(offset, data[offset : offset + length])

    assert assembler.result() == data


@given(
    total=st.integers(1, 200),
    attempts=st.lists(st.tuples(st.integers(0, 199), st.integers(1, 50)), max_size=30),
)
def test_assembler_accepts_exactly_the_pieces_that_fit_and_do_not_overlap(total, attempts):
    assembler = Assembler(total)
    received: set[int] = set()

    for offset, length in attempts:
        span = set(range(offset, offset + length))
        if offset + length > total or span & received:
            with pytest.raises(ValueError):
                assembler.add(offset, bytes(length))
        else:
            assembler.add(offset, bytes(length))
            received |= span

    missing = {i for offset, length in assembler.missing() for i in range(offset, offset + length)}
    assert missing == set(range(total)) - received
    assert assembler.complete() == (received == set(range(total)))


# ------------------------------------------------------------------- timings


def test_a_state_captured_without_rng_restores_and_leaves_this_process_rng_alone():
    replica = trained(3)
    state = capture(2, replica.model, replica.optimizer, replica.scheduler, with_rng=False)
    assert state.rng == {}
    assert digest(state) == digest(capture_replica(replica, 2))
    loaded = from_bytes(to_bytes(state), expect_digest=digest(state))
    other = new_replica(seed=5)
    torch.manual_seed(1234)
    expected = torch.get_rng_state()
    restore(loaded, other.model, other.optimizer, other.scheduler)
    assert torch.equal(torch.get_rng_state(), expected)
    pairs = zip(parameters(other), parameters(replica), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_replicas_with_different_rng_streams_serve_identical_bytes_without_rng():
    replica = trained(3)

    def served() -> bytes:
        state = capture(2, replica.model, replica.optimizer, replica.scheduler, with_rng=False)
        return to_bytes(state)

    torch.manual_seed(1)
    first = served()
    torch.manual_seed(2)
    random.seed(2)
    assert served() == first
