"""What a user's objects reach: their attributes, the items of their small
containers, a ``functools.partial``'s and a bound method's parts, a few
levels down, each with the path that reaches it.

The runtime walks a data set, a collate function and a model's modules to
find the random generators they hold (``rollcall.worker.randomness``) and
the settings they keep (``rollcall.worker.contract.DataWatch``). The walk
is bounded: a few levels, containers of at most a few hundred items (a data
set's list of a million samples holds data, not settings), and it never
looks into tensors, arrays, types, modules or functions.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

try:
    import numpy
except ImportError:  # pragma: no cover - torch wheels bring numpy
    numpy = None  # type: ignore[assignment]

__all__ = ["SCALARS", "reach", "scalars"]

#: How deep the walk goes below each object it starts from, and the largest
#: container it looks into.
DEPTH = 4
LARGEST = 256

#: Values reached at every path they are found at, never walked into.
SCALARS = (type(None), bool, int, float, complex, str, bytes)

#: Module state a walk never looks into: parameters, buffers and submodules
#: (each module of a model is a start of its own).
_MODULE_SKIPPED = frozenset({"_parameters", "_buffers", "_modules"})

#: Neither reached nor walked into.
_OPAQUE = (
    bytearray, range, torch.Tensor, torch.dtype, torch.device, type, types.ModuleType,
    types.FunctionType, types.BuiltinFunctionType,
)  # fmt: skip


def reach(
    roots: Sequence[tuple[str, Any]], *, stop: tuple[type, ...] = (), depth: int = DEPTH
) -> Iterator[tuple[str, Any]]:
    """``(path, object)`` for what each ``(name, root)`` reaches, the roots
    included, depth first in a fixed order: scalars (``SCALARS``) at every
    path, any other object once, at the first path found. Instances of
    ``stop`` are reached but not walked into. Paths read like Python:
    ``name.attribute``, ``name[2]``, ``name['key']``."""
    seen: set[int] = set()

    def walk(path: str, obj: Any, left: int) -> Iterator[tuple[str, Any]]:
        if isinstance(obj, SCALARS):
            yield path, obj
            return
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            return
        seen.add(id(obj))
        yield path, obj
        if left > 0 and not isinstance(obj, stop) and not _array(obj):
            for step, child in _children(obj, named=True):
                yield from walk(_join(path, step), child, left - 1)

    for name, root in roots:
        yield from walk(name, root, depth)


def scalars(roots: Sequence[Any], *, depth: int = DEPTH) -> list[Any]:
    """The scalars :func:`reach` finds from ``roots``, in its order, without
    their paths: a few times faster, for a check at every step that needs
    the paths only once something differs."""
    seen: set[int] = set()
    found: list[Any] = []

    def walk(obj: Any, left: int) -> None:
        if isinstance(obj, SCALARS):
            found.append(obj)
        elif id(obj) not in seen and not isinstance(obj, _OPAQUE):
            seen.add(id(obj))
            if left > 0 and not _array(obj):
                for child in _children(obj, named=False):
                    walk(child, left - 1)

    for root in roots:
        walk(root, depth)
    return found


def _array(obj: Any) -> bool:
    return numpy is not None and isinstance(obj, numpy.ndarray)


def _join(path: str, step: str | tuple[Any]) -> str:
    if isinstance(step, tuple):  # an item
        return f"{path}[{step[0]!r}]"
    return f"{path}.{step}" if path else step


def _children(obj: Any, *, named: bool) -> Iterable[Any]:
    """``obj``'s children: ``(step, child)`` pairs if ``named`` (a step is
    an attribute's name, or ``(key,)`` for an item), else the children."""
    if isinstance(obj, dict):
        if len(obj) > LARGEST:
            return ()
        return [((k,), v) for k, v in obj.items()] if named else obj.values()
    if isinstance(obj, (list, tuple, set, frozenset)):
        if len(obj) > LARGEST:
            return ()
        return [((i,), v) for i, v in enumerate(obj)] if named else obj
    if isinstance(obj, functools.partial):
        parts = [("func", obj.func), *((f"args[{i}]", a) for i, a in enumerate(obj.args)),
                 *((f"keywords[{k!r}]", v) for k, v in obj.keywords.items())]  # fmt: skip
    elif isinstance(obj, types.MethodType):  # a collate method of an object holding a generator
        parts = [("__self__", obj.__self__)]
    else:
        try:  # a proxy's __getattr__ may answer for __dict__, or raise anything
            attributes = getattr(obj, "__dict__", None)
        except Exception:
            return ()
        if not isinstance(attributes, dict):
            return ()
        if isinstance(obj, torch.nn.Module):
            parts = [(k, v) for k, v in attributes.items() if k not in _MODULE_SKIPPED]
        elif len(attributes) > LARGEST:
            return ()
        else:
            return attributes.items() if named else attributes.values()
    return parts if named else [child for _, child in parts]
