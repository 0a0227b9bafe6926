"""The byte form of a replica state: a JSON header and the raw tensor bytes,
which decodes without running any code a peer could have put there, and
cheaply.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from typing import Any

import torch

from rollcall.worker.digest import digest_like, tensor_bytes
from rollcall.worker.state import FORMAT, VERSION, CorruptState, ReplicaState

__all__ = [
    "Decoded",
    "PREFIX_BYTES",
    "decode",
    "from_bytes",
    "header_size",
    "layout_of",
    "to_bytes",
    "tree_from_bytes",
    "tree_to_bytes",
    "validated",
]

# Layout: MAGIC, the header's length (u64, little endian), the header (JSON,
# UTF-8), then, from the next multiple of ALIGN on, every tensor's raw bytes,
# each at an offset (from there) that is a multiple of ALIGN, in the host's
# byte order (little-endian on every platform torch ships for). The header holds
# the table of tensors ([dtype, shape, offset] each) and the state, FORMAT and
# VERSION included, as a tagged tree: {"d": [[key, value], ...]} a dict,
# {"l": [...]} a list, {"u": [...]} a tuple, {"t": i} tensor i; str, int,
# float, bool and None as themselves.
#
# Decoding is a JSON parse and one `torch.frombuffer` view per tensor, so
# nothing the bytes say can run code. It replaced `torch.save`/`torch.load`
# (`weights_only=True`), whose pickle walk made loading the 1.7 MB state of
# the example 15 ms of a ~30 ms transfer (bench/README.md).

#: The first bytes of a blob; the last one is the layout's version.
MAGIC = b"rollcall.state.2"
ALIGN = 64
_HEADER_LENGTH = struct.Struct("<Q")
#: The bytes that say how long the header is: MAGIC and the length.
PREFIX_BYTES = len(MAGIC) + _HEADER_LENGTH.size
_DTYPES: dict[str, torch.dtype] = {
    str(value): value for value in vars(torch).values() if isinstance(value, torch.dtype)
}


def to_bytes(state: ReplicaState) -> bytes:
    """Serialize ``state``: a JSON header and the raw tensor bytes (see the
    layout above). Equal states give equal bytes."""
    return tree_to_bytes(
        {
            "format": FORMAT,
            "version": VERSION,
            "step": state.step,
            "model": state.model,
            "optimizer": state.optimizer,
            "scheduler": state.scheduler,
            "grad_scaler": state.grad_scaler,
            "data_position": state.data_position,
            "rng": state.rng,
            "extras": state.extras,
        }
    )


def tree_to_bytes(tree: Any) -> bytes:
    """Serialize a tree of dicts, lists, tuples, scalars and tensors in the
    layout above. Equal trees give equal bytes."""
    tensors: list[torch.Tensor] = []
    encoded = _encode(tree, tensors)
    flats = [tensor_bytes(tensor) for tensor in tensors]
    table = []
    position = 0
    for tensor, flat in zip(tensors, flats, strict=True):
        table.append([str(tensor.dtype), list(tensor.shape), position])
        position = _aligned(position + flat.nbytes)
    text = json.dumps({"tensors": table, "state": encoded}, separators=(",", ":")).encode()
    start = len(MAGIC) + _HEADER_LENGTH.size + len(text)
    parts: list[Any] = [MAGIC, _HEADER_LENGTH.pack(len(text)), text, bytes(_aligned(start) - start)]
    for flat in flats:
        parts.append(flat)
        parts.append(bytes(_aligned(flat.nbytes) - flat.nbytes))
    return b"".join(parts)


@dataclass(frozen=True)
class Decoded:
    """A blob decoded: its tree, whose tensors are views into the blob, and
    where each tensor's bytes lie."""

    tree: Any
    #: The tensors of the table, in its order (``spans`` says where each lies).
    tensors: tuple[torch.Tensor, ...]
    #: (offset in the blob, byte count) of each tensor's bytes, table order.
    spans: tuple[tuple[int, int], ...]
    #: Where the tensor bytes start: the header and its padding come before.
    data_start: int


def tree_from_bytes(data: bytes | bytearray | mmap.mmap) -> Any:
    """The tree ``tree_to_bytes`` wrote, without running code; CorruptState
    if the bytes do not decode. The tensors share ``data`` (as
    ``from_bytes``)."""
    return decode(data if isinstance(data, (bytearray, mmap.mmap)) else bytearray(data)).tree


def decode(buffer: Any) -> Decoded:
    """Decode the header at the start of ``buffer`` (a writable buffer the
    size of the whole blob) without running code: the tree, with one
    ``torch.frombuffer`` view per tensor, valid even while the tensor bytes
    have not arrived yet. CorruptState if the header does not decode."""
    try:
        return _decode(buffer)
    except CorruptState:
        raise
    except Exception as exc:  # malformed input fails in many ways; all mean "corrupt"
        raise CorruptState(f"serialized state does not load ({len(buffer)} bytes): {exc}") from exc


def header_size(prefix: Any) -> int:
    """Bytes before the tensor bytes (MAGIC, the header's length, the header,
    its padding), read from the first ``PREFIX_BYTES`` of a blob.
    CorruptState if they are not a blob's."""
    if len(prefix) < PREFIX_BYTES or bytes(prefix[: len(MAGIC)]) != MAGIC:
        raise CorruptState("not a rollcall replica state")
    (length,) = _HEADER_LENGTH.unpack_from(prefix, len(MAGIC))
    return _aligned(PREFIX_BYTES + length)


def layout_of(data: Any, size: int | None = None) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(data_start, spans) of the blob ``data`` (any buffer): where its
    tensor bytes start and lie, as ``Decoded``, from its header alone,
    without a view of any tensor (so ``data`` may be read-only, or only
    the blob's first bytes, the header, when ``size`` says how long the
    whole blob is)."""
    size = len(data) if size is None else size
    try:
        start, table = _header(data)
        return start, tuple(_span(size, entry, start) for entry in table)
    except CorruptState:
        raise
    except Exception as exc:  # as in decode()
        raise CorruptState(f"serialized state does not load ({len(data)} bytes): {exc}") from exc


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _encode(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"t": len(tensors) - 1}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        for key in obj:
            if key is not None and not isinstance(key, (bool, int, float, str)):
                raise TypeError(f"a dict key of type {type(key).__name__} cannot be serialized")
        return {"d": [[k, _encode(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, list):
        return {"l": [_encode(item, tensors) for item in obj]}
    if isinstance(obj, tuple):
        return {"u": [_encode(item, tensors) for item in obj]}
    raise TypeError(f"a {type(obj).__name__} cannot be part of a replica state")


def from_bytes(
    data: bytes | bytearray | mmap.mmap, expect_digest: str | None = None, threads: int = 1
) -> ReplicaState:
    """Load a state written by `to_bytes`, onto the CPU, without running code.

    Raises CorruptState on any failure: bytes that do not decode, a structure
    that is not a replica state, or (when `expect_digest` is given) content
    whose digest differs (a digest of the earlier whole-walk form, recorded
    by an earlier version, is checked in that form). The layout carries no
    checksum of its own, so a flipped byte inside tensor data is only caught
    by the digest; pass the one the sender announced. ``threads``: how many
    threads hash a large state's pieces for that check (``digest``).

    The tensors share one private copy of ``data`` (a ``bytearray`` or an
    ``mmap`` passed in is used as it is, and must not be changed afterwards).
    """
    state = validated(tree_from_bytes(data))
    if expect_digest is not None:
        actual = digest_like(state, expect_digest, threads)
        if actual != expect_digest:
            raise CorruptState(f"replica state digest is {actual}, expected {expect_digest}")
    return state


def _header(buffer: Any) -> tuple[int, list[Any]]:
    """(data_start, the tensor table) of a blob's header; the header's
    ``state`` is left out."""
    data_start, header = _parse_header(buffer)
    return data_start, header["tensors"]


def _parse_header(buffer: Any) -> tuple[int, dict[str, Any]]:
    def fail(why: str) -> CorruptState:
        return CorruptState(f"replica state does not load ({len(buffer)} bytes): {why}")

    start = PREFIX_BYTES
    if len(buffer) < start or bytes(buffer[: len(MAGIC)]) != MAGIC:
        raise fail("not a rollcall replica state")
    (length,) = _HEADER_LENGTH.unpack_from(buffer, len(MAGIC))
    if length > len(buffer) - start:
        raise fail(f"header of {length} bytes runs past the end")
    header = json.loads(bytes(buffer[start : start + length]).decode())
    if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
        raise fail("header is not a dict with a tensor table")
    return _aligned(start + length), header


def _decode(buffer: Any) -> Decoded:
    data_start, header = _parse_header(buffer)
    spans = tuple(_span(len(buffer), entry, data_start) for entry in header["tensors"])
    entries = zip(header["tensors"], spans, strict=True)
    tensors = tuple(_tensor_at(buffer, entry, span) for entry, span in entries)
    return Decoded(_decode_tree(header.get("state"), list(tensors)), tensors, spans, data_start)


def _span(size: int, entry: Any, data_start: int) -> tuple[int, int]:
    """(offset in a blob of ``size`` bytes, byte count) of a tensor table
    entry, checked."""
    dtype_name, shape, offset = entry
    dtype = _DTYPES[dtype_name]
    if not all(type(n) is int and n >= 0 for n in shape) or type(offset) is not int or offset < 0:
        raise CorruptState(f"tensor entry {entry!r} is malformed")
    nbytes = math.prod(shape) * dtype.itemsize
    offset += data_start
    if offset % ALIGN or offset + nbytes > size:
        raise CorruptState(f"tensor entry {entry!r} lies outside the data")
    return offset, nbytes


def _tensor_at(buffer: Any, entry: Any, span: tuple[int, int]) -> torch.Tensor:
    dtype_name, shape, _ = entry
    dtype = _DTYPES[dtype_name]
    offset, nbytes = span
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    count = nbytes // dtype.itemsize
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).view(shape)


def _decode_tree(node: Any, tensors: list[torch.Tensor]) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, dict) and len(node) == 1:
        ((tag, value),) = node.items()
        if tag == "t" and type(value) is int and 0 <= value < len(tensors):
            return tensors[value]
        if tag == "d" and isinstance(value, list):
            return {_scalar_key(k): _decode_tree(v, tensors) for k, v in value}
        if tag == "l" and isinstance(value, list):
            return [_decode_tree(item, tensors) for item in value]
        if tag == "u" and isinstance(value, list):
            return tuple(_decode_tree(item, tensors) for item in value)
    raise CorruptState(f"replica state holds an unknown node {str(node)[:80]!r}")


def _scalar_key(key: Any) -> Any:
    if key is not None and not isinstance(key, (bool, int, float, str)):
        raise CorruptState(f"replica state holds a dict key of type {type(key).__name__}")
    return key


def validated(payload: Any) -> ReplicaState:
    """The replica state a decoded tree holds; CorruptState if it is not one."""

    def fail(why: str) -> CorruptState:
        return CorruptState(f"not a replica state: {why}")

    if not isinstance(payload, dict):
        raise fail(f"top level is a {type(payload).__name__}, not a dict")
    if payload.get("format") != FORMAT or payload.get("version") != VERSION:
        raise fail(
            f"format {payload.get('format')!r} version {payload.get('version')!r}, "
            f"expected {FORMAT!r} version {VERSION}"
        )
    step = payload.get("step")
    if type(step) is not int or step < -1:
        raise fail(f"step {step!r} is not an int >= -1")
    model = payload.get("model")
    if not isinstance(model, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()
    ):
        raise fail("model is not a dict of names to tensors")
    optimizer = payload.get("optimizer")
    if not isinstance(optimizer, dict) or not {"state", "param_groups"} <= optimizer.keys():
        raise fail("optimizer is not an optimizer state dict")
    for name in ("scheduler", "grad_scaler"):
        if payload.get(name) is not None and not isinstance(payload[name], dict):
            raise fail(f"{name} is neither a dict nor None")
    position = payload.get("data_position")
    if not isinstance(position, dict) or not all(
        isinstance(k, str) and type(v) is int for k, v in position.items()
    ):
        raise fail("data_position is not a dict of names to ints")
    rng = payload.get("rng")
    if not isinstance(rng, dict) or (
        rng
        and (
            not isinstance(rng.get("torch"), torch.Tensor)
            or not isinstance(rng.get("python"), dict)
        )
    ):
        raise fail("rng is neither empty nor holds the torch and python generator states")
    extras = payload.get("extras")
    if not isinstance(extras, dict):
        raise fail("extras is not a dict")
    return ReplicaState(
        step=step,
        model=model,
        optimizer=optimizer,
        scheduler=payload["scheduler"],
        grad_scaler=payload["grad_scaler"],
        data_position=position,
        rng=rng,
        extras=extras,
    )
