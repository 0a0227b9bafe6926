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

import torch

__all__ = ["BufferSync"]


class BufferSync:
    """The persistent buffers of ``model`` that are kept in step."""

    def __init__(self, model: torch.nn.Module) -> None:
        persistent = model.state_dict(keep_vars=True)
        self._buffers: list[tuple[str, torch.Tensor]] = []
        for name, buffer in model.named_buffers():
            if name not in persistent:
                continue  # not part of the state: never compared, never sent
            if not (buffer.is_floating_point() or _is_integer(buffer)):
                raise ValueError(
                    f"buffer {name} has dtype {buffer.dtype}: the runtime keeps only "
                    "floating-point and integer buffers identical across replicas; pass "
                    "sync_buffers=False to keep buffers per replica (digests then differ and "
                    "every view change fetches the whole state)"
                )
            self._buffers.append((name, buffer))
        self._committed = [buffer.detach().clone() for _, buffer in self._buffers]

    def __len__(self) -> int:
        return len(self._buffers)

    def contributions(self, weight: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's changes since the last commit, to be summed over the
        view: ``weight`` (its microbatch count) times the change for floating
        buffers, the change for integer ones, all as ``dtype`` (integer
        changes are small counts, exact in any float type)."""
        out = []
        for (_, buffer), before in zip(self._buffers, self._committed, strict=True):
            delta = buffer.detach().to(torch.float64) - before.to(torch.float64)
            if buffer.is_floating_point():
                delta = delta * weight
            out.append(delta.to(dtype).reshape(-1))
        return out

    def apply(self, summed: list[torch.Tensor], total_weight: int) -> None:
        """Set every buffer from the view's summed contributions; they become
        the new committed values."""
        for (_, buffer), before, change in zip(self._buffers, self._committed, summed, strict=True):
            if buffer.is_floating_point():
                # In float64 and back: a buffer nobody changed (a zero sum)
                # keeps its exact bits.
                moved = (change.to(torch.float64) / total_weight).reshape(buffer.shape)
                value = (before.to(torch.float64) + moved).to(buffer.dtype)
            else:
                value = before + change.round().to(buffer.dtype).reshape(buffer.shape)
            with torch.no_grad():
                buffer.copy_(value)
        self._committed = [buffer.detach().clone() for _, buffer in self._buffers]

    def rollback(self) -> None:
        """Undo what the forward passes of an uncommitted step did."""
        with torch.no_grad():
            for (_, buffer), before in zip(self._buffers, self._committed, strict=True):
                buffer.copy_(before)

    def current(self) -> list[torch.Tensor]:
        """Copies of the buffers as they are now (exact mode keeps each
        microbatch's)."""
        return [buffer.detach().clone() for _, buffer in self._buffers]

    def committed(self) -> list[torch.Tensor]:
        """The buffers as of the last commit, in order (not copies: read only)."""
        return list(self._committed)

    def set_committed(self, values: list[torch.Tensor]) -> None:
        """Set every buffer to ``values`` (in order); they become the new
        committed values."""
        with torch.no_grad():
            for (_, buffer), value in zip(self._buffers, values, strict=True):
                buffer.copy_(value)
        self._committed = [buffer.detach().clone() for _, buffer in self._buffers]

    def committed_state(self) -> dict[str, torch.Tensor]:
        """The buffers as of the last commit, by state-dict name (what a
        replica serves while a step may be half done)."""
        pairs = zip(self._buffers, self._committed, strict=True)
        return {name: before.clone() for (name, _), before in pairs}

    def reset(self) -> None:
        """The model's buffers were replaced (state restored): they are the
        committed values now."""
        self._committed = [buffer.detach().clone() for _, buffer in self._buffers]


def _is_integer(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool
