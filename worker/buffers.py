"""Buffers updated in the forward pass, kept identical on every replica.

BatchNorm's running statistics change with every training forward pass, on
each rank from its own microbatches. Left alone, replicas drift apart: the
same weights then give a different validation loss depending on which rank
saves the model, and because the state digest covers buffers, every view
change makes survivors fetch the whole state again.

So each committed step ends with every rank holding the same buffers: the
change of each buffer during the step travels in the step's all-reduce
(no extra collective), and every rank applies the same combination:

* floating-point buffers (running mean and variance) move by the average of
  the ranks' changes weighted by how many microbatches each ran —
  ``before + sum(n_r * delta_r) / sum(n_r)``: a convex combination of what
  the ranks computed, so it stays stable whatever the split; a buffer that
  no rank changed keeps its exact value;
* integer buffers (``num_batches_tracked``) move by the sum of the ranks'
  changes, which is exactly what one process running every microbatch would
  count.

This is not bit-identical between world sizes; the exact mode
(``rollcall.worker.exact``) is. A step that is not committed restores the buffers
of the last committed step, so an aborted step leaves no trace in them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rollcall.membership.errors import UsageError

__all__ = ["BufferSync"]


class _Slot(NamedTuple):
    """Where a buffer lives: a forward pass may assign a new tensor to it
    (``self.mean = 0.9 * self.mean + ...``), so it is looked up there."""

    name: str  # as in the model's state_dict
    owner: torch.nn.Module
    attr: str
    form: tuple[torch.dtype, torch.device, torch.Size]


class _Unsaved(NamedTuple):
    """A buffer registered with ``persistent=False``, and its version
    counter when ``BufferSync`` was built."""

    name: str
    tensor: torch.Tensor
    version: int


class BufferSync:
    """The persistent buffers of ``model`` that are kept in step."""

    def __init__(self, model: torch.nn.Module) -> None:
        persistent = model.state_dict(keep_vars=True)
        self._slots: list[_Slot] = []
        self._unsaved: list[_Unsaved] = []
        for name, buffer in model.named_buffers():
            if name not in persistent:
                # Not part of the state: never compared, never sent; so it
                # must not be state (a statistic the forward pass updates).
                self._unsaved.append(_Unsaved(name, buffer, buffer._version))
                continue
            if not (buffer.is_floating_point() or _is_integer(buffer)):
                raise ValueError(
                    f"buffer {name} has dtype {buffer.dtype}: the runtime keeps only "
                    "floating-point and integer buffers identical across replicas; pass "
                    "sync_buffers=False to keep buffers per replica (digests then differ and "
                    "every view change fetches the whole state)"
                )
            owner_name, _, attr = name.rpartition(".")
            form = (buffer.dtype, buffer.device, buffer.shape)
            self._slots.append(_Slot(name, model.get_submodule(owner_name), attr, form))
        self._committed = [buffer.detach().clone() for buffer in self._live()]

    def _live(self) -> list[torch.Tensor]:
        """The buffers the model holds now, in order."""
        live: list[torch.Tensor] = []
        for slot in self._slots:
            buffer = slot.owner._buffers.get(slot.attr)
            form = None if buffer is None else (buffer.dtype, buffer.device, buffer.shape)
            if buffer is None or form != slot.form:
                raise UsageError(
                    f"buffer {slot.name} was replaced by {_describe(buffer)} (it was of "
                    f"{_describe_form(slot.form)} when Elastic was built): the runtime keeps "
                    "each buffer identical across replicas and sends it to joiners in the form "
                    "it had then. Keep its dtype, device and shape (assign a new tensor of the "
                    "same form, or change it in place)"
                )
            live.append(buffer)
        return live

    def check_unsaved(self) -> None:
        """Refuse a buffer kept out of the state that was changed in place
        since construction: a running statistic no joiner or checkpoint
        would get, and each replica's following its own microbatches."""
        for unsaved in self._unsaved:
            if unsaved.tensor._version != unsaved.version:
                raise UsageError(
                    f"buffer {unsaved.name} is not persistent (registered with "
                    "persistent=False) and was changed in place since Elastic was built (by a "
                    "forward pass): it is not in the model's state_dict, so a worker that joins "
                    "and a checkpoint never get it, and each replica's copy follows its own "
                    "microbatches. If it is state, register it persistent (the default): the "
                    "runtime then keeps it identical on every replica and hands it to joiners; "
                    "if it is a cache that does not depend on the data, fill it before Elastic "
                    "is built; sync_buffers=False keeps every buffer per replica"
                )

    def __len__(self) -> int:
        return len(self._slots)

    def contributions(self, weight: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's changes since the last commit, to be summed over the
        view: ``weight`` (its microbatch count) times the change for floating
        buffers, the change for integer ones, all as ``dtype`` (integer
        changes are small counts, exact in any float type)."""
        self.check_unsaved()
        out = []
        for buffer, before in zip(self._live(), self._committed, strict=True):
            delta = buffer.detach().to(torch.float64) - before.to(torch.float64)
            if buffer.is_floating_point():
                delta = delta * weight
            out.append(delta.to(dtype).reshape(-1))
        return out

    def apply(self, summed: list[torch.Tensor], total_weight: int) -> None:
        """Set every buffer from the view's summed contributions; they become
        the new committed values."""
        live = self._live()
        for buffer, before, change in zip(live, self._committed, summed, strict=True):
            if buffer.is_floating_point():
                # In float64 and back: a buffer nobody changed (a zero sum)
                # keeps its exact bits.
                moved = (change.to(torch.float64) / total_weight).reshape(buffer.shape)
                value = (before.to(torch.float64) + moved).to(buffer.dtype)
            else:
                value = before + change.round().to(buffer.dtype).reshape(buffer.shape)
            with torch.no_grad():
                buffer.copy_(value)
        self._committed = [buffer.detach().clone() for buffer in live]

    def rollback(self) -> None:
        """Undo what the forward passes of an uncommitted step did."""
        with torch.no_grad():
            for buffer, before in zip(self._live(), self._committed, strict=True):
                buffer.copy_(before)

    def current(self) -> list[torch.Tensor]:
        """Copies of the buffers as they are now (exact mode keeps each
        microbatch's)."""
        self.check_unsaved()
        return [buffer.detach().clone() for buffer in self._live()]

    def committed(self) -> list[torch.Tensor]:
        """The buffers as of the last commit, in order (not copies: read only)."""
        return list(self._committed)

    def set_committed(self, values: list[torch.Tensor]) -> None:
        """Set every buffer to ``values`` (in order); they become the new
        committed values."""
        live = self._live()
        with torch.no_grad():
            for buffer, value in zip(live, values, strict=True):
                buffer.copy_(value)
        self._committed = [buffer.detach().clone() for buffer in live]

    def committed_state(self) -> dict[str, torch.Tensor]:
        """The buffers as of the last commit, by state-dict name (what a
        replica serves while a step may be half done)."""
        pairs = zip(self._slots, self._committed, strict=True)
        return {slot.name: before.clone() for slot, before in pairs}

    def reset(self) -> None:
        """The model's buffers were replaced (state restored): they are the
        committed values now."""
        self._committed = [buffer.detach().clone() for buffer in self._live()]


def _describe_form(form: tuple[torch.dtype, torch.device, torch.Size]) -> str:
    dtype, device, shape = form
    return f"{dtype} on {device}, shape {list(shape)}"


def _describe(buffer: torch.Tensor | None) -> str:
    return (
        "None"
        if buffer is None
        else f"one of {_describe_form((buffer.dtype, buffer.device, buffer.shape))}"
    )


def _is_integer(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool
