"""The canonical content digest of a replica state (and of any state tree):
equal state, equal digest, whatever the dict order, memory layout or device.

Replicas compare their digests at a roll call, and a joiner checks a
transfer against the digest its sender announced.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import torch

from rollcall.worker.state import FORMAT, VERSION, ReplicaState

__all__ = ["digest", "tensor_bytes", "tree_digest"]

DIGEST_ALGORITHM = "sha256"


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
    raw = tensor_bytes(tensor)
    sink.update(_frame(b"t", str(tensor.dtype).encode()))
    sink.update(struct.pack(f"<Q{tensor.dim()}Q", tensor.dim(), *tensor.shape))
    sink.update(struct.pack("<Q", raw.nbytes))
    sink.update(raw)


def tensor_bytes(tensor: torch.Tensor) -> Any:
    """The tensor's contiguous CPU bytes, as a buffer (no copy if it already
    is contiguous on the CPU)."""
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"only dense tensors can be part of a replica state, not {tensor.layout}")
    flat = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()
