"""Exact mode: a step's update depends on its samples alone, not on how many
ranks ran it or which rank ran which microbatch (``docs/exactness.md``).

Floating-point addition is not associative, so the default reduction (each
rank sums its microbatches' gradients in turn, gloo sums the ranks' partial
sums in an order of its own) gives last-bit differences between world sizes,
and Adam turns the rounding noise of gradients that are truly zero into full
steps. Here the sum is formed where order cannot matter:

* each microbatch's gradients are kept apart (``took``; the backward pass of
  one microbatch on identical weights and inputs is the same computation on
  every rank);
* one all-reduce (MAX) agrees, per parameter tensor, on the largest binary
  exponent any microbatch of the step reached;
* every microbatch gradient becomes a fixed-point integer at that tensor's
  scale (``int64``, rounded half to even), chosen so that the sum of all the
  step's microbatches cannot overflow: integer addition is exact, so the
  local sums and the all-reduce (SUM) of them are the same whatever the split;
* the integer sum goes back to floating point once, divided by the global
  count, with IEEE rounding: the same bits on every rank and in every run.

The error against the exact real sum is at most half a unit of the scale per
microbatch: ``|error| <= M * 2**(e - B - 1)`` for ``M`` microbatches, ``B =
62 - ceil(log2 M)`` and ``2**e`` above the tensor's largest microbatch
gradient, i.e. about ``2**-63`` relative to that largest value (far below a
float32 ulp of it); values of the tensor more than ~2**38 times smaller than
its largest lose relative precision (a float sum would lose them too).

Buffers updated in the forward pass (BatchNorm's running statistics) are
handled the same way: every microbatch runs from the step's starting buffers,
its result is kept, the results travel bit for bit (each microbatch's row has
one contributor, and integer addition of a value and zeros is exact) and
every rank combines them in microbatch order: floating-point buffers become
the mean of the microbatches' results (as if the global batch were one
batch), integer ones add up the microbatches' changes.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from rollcall.membership.errors import UsageError
from rollcall.worker.buffers import BufferSync

__all__ = [
    "MIN_EXPONENT",
    "NO_EXPONENT",
    "ExactStep",
    "Reduced",
    "fingerprint_value",
    "fixed_point",
    "fixed_point_bits",
]

#: Exponent of a tensor no microbatch gave a nonzero gradient.
NO_EXPONENT = -(2**62)
#: Exponents are clamped here: the scale ``2**(B - e)`` must stay a finite
#: float64 (``B - e <= 1023``); gradients below ``2**-961`` round to zero.
MIN_EXPONENT = -961

#: Reduces tensors in place across the view with "max" or "sum".
Reduce = Callable[[Sequence[torch.Tensor], str], None]


def fingerprint_value(enabled: bool) -> str:
    """The job fingerprint's ``exact`` field: ``false``, or ``true`` with
    what a microbatch's gradient bits depend on besides the job's settings
    (the torch build, the intra-op thread count, the machine, the
    instruction set torch picked its CPU kernels for), so that a
    worker that cannot give the same bits is refused at join, naming them,
    instead of silently breaking the job's exactness."""
    if not enabled:
        return "false"
    parts = [f"torch {torch.__version__}", f"{torch.get_num_threads()} intra-op threads",
             platform.machine(), f"CPU {torch.backends.cpu.get_cpu_capability()}",
             *_numeric_settings()]  # fmt: skip
    return f"true ({', '.join(parts)})"


def _numeric_settings() -> list[str]:
    """The process's torch settings that change a kernel's bits and are
    not torch's defaults (named only then, so that the field of workers
    with the defaults stays what it was)."""
    found = []
    if (precision := torch.get_float32_matmul_precision()) != "highest":
        found.append(f"float32 matmul precision {precision}")
    if torch.are_deterministic_algorithms_enabled():
        found.append("deterministic algorithms")
    if not torch.backends.mkldnn.enabled:
        found.append("oneDNN off")
    # CPU only, as exact mode is verified: a GPU's TF32 and cuDNN switches
    # belong here when it is verified on one.
    return found


def fixed_point_bits(microbatches: int) -> int:
    """``B``: every quantised value is at most ``2**B`` in magnitude, so the
    sum of ``microbatches`` of them stays below ``2**62`` (no int64 overflow)."""
    return 62 - max(0, (microbatches - 1).bit_length())


def exponent(tensor: torch.Tensor) -> tuple[int, bool]:
    """The binary exponent ``e`` with ``|x| < 2**e`` for every element (or
    ``NO_EXPONENT`` for all zeros), and whether any element is not finite."""
    if tensor.numel() == 0:
        return NO_EXPONENT, False
    low, high = torch.aminmax(tensor.detach())  # one pass, no |x| copy
    largest = max(-float(low), float(high))
    if not math.isfinite(largest):
        return NO_EXPONENT, True
    if largest == 0.0:
        return NO_EXPONENT, False
    return max(math.frexp(largest)[1], MIN_EXPONENT), False


def fixed_point(grad: torch.Tensor, shift: int) -> torch.Tensor:
    """``round(grad * 2**shift)`` as int64, flattened (half to even).

    Scaling by a power of two is exact, so a float32 gradient is scaled and
    rounded in float32 when the factor is a float32 number (the integer is
    then the same as through float64, at half the memory traffic)."""
    flat = grad.detach().reshape(-1)
    if flat.dtype == torch.float32 and -126 <= shift <= 127:
        scaled = flat * math.ldexp(1.0, shift)
    else:
        scaled = flat.to(torch.float64) * math.ldexp(1.0, shift)
    return scaled.round_().to(torch.int64)


def _bits(values: torch.Tensor) -> torch.Tensor:
    """float64 values as their int64 bit patterns (sent bit for bit)."""
    return values.to(torch.float64).contiguous().view(torch.int64)


def _floats(bits: torch.Tensor) -> torch.Tensor:
    return bits.contiguous().view(torch.float64)


@dataclass
class _Microbatch:
    """What one microbatch of the step left: its gradients (None: the
    parameter got none), buffers after its forward pass, loss and count."""

    grads: list[torch.Tensor | None]
    buffers: list[torch.Tensor]
    loss: float
    count: int


@dataclass
class Reduced:
    """A step reduced in exact mode, to be applied (under the runtime's
    update lock) or dropped."""

    count: int
    loss: float
    params: list[torch.nn.Parameter]
    grads: list[torch.Tensor]
    sync: BufferSync | None
    buffers: list[torch.Tensor] | None
    #: A rank asked, in this reduction, that the view's members stop after
    #: the step (a roll call held only for joiners waits for it).
    stop: bool = False
    #: The maxima over the ranks of the caller's ``also_max`` entries.
    also_max: tuple[int, ...] = ()
    #: Per parameter, whether a microbatch of some rank gave it a gradient.
    used: tuple[bool, ...] = ()

    def apply(self) -> None:
        for p, grad in zip(self.params, self.grads, strict=True):
            p.grad = grad
        if self.sync is not None and self.buffers is not None:
            self.sync.set_committed(self.buffers)


class ExactStep:
    """This rank's microbatches of the current step, kept apart and reduced
    so that the result does not depend on the split.

    Used by the runtime's ``Step``: ``begin`` when a step is handed out,
    ``start`` before each microbatch, ``took`` after each ``step.backward``
    and ``reduce`` at commit.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        buffers: BufferSync | None,
        microbatches: int,
    ) -> None:
        self._params = list(params)
        self._buffers = buffers
        self._microbatches = microbatches
        self._bits = fixed_point_bits(microbatches)
        self._taken: dict[int, _Microbatch] = {}
        #: The zero gradients ``took`` left for the next pass, with their
        #: version counters: one still the same took no part in that pass.
        self._fresh: list[tuple[torch.Tensor, int]] = []
        #: Whether some microbatch gradient of the step being reduced is not finite.
        self._nonfinite = False

    def begin(self, keep: Collection[int] = ()) -> None:
        """A new step, or the same step again after an abort, keeping the
        microbatches ``keep`` of that attempt (each is kept apart, so any of
        them is exactly what running it again would give)."""
        self._taken = {i: taken for i, taken in self._taken.items() if i in keep}
        if not self._taken:
            self._fresh = []  # not kept alive between steps: a gradient's memory

    def start(self) -> None:
        """Before each microbatch: it runs from the step's buffers (those of
        the last commit)."""
        if self._buffers is not None:
            self._buffers.rollback()

    def took(self, index: int, loss: float, count: int) -> None:
        """After a backward pass of microbatch ``index``: keep its gradients
        apart (the parameters' ``.grad`` starts from zero for the next one)
        and the buffers its forward pass left."""
        if not 0 <= index < self._microbatches:
            raise UsageError(
                "in exact mode step.backward() must be called inside "
                "`for batch in step.microbatches()`, once or more per microbatch"
            )
        grads: list[torch.Tensor | None] = []
        fresh = self._fresh if len(self._fresh) == len(self._params) else []
        for i, p in enumerate(self._params):
            grad = p.grad
            untouched = bool(fresh) and grad is fresh[i][0] and grad._version == fresh[i][1]
            grads.append(None if grad is None or untouched else grad.detach())
        # Fresh zero gradients, not None: a change made to them before the
        # commit (clip_grad_norm_, zero_grad) is then seen and refused by
        # the runtime's GradientWatch, as in default mode.
        self._fresh = []
        for p in self._params:
            p.grad = torch.zeros_like(p)
            self._fresh.append((p.grad, p.grad._version))
        buffers = self._buffers.current() if self._buffers is not None else []
        earlier = self._taken.get(index)
        if earlier is not None:  # a second backward pass of the same microbatch
            for i, grad in enumerate(grads):
                before = earlier.grads[i]
                if before is not None:
                    grads[i] = before if grad is None else before + grad
            loss, count = earlier.loss + loss, earlier.count + count
        self._taken[index] = _Microbatch(grads, buffers, loss, count)

    def reduce(self, reduce: Reduce, stop: bool = False, also_max: Sequence[int] = ()) -> Reduced:
        """Reduce the step across the view with ``reduce`` (two collectives:
        a MAX of exponents, a SUM of integers; ``stop``, this rank asks the
        view's members to stop after the step, rides on the MAX, and the
        result's ``stop`` says whether any rank asked; so do the caller's
        ``also_max`` integers, whose maxima the result carries, and whether
        any rank's microbatch gave each parameter a gradient). The result's
        ``apply`` sets every parameter's ``.grad`` (in its dtype) to the
        step's gradient divided by the global count, and the buffers to
        their combination; its ``used`` says which parameters a microbatch
        gave a gradient (the runtime drops the others' ``.grad``).
        Raises whatever ``reduce`` raises (the step is then not applied), and
        ``UsageError`` if the global count is not positive."""
        n = len(self._params)
        tail = torch.tensor([int(stop), *self._present(), *also_max], dtype=torch.int64)
        exponents = torch.cat([self._exponents(), tail])
        reduce([exponents], "max")
        end = len(exponents) - len(also_max)
        maxima = tuple(int(e) for e in exponents[end:])
        used = tuple(bool(int(e)) for e in exponents[end - n : end])
        exponents = exponents[: end - n]
        scales = [int(e) for e in exponents[:-2]]
        self._nonfinite = bool(int(exponents[-2]))
        stopped = bool(int(exponents[-1]))
        payload = self._payload(scales)
        reduce(payload, "sum")
        counts, losses, present = payload[-3], _floats(payload[-2]), payload[-1]
        count = int(counts.sum())
        if count <= 0:
            raise UsageError(
                f"the step's global sample count is {count}: step.backward must be given "
                "the number of samples (or tokens) its loss sums over"
            )
        loss = 0.0
        for index in range(self._microbatches):  # in microbatch order
            if int(present[index]):
                loss += float(losses[index])
        grads = [
            self._gradient(summed, e, count, self._nonfinite).to(p.dtype).reshape(p.shape)
            for p, e, summed in zip(self._params, scales, payload[:n], strict=True)
        ]
        buffers = self._combined(payload[n:-3], present) if self._buffers is not None else None
        self._taken.clear()
        self._fresh = []
        return Reduced(
            count, loss, self._params, grads, self._buffers, buffers, stopped, maxima, used
        )

    # --- the parts --------------------------------------------------------------

    def _present(self) -> list[int]:
        """Per parameter tensor, 1 if one of this rank's microbatches gave
        it a gradient (zeros count: the parameter took part)."""
        return [
            int(any(taken.grads[i] is not None for taken in self._taken.values()))
            for i in range(len(self._params))
        ]

    def _exponents(self) -> torch.Tensor:
        """Per parameter tensor, the largest exponent this rank's microbatches
        reached; last, 1 if any gradient is not finite."""
        out = torch.full((len(self._params) + 1,), NO_EXPONENT, dtype=torch.int64)
        out[-1] = 0
        for taken in self._taken.values():
            for i, grad in enumerate(taken.grads):
                if grad is None:
                    continue
                e, nonfinite = exponent(grad)
                if nonfinite:
                    out[-1] = 1
                out[i] = max(int(out[i]), e)
        return out

    def _payload(self, scales: Sequence[int]) -> list[torch.Tensor]:
        """The int64 tensors of the SUM: per parameter the fixed-point sum of
        this rank's microbatches; per buffer one row per microbatch of the
        step (its result, bit for bit; zeros in the rows other ranks fill);
        then per microbatch its count, loss (bits) and whether it ran here."""
        grads = []
        for i, (p, e) in enumerate(zip(self._params, scales, strict=True)):
            total: torch.Tensor | None = None
            if e != NO_EXPONENT and not self._nonfinite:  # non-finite: nothing to sum
                for index in sorted(self._taken):
                    grad = self._taken[index].grads[i]
                    if grad is not None:
                        fixed = fixed_point(grad, self._bits - e)
                        total = fixed if total is None else total.add_(fixed)
            grads.append(torch.zeros(p.numel(), dtype=torch.int64) if total is None else total)
        rows = []
        if self._buffers is not None:
            for j, start in enumerate(self._buffers.committed()):
                row = torch.zeros((self._microbatches, start.numel()), dtype=torch.int64)
                for index, taken in self._taken.items():
                    value = taken.buffers[j].reshape(-1)
                    row[index] = _bits(value) if start.is_floating_point() else value.long()
                rows.append(row)
        counts = torch.zeros(self._microbatches, dtype=torch.int64)
        losses = torch.zeros(self._microbatches, dtype=torch.float64)
        present = torch.zeros(self._microbatches, dtype=torch.int64)
        for index, taken in self._taken.items():
            counts[index], losses[index], present[index] = taken.count, taken.loss, 1
        return [*grads, *rows, counts, _bits(losses).clone(), present]

    def _gradient(self, summed: torch.Tensor, e: int, count: int, nonfinite: bool) -> torch.Tensor:
        """The step's gradient of one tensor, in float64: the exact integer
        sum back at its scale, divided by the global count."""
        if nonfinite:
            # Some microbatch overflowed: every rank sees the same inf (a
            # grad scaler then skips the step and lowers its scale).
            return torch.full(summed.shape, math.inf, dtype=torch.float64)
        if e == NO_EXPONENT:
            return torch.zeros(summed.shape, dtype=torch.float64)
        return summed.to(torch.float64) * math.ldexp(1.0, e - self._bits) / count

    def _combined(self, rows: Sequence[torch.Tensor], present: torch.Tensor) -> list[torch.Tensor]:
        """Every buffer from the microbatches' results, in microbatch order."""
        assert self._buffers is not None
        out = []
        ran = [index for index in range(self._microbatches) if int(present[index])]
        for start, row in zip(self._buffers.committed(), rows, strict=True):
            if not ran:
                out.append(start.clone())
                continue
            if start.is_floating_point():
                before = start.to(torch.float64).reshape(-1)
                change = torch.zeros_like(before)
                for index in ran:
                    change += _floats(row[index]) - before
                value = before + change / len(ran)
            else:
                before = start.long().reshape(-1)
                value = before.clone()
                for index in ran:
                    value += row[index] - before
            out.append(value.to(start.dtype).reshape(start.shape))
        return out
