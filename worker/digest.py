"""The canonical content digest of a replica state (and of any state tree):
equal state, equal digest, whatever the dict order, memory layout or device.

Replicas compare their digests at a roll call, and a member that fetches
state checks what it received against the digest agreed there. A replica
state's digest sees each tensor's bytes through the SHA-256 of each of
their pieces (``PIECE_BYTES`` each), so a fetcher checks every piece on
its own, as it arrives and in any order, and then the whole with one walk
over the state's structure (``digest_of_pieces``), without a pass over the
bytes at the end.

A large state's pieces can be hashed by several threads at once
(``digest(state, threads=N)``: hashlib releases the GIL), which a roll
call's answer does with the cores the waiting training thread leaves idle.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from rollcall.worker.state import FORMAT, VERSION, ReplicaState

__all__ = [
    "PIECE_BYTES",
    "digest",
    "digest_like",
    "digest_of_pieces",
    "hash_threads",
    "piece_bounds",
    "piece_hash",
    "tensor_bytes",
    "tree_digest",
]

#: A replica state's digest: "sha256-pieces:<64 hex digits>".
DIGEST_FORM = "sha256-pieces"
#: The form before (one SHA-256 over the walk with every tensor's raw
#: bytes), still checked where such a digest was recorded (checkpoint
#: manifests written by earlier versions); ``tree_digest`` keeps it.
WHOLE_FORM = "sha256"
#: Bytes per piece of a tensor's bytes (the last piece of a tensor may be
#: shorter). Part of the digest's definition: another value, other digests.
PIECE_BYTES = 1 << 20

#: A tensor's part of the walk, after its dtype and shape.
TensorLeaf = Callable[[Any, torch.Tensor], None]

#: Below this many tensor bytes a state is hashed by the calling thread
#: alone (handing pieces to other threads costs more than it saves).
PARALLEL_BYTES = 8 << 20
#: Pieces per task handed to a hashing thread.
_TASK_PIECES = 4
#: Hashing threads at most, whatever the cores.
_MAX_THREADS = 8


def hash_threads() -> int:
    """Threads worth hashing a large state with: the cores this process
    may run on (at most 8)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, _MAX_THREADS))


def digest(state: ReplicaState, threads: int = 1) -> str:
    """Canonical content digest, "sha256-pieces:<64 hex digits>".

    Two replicas holding equal state get the same digest whatever the pickle
    details, dict insertion order, memory layout or device: the hash runs over
    a canonical, length-framed walk (dict entries sorted by their encoded key;
    tensors as dtype, shape, byte count and the SHA-256 of each
    ``PIECE_BYTES`` piece of their raw contiguous CPU bytes; scalars
    type-tagged, so 1, 1.0, True and "1" differ; lists and tuples alike, in
    order).

    Covered: step, model, optimizer (state and param_groups), scheduler, grad
    scaler, data position and extras. The RNG states are deliberately left
    out: per-microbatch randomness is seeded from (seed, step, microbatch), so
    the process generators are not part of what replicas must agree on, and
    they legitimately differ between ranks that ran different microbatches.

    ``threads``: how many threads hash the pieces of a state of at least
    ``PARALLEL_BYTES`` (the calling thread and ``threads - 1`` others; the
    same digest whatever the number). Meant for a thread that waits
    anyway, a roll call's answer; a digest taken beside training (a
    checkpoint's) keeps the default, one, and leaves the cores to it.
    """
    if threads < 1:
        raise ValueError(f"threads must be at least 1, not {threads}")
    known = _hashed_in_parallel(state, threads) if threads > 1 else None
    return _state_digest(state, DIGEST_FORM, _pieces_leaf(known))


def digest_like(state: ReplicaState, recorded: str, threads: int = 1) -> str:
    """The digest of ``state`` in the form of ``recorded`` (a digest of the
    earlier whole-walk form "sha256:..." is computed that way, by one
    thread), to compare with it."""
    if recorded.startswith(f"{WHOLE_FORM}:"):
        return _state_digest(state, WHOLE_FORM, _feed_whole_tensor)
    return digest(state, threads=threads)


def digest_of_pieces(state: ReplicaState, pieces: Mapping[int, Sequence[bytes]]) -> str:
    """``digest(state)`` from the pieces' SHA-256 digests already known:
    ``pieces[id(tensor)]`` lists each tensor's, in order (a tensor without
    bytes may be missing). Costs a walk over the structure only. KeyError
    if a tensor with bytes has no entry."""
    return _state_digest(state, DIGEST_FORM, _pieces_leaf(pieces))


def tree_digest(tree: Any) -> str:
    """Canonical content digest of one state tree (a ``state_dict``, say),
    "sha256:<64 hex digits>", by the walk of :func:`digest` with each
    tensor's raw bytes hashed whole."""
    sink = hashlib.sha256()
    sink.update(f"{FORMAT}.tree/{VERSION}\0".encode())
    _feed(sink, tree, _feed_whole_tensor)
    return f"{WHOLE_FORM}:{sink.hexdigest()}"


def piece_bounds(nbytes: int) -> list[tuple[int, int]]:
    """The (start, end) of each piece of ``nbytes`` bytes of one tensor."""
    return [(start, min(start + PIECE_BYTES, nbytes)) for start in range(0, nbytes, PIECE_BYTES)]


def piece_hash(data: Any) -> bytes:
    """The SHA-256 digest (32 bytes) of one piece (any buffer)."""
    return hashlib.sha256(data).digest()


def _state_digest(state: ReplicaState, form: str, leaf: TensorLeaf) -> str:
    sink = hashlib.sha256()
    prefix = f"{FORMAT}/{VERSION}" if form == WHOLE_FORM else f"{FORMAT}/{VERSION}/{form}"
    sink.update(f"{prefix}\0".encode())
    _feed(sink, _digested(state), leaf)
    return f"{form}:{sink.hexdigest()}"


def _digested(state: ReplicaState) -> dict[str, Any]:
    """What a replica state's digest walks over."""
    return {
        "step": state.step,
        "model": state.model,
        "optimizer": state.optimizer,
        "scheduler": state.scheduler,
        "grad_scaler": state.grad_scaler,
        "data_position": state.data_position,
        "extras": state.extras,
    }


def _hashed_in_parallel(state: ReplicaState, threads: int) -> dict[int, list[bytes]] | None:
    """The SHA-256 of every piece of every tensor of ``state``, keyed by
    ``id(tensor)`` as ``digest_of_pieces`` takes them, hashed by the
    calling thread and ``threads - 1`` others; None for a state too small
    to be worth it."""
    tensors = {id(t): t for t in _tensors_in(_digested(state))}
    sizes = {key: t.numel() * t.element_size() for key, t in tensors.items()}
    if sum(sizes.values()) < PARALLEL_BYTES:
        return None
    # Tasks in walk order: a few pieces each of a tensor whose bytes are
    # in host memory already, a whole tensor that needs a copy to get them
    # (strided, on a device), made by the task: at most one such copy per
    # thread at a time, as one thread alone has. The other threads take
    # tasks from the front, the calling thread from the back, until they
    # meet: nobody waits while work is left.
    tasks: list[tuple[int, Any, list[tuple[int, int]]]] = []
    for key, tensor in tensors.items():
        _check_dense(tensor)
        if not sizes[key]:
            continue
        bounds = piece_bounds(sizes[key])
        if not _bytes_in_place(tensor):
            tasks.append((key, tensor, bounds))
            continue
        raw = tensor_bytes(tensor)  # a view, no copy
        for first in range(0, len(bounds), _TASK_PIECES):
            tasks.append((key, raw, bounds[first : first + _TASK_PIECES]))
    with ThreadPoolExecutor(threads - 1, thread_name_prefix="rollcall-digest") as pool:
        results: list[Future[list[bytes]] | list[bytes]] = [
            pool.submit(_hash_pieces, raw, bounds) for _, raw, bounds in tasks
        ]
        try:
            for index in reversed(range(len(tasks))):
                task = results[index]
                if isinstance(task, Future) and task.cancel():
                    results[index] = _hash_pieces(tasks[index][1], tasks[index][2])
        except BaseException:
            for task in results:
                if isinstance(task, Future):
                    task.cancel()
            raise
    known: dict[int, list[bytes]] = {key: [] for key in tensors}
    for (key, _, _), task in zip(tasks, results, strict=True):
        known[key].extend(task.result() if isinstance(task, Future) else task)
    return known


def _hash_pieces(source: Any, bounds: Sequence[tuple[int, int]]) -> list[bytes]:
    """The pieces ``bounds`` of ``source``: a buffer, or a tensor whose
    bytes are copied first."""
    raw = tensor_bytes(source) if isinstance(source, torch.Tensor) else source
    return [piece_hash(raw[start:end]) for start, end in bounds]


def _bytes_in_place(tensor: torch.Tensor) -> bool:
    """Whether ``tensor_bytes`` gives ``tensor``'s bytes without a copy."""
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor ``_feed`` would reach in ``obj``."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)


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


def _feed(sink: Any, obj: Any, leaf: TensorLeaf) -> None:
    if isinstance(obj, torch.Tensor):
        sink.update(_frame(b"t", str(obj.dtype).encode()))
        sink.update(struct.pack(f"<Q{obj.dim()}Q", obj.dim(), *obj.shape))
        leaf(sink, obj)
    elif isinstance(obj, dict):
        entries = sorted(
            ((_scalar_bytes(key), value) for key, value in obj.items()), key=lambda e: e[0]
        )
        sink.update(b"d" + struct.pack("<Q", len(entries)))
        for key, value in entries:
            sink.update(key)
            _feed(sink, value, leaf)
    elif isinstance(obj, (list, tuple)):
        sink.update(b"l" + struct.pack("<Q", len(obj)))
        for item in obj:
            _feed(sink, item, leaf)
    else:
        sink.update(_scalar_bytes(obj))


def _feed_whole_tensor(sink: Any, tensor: torch.Tensor) -> None:
    raw = tensor_bytes(tensor)
    sink.update(struct.pack("<Q", raw.nbytes))
    sink.update(raw)


def _pieces_leaf(known: Mapping[int, Sequence[bytes]] | None) -> TensorLeaf:
    def leaf(sink: Any, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        sink.update(struct.pack("<Q", nbytes))
        if known is None:
            raw = tensor_bytes(tensor)
            for start, end in piece_bounds(nbytes):
                sink.update(piece_hash(raw[start:end]))
        elif nbytes:
            hashes = known[id(tensor)]
            if len(hashes) != len(piece_bounds(nbytes)):
                raise KeyError(f"{len(hashes)} piece digests for a tensor of {nbytes} bytes")
            sink.update(b"".join(hashes))

    return leaf


def tensor_bytes(tensor: torch.Tensor) -> Any:
    """The tensor's contiguous CPU bytes, as a buffer (no copy if it already
    is contiguous on the CPU)."""
    _check_dense(tensor)
    flat = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def _check_dense(tensor: torch.Tensor) -> None:
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"only dense tensors can be part of a replica state, not {tensor.layout}")
