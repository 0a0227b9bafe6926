"""The full state of a data-parallel replica, its canonical digest, and a byte
form that can be streamed in chunks and fetched in stripes from several peers.

A worker that is behind or new pulls this state from a live peer at a roll call
(DESIGN.md, "Steps, commits and coherent state"). The digest lets replicas
compare their state and lets a joiner verify a transfer; the byte form is a
`torch.save` blob that loads with `weights_only=True`, so a peer cannot make a
joiner run code.

Everything here is pure: no sockets, no clocks. The transport lives elsewhere.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import random
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from membership.errors import RollcallError

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
]

FORMAT = "rollcall.ReplicaState"
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
    strs, bools and None, so that the state loads with `weights_only=True`.
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
) -> ReplicaState:
    """Snapshot the replica after committed step `step`.

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
        rng=_capture_rng(),
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
    types `torch.load(weights_only=True)` accepts. Subclasses of the scalar
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
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"only dense tensors can be digested, not {tensor.layout}")
    flat = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy()
    sink.update(_frame(b"t", str(flat.dtype).encode()))
    sink.update(struct.pack(f"<Q{tensor.dim()}Q", tensor.dim(), *tensor.shape))
    sink.update(struct.pack("<Q", raw.nbytes))
    sink.update(raw)


# ---------------------------------------------------------------------- bytes


def to_bytes(state: ReplicaState) -> bytes:
    """Serialize with `torch.save`; the result loads with `weights_only=True`."""
    payload = {
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
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes, expect_digest: str | None = None) -> ReplicaState:
    """Load a state written by `to_bytes`, onto the CPU, without running code.

    Raises CorruptState on any failure: bytes that do not load, a structure
    that is not a replica state, or (when `expect_digest` is given) content
    whose digest differs. `torch.save` blobs carry no checksum the loader
    verifies, so a flipped byte inside tensor data is only caught by the
    digest; pass the one the sender announced.
    """
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # the loader has no single error type; all mean "corrupt"
        raise CorruptState(f"replica state does not load ({len(data)} bytes): {exc}") from exc
    state = _validated(payload)
    if expect_digest is not None:
        actual = digest(state)
        if actual != expect_digest:
            raise CorruptState(f"replica state digest is {actual}, expected {expect_digest}")
    return state


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
    if (
        not isinstance(rng, dict)
        or not isinstance(rng.get("torch"), torch.Tensor)
        or not isinstance(rng.get("python"), dict)
    ):
        raise fail("rng lacks the torch and python generator states")
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

    def result(self) -> bytes:
        """The reassembled blob. ValueError while bytes are missing."""
        if not self.complete():
            raise ValueError(f"blob incomplete, missing (offset, length) {self.missing()}")
        return bytes(self._buffer)
