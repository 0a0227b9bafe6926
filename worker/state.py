"""The full state of a data-parallel replica: what it holds, and its capture
from (and restore into) the training objects.

A worker that is behind or new pulls this state from a live peer at a roll call
(DESIGN.md, "Steps, commits and coherent state"). Its canonical digest is in
``rollcall.worker.digest``, its byte form in ``rollcall.worker.state_bytes``,
and the chunks and stripes a transfer moves it in, in ``rollcall.worker.stripes``.

Everything here is pure: no sockets, no clocks. The transport lives elsewhere.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rollcall.membership.errors import RollcallError

try:
    import numpy as np
except ImportError:  # numpy is optional for the RNG part of the state
    np = None  # type: ignore[assignment]

__all__ = ["CorruptState", "ReplicaState", "capture", "restore"]

FORMAT = "rollcall.ReplicaState"
#: Version of the state's structure (and of the digest's walk over it); the
#: byte layout has its own, in ``rollcall.worker.state_bytes.MAGIC``.
VERSION = 1


class CorruptState(RollcallError):
    """The bytes received are not a replica state this version can load (torn,
    truncated, tampered with, or of another format): fetch them again, from
    another peer if possible."""


@dataclass
class ReplicaState:
    """What a joiner needs to continue exactly where the others are.

    Every value is built only from tensors, dicts, lists, tuples, ints, floats,
    strs, bools and None: what the byte form (`rollcall.worker.state_bytes`) can hold.
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


def capture(
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    grad_scaler: Any = None,
    extras: Mapping[str, Any] | None = None,
    with_rng: bool = True,
    live: bool = False,
) -> ReplicaState:
    """Snapshot the replica after committed step `step`.

    With ``with_rng=False`` the process RNG states are left out (``rng`` is
    empty): every replica's RNG streams differ, so a state served to peers
    leaves them out, which keeps the bytes of all replicas at one digest
    identical (and a transfer striped across them coherent).

    Tensors are detached and cloned, containers copied, so training on after
    the capture does not change the snapshot. With ``live`` the model's
    parameters and the optimizer's per-parameter state (nearly all of a
    large state's bytes) are not cloned: the snapshot shares them with the
    model and optimizer, which only an update (or a restore) changes, and
    the caller must stop using it before one does (``ServedState.
    release_live``). Buffers, which a forward pass changes, and everything
    else are cloned as always. Raises TypeError, naming the offending entry,
    if some value could not be transferred safely (anything but tensors,
    dicts, lists, tuples, ints, floats, strs, bools and None).
    """
    if type(step) is not int or step < -1:
        raise ValueError(f"step must be an int >= -1, got {step!r}")
    return ReplicaState(
        step=step,
        model=_copy_tree(model.state_dict(), "model", _parameters_of(model) if live else None),
        optimizer=_copy_optimizer(optimizer.state_dict(), live),
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


def _parameters_of(model: torch.nn.Module) -> Callable[[torch.Tensor], bool]:
    """Whether a tensor of ``model.state_dict()`` is one of its (dense)
    parameters, which ``capture(..., live=True)`` shares."""
    dense = {
        (p.data_ptr(), p.dtype, p.shape) for p in model.parameters() if p.layout is torch.strided
    }
    return lambda t: t.layout is torch.strided and (t.data_ptr(), t.dtype, t.shape) in dense


def _copy_optimizer(state: Any, live: bool) -> Any:
    """``optimizer.state_dict()`` copied; with ``live`` its per-parameter
    state (the entry "state") is shared, not cloned (``capture``)."""
    if not live or not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        return _copy_tree(state, "optimizer")
    return {
        key: _copy_tree(value, f"optimizer[{key!r}]", _shared if key == "state" else None)
        for key, value in state.items()
    }


def _shared(_: torch.Tensor) -> bool:
    return True


def plain(tree: Any, path: str) -> Any:
    """``tree`` as a captured state holds it: containers copied, tensors
    the same objects, subclasses of the scalar types as their base type;
    ``TypeError`` for what a state cannot hold."""
    return _copy_tree(tree, path, _shared)


def _copy_tree(obj: Any, path: str, share: Callable[[torch.Tensor], bool] | None = None) -> Any:
    """Deep copy of a state tree, cloning tensors (those ``share`` names
    only detached), and proof that it holds only types the byte form
    (`state_bytes.to_bytes`) holds. Subclasses of the scalar types (IntEnum,
    numpy.float64, ...) become their plain base type."""
    if isinstance(obj, torch.Tensor):
        return obj.detach() if share is not None and share(obj) else obj.detach().clone()
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
            copied[_copy_tree(key, path)] = _copy_tree(value, f"{path}[{key!r}]", share)
        return copied
    if isinstance(obj, list):
        return [_copy_tree(item, f"{path}[{i}]", share) for i, item in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_copy_tree(item, f"{path}[{i}]", share) for i, item in enumerate(obj))
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
