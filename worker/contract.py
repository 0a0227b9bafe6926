"""The state contract: what the training loop hands the runtime, and the
guards that turn its silent misuses into clear errors.

Everything stateful in the loop must be registered with ``Elastic`` so that
it travels with the replica state (DESIGN.md, "The state contract"). The
runtime then owns the moments at which that state changes: it steps the
optimizer, the grad scaler and the LR scheduler in ``commit()``, after the
reduction. A loop that steps one of them itself as well would run it twice
(a schedule at double speed) or on a partial gradient; a scheduler attached
to the optimizer but not registered would restart on every joiner. The
guards here refuse each of those with a :class:`UsageError` that says what
to change, instead of letting the replicas drift apart.

The guards change only the objects given to them (the scheduler's class, a
step pre-hook on the optimizer) and are removed by ``release()``.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import inspect
import math
import numbers
import struct
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple, NoReturn, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from rollcall.membership.errors import UsageError
from rollcall.worker.digest import tree_digest
from rollcall.worker.reach import SCALARS, reach, scalars
from rollcall.worker.state import plain

__all__ = [
    "Agreed", "Agreement", "Agreements", "DataWatch", "GradientWatch", "HookAgreement", "Ownership",
    "ParameterWatch", "RegisteredWatch", "Stateful", "check_extras", "check_scheduler",
    "check_steps_total",
    "in_eval_mode", "learning_rates", "modes_tag", "not_finite", "not_finite_names",
    "check_loss", "finite_buffers", "settings_tag", "skips_non_finite",
]  # fmt: skip


class Stateful(Protocol):
    """What user state registered with ``Elastic(state={...})`` must offer."""

    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> Any: ...


def check_extras(
    extras: Mapping[str, Any], model: torch.nn.Module | None = None, **passed: Any
) -> dict[str, Stateful]:
    """User state by name; each value needs ``state_dict`` and
    ``load_state_dict`` (ValueError/TypeError otherwise), and must not be
    what Elastic registers already: ``model`` or any of its parameters or
    buffers, or one of ``passed`` (the optimizer, the scheduler, the grad
    scaler, by argument name; UsageError)."""
    passed = {"model": model, **passed}
    held = {id(t) for t in (*model.parameters(), *model.buffers())} if model is not None else set()
    checked: dict[str, Stateful] = {}
    for name, value in extras.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"state= names must be non-empty strings, got {name!r}")
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(value, method, None)):
                raise TypeError(
                    f"state[{name!r}] ({type(value).__name__}) has no {method}(): registered "
                    "state must have state_dict() and load_state_dict(), like a torch module "
                    "or optimizer; wrap a plain value in an object that has them"
                )
        for argument, obj in passed.items():
            if obj is not None and value is obj:
                raise UsageError(
                    f"state[{name!r}] is the {argument} passed to Elastic({argument}=...), which "
                    "travels with the replica already (the runtime loads it into joiners and "
                    "checkpoints it, and owns the moments it changes): take it out of state="
                )
        if isinstance(value, torch.nn.Module) and any(
            id(t) in held for t in (*value.parameters(), *value.buffers())
        ):
            raise UsageError(
                f"state[{name!r}] holds parameters or buffers of the model, which travel with "
                "the replica already (and change in every forward pass and commit): take it out "
                "of state=; an EMA or averaged copy of the model (copy.deepcopy, AveragedModel) "
                "has tensors of its own and is fine"
            )
        checked[name] = value
    return checked


def check_steps_total(max_steps: Any, ran_to: int | None) -> None:
    """Refuse a ``job.steps(max_steps)`` call that is not a job's total
    (not an int, below 1), or that is no larger than ``ran_to``, the total
    of an earlier call that ran to its end: it has no step to hand out (an
    epoch loop kept around ``steps()`` trains the first epoch only)."""
    if isinstance(max_steps, bool) or not isinstance(max_steps, numbers.Integral):
        raise TypeError(
            f"job.steps() takes the job's total number of steps as an int, got {max_steps!r}"
        )
    if max_steps < 1:
        raise ValueError(f"job.steps() needs a total of at least 1 step, got {max_steps}")
    if ran_to is not None and max_steps <= ran_to:
        raise UsageError(
            f"job.steps({max_steps}) was called again after this worker's job.steps({ran_to}) "
            "ran to its end: steps() takes the job's total number of steps (the global step "
            "to stop before, not a count per call), so this call has no step to hand out, and "
            "an epoch loop around it trains the first epoch only. Call "
            "job.steps(epochs * steps_per_epoch) once (the runtime goes through the data set "
            "epoch after epoch) and take the epoch from the step (step.number // "
            "steps_per_epoch); a later call must ask for a larger total"
        )


def check_materialized(model: torch.nn.Module) -> None:
    """Refuse a model whose lazy modules (``nn.LazyLinear``) have not made
    their parameters yet: they have no shape, so nothing can be checked,
    reduced or sent to a joiner. A forward pass on one batch before
    ``Elastic(...)``, under the same seed on every worker, makes them."""
    lazy = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()]
            if torch.nn.parameter.is_lazy(tensor)]  # fmt: skip
    if lazy:
        raise UsageError(
            f"the model's {', '.join(lazy)} are not made yet (a lazy module's, such as "
            "nn.LazyLinear's: they get their shape from the first forward pass). Run one "
            "forward pass on a batch before Elastic(...), after the same torch.manual_seed on "
            "every worker, so that every worker starts from the same weights"
        )


def check_optimizer_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer parameter the model does not hold: the runtime
    reduces the gradients of the model's parameters only, so such a one
    would be updated with each worker's own partial gradient, and the
    replicas would part."""
    held = {id(p) for p in model.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if id(param) not in held:
                raise UsageError(
                    f"parameter {i} of the optimizer's param group {g} is not a parameter of "
                    "the model: the runtime reduces the gradients of the model's parameters, so "
                    "this one would be updated with each worker's own partial gradient and the "
                    "replicas would part. Register it in the model (an nn.Parameter attribute "
                    "of one of its modules)"
                )


def check_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose ``step`` needs a closure (``LBFGS``): it
    evaluates the loss itself, several times per update, on whatever data
    the closure reads, while the runtime calls ``step()`` once per step on
    the gradient reduced over the view."""
    try:
        parameters = inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):  # a builtin or an odd wrapper: nothing to read
        return
    closure = parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise UsageError(
            f"{type(optimizer).__name__}.step() needs a closure: it evaluates the loss itself, "
            "several times per update, while the runtime calls optimizer.step() once per step "
            "with the gradient reduced over every worker's microbatches. Use an optimizer that "
            "steps on the gradient alone (SGD, Adam, AdamW and the like)"
        )


def check_distributed_modules(model: torch.nn.Module) -> None:
    """Refuse, at construction, modules that reduce over a torch.distributed
    process group of their own: the runtime creates none of its own as the
    default, and its groups follow the job's members. ``SyncBatchNorm``
    without a default group normalizes each microbatch by its own
    statistics and says nothing (the port asked for statistics over the
    workers' batches), and with a default group the user made it reduces
    over members that are not the job's; ``DistributedDataParallel`` and
    FSDP reduce the gradients themselves, before the runtime does again."""
    for name, module in model.named_modules():
        label = f"{name or 'the model'} ({type(module).__name__})"
        if isinstance(module, torch.nn.SyncBatchNorm):
            raise UsageError(
                f"{label} computes its batch statistics over torch.distributed's default "
                "process group, which rollcall does not create: without one it normalizes each "
                "microbatch by that microbatch's statistics alone, saying nothing, and with one "
                "made by the script it reduces over processes that are not the job's members. "
                "Build it as a BatchNorm (drop convert_sync_batchnorm): each microbatch is then "
                "normalized by its own statistics, as in a single process that accumulates "
                "gradients, and the running statistics are averaged over the workers at every "
                "step (Elastic(sync_buffers=True), the default)"
            )
        wrappers = {f"{c.__module__}.{c.__name__}" for c in type(module).__mro__}
        if "torch.nn.parallel.distributed.DistributedDataParallel" in wrappers or any(
            w.startswith("torch.distributed.fsdp.") for w in wrappers
        ):
            raise UsageError(
                f"{label}: the model is wrapped in DistributedDataParallel or FSDP, which "
                "reduce the gradients over a process group of their own during backward: "
                "rollcall reduces them again over the job's members, whose process groups it "
                "builds and rebuilds itself. Pass the module itself to Elastic (ddp.module), "
                "without the wrapper or init_process_group; for sharded optimizer state use "
                "Elastic(shard_redundancy=...)"
            )


#: What to do about a sparse gradient, in every refusal of one.
_DENSE = (
    "the runtime sums dense gradients over the workers and cannot carry a sparse one. Build "
    "the embedding with sparse=False (its gradient is then a dense tensor the size of its "
    "weight) and train it with an optimizer of dense gradients (Adam or AdamW in place of "
    "SparseAdam)"
)


def check_dense_gradients(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse, at construction, what makes sparse gradients: a module built
    with ``sparse=True`` (``nn.Embedding``, ``nn.EmbeddingBag``) that has a
    trainable parameter, and ``SparseAdam``, which takes nothing else (the
    reduction packs dense gradients; a sparse one failed inside it with
    torch's "reshape is not implemented for sparse tensors")."""
    for name, module in model.named_modules():
        if getattr(module, "sparse", False) is True and any(
            p.requires_grad for p in module.parameters(recurse=False)
        ):
            raise UsageError(
                f"{name or 'the model'} ({type(module).__name__}) was built with sparse=True, "
                f"so its gradient is a sparse tensor: {_DENSE}"
            )
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise UsageError(f"SparseAdam takes only sparse gradients: {_DENSE}")


def refuse_sparse_gradients(named: Mapping[str, torch.nn.Parameter], step: int) -> None:
    """After a backward pass of ``step``: refuse a gradient that is not a
    dense tensor (an embedding's ``sparse`` set after construction, or
    ``F.embedding(..., sparse=True)`` in a model's own code)."""
    for name, param in named.items():
        grad = param.grad
        if grad is not None and grad.layout is not torch.strided:
            raise UsageError(
                f"step {step}: the gradient of {name} is sparse ({grad.layout}): {_DENSE}"
            )


class ParameterWatch:
    """The model's parameters as ``Elastic`` was built with them: the
    runtime reduces, transfers and checkpoints those Parameter objects, in
    that dtype, on that device, and reduces the gradients of those that
    required grad then. :meth:`check` (every step, before the reduction)
    refuses any change the loop made since, each of which would be silently
    wrong: a parameter frozen since would stay among those reduced (in a
    sharded job updated with a zero gradient); one unfrozen, added
    or put in another's place (a rebuilt layer) would be updated with this
    worker's own partial gradient, and the replicas would part; a dtype or
    device changed (``model.double()``, ``.to()``) no longer matches what
    the runtime reduces into and what a joiner is built with.

    Every step costs one pass over the parameters (requires_grad and dtype:
    about 0.1 ms per 1000 tensors here). A parameter or module registered
    on one of the model's modules is seen at once, by torch's global
    registration hooks (held until :meth:`release`); everything else (a
    removed parameter, a device or shape changed) at the steps ``full``
    is asked for."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._built = [
            (name, param, param.requires_grad, _form(param))
            for name, param in model.named_parameters()
        ]
        modules = {id(m) for m in model.modules()}
        #: A registration on one of the model's modules since the last check.
        self._touched = False

        def touched(module: torch.nn.Module, *_: object) -> None:
            if id(module) in modules:
                self._touched = True

        hooks = torch.nn.modules.module
        self._hooks = [
            hooks.register_module_parameter_registration_hook(touched),
            hooks.register_module_module_registration_hook(touched),
        ]

    def check(self, step: int, full: bool = False) -> None:
        if self._touched or full:
            params = list(self._model.parameters())
            if len(params) != len(self._built) or any(
                now is not then for now, (_, then, _, _) in zip(params, self._built, strict=False)
            ):
                self._refuse_other(step)
            self._touched = False  # the same Parameters registered again
        for name, param, trainable, form in self._built:
            if param.requires_grad is not trainable:
                verb = "unfrozen" if param.requires_grad else "frozen"
                raise UsageError(
                    f"step {step}: parameter {name!r} was {verb} (requires_grad set to "
                    f"{param.requires_grad}) after Elastic was built; the runtime reduces, "
                    "checks and transfers the parameters that required grad then, so this one "
                    "would "
                    + ("be updated with this worker's own partial gradient"
                       if param.requires_grad else
                       "stay among them (in a sharded job updated with a zero gradient: weight "
                       "decay, momentum)")
                    + ". Set requires_grad before building Elastic; to freeze parameters for "
                    "a while, keep them trainable in a param group of their own and set its "
                    "lr to 0 (and back)"
                )  # fmt: skip
            if param.dtype is not form[0] or (full and _form(param) != form):
                raise UsageError(
                    f"step {step}: parameter {name!r} changed "
                    f"{_change(form, _form(param))} after Elastic was built (model.to(), .half(), "
                    ".double(), or a new .data); the runtime reduces, transfers and "
                    "checkpoints the parameters as they were then. Convert the model before "
                    "building Elastic"
                )

    def release(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _refuse_other(self, step: int) -> None:
        built = {name: param for name, param, _, _ in self._built}
        now = dict(self._model.named_parameters())
        what = [f"{n!r} was added" for n in now if n not in built]
        what += [f"{n!r} was removed" for n in built if n not in now]
        what += [
            f"{n!r} was replaced by another Parameter"
            for n, p in now.items() if n in built and p is not built[n]
        ]  # fmt: skip
        if not what:  # the same Parameters under other names: moved between modules
            what = ["the model's parameters were rearranged"]
        listed = "; ".join(what[:4]) + (f"; and {len(what) - 4} more" if len(what) > 4 else "")
        raise UsageError(
            f"step {step}: the model's parameters changed after Elastic was built: {listed}. "
            "The runtime reduces, transfers and checkpoints the Parameters the model held "
            "then, so a new one would be updated with this worker's own partial gradient and "
            "the replicas would part. Give the model every layer before building Elastic; to "
            "re-initialise a layer, write into its parameters in place (under "
            "torch.no_grad(), the same on every worker)"
        )


class RegisteredWatch:
    """The registered state the loop's code may change (``state=`` objects,
    the scheduler, the grad scaler), fingerprinted cheaply: each
    ``state_dict()`` walked, its tensors taken by where their bytes are and
    their version counter (an in-place change, ``mul_`` or ``copy_``, moves
    it), its other values by content. :meth:`hold` when a step is handed out,
    :meth:`changed` at its ``commit()``: a change in between is the loop's
    code before ``commit()``, which a step aborted and handed out again runs
    twice, and which a worker that joins during the step drops.

    An object whose ``state_dict()`` hands out new tensors at each call
    (copies) cannot be fingerprinted so; it is left out, and left to the
    joiner's own check (``Elastic._land_fetch``). A change made through
    ``.data`` moves no version counter and is not seen either. Costs the
    ``state_dict()`` calls and a walk: microseconds for an EMA of a few
    dozen tensors."""

    def __init__(self, objects: Mapping[str, Any], synced: Collection[str] = ()) -> None:
        """``synced``: objects whose ``state_dict()`` waits for the device
        (a grad scaler reads its scale with ``.item()``): digested, never
        watched at every step."""
        self._objects = {name: obj for name, obj in objects.items() if obj is not None}
        watched = {n: o for n, o in self._objects.items() if n not in synced}
        once, again = self._fingerprints(watched), self._fingerprints(watched)
        self._stable = {n: o for n, o in watched.items() if once[n] == again[n]}
        self._held: dict[str, Any] = {}

    @staticmethod
    def _fingerprints(objects: Mapping[str, Any]) -> dict[str, Any]:
        return {name: _marked(obj.state_dict()) for name, obj in objects.items()}

    def digest(self) -> str:
        """A digest of the whole content of every object's state (each
        tensor's bytes hashed: ~0.06 s for 100 MB here), to compare over a
        stretch where the cheap fingerprint is not enough."""
        return tree_digest({name: obj.state_dict() for name, obj in self._objects.items()})

    def hold(self) -> None:
        """The state as the step is handed out."""
        self._held = self._fingerprints(self._stable)

    def changed(self) -> list[str]:
        """The objects changed since :meth:`hold` (none before it)."""
        if not self._held:
            return []
        now = self._fingerprints(self._stable)
        return [name for name, mark in self._held.items() if now.get(name) != mark]


#: Leaves compared as they are: immutable, so one held stays as it was.
_PLAIN = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


def _marked(tree: Any) -> Any:
    """``tree`` as a comparable copy: each tensor as where its bytes are and
    its version counter (a ``detach()``-ed view shares both with its base),
    immutable values as they are. Any other value cannot be part of a
    replica state (``digest`` refuses it when the state is captured): taken
    by identity here."""
    if isinstance(tree, torch.Tensor):
        return ("tensor", tree.data_ptr(), tree._version, tuple(tree.shape), tree.stride(),
                tree.dtype)  # fmt: skip
    if isinstance(tree, Mapping):
        return ("map", {key: _marked(value) for key, value in tree.items()})
    if isinstance(tree, list | tuple):
        return ("seq", [_marked(value) for value in tree])
    if isinstance(tree, _PLAIN):
        return tree
    return ("object", type(tree).__name__, id(tree))


def _form(param: torch.Tensor) -> tuple[torch.dtype, torch.device, tuple[int, ...]]:
    return param.dtype, param.device, tuple(param.shape)


def _change(
    then: tuple[torch.dtype, torch.device, tuple[int, ...]],
    now: tuple[torch.dtype, torch.device, tuple[int, ...]],
) -> str:
    """What differs: "from torch.float32 to torch.float64", "from cpu to cuda:0",
    "from shape [4, 8] to [8, 4]", joined by commas."""
    parts = [f"from {a} to {b}" for a, b in zip(then[:2], now[:2], strict=True) if a != b]
    if then[2] != now[2]:
        parts.append(f"from shape {list(then[2])} to {list(now[2])}")
    return ", ".join(parts)


def settings_tag(optimizer: torch.optim.Optimizer) -> int:
    """A 16-bit digest of the numeric settings of ``optimizer``'s param
    groups (lr, betas, weight decay, momentum...; not the parameters), in
    order: the same settings give the same tag in every process. The ranks
    compare the tags of the settings their last updates used (``Agreement``)."""
    parts = []
    for g, group in enumerate(optimizer.param_groups):
        for key in sorted(group):
            value = group[key]
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if key != "params" and _numeric(value):
                parts.append(f"{g}.{key}={value!r}")
    return tag16("\n".join(parts).encode())


def tag16(data: bytes) -> int:
    """A 16-bit digest of ``data``, the same in every process: what the
    ranks' agreements compare (``Agreement``)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=2).digest(), "big")


def _numeric(value: Any) -> bool:
    if isinstance(value, tuple | list):
        return all(_numeric(v) for v in value)
    return isinstance(value, bool | int | float)


def learning_rates(optimizer: torch.optim.Optimizer) -> str:
    """This rank's learning rates, for a message: "0.001" or "0.001, 0.0005"."""
    rates = []
    for group in optimizer.param_groups:
        lr = group.get("lr")
        rates.append(repr(lr.item() if isinstance(lr, torch.Tensor) else lr))
    return ", ".join(rates)


class Agreement:
    """Whether the ranks' last updates used the same optimizer settings.

    Every rank applies the same reduced gradient; one whose learning rate
    (or any other setting) differs, set from a count the loop keeps itself
    (a worker that joins or restarts counts from 0) or from anything else
    that differs by rank, parts from the others with no error. Each rank
    adds the tag (``settings_tag``) of the settings its previous update
    used to the step's reduction, none if it did not apply that update
    itself (it loaded the state): in the float64 SUM of the default and
    overlapped modes as (1, t, t²), whose sums (n, s, q) are all equal
    exactly when n·q = s² (exact in float64: t < 2**16); in exact mode's
    int64 MAX as (t, -t), all equal when the two maxima are opposite.
    Every rank sees the same sums, so every rank decides alike."""

    #: The MAX entries of a rank that adds no tag: below any tag.
    NONE_MAX = (-1, -(1 << 17))

    @staticmethod
    def sum_terms(tag: int | None) -> list[float]:
        return [0.0, 0.0, 0.0] if tag is None else [1.0, float(tag), float(tag * tag)]

    @staticmethod
    def agreed_sums(n: float, s: float, q: float) -> bool:
        return n == 0 or n * q == s * s

    @staticmethod
    def max_terms(tag: int | None) -> list[int]:
        return list(Agreement.NONE_MAX) if tag is None else [tag, -tag]

    @staticmethod
    def agreed_maxima(most: int, least_negated: int) -> bool:
        return most < 0 or most == -least_negated


class HookAgreement:
    """Whether the ranks' last updates applied the same gradients after
    ``before_update``.

    Every rank gives its ``before_update`` the same reduced gradient. A hook
    that differs between workers (another clip norm from a worker's command
    line, noise drawn from a generator each rank seeds its own way) makes
    them apply other updates, and the replicas part with no error: the
    job's fingerprint names the hook, not the values it closes over. Each
    rank that ran the hook takes a probe of the gradients it left
    (:meth:`probe`: the norms of a strided sample of every gradient, summed,
    ~64 elements a tensor) and adds it to the next step's reduction, as
    ``Agreement`` adds its tag: in the float64 SUM of the default and
    overlapped modes as (1, p, p²), whose sums (n, s, q) say the probes
    agree when n·q − s² ≤ (``SPREAD`` · s)² / n: one rank a relative
    ``SPREAD`` off the others is seen, whatever the world size (machines of
    other kinds round the same computation apart by ~1e-7; a clip norm that
    differs by a per mille is seen whenever it clips);
    in exact mode's int64 MAX as (h, −h) of a 16-bit digest of the probe's
    bits, which exact mode makes equal on every rank. A probe that is not
    finite (a grad scaler's overflow step) counts as none; sums that
    overflow (probes past ~1e150) judge nothing."""

    #: The relative spread of the ranks' probes taken as agreement.
    SPREAD = 1e-3
    #: Elements of each gradient the probe takes, about.
    ELEMENTS = 64

    @staticmethod
    def probe(params: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The probe of ``params``' gradients, a float64 scalar on their
        device (not read here: on an accelerator that would wait for it);
        None without gradients."""
        samples = []
        for param in params:
            grad = param.grad
            size = 0 if grad is None else grad.numel()
            if grad is None or not size:
                continue
            stride = max(1, size // HookAgreement.ELEMENTS)
            # One view, not a reshape and a slice: ~100 us a step for 30 tensors.
            samples.append(
                grad.as_strided(((size + stride - 1) // stride,), (stride,))
                if grad.is_contiguous() else grad.reshape(-1)[::stride]
            )  # fmt: skip
        if not samples:
            return None
        norms = torch._foreach_norm(samples)
        device = norms[0].device
        return torch.stack([n.to(device) for n in norms]).sum(dtype=torch.float64)

    @staticmethod
    def read(probe: torch.Tensor | None) -> float | None:
        """The probe as a number, None if there is none or it is not finite."""
        if probe is None:
            return None
        value = float(probe.item())
        return value if math.isfinite(value) else None

    @staticmethod
    def sum_terms(probe: float | None) -> list[float]:
        return [0.0, 0.0, 0.0] if probe is None else [1.0, probe, probe * probe]

    @staticmethod
    def agreed_sums(n: float, s: float, q: float) -> bool:
        if n == 0:
            return True
        # n·q − s² is n² times the probes' variance: one probe a relative d
        # off the others' makes it about (d·s)²/n, whatever n.
        spread, bound = n * q - s * s, (HookAgreement.SPREAD * s) ** 2 / n
        # Probes past 1e150 overflow the squares: nothing can be said then.
        return not (math.isfinite(spread) and math.isfinite(bound)) or spread <= bound

    @staticmethod
    def max_terms(probe: float | None) -> list[int]:
        """``Agreement.max_terms`` of a 16-bit digest of the probe's bits."""
        if probe is None:
            return Agreement.max_terms(None)
        return Agreement.max_terms(tag16(struct.pack("<d", probe)))

    agreed_maxima = staticmethod(Agreement.agreed_maxima)


def modes_tag(modules: Iterable[torch.nn.Module]) -> int:
    """A 16-bit digest of which of ``modules`` are in training mode, in
    order. The ranks compare it at every step (``Agreements``): a rank that
    evaluated (``model.eval()``) and did not call ``model.train()`` again
    trains with dropout off and batch norms on their running statistics
    while the others do not, and its gradients are averaged with theirs."""
    return tag16(bytes(m.training for m in modules))


def in_eval_mode(modules: Mapping[str, torch.nn.Module]) -> str:
    """This rank's modules in eval mode, for a message: "2 of 30 (drop, norm)"."""
    names = [name or "the model" for name, module in modules.items() if not module.training]
    return some_of(names, len(modules))


def some_of(names: Sequence[str], total: int) -> str:
    """Names for a message: "2 of 30 (head.weight, head.bias)"."""
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return f"{len(names)} of {total}" + (f" ({shown})" if names else "")


def not_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any element of ``tensors`` is NaN or infinite. One fused pass
    per device and dtype: torch's own check for a grad scaler, unscaling by
    1.0, which changes no value (~30 us for the example's 30 gradients here,
    ~5 ms for 25 M elements)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for (device, _), group in groups.items():
        found = torch.zeros(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(
            group, found, torch.ones(1, device=device)
        )
        if found.item():
            return True
    return False


def skips_non_finite(scaler: Any) -> bool:
    """Whether the grad scaler ``scaler`` skips a step whose gradient is not
    finite. One built with ``enabled=False`` (mixed precision off, or a CUDA
    scaler on a machine without CUDA) does not: its ``step()`` is the
    optimizer's, and applies whatever the gradient holds."""
    if scaler is None:
        return False
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True


#: ``at::Reduction::Mean`` and ``Sum``, as a loss function's backward node
#: saves them.
_MEAN_REDUCTION = 1
_SUM_REDUCTION = 2
_MEANS = ("MeanBackward0", "MeanBackward1")
_SUMMING = ("SumBackward0", "SumBackward1")
#: Nodes a loss's terms pass through unchanged but for a constant factor:
#: a walk from the loss goes on through these only.
_SUMS = ("AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1",
         "RsubBackward0", "RsubBackward1", "NegBackward0")  # fmt: skip
_PASSING = ("ToCopyBackward0", "CloneBackward0", "ViewBackward0", "SqueezeBackward0",
            "SqueezeBackward1", "UnsqueezeBackward0")  # fmt: skip
#: How many nodes the walk reads at most (a loss of many terms is cut short).
_LOSS_NODES = 64


class _Term(NamedTuple):
    """An autograd node of a loss, reached from the loss's own node."""

    node: Any
    path: tuple[str, ...] = ()  # the node names from the loss to it
    factors: tuple[float, ...] = ()  # the constant factors on the way

    @property
    def weight(self) -> float:
        """Its weight in the loss: the factors' product, without sign."""
        return abs(math.prod(self.factors))

    @property
    def reduction(self) -> str | None:
        """``"mean"`` or ``"sum"`` for a node that reduces so (a ``mean()``
        or ``sum()``, or a loss function's ``reduction``), else None."""
        name, saved = self.node.name(), getattr(self.node, "_saved_reduction", None)
        if name in _MEANS or saved == _MEAN_REDUCTION:
            return "mean"
        return "sum" if name in _SUMMING or saved == _SUM_REDUCTION else None

    @property
    def summed(self) -> bool:
        """A summed term: a loss function's ``reduction='sum'`` at any
        weight (a label smoothing weighs its parts), a ``sum()`` weighing 1
        or more."""
        by_loss = getattr(self.node, "_saved_reduction", None) == _SUM_REDUCTION
        return self.reduction == "sum" and (by_loss or self.weight >= 1)

    def divided_by(self, count: int) -> bool:
        """Whether a factor on the way from the loss is ``1 / count``."""
        return any(math.isclose(abs(f) * count, 1.0, rel_tol=1e-6) for f in self.factors)


def _constant(saved: Any) -> float | None:
    """A one-element factor's value; None for a tensor of more (a weighting
    per sample) or nothing saved."""
    if isinstance(saved, torch.Tensor):
        return float(saved) if saved.numel() == 1 else None
    return float(saved) if isinstance(saved, (int, float)) else None


def _factors(node: Any, name: str) -> list[tuple[Any, float]]:
    """The nodes ``node`` (named ``name``) passes its gradient to, each with
    the constant factor on the way, when ``node`` only adds, negates, casts
    or multiplies by a constant; else empty (the walk stops there)."""
    inputs = [child for child, _ in node.next_functions]
    if name in _SUMS or name in _PASSING:
        return [(child, 1.0) for child in inputs if child is not None]
    if len(inputs) == 2 and name in ("MulBackward0", "DivBackward0"):
        if inputs[0] is not None and inputs[1] is not None:
            return []  # a product of two computed terms: not a weighting
        grad, saved = (0, "_saved_other") if inputs[0] is not None else (1, "_saved_self")
        if name == "DivBackward0" and grad == 1:
            return []  # a constant divided by the loss
        factor = _constant(getattr(node, saved, None))
        if factor is None:
            return []
        return [(inputs[grad], 1.0 / factor if name == "DivBackward0" and factor else factor)]
    if name in ("MulBackward1", "DivBackward1") and inputs[0] is not None:
        factor = _constant(getattr(node, "_saved_other", None))
        if factor is None or (name == "DivBackward1" and not factor):
            return []
        return [(inputs[0], factor if name == "MulBackward1" else 1.0 / factor)]
    return []


def _loss_terms(loss: torch.Tensor) -> Iterator[_Term]:
    """The autograd nodes the loss is a weighted sum of: from the loss's own
    node through additions, casts and constant factors (``_factors``), at
    most ``_LOSS_NODES`` of them."""
    stack = [_Term(loss.grad_fn)]
    for _ in range(_LOSS_NODES):
        if not stack:
            return
        term = stack.pop()
        yield term
        name = term.node.name()
        for child, factor in _factors(term.node, name):
            stack.append(_Term(child, (*term.path, name), (*term.factors, factor)))


def _scales_by(node: Any, scale: torch.Tensor) -> bool:
    """Whether ``node`` multiplies by the grad scaler's scale tensor."""
    if node.name() != "MulBackward0":
        return False
    saved = [getattr(node, "_saved_other", None), getattr(node, "_saved_self", None)]
    return any(isinstance(t, torch.Tensor) and t.data_ptr() == scale.data_ptr() for t in saved)


def check_loss(loss: torch.Tensor, count: int, scaler: Any) -> None:
    """``step.backward(loss, count)`` wants the loss *summed* over ``count``
    samples, unscaled. Two ports get it wrong with no error, and train on
    a gradient ``count`` times too small or the scale times too large (an
    optimizer that normalises, Adam, a clip by norm, hides most of it):
    a loss averaged over the batch given with ``count`` > 1, and a loss the
    grad scaler has already scaled (``scaler.scale(loss)``; the runtime
    scales it). ``UsageError`` for both.

    The loss's autograd graph is read from its node through additions,
    negations, casts and constant factors (``_loss_terms``, a few us). It
    is refused as averaged when no term is summed (``reduction='sum'``, or
    a ``sum()`` weighing 1 or more, neither divided by ``count`` on the
    way), no mean weighs more than 1, and it holds a mean (a ``mean()``, or
    a loss function's ``reduction='mean'``) or a sum divided by ``count``
    (the mean spelled out): the mean itself, one divided by a gradient
    accumulation's count, a label-smoothed cross entropy, ``0.9 * ce + 0.1
    * mse``, a mean beside an L2 penalty, ``ce_sum / len(y)``. A mean times
    its count is admitted. So is a mean of small weight beside a summed
    term (``ce_sum + 0.01 * reg``: a weight that may already hold the
    count), a sum times a weight that is not ``1 / count``, and one halved
    with a count of 2 (``0.5 * sq_sum``, as usual for squares). Not seen: a
    mean behind any other operation, and a ``count`` that counts something
    else than the loss sums over."""
    if loss.grad_fn is None:
        return
    scale = getattr(scaler, "_scale", None)
    means: list[_Term] = []
    sums: list[_Term] = []
    for term in _loss_terms(loss):
        if isinstance(scale, torch.Tensor) and _scales_by(term.node, scale):
            raise UsageError(
                "step.backward was given a loss the grad scaler has scaled "
                "(scaler.scale(loss)): the runtime scales it itself, so this gradient would "
                f"be the scale ({float(scale):g}) times too large. Pass the loss unscaled: "
                "step.backward(loss_sum, count)"
            )
        reduction = term.reduction
        if reduction is not None and term.weight:
            (means if reduction == "mean" else sums).append(term)
    if count < 2 or any(t.weight > 1 for t in means):
        return
    # A sum divided by the count given is the mean spelled out. Not for a
    # count of 2: a half is also the usual weight of a sum of squares.
    divided = [t for t in sums if count > 2 and t.divided_by(count)]
    if any(t.summed and t not in divided for t in sums):
        return  # a summed term: any other may be weighted on purpose
    alone = len(means) + len(sums) == 1
    if means:
        heaviest = max(means, key=lambda t: t.weight)
        _refuse_averaged(heaviest, count, "averaged over its samples", alone)
    if divided:
        what = f"summed over its samples and divided by count={count}, which is their mean"
        _refuse_averaged(max(divided, key=lambda t: t.weight), count, what, alone)


def _refuse_averaged(term: _Term, count: int, what: str, alone: bool) -> NoReturn:
    """``check_loss``'s refusal of ``term``, a mean or a sum of too small a
    weight; ``alone``: the only mean or sum of the loss."""
    name, weight, mean = term.node.name(), term.weight, term.reduction == "mean"
    kind = ("a mean(), or a loss function's default reduction='mean'" if mean else
            "a sum(), or a loss function's reduction='sum'")  # fmt: skip
    where = f", weighing {weight:g}, reached through {' > '.join(term.path)}"
    share = "this" if alone else "that term" + chr(39) + "s share of the"
    other = weight if mean else weight * count  # a weight besides the count's division
    besides = "" if math.isclose(other, 1.0) else f", besides its weight of {other:.3g}"
    raise UsageError(
        f"step.backward was given a loss {what} ({name}: {kind}"
        f"{where if term.path else ''}) with count={count}: the runtime sums the losses and "
        f"divides by the step's global count, so {share} gradient would be {count} times "
        f"too small{besides}. Pass the loss summed over "
        "the microbatch (reduction='sum' and no division by the count, or each mean times "
        "its count), or count=1 to weigh every microbatch alike"
    )


def finite_buffers(model: torch.nn.Module) -> frozenset[str]:
    """The names of ``model``'s float buffers that hold no NaN or infinity
    now: those a forward pass may make not finite (a batch norm's running
    statistics). A buffer that holds one by design (a causal mask of
    ``-inf``) is left out of ``buffers_not_finite``."""
    return frozenset(
        name for name, buffer in model.named_buffers()
        if buffer.is_floating_point() and not not_finite([buffer])
    )  # fmt: skip


def buffers_not_finite(model: torch.nn.Module, finite: frozenset[str]) -> dict[str, torch.Tensor]:
    """``model``'s buffers named in ``finite`` (``finite_buffers``), by
    name, if any of them now holds NaN or infinity; else empty. One fused
    pass per dtype."""
    if not finite:
        return {}
    named = {n: b for n, b in model.named_buffers() if n in finite}
    return named if named and not_finite(named.values()) else {}


def not_finite_names(named: Mapping[str, torch.Tensor]) -> str:
    """The tensors of ``named`` holding NaN or infinity, for a message:
    "2 of 30 (head.weight, head.bias)"."""
    names = [name for name, tensor in named.items() if not bool(torch.isfinite(tensor).all())]
    return some_of(names, len(named))


class Agreed(NamedTuple):
    """Whether the ranks' last updates used the same optimizer settings
    (``Agreement``) and the same gradients after ``before_update``
    (``HookAgreement``), and whether they ran this step with the same
    modules in training mode (``modes_tag``)."""

    settings: bool
    gradients: bool
    modes: bool


class Agreements(NamedTuple):
    """What a rank adds to a step's reduction for the ranks to compare:
    the ``settings_tag`` and ``HookAgreement`` probe of its previous update
    (None where it did not apply that update itself, or ran no hook) and
    the ``modes_tag`` of this step; as float64 SUM terms (default and
    overlapped modes) or int64 MAX terms (exact mode)."""

    settings: int | None
    probe: float | None
    modes: int

    def sum_terms(self) -> list[float]:
        return [*Agreement.sum_terms(self.settings), *HookAgreement.sum_terms(self.probe),
                *Agreement.sum_terms(self.modes)]  # fmt: skip

    def max_terms(self) -> list[int]:
        return [*Agreement.max_terms(self.settings), *HookAgreement.max_terms(self.probe),
                *Agreement.max_terms(self.modes)]  # fmt: skip

    @staticmethod
    def agreed_sums(sums: Sequence[float]) -> Agreed:
        """The verdict on ``sum_terms`` summed over the ranks."""
        return Agreed(Agreement.agreed_sums(*sums[0:3]), HookAgreement.agreed_sums(*sums[3:6]),
                      Agreement.agreed_sums(*sums[6:9]))  # fmt: skip

    @staticmethod
    def agreed_maxima(maxima: Sequence[int]) -> Agreed:
        """The verdict on ``max_terms`` maximised over the ranks."""
        return Agreed(Agreement.agreed_maxima(*maxima[0:2]),
                      HookAgreement.agreed_maxima(*maxima[2:4]),
                      Agreement.agreed_maxima(*maxima[4:6]))  # fmt: skip


def check_scheduler(
    scheduler: Any, optimizer: torch.optim.Optimizer, registered: Iterable[Any] = ()
) -> None:
    """Refuse a scheduler the runtime cannot step for the user, and an LR
    scheduler attached to ``optimizer`` but not registered: neither passed
    as ``scheduler`` (nor combined in it), nor among the objects
    ``registered`` as user state."""
    if scheduler is not None:
        others = _unregistered_schedulers(optimizer, [scheduler, *registered])
        if others:
            raise UsageError(
                f"another LR scheduler ({type(others[0]).__name__}) is attached to this "
                f"optimizer besides the one passed to Elastic ({type(scheduler).__name__}): "
                "the runtime steps only the one passed, and a worker that joins gets only its "
                "state, so the other's schedule would start again from step 0 there. Combine "
                "them into one (torch.optim.lr_scheduler.SequentialLR for a warm-up then a "
                "decay, ChainedScheduler for both at once), pass that as scheduler=, and "
                "remove the other's step() from the loop"
            )
    if scheduler is None:
        if _has_scheduler(optimizer):
            raise UsageError(
                "an LR scheduler is attached to this optimizer but was not passed to Elastic: "
                "pass it as Elastic(scheduler=...) and remove scheduler.step() from the loop; "
                "the runtime steps it after every committed step and hands its state to new "
                "workers (unregistered, a joiner's schedule would start again from step 0)"
            )
        return
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise UsageError(
            "ReduceLROnPlateau needs a metric at every step, so the runtime cannot step it: "
            "register it as state={'plateau': scheduler} and call scheduler.step(metric) "
            "yourself with a metric that is the same on every worker (Elastic.all_reduce it), "
            "after a successful commit() and before any job.busy() of that step"
        )
    for method in ("step", "state_dict", "load_state_dict"):
        if not callable(getattr(scheduler, method, None)):
            raise TypeError(f"scheduler ({type(scheduler).__name__}) has no {method}()")
    attached = getattr(scheduler, "optimizer", optimizer)
    if attached is not optimizer:
        raise UsageError("the scheduler passed to Elastic drives another optimizer")


def _unregistered_schedulers(
    optimizer: torch.optim.Optimizer, registered: Iterable[Any]
) -> list[Any]:
    """The LR schedulers built on ``optimizer`` that are neither in
    ``registered`` nor combined in one of them (``SequentialLR``,
    ``ChainedScheduler``). Found among the objects that refer to the
    optimizer (``gc.get_referrers``: ~20 ms once, at construction); a
    scheduler's instance dict stands for it once it has been made a dict
    object. Unreachable ones left in a reference cycle are collected
    before they count."""
    known = {id(part) for item in registered for part, _ in _combined_schedulers(item, None)}

    def found() -> list[Any]:
        out: list[Any] = []
        for referrer in gc.get_referrers(optimizer):
            if isinstance(referrer, dict):
                if referrer.get("optimizer") is not optimizer:
                    continue
                owners = [o for o in gc.get_referrers(referrer)
                          if getattr(o, "__dict__", None) is referrer]  # fmt: skip
            else:
                owners = [referrer]
            for owner in owners:
                if (
                    isinstance(owner, torch.optim.lr_scheduler.LRScheduler)
                    and id(owner) not in known
                    and all(owner is not o for o in out)
                ):
                    out.append(owner)
        return out

    if not found():
        return []
    gc.collect()  # rare: then a scheduler left unreachable does not count
    return found()


def _has_scheduler(optimizer: torch.optim.Optimizer) -> bool:
    # Every torch LRScheduler wraps its optimizer's step() to count calls and
    # marks the wrapper: the mark says a scheduler was built on it.
    return bool(getattr(optimizer.step, "_wrapped_by_lr_sched", False))


def loaded_checked(name: str, obj: Stateful, given: Any) -> None:
    """``obj.load_state_dict(given)``, refusing registered state whose
    ``load_state_dict`` did not restore what ``state_dict`` gives (a field
    forgotten in a state class): a worker that joins or resumes would keep
    its own value of it, and the replicas would part with no error.

    Compared in memory, not by digest (a load is on a joiner's way into
    its first step: ~25 ms for 100 MB of tensors here, against ~150 ms for
    two SHA-256 passes): tensors by dtype, shape and value (NaN where NaN),
    other values by type and value, both sides in the form a captured
    state holds (``state.plain``: an IntEnum restored as such is its int).
    The containers given are copied first, not their tensors (a
    ``load_state_dict`` may consume what it is given)."""
    expected = plain(given, name)
    obj.load_state_dict(given)
    found = plain(obj.state_dict(), name)
    if _same_state(found, expected):
        return
    differing = ""
    if isinstance(found, dict) and isinstance(expected, dict):
        keys = sorted({*found, *expected}, key=str)
        names = [repr(k) for k in keys if k not in found or k not in expected
                 or not _same_state(found[k], expected[k])]  # fmt: skip
        differing = f" (at {', '.join(names)})"
    raise UsageError(
        f"state[{name!r}]: after load_state_dict, its state_dict() differs from the state "
        f"loaded into it{differing}. A worker that joins or resumes from a checkpoint would "
        "keep its own value there, and the replicas would part with no error. Make "
        "load_state_dict restore everything state_dict returns"
    )


def _same_state(a: Any, b: Any) -> bool:
    """Whether two state trees hold the same: lists and tuples alike, as
    the state's digest takes them."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype and a.shape == b.shape
            and (a is b or torch.equal(a, b) or _same_nan(a, b))
        )  # fmt: skip
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
            and all(_same_state(a[key], b[key]) for key in a)
        )  # fmt: skip
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (
            isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
            and all(map(_same_state, a, b))
        )  # fmt: skip
    return type(a) is type(b) and _same(a, b)


def _same_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal but for NaNs in the same places (``torch.equal`` says NaN is
    never equal)."""
    if not a.is_floating_point() and not a.is_complex():
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


class DataWatch:
    """The settings the data set and the collate function keep (numbers,
    text and flags among their attributes, a few levels down:
    ``rollcall.worker.reach``), as the job's loading saw them when
    ``Elastic`` was built, compared at every commit.

    A loop that changes one later (a curriculum kept in the data set:
    ``dataset.difficulty = 2`` at step 1000) reaches only part of the
    job's samples: the loader's worker processes hold copies made when they
    started, a worker that joins builds its own data set, and a plain
    loop's data loader would have taken the change at its next epoch. The
    step is refused before its reduction. Settings that loading itself
    changes (a counter a ``__getitem__`` keeps, when loading runs in this
    process) are not watched: :meth:`loaded` drops those the data probe's
    loads changed."""

    def __init__(self, dataset: Any, collate: Any) -> None:
        self._roots = (("", dataset), ("collate", collate))
        self._settings = self._read()
        #: What :func:`scalars` read when nothing watched had changed: while
        #: it reads the same, nothing is compared path by path (~40 µs for
        #: 200 settings, against ~0.5 ms).
        self._last = scalars([root for _, root in self._roots])

    def _read(self) -> dict[str, Any]:
        return {path or "the data set": value for path, value in reach(self._roots)
                if isinstance(value, SCALARS)}  # fmt: skip

    def loaded(self) -> None:
        """After loads in this process: stop watching what they changed."""
        now = self._read()
        self._settings = {p: v for p, v in self._settings.items() if _same(now.get(p, _GONE), v)}
        self._last = scalars([root for _, root in self._roots])

    def check(self, step: int) -> None:
        """Raise ``UsageError`` if a watched setting has another value now
        (one that is gone, or no longer a number or text, is not compared:
        a file handle opened on first use)."""
        quick = scalars([root for _, root in self._roots])
        if quick == self._last:  # a list compares each item's identity first: NaN too
            return
        now = self._read()
        self._last = quick  # kept only if nothing watched changed (below)
        for path, value in self._settings.items():
            if path in now and not _same(now[path], value):
                where = f"collate function's {path[8:]}" if path.startswith("collate.") else (
                    f"data set's {path}")  # fmt: skip
                raise UsageError(
                    f"step {step}: the {where} changed from {value!r} to {now[path]!r} after "
                    "Elastic was built. The loader's worker processes hold copies of the data "
                    "set made when they started, and a worker that joins builds its own, so the "
                    "change would reach only part of the job's samples, with no error. Make "
                    "each sample a function of its index alone (a schedule by step belongs in "
                    "the loop, from step.number); if loading itself changes it, pass "
                    "data_probe=False on every worker"
                )


_GONE = object()


def _same(a: Any, b: Any) -> bool:
    return bool(a == b) or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


class Ownership:
    """The runtime's ownership of ``optimizer.step``, ``scheduler.step`` and
    the grad scaler's ``unscale_``, ``step`` and ``update``: calls from
    anywhere but :meth:`applying` raise :class:`UsageError`.

    The optimizer is guarded by a step pre-hook (torch's own API). The
    scheduler's class is swapped for a subclass whose ``step`` checks: a
    scheduler's ``state_dict`` is its instance ``__dict__``, so patching an
    attribute on the instance would end up in the state. So are the classes
    of the schedulers it combines (``SequentialLR``'s and
    ``ChainedScheduler``'s ``_schedulers``), which it steps itself.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        params: Iterable[torch.nn.Parameter] = (),
        scaler: Any = None,
    ) -> None:
        self._optimizer = optimizer
        self._scheduler = scheduler
        self._inside = False
        self._hook = optimizer.register_step_pre_hook(self._optimizer_step)
        #: The model's parameters, which no other optimizer may step.
        self._held = {id(p) for p in params}
        self._others_hook = register_optimizer_step_pre_hook(self._other_optimizer_step)
        #: Each scheduler whose class was swapped, with its own class.
        self._swapped: list[tuple[Any, type]] = []
        self._stepped = _schedule_position(scheduler)
        for part, whole in _combined_schedulers(scheduler, None):
            self._guard(part, whole)
        if scaler is not None:
            self._guard_scaler(scaler)

    def _guard_scaler(self, scaler: Any) -> None:
        """Guard the grad scaler's ``unscale_``, ``step`` and ``update`` (an
        AMP loop's lines kept in a port)."""
        self._swap_guarded(
            scaler, ("unscale_", "step", "update"),
            lambda name: (
                f"scaler.{name}() was called in the training loop, but this grad scaler is "
                "registered with Elastic(grad_scaler=...): commit() unscales the gradient "
                "reduced over every worker, steps the optimizer through the scaler and updates "
                "its scale. Remove scaler.unscale_(), scaler.step() and scaler.update() from "
                "the loop (clip in before_update: the gradient it is given is unscaled "
                "already), and give step.backward the loss unscaled"
            ),
        )  # fmt: skip

    def _guard(self, scheduler: Any, whole: Any) -> None:
        """Guard ``scheduler``'s ``step``; ``whole``: the registered
        scheduler that combines it, if it is not that one."""
        what = (
            "this scheduler is registered with Elastic(scheduler=...)" if whole is None else
            f"this scheduler ({type(scheduler).__name__}, part of the registered "
            f"{type(whole).__name__}) is stepped by it"
        )  # fmt: skip
        self._swap_guarded(
            scheduler, ("step",),
            lambda _: (
                f"scheduler.step() was called in the training loop, but {what}, which the "
                "runtime steps after every committed step: remove scheduler.step() from the "
                "loop (stepping it twice would run the schedule at double speed)"
            ),
        )  # fmt: skip

    def _swap_guarded(self, obj: Any, names: Sequence[str], refusal: Callable[[str], str]) -> None:
        """Swap ``obj``'s class for a subclass whose methods ``names``
        raise ``UsageError(refusal(name))`` when called from outside
        :meth:`applying` (an instance attribute would end up in a
        scheduler's ``state_dict``, its ``__dict__``). A class that refuses
        the swap is left as it is (a scheduler's is checked at commit)."""
        original = type(obj)
        ownership = self

        def guarded(name: str) -> Callable[..., Any]:
            def call(this: Any, *args: Any, **kwargs: Any) -> Any:
                if not ownership._inside:
                    raise UsageError(refusal(name))
                return getattr(original, name)(this, *args, **kwargs)

            return call

        namespace: dict[str, Any] = {name: guarded(name) for name in names}
        namespace.update(__module__=original.__module__, __qualname__=original.__qualname__)
        with contextlib.suppress(TypeError):
            obj.__class__ = type(original.__name__, (original,), namespace)
            self._swapped.append((obj, original))

    def _optimizer_step(self, *_: Any) -> None:
        if not self._inside:
            raise UsageError(
                "optimizer.step() was called in the training loop: step.commit() applies "
                "the update after summing the gradients over every worker; remove "
                "optimizer.step() (and zero_grad()) from the loop"
            )

    def _other_optimizer_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """(Every optimizer's step in the process.) Another optimizer that
        holds parameters of the model, stepped outside the runtime's update
        (inside it, an optimizer the registered one steps itself)."""
        if optimizer is self._optimizer or self._inside or not self._held:
            return
        shared = sum(1 for group in optimizer.param_groups for p in group["params"]
                     if id(p) in self._held)  # fmt: skip
        if shared:
            raise UsageError(
                f"another optimizer ({type(optimizer).__name__}) holds {shared} of the model's "
                "parameters and was stepped in the training loop: Elastic steps only the "
                "optimizer passed to it, in commit(), after summing the gradients over every "
                "worker. Stepped before commit() this one would apply this worker's partial "
                "gradient, so the replicas part; after it, the gradients are gone with the "
                "runtime's update, so its parameters would not train; and its state would "
                "not travel to a worker that joins. Pass one optimizer that holds every "
                "parameter (param groups; for two algorithms, one torch.optim.Optimizer "
                "whose step() steps both), or freeze its parameters (requires_grad=False) "
                "if they should not train"
            )

    @contextlib.contextmanager
    def applying(self) -> Iterator[None]:
        """The runtime's own update: optimizer, scaler and scheduler steps."""
        self._inside = True
        try:
            yield
        finally:
            self._inside = False

    def check_schedule(self) -> None:
        """Before an update: the scheduler has not moved since the runtime
        last stepped it (stepped through another object, or a class that
        could not be guarded)."""
        position = _schedule_position(self._scheduler)
        if position != self._stepped:
            raise UsageError(
                f"the registered scheduler moved from step {self._stepped} to {position} "
                "outside step.commit(): the runtime steps it after every committed step; "
                "remove scheduler.step() from the loop"
            )

    def step_scheduler(self) -> None:
        """Step the registered scheduler (after the optimizer's step)."""
        if self._scheduler is not None:
            with self.applying():
                self._scheduler.step()
            self._stepped = _schedule_position(self._scheduler)

    def loaded(self) -> None:
        """The scheduler's state was replaced (state restored)."""
        self._stepped = _schedule_position(self._scheduler)

    def release(self) -> None:
        """Give the objects back as they were."""
        self._hook.remove()
        self._others_hook.remove()
        for guarded, original in self._swapped:
            guarded.__class__ = original
        self._swapped = []


def _combined_schedulers(scheduler: Any, whole: Any) -> Iterator[tuple[Any, Any]]:
    """``scheduler`` (with the registered ``whole`` that combines it, None
    for the registered one) and, depth first, the schedulers it combines."""
    if scheduler is None:
        return
    yield scheduler, whole
    for part in getattr(scheduler, "_schedulers", ()):
        yield from _combined_schedulers(part, scheduler if whole is None else whole)


class ShardedStateGuard:
    """In a job with sharded optimizer state the user's optimizer holds none
    of it (each rank's part lives in ``rollcall.worker.sharded``): its
    ``state_dict()`` would lack every moment and ``load_state_dict()`` would
    be ignored, so both raise :class:`UsageError` unless the runtime itself
    calls them (``allowed``). Torch's own hooks, removed by ``release``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._inside = False
        self._hooks = [
            optimizer.register_state_dict_pre_hook(self._saving),
            optimizer.register_load_state_dict_pre_hook(self._loading),
        ]

    def _saving(self, *_: Any) -> None:
        if not self._inside:
            raise UsageError(
                "optimizer.state_dict() was called, but the optimizer state is sharded across "
                "the workers (Elastic(shard_redundancy=...)): the optimizer object holds none of "
                "it, so a checkpoint of it would silently restart the moments. Let the runtime "
                "write checkpoints (checkpoint_dir=), which gather the whole state"
            )

    def _loading(self, *_: Any) -> None:
        if not self._inside:
            raise UsageError(
                "optimizer.load_state_dict() was called, but the optimizer state is sharded "
                "across the workers (Elastic(shard_redundancy=...)): it would be ignored. The "
                "runtime loads the job's checkpoints itself"
            )

    @contextlib.contextmanager
    def allowed(self) -> Iterator[None]:
        """The runtime's own capture or restore of the optimizer."""
        self._inside = True
        try:
            yield
        finally:
            self._inside = False

    def release(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _schedule_position(scheduler: Any) -> int | None:
    """How far a scheduler has been stepped, where it says (torch's
    schedulers count in ``last_epoch``)."""
    position = getattr(scheduler, "last_epoch", None)
    return position if isinstance(position, int) else None


class GradientWatch:
    """Notices gradients changed between ``step.backward()`` and
    ``step.commit()``.

    Between them a gradient is this rank's partial sum over its own
    microbatches: clipping it (``clip_grad_norm_``), scaling it or zeroing it
    there gives a result that depends on how the step was split, without any
    error. Every in-place change bumps a tensor's version counter, and
    ``zero_grad`` replaces or drops the tensor, so comparing (identity,
    version) of every gradient at commit with what ``backward`` left shows
    it.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self._params = list(params)
        self._seen: list[tuple[int, int]] | None = None

    def mark(self) -> None:
        """Call right after a backward pass this runtime ran."""
        self._seen = [self._signature(p) for p in self._params]

    def forget(self) -> None:
        self._seen = None

    def before_backward(self) -> None:
        """Before a backward pass this runtime runs: raise
        :class:`UsageError` if a gradient changed since the last
        :meth:`mark` of the step, or, before its first, if one exists. A
        plain loop's ``zero_grad()`` kept at the top of the microbatch loop
        throws away the rank's earlier microbatches, which the step's count
        still includes; a gradient left by a backward pass the runtime did
        not run is added without being counted."""
        found = self._difference()
        if found == "unmarked":
            raise UsageError(
                "gradients exist before the step's first step.backward(): left by a "
                "backward pass the runtime did not run (loss.backward(), also one before "
                "the first step) or assigned to .grad, they would be added to this step's "
                "gradient without their samples being counted. Run every backward pass of "
                "a step as step.backward(loss_sum, count), inside `for batch in "
                "step.microbatches()`, and none outside the steps (or drop its gradients "
                "with model.zero_grad(set_to_none=True) before the step)"
            )
        if found == "changed":
            raise UsageError(
                "gradients were changed since the step's previous step.backward() (by "
                "zero_grad(), an assignment to .grad or an in-place operation): they hold this "
                "worker's sum over its earlier microbatches of the step (also those kept from "
                "an aborted attempt of it, which are not run again), which the step's count "
                "includes, and zeroing them would drop those microbatches from the step. The "
                "runtime zeroes the gradients after every update: remove zero_grad() from the "
                "loop (a plain loop's first line, kept in the microbatch loop or at the top of "
                "the step), and do any change to the gradients in Elastic(before_update=...), "
                "which runs on the reduced gradient"
            )

    def check(self) -> None:
        """At commit: raise :class:`UsageError` if a gradient changed since
        the last :meth:`mark` (or exists without any)."""
        found = self._difference()
        if found == "unmarked":
            raise UsageError(
                "gradients exist but step.backward() was not called in this step: call "
                "step.backward(loss_sum, count) instead of loss.backward(), so the "
                "runtime counts the samples it divides by"
            )
        if found == "changed":
            raise UsageError(
                "gradients were changed between step.backward() and step.commit() (by "
                "clip_grad_norm_, zero_grad() or an in-place operation): there they are this "
                "worker's partial sum, not the step's gradient. Do it in "
                "Elastic(before_update=...), which runs on the reduced, normalised gradient"
            )

    def _difference(self) -> Literal["unmarked", "changed"] | None:
        """``"unmarked"``: gradients exist and no :meth:`mark` was made
        since the last :meth:`forget`; ``"changed"``: they differ from the
        last mark; None: neither."""
        current = [self._signature(p) for p in self._params]
        if self._seen is None:
            return "unmarked" if any(sig != (0, 0) for sig in current) else None
        return "changed" if current != self._seen else None

    @staticmethod
    def _signature(param: torch.nn.Parameter) -> tuple[int, int]:
        grad = param.grad
        return (0, 0) if grad is None else (id(grad), grad._version)
