"""The pieces of a state blob, which a fetch checks one by one as they
arrive, and the units (byte ranges holding whole pieces) it asks its
sources for.

A piece is ``PIECE_BYTES`` of one tensor's bytes (``rollcall.worker.digest``):
the state's digest covers each piece through its SHA-256, so a piece's
digest, once known, checks that piece alone. Pure: no sockets, no clocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollcall.worker.digest import piece_bounds, piece_hash
from rollcall.worker.state import CorruptState
from rollcall.worker.state_bytes import layout_of

__all__ = ["HASH_BYTES", "Piece", "Unit", "by_tensor", "piece_hashes", "pieces_of", "units_of"]

#: Bytes of one piece's digest (SHA-256).
HASH_BYTES = 32


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of the blob: one piece of tensor ``tensor`` (its
    index in the blob's table)."""

    tensor: int
    start: int
    end: int


@dataclass(frozen=True)
class Unit:
    """Bytes [start, end) of the blob, asked of one source at a time:
    whole pieces (``pieces``, indices into the piece list) and the padding
    between them."""

    start: int
    end: int
    pieces: tuple[int, ...]


def pieces_of(spans: Sequence[tuple[int, int]], data_start: int) -> tuple[Piece, ...]:
    """The pieces of a blob whose tensors lie at ``spans`` ((offset, byte
    count) each, table order), in table order, which is the order of the
    digest's walk within each tensor. The tensors must lie in table order,
    after ``data_start``, without overlapping (as ``to_bytes`` writes them):
    CorruptState otherwise."""
    result: list[Piece] = []
    position = data_start
    for index, (offset, nbytes) in enumerate(spans):
        if nbytes == 0:
            continue
        if offset < position:
            raise CorruptState(f"tensor {index} at {offset} overlaps the bytes before {position}")
        result.extend(Piece(index, offset + a, offset + b) for a, b in piece_bounds(nbytes))
        position = offset + nbytes
    return tuple(result)


def units_of(pieces: Sequence[Piece], unit_bytes: int) -> tuple[Unit, ...]:
    """Consecutive pieces grouped into units of about ``unit_bytes`` (a unit
    holds whole pieces, at least one), in blob order."""
    if unit_bytes <= 0:
        raise ValueError(f"unit_bytes must be positive, got {unit_bytes}")
    units: list[Unit] = []
    members: list[int] = []
    for index, piece in enumerate(pieces):
        if members and piece.end - pieces[members[0]].start > unit_bytes:
            units.append(Unit(pieces[members[0]].start, pieces[members[-1]].end, tuple(members)))
            members = []
        members.append(index)
    if members:
        units.append(Unit(pieces[members[0]].start, pieces[members[-1]].end, tuple(members)))
    return tuple(units)


def by_tensor(
    pieces: Sequence[Piece], hashes: Sequence[bytes], tensors: Sequence[torch.Tensor]
) -> dict[int, list[bytes]]:
    """The pieces' digests per tensor, keyed by ``id(tensor)`` (what
    ``rollcall.worker.digest.digest_of_pieces`` takes)."""
    result: dict[int, list[bytes]] = {id(tensor): [] for tensor in tensors}
    for piece, value in zip(pieces, hashes, strict=True):
        result[id(tensors[piece.tensor])].append(value)
    return result


def piece_hashes(data: Any) -> bytes:
    """The digests of every piece of the blob ``data`` (any buffer), in
    table order, concatenated (``HASH_BYTES`` each): what a source answers
    a fetcher that found pieces failing the agreed digest."""
    data_start, spans = layout_of(data)
    view = memoryview(data)
    return b"".join(piece_hash(view[p.start : p.end]) for p in pieces_of(spans, data_start))
