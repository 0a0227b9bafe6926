"""The keep-alive runtime inside a training process.

A user keeps an ordinary PyTorch loop and adds a few lines::

    with Elastic(model, optimizer, dataset, global_batch=32, micro_batch=8,
                 scheduler=scheduler) as job:
        for step in job.steps(1000):
            for batch in step.microbatches():
                loss_sum, count = my_loss(model, batch.inputs, batch.targets)
                step.backward(loss_sum, count)
            step.commit()

``Elastic`` joins the job through the rendezvous service, owns the step loop's
safe points and, for each committed view, builds a fresh gloo group, pulls the
current state from live peers when this worker is behind or new, and tells
each rank which microbatches of the global batch it runs. ``commit`` sums the
gradients (and sample counts, and the changes of buffers such as BatchNorm's
running statistics) over the view, divides by the step's global count, runs
the ``before_update`` hook (gradient clipping), and applies the optimizer,
grad scaler and scheduler steps; it returns False when the step was aborted by
a view change, in which case ``steps`` hands out the same step number again
once the new view is in place.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, NoReturn, TypeVar

import grpc
import torch
from torch.distributed import ReduceOp

from rollcall.membership.cause import Cause
from rollcall.membership.checkpoint import (
    MAX_PARTITIONS,
    CheckpointManifest,
    CheckpointPart,
    ReplayCost,
)
from rollcall.membership.config import Config
from rollcall.membership.errors import (
    ControlPlaneUnavailable,
    Evicted,
    Interrupted,
    InvalidRequest,
    JobRecordLost,
    NonFiniteGradient,
    ProgressLost,
    RollcallError,
    StateDrifted,
    UsageError,
    ViewChanged,
)
from rollcall.membership.member import Answer, Fence, Member
from rollcall.membership.shards import Sharding, ShardPlan, moves
from rollcall.membership.view import EMPTY_VIEW, View
from rollcall.pb import rendezvous_pb2, state_pb2_grpc
from rollcall.protocol.client import ClientTLS, RendezvousClient, RollCallAnswer
from rollcall.protocol.serving import serve
from rollcall.protocol.serving import stop as stop_metrics
from rollcall.protocol.wire import TokenInterceptor, read_token
from rollcall.worker.abort import PeerFailed, StepAborted
from rollcall.worker.bootstrap_store import host_store
from rollcall.worker.buffers import BufferSync
from rollcall.worker.checkpoint import (
    CheckpointUnusable,
    CheckpointWriter,
    describe_failure,
    describe_part,
    part_bytes,
    process_age,
)
from rollcall.worker.contract import (
    Agreed,
    Agreements,
    DataWatch,
    GradientWatch,
    HookAgreement,
    Ownership,
    ParameterWatch,
    RegisteredWatch,
    ShardedStateGuard,
    buffers_not_finite,
    check_dense_gradients,
    check_distributed_modules,
    check_extras,
    check_loss,
    check_materialized,
    check_optimizer_params,
    check_optimizer_step,
    check_scheduler,
    check_steps_total,
    finite_buffers,
    in_eval_mode,
    learning_rates,
    loaded_checked,
    modes_tag,
    not_finite,
    not_finite_names,
    refuse_sparse_gradients,
    settings_tag,
    skips_non_finite,
    some_of,
)
from rollcall.worker.digest import digest, hash_threads, tree_digest
from rollcall.worker.environment import (
    DEFAULT_NAME,
    ENV_AGENT,
    ENV_CHECKPOINT_DIR,
    ENV_JOB,
    ENV_NAME,
    ENV_RENDEZVOUS,
)
from rollcall.worker.exact import ExactStep
from rollcall.worker.exact import fingerprint_value as exact_fingerprint
from rollcall.worker.faults import (
    HELD_STATE_S,
    SLOW_ANSWER_S,
    SLOW_BUILD_S,
    SLOW_LAND_S,
    Faults,
)
from rollcall.worker.fingerprint import (
    CODE_OFF,
    DATA_OFF,
    VARYING,
    callable_name,
    code_digests,
    job_fingerprint,
    user_settings,
)
from rollcall.worker.fingerprint import data_probe as probed_data
from rollcall.worker.group import EpochGroup
from rollcall.worker.ledger import Ledger
from rollcall.worker.loader import (
    Batch,
    LoaderOptions,
    MicrobatchLoader,
    default_collate,
    seed_generators,
)
from rollcall.worker.messages import describe_transport, install_default_handler, view_change
from rollcall.worker.metrics import WorkerMetrics
from rollcall.worker.overlap import Buckets
from rollcall.worker.parking import wait_parked
from rollcall.worker.plan import DIVISION, update_seed
from rollcall.worker.randomness import ModelGenerators
from rollcall.worker.report import SupervisorReport
from rollcall.worker.resume import choose, what_restarting_does
from rollcall.worker.served import ServedState
from rollcall.worker.sharded import PartitionState, ShardedOptimizer, check_shardable
from rollcall.worker.state import CorruptState, ReplicaState, capture, restore
from rollcall.worker.state_bytes import tree_to_bytes
from rollcall.worker.switching import SwitchInterval
from rollcall.worker.transfer import Snapshot, StateFetcher, StateServer, TransferFailed

log = logging.getLogger("rollcall.worker")
T = TypeVar("T")
#: ``Elastic.all_reduce`` operations.
_REDUCE_OPS = {"sum": ReduceOp.SUM, "mean": ReduceOp.SUM, "max": ReduceOp.MAX,
               "min": ReduceOp.MIN, "product": ReduceOp.PRODUCT}  # fmt: skip


#: What a loop that trains on its own DataLoader does, in its refusals.
_OWN_LOADER = (
    "every worker would train on batches of its own, repeating the others' samples, while the "
    "step's samples were recorded as trained"
)


class Step:
    """One global step as this rank sees it.

    Attributes: ``number`` (the global step, the same on every rank and
    handed out again after an abort), ``epoch`` (the view it runs in),
    ``rank`` and ``world_size`` (this rank's place in that view), ``loss``
    (the step's mean loss over the global batch, after a successful
    ``commit``), ``committed`` and ``aborted``.
    """

    def __init__(self, job: Elastic, number: int, view: View, rank: int) -> None:
        self.number = number
        self.epoch = view.epoch
        self.rank = rank
        self.world_size = view.size
        #: Ranks that run no microbatch of this step (``Elastic._idle``).
        self.idle = job._idle(view, number)
        self._job = job
        self.started = time.monotonic()
        self._count = 0
        self._loss = 0.0
        self._microbatches = 0
        #: Index (within the step) of the microbatch handed out last.
        self._index = -1
        #: Microbatches whose loop body finished (in this attempt or kept
        #: from an aborted one), by index.
        self.done: list[int] = []
        #: Microbatches ``microbatches()`` handed out in this attempt, by index.
        self._handed: set[int] = set()
        #: The loop's body for a microbatch is running (``step.backward``
        #: belongs there).
        self._in_body = False
        #: The step's all-reduce completed (its result is in the gradients).
        self._reduced = False
        #: overlap=True: the microbatch handed out is the rank's last of the
        #: step, whose backward pass starts the buckets' all-reduces; their
        #: handles (None for one that could not start: an abort).
        self._final = False
        self._pending: list[Any] = []
        self.aborted = False
        self.committed = False
        #: ``commit()`` was called (whatever it returned): the step is done.
        self._commit_called = False
        #: Mean loss over the global batch, known after a successful commit.
        self.loss: float | None = None
        kept = job._take_carry(self)
        if job._exact is not None:
            job._exact.begin(keep=kept)
        if job._buckets is not None:
            job._buckets.attach(zero=not kept)
            if not kept:
                job._gradients.mark()  # the zeroed views are where backward starts

    def microbatches(self) -> Iterator[Batch]:
        """This rank's microbatches of the step (loaded ahead when there are
        loader workers), each handed out with torch's, ``random``'s and
        numpy's generators, and those the model holds, seeded from (seed,
        step, microbatch index) only. Those it finished before an
        abort of the same step are not handed out again. Stops early on an
        abort. Refused after ``commit()``: the step's microbatches were
        consumed (handed out again, they would be loaded, seeded and counted
        as finished once more, and a training-mode forward pass of theirs
        would move the buffers outside any step)."""
        self._refuse_after_commit("step.microbatches() after commit()")
        job = self._job
        finished = set(self.done)
        todo = [mb for mb in job.plan.for_rank(self.number, self.rank, self.world_size, self.idle)
                if mb.index not in finished]  # fmt: skip
        for mb in todo:
            if job._aborting():
                self.aborted = True
                return
            data = job._loader.get(mb.step, mb.index)
            if job._exact is not None:
                job._exact.start()
            seed_generators(mb.seed)
            job._generators.seed(mb.seed)
            self._microbatches += 1
            self._index = mb.index
            self._final = mb is todo[-1]
            self._handed.add(mb.index)
            self._in_body = True
            yield Batch(mb, data)
            self._in_body = False
            job._generators.check_after_first()
            self.done.append(mb.index)  # its loop body finished

    def backward(self, loss_sum: torch.Tensor, count: int) -> None:
        """Accumulate gradients of a loss *summed* over ``count`` samples or
        tokens (not averaged: the runtime divides by the step's global count)."""
        self._refuse_after_commit("step.backward after commit()")
        if not self._in_body:
            self._refuse_outside_loop()
        count = _check_count(count)
        job = self._job
        check_loss(loss_sum, count, job._scaler)
        job._gradients.before_backward()
        buckets = job._buckets
        if buckets is not None and self._final:
            buckets.arm(job._launcher(self))
        if job._scaler is not None:
            job._scaler.scale(loss_sum).backward()
        else:
            loss_sum.backward()
        if buckets is not None:
            if self._final:
                self._pending = buckets.flush(job._launcher(self))
            buckets.passed()
        refuse_sparse_gradients(job._named_params, self.number)
        loss = float(loss_sum.detach())
        if job._exact is not None:
            job._exact.took(self._index, loss, count)
        job._gradients.mark()
        self._count += count
        self._loss += loss

    def commit(self) -> bool:
        """Sum gradients over the view and apply the update. False if the step
        was aborted (nothing was applied; the step will be handed out again)."""
        self._refuse_after_commit("commit() was called again")
        self._commit_called = True
        self.committed = self._job._commit(self)
        return self.committed

    def _refuse_outside_loop(self) -> NoReturn:
        """``step.backward`` outside the loop's body for a microbatch."""
        once = (
            "every worker runs code outside that loop once per step, so a term given there "
            "would be in the step's gradient once per worker, as many times as there are "
            "workers. Add such a term to each microbatch's loss weighted by its count "
            "(step.backward(loss_sum + penalty * count, count) holds the penalty once per step, "
            "however the step is divided), or add its gradient in Elastic(before_update=...)"
        )
        if not self._handed and not self.done:
            raise UsageError(
                f"step {self.number}: step.backward() was called before `for batch in "
                "step.microbatches()` handed out any microbatch of the step: train each step on "
                "those microbatches, which the runtime divides among the workers, not on "
                f"batches of the script's own DataLoader ({_OWN_LOADER}); and {once}"
            )
        raise UsageError(
            f"step {self.number}: step.backward() was called outside `for batch in "
            f"step.microbatches()` (after its last microbatch): {once}. Iterate the "
            "microbatches in that loop, not over a list made of them first: the runtime seeds "
            "each and counts it as its turn comes"
        )

    def _check_microbatches_run(self) -> None:
        """At commit: every microbatch of this rank in the step was handed
        out (or kept from an aborted attempt). A loop that left
        ``microbatches()`` early (a ``break``, an error caught outside it)
        would apply the step on part of the rank's share while its samples
        were recorded as trained, and the step's gradient would depend on
        how the step was divided."""
        assigned = self._job.plan.assignment(self.number, self.world_size, self.idle)[self.rank]
        run = self._handed.union(self.done)
        if all(index in run for index in assigned):
            return
        if not run:
            raise UsageError(
                f"step {self.number}: none of this rank's {len(assigned)} microbatches of the "
                "step was run: the loop did not iterate step.microbatches() (a port that kept "
                f"its own DataLoader: {_OWN_LOADER}). "
                "Train each step on `for batch in step.microbatches()`: the runtime divides "
                "the data set among the workers (pass the DataLoader or data set to Elastic)"
            )
        raise UsageError(
            f"step {self.number}: the loop left step.microbatches() with {len(run)} of this "
            f"rank's {len(assigned)} microbatches of the step handed out (a break, a return, or "
            "an error caught outside the loop): applied, the step would hold part of its "
            "samples, the others' samples would be recorded as trained, and its gradient would "
            "depend on how the step was divided over the workers. Let `for batch in "
            "step.microbatches()` run to its end before commit()"
        )

    def _refuse_after_commit(self, what: str) -> None:
        # A second reduction would meet the others' next step's all-reduce,
        # and gradients after it would be summed into the next step's.
        if self._commit_called:
            raise UsageError(
                f"step {self.number}: {what}: each step commits once, and nothing of it runs "
                "after: commit() returned "
                f"{self.committed} ({'applied' if self.committed else 'nothing was applied'})"
                "; job.steps() hands out the next step, or this one again if it was aborted"
            )


def _group_sizes(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    return tuple(len(group["params"]) for group in optimizer.param_groups)


#: The layout of a step's reduction, in the job's fingerprint
#: (``reduction``): workers whose collectives of a step carry other terms
#: cannot reduce together. "2": with, per parameter, whether a rank gave it
#: a gradient (2026-12-07); absent: the layout before.
REDUCTION = "2"


def _totals(
    step: Step, ask: bool, agreements: Agreements, present: Sequence[float]
) -> torch.Tensor:
    """What every rank adds to a step's SUM besides the gradients and
    buffers: (count, loss, asks to stop, ``Agreements``' terms, and per
    parameter 1 if a microbatch of this rank gave it a gradient). In
    float64 (a second, tiny collective when gradients are float32): a count
    of samples or tokens stays exact up to 2**53, where float32 would round
    it above 2**24."""
    return torch.tensor(
        [float(step._count), step._loss, float(ask), *agreements.sum_terms(), *present],
        dtype=torch.float64,
    )


class _Totals(NamedTuple):
    """``_totals`` summed over the view, read."""

    samples: float  # the global count
    loss: float
    stop: bool  # some rank asked to stop after the step
    agreed: Agreed
    used: list[bool]  # per parameter: some rank's microbatch gave it a gradient


def _read_totals(totals: torch.Tensor, parameters: int) -> _Totals:
    values = totals.tolist()
    used = [v > 0 for v in values[len(values) - parameters :]]
    agreed = Agreements.agreed_sums(values[3 : len(values) - parameters])
    return _Totals(values[0], values[1], values[2] > 0, agreed, used)


def _leave_unused(params: Sequence[torch.Tensor], used: Sequence[bool]) -> None:
    """No ``.grad`` for a parameter that no microbatch of any rank gave a
    gradient in the step (a head of a task the step had no sample of, an
    expert no token was routed to, a module the forward pass skipped): the
    optimizer then leaves it alone, as a plain loop's and DDP's do, instead
    of moving it by its momentum and weight decay on a zero gradient."""
    for param, took_part in zip(params, used, strict=True):
        if not took_part:
            param.grad = None


class _Applied(NamedTuple):
    """An update this rank applied itself: its step, the ``settings_tag``
    of its optimizer settings, the ``HookAgreement.probe`` of the
    gradients ``before_update`` left (None without a hook) and its
    ``learning_rates`` (for a message)."""

    step: int
    settings: int
    probe: torch.Tensor | None
    rates: str


def _check_sharding(
    redundancy: int | None, partitions: int, optimizer: torch.optim.Optimizer, scaler: Any
) -> Sharding | None:
    """``Elastic``'s sharding options, checked: None for replicated state."""
    if redundancy is None:
        return None
    for name, value in (("shard_redundancy", redundancy), ("shard_partitions", partitions)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if scaler is not None:
        raise UsageError(
            "sharded optimizer state cannot be combined with a grad scaler (its unscale and "
            "inf check need the whole optimizer): train with shard_redundancy=None"
        )
    check_shardable(optimizer)
    return Sharding(partitions, redundancy)


def _say_replaced_handler(sig: signal.Signals, previous: Any) -> None:
    """Warn that the script's own handler of ``sig`` (a cluster script's
    save-and-requeue on SIGTERM) does not run while the job does."""
    if not callable(previous) or previous is signal.default_int_handler:
        return
    log.warning(
        "the script's %s handler (%s) is replaced while the job runs: rollcall leaves the job "
        "cleanly on %s and raises rollcall.Interrupted at the next safe point; the handler is "
        "put back when Elastic closes. To run it too, catch rollcall.Interrupted around the "
        "loop and call it there; Elastic(handle_signals=False) keeps it instead (a %s is then "
        "a crash to the other workers)",
        sig.name, callable_name(previous), sig.name, sig.name,
    )  # fmt: skip


def _check_count(count: Any) -> int:
    try:
        value = int(count)
    except (TypeError, ValueError):
        raise UsageError(f"step.backward count must be a sample count, got {count!r}") from None
    if value < 0 or value != count:
        raise UsageError(f"step.backward count must be a non-negative integer, got {count!r}")
    return value


class Elastic:
    """Data-parallel training that survives workers dying and arriving.

    Elastic is the I/O shell around ``rollcall.membership.member.Member``, the
    protocol's pure state machine: every event (a view, a roll call, an
    acknowledgement, a reduction done or failed, time) is fed to it under
    ``_state``, and the runtime does what it decides. Threads and what each
    owns:

    ============================  =========================================
    thread                        owns
    ============================  =========================================
    training (the user's)         the loop, the model's tensors between
                                  safe points, the group of the view in
                                  force (``_group``), the loader; feeds
                                  ``enter``, ``reduced``, ``fence``,
                                  ``applied``, ``failed``, ``tick``
    control (asyncio, "rollcall") the rendezvous session, the state server,
                                  ``_view``, ``_busy``; feeds ``joined``,
                                  ``view_committed``, ``roll_call``,
                                  ``session_ended``
    default executor              the digest of a roll-call answer
    digest helpers                the other hashing threads of a large
                                  state's digest (``digest.hash_threads``)
    checkpoint writer             serializing and writing a snapshot
    group build                   building the view's group while the
                                  training thread computes (``_building``,
                                  one per view; taken over by its first
                                  collective)
    group helpers                 one blocking store or gloo call each
    loader processes              reading microbatches ahead
    ============================  =========================================

    Locks: ``_state`` around each call to the machine (never held while
    waiting); ``_lock`` while an update is applied or the state restored or
    captured. The step in flight is aborted exactly while the machine's
    newest answered roll call is newer than the view it entered, two numbers
    that only grow: nothing is cleared, so no abort can be lost between two
    threads. A roll call that finds an update in flight is answered when
    ``applied`` hands its step over (``_answer_waiting``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Any,
        *,
        global_batch: int,
        micro_batch: int,
        seed: int = 0,
        scheduler: Any = None,
        grad_scaler: Any = None,
        state: Mapping[str, Any] | None = None,
        before_update: Callable[[Step], Any] | None = None,
        sync_buffers: bool = True,
        exact: bool = False,
        overlap: bool = False,
        min_workers: int = 1,
        start_over: bool = False,
        rendezvous: Sequence[str] | str | None = None,
        agent: str | None = None,
        job: str | None = None,
        token: str | None = None,
        host: str = "127.0.0.1",
        name: str | None = None,
        collate: Callable[[Sequence[Any]], Any] | None = None,
        ledger: str | Path | None = None,
        config: Config | None = None,
        tls: ClientTLS | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = 100,
        metrics_port: int | None = None,
        handle_signals: bool = True,
        messages: bool = True,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        pin_memory: bool = False,
        shard_redundancy: int | None = None,
        shard_partitions: int = 64,
        data_probe: bool = True,
        code_check: bool = True,
        settings: Mapping[str, Any] | argparse.Namespace | None = None,
        max_skipped_steps: int = 100,
    ) -> None:
        # The module that constructs the job, and the modules imported from
        # its project: their source is compared at join.
        caller = sys._getframe(1).f_globals
        if messages:
            install_default_handler()
        addresses = rendezvous if rendezvous is not None else os.environ.get(ENV_RENDEZVOUS, "")
        if isinstance(addresses, str):
            addresses = [a for a in addresses.split(",") if a]
        if not addresses:
            raise ValueError(f"no rendezvous address: pass rendezvous= or set {ENV_RENDEZVOUS}")
        #: The host agent that carries this host's sessions, if any.
        self._agent = agent or os.environ.get(ENV_AGENT) or None
        self.job_name = job or os.environ.get(ENV_JOB, "")
        if not self.job_name:
            raise ValueError(f"no job name: pass job= or set {ENV_JOB}")
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        if (
            isinstance(max_skipped_steps, bool) or not isinstance(max_skipped_steps, int)
            or max_skipped_steps < 1
        ):  # fmt: skip
            raise ValueError(f"max_skipped_steps must be an int >= 1, got {max_skipped_steps!r}")
        if isinstance(min_workers, bool) or not isinstance(min_workers, int) or min_workers < 1:
            raise ValueError(f"min_workers must be an int >= 1, got {min_workers!r}")
        if before_update is not None and not callable(before_update):
            raise TypeError("before_update must be callable (it is given the Step)")
        if exact and not sync_buffers:
            raise ValueError(
                "exact=True keeps the buffers identical on every replica: it cannot be combined "
                "with sync_buffers=False"
            )
        if exact and overlap:
            raise ValueError(
                "exact=True reduces every microbatch's gradients as integers at commit: it "
                "cannot be combined with overlap=True"
            )
        check_materialized(model)
        self._extras = check_extras(
            state or {}, model, optimizer=optimizer, scheduler=scheduler, grad_scaler=grad_scaler
        )
        check_scheduler(scheduler, optimizer, registered=self._extras.values())
        self._schedulers_rechecked = False  # at the first commit (_check_scheduler_registered)
        check_optimizer_params(model, optimizer)
        check_optimizer_step(optimizer)
        check_dense_gradients(model, optimizer)
        check_distributed_modules(model)
        self._sharding = _check_sharding(shard_redundancy, shard_partitions, optimizer, grad_scaler)
        self._token = token or read_token(None)
        self._config = config or Config()
        self._faults = Faults.from_env()
        self._report = SupervisorReport.from_env()
        self._model = model
        self._optimizer = optimizer
        self._scheduler = scheduler
        self._scaler = grad_scaler
        #: Whether the scaler skips a step whose gradient is not finite
        #: (``enabled=False``: it does not), how many steps in a row it has
        #: skipped, and how many it may.
        self._skips = skips_non_finite(grad_scaler)
        self._skipped = 0
        self._max_skipped = max_skipped_steps
        #: Steps in a row whose before_update left no gradient (``_check_gradients_kept``).
        self._dropped = 0
        #: What the loop's code may change (``_check_registered``, ``busy``).
        self._registered = RegisteredWatch({
            **{f"state {name!r}": obj for name, obj in self._extras.items()},
            "the scheduler": scheduler, "the grad scaler": grad_scaler,
        }, synced=("the grad scaler",))  # fmt: skip
        self._before_update = before_update
        self._host = host
        self._min_workers = min_workers
        self._start_over = start_over
        #: A checkpoint resumed from files etcd's record no longer names, and
        #: the other such files: published when a view resumes from it.
        self._adopted: tuple[CheckpointManifest, Sequence[CheckpointManifest]] | None = None
        self._checkpoint_every = checkpoint_every
        self.ledger = Ledger(
            Path(ledger) if ledger is not None else None,
            sync_interval=self._config.ledger_sync_interval,
            lock_wait=self._config.ledger_lock_wait,
        )
        # A DataLoader as `dataset` brings its collate_fn and worker settings.
        self._loader = MicrobatchLoader.open(
            dataset, global_batch=global_batch, micro_batch=micro_batch, seed=seed,
            collate=collate, options=LoaderOptions(
                num_workers=num_workers, prefetch_factor=prefetch_factor,
                worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
                pin_memory=pin_memory,
            ), config=self._config,
        )  # fmt: skip
        try:
            self.ledger.refuse_another_plan(self._loader.plan)
        except UsageError:
            self.ledger.close()
            raise
        # What every worker of the job must match, checked at join: taken
        # before anything trains the model.
        flags = {"min_workers": str(min_workers), "sync_buffers": str(sync_buffers).lower(),
                 "exact": exact_fingerprint(exact), "data_division": DIVISION,
                 "reduction": REDUCTION,
                 "drift_check": str(self._config.drift_check_every)}  # fmt: skip
        if overlap:
            # Absent otherwise: a job of workers from before the option matches.
            flags["overlap"] = "true"
        if settings is not None:
            flags["settings"] = user_settings(settings)  # absent otherwise, as overlap
        if self._sharding is not None:
            # Every rank takes part in gathering a checkpoint's state.
            writes = checkpoint_dir is not None or bool(os.environ.get(ENV_CHECKPOINT_DIR))
            if writes and self._sharding.count > MAX_PARTITIONS:
                raise UsageError(
                    f"shard_partitions={self._sharding.count} with checkpoints: a sharded "
                    f"checkpoint's manifest names every partition, at most {MAX_PARTITIONS}"
                )
            flags.update(self._sharding.fields(), checkpoint_every=str(checkpoint_every),
                         checkpoints="on" if writes else "off")  # fmt: skip
        # Forked loader workers must start before any socket or thread exists,
        # and must not keep the supervisor's channel open after we are gone.
        # Nor the ledger's locked file: a loader worker outliving a killed
        # worker (up to 5 s) would hold its lock, and refuse its restart.
        channel = self._report.fileno()
        self._loader.start(
            not_inherited=tuple(fd for fd in (channel, self.ledger.fileno()) if fd is not None)
        )
        #: The data set's settings, compared at every commit (off with the probe).
        self._data_watch = DataWatch(*self._loader.user_objects[:2]) if data_probe else None
        # What the workers read is compared too, read as steps read it: by
        # the loader's processes, so that this one opens none of the data
        # set's files before they fork.
        data = probed_data(self._loader.probe()) if data_probe else DATA_OFF
        if self._data_watch is not None:
            self._data_watch.loaded()
        if data == VARYING and exact:
            self._loader.close()
            self.ledger.close()
            raise UsageError(
                "exact=True: the data plan's first microbatch, read twice, gave other values: "
                "what a sample holds depends on more than its index and the generators the "
                "runtime seeds before each microbatch (torch's, random's and numpy's, and those "
                "the data set and collate function hold): the time, the process id, or a "
                "generator made in a worker_init_fn or on first use. Other histories would "
                "then compute other bits. Draw augmentation from those generators, or run "
                "without exact=True; data_probe=False on every worker skips this check and "
                "leaves the guarantee to you"
            )
        if data == VARYING:
            log.info(
                "the data plan's first microbatch read twice gave other values (augmentation "
                "from a generator the runtime does not seed, or a sample that holds the "
                "process's id): what the workers read is not compared at join"
            )
        code = CODE_OFF
        if code_check:
            module, file = caller.get("__name__"), caller.get("__file__")
            code = code_digests([
                *model.modules(), optimizer, scheduler, grad_scaler, *self._extras.values(),
                before_update, *self._loader.user_objects,
            ], module if isinstance(module, str) else None,
                Path(os.path.realpath(file)).parent if isinstance(file, str) else None,
            )  # fmt: skip
        self.fingerprint = job_fingerprint(
            model, optimizer, self._loader.plan, scheduler=scheduler, grad_scaler=grad_scaler,
            extras=self._extras, before_update=before_update, data=data, code=code, flags=flags,
        )  # fmt: skip
        self.plan = self._loader.plan
        self.member_id: str | None = None
        #: The trainable parameters by name, in the model's order.
        self._named_params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self._params = list(self._named_params.values())
        #: The model's modules, whose training modes the ranks compare at
        #: every step (``modes_tag``).
        self._named_modules = dict(model.named_modules())
        #: Random generators the model's modules hold (a custom dropout's
        #: ``torch.Generator``): seeded with torch's at every microbatch.
        self._generators = ModelGenerators(model, exact=exact)
        #: The float buffers that are finite now (``_check_buffers``).
        self._finite_buffers = finite_buffers(model)
        #: The optimizer's parameter count per group when last checked.
        self._groups_seen = _group_sizes(optimizer)
        #: The last update this rank applied itself, compared with the
        #: others' at the next reduction (``Agreement``, ``HookAgreement``).
        self._applied: _Applied | None = None
        #: The step ``steps()`` handed out and the loop runs.
        self._stepping: Step | None = None
        #: The largest ``max_steps`` of a ``steps()`` call that ran to its end.
        self._steps_ran_to: int | None = None
        self._buffers = BufferSync(model) if sync_buffers else None
        self._exact = (
            ExactStep(self._params, self._buffers, self._loader.plan.num_microbatches)
            if exact
            else None
        )
        self._gradients = GradientWatch(self._params)
        #: overlap=True: the gradients as views into buckets whose
        #: all-reduces start during the last backward pass of a step.
        self._buckets = (
            Buckets(self._params, self._config.overlap_bucket_bytes, list(self._named_params))
            if overlap
            else None
        )
        #: This rank's part of the optimizer state in a sharded job (built
        #: on entering the first view) and the view it was last moved to.
        self._sharded: ShardedOptimizer | None = None
        self._shard_view: View | None = None
        #: A sharded step landed without its all-gather (``_complete_step``).
        self._incomplete = False
        #: The step whose roll calls are answered before the loop's code
        #: after its ``commit()`` ran (``_complete_step``), until that code
        #: ran (``_loop_code_ran``).
        self._unsettled: int | None = None
        #: (step, reason, ``RegisteredWatch.digest``) when the first
        #: ``job.busy()`` after that step's commit began: roll calls are
        #: answered from then on, so that state must not change before the
        #: loop asks for the next step (``_check_loop_state``).
        self._busy_began: tuple[int, str, str] | None = None
        #: What this rank finished of an aborted step (``_set_aside``).
        self._carry: _Carry | None = None
        #: The view entered last and this rank in it.
        self._entered: tuple[View, int] = (EMPTY_VIEW, 0)
        #: A checkpoint's whole optimizer state, until the shards take it.
        self._full_optimizer: dict[str, Any] | None = None
        # Checked once before anything starts: the state must be one that
        # can travel (and this raises TypeError naming what cannot).
        self._guard = ShardedStateGuard(optimizer) if self._sharding is not None else None
        self._capture(-1, with_rng=False)
        self._ownership = Ownership(optimizer, scheduler, model.parameters(), grad_scaler)

        #: Held while an update is applied or the state restored or captured.
        self._lock = threading.Lock()
        #: The protocol's decisions (membership/member.py); ``_state`` is held
        #: for each call to it, never longer.
        self._member = Member(self._config)
        self._switching = SwitchInterval(self._config.view_change_switch_interval)
        self._state = threading.Lock()
        #: Roll calls waiting for an update in flight to land and settle (the
        #: loop's code after commit() to run), and since when (monotonic).
        self._waiting_answers: list[asyncio.Future[int | None]] = []
        self._waiting_since: float | None = None
        #: A checkpoint due at the step that landed last, captured once the
        #: step settled.
        self._due_checkpoint: _DueCheckpoint | None = None
        #: Signalled when a view arrives or a roll call starts.
        self._view_changed = threading.Condition()
        self._view: View = EMPTY_VIEW
        self._causes: dict[int, tuple[Cause, ...]] = {}
        self._previous_view: View | None = None
        #: The last step whose state the ranks compared (``_check_drift``).
        self._drift_checked = -1
        #: (Sharded.) The step at whose all-gather this rank's copies of
        #: these partitions differed from those their senders sent, and
        #: who sent each (``_publish_shards``, ``_refuse_drifted_copies``).
        self._drifted_copies: tuple[int, dict[int, str]] | None = None
        #: Busy declarations of peers: member id -> (until, reason), monotonic.
        self._busy: dict[str, tuple[float, str]] = {}
        self._interrupted = 0  # the signal that asked us to leave, if any
        #: Whether a step given up for a roll call held at its end was said.
        self._said_step_end = False
        #: A sharded job said it updates a parameter no microbatch reached.
        self._said_unused = False
        self._left = False
        #: What this worker serves to peers (the state its last roll-call
        #: answer named, or the one it fetched).
        self._served = ServedState()
        self._group: EpochGroup | None = None
        #: The group of the view entered last while it is built on a thread
        #: of its own (``_enter``): taken over by the view's first collective.
        self._building: _GroupBuild | None = None
        self._store_ports: dict[int, asyncio.Future[int]] = {}
        self._closed = False
        #: Set when this worker resumed the job from a durable checkpoint.
        self.resumed: ReplayCost | None = None
        #: In a sharded job: what entering the last view did to this rank's
        #: shards (epoch, partitions fetched, bytes, partitions held).
        self.resharded: dict[str, Any] | None = None
        self._step_seconds = 0.0  # moving average of a committed step's wall time
        self._launch_s = 0.0  # process start to joined
        self._lost_work = 0.0  # compute thrown away since the last view report
        # (epoch, fetch s, rebuild s, monotonic time the group was ready) of
        # the view entered last, until its first commit is reported.
        self._entering: tuple[int, float, float, float] | None = None
        #: This worker's state fetch for the view entered last, when it is
        #: landed at the view's first commit instead of before the view's
        #: first step (``_idle``, ``_land_fetch``).
        self._fetch_in_flight: _FetchInFlight | None = None
        self._below_minimum_said = 0
        self.metrics = WorkerMetrics() if metrics_port is not None else None
        self._metrics_server = (
            serve(self.metrics.registry, metrics_port, host)
            if self.metrics is not None and metrics_port is not None  # both: mypy narrows each
            else None
        )
        self._last_commit: tuple[int, float] | None = None  # (epoch, monotonic time)
        self._progress_epoch = 0  # the view whose first commit was reported
        self._signals: dict[int, Any] = {}
        self._joined = False

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollcall", daemon=True)
        self._thread.start()
        self._client = RendezvousClient(
            addresses, self.job_name, self._token, self._config, tls, agent=self._agent
        )
        self._fetcher: StateFetcher | None = None
        self._server: grpc.aio.Server | None = None
        self._servicer: StateServer | None = None
        if checkpoint_dir is None and os.environ.get(ENV_CHECKPOINT_DIR):
            checkpoint_dir = Path(os.environ[ENV_CHECKPOINT_DIR])
        self.checkpoints = (
            CheckpointWriter(
                Path(checkpoint_dir),
                self.job_name,
                self._publish_checkpoint,
                on_failure=self._checkpoint_failed,
                on_durable=self._checkpoint_durable,
                fingerprint=self.fingerprint,
                part_wait=self._config.collective_timeout,
            )  # fmt: skip
            if checkpoint_dir is not None
            else None
        )
        #: The parameters as built (``_check_model``); holds torch's
        #: registration hooks until ``close``.
        self._parameter_watch = ParameterWatch(model)
        if handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._signals[sig] = signal.signal(sig, self._on_signal)
                _say_replaced_handler(sig, self._signals[sig])
        try:
            self._call(self._start(name or os.environ.get(ENV_NAME) or DEFAULT_NAME))
        except BaseException:
            self._report.ended(sys.exc_info()[1])
            self._restore_signals()
            self._ownership.release()
            self._parameter_watch.release()
            if self._guard is not None:
                self._guard.release()
            self._stop_loop()
            stop_metrics(self._metrics_server)
            self._loader.close()
            self.ledger.close()
            raise
        self._joined = True

    # --- what the loop may ask ---------------------------------------------------

    @property
    def committed_step(self) -> int:
        """The last step this worker committed (or loaded): -1 before any."""
        return self._member.step

    @property
    def rank(self) -> int | None:
        """This worker's rank in the view in force (None before the first)."""
        group = self._group or self._building
        return group.rank if group is not None else None

    @property
    def world_size(self) -> int | None:
        """Members of the view in force (None before the first)."""
        group = self._group or self._building
        return group.size if group is not None else None

    @property
    def sharding(self) -> Sharding | None:
        """The partition count and redundancy of the sharded optimizer state
        (None: every worker holds all of it)."""
        return self._sharding

    def state_digest(self) -> str:
        """Digest of this replica's whole state after its last committed step
        (model parameters and buffers, optimizer, scheduler, grad scaler,
        registered state): what roll calls compare. Equal on every replica
        of a job at the same step. In a sharded job it leaves out the
        optimizer state, which no rank holds whole. A large state is hashed
        by as many threads as this process has cores."""
        with self._lock:  # nothing updates meanwhile: nothing needs cloning
            state = self._capture(self.committed_step, with_rng=False, live=True)
            return digest(state, threads=hash_threads())

    def all_reduce(self, tensors: torch.Tensor | Sequence[torch.Tensor], op: str = "sum") -> None:
        """Reduce ``tensors`` in place over the view in force ("sum", "mean",
        "max", "min", "product"), for the loop's own metrics (an evaluation
        loss summed over every rank's shard). Every rank must call it at the
        same point of its loop, from the training thread. Raises
        :class:`ViewChanged` if the membership changes or a peer fails
        meanwhile: nothing was reduced, and the step in flight is aborted
        too."""
        if op not in _REDUCE_OPS:
            raise ValueError(f"op must be one of {', '.join(_REDUCE_OPS)}, got {op!r}")
        step = self._stepping
        if step is not None and step._handed and not step._commit_called:
            # Between a step's first microbatch and its commit the ranks call
            # it unevenly (their shares of microbatches differ), and with
            # overlap a rank's gradient buckets may already be under way.
            raise UsageError(
                f"step {step.number}: job.all_reduce() was called between the step's first "
                "microbatch and its commit(): the workers run different numbers of "
                "microbatches, so they would not call it alike, and its collective would "
                "meet another's (the gradients' reduction, a bucket of it under way with "
                "overlap=True): gloo then aborts the process, or sums unrelated tensors. Call "
                "it before `for batch in step.microbatches()` or after commit() (step.loss "
                "is the step's loss over every worker already)"
            )
        items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        group = self._ready_group()
        if group is None or not group.usable or self._aborting():
            raise ViewChanged("the view is changing: no collective can run now")
        try:
            group.allreduce(items, _REDUCE_OPS[op])
        except StepAborted as exc:
            if isinstance(exc, PeerFailed):
                self._note_failure(f"epoch {group.epoch}: all_reduce", exc.reason)
            raise ViewChanged(f"all_reduce abandoned: {exc}") from None
        if op == "mean":
            for item in items:
                item.div_(group.size)

    @contextlib.contextmanager
    def busy(self, reason: str = "busy", timeout: float | None = None) -> Iterator[None]:
        """Declare that this rank will be away from collectives (evaluating,
        saving, compiling) for at most ``timeout`` seconds (default
        ``Config.busy_default``, at most ``Config.busy_max``)::

            if step.rank == 0 and step.number % 50 == 0:
                with job.busy("evaluation"):
                    evaluate(model)

        Its peers then wait for it in their collectives instead of counting
        it as failed after ``Config.collective_timeout``, and the detector
        does not suspect it for silence. A rank still busy past ``timeout``
        is treated as failed ``collective_timeout`` later.
        """
        seconds = self._config.busy_default if timeout is None else float(timeout)
        if not 0 < seconds <= self._config.busy_max:
            raise ValueError(
                f"busy timeout must be in (0, {self._config.busy_max:g}] seconds "
                f"(Config.busy_max), got {timeout!r}"
            )
        # What the loop did after commit() is done: a roll call that comes
        # while it is busy is answered at once, with the step's state.
        self._settle()
        reason = str(reason)[:200]
        if self._busy_began is None or self._busy_began[0] != self.committed_step:
            self._busy_began = (self.committed_step, reason, self._registered.digest())
        started = time.monotonic()
        self._loop.call_soon_threadsafe(self._client.declare_busy, seconds, reason)
        try:
            yield
        finally:
            self._loop.call_soon_threadsafe(self._client.declare_busy, 0.0, reason)
            took = time.monotonic() - started
            if took > seconds:
                log.warning(
                    "busy (%s) took %.0f s, longer than the %.0f s declared: peers may have "
                    "counted this worker as failed", reason, took, seconds,
                )  # fmt: skip

    # --- the control thread -------------------------------------------------------

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    async def _start(self, name: str) -> None:
        server = grpc.aio.server(interceptors=[TokenInterceptor(self._token)])
        self._servicer = StateServer(
            self.job_name,
            self._config,
            own_id=lambda: self.member_id,
            current_view=lambda: self._view,
            snapshot=self._served.snapshot,
            store_port=self._store_port,
            epoch_secret=self._client.epoch_secret,
            faults=self._faults,
            partition=self._serve_partition if self._sharding is not None else None,
        )
        state_pb2_grpc.add_StateTransferServicer_to_server(self._servicer, server)
        port = server.add_insecure_port(f"{self._host}:0")
        await server.start()
        self._server = server
        self.address = f"{self._host}:{port}"
        member_id = await self._client.join(
            self.address,
            name=name,
            on_roll_call=self._on_roll_call,
            on_view=self._on_view,
            on_end=self._on_end,
            on_busy=self._on_busy,
            fingerprint=self.fingerprint,
        )
        self.member_id = member_id
        with self._state:
            self._member.joined(member_id)
        self._launch_s = process_age()
        self._fetcher = StateFetcher(
            self.job_name, self.member_id, self._token,
            epoch_secret=self._client.epoch_secret, config=self._config,
        )  # fmt: skip
        log.info("joined job %s as %s", self.job_name, self.member_id)
        log.debug("state server of %s at %s", self.member_id, self.address)
        self._report.joined(self.member_id, self.address)

    async def _serve_partition(self, partition: int, step: int) -> tuple[str, bytes]:
        """(Control side.) The serialized state of a partition this rank
        holds as of ``step``, and its digest."""

        def export() -> tuple[str, bytes]:
            with self._lock:
                sharded = self._sharded
                if sharded is None or self.committed_step != step or not sharded.holds(partition):
                    raise InvalidRequest(
                        f"{self.member_id} does not hold partition {partition} of step {step}"
                    )
                tree = list(sharded.export(partition).segments)
            return tree_digest(tree), tree_to_bytes(tree)

        return await self._loop.run_in_executor(None, export)

    def _on_view(self, view: View) -> None:
        dropped = None
        with self._state:
            self._member.view_committed(view)
            lost = view.shards.lost if view.shards is not None else ()
            if lost and self.member_id in view and self._member.step >= 0:
                # Our state is worthless from now on: no roll call may count
                # it, no peer may fetch it (no update lands after the answer
                # that preceded this view).
                dropped = self._member.step
                self._member.restored(-1)
        if dropped is not None:
            self._say_lost(view, dropped)
        with self._view_changed:
            self._view = view
            self._view_changed.notify_all()

    def _on_end(self, error: RollcallError) -> None:
        """The session ended for good (evicted...): stop the step in flight."""
        with self._state:
            self._member.session_ended()
        self._wake()

    def _on_busy(self, member_id: str, seconds: float, reason: str) -> None:
        now = time.monotonic()
        busy = {m: b for m, b in self._busy.items() if b[0] + self._config.collective_timeout > now}
        busy[member_id] = (now + seconds, reason)
        self._busy = busy  # replaced whole: the training thread reads it unlocked
        if seconds > 0:
            log.info("%s is busy (%s) for up to %.0f s: waiting for it", member_id, reason, seconds)

    def _on_roll_call(
        self, epoch: int, causes: tuple[Cause, ...]
    ) -> Coroutine[Any, Any, RollCallAnswer]:
        """Abort the step in flight (now, as the roll call is read), then
        answer with the last committed step and the digest of the state
        this worker will serve (the coroutine returned). A step whose
        all-reduce completed has every member's contribution: the answer
        waits for it to land, so that it names it and every member that
        completed the reduction answers alike, and then for the loop to
        finish it (its code after ``commit()`` may change registered state,
        an EMA say), so that the state served is the step's whole state."""
        arrived = time.perf_counter()
        self._switching.shorten(epoch)  # until a step of its view commits
        self._causes[epoch] = causes
        loop = asyncio.get_running_loop()
        # Held only for joiners and clean leaves: the step in flight runs
        # on, and the view's members stop together after the next
        # reduction (Member.roll_call).
        at_step_end = self._client.at_step_end(epoch)
        with self._state:
            answer = self._member.roll_call(epoch, at_step_end)
            waiting = None
            if answer is None:
                waiting = loop.create_future()
                self._waiting_answers.append(waiting)
                if self._waiting_since is None:
                    self._waiting_since = time.monotonic()
                if self._member.stop_asked:
                    loop.call_later(self._config.rollcall_step_end_wait, self._step_end_late, epoch)
        self._wake()
        return self._answer_when_ready(epoch, arrived, at_step_end, answer, waiting)

    async def _answer_when_ready(
        self, epoch: int, arrived: float, at_step_end: bool,
        answer: Answer | None, waiting: asyncio.Future[int | None] | None,
    ) -> RollCallAnswer:  # fmt: skip
        """The rest of ``_on_roll_call``: wait for the step to land if the
        answer waits for it, then capture and digest the state."""
        loop = asyncio.get_running_loop()
        step = answer.step if answer is not None else await waiting  # type: ignore[misc]
        known = time.perf_counter()
        reply = await loop.run_in_executor(None, self._digest_of, step)
        if self._faults.slow_answer():
            await asyncio.sleep(SLOW_ANSWER_S)
        # The answer is on the path of every view change: what it waited for.
        answered, digested = time.perf_counter() - arrived, time.perf_counter() - known
        log.debug(
            "roll call %d answered in %.1f ms (step %s: %.1f ms waiting for it to land, "
            "%.1f ms capturing and digesting the state)", epoch, answered * 1000, step,
            (known - arrived) * 1000, digested * 1000,
        )  # fmt: skip
        deadline = self._client.answer_deadline(at_step_end)
        if answered > deadline / 2 and digested > answered / 2:
            # A large state (hundreds of MB on 2 cores, slowest the first
            # times it is captured): an answer after the deadline leaves
            # this member out of the view, and at a hot-add every member.
            log.warning(
                "roll call %d: capturing and digesting the state of step %s took %.2f s, "
                "answered %.2f s after the roll call arrived; the roll call's deadline is "
                "%.1f s: a member that answers later is left out of the view. Raise "
                "rollcall_deadline on the replicas and the workers (--set "
                "rollcall_deadline=SECONDS) well above this",
                epoch, step, digested, answered, deadline,
            )  # fmt: skip
        return reply

    def _wake(self) -> None:
        with self._view_changed:
            self._view_changed.notify_all()

    def _step_end_late(self, epoch: int) -> None:
        """Roll call ``epoch``, held at the step's end, waited
        ``rollcall_step_end_wait`` for it: the step is given up. Said once
        when the steps take longer than that (every join and clean leave
        then throws a step's work away). A newer roll call that replaced
        it waits for its own time."""
        with self._state:
            waiting = self._member.ending == epoch
        wait = self._config.rollcall_step_end_wait
        if waiting and not self._said_step_end and self._step_seconds > wait:
            self._said_step_end = True
            log.warning(
                "roll call %d: the step in flight did not end within rollcall_step_end_wait "
                "(%.1f s; a step takes ~%.1f s here): it is aborted and its work lost, at every "
                "join and clean leave. Set rollcall_step_end_wait above the step time on the "
                "replicas and the workers (--set rollcall_step_end_wait=SECONDS)",
                epoch, wait, self._step_seconds,
            )  # fmt: skip
        self._give_up_step_end(epoch)

    def _give_up_step_end(self, epoch: int | None = None) -> None:
        """A roll call held for joiners still waits for the step in flight
        to end (a long step, a busy period, a failed reduction): answered as
        any roll call now, aborting the step (``Member.give_up_step_end``;
        ``epoch``: only if that roll call is the one waiting)."""
        with self._state:
            answer = self._member.give_up_step_end(epoch)
        if answer is not None:
            self._answer_waiting(answer.step)
        self._wake()

    def _digest_of(self, step: int | None) -> RollCallAnswer:
        """(Control side, in a worker thread.) The answer: ``step``, the
        digest of the state served for it, captured once, and in a sharded
        job the epoch of the shard plan this rank moved to. No update lands
        once an answer is decided (the machine's ``answered`` is ahead)."""
        if step is None:
            return RollCallAnswer(None, "")
        with self._lock:
            assert step == self.committed_step, (step, self.committed_step)
            held = self._served.held()
            if held is None or held[0] != step:
                # Parameters and optimizer state shared, not cloned (the
                # bulk of a large state, on every view change's path): no
                # update lands before every fetcher of the next view was
                # served, and each releases them first (_apply, _restore).
                # A sharded rank completes its parameters on entering a
                # view, while joiners fetch: it clones.
                live = self._sharding is None
                state = self._capture(step, with_rng=False, live=live)
                # The training thread waits for the view: its cores hash.
                held = (step, digest(state, threads=hash_threads()))
                # Serialized when a peer first asks for it, not on the
                # answer's way (in a crash, nobody does).
                self._served.serve_captured(step, held[1], state, live=live)
            moved = self._shard_view if self._sharded is not None else None
            return RollCallAnswer(
                step, held[1], None if moved is None else moved.epoch,
                unsettled=step == self._unsettled,
            )  # fmt: skip

    def _answer_waiting(self, step: int | None) -> None:
        """(Training side.) Hand the step that just landed (or not) to the
        roll calls that waited for it."""
        waiting, self._waiting_answers = self._waiting_answers, []
        self._waiting_since = None
        for future in waiting:
            self._loop.call_soon_threadsafe(_settle, future, step)

    def _capture(self, step: int, with_rng: bool = True, live: bool = False) -> ReplicaState:
        """The replica state after ``step`` (under ``_lock`` once training):
        buffers as of the last commit, whatever a step in flight did. In a
        sharded job its optimizer entry holds no state (``_publish_shards``
        gathers it for a checkpoint). ``live``: see ``state.capture``."""
        with self._guarded():
            return self._capture_state(step, with_rng, live)

    def _guarded(self) -> contextlib.AbstractContextManager[None]:
        """The runtime's own use of the user's optimizer's state_dict."""
        return self._guard.allowed() if self._guard is not None else contextlib.nullcontext()

    def _capture_state(self, step: int, with_rng: bool, live: bool = False) -> ReplicaState:
        state = capture(
            step, self._model, self._optimizer, self._scheduler, self._scaler,
            {name: obj.state_dict() for name, obj in self._extras.items()}, with_rng=with_rng,
            live=live,
        )  # fmt: skip
        if self._buffers is not None:
            state.model.update(self._buffers.committed_state())
        return state

    def _restore(self, state: ReplicaState) -> None:
        """Load ``state`` into the registered objects (under ``_lock``)."""
        self._served.release_live()
        with self._guarded():
            extras = restore(state, self._model, self._optimizer, self._scheduler, self._scaler)
        missing = sorted(set(self._extras) - set(extras))
        if missing or set(extras) - set(self._extras):
            raise UsageError(
                f"the state received registers {sorted(extras)} but this worker "
                f"registers {sorted(self._extras)} (state=): every worker must register the same"
            )
        for name, obj in self._extras.items():
            loaded_checked(name, obj, extras[name])
        self._registered.hold()  # the runtime's change, not the loop's
        if self._sharding is not None:
            # A checkpoint holds the whole optimizer state (a peer's snapshot
            # none): the shards take their part of it on entering the view.
            with self._guarded():
                whole = self._optimizer.state_dict() if self._optimizer.state else None
            self._full_optimizer = whole
            self._optimizer.state.clear()
        if self._buffers is not None:
            self._buffers.reset()
        self._ownership.loaded()
        # Steps this worker committed after the state's were undone (the
        # job resumed from a checkpoint): they are trained again.
        undone = self.ledger.rewind(state.step)
        if undone:
            log.info("ledger: the %d steps after step %d are undone", undone, state.step)
        with self._state:
            self._member.restored(state.step)

    async def _store_port(self, epoch: int) -> int:
        future = self._store_ports.setdefault(epoch, self._loop.create_future())
        return await asyncio.wait_for(asyncio.shield(future), self._config.collective_timeout)

    def _publish_store_port(self, epoch: int, port: int) -> None:
        future = self._store_ports.setdefault(epoch, self._loop.create_future())
        if not future.done():
            future.set_result(port)
        for old in [e for e in self._store_ports if e < epoch - 1]:
            del self._store_ports[old]

    # --- signals -----------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: object) -> None:
        """First SIGINT/SIGTERM: leave the job cleanly at once (the others
        reconfigure as for a leave) and stop at the next safe point. In a
        replicated job the step in flight runs on to its reduction, which
        asks the others to stop after it, for up to
        ``rollcall_step_end_wait``: they land it with this worker's part
        instead of training it again (``Member.leave``). A second signal
        exits at once."""
        name = signal.Signals(signum).name
        if not self._joined:
            raise Interrupted(signum, f"{name} while joining job {self.job_name}")
        if self._interrupted:
            os.write(2, f"rollcall: second {name}: exiting at once\n".encode())
            os._exit(128 + signum)
        self._interrupted = signum
        # A sharded step goes on after its reduction (the parameters'
        # all-gather), which a member that applies nothing cannot serve.
        after_step = self._sharding is None
        log.warning("%s: leaving job %s (send it again to exit at once)", name, self.job_name)
        # This handler runs on the training thread, between two of its
        # bytecodes, maybe while it holds ``_state`` (not reentrant): the
        # member leaves on the event loop's thread, which waits for it.
        self._loop.call_soon_threadsafe(self._leave_member, after_step)
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._leave_now()))
        if after_step:
            self._loop.call_soon_threadsafe(
                self._loop.call_later, self._config.rollcall_step_end_wait, self._stop_step
            )

    def _leave_member(self, after_step: bool) -> None:
        """The member leaves (``Member.leave``), from a thread that does not
        hold ``_state``."""
        with self._state:
            self._member.leave(after_step=after_step)
        self._wake()

    def _stop_step(self) -> None:
        """A step in flight that did not reach its reduction within
        ``rollcall_step_end_wait`` of a signal to leave: stopped now."""
        self._leave_member(after_step=False)

    async def _leave_now(self) -> None:
        if self._left or self._client.ended is not None:
            return
        self._left = True
        if self._faults.failed_leave():
            log.warning("leave failed: injected fault")
            return
        try:
            await asyncio.wait_for(self._client.leave(), self._config.client_call_deadline)
        except (RollcallError, TimeoutError) as exc:
            log.warning("leave failed: %s", exc)

    def _raise_if_interrupted(self) -> None:
        signum = self._interrupted
        if signum:
            name = signal.Signals(signum).name
            message = f"left job {self.job_name} cleanly after step {self.committed_step} ({name})"
            log.warning("%s", message)
            raise Interrupted(signum, message)

    def _restore_signals(self) -> None:
        for sig, previous in self._signals.items():
            with contextlib.suppress(ValueError, TypeError):  # not the main thread any more
                signal.signal(sig, previous)
        self._signals = {}

    # --- the training thread ---------------------------------------------------------

    def _aborting(self) -> bool:
        """The step in flight must stop: a newer roll call was answered, the
        session ended, or the worker is leaving (read without the lock: the
        machine's numbers only grow)."""
        return self._member.aborting or self._closed

    def steps(self, max_steps: int) -> Iterator[Step]:
        """Steps ``committed + 1 .. max_steps - 1``, each handed out again
        after an aborted attempt, in whatever view is current then.
        ``max_steps`` is the job's total: a later call asks for more (a
        larger total) or is refused, since it would hand out nothing."""
        check_steps_total(max_steps, self._steps_ran_to)
        # A later call goes on in the view the last one ended in, if no
        # view change began meanwhile (none will come to be entered).
        go_on = self._steps_ran_to is not None and self._in_latest_view()
        while self.committed_step + 1 < max_steps:
            if not go_on and not self._enter_next():
                continue
            go_on = False
            while self._next_step() < max_steps and not self._aborting():
                if self._member.finishing and self._member.halted:
                    # Asked to leave once the members stopped after the
                    # last step (a roll call held at its end): no step
                    # follows in this view. Asked between steps otherwise,
                    # the next one runs on to its reduction as a step in
                    # flight would, its part counted.
                    self._stop_step()
                    break
                if self._hold_while_halted():
                    continue
                # The view entered last: a sharded commit may have entered
                # a new one to complete its step (_complete_step).
                view, rank = self._entered
                step = Step(self, self._next_step(), view, rank)
                if self._building is not None:
                    log.debug(
                        "step %d: computing while the group of view %d builds",
                        step.number, view.epoch,
                    )  # fmt: skip
                self._registered.hold()
                self._stepping = step
                try:
                    yield step
                finally:
                    self._stepping = None
                    self._loop_code_ran()
                    if sys.exc_info()[0] is None:  # the loop asks for the next step
                        if not step.committed:
                            self._check_registered(step)
                            self._check_commit_called(step)
                        self._check_loop_state()
                    if step.committed:
                        self._settle()
                    else:
                        self._set_aside(step)
                if not step.committed and self._entered[0] is view:
                    # Otherwise the step's commit entered a newer view that
                    # undid it (_complete_step): it is handed out again there.
                    break
            if self._fetch_in_flight is not None and not self._aborting():
                # The view's first step is past max_steps: no commit lands
                # the state this worker fetched, so it is landed here.
                with contextlib.suppress(StepAborted):
                    self._land_fetch()
            self._raise_if_interrupted()
        self._steps_ran_to = max(max_steps, self._steps_ran_to or 0)
        self._report.done(self.committed_step)

    def _hold_while_halted(self) -> bool:
        """(Training side.) The view's members stopped after the step that
        landed last, for a roll call held for joiners that this worker has
        not been asked yet: start no step until it is (its answer ends the
        view) or it is given up (``Member.tick``: the steps go on). Whether
        it held."""
        with self._view_changed:
            held = False
            while not self._aborting() and not self._member.finishing:
                with self._state:
                    self._member.tick(time.monotonic())
                    if not self._member.halted:
                        return held
                held = True
                self._view_changed.wait(timeout=self._config.abort_poll)
            return held

    def _in_latest_view(self) -> bool:
        """Whether this worker is in the newest committed view, entered,
        with no roll call under way."""
        with self._state:
            latest = self._member.view
        entered = self._entered[0]
        return entered is not EMPTY_VIEW and entered.epoch == latest.epoch and not self._aborting()

    def _enter_next(self) -> bool:
        """Wait for the next view and enter it; False if it was given up
        (the next view, a roll call is coming or is asked for by
        ``_wait_for_view``, replaces it)."""
        view = self._wait_for_view()
        try:
            self._entered = (view, self._enter(view))
        except StepAborted as exc:
            if isinstance(exc, PeerFailed):
                self._note_failure(f"view {view.epoch} given up while entering it", exc.reason)
            else:
                log.info("view %d given up while entering it: %s", view.epoch, exc)
            return False
        return True

    def _complete_step(self, step: Step) -> bool:
        """A sharded step landed but its parameter all-gather did not reach
        this rank: the model is still the previous step's. Enter the next
        view, which completes the parameters from their holders, before
        ``commit`` returns, so that the loop never sees a model that is not
        the step's. False if that view undid the step (it resumed from a
        checkpoint: the step is handed out again)."""
        log.info(
            "step %d landed but its parameter all-gather did not complete: waiting for the "
            "next view to complete it", step.number,
        )  # fmt: skip
        # The roll call of that view cannot wait for the loop's code after
        # this commit (it is the loop's next step): answered now, saying so
        # (the leader lets nobody take the registered state served then,
        # which lacks what that code changes: docs/worker.md).
        with self._lock:
            self._unsettled = step.number
        self._settle()
        while not self._enter_next():
            pass
        return self.committed_step >= step.number

    def _loop_code_ran(self) -> None:
        """(Training side.) The loop's code after a ``commit()`` that entered
        a view before it returned (``_complete_step``) ran: roll calls are
        answered as settled again, with the registered state captured anew."""
        if self._unsettled is None:
            return
        with self._lock:
            step, self._unsettled = self._unsettled, None
            held = self._served.held()
            if held is not None and held[0] == step:
                self._served.serve(None)

    def _check_registered(self, step: Step) -> None:
        """(Training side, at ``commit()`` or when an aborted step ends.)
        Refuse registered state the loop changed since ``step`` was handed
        out (``RegisteredWatch``), on every rank, whatever happens next."""
        changed = self._registered.changed()
        if changed:
            raise UsageError(
                f"step {step.number}: registered state ({', '.join(changed)}) changed in the "
                "loop before commit(). A step aborted and handed out again runs that code "
                "twice, and a worker that joins during the step loads the job's state at its "
                "commit, dropping the change there alone. Change registered state only after "
                "a successful commit() (as an EMA update does)"
            )

    def _check_loop_state(self) -> None:
        """(Training side, the loop asks for the next step.) Since the
        step's first ``job.busy()`` began, roll calls were answered with
        the registered state of then, and a worker that joined meanwhile
        took it: raise ``UsageError`` if the loop changed it since (inside a
        ``with`` block, or after it), which that worker would never see."""
        began, self._busy_began = self._busy_began, None
        if began is None:
            return
        step, reason, held = began
        if self.committed_step != step or self._registered.digest() == held:
            return
        raise UsageError(
            f"step {step}: registered state (state=, scheduler or grad scaler) changed after "
            f"job.busy({reason!r}) began, inside the with block or after it before the next "
            "step. From job.busy() on, roll calls are answered with the state as it was then "
            "(the loop is not in a step), so a worker that joins meanwhile would train on "
            "without the change, its replica parting from the others'. Change registered state "
            "after commit() and before job.busy() (keep what the busy work found, an "
            "evaluation's loss, in a variable, and record it after the next commit())"
        )

    def _settle(self) -> None:
        """(Training side.) The loop finished the step that landed last: it
        asks for the next step, leaves the loop or declares itself busy, so
        the registered state is the step's whole state. Answer the roll calls
        that waited for that, and capture the checkpoint due at the step."""
        waited = self._waiting_since
        with self._state:
            answer = self._member.settled()
        if answer is not None:
            self._answer_waiting(answer.step)
            waited_s = time.monotonic() - waited if waited is not None else 0.0
            deadline = self._client.answer_deadline(at_step_end=False)
            if waited_s > deadline / 2:
                log.warning(
                    "a roll call waited %.2f s for the loop to finish step %s (its code after "
                    "commit()); the roll call's deadline is %.1f s: wrap long work between "
                    "steps in job.busy(), or this worker is left out of the view",
                    waited_s, answer.step, deadline,
                )  # fmt: skip
        self._check_drift()
        due, self._due_checkpoint = self._due_checkpoint, None
        if due is None:
            return
        assert self.checkpoints is not None and self.member_id is not None
        with self._lock:
            if self.committed_step != due.step:  # a view restored other state meanwhile
                return
            state = self._capture(due.step)
            if due.optimizer is not None:
                state.optimizer = due.optimizer
        self.checkpoints.submit(
            state, due.epoch, self.member_id, self._step_seconds, parts=due.parts,
            own_part=due.own_part,
        )  # fmt: skip

    def _check_commit_called(self, step: Step) -> None:
        """The loop asks for the next step: ``step`` must have been
        committed, unless it was aborted (it comes again). A step skipped by
        the loop cannot be: the others' reductions of it wait for this
        rank's, and the same step would come again with what this rank had
        set aside of it (before, the loop waited for a view that never
        came)."""
        if step._commit_called or step.aborted or self._aborting():
            return
        raise UsageError(
            f"step {step.number} was handed out and not committed: the loop went on to the "
            "next step without calling step.commit(). Every worker's commit() reduces the step "
            "with the others', so a step cannot be skipped by one worker, and its work would "
            "come back with it. Call step.commit() on every step (it returns False when the "
            "step was aborted, and the same step comes again); a step whose gradient is not "
            "finite is refused at commit, or skipped there by a grad scaler"
        )

    def _set_aside(self, step: Step) -> None:
        """A step that did not commit: keep what this rank finished of it
        (the gradients and buffer changes of its finished microbatches) for
        the same step's next attempt, unless its all-reduce completed (the
        gradients then hold the sum, not this rank's part) or it finished
        nothing; else throw it away."""
        if self.metrics is not None:
            self.metrics.aborted.inc()
        self._drop_fetch()
        seconds = time.monotonic() - step.started
        if self._buckets is not None and self._buckets.started:
            # Its gradients are under reduction, or were abandoned with a
            # group that may still write into them: fresh buckets.
            self._buckets.replace()
            step._reduced = True
        if step._reduced or not step.done:
            self._discard(seconds)
            return
        self._carry = _Carry(
            step.number, tuple(step.done), step._count, step._loss, step._microbatches,
            self._param_versions(), seconds,
        )  # fmt: skip

    def _take_carry(self, step: Step) -> tuple[int, ...]:
        """(Step creation.) The microbatches of ``step`` this rank finished in
        an aborted attempt of it that it can keep: the step is the same, the
        parameters have not changed since (no state was loaded or completed
        meanwhile), and the microbatches are this rank's in the new split;
        in default mode all of them must be (their gradients are summed in
        ``.grad`` and cannot be taken apart), in exact mode each one is kept
        apart. Whatever cannot be kept is thrown away here."""
        carry, self._carry = self._carry, None
        if carry is None:
            return ()
        assigned = {mb.index for mb in self.plan.for_rank(step.number, step.rank,
                                                          step.world_size, step.idle)}  # fmt: skip
        kept = tuple(i for i in carry.done if i in assigned)
        usable = carry.step == step.number and carry.params == self._param_versions() and (
            self._exact is not None or len(kept) == len(carry.done)
        )
        if not usable or not kept:
            self._discard(carry.seconds)
            return ()
        step.done = list(kept)
        step._count, step._loss, step._microbatches = carry.count, carry.loss, carry.microbatches
        log.info(
            "step %d: %d microbatches finished before it was aborted are kept (%s), %d to run",
            step.number, len(kept), ", ".join(map(str, kept)), len(assigned) - len(kept),
        )  # fmt: skip
        return kept

    def _next_step(self) -> int:
        """The step this worker runs next: the one after its committed step,
        or after the state it is fetching (``_fetch_in_flight``)."""
        fetch = self._fetch_in_flight
        if fetch is not None:
            return fetch.step + 1
        return self.committed_step + 1

    def _fetches_during_first_step(self, view: View) -> bool:
        """Whether the members ``view`` tells to fetch state do so during the
        view's first step instead of before it: they run none of its
        microbatches (the others divide the whole step), contribute nothing
        to its reduction, and land the state fetched just before that
        reduction (``_land_fetch``), so that the others compute while they
        fetch. With ``overlap`` a fetching rank starts every bucket at that
        commit, after the landing, as any rank without a microbatch does.
        Only in a job without sharding (a setting every worker shares: the
        job's fingerprint), for a view that resumes a step and keeps at
        least one member that does not fetch. Every member decides alike
        from the view alone, so every member divides the step alike."""
        return (
            self._sharding is None
            and view.resume_step is not None
            and bool(view.fetch)
            and any(m.id not in view.fetch for m in view.members)
        )

    def _idle(self, view: View, step: int) -> frozenset[int]:
        """The ranks of ``view`` that run nothing at ``step``: those that
        fetch state during the view's first step (``_fetches_during_first_step``)."""
        if view.resume_step is None or step != view.resume_step + 1:
            return frozenset()
        if not self._fetches_during_first_step(view):
            return frozenset()
        return frozenset(rank for rank, m in enumerate(view.members) if m.id in view.fetch)

    def _land_fetch(self) -> None:
        """(Training thread.) Wait for the state fetch in flight and load it:
        this worker then holds the view's resume step, as every member does
        before the reduction of the view's first step. Raises StepAborted as
        ``_await`` does (the fetch is then dropped)."""
        fetch, self._fetch_in_flight = self._fetch_in_flight, None
        assert fetch is not None
        if self.state_digest() != fetch.held:
            fetch.future.cancel()
            raise UsageError(
                f"step {fetch.step + 1}: registered state (model, optimizer, scheduler, "
                "grad scaler or state=) changed in the loop before commit(). This worker "
                "joined the view during this step and loads the job's state at its commit, "
                "which would drop that change here while the others keep theirs; a step "
                "aborted and handed out again would also make it twice. Change registered "
                "state only after a successful commit() (as an EMA update does)"
            )
        fetched = self._restore_fetched(fetch.view, fetch.future)
        if self._entering is not None and self._entering[0] == fetch.view.epoch:
            epoch, _, built, ready = self._entering
            self._entering = (epoch, fetched, built, ready)

    def _drop_fetch(self) -> None:
        """Cancel the state fetch in flight, if any: its view was given up."""
        fetch, self._fetch_in_flight = self._fetch_in_flight, None
        if fetch is not None:
            fetch.future.cancel()

    def _param_versions(self) -> tuple[int, ...]:
        """The parameters' version counters: any in-place change (an update,
        a state loaded, an all-gather) moves one."""
        return tuple(p._version for p in self._params)

    def _drop_gradients(self) -> None:
        """After an update, or an aborted step: no gradient is left, also on
        a trainable parameter the optimizer does not hold (its
        ``zero_grad`` would leave that one, and the next step's backward
        passes would add to it)."""
        self._optimizer.zero_grad(set_to_none=True)
        for param in self._params:
            param.grad = None
        self._gradients.forget()

    def _discard(self, seconds: float) -> None:
        """Throw away what an uncommitted step did to gradients and buffers
        (``seconds``: the work lost)."""
        self._drop_gradients()
        if self._buffers is not None:
            self._buffers.rollback()
        self._lost_work += seconds

    def _wait_for_view(self) -> View:
        """The newest committed view that contains this worker, that it has
        not entered yet and that has at least ``min_workers`` members if the
        job is starting."""
        with self._view_changed:
            while True:
                ended = self._client.ended
                if isinstance(ended, JobRecordLost):
                    saved = self._save_before_exit()
                    directory = self.checkpoints.directory if self.checkpoints else None
                    then = what_restarting_does(self.committed_step, directory, saved)
                    raise JobRecordLost(f"{ended}. {then}") from ended
                if ended is not None:
                    raise ended
                self._raise_if_interrupted()
                with self._state:
                    view = self._member.next_view(self._min_workers)
                    report = self._member.tick(time.monotonic())
                    latest = self._member.view
                if view is not None:
                    return view
                if report is not None:
                    # No roll call followed a failure: we cannot tell which
                    # peer broke the collective, so ask for one, which calls
                    # everyone (live members answer and keep their place).
                    self._loop.call_soon_threadsafe(self._client.request_rollcall, report.reason)
                if (
                    self.member_id in latest
                    and latest.resume_step is None
                    and latest.size < self._min_workers
                    and not (latest.shards is not None and latest.shards.lost)
                    and self._below_minimum_said != latest.epoch
                ):
                    self._below_minimum_said = latest.epoch
                    log.info(
                        "waiting for %d workers before step 0 (view %d has %d)",
                        self._min_workers, latest.epoch, latest.size,
                    )  # fmt: skip
                self._view_changed.wait(timeout=self._config.abort_poll * 10)

    def _enter(self, view: View) -> int:
        """Pull state if behind, build the group for ``view`` (in the
        background when nothing needs it before the first collective:
        ``_ready_group``); returns our rank. Raises ``StepAborted`` if a
        newer roll call, a dead peer or a timeout gets in the way (``steps``
        then waits for the next view)."""
        fetched = 0.0
        assert self.member_id is not None and self._fetcher is not None
        rank = view.rank_of(self.member_id)
        assert rank is not None
        # Before the machine enters the view: a build of the view left
        # behind sees its abort (a newer roll call) until then.
        self._drop_group()
        self._drop_fetch()
        with self._state:
            self._member.enter(view)
        if self._aborting():
            raise StepAborted(f"epoch {view.epoch}: a newer roll call is under way")
        self._check_shards(view)
        if view.resume_step is None and self.committed_step < 0:
            self._resume_from_checkpoint(view)
        if self.committed_step >= 0 and (
            view.resume_step is None or self.committed_step > view.resume_step
        ):
            # Our state is newer than the view says (we loaded a checkpoint
            # after answering): its resume step must be decided again.
            reason = (
                f"holds step {self.committed_step}, view {view.epoch} resumes at {view.resume_step}"
            )
            self._ask_for_rollcall(reason)
            raise StepAborted(f"epoch {view.epoch}: {reason}; asked for a roll call")
        behind = view.resume_step is not None and self.committed_step != view.resume_step
        fetching: Future[Any] | None = None
        if self.member_id in view.fetch and not behind:
            self._say_drifted(view)
        if self.member_id in view.fetch or behind:
            # The fetch runs on the control loop while this thread builds the
            # group: the others wait for this rank's group build and fetch
            # together, not one after the other. The state is restored once
            # both are done, before any collective of the view.
            sources = view.fetch.get(self.member_id) or tuple(
                m.id for m in view.members if m.id != self.member_id
            )
            addresses = [m.address for m in view.members if m.id in sources]
            fetching = asyncio.run_coroutine_threadsafe(
                self._fetcher.fetch(
                    addresses, view.epoch, view.digest, self._config.collective_timeout
                ),
                self._loop,
            )
        if fetching is None and self._sharding is None:
            # Nothing of this view needs the group before its first
            # collective: it is built on a thread of its own while this
            # thread computes the step's microbatches (a survivor that takes
            # over a dead rank's share overlaps that work with the build),
            # and the first collective waits for it (``_ready_group``; with
            # overlap, the last backward pass's buckets: ``_launcher``).
            self._loader.enter_view(rank, view.size, self.committed_step + 1)
            entered = view_change(self._previous_view, view, rank,
                                  self._causes.get(view.epoch, ()), self.member_id)  # fmt: skip
            self._building = _GroupBuild(
                view, rank, lambda: self._make_group(view, rank), lambda: log.info("%s", entered)
            )
        else:
            try:
                built = time.perf_counter()
                self._group = self._make_group(view, rank)
                ready = time.perf_counter()
            except BaseException:
                if fetching is not None:
                    fetching.cancel()
                raise
            if (
                fetching is not None
                and not fetching.done()
                and self.member_id in view.fetch
                and self._fetches_during_first_step(view)
            ):
                # Landed at the first step's commit (the others do not wait
                # for it). A fetch done by now, the group built, is landed
                # here: this rank still runs nothing of that step (every
                # member decided so from the view), but its loop starts
                # from the fetched state.
                assert view.resume_step is not None
                self._fetch_in_flight = _FetchInFlight(
                    view, view.resume_step, fetching, self.state_digest()
                )
            elif fetching is not None:
                fetched = self._restore_fetched(view, fetching)
            if self._sharding is not None:
                self._enter_shards(view)
            self._loader.enter_view(rank, view.size, self._next_step())
            log.info(
                "%s", view_change(self._previous_view, view, rank,
                                  self._causes.get(view.epoch, ()), self.member_id),
            )  # fmt: skip
            self._group_ready(view, fetched, ready - built, time.monotonic())
        if view.resume_step is not None and view.size < self._min_workers:
            log.warning(
                "view %d has %d members, fewer than min_workers %d: training goes on",
                view.epoch, view.size, self._min_workers,
            )  # fmt: skip
        self._previous_view = view
        for old_epoch in [e for e in self._causes if e < view.epoch]:
            del self._causes[old_epoch]
        if self._adopted is not None and view.resume_step is not None:
            manifest, orphans = self._adopted
            self._adopted = None
            if view.resume_step == manifest.step and self.checkpoints is not None:
                self.checkpoints.adopt(replace(manifest, epoch=view.epoch), orphans)
        return rank

    def _check_shards(self, view: View) -> None:
        """A sharded job's view must say who owns what; if it says that
        partitions were lost, this rank's state is worthless: it drops it,
        and the view resumes from the newest durable checkpoint."""
        shards = view.shards
        if self._sharding is None and shards is None:
            return
        if self._sharding is None or shards is None:
            raise UsageError(
                f"view {view.epoch} {'has' if shards else 'has no'} shard plan but this worker "
                f"{'is not' if self._sharding is None else 'is'} sharded: the rendezvous service "
                "must be of this version (it plans the shards from the job's fingerprint)"
            )
        if shards.count != self._sharding.count:
            raise UsageError(
                f"view {view.epoch} plans {shards.count} partitions, this worker "
                f"{self._sharding.count}"
            )
        if shards.lost:
            # This rank's step was dropped when the view arrived (_on_view).
            with self._lock:
                if self._sharded is not None:
                    self._sharded.forget()
                self._full_optimizer = None
                self._served.serve(None)

    def _say_lost(self, view: View, step: int) -> None:
        """The one line a view that lost partitions gets."""
        assert view.shards is not None
        lost = view.shards.lost
        previous = self._shard_view.shards if self._shard_view is not None else None
        owners = sorted({m for p in lost for m in previous.plan.owners[p]}) if (
            previous is not None and previous.count == view.shards.count
        ) else []  # fmt: skip
        log.error(
            "view %d: partitions %s of the optimizer state have no live copy (their owners %s "
            "are gone): this worker drops its state of step %d and the job resumes from its "
            "newest durable checkpoint",
            view.epoch, ", ".join(map(str, lost)), ", ".join(owners) or "?", step,
        )  # fmt: skip

    def _enter_shards(self, view: View) -> None:
        """Bring this rank's shards to ``view``'s plan, in its new group:
        complete the parameters of the resume step from their holders (the
        previous step's all-gather may not have reached everyone), fetch the
        partitions newly given to this rank from a holder (digest-checked
        against a second holder when there is one), wait until every member
        has what it needs, then keep, take or drop."""
        shards = view.shards
        group = self._group
        assert shards is not None and group is not None and self.member_id is not None
        me = self.member_id
        started = time.perf_counter()
        if not shards.sources:
            # A fresh plan: the job starts, or resumes from a checkpoint
            # (the shards were built when it loaded, _resume_from_checkpoint).
            if self._shard_view is not view:
                with self._lock:
                    self._build_shards(view)
            assert self._sharded is not None
            self.resharded = {"epoch": view.epoch, "fetched": [], "bytes": 0,
                              "owned": list(self._sharded.owned)}  # fmt: skip
            return
        holders = {m for entry in shards.sources for m in entry}
        with self._lock:
            if self._sharded is None:
                self._sharded = ShardedOptimizer(self._optimizer, shards.plan, me)
                self._sharded.forget()
            elif me not in holders:
                self._sharded.forget()  # behind: its copies are of an older step
            self._full_optimizer = None
        sharded = self._sharded
        sharded.publish(group.allgather, view.ids, shards.sources)
        needs = sharded.needs(shards.plan)
        received, size = self._remote(
            self._fetch_partitions(view, needs), f"epoch {view.epoch}: fetching partitions"
        )
        if moves(ShardPlan(shards.sources, shards.plan.redundancy), shards.plan):
            # Nobody drops a copy before every taker has its own.
            group.allreduce_sum([torch.zeros(1)])
        with self._lock:
            fetched = sharded.move_to(shards.plan, received, keep=True)
        self._shard_view = view
        self.resharded = {"epoch": view.epoch, "fetched": list(fetched), "bytes": size,
                          "owned": list(sharded.owned)}  # fmt: skip
        log.info(
            "view %d: optimizer state re-sharded in %.3f s: this rank holds partitions %s "
            "(%d fetched, %d bytes)",
            view.epoch, time.perf_counter() - started, list(sharded.owned), len(fetched), size,
        )  # fmt: skip

    def _build_shards(self, view: View) -> None:
        """(Under ``_lock``.) This rank's shards of ``view``'s fresh plan,
        holding their part of a checkpoint's optimizer state if one was just
        loaded, else none (step 0)."""
        assert view.shards is not None and self.member_id is not None
        self._sharded = ShardedOptimizer(self._optimizer, view.shards.plan, self.member_id)
        if self._full_optimizer is not None:
            self._sharded.load_state(self._full_optimizer)
            self._full_optimizer = None
        self._shard_view = view

    async def _fetch_partitions(
        self, view: View, partitions: Sequence[int]
    ) -> tuple[dict[int, PartitionState], int]:
        """(Control side.) The partitions' states as of the view's resume
        step, from their holders, all at once."""
        shards = view.shards
        fetcher = self._fetcher
        assert shards is not None and fetcher is not None and view.resume_step is not None
        address = {m.id: m.address for m in view.members}
        step = view.resume_step

        async def one(p: int) -> tuple[int, PartitionState, int]:
            holders = [m for m in shards.sources[p] if m != self.member_id]
            turn = p % len(holders)
            ordered = holders[turn:] + holders[:turn]
            witness = address[ordered[1]] if len(ordered) > 1 else None
            tree, size = await fetcher.fetch_partition(
                [address[m] for m in ordered], view.epoch, p, step,
                self._config.collective_timeout, witness,
            )  # fmt: skip
            return p, PartitionState(p, tuple(tree)), size

        results = await asyncio.gather(*(one(p) for p in partitions))
        return {p: state for p, state, _ in results}, sum(size for _, _, size in results)

    def _publish_shards(self, step: Step, group: EpochGroup) -> _DueCheckpoint | None:
        """(Under ``_lock``, the step landed.) The all-gather of the updated
        parameters; then, at a checkpoint step, this rank's part of the
        checkpoint (``_checkpoint_parts``). A failed all-gather leaves the
        step landed: the next view completes it (``_enter_shards``)."""
        sharded, view = self._sharded, self._shard_view
        assert sharded is not None and view is not None
        compare = self._check_due(step.number)
        if self._member.ending is not None and self._faults.held_gather_exit():
            logging.shutdown()
            os._exit(9)
        try:
            drifted = sharded.publish(group.allgather, view.ids, compare=compare)
        except StepAborted as exc:
            if isinstance(exc, PeerFailed):
                self._note_failure(f"epoch {step.epoch}: parameter all-gather failed", exc.reason)
            self._incomplete = True  # commit enters the next view before it returns
            return None
        if drifted:
            senders = {p: sharded.sender_of(p, view.ids) for p in drifted}
            self._drifted_copies = (step.number, senders)
        self._check_updated(step)
        if self.checkpoints is None or (step.number + 1) % self._checkpoint_every != 0:
            return None
        return self._checkpoint_parts(step, group, sharded, view)

    def _checkpoint_parts(
        self, step: Step, group: EpochGroup, sharded: ShardedOptimizer, view: View
    ) -> _DueCheckpoint | None:
        """(Under ``_lock``.) A sharded checkpoint: every rank that sends
        partitions in the all-gather writes their state to a part file of
        its own; one all-gather of the parts' descriptions (where, size,
        SHA-256, partitions and their digests) tells every rank whether all
        are ready to write (else every one skips the checkpoint alike) and
        rank 0 the manifest's parts. Rank 0 gets the checkpoint, which it
        captures once the step settled and publishes once every part is
        written; the others write their part now."""
        checkpoints, me = self.checkpoints, self.member_id
        assert checkpoints is not None and me is not None
        mine = [sharded.export(p) for p in sharded.sent_by_me(view.ids)]
        blob = part_bytes(mine) if mine else b""
        path = str(checkpoints.part_path(step.number, me))
        part = describe_part(path, blob, mine).to_dict() if mine else None
        text = json.dumps({"ready": not checkpoints.busy, "part": part}).encode()
        try:
            lengths = group.allgather(torch.tensor([len(text)], dtype=torch.int64))
            padded = torch.zeros(max(int(n) for n in lengths), dtype=torch.uint8)
            padded[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
            gathered = group.allgather(padded)
        except StepAborted as exc:
            log.info("step %d: no checkpoint, its parts' descriptions did not reach every rank "
                     "(%s)", step.number, exc)  # fmt: skip
            return None
        try:
            said = [
                json.loads(t[: int(n)].numpy().tobytes())
                for n, t in zip(lengths, gathered, strict=True)
            ]
            parts = tuple(CheckpointPart.from_dict(d["part"]) for d in said if d["part"])
        except (InvalidRequest, ValueError, KeyError, TypeError) as exc:
            log.warning("step %d: no checkpoint, a rank's part description is malformed: %s",
                        step.number, exc)  # fmt: skip
            return None
        if not all(d["ready"] for d in said):
            checkpoints.skip(step.number, "a rank is still writing its part of the previous one")
            return None
        if group.rank != 0:
            if blob:
                checkpoints.submit_part(step.number, me, blob)
            return None
        with self._guarded():
            entry = sharded.checkpoint_entry()
        return _DueCheckpoint(step.number, step.epoch, entry, parts, blob or None)

    def _patience(self, started: float) -> float:
        """How long a wait for peers that began at ``started`` may go on:
        ``collective_timeout``, counted from the end of the latest busy
        period a member of the view declared if that is later."""
        view = self._view
        latest = started
        for member_id, (until, _) in self._busy.items():
            if member_id in view:
                latest = max(latest, until)
        return latest + self._config.collective_timeout

    def _make_group(self, view: View, rank: int) -> EpochGroup:
        """This rank's group for ``view`` (on the training thread, or on the
        thread of a ``_GroupBuild``). Raises StepAborted as the build does."""
        assert self._fetcher is not None
        secret = self._client.epoch_secret(view.epoch)
        if secret is None:
            # Sent just before the view on the same session: not expected.
            reason = f"no epoch secret was received for view {view.epoch}"
            self._ask_for_rollcall(reason)
            raise StepAborted(f"epoch {view.epoch}: {reason}; asked for a roll call")
        timeout = self._config.collective_timeout
        if self._faults.slow_build():
            time.sleep(SLOW_BUILD_S)
        if rank == 0:
            _, port = host_store(timeout, host=self._host)  # the group owns it
            self._loop.call_soon_threadsafe(self._publish_store_port, view.epoch, port)
            host = self._host
        else:
            leader = view.members[0]
            port = self._remote(
                self._fetcher.group_store_port(leader.address, view.epoch, timeout),
                f"epoch {view.epoch}: asking rank 0 for the group store",
            )
            host = leader.address.rpartition(":")[0]
        return EpochGroup.build(
            view.epoch, rank, view.size, host, port, rank == 0, timeout, _Abort(self, view.epoch),
            listen_host=self._host, patience=self._patience,
            hard_timeout=self._config.collective_backstop(), secret=secret, config=self._config,
        )  # fmt: skip

    def _group_ready(self, view: View, fetched: float, built: float, ready: float) -> None:
        """The group of ``view`` is in place since ``ready`` (monotonic):
        what its first commit reports."""
        self._entering = (view.epoch, fetched, built, ready)
        if self.metrics is not None:
            self.metrics.epoch.set(view.epoch)
            self.metrics.world.set(view.size)
        log.debug(
            "entered view %d (state fetch %.3f s, group build %.3f s)", view.epoch, fetched, built
        )

    def _ready_group(self) -> EpochGroup | None:
        """(Training thread.) The group of the view entered last, once built:
        a build still running on its own thread is waited for (it ends
        within a poll once the view is aborted). None if there is none, or
        if its build failed (the view is then given up as if entering it
        had failed: the step is set aside, and the next view is awaited)."""
        building = self._building
        if building is None:
            return self._group
        self._building = None
        try:
            self._group = building.result()
        except StepAborted as exc:
            if isinstance(exc, PeerFailed):
                self._note_failure(
                    f"view {building.view.epoch} given up while building its group", exc.reason
                )
            else:
                log.info("view %d given up while building its group: %s", building.view.epoch, exc)
            return None
        self._group_ready(building.view, 0.0, building.seconds, building.ready_at)
        return self._group

    def _drop_group(self) -> None:
        """(Training thread.) Close the group in force, and the one being
        built (waited for first: it ends within a poll once aborted)."""
        building, self._building = self._building, None
        if building is not None:
            with contextlib.suppress(StepAborted):
                self._group = building.result()
        old, self._group = self._group, None
        if old is not None:
            old.close()

    def _restore_fetched(self, view: View, fetching: Future[Any]) -> float:
        """Wait for the state fetch of ``view`` and restore it; its seconds."""
        held = self.committed_step
        blob, state, report = self._await(fetching, f"epoch {view.epoch}: state fetch")
        with self._lock:
            self._restore(state)
            self._served.serve(Snapshot(state.step, view.digest, blob))
        why = ("new" if held < 0 else f"held step {held}" if held != state.step
               else "its state of that step differed")  # fmt: skip
        log.info(
            "pulled step %d (%d bytes) from %d peers in %.3f s (%d whole refetches; %s)",
            state.step, report.size, len(report.sources), report.seconds, report.retries, why,
        )  # fmt: skip
        return float(report.seconds)

    def _remote(self, coro: Any, what: str) -> Any:
        """Run a peer call on the control loop; give up (``StepAborted``) as
        soon as a newer roll call aborts this view, or when the call fails:
        a failed peer means a new view is coming anyway."""
        return self._await(asyncio.run_coroutine_threadsafe(coro, self._loop), what)

    def _await(self, future: Future[Any], what: str) -> Any:
        """The result of a peer call running on the control loop (as
        ``_remote``)."""
        while True:
            try:
                return future.result(timeout=self._config.abort_poll)
            except FutureTimeout:
                if self._aborting():
                    future.cancel()
                    raise StepAborted(f"{what}: aborted by a newer roll call") from None
            except (
                grpc.aio.AioRpcError,
                TransferFailed,
                CorruptState,
                ControlPlaneUnavailable,
            ) as exc:
                self._note_failure(f"{what} failed", str(exc))
                raise StepAborted(f"{what} failed: {exc}") from exc

    def _commit(self, step: Step) -> bool:
        self._check_registered(step)
        group = self._ready_group()
        if step.aborted or self._aborting() or group is None:
            return False
        step._check_microbatches_run()
        if self._fetch_in_flight is not None:
            # Before the reduction: what this rank contributes (nothing, but
            # a buffer's change is taken against its committed value, and in
            # exact mode the buffers are combined from it) and what the
            # update applies to are the view's resume state.
            try:
                self._land_fetch()
            except StepAborted:
                return False
        self._gradients.check()
        self._check_model(step)
        if self._data_watch is not None:
            self._data_watch.check(step.number)
        self._check_scheduler_registered()
        if self._sharded is not None:
            self._sharded.check_groups()  # before the reduction: nothing changed yet
        self._check_parameters_kept(step)
        # This rank asks, in the step's reduction, that the view's members
        # stop after it (a roll call held for joiners waits for it).
        ask = self._member.stop_asked
        applied = self._applied
        last = applied if applied is not None and applied.step == step.number - 1 else None
        agreements = Agreements(
            settings=None if last is None else last.settings,
            probe=None if last is None else HookAgreement.read(last.probe),
            modes=modes_tag(self._named_modules.values()),
        )
        grads: Sequence[torch.Tensor | None]  # the reduced gradient, by parameter
        used: Sequence[bool]  # by parameter: a microbatch of some rank gave it a gradient
        try:
            if self._exact is not None:
                reduced = self._exact.reduce(
                    lambda tensors, op: group.allreduce(tensors, _REDUCE_OPS[op]), stop=ask,
                    also_max=agreements.max_terms(),
                )  # fmt: skip
                count, loss, stop = float(reduced.count), reduced.loss, reduced.stop
                agreed = Agreements.agreed_maxima(reduced.also_max)
                finish, grads, used = reduced.apply, reduced.grads, reduced.used
            elif self._buckets is not None:
                (count, loss, stop, agreed, used), finish = self._reduce_buckets(
                    step, group, ask, agreements
                )
                grads = [p.grad for p in self._params]  # the buckets' views
            else:
                tensors, buffer_slots = self._reduction(step, ask, agreements)
                group.allreduce_sum(tensors)
                count, loss, stop, agreed, used = _read_totals(tensors[-1], len(self._params))
                grads = tensors[: buffer_slots.start]

                def finish() -> None:
                    self._normalise(tensors, buffer_slots, count)

        except PeerFailed as exc:
            self._note_failure(f"epoch {step.epoch}: all-reduce failed", exc.reason)
            self._give_up_step_end()  # no step ends here: a waiting roll call is answered
            return False
        except StepAborted:
            return False
        step._reduced = True  # the gradients hold the sum now, not this rank's part
        if count <= 0:
            raise UsageError(
                f"step {step.number}: the global sample count is {count:g}: step.backward "
                "must be given the number of samples (or tokens) its loss sums over"
            )
        if not agreed.gradients:
            raise UsageError(
                f"step {step.number}: the ranks of view {step.epoch} applied step "
                f"{step.number - 1} with different gradients after before_update (this rank's "
                f"hook: {callable_name(self._before_update)}): every rank gives it the same "
                "reduced gradient, so a hook that differs between workers (another clip norm "
                "from a worker's settings, noise from a generator each rank seeds its own way) "
                "makes the replicas part. Run every worker with the same hook and settings, and "
                "draw any randomness in it from torch's, random's or numpy's global generators "
                "(the runtime seeds them from the step before the hook) or from a generator "
                "seeded from step.number"
            )
        if not agreed.modes:
            raise UsageError(
                f"step {step.number}: the ranks of view {step.epoch} ran it with their modules in "
                f"different training modes (this rank's modules in eval mode: "
                f"{in_eval_mode(self._named_modules)}): a rank that evaluated (model.eval()) and "
                "did not call model.train() again trains with dropout off and batch norms on "
                "their running statistics while the others do not, and its gradients are "
                "averaged with theirs. Call model.train() after evaluating, before the next step, "
                "on every rank (or put every rank in the same mode)"
            )
        if not agreed.settings:
            raise UsageError(
                f"step {step.number}: the ranks of view {step.epoch} applied step "
                f"{step.number - 1} with different optimizer settings (this rank's learning "
                f"rates: {learning_rates(self._optimizer)}): every rank applies the same reduced "
                "gradient, so the replicas part. Set the learning rate and the other settings "
                "with a registered LR scheduler (Elastic(scheduler=...)) or from step.number in "
                "before_update, never from a count the loop keeps itself (a worker that joins "
                "or restarts counts from 0)"
            )
        # A grad scaler skips a step whose gradient is not finite; without
        # one (or with one built with enabled=False), applying it would make
        # every replica's weights NaN.
        finite = not not_finite(g for g in grads if g is not None)
        if not finite and not self._skips:
            self._refuse_not_finite(
                step, grads, "the reduced gradient",
                "Applied, it would make every replica's weights NaN for the rest of the run. "
                "Either the run diverged (lower the learning rate, clip the gradients in "
                "before_update, look for a log of 0 or a division by 0 in the loss), or a "
                "worker computes wrongly (a faulty device: compare the ranks' losses). To skip "
                "such steps instead, as mixed precision does, register a grad scaler "
                "(Elastic(grad_scaler=...))",
            )  # fmt: skip
        if self._faults.slow_land():
            time.sleep(SLOW_LAND_S)
        with self._state:
            dropped = self._member.reduced(step.number, step.epoch, stop)
        if dropped is not None:
            # Drop.ANSWERED: our answer to a roll call already named the
            # previous step; applying this one would run it twice.
            return False
        landed = False
        try:
            if not self._fenced():
                with self._state:
                    gone = self._member.ended or self._member.leaving
                if not gone:
                    # The others may have applied this step: a roll call
                    # realigns the view (this worker then pulls the state).
                    self._ask_for_rollcall(
                        f"epoch {step.epoch}: step {step.number} dropped (no fresh heartbeat ack)"
                    )
                return False
            with self._lock:
                self._apply(step, finish, finite, used)
                landed = True
                if self._faults.diverge():
                    self._drift()
                if self._sharded is None and self._checkpoint_due(step):
                    self._due_checkpoint = _DueCheckpoint(step.number, step.epoch)
                if self._sharded is not None:
                    self._due_checkpoint = self._publish_shards(step, group)
        finally:
            with self._state:
                answer = self._member.applied(step.number, landed)
            if answer is not None:
                self._answer_waiting(answer.step)
        self._switching.committed(step.epoch)
        self._time_step(step.epoch)
        self._account(step)
        step.loss = loss / count
        self.ledger.record(
            step.number, step.epoch, step.world_size, self.plan.step_samples(step.number)
        )
        self._loader.step_committed(step.number)
        # Reported with the next heartbeat: waking the control thread at
        # every commit costs the training thread a GIL hand-off. The first
        # step of a view is reported at once.
        self._client.note_progress(step.number)
        if step.epoch != self._progress_epoch:
            self._progress_epoch = step.epoch
            self._loop.call_soon_threadsafe(self._client.report_progress, step.number)
        self._report.step(step, self.plan.global_batch)
        if self._incomplete:
            self._incomplete = False
            return self._complete_step(step)
        return True

    def _check_drift(self) -> None:
        """(Training side, the loop done with the step that landed last.)
        Every ``drift_check_every`` steps of a replicated job, compare this
        replica's state with the others': the maximum of a digest's prefix
        and of its negation over the view's ranks give its largest and
        smallest value. Replicas that differ ask for a roll call, whose most
        common state the others then take (``_say_drifted``). Once per step;
        given up, with the step's state unchecked, if the view changes
        meanwhile (its roll call compares every replica's state anyway).
        In a sharded job, a copy of a partition found differing from its
        sender's at the step's all-gather (``_publish_shards``) stops the
        worker here, and at every later call."""
        if self._drifted_copies is not None:
            self._refuse_drifted_copies(*self._drifted_copies)
        step = self.committed_step
        if step < 0 or not self._check_due(step) or step == self._drift_checked:
            return
        if self._buffers is None or self._sharding is not None or self._aborting():
            # Per-replica buffers differ by design. A sharded job's ranks
            # hold different states: each owner of a partition compares its
            # copy with the sender's in the step's all-gather instead.
            return
        self._drift_checked = step
        group = self._ready_group()
        if group is None or not group.usable or group.size < 2:
            return
        mine = int(self.state_digest().partition(":")[2][:15], 16)  # 60 bits
        bounds = torch.tensor([mine, -mine], dtype=torch.int64)
        try:
            group.allreduce([bounds], ReduceOp.MAX)
        except StepAborted as exc:
            log.debug("step %d: the replicas' states were not compared: %s", step, exc)
            return
        highest, lowest = int(bounds[0]), -int(bounds[1])
        if highest == lowest == mine:
            return
        log.warning(
            "step %d: the replicas' states differ (the %d ranks of view %d do not hold one "
            "digest): a replica drifted from the others, which nothing in a step shows; "
            "asking for a roll call, whose most common state every other replica takes "
            "(docs/worker.md, \"Replicas that drift\")",
            step, group.size, group.epoch,
        )  # fmt: skip
        self._ask_for_rollcall(f"step {step}: the replicas' states differ")

    def _check_due(self, step: int) -> bool:
        """Whether ``step`` is one at which the states or copies are compared
        (every ``drift_check_every`` steps; every rank decides alike)."""
        return (step + 1) % self._config.drift_check_every == 0

    def _refuse_drifted_copies(self, step: int, senders: Mapping[int, str]) -> None:
        """(Training side, sharded.) At step ``step``'s all-gather this
        rank's copies of the partitions ``senders`` names were not bit for
        bit those their senders computed, which the model follows. Nothing
        can say which owner computed right; the trajectory is the senders'.
        A copy that differs from it would change the job's course the
        moment its sender is lost, so this worker stops and says so (its
        partitions are then taken from their other owners)."""
        named = ", ".join(f"{p} (sent by {m})" for p, m in sorted(senders.items()))
        partitions = f"partition{'s' if len(senders) > 1 else ''} {named}"
        if self.metrics is not None:
            self.metrics.drifted.inc()
        message = (
            f"step {step}: this worker's copy of {partitions} of the sharded optimizer state "
            "is not bit for bit the one another owner computed and sent, which the model "
            "follows: the workers do not compute alike (another torch build, other "
            "kernels, another kind of CPU or GPU). Kept, it would change the job's course the "
            "moment that owner is lost, so this worker stops; start it again to rejoin with "
            "the others' copies, and run every worker of a sharded job with one torch build on "
            "one kind of hardware (docs/sharding.md, \"Copies that drift\")"
        )
        log.error("%s", message)
        raise StateDrifted(message)

    def _say_drifted(self, view: View) -> None:
        """(Entering ``view``, whose resume step this worker holds, yet which
        has it fetch that step.) Say so if the state it answered with is
        not the one agreed: its replica had drifted from the others', which
        nothing in a step shows (every replica applies the same reduced
        gradients, and stays identical only if all compute alike)."""
        held = self._served.held()
        if held is None or held[0] != view.resume_step or held[1] == view.digest:
            return
        if self._buffers is None:
            return  # sync_buffers=False: each replica's buffers are its own, digests differ
        if self._previous_view is None or self.member_id not in self._previous_view:
            return  # a joiner: its state is never adopted, whatever it holds
        log.warning(
            "view %d: this worker held step %d as the view's sources do, but with another "
            "state (%s; theirs %s): its replica drifted from the view's sources since they "
            "last agreed, and the steps since were trained on replicas that differ. It takes "
            "their state now. Replicas stay identical only if every worker computes alike: "
            "one torch version and the same kernels on the same kind of hardware, and no "
            "registered state changed differently on one rank (docs/worker.md, \"Replicas "
            "that drift\")",
            view.epoch, held[0], _short(held[1]), _short(view.digest),
        )  # fmt: skip
        if self.metrics is not None:
            self.metrics.drifted.inc()

    def _drift(self) -> None:
        """(Fault injection, ``diverge_steps``.) Nudge the first element of
        the first floating-point parameter by one unit in the last place; in
        a sharded job, of this rank's first copy of a partition (the model's
        parameters are the senders' copies, overwritten at every step)."""
        with torch.no_grad():
            sharded = self._sharded
            mine = sharded.copy_of(sharded.owned[0]) if sharded and sharded.owned else None
            for parameter in mine or self._model.parameters():
                if parameter.is_floating_point() and parameter.numel():
                    first = parameter.view(-1)[:1]
                    first.copy_(torch.nextafter(first, first + 1))
                    return

    def _launcher(self, step: Step) -> Callable[[torch.Tensor], Any]:
        """(overlap=True) Starts a bucket's all-reduce in the view's group;
        one that cannot start (the abort is set, the group broke) is None:
        the step is then aborted at commit. Runs inside autograd's hooks,
        so it must not raise. Made before the last backward pass starts:
        waits for a group still being built (``_ready_group``)."""
        group = self._ready_group()

        def launch(buffer: torch.Tensor) -> Any:
            if group is None:
                return None
            try:
                return group.start_allreduce_sum(buffer)
            except StepAborted:
                return None

        return launch

    def _refuse_not_finite(
        self, step: Step, grads: Sequence[torch.Tensor | None], what: str, advice: str
    ) -> NoReturn:
        """Every rank holds the same reduced gradient (and gives it to the
        same hook), so every rank raises here at the same step, before the
        optimizer steps."""
        named = self._by_name(grads)
        raise NonFiniteGradient(
            f"step {step.number}: {what} is not finite (NaN or infinity in "
            f"{not_finite_names(named)}; this rank's loss "
            f"for the step: {step._loss:g} over {step._count:g} samples): the optimizer did "
            f"not step and every rank stops here, so the model and its replicas hold "
            f"step {step.number - 1}, and no checkpoint holds anything later. {advice}"
        )

    def _by_name(self, tensors: Sequence[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """(For a message.) One tensor per trained parameter, in the
        parameters' order, by the parameter's name; the Nones left out."""
        return {n: t for n, t in zip(self._named_params, tensors, strict=True) if t is not None}

    def _refuse_skipping(self, step: Step) -> NoReturn:
        """The grad scaler has skipped ``max_skipped_steps`` steps in a row:
        the run trains no more, and would end as if it had."""
        assert self._scaler is not None
        first = step.number - self._skipped + 1
        self._refuse_not_finite(
            step, [p.grad for p in self._params],
            f"the reduced gradient of every step since step {first} ({self._skipped} in a row, "
            f"the most max_skipped_steps allows)",
            f"The grad scaler skipped each of them (its scale is now "
            f"{float(self._scaler.get_scale()):g}), so the model has not changed since step "
            f"{first - 1} and would not for the rest of the run. Halving the scale did not make "
            "the gradient finite: the loss itself is not finite, or the weights already hold "
            "NaN. Start again from an earlier checkpoint with a lower learning rate, or raise "
            "Elastic(max_skipped_steps=...) if the scaler is still looking for its scale",
        )  # fmt: skip

    def _reduce_buckets(
        self, step: Step, group: EpochGroup, ask: bool, agreements: Agreements
    ) -> tuple[_Totals, Callable[[], None]]:
        """(overlap=True) Start what the last backward pass did not, sum the
        buffers' changes and ``_totals``, wait for the buckets; returns the
        totals read and ``finish``, which divides the gradients (the
        buckets' views) in place and applies the buffers."""
        buckets = self._buckets
        assert buckets is not None
        pending = buckets.flush(self._launcher(step))
        if any(p is None for p in pending):
            raise StepAborted(f"epoch {step.epoch}: a gradient bucket's all-reduce did not start")
        buckets.check_views()
        small = self._buffers.contributions(step._microbatches, torch.float32) if (
            self._buffers is not None
        ) else []  # fmt: skip
        totals = _totals(step, ask, agreements, buckets.present(self._params))
        # Started after the buckets, as on every rank, and waited for with
        # them: an abandoned wait parks every buffer with the group.
        pending.append(group.start_allreduce_sum(totals))
        changes = torch.cat([c.reshape(-1) for c in small]) if small else None
        if changes is not None:
            pending.append(group.start_allreduce_sum(changes))
        group.finish(pending)
        step._reduced = True
        read = _read_totals(totals, len(self._params))

        def finish() -> None:
            for param in self._params:
                assert param.grad is not None
                param.grad.div_(read.samples)
            if self._buffers is not None and changes is not None:
                offset = 0
                for change in small:
                    change.copy_(changes[offset : offset + change.numel()].view_as(change))
                    offset += change.numel()
                self._buffers.apply(small, self.plan.num_microbatches)

        return read, finish

    def _reduction(
        self, step: Step, ask: bool, agreements: Agreements
    ) -> tuple[list[torch.Tensor], slice]:
        """What the step's one all-reduce sums: every gradient (zeros for a
        parameter without one), the buffers' changes, and ``_totals`` last
        (count, loss, the ranks asking to stop after the step,
        ``Agreements``' terms, which parameters this rank gave a gradient).
        Returns them and where the buffers' entries sit."""
        grads, present = [], []
        for p in self._params:
            present.append(0.0 if p.grad is None else 1.0)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        dtype = grads[0].dtype if grads else torch.float32
        buffers: list[torch.Tensor] = (
            self._buffers.contributions(step._microbatches, dtype)
            if self._buffers is not None
            else []
        )
        totals = _totals(step, ask, agreements, present)
        slots = slice(len(grads), len(grads) + len(buffers))
        return [*grads, *buffers, totals], slots

    def _normalise(self, tensors: list[torch.Tensor], buffer_slots: slice, count: float) -> None:
        """(Default mode.) The summed gradients divided by the global count,
        the buffers set from their summed changes."""
        for grad in tensors[: buffer_slots.start]:
            grad.div_(count)
        if self._buffers is not None:
            self._buffers.apply(tensors[buffer_slots], self.plan.num_microbatches)

    def _apply(
        self, step: Step, finish: Callable[[], None], finite: bool, used: Sequence[bool]
    ) -> None:
        """The update, under ``_lock``: the reduction's gradients and buffers
        (``finish``), hook, optimizer, scaler, scheduler. ``finite``: the
        reduced gradient was (a gradient the hook leaves is then too, or the
        step is refused: a grad scaler would apply it, having found nothing
        when it unscaled). ``used``: by parameter, whether a microbatch of
        some rank gave it a gradient (``_leave_unused``)."""
        self._served.release_live()  # a capture sharing what changes now
        finish()
        _leave_unused(self._params, used)
        if self._sharded is not None and not self._said_unused:
            self._say_unused_updated(step, used)
        self._check_buffers(step)
        self._skipped = 0 if finite else self._skipped + 1
        if self._skipped >= self._max_skipped:
            self._refuse_skipping(step)
        if self._scaler is not None:
            with self._ownership.applying():
                self._scaler.unscale_(self._optimizer)
        probe = None
        # Noise a hook or the optimizer draws is the same on every rank.
        seed_generators(update_seed(self.plan.seed, step.number))
        if self._before_update is not None:
            self._before_update(step)
            self._check_parameters_kept(step, in_hook=True)
            left = [p.grad for p in self._params]
            self._check_gradients_kept(step, left, used)
            if finite and not_finite(g for g in left if g is not None):
                # The reduced gradient was finite: the hook made it not.
                hook = callable_name(self._before_update)
                self._refuse_not_finite(
                    step, left, f"the gradient before_update ({hook}) left",
                    "Applied, it would make every replica's weights NaN for the rest of the "
                    "run. The reduced gradient the hook was given was finite: fix the hook (a "
                    "division by a norm that can be 0 wants an epsilon)",
                )  # fmt: skip
            probe = HookAgreement.probe(self._params)
        self._applied = _Applied(
            step.number, settings_tag(self._optimizer), probe, learning_rates(self._optimizer)
        )
        with self._ownership.applying():
            if self._sharded is not None:
                self._sharded.update()  # this rank's partitions; the others' arrive next
                # The user's optimizer never steps: tell torch's LR schedulers
                # an update ran (their marker), or they warn of a wrong order.
                self._optimizer._opt_called = True  # type: ignore[attr-defined]
            elif self._scaler is not None:
                self._scaler.step(self._optimizer)
                self._scaler.update()
            else:
                self._optimizer.step()
        self._ownership.step_scheduler()
        if self._sharded is None:
            self._check_updated(step)
        self._drop_gradients()

    def _say_unused_updated(self, step: Step, used: Sequence[bool]) -> None:
        """(Sharded, once.) A parameter no microbatch reached has no
        ``.grad`` now, but the sharded update runs over flat partitions
        that cut across parameters and gives it a zero gradient, which an
        optimizer with momentum or weight decay moves it by; a plain loop
        would leave it alone."""
        unused = self._by_name([None if u else p for p, u in zip(self._params, used, strict=True)])
        if unused:
            self._said_unused = True
            log.warning(
                "step %d: no microbatch gave a gradient to %s: a sharded job updates such "
                "parameters with a zero gradient (its optimizer's momentum and weight decay "
                "move them), where a plain loop or a replicated job leaves them alone. Said "
                "once; train with shard_redundancy=None to leave them alone",
                step.number, some_of(list(unused), len(self._params)),
            )  # fmt: skip

    def _check_buffers(self, step: Step) -> None:
        """(Under ``_lock``, once the step's buffers are applied.) The
        model's float buffers that were finite when ``Elastic`` was built
        must still be (a causal mask of ``-inf`` is left alone). A forward
        pass over a sample that is NaN makes a batch norm's running
        statistics NaN; with a grad scaler the step's gradient is then
        skipped, but the statistics have moved, and every evaluation of the
        model reads NaN from then on while training (on batch statistics)
        goes on. With the buffers synchronised every rank holds the same and
        raises here, before a checkpoint of the step is written or its state
        served."""
        named = buffers_not_finite(self._model, self._finite_buffers)
        if not named:
            return
        raise NonFiniteGradient(
            f"step {step.number}: the buffers the step's forward passes left are not finite "
            f"(NaN or infinity in {not_finite_names(named)}; this rank's loss for the step: "
            f"{step._loss:g} over {step._count:g} samples): kept, every evaluation of the "
            "model (model.eval(), on the running statistics) would read NaN from here on, "
            "while training goes on. This rank stops here (with the buffers synchronised, "
            f"every rank does), so no checkpoint holds step {step.number} or later, and no "
            "worker is given its state. Look for a sample that is NaN or infinite in the "
            "step's data (a forward pass over it made them so), and start again from the "
            "last checkpoint"
        )

    def _check_updated(self, step: Step) -> None:
        """(Under ``_lock``, after the update: at the end of ``_apply``, or
        after a sharded job's all-gather.) The parameters must be finite: an
        optimizer makes NaN of a finite gradient (Adam with ``eps=0`` on a
        gradient of 0, a learning rate the scheduler made NaN or infinite).
        Every rank computed the same update, so every rank raises here,
        before a checkpoint of the step is written or its state served."""
        if not not_finite(p.detach() for p in self._params):
            return
        named = self._by_name([p.detach() for p in self._params])
        assert self._applied is not None
        raise NonFiniteGradient(
            f"step {step.number}: the parameters the optimizer's update left are not finite "
            f"(NaN or infinity in {not_finite_names(named)}), though the gradient it was given "
            f"was (its learning rates: {self._applied.rates}): every rank computed "
            f"the same update and stops here, so no checkpoint holds step {step.number} or "
            "later, and no worker is given its state. Look at the optimizer's settings (a "
            "learning rate the scheduler made NaN or infinite, an eps of 0 in a denominator) "
            "and start again from the last checkpoint"
        )

    def _check_model(self, step: Step) -> None:
        """(Every step, before the reduction.) The model's parameters as
        ``Elastic`` was built with them (``ParameterWatch``), and no
        parameter added to the optimizer that the model does not hold."""
        sizes = _group_sizes(self._optimizer)
        if sizes != self._groups_seen:
            check_optimizer_params(self._model, self._optimizer)
            self._groups_seen = sizes
        self._parameter_watch.check(step.number, full=self._check_due(step.number))

    def _check_gradients_kept(
        self, step: Step, left: Sequence[torch.Tensor | None], used: Sequence[bool]
    ) -> None:
        """(After ``before_update``.) A hook that sets every gradient to None
        gives the update no gradient: the optimizer skips every parameter (a
        sharded job's applies a zero gradient, which only momentum and
        weight decay move them by). Now and then that is a choice (a hook
        that skips a step whose gradient spikes); at ``max_skipped_steps``
        steps in a row it is a plain loop's ``optimizer.zero_grad()`` moved
        into the hook, and the job would train on with a model that never
        learns. Every rank runs the same hook on the same reduced gradient,
        so every rank raises here, before the update. A hook that drops some
        gradients (a part it freezes) is left alone, as is one that zeroes
        them in place (not seen)."""
        kept = [grad for grad, was_used in zip(left, used, strict=True) if was_used]
        self._dropped = self._dropped + 1 if kept and all(g is None for g in kept) else 0
        if self._dropped < self._max_skipped:
            return
        first = step.number - self._dropped + 1
        raise UsageError(
            f"step {step.number}: before_update ({callable_name(self._before_update)}) set every "
            f"gradient to None at each step since step {first} ({self._dropped} in a row, the "
            "most max_skipped_steps allows): no update since has been given a gradient (the "
            "optimizer skips a parameter without one; a sharded job's applies a zero gradient), "
            "and none would be for the rest of the run. Leave the gradients in place in the "
            "hook (the runtime drops them after every update: a plain loop's "
            "optimizer.zero_grad() is not needed there); a hook that skips an update now and "
            "then is fine, or raise Elastic(max_skipped_steps=...)"
        )

    def _check_parameters_kept(self, step: Step, in_hook: bool = False) -> None:
        """(Sharded, every ``drift_check_every`` steps: before the reduction,
        and after ``before_update`` if there is one.) A sharded job's
        parameters are its optimizer's: each update starts from the owners'
        copies, and the all-gather writes them into the model. A change the
        loop made to the model's parameters since (after ``commit()``: a
        clamp, a renormalisation; or in ``before_update``, whose change this
        very step's all-gather overwrites) would be lost, on every rank
        alike, with no error; refused instead. Each rank checks the
        partitions it sends."""
        sharded, view = self._sharded, self._shard_view
        if sharded is None or view is None or not self._check_due(step.number):
            return
        changed = sharded.changed(view.ids)
        if not changed:
            return
        named = ", ".join(map(str, changed[:8]))
        if len(changed) > 8:
            named += f" and {len(changed) - 8} more"
        when, lost = (
            ("in before_update", "lost at this step's all-gather")
            if in_hook
            else ("outside the optimizer since the last update", "lost at the next step")
        )
        raise UsageError(
            f"step {step.number}: the model's parameters were changed {when} (partitions "
            f"{named} differ from this rank's copy): in a sharded job the parameters are the "
            f"optimizer's, and each update starts from its copies, so such a change is {lost}. "
            "Change only the gradients in before_update, and run a job whose loop changes its "
            "parameters unsharded (without shard_redundancy) (docs/sharding.md, \"What is "
            "refused\")"
        )

    def _check_scheduler_registered(self) -> None:
        """A scheduler built on the optimizer after ``Elastic`` was, or the
        registered one stepped outside the runtime. With one registered,
        another is looked for again at this process's first commit (~20 ms,
        once): a warm-up built after ``Elastic``, before the loop."""
        if self._scheduler is None:
            check_scheduler(None, self._optimizer)
            return
        if not self._schedulers_rechecked:
            self._schedulers_rechecked = True
            check_scheduler(self._scheduler, self._optimizer, registered=self._extras.values())
        self._ownership.check_schedule()

    def _account(self, step: Step) -> None:
        """Metrics for a committed step; after the first one of a view, tell
        the leader how entering the view went (for the events file)."""
        metrics = self.metrics
        if metrics is not None:
            metrics.steps.inc()
            metrics.samples.inc(self.plan.global_batch)
            metrics.step_seconds.set(self._step_seconds)
        entering = self._entering
        if entering is None or entering[0] != step.epoch:
            return
        self._entering = None
        epoch, fetch_s, rebuild_s, ready = entering
        report = rendezvous_pb2.ViewReport(
            epoch=epoch, fetch_s=fetch_s, rebuild_s=rebuild_s,
            first_step_s=time.monotonic() - ready, lost_work_s=self._lost_work,
            step_s=self._step_seconds, launch_s=self._launch_s,
            global_batch=self.plan.global_batch,
        )  # fmt: skip
        if metrics is not None:
            for phase in ("fetch", "rebuild", "first_step"):
                metrics.stall.labels(phase).observe(getattr(report, f"{phase}_s"))
            metrics.lost_work.inc(self._lost_work)
        self._lost_work = 0.0
        self._loop.call_soon_threadsafe(self._client.report_view, report)

    def _checkpoint_writer(self, world_size: int) -> int:
        """The rank that writes the replicated state's checkpoints in a view
        of ``world_size``: the one the data plan gives the fewest
        microbatches, so that the state's capture and its write run while
        that rank would wait for the others in the next reduction, not on
        the step's longest path (rank 0, which wrote before, runs the most)."""
        return self.plan.lightest_rank(world_size)

    def _checkpoint_due(self, step: Step) -> bool:
        """The view's checkpoint writer writes a checkpoint after every
        ``checkpoint_every``-th step."""
        return (
            self.checkpoints is not None
            and step.rank == self._checkpoint_writer(step.world_size)
            and (step.number + 1) % self._checkpoint_every == 0
            and self.checkpoints.ready(step.number)
        )

    def _time_step(self, epoch: int) -> None:
        """Average wall time between commits within one view (T_step)."""
        now = time.monotonic()
        if self._last_commit is not None and self._last_commit[0] == epoch:
            seconds = now - self._last_commit[1]
            self._step_seconds = (
                seconds if self._step_seconds == 0 else 0.9 * self._step_seconds + 0.1 * seconds
            )
        self._last_commit = (epoch, now)

    def _publish_checkpoint(
        self, manifest: CheckpointManifest
    ) -> tuple[bool, tuple[CheckpointManifest, ...]]:
        """(Writer thread.) Publish through the rendezvous service, after
        reporting the progress that allows it (the service refuses a
        checkpoint beyond the job's progress; progress reports are sparse)."""
        step = max(self.committed_step, manifest.step)
        self._loop.call_soon_threadsafe(self._client.report_progress, step)
        return self._call(
            self._client.publish_checkpoint(manifest), timeout=self._config.client_call_deadline
        )

    def _save_before_exit(self) -> CheckpointManifest | str | None:
        """etcd lost the job's record and no replica remembers it: write the
        state this worker holds (its last committed step) to the checkpoint
        directory, so that workers started again resume from it rather than
        from an older checkpoint. The last view's checkpoint writer
        writes, as it writes every checkpoint: the members may hold steps
        one apart (a step dropped for want of a heartbeat acknowledgement),
        and workers started again take the newest written file. The
        manifest written, why it was not (a text), or None (no checkpoint
        directory, nothing trained, not the writer)."""
        if self.checkpoints is None or self.committed_step < 0 or self.member_id is None:
            return None
        if self._view.rank_of(self.member_id) != self._checkpoint_writer(self._view.size):
            return None
        if self._sharded is not None:
            return "the optimizer state is sharded: writing it needs every rank"
        try:
            with self._lock:
                state = self._capture(self.committed_step)
            return self.checkpoints.write_last(
                state, self._view.epoch, self.member_id, self._step_seconds,
                timeout=self._config.client_call_deadline,
            )  # fmt: skip
        except Exception as exc:  # said in the exit line: the older files remain
            return describe_failure(exc)

    def _checkpoint_failed(self, step: int, reason: str) -> None:
        """(Writer thread.) Durability is stuck: count it, tell the leader."""
        if self.metrics is not None:
            self.metrics.checkpoint_failures.inc()

        def report() -> None:
            if self._client.ended is None and self._joined:
                self._client.report_checkpoint_failure(step, reason)

        self._loop.call_soon_threadsafe(report)

    def _checkpoint_durable(self, step: int) -> None:
        """(Writer thread.) A checkpoint of ``step`` is recorded."""
        if self.metrics is not None:
            self.metrics.checkpoints.inc()
            self.metrics.durable_step.set(step)

    def _resume_from_checkpoint(self, view: View) -> None:
        """No member of ``view`` holds any state: load the newest usable
        durable checkpoint, if the job has one, and report the replay cost.
        Raises ``CheckpointUnusable`` when checkpoints exist but none loads,
        and ``ProgressLost`` when the job has progress but no checkpoint
        (the worker must not start the job from scratch on its own)."""
        # A worker that trained in an earlier view was not launched again.
        launch = process_age() if self._previous_view is None else 0.0
        status = self._remote(self._client.status(), f"epoch {view.epoch}: reading checkpoints")
        chosen = choose(
            status, job=self.job_name, start_over=self._start_over, fingerprint=self.fingerprint,
            directory=self.checkpoints.directory if self.checkpoints else None,
        )  # fmt: skip
        if chosen is None:
            self._refuse_an_earlier_runs_ledger()
            return
        loaded, orphans = chosen.loaded, chosen.orphans
        with self._lock:
            self._restore(loaded.state)
            self._served.serve(None)  # served without RNG states, captured at the roll call
            if self._sharding is not None:
                # At once: a rank holding the step must hold the plan's shards.
                self._build_shards(view)
        if orphans is not None:
            self._adopted = (loaded.manifest, orphans.manifests)
            log.warning(
                "job %s has no record in etcd (no progress, no checkpoint manifest), but %s "
                "holds %d checkpoint files of it: etcd probably lost the job's data. Resumed "
                "from the newest written one that verifies, step %d (%s, written %s); it is "
                "published again once the job resumes from it",
                self.job_name, self.checkpoints.directory if self.checkpoints else "?",
                len(orphans.manifests) + len(orphans.unchecked), loaded.manifest.step,
                Path(loaded.manifest.uri).name,
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(loaded.manifest.created_unix)),
            )  # fmt: skip
        s_ckpt = loaded.manifest.step
        self.resumed = ReplayCost(
            s_done=max(s_ckpt, status.last_step if status.last_step is not None else s_ckpt),
            s_ckpt=s_ckpt,
            t_step=loaded.manifest.step_seconds,
            t_launch=launch,
            t_load=loaded.seconds,
        )
        self._report.resumed(self.resumed)
        log.warning(
            "%s: resumed from the checkpoint of step %d (%s); replay cost %.2f s "
            "(%d steps x %.3f s + launch %.2f s + load %.3f s)",
            "partitions of the optimizer state were lost" if view.shards and view.shards.lost
            else "no live replica",
            s_ckpt, loaded.manifest.uri, self.resumed.seconds, self.resumed.replay_steps,
            self.resumed.t_step, launch, loaded.seconds,
        )  # fmt: skip

    def _refuse_an_earlier_runs_ledger(self) -> None:
        """The job starts at step 0 (a new job, or one started over): steps
        this worker's ledger file already holds are another run's, and this
        run's would be recorded after them (its first commit would fail on
        "step 0 is already recorded", after the update). ``UsageError``
        before anything trains; the file is left as it is."""
        recorded = self.ledger.steps()
        if not recorded:
            return
        raise UsageError(
            f"the ledger {self.ledger.path} already holds steps {min(recorded)} to "
            f"{max(recorded)} ({len(recorded)} records), but this worker starts job "
            f"{self.job_name} at step 0 (a new job, or one started over): those are another "
            "run's, and this run's steps would be recorded after them. Give each run a ledger "
            "file of its own (another path) or move that one away; nothing was trained"
        )

    def _fenced(self) -> bool:
        """Fencing before an update: the leader must have acknowledged a
        heartbeat sent within ``fence_window`` (it evicts a member only after
        the detector's earliest suspicion, later than that). A frozen or
        cut-off worker (a partition drops its writes silently) has no such
        acknowledgement and must not commit in its old epoch; a live one
        gets the next within a heartbeat interval, or, while the service
        fails over to a new leader, within seconds: this waits up to
        ``fence_patience`` for it, and past that for as long as the session
        is between leaders (a failover can take longer on a loaded machine),
        so that every member that completed the reduction lands the step
        alike. The next leader's answer ends that wait: an acknowledgement,
        or the end of a session it no longer holds."""
        since = time.monotonic()
        said = False
        told = since + self._config.fence_patience  # when the long wait was last said
        while True:
            between = self._client.between_leaders()
            now = time.monotonic()
            with self._state:
                self._member.acked(self._client.last_acked)
                verdict = self._member.fence(now, since, between)
                if self._faults.held_state():
                    time.sleep(HELD_STATE_S)
            if verdict is Fence.OK:
                if said:
                    log.info("acknowledged after %.2f s: applying the step", now - since)
                return True
            if verdict is Fence.EXPIRED:
                log.warning("no recent heartbeat acknowledgement: not applying the step")
                return False
            if not said and now - since > self._config.fence_window:
                said = True
                log.info(
                    "waiting up to %.0f s for the rendezvous service to acknowledge a heartbeat "
                    "before applying the step (a leader failover?), longer while no leader answers",
                    self._config.fence_patience,
                )  # fmt: skip
            if between and now >= told:
                told = now + self._config.unreachable_notice
                log.warning(
                    "no rendezvous leader has acknowledged this worker for %.0f s (a failover?): "
                    "the step waits for the next leader rather than be dropped where other "
                    "members land it, and lands once it acknowledges this worker (the session "
                    "ends if it no longer holds it)", now - self._client.last_acked,
                )  # fmt: skip
            time.sleep(self._config.abort_poll)

    def _note_failure(self, what: str, detail: str = "") -> None:
        """A peer call or collective failed (``detail``: the transport's own
        text, logged at DEBUG only). Usually the failed peer's own session
        broke too and a roll call is already coming; if none comes within the
        detector's bound, ``_wait_for_view`` reports it."""
        reason = f"{what}: {describe_transport(detail)}" if detail else what
        log.info("%s", reason)
        if detail:
            log.debug("%s: %s", what, detail)
        with self._state:
            self._member.failed(time.monotonic(), reason[:200])

    def _ask_for_rollcall(self, reason: str) -> None:
        """Our state or group no longer matches the view: ask for a roll call
        now, and again after the detector's bound if no view follows."""
        self._note_failure(reason)
        self._loop.call_soon_threadsafe(self._client.request_rollcall, reason)

    # --- shutdown ---------------------------------------------------------------------

    def close(self, leave: bool = True) -> None:
        """Leave the job cleanly (the others reconfigure at once), stop the
        state server, and wait until no abandoned collective is in flight."""
        if self._closed:
            return
        self._closed = True
        self._report.ended(sys.exc_info()[1] or self._client.ended)
        self._restore_signals()
        self._ownership.release()
        self._parameter_watch.release()
        if self._guard is not None:
            self._guard.release()
        if self.checkpoints is not None and not self.checkpoints.wait(
            self._config.collective_timeout
        ):
            log.warning("a checkpoint was still being written at exit; it is not published")
        try:
            if leave and not self._left and self._client.ended is None:
                self._left = True
                self._call(self._client.leave(), timeout=self._config.client_call_deadline)
        except (RollcallError, TimeoutError) as exc:
            log.warning("leave failed: %s", exc)
        finally:
            self._loader.close()
            self.ledger.close()
            self._drop_group()
            self._switching.restore()
            self._stop_loop()
            wait_parked(self._config.collective_timeout + 5)
            stop_metrics(self._metrics_server)

    def _stop_loop(self) -> None:
        async def shutdown() -> None:
            await self._client.close()
            if self._fetcher is not None:
                await self._fetcher.close()
            if self._server is not None:
                await self._server.stop(0.5)
            if self._servicer is not None:
                self._servicer.close()  # its data channel, and the fetches it serves

        try:
            self._call(shutdown(), timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def __enter__(self) -> Elastic:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass(frozen=True)
class _FetchInFlight:
    """A state fetch running while the view's first step runs without this
    worker's microbatches (``Elastic._fetches_during_first_step``): the
    state of ``step`` for ``view``, loaded at that step's commit."""

    view: View
    step: int
    future: Future[Any]
    #: The digest of this worker's own state when the fetch began: the loop
    #: must not change it before the fetched state is loaded.
    held: str


@dataclass(frozen=True)
class _Carry:
    """What a rank finished of an aborted step, kept for its next attempt:
    the microbatches (their gradients stay in ``.grad``, or in exact mode
    in ``ExactStep``, and their buffer changes in the buffers), the step's
    count, loss and microbatches run so far, the parameters' versions when
    it was set aside, and the seconds the attempt took."""

    step: int
    done: tuple[int, ...]
    count: int
    loss: float
    microbatches: int
    params: tuple[int, ...]
    seconds: float


@dataclass(frozen=True)
class _DueCheckpoint:
    """A checkpoint due at a step, captured once the step settled. In a
    sharded job: the optimizer entry (``param_groups`` and layout), every
    part of the checkpoint, and this rank's own part's bytes."""

    step: int
    epoch: int
    optimizer: dict[str, Any] | None = None
    parts: tuple[CheckpointPart, ...] = ()
    own_part: bytes | None = None


def _short(digest: str) -> str:
    """A digest as a log line names it: its form and 16 hex digits."""
    form, _, value = digest.partition(":")
    return f"{form}:{value[:16]}" if value else digest


def _settle(future: asyncio.Future[int | None], step: int | None) -> None:
    if not future.done():
        future.set_result(step)


class _Abort:
    """The abort flag the group of view ``epoch`` polls, its build and its
    collectives: a newer roll call was answered, the session ended, or the
    worker is leaving or closed (``Member.aborts``)."""

    def __init__(self, job: Elastic, epoch: int) -> None:
        self._job = job
        self._epoch = epoch

    def is_set(self) -> bool:
        return self._job._member.aborts(self._epoch) or self._job._closed


class _GroupBuild:
    """The group of view ``view`` (this worker's ``rank`` in it) built by
    ``make`` on a thread of its own, which calls ``ready`` once it is; the
    training thread computes meanwhile and takes it over with ``result``.
    ``make`` ends by itself once the view is aborted (it polls the same
    abort as the group), so ``result`` never waits long for a view given
    up."""

    def __init__(
        self, view: View, rank: int, make: Callable[[], EpochGroup], ready: Callable[[], None]
    ) -> None:
        self.view = view
        self.rank = rank
        self.size = view.size
        #: Seconds the build took, and when it ended (monotonic), once done.
        self.seconds = 0.0
        self.ready_at = 0.0
        self._make = make
        self._ready = ready
        self._done = threading.Event()
        self._group: EpochGroup | None = None
        self._error: BaseException | None = None
        threading.Thread(
            target=self._run, name=f"rollcall view {view.epoch} group", daemon=True
        ).start()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            self._group = self._make()
        except BaseException as exc:  # handed to the training thread, never lost
            self._error = exc
        else:
            self._ready()
        self.seconds = time.perf_counter() - started
        self.ready_at = time.monotonic()
        self._done.set()

    def result(self) -> EpochGroup:
        """The group, once built; the build's StepAborted (or any other
        error) raised here, on the training thread."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._group is not None
        return self._group


__all__ = [
    "Batch",
    "CheckpointUnusable",
    "Elastic",
    "Evicted",
    "Interrupted",
    "NonFiniteGradient",
    "ProgressLost",
    "StateDrifted",
    "Step",
    "UsageError",
    "ViewChanged",
    "default_collate",
]
