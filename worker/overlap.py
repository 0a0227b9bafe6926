"""Gradient reduction overlapped with the backward pass (``Elastic(overlap=True)``).

The parameters' gradients live in a few flat *buckets* (one dtype each, at
most ``Config.overlap_bucket_bytes``, parameters taken in reverse order of
registration, which is roughly the order backward produces them): every
``.grad`` is a view into its bucket, so autograd accumulates straight into
it and nothing is copied into a flat buffer and back. During the rank's
last backward pass of a step each parameter's post-accumulate hook marks it
done; a bucket whose parameters are all done starts its all-reduce at once
(in place, asynchronously), so the sums travel while backward computes the
rest. Buckets start in index order on every rank, whatever order their
parameters finish in, because gloo matches collectives by order: a bucket
ready early waits for the ones before it. What backward never reached (a
parameter that took no part in the forward pass) starts when the pass
returns; a rank with no microbatch in the step starts every bucket at
commit. ``commit`` waits for them all (abortable, as any collective) and
divides the sums in place.

One backward pass per microbatch: the last one's hooks start the buckets,
so a second pass in that microbatch would add to sums already under way;
it is refused (``UsageError``) before it runs. A parameter can still be
accumulated more than once inside one pass: a module run under reentrant
checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``) more
than once, or also outside it, is reached by one inner backward pass per
run. Its bucket must not start before the last of them, and nothing says
which one that is, so a worker's first pass starts no bucket before it
returns, and later passes hold back the buckets of every parameter an
earlier pass accumulated more than once (they start when the pass
returns). A repeat that no earlier pass showed (the repeats depend on the
data) and that comes after its bucket started is refused at once: the
sum under way misses it. Exact mode reduces every
microbatch's gradients as integers at commit and cannot be overlapped.
Once a step's reduction was started its gradients are no longer this
rank's own, so the runtime keeps nothing of it for a next attempt, and
after an abandoned reduction the buckets are replaced (a parked group may
still write into the old ones).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollcall.membership.errors import UsageError

__all__ = ["Buckets"]

#: Starts a bucket's all-reduce in place and returns its handle.
Launch = Callable[[torch.Tensor], Any]


@dataclass
class _Bucket:
    dtype: torch.dtype
    params: list[torch.nn.Parameter] = field(default_factory=list)
    size: int = 0
    buffer: torch.Tensor | None = None
    #: Parameters of this bucket not yet done in the armed backward pass
    #: (and ``_HELD`` while it waits for the pass to return).
    waiting: set[int] = field(default_factory=set)


#: In a bucket's ``waiting``: started only when the backward pass returns.
_HELD = -1


class Buckets:
    """The gradients of ``params`` as views into flat buckets, reduced
    bucket by bucket as the last backward pass of a step finishes them."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        cap_bytes: int,
        names: Sequence[str] | None = None,
    ) -> None:
        """``names``: the parameters' names, for messages."""
        if cap_bytes < 1:
            raise ValueError(f"the bucket size must be positive, got {cap_bytes}")
        self._buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, offset)
        open_by_dtype: dict[torch.dtype, int] = {}
        for param in reversed(list(params)):
            index = open_by_dtype.get(param.dtype)
            full = index is not None and (
                self._buckets[index].size + param.numel()
            ) * param.element_size() > cap_bytes
            if index is None or full:
                index = len(self._buckets)
                self._buckets.append(_Bucket(param.dtype))
                open_by_dtype[param.dtype] = index
            bucket = self._buckets[index]
            self._where[id(param)] = (index, bucket.size)
            bucket.params.append(param)
            bucket.size += param.numel()
        self._launch: Launch | None = None
        self._started: list[Any] = []
        self._next = 0  # the next bucket to start
        #: ids of the parameters a backward pass of this step reached.
        self._used: set[int] = set()
        #: ids of the parameters the backward pass under way reached.
        self._this_pass: set[int] = set()
        #: ids of the parameters a pass accumulated more than once.
        self._repeated: set[int] = set()
        #: Whether a backward pass has returned (its repeats are known).
        self._observed = False
        self._names = {} if names is None else dict(zip(map(id, params), names, strict=True))
        self._hooks = [p.register_post_accumulate_grad_hook(self._done) for p in params]
        self._allocate()

    @property
    def count(self) -> int:
        return len(self._buckets)

    @property
    def started(self) -> bool:
        """Whether this step's reduction has started (a bucket is under way)."""
        return self._next > 0

    def attach(self, zero: bool = True) -> None:
        """Before a step's first backward pass: every gradient a view into
        its bucket (views the optimizer or the user dropped are made again),
        the buckets zeroed unless ``zero`` is False (they hold what an
        aborted attempt of the step finished, kept)."""
        if zero:
            self._used.clear()
        for bucket in self._buckets:
            assert bucket.buffer is not None
            if zero:
                bucket.buffer.zero_()
            offset = 0
            for param in bucket.params:
                view = bucket.buffer[offset : offset + param.numel()].view_as(param)
                if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                    param.grad = view
                offset += param.numel()
        self._launch, self._started, self._next = None, [], 0
        self._this_pass.clear()

    def passed(self) -> None:
        """A backward pass returned (after :meth:`flush`, for the rank's last
        of the step): its repeats are known."""
        self._this_pass.clear()
        self._observed = True

    def arm(self, launch: Launch) -> None:
        """The next backward pass is the rank's last of the step: start each
        bucket's all-reduce (``launch``) as soon as it and those before it
        are done; in a worker's first pass, and for a parameter an earlier
        pass accumulated more than once, only when the pass returns."""
        if self._next or self._launch is not None:
            raise UsageError(
                "with overlap=True, call step.backward() once per microbatch: the last one "
                "starts the reduction of the gradients, which a second pass would add to"
            )
        self._launch = launch
        self._this_pass.clear()
        for bucket in self._buckets:
            bucket.waiting = {id(p) for p in bucket.params}
            if not self._observed or not self._repeated.isdisjoint(bucket.waiting):
                bucket.waiting.add(_HELD)

    def flush(self, launch: Launch) -> list[Any]:
        """After the last backward pass (or at commit, on a rank that ran no
        microbatch): start every bucket not started yet, in order, and return
        the handles of the step's all-reduces, in bucket order."""
        self._launch = launch
        for bucket in self._buckets[self._next :]:
            bucket.waiting = set()
        self._start_ready()
        self._launch = None
        return list(self._started)

    def present(self, params: Sequence[torch.nn.Parameter]) -> list[float]:
        """Per parameter of ``params``, 1.0 if a backward pass of this step
        on this rank reached it (its view then holds its gradient; one left
        at zero took no part)."""
        return [1.0 if id(p) in self._used else 0.0 for p in params]

    def check_views(self) -> None:
        """Every gradient still a view into its bucket (a pass that did not
        accumulate in place would have replaced it): UsageError otherwise."""
        for bucket in self._buckets:
            assert bucket.buffer is not None
            offset = 0
            for param in bucket.params:
                grad = param.grad
                expected = bucket.buffer[offset : offset + param.numel()].data_ptr()
                if grad is None or grad.data_ptr() != expected:
                    raise UsageError(
                        "a gradient was replaced between step.backward() and step.commit() "
                        "(overlap=True keeps every .grad a view into its reduction bucket): "
                        "do not assign .grad or call zero_grad() there"
                    )
                offset += param.numel()

    def replace(self) -> None:
        """New buffers (an abandoned reduction may still write the old ones
        while its group is parked)."""
        self._allocate()
        self._used.clear()
        self._this_pass.clear()
        for bucket in self._buckets:
            for param in bucket.params:
                param.grad = None
        self._launch, self._started, self._next = None, [], 0

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _allocate(self) -> None:
        for bucket in self._buckets:
            bucket.buffer = torch.zeros(bucket.size, dtype=bucket.dtype)

    def _done(self, param: torch.nn.Parameter) -> None:
        """A parameter's gradient is accumulated (autograd's hook)."""
        key = id(param)
        self._used.add(key)
        if key in self._this_pass:
            self._again(key)
        self._this_pass.add(key)
        if self._launch is None:
            return
        index, _ = self._where[key]
        self._buckets[index].waiting.discard(key)
        self._start_ready()

    def _again(self, key: int) -> None:
        """The parameter ``key`` was accumulated again in the same pass."""
        self._repeated.add(key)
        index, _ = self._where[key]
        if self._launch is not None and index < self._next:
            name = self._names.get(key, "a parameter")
            raise UsageError(
                f"with overlap=True, the gradient of {name} was accumulated again after its "
                "bucket's all-reduce had started, in the same backward pass: a module run "
                "more than once under reentrant checkpointing (torch.utils.checkpoint with "
                "use_reentrant=True, also a model library's gradient checkpointing), or both "
                "inside and outside it, adds to its gradient once per run, and no earlier pass "
                "of this worker had shown that (the runs depend on the data). The sum under "
                "way misses this part. Checkpoint with use_reentrant=False (torch's "
                "recommended setting: one pass, one addition), or train with overlap=False"
            )

    def _start_ready(self) -> None:
        launch = self._launch
        assert launch is not None
        while self._next < len(self._buckets) and not self._buckets[self._next].waiting:
            buffer = self._buckets[self._next].buffer
            assert buffer is not None
            self._started.append(launch(buffer))
            self._next += 1
