"""The full state of a data-parallel replica, its canonical digest, and a byte
form that can be streamed in chunks and fetched in stripes from several peers.

A worker that is behind or new pulls this state from a live peer at a roll call
(DESIGN.md, "Steps, commits and coherent state"). The digest lets replicas
compare their state and lets a joiner verify a transfer; the byte form is a
JSON header followed by raw tensor bytes, which decodes without running any
code a peer could have put there, and cheaply.

Everything here is pure: no sockets, no clocks. The transport lives elsewhere.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import random
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rollcall.membership.errors import RollcallError

try:
    import numpy as np
except ImportError:  # numpy is optional for the RNG part of the state
    np = None  # type: ignore[assignment]

__all__ = [
    "Assembler",
    "CorruptState",
    "ReplicaState",
    "capture",
    "chunks",
    "digest",
    "from_bytes",
    "ranges",
    "restore",
    "to_bytes",
    "tree_digest",
]

FORMAT = "rollcall.ReplicaState"
#: Version of the state's structure (and of the digest's walk over it); the
#: byte layout has its own, in MAGIC.
VERSION = 1
DIGEST_ALGORITHM = "sha256"


class CorruptState(RollcallError):
    """The bytes received are not a replica state this version can load (torn,
    truncated, tampered with, or of another format): fetch them again, from
    another peer if possible."""


@dataclass
class ReplicaState:
    """What a joiner needs to continue exactly where the others are.

    Every value is built only from tensors, dicts, lists, tuples, ints, floats,
    strs, bools and None: what the byte form (`to_bytes`) can hold.
    """

    step: int
    """Last committed global step (-1 before any)."""
    model: dict[str, torch.Tensor]
    """`model.state_dict()`: parameters and buffers."""
    optimizer: dict[str, Any]
    """`optimizer.state_dict()`."""
    scheduler: dict[str, Any] | None
    """`scheduler.state_dict()`, or None when the job has no LR scheduler."""
    grad_scaler: dict[str, Any] | None
    """`grad_scaler.state_dict()`, or None when the job has no grad scaler."""
    data_position: dict[str, int]
    """Where the data plan stands; the plan derives everything from the step."""
    rng: dict[str, Any]
    """Process RNG states: "torch" (CPU generator), "python", and "numpy" when
    numpy is importable. Not part of the digest (see `digest`)."""
    extras: dict[str, Any]
    """User extras: JSON-able values or tensors."""


# ---------------------------------------------------------------- capture/restore


def capture(
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    grad_scaler: Any = None,
    extras: Mapping[str, Any] | None = None,
    with_rng: bool = True,
) -> ReplicaState:
    """Snapshot the replica after committed step `step`.

    With ``with_rng=False`` the process RNG states are left out (``rng`` is
    empty): every replica's RNG streams differ, so a state served to peers
    leaves them out, which keeps the bytes of all replicas at one digest
    identical (and a transfer striped across them coherent).

    Tensors are detached and cloned, containers copied, so training on after
    the capture does not change the snapshot. Raises TypeError, naming the
    offending entry, if some value could not be transferred safely (anything
    but tensors, dicts, lists, tuples, ints, floats, strs, bools and None).
    """
    if type(step) is not int or step < -1:
        raise ValueError(f"step must be an int >= -1, got {step!r}")
    return ReplicaState(
        step=step,
        model=_copy_tree(model.state_dict(), "model"),
        optimizer=_copy_tree(optimizer.state_dict(), "optimizer"),
        scheduler=None if scheduler is None else _copy_tree(scheduler.state_dict(), "scheduler"),
        grad_scaler=(
            None if grad_scaler is None else _copy_tree(grad_scaler.state_dict(), "grad_scaler")
        ),
        data_position={"step": step},
        rng=_capture_rng() if with_rng else {},
        extras=_copy_tree(dict(extras or {}), "extras"),
    )


def restore(
    state: ReplicaState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    grad_scaler: Any = None,
) -> dict[str, Any]:
    """Load `state` into the given objects in place, RNG states included, and
    return (a copy of) the user extras.

    The objects must be configured like the replica that captured the state;
    a scheduler or grad scaler present on one side only is a ValueError.
    The state itself is left untouched: the objects receive copies, because
    `Optimizer.load_state_dict` would otherwise keep the snapshot's tensors
    and update them in place.
    """
    _check_same_presence("scheduler", state.scheduler, scheduler)
    _check_same_presence("grad_scaler", state.grad_scaler, grad_scaler)
    model.load_state_dict(state.model)
    optimizer.load_state_dict(_copy_tree(state.optimizer, "optimizer"))
    if scheduler is not None and state.scheduler is not None:
        scheduler.load_state_dict(_copy_tree(state.scheduler, "scheduler"))
    if grad_scaler is not None and state.grad_scaler is not None:
        grad_scaler.load_state_dict(_copy_tree(state.grad_scaler, "grad_scaler"))
    _restore_rng(state.rng)
    return _copy_tree(state.extras, "extras")


def _check_same_presence(name: str, saved: object, given: object) -> None:
    if (saved is None) != (given is None):
        held = "holds" if saved is not None else "holds no"
        passed = "was" if given is not None else "was not"
        raise ValueError(
            f"the state {held} {name} but one {passed} passed to restore: "
            "the replicas are configured differently"
        )


def _copy_tree(obj: Any, path: str) -> Any:
    """Deep copy of a state tree, cloning tensors, and proof that it holds only
    types the byte form (`to_bytes`) holds. Subclasses of the scalar
    types (IntEnum, numpy.float64, ...) become their plain base type."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if obj is None:
        return None
    if isinstance(obj, bool):
        return bool(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, dict):
        copied = {}
        for key, value in obj.items():
            if key is not None and not isinstance(key, (bool, int, float, str)):
                raise TypeError(f"{path}: key {key!r} of type {type(key).__name__} not allowed")
            copied[_copy_tree(key, path)] = _copy_tree(value, f"{path}[{key!r}]")
        return copied
    if isinstance(obj, list):
        return [_copy_tree(item, f"{path}[{i}]") for i, item in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_copy_tree(item, f"{path}[{i}]") for i, item in enumerate(obj))
    raise TypeError(
        f"{path}: a {type(obj).__name__} cannot be part of a replica state "
        "(allowed: tensors, dict, list, tuple, int, float, str, bool, None)"
    )


def _capture_rng() -> dict[str, Any]:
    version, internal, gauss_next = random.getstate()
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if np is not None:
        name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
        rng["numpy"] = {
            "bit_generator": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    return rng


def _restore_rng(rng: Mapping[str, Any]) -> None:
    if not rng:
        return  # captured without RNG states: this process keeps its own
    torch.set_rng_state(rng["torch"])
    python = rng["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    saved = rng.get("numpy")
    # A state captured without numpy leaves numpy's generator alone, and a
    # process without numpy has nothing to restore.
    if np is not None and saved is not None:
        np.random.set_state(
            (
                saved["bit_generator"],
                saved["keys"].numpy().astype(np.uint32),
                saved["pos"],
                saved["has_gauss"],
                saved["cached_gaussian"],
            )
        )


# ------------------------------------------------------------------------ digest


def digest(state: ReplicaState) -> str:
    """Canonical content digest, "sha256:<64 hex digits>".

    Two replicas holding equal state get the same digest whatever the pickle
    details, dict insertion order, memory layout or device: the hash runs over
    a canonical, length-framed walk (dict entries sorted by their encoded key;
    tensors as dtype, shape and raw contiguous CPU bytes; scalars type-tagged,
    so 1, 1.0, True and "1" differ; lists and tuples alike, in order).

    Covered: step, model, optimizer (state and param_groups), scheduler, grad
    scaler, data position and extras. The RNG states are deliberately left
    out: per-microbatch randomness is seeded from (seed, step, microbatch), so
    the process generators are not part of what replicas must agree on, and
    they legitimately differ between ranks that ran different microbatches.
    """
    sink = hashlib.sha256()
    sink.update(f"{FORMAT}/{VERSION}\0".encode())
    _feed(
        sink,
        {
            "step": state.step,
            "model": state.model,
            "optimizer": state.optimizer,
            "scheduler": state.scheduler,
            "grad_scaler": state.grad_scaler,
            "data_position": state.data_position,
            "extras": state.extras,
        },
    )
    return f"{DIGEST_ALGORITHM}:{sink.hexdigest()}"


def tree_digest(tree: Any) -> str:
    """Canonical content digest of one state tree (a ``state_dict``, say),
    "sha256:<64 hex digits>", by the same walk as :func:`digest`."""
    sink = hashlib.sha256()
    sink.update(f"{FORMAT}.tree/{VERSION}\0".encode())
    _feed(sink, tree)
    return f"{DIGEST_ALGORITHM}:{sink.hexdigest()}"


def _frame(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<Q", len(payload)) + payload


def _scalar_bytes(obj: Any) -> bytes:
    if obj is None:
        return b"N"
    if isinstance(obj, bool):
        return b"T" if obj else b"F"
    if isinstance(obj, int):
        return _frame(b"i", repr(int(obj)).encode())
    if isinstance(obj, float):
        # repr is the shortest string that round-trips, hence one per value.
        return _frame(b"f", repr(float(obj)).encode())
    if isinstance(obj, str):
        return _frame(b"s", obj.encode("utf-8", "surrogatepass"))
    raise TypeError(f"a {type(obj).__name__} cannot be part of a replica state")


def _feed(sink: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        _feed_tensor(sink, obj)
    elif isinstance(obj, dict):
        entries = sorted(
            ((_scalar_bytes(key), value) for key, value in obj.items()), key=lambda e: e[0]
        )
        sink.update(b"d" + struct.pack("<Q", len(entries)))
        for key, value in entries:
            sink.update(key)
            _feed(sink, value)
    elif isinstance(obj, (list, tuple)):
        sink.update(b"l" + struct.pack("<Q", len(obj)))
        for item in obj:
            _feed(sink, item)
    else:
        sink.update(_scalar_bytes(obj))


def _feed_tensor(sink: Any, tensor: torch.Tensor) -> None:
    raw = _raw(tensor)
    sink.update(_frame(b"t", str(tensor.dtype).encode()))
    sink.update(struct.pack(f"<Q{tensor.dim()}Q", tensor.dim(), *tensor.shape))
    sink.update(struct.pack("<Q", raw.nbytes))
    sink.update(raw)


# ---------------------------------------------------------------------- bytes
#
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
_DTYPES: dict[str, torch.dtype] = {
    str(value): value for value in vars(torch).values() if isinstance(value, torch.dtype)
}


def to_bytes(state: ReplicaState) -> bytes:
    """Serialize ``state``: a JSON header and the raw tensor bytes (see the
    layout above). Equal states give equal bytes."""
    tensors: list[torch.Tensor] = []
    tree = _encode(
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
        },
        tensors,
    )
    flats = [_raw(tensor) for tensor in tensors]
    table = []
    position = 0
    for tensor, flat in zip(tensors, flats, strict=True):
        table.append([str(tensor.dtype), list(tensor.shape), position])
        position = _aligned(position + flat.nbytes)
    text = json.dumps({"tensors": table, "state": tree}, separators=(",", ":")).encode()
    start = len(MAGIC) + _HEADER_LENGTH.size + len(text)
    parts: list[Any] = [MAGIC, _HEADER_LENGTH.pack(len(text)), text, bytes(_aligned(start) - start)]
    for flat in flats:
        parts.append(flat)
        parts.append(bytes(_aligned(flat.nbytes) - flat.nbytes))
    return b"".join(parts)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _raw(tensor: torch.Tensor) -> Any:
    """The tensor's contiguous CPU bytes, as a buffer (no copy if it already
    is contiguous on the CPU)."""
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"only dense tensors can be part of a replica state, not {tensor.layout}")
    flat = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


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


def from_bytes(data: bytes | bytearray, expect_digest: str | None = None) -> ReplicaState:
    """Load a state written by `to_bytes`, onto the CPU, without running code.

    Raises CorruptState on any failure: bytes that do not decode, a structure
    that is not a replica state, or (when `expect_digest` is given) content
    whose digest differs. The layout carries no checksum of its own, so a
    flipped byte inside tensor data is only caught by the digest; pass the one
    the sender announced.

    The tensors share one private copy of ``data`` (a ``bytearray`` passed in
    is used as it is, and must not be changed afterwards).
    """
    buffer = data if isinstance(data, bytearray) else bytearray(data)
    try:
        payload = _decode(buffer)
    except CorruptState:
        raise
    except Exception as exc:  # malformed input fails in many ways; all mean "corrupt"
        raise CorruptState(f"replica state does not load ({len(data)} bytes): {exc}") from exc
    state = _validated(payload)
    if expect_digest is not None:
        actual = digest(state)
        if actual != expect_digest:
            raise CorruptState(f"replica state digest is {actual}, expected {expect_digest}")
    return state


def _decode(buffer: bytearray) -> Any:
    def fail(why: str) -> CorruptState:
        return CorruptState(f"replica state does not load ({len(buffer)} bytes): {why}")

    start = len(MAGIC) + _HEADER_LENGTH.size
    if len(buffer) < start or buffer[: len(MAGIC)] != MAGIC:
        raise fail("not a rollcall replica state")
    (length,) = _HEADER_LENGTH.unpack_from(buffer, len(MAGIC))
    if length > len(buffer) - start:
        raise fail(f"header of {length} bytes runs past the end")
    header = json.loads(buffer[start : start + length].decode())
    if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
        raise fail("header is not a dict with a tensor table")
    data_start = _aligned(start + length)
    tensors = [_tensor_at(buffer, entry, data_start) for entry in header["tensors"]]
    return _decode_tree(header.get("state"), tensors)


def _tensor_at(buffer: bytearray, entry: Any, data_start: int) -> torch.Tensor:
    dtype_name, shape, offset = entry
    dtype = _DTYPES[dtype_name]
    if not all(type(n) is int and n >= 0 for n in shape) or type(offset) is not int or offset < 0:
        raise CorruptState(f"tensor entry {entry!r} is malformed")
    count = math.prod(shape)
    offset += data_start
    if offset % ALIGN or offset + count * dtype.itemsize > len(buffer):
        raise CorruptState(f"tensor entry {entry!r} lies outside the data")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
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


def _validated(payload: Any) -> ReplicaState:
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


# --------------------------------------------------------- chunks and stripes


def chunks(data: bytes, chunk_size: int) -> Iterator[tuple[int, bytes]]:
    """Yield (offset, piece) pieces of at most `chunk_size` bytes, in order,
    covering `data` exactly (nothing for empty data)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    for offset in range(0, len(data), chunk_size):
        yield offset, data[offset : offset + chunk_size]


def ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """Split [0, total) into at most `parts` contiguous (offset, length)
    ranges whose lengths differ by at most one, longer ones first; used to
    stripe a fetch across peers. Empty ranges are dropped, so `parts > total`
    yields `total` ranges of one byte."""
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    base, longer = divmod(total, parts)
    result = []
    offset = 0
    for index in range(min(parts, total)):
        length = base + 1 if index < longer else base
        result.append((offset, length))
        offset += length
    return result


class Assembler:
    """Reassembles a blob of `total` bytes from pieces fetched from different
    peers, in any order. Memory is bounded by `total`: a piece that falls
    outside the blob or overlaps one already received is refused."""

    def __init__(self, total: int) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total = total
        self._buffer = bytearray(total)
        # Received [start, end) intervals, sorted, disjoint and never adjacent
        # (adjacent ones are merged), so in-order arrival keeps one interval.
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, offset: int, piece: bytes) -> None:
        """Store `piece` at `offset`. ValueError if it does not fit in the blob
        or overlaps bytes already received."""
        end = offset + len(piece)
        if offset < 0 or end > self.total:
            raise ValueError(f"piece [{offset}, {end}) lies outside the blob of {self.total} bytes")
        if not piece:
            return
        index = bisect.bisect_right(self._starts, offset)
        if index > 0 and self._ends[index - 1] > offset:
            raise ValueError(
                f"piece [{offset}, {end}) overlaps received "
                f"[{self._starts[index - 1]}, {self._ends[index - 1]})"
            )
        if index < len(self._starts) and self._starts[index] < end:
            raise ValueError(
                f"piece [{offset}, {end}) overlaps received "
                f"[{self._starts[index]}, {self._ends[index]})"
            )
        self._buffer[offset:end] = piece
        start = offset
        if index > 0 and self._ends[index - 1] == offset:
            index -= 1
            start = self._starts[index]
            del self._starts[index], self._ends[index]
        if index < len(self._starts) and self._starts[index] == end:
            end = self._ends[index]
            del self._starts[index], self._ends[index]
        self._starts.insert(index, start)
        self._ends.insert(index, end)

    def missing(self) -> list[tuple[int, int]]:
        """The (offset, length) ranges not received yet, in order."""
        gaps = []
        position = 0
        for start, end in zip(self._starts, self._ends, strict=True):
            if start > position:
                gaps.append((position, start - position))
            position = end
        if position < self.total:
            gaps.append((position, self.total - position))
        return gaps

    def complete(self) -> bool:
        """Whether every byte has been received."""
        return self.total == 0 or (self._starts == [0] and self._ends == [self.total])

    def result(self) -> bytearray:
        """The reassembled blob: the assembler's own buffer, not a copy (a
        copy of a large state costs as much as its decode and digest check
        together). ValueError while bytes are missing; once complete, no
        piece can change it."""
        if not self.complete():
            raise ValueError(f"blob incomplete, missing (offset, length) {self.missing()}")
        return self._buffer
