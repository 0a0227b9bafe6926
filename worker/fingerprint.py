"""The worker's side of the configuration fingerprint: this process's
training setup as a :class:`rollcall.membership.fingerprint.JobFingerprint`.

The runtime computes it once, at construction, before it joins (and before
any step changes the model), from the objects it is given. Every value is
canonical text or a SHA-256 over a canonical walk (``rollcall.worker.digest``), never
``hash()``, which Python salts per process: the same script with the same
seed gives the same fingerprint in every process, on every machine.

Costs one pass of SHA-256 over the model's parameters and buffers (the
``initial_state`` digest): ~0.7 ms for the example's 137k parameters, ~30
ms for 50 MB of them on this 2-core machine (``docs/worker.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import inspect
import json
import os
import sys
import sysconfig
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rollcall.membership.fingerprint import MAX_VALUE_LENGTH, NAMES, VALUE_PATTERN, JobFingerprint
from rollcall.worker.digest import tree_digest
from rollcall.worker.plan import DataPlan

#: Value of a class field when the job has no such object.
NONE = "none"
#: ``data`` when the reads of the probe differed (:func:`data_probe`).
VARYING = "varies between reads"
#: ``data`` of a worker that does not compare what it reads (``data_probe=False``),
#: ``code`` of one that does not compare its code (``code_check=False``).
DATA_OFF = CODE_OFF = "off"
#: Top-level packages whose source ``code`` does not compare: Python's own
#: (its version is the interpreter's), torch (the ``torch`` field names its
#: build) and rollcall itself; ``__mp_main__``, multiprocessing's other
#: name for ``__main__``.
_NOT_USER_CODE = frozenset({"torch", "rollcall", "__mp_main__"}) | sys.stdlib_module_names
#: Directories that hold installed packages, not a project's own code.
_INSTALLED = frozenset({"site-packages", "dist-packages"})
#: Files that mark a project's root directory (``project_root``).
_PROJECT_MARKS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")
#: Hex digits of each module's source digest in ``code``.
_CODE_DIGEST = 8
#: Hex digits of the digest kept when a value is shortened.
_SHORTENED_DIGEST = 16


def job_fingerprint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: DataPlan,
    *,
    scheduler: Any = None,
    grad_scaler: Any = None,
    extras: Mapping[str, Any] | None = None,
    before_update: Any = None,
    data: str = DATA_OFF,
    code: str = CODE_OFF,
    flags: Mapping[str, str] | None = None,
) -> JobFingerprint:
    """The fingerprint of a job run with these objects, as they are now.

    ``extras`` is the registered user state (only its names count);
    ``before_update`` the hook, by its module and qualified name; ``data``
    what the worker read of the data set (:func:`data_probe`, or ``off``);
    ``code`` the source it runs (:func:`code_digests`, or ``off``).
    ``flags`` are settings of the runtime itself, by field name (e.g.
    ``{"min_workers": "2"}``); each must be a field that
    ``rollcall.membership.fingerprint.FIELDS`` declares and this function does not
    compute (else ``ValueError``)."""
    values = {
        "global_batch": str(plan.global_batch),
        "micro_batch": str(plan.micro_batch),
        "seed": str(plan.seed),
        "num_samples": str(plan.num_samples),
        "data": data,
        "model": model_structure(model),
        "modules": module_settings(model),
        "optimizer": class_name(optimizer),
        "optimizer_settings": optimizer_settings(optimizer),
        "scheduler": class_name(scheduler),
        "scheduler_settings": scheduler_settings(scheduler),
        "grad_scaler": class_name(grad_scaler),
        "extras": json.dumps(sorted(str(name) for name in extras or {}), separators=(",", ":")),
        "before_update": callable_name(before_update),
        "code": code,
        "initial_state": tree_digest(model.state_dict()),
        "torch": torch.__version__,
    }
    for name, value in (flags or {}).items():
        if name not in NAMES or name in values:
            raise ValueError(f"{name!r} is not a fingerprint flag (see membership/fingerprint.py)")
        values[name] = value
    return JobFingerprint.of({name: bounded(value) for name, value in values.items()})


def user_settings(settings: Mapping[str, Any] | argparse.Namespace) -> str:
    """The ``settings`` field: settings of the training script's own that
    every worker must share (a loss weight, a label smoothing, an AMP flag
    from its command line), as ``name=value`` words sorted by name, each
    value as compact JSON (a space inside text as ``\\u0020``, so that a
    mismatch names the words that differ). Values are numbers, text,
    booleans, None, and lists and dicts of them; anything else is a
    ``TypeError`` naming the setting, and a name that is not a non-empty
    word without ``=`` a ``ValueError``."""
    if isinstance(settings, argparse.Namespace):
        settings = vars(settings)
    if not isinstance(settings, Mapping):
        raise TypeError(
            f"settings= is a {type(settings).__name__}: give a dict of the training script's "
            "own settings, or its argparse.Namespace"
        )
    words = []
    for name in sorted(settings, key=str):
        if not isinstance(name, str) or not name or "=" in name or not name.isprintable() or (
            any(c.isspace() for c in name)
        ):  # fmt: skip
            raise ValueError(f"settings= name {name!r}: names are words without '=' or spaces")
        try:
            text = json.dumps(
                settings[name], sort_keys=True, separators=(",", ":"), allow_nan=True
            )
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"settings[{name!r}] is a {type(settings[name]).__name__}: give numbers, text, "
                "booleans, None, or lists and dicts of them (a path as text, if it must match)"
            ) from exc
        words.append(f"{name}={text.replace(' ', chr(92) + 'u0020')}")
    return " ".join(words) if words else "none"


def data_probe(reads: Sequence[Any]) -> str:
    """What a worker read of the data set: the digest of the plan's first
    microbatch as loaded (``MicrobatchLoader.probe``), the same on every
    worker that reads the same samples, whatever its rank. ``VARYING`` when
    the reads differ (augmentation from a generator the runtime does not
    seed, a sample that holds the worker process's id): such a data set
    cannot be compared this way, and every worker says so alike. Values
    that are neither tensors, arrays, numbers, text nor containers of them
    count by their class alone."""
    digests = {tree_digest(_comparable(read)) for read in reads}
    return digests.pop() if len(digests) == 1 else VARYING


def code_digests(objects: Iterable[Any], caller: str | None, script: Path | None = None) -> str:
    """The source the job runs: ``NAME=DIGEST ...`` (``none`` if empty),
    the first hex digits of the SHA-256 of the source of each module that
    ``caller`` (the module that constructs ``Elastic``) names, that
    defines the class of one of ``objects`` or any of its bases (a
    function: its own module), or that was imported from a file of a
    project these come from (``project_root``: of ``script``, the
    directory of the caller's file, and of each defining module's file; a
    loss in a module beside the script, or in the package of a ``src/``
    layout the script's project installs in editable mode), but installed
    packages there; in order of name. Python's own modules, torch's and
    rollcall's are left out. A module without source (typed in, or loaded
    from bytecode alone) reads ``nosource``. Comments count: the same file
    gives the same digest on every host, another version of it another."""
    names = {caller} if caller else set()
    for obj in objects:
        names.update(_defining_modules(obj))
    names = {n for n in names if _user_code(n)}
    roots = {project_root(script)} if script is not None else set()
    for name in names:
        file = _own_file(name)
        if file is not None:
            roots.add(project_root(file.parent))
    names.update(_imported_from(roots))
    return " ".join(f"{n}={_source_digest(n)}" for n in sorted(names)) or NONE


def project_root(directory: Path) -> Path:
    """The project ``directory`` belongs to: its nearest ancestor (itself
    included) that holds one of ``_PROJECT_MARKS``, else ``directory``."""
    for candidate in (directory, *directory.parents):
        if any((candidate / mark).exists() for mark in _PROJECT_MARKS):
            return candidate
    return directory


def _user_code(module: str) -> bool:
    return module.partition(".")[0] not in _NOT_USER_CODE


def _own_file(name: str) -> Path | None:
    """Module ``name``'s file, resolved, unless it is an installed package's
    or the interpreter's (a console script in the environment's ``bin``,
    whose first line names the environment's path)."""
    file = getattr(sys.modules.get(name), "__file__", None)
    if not isinstance(file, str):
        return None
    path = Path(os.path.realpath(file))
    if _INSTALLED & set(path.parts) or any(path.is_relative_to(p) for p in _interpreter_dirs()):
        return None
    return path


@functools.cache
def _interpreter_dirs() -> tuple[Path, ...]:
    """Where this interpreter keeps its own modules and scripts."""
    paths = sysconfig.get_paths()
    keys = ("stdlib", "platstdlib", "purelib", "platlib", "scripts")
    return tuple({Path(os.path.realpath(paths[k])) for k in keys if k in paths})


def _imported_from(roots: Collection[Path]) -> set[str]:
    """The modules imported so far from files under one of ``roots``, but
    installed packages (a virtual environment kept there)."""
    if not roots:
        return set()
    found = set()
    for name, module in list(sys.modules.items()):
        # ``python -m rollcall``: ``__main__`` is rollcall's own module.
        spec = getattr(getattr(module, "__spec__", None), "name", None)
        if not _user_code(spec if isinstance(spec, str) else name):
            continue
        path = _own_file(name)
        if path is not None and any(path.is_relative_to(root) for root in roots):
            found.add(name)
    return found


def _defining_modules(obj: Any) -> set[str]:
    """The modules that define ``obj``'s code: a function's own (a bound
    method's, a partial's target's), else those of its class's bases."""
    while isinstance(obj, functools.partial):
        obj = obj.func
    obj = getattr(obj, "__func__", obj)
    if inspect.isfunction(obj):
        return {obj.__module__} if isinstance(obj.__module__, str) else set()
    if obj is None:
        return set()
    return {c.__module__ for c in type(obj).__mro__ if isinstance(c.__module__, str)}


def _source_digest(name: str) -> str:
    """The digest of module ``name``'s source file as it is on disk (an
    empty one too), else of the source ``inspect`` finds (a zip import)."""
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    try:
        if isinstance(file, str) and file.endswith(".py"):
            source = Path(file).read_bytes()
        elif module is not None:
            source = inspect.getsource(module).encode("utf-8", "surrogatepass")
        else:
            return "nosource"
    except (OSError, TypeError):
        return "nosource"
    return hashlib.sha256(source).hexdigest()[:_CODE_DIGEST]


def _comparable(obj: Any) -> Any:
    """``obj`` as a tree ``tree_digest`` takes: containers of dense tensors
    and scalars; anything else as the name of its class."""
    if isinstance(obj, torch.Tensor):
        dense = obj.layout == torch.strided and not obj.is_quantized
        return obj if dense else f"<tensor {obj.layout}>"
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return "bytes:" + hashlib.sha256(obj).hexdigest()
    if isinstance(obj, Mapping):
        return {_key(k): _comparable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_comparable(item) for item in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _comparable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return [class_name(obj), fields]
    if type(obj).__module__ == "numpy" and hasattr(obj, "dtype"):
        import numpy

        try:  # an array or a numpy scalar of a numeric type
            return torch.from_numpy(numpy.ascontiguousarray(numpy.asarray(obj)))
        except TypeError:
            pass
    return f"<{class_name(obj)}>"


def _key(key: Any) -> Any:
    scalar = key is None or isinstance(key, (bool, int, float, str))
    return key if scalar else f"<{class_name(key)}>"  # never a repr: it may hold an address


def class_name(obj: Any) -> str:
    """``torch.optim.adamw.AdamW``; ``none`` for None."""
    if obj is None:
        return NONE
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def callable_name(fn: Any) -> str:
    """``train.clip`` for a function (``main.<locals>.clip`` for one defined
    in ``main``), the class's name for a callable object; ``none`` for None.
    The same in every process that runs the same script; its module's
    source is compared in ``code`` (:func:`code_digests`), the values it
    closes over are not compared."""
    if fn is None:
        return NONE
    name = getattr(fn, "__qualname__", None)
    if isinstance(name, str) and getattr(fn, "__module__", None) is not None:
        return f"{fn.__module__}.{name}"
    return class_name(fn)


def model_structure(model: torch.nn.Module) -> str:
    """Names, dtypes, shapes and kinds (trainable, frozen, buffer) of every
    entry of the state_dict, in order (the order the runtime's flat
    gradient and the optimizer's state follow): a summary a person can
    read and the digest of the whole list."""
    lines = []
    elements = 0
    for name, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.nn.Parameter):
            kind = "trainable" if tensor.requires_grad else "frozen"
        else:
            kind = "buffer"
        if isinstance(tensor, torch.Tensor):
            elements += tensor.numel()
            lines.append(f"{name} {tensor.dtype} {tuple(tensor.shape)} {kind}")
        else:  # a module's extra state
            lines.append(f"{name} {type(tensor).__qualname__}")
    structure = hashlib.sha256("\n".join(lines).encode("utf-8", "surrogatepass")).hexdigest()
    return f"{len(lines)} tensors, {elements:,} elements, sha256:{structure}"


def module_settings(model: torch.nn.Module) -> str:
    """The class and settings of every module, in order, which the
    parameters' shapes do not show (a dropout rate, a norm's eps or
    momentum, an activation, a module without parameters): torch's own
    modules by their public attributes (``p``, ``eps``, ``norm_first``, an
    activation function by name), any other module by its
    ``extra_repr()``, the text torch prints for it (its own attributes may
    hold anything, a path or a process id). A count and the digest of the
    whole list."""
    lines = []
    for name, module in model.named_modules():
        cls = type(module)
        words = [name, cls.__qualname__, module.extra_repr()]
        if cls.__module__.startswith("torch."):
            for key, value in sorted(vars(module).items()):
                if key.startswith("_") or key == "training":
                    continue
                if callable(value) and not isinstance(value, torch.nn.Module):
                    words.append(f"{key}={callable_name(value)}")
                elif value is None or isinstance(value, (bool, int, float, str, tuple)):
                    words.append(f"{key}={_text(value)}")
        lines.append(" ".join(words))
    digest = hashlib.sha256("\n".join(lines).encode("utf-8", "surrogatepass")).hexdigest()
    return f"{len(lines)} modules, sha256:{digest}"


def optimizer_settings(optimizer: torch.optim.Optimizer) -> str:
    """Hyperparameters of the parameter groups (not the parameters) as
    ``name=value`` words: those every group shares once, those that vary
    per group as ``g<i>.name=value``, after ``groups=<n>``."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return _settings(groups)


def scheduler_settings(scheduler: Any) -> str:
    """The LR scheduler's public state at construction (its settings and
    position) as ``name=value`` words; ``none`` without a scheduler."""
    if scheduler is None:
        return NONE
    state = scheduler.state_dict()
    return _settings([{k: v for k, v in state.items() if not str(k).startswith("_")}])


def _settings(groups: list[dict[str, Any]]) -> str:
    if not groups:
        return "groups=0"
    names = sorted({str(k) for group in groups for k in group})
    texts = [{str(k): _text(v) for k, v in group.items()} for group in groups]
    shared = [n for n in names if len({t.get(n) for t in texts}) == 1 and n in texts[0]]
    words = [] if len(groups) == 1 else [f"groups={len(groups)}"]
    words += [f"{name}={texts[0][name]}" for name in shared]
    for index, text in enumerate(texts):
        words += [f"g{index}.{n}={text[n]}" for n in names if n not in shared and n in text]
    return " ".join(words)


def _text(value: Any) -> str:
    """Canonical text of a hyperparameter: floats by ``repr`` (shortest
    round trip), sequences in parentheses, tensors by value or digest, other
    objects by class (never by ``repr``, which may hold an address)."""
    if value is None or isinstance(value, (bool, int)):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return value if value.isidentifier() else json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(_text(item) for item in value) + ")"
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return f"tensor({_text(value.item())})"
        return f"tensor:{tree_digest(value)[: 7 + _SHORTENED_DIGEST]}"
    if isinstance(value, Mapping):
        items = sorted((str(k), _text(v)) for k, v in value.items())
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    return f"<{type(value).__qualname__}>"


def bounded(value: str) -> str:
    """``value`` as printable ASCII of at most ``MAX_VALUE_LENGTH``
    characters: escaped if needed, and if still too long, cut and ended with
    the first digits of the whole value's SHA-256 (so that two long values
    differing after the cut still differ)."""
    if not VALUE_PATTERN.fullmatch(value):
        value = value.encode("unicode_escape").decode("ascii")
    if len(value) <= MAX_VALUE_LENGTH:
        return value
    tail = " ..." + hashlib.sha256(value.encode()).hexdigest()[:_SHORTENED_DIGEST]
    return value[: MAX_VALUE_LENGTH - len(tail)] + tail
