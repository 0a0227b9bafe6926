"""Pieces of a state blob and the data channel's frames, with no sockets:
each piece checks alone, the pieces' digests give the state's digest, and
every frame length is bounded before anything of that length is read."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rollcall.membership.errors import InvalidRequest
from rollcall.worker.data_wire import (
    HELLO,
    MAX_MESSAGE,
    REQUEST,
    STATUS,
    Code,
    Hello,
    Kind,
    Request,
    Status,
    client_proof,
    server_proof,
)
from rollcall.worker.digest import (
    PIECE_BYTES,
    digest,
    digest_like,
    digest_of_pieces,
    piece_bounds,
    piece_hash,
    tree_digest,
)
from rollcall.worker.pieces import HASH_BYTES, Piece, by_tensor, piece_hashes, pieces_of, units_of
from rollcall.worker.state import CorruptState, ReplicaState
from rollcall.worker.state_bytes import (
    Decoded,
    decode,
    from_bytes,
    header_size,
    layout_of,
    to_bytes,
    validated,
)


def state_with(**tensors: torch.Tensor) -> ReplicaState:
    torch.manual_seed(0)
    return ReplicaState(
        step=3,
        model=dict(tensors),
        optimizer={"state": {0: {"exp_avg": torch.randn(5)}}, "param_groups": [{"lr": 0.1}]},
        scheduler=None,
        grad_scaler=None,
        data_position={"step": 3},
        rng={},
        extras={"note": "x", "zero": torch.empty(0, 4)},
    )


#: Two tensors of several pieces each (the second ends in a short piece) and
#: small ones between them.
STATE = state_with(
    big=torch.arange(float(PIECE_BYTES // 2), dtype=torch.float64),  # 4 pieces
    bias=torch.ones(3),
    odd=torch.arange(PIECE_BYTES // 4 + 7, dtype=torch.int32),  # 2 pieces, last 28 bytes
)
BLOB = to_bytes(STATE)


def received_pieces(blob: bytes) -> tuple[tuple[Piece, ...], list[bytes], Decoded]:
    decoded = decode(bytearray(blob))
    pieces = pieces_of(decoded.spans, decoded.data_start)
    view = memoryview(blob)
    return pieces, [piece_hash(view[p.start : p.end]) for p in pieces], decoded


def test_a_tensor_is_cut_into_pieces_of_the_documented_size():
    assert piece_bounds(0) == []
    assert piece_bounds(5) == [(0, 5)]
    assert piece_bounds(PIECE_BYTES) == [(0, PIECE_BYTES)]
    assert piece_bounds(2 * PIECE_BYTES + 1) == [
        (0, PIECE_BYTES), (PIECE_BYTES, 2 * PIECE_BYTES), (2 * PIECE_BYTES, 2 * PIECE_BYTES + 1)
    ]  # fmt: skip


def test_the_digest_from_the_pieces_equals_the_digest_of_the_state():
    pieces, hashes, decoded = received_pieces(BLOB)
    state = validated(decoded.tree)

    found = digest_of_pieces(state, by_tensor(pieces, hashes, decoded.tensors))

    assert found == digest(STATE) == digest(state)
    assert [p.tensor for p in pieces].count(0) == 4
    assert len(pieces) == 4 + 1 + 2 + 1  # big, bias, odd, the optimizer's exp_avg


def test_a_piece_that_differs_makes_the_digest_differ():
    pieces, hashes, decoded = received_pieces(BLOB)
    state = validated(decoded.tree)
    for index in range(len(pieces)):
        changed = list(hashes)
        changed[index] = hashlib.sha256(b"not this piece").digest()
        found = digest_of_pieces(state, by_tensor(pieces, changed, decoded.tensors))
        assert found != digest(STATE), index


def test_a_digest_list_of_the_wrong_length_is_refused():
    pieces, hashes, decoded = received_pieces(BLOB)
    state = validated(decoded.tree)
    known = by_tensor(pieces, hashes, decoded.tensors)
    known[id(decoded.tensors[0])].pop()

    with pytest.raises(KeyError):
        digest_of_pieces(state, known)


def test_a_server_lists_the_digest_of_every_piece_in_table_order():
    pieces, hashes, _ = received_pieces(BLOB)

    listed = piece_hashes(BLOB)

    assert listed == b"".join(hashes) and len(listed) == len(pieces) * HASH_BYTES


def test_a_digest_of_the_earlier_whole_form_is_still_checked_in_that_form():
    """Checkpoint manifests written before the pieces form record it."""
    whole = digest_like(STATE, "sha256:" + "0" * 64)
    assert whole.startswith("sha256:") and whole != digest(STATE)

    assert from_bytes(BLOB, expect_digest=whole).step == 3
    damaged = bytearray(BLOB)
    damaged[decode(bytearray(BLOB)).spans[0][0] + 1] ^= 0xFF
    with pytest.raises(CorruptState, match="digest"):
        from_bytes(bytes(damaged), expect_digest=whole)


def test_tree_digests_keep_the_whole_form():
    """Partition digests (sharded checkpoints) and fingerprints use it."""
    value = tree_digest({"w": torch.arange(4.0)})
    sink = hashlib.sha256(b"rollcall.ReplicaState.tree/1\0")
    sink.update(b"d" + struct.pack("<Q", 1) + b"s" + struct.pack("<Q", 1) + b"w")
    sink.update(b"t" + struct.pack("<Q", 13) + b"torch.float32" + struct.pack("<QQ", 1, 4))
    sink.update(struct.pack("<Q", 16) + torch.arange(4.0).numpy().tobytes())
    assert value == f"sha256:{sink.hexdigest()}"


def test_the_layout_comes_from_the_header_alone():
    size = header_size(BLOB[:24])
    decoded = decode(bytearray(BLOB))

    assert size == decoded.data_start and size % 64 == 0
    assert layout_of(BLOB[:size], len(BLOB)) == (decoded.data_start, decoded.spans)
    with pytest.raises(CorruptState):
        layout_of(BLOB[:size], size + 10)  # tensors past the end of so short a blob
    with pytest.raises(CorruptState):
        header_size(b"rollcall.state.1" + bytes(8))


def test_pieces_of_tensors_out_of_order_or_overlapping_are_refused():
    with pytest.raises(CorruptState, match="overlaps"):
        pieces_of([(128, 64), (64, 64)], 64)
    with pytest.raises(CorruptState, match="overlaps"):
        pieces_of([(64, 128), (128, 64)], 64)
    with pytest.raises(CorruptState, match="overlaps"):
        pieces_of([(0, 64)], 64)  # inside the header
    assert pieces_of([(64, 0), (64, 10)], 64) == (Piece(1, 64, 74),)


@given(
    sizes=st.lists(st.integers(0, 3 * PIECE_BYTES), min_size=1, max_size=12),
    unit=st.integers(1, 5 * PIECE_BYTES),
)
def test_units_hold_whole_pieces_in_order_and_every_piece_once(sizes, unit):
    spans, position = [], 64
    for nbytes in sizes:
        spans.append((position, nbytes))
        position += -(-nbytes // 64) * 64
    pieces = pieces_of(spans, 64)

    units = units_of(pieces, unit)

    assert [i for u in units for i in u.pieces] == list(range(len(pieces)))
    for u in units:
        assert u.start == pieces[u.pieces[0]].start and u.end == pieces[u.pieces[-1]].end
        assert len(u.pieces) == 1 or u.end - u.start <= unit
    assert all(a.end <= b.start for a, b in zip(units, units[1:], strict=False))


# --------------------------------------------------------------------- frames


def test_frames_read_back_as_written():
    hello = Hello("job1", "w-1", 7, b"n" * 32, b"p" * 32)
    encoded = hello.encode()
    assert Hello.lengths(encoded[: HELLO.size], 64) == (4, 3)
    assert Hello.decode(encoded[: HELLO.size], encoded[HELLO.size :]) == hello

    request = Request(Kind.RANGE, "sha256-pieces:ab", 10, 20)
    encoded = request.encode()
    assert Request.digest_length(encoded[: REQUEST.size], 128) == 16
    assert Request.decode(encoded[: REQUEST.size], encoded[REQUEST.size :]) == request

    encoded = Status.encode(Code.PERMISSION_DENIED, "no", 5)
    assert Status.message_length(encoded[: STATUS.size]) == 2
    assert Status.decode(encoded[: STATUS.size], encoded[STATUS.size :]) == Status(7, "no", 5)


@pytest.mark.parametrize(
    ("fixed", "check", "says"),
    [
        (HELLO.pack(65535, 3, 1, bytes(32), bytes(32)), lambda f: Hello.lengths(f, 64), "job"),
        (HELLO.pack(4, 0, 1, bytes(32), bytes(32)), lambda f: Hello.lengths(f, 64), "member_id"),
        (REQUEST.pack(9, 10, 0, 1), lambda f: Request.digest_length(f, 128), "unknown request"),
        (REQUEST.pack(1, 200, 0, 1), lambda f: Request.digest_length(f, 128), "longer than 128"),
        (STATUS.pack(0, MAX_MESSAGE + 1, 0), Status.message_length, "message of"),
    ],
    ids=["job too long", "empty member id", "unknown kind", "digest too long", "long message"],
)
def test_a_frame_announcing_too_much_is_refused_before_it_is_read(fixed, check, says):
    with pytest.raises(InvalidRequest, match=says):
        check(fixed)


def test_the_proofs_bind_both_nonces_the_caller_and_the_secret():
    hello = Hello("job1", "w-1", 7, b"c" * 32, b"")
    proof = client_proof("s" * 64, b"n" * 32, hello)

    assert proof != server_proof("s" * 64, b"n" * 32, hello)
    for other in [
        client_proof("t" * 64, b"n" * 32, hello),
        client_proof("s" * 64, b"m" * 32, hello),
        client_proof("s" * 64, b"n" * 32, Hello("job1", "w-2", 7, b"c" * 32, b"")),
        client_proof("s" * 64, b"n" * 32, Hello("job1", "w-1", 8, b"c" * 32, b"")),
        client_proof("s" * 64, b"n" * 32, Hello("job1", "w-1", 7, b"d" * 32, b"")),
    ]:
        assert other != proof
