"""The keep-alive runtime inside a training process.

A user keeps an ordinary PyTorch loop and adds a few lines::

    with Elastic(model, optimizer, dataset, global_batch=32, micro_batch=8) as job:
        for step in job.steps(1000):
            for batch in step.microbatches():
                loss_sum, count = my_loss(model, batch.inputs, batch.targets)
                step.backward(loss_sum, count)
            step.commit()

``Elastic`` joins the job through the rendezvous service, owns the step loop's
safe points and, for each committed view, builds a fresh gloo group, pulls the
current state from live peers when this worker is behind or new, and tells
each rank which microbatches of the global batch it runs. ``commit`` sums the
gradients (and sample counts) over the view, divides by the step's global
count and applies the optimizer step; it returns False when the step was
aborted by a view change, in which case ``steps`` hands out the same step
number again once the new view is in place.

Threads: the training thread runs the user's loop; a control thread runs an
asyncio loop with the rendezvous session and the state server. They meet
through ``_lock`` (held while an update is applied or state is restored or
captured) and the ``_abort`` event.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from membership.checkpoint import CheckpointManifest, ReplayCost
from membership.config import Config
from membership.errors import ControlPlaneUnavailable, Evicted, RollcallError
from membership.view import EMPTY_VIEW, View
from rendezvous.client import ClientTLS, RendezvousClient
from rendezvous.metrics import serve
from rendezvous.metrics import stop as stop_metrics
from rendezvous.wire import TokenInterceptor, read_token
from rollcall.pb import rendezvous_pb2, state_pb2_grpc
from worker.checkpoint import CheckpointUnusable, CheckpointWriter, load_newest, process_age
from worker.faults import Faults
from worker.group import EpochGroup, PeerFailed, StepAborted, host_store, wait_parked
from worker.loader import Batch, LoaderOptions, MicrobatchLoader, default_collate
from worker.metrics import WorkerMetrics
from worker.plan import Ledger
from worker.state import CorruptState, capture, digest, restore, to_bytes
from worker.transfer import Snapshot, StateFetcher, StateServer, TransferFailed

log = logging.getLogger("rollcall.worker")
T = TypeVar("T")

#: Environment variables read when the constructor is not told.
ENV_RENDEZVOUS = "ROLLCALL_RENDEZVOUS"
ENV_JOB = "ROLLCALL_JOB"
#: How often a waiting training thread looks at the abort flag.
ABORT_POLL = 0.005


class Step:
    """One global step as this rank sees it."""

    def __init__(self, job: Elastic, number: int, view: View, rank: int) -> None:
        self.number = number
        self.epoch = view.epoch
        self.rank = rank
        self.world_size = view.size
        self._job = job
        self.started = time.monotonic()
        self._count = 0
        self._loss = 0.0
        self.aborted = False
        self.committed = False
        #: Mean loss over the global batch, known after a successful commit.
        self.loss: float | None = None

    def microbatches(self) -> Iterator[Batch]:
        """This rank's microbatches of the step (loaded ahead when there are
        loader workers), each handed out with the torch RNG seeded from
        (seed, step, microbatch index) only. Stops early on an abort."""
        job = self._job
        for mb in job.plan.for_rank(self.number, self.rank, self.world_size):
            if job._abort.is_set():
                self.aborted = True
                return
            data = job._loader.get(mb.step, mb.index)
            torch.manual_seed(mb.seed)
            yield Batch(mb, data)

    def backward(self, loss_sum: torch.Tensor, count: int) -> None:
        """Accumulate gradients of a loss *summed* over ``count`` samples or tokens."""
        loss_sum.backward()
        self._count += count
        self._loss += float(loss_sum.detach())

    def commit(self) -> bool:
        """Sum gradients over the view and apply the update. False if the step
        was aborted (nothing was applied; the step will be handed out again)."""
        self.committed = self._job._commit(self)
        return self.committed


class Elastic:
    """Data-parallel training that survives workers dying and arriving."""

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
        rendezvous: Sequence[str] | str | None = None,
        job: str | None = None,
        token: str | None = None,
        host: str = "127.0.0.1",
        name: str = "w",
        collate: Callable[[Sequence[Any]], Any] | None = None,
        ledger: Path | str | None = None,
        config: Config | None = None,
        tls: ClientTLS | None = None,
        group_timeout: float = 30.0,
        checkpoint_dir: Path | None = None,
        checkpoint_every: int = 100,
        metrics_port: int | None = None,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        pin_memory: bool = False,
    ) -> None:
        addresses = rendezvous if rendezvous is not None else os.environ.get(ENV_RENDEZVOUS, "")
        if isinstance(addresses, str):
            addresses = [a for a in addresses.split(",") if a]
        if not addresses:
            raise ValueError(f"no rendezvous address: pass rendezvous= or set {ENV_RENDEZVOUS}")
        self.job_name = job or os.environ.get(ENV_JOB, "")
        if not self.job_name:
            raise ValueError(f"no job name: pass job= or set {ENV_JOB}")
        self._token = token or read_token(None)
        self._config = config or Config()
        self._faults = Faults.from_env()
        self._model = model
        self._optimizer = optimizer
        self._scheduler = scheduler
        self._host = host
        self._group_timeout = group_timeout
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        self._checkpoint_every = checkpoint_every
        self.ledger = Ledger(Path(ledger) if ledger is not None else None)
        # A DataLoader as `dataset` brings its collate_fn and worker settings.
        self._loader = MicrobatchLoader.open(
            dataset, global_batch=global_batch, micro_batch=micro_batch, seed=seed,
            collate=collate, options=LoaderOptions(
                num_workers=num_workers, prefetch_factor=prefetch_factor,
                worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
                pin_memory=pin_memory,
            ),
        )  # fmt: skip
        # Forked loader workers must start before any socket or thread exists.
        self._loader.start()
        self.plan = self._loader.plan
        self.committed_step = -1
        self.member_id: str | None = None
        self._params = [p for p in model.parameters() if p.requires_grad]

        self._lock = threading.Lock()
        # Signalled when a step whose all-reduce completed has been applied
        # or dropped; ``_applying`` is true in between.
        self._applied = threading.Condition(self._lock)
        self._applying = False
        self._view_changed = threading.Condition()
        self._view: View = EMPTY_VIEW
        self._abort = threading.Event()
        self._rollcall_epoch = 0
        self._frozen = False
        self._snapshot: Snapshot | None = None
        self._group: EpochGroup | None = None
        self._store_ports: dict[int, asyncio.Future[int]] = {}
        self._closed = False
        self._failure: tuple[float, str] | None = None
        self._abandoned = 0  # epoch of the last view given up while entering it
        #: Set when this worker resumed the job from a durable checkpoint.
        self.resumed: ReplayCost | None = None
        self._step_seconds = 0.0  # moving average of a committed step's wall time
        self._launch_s = 0.0  # process start to joined
        self._lost_work = 0.0  # compute thrown away since the last view report
        # (epoch, fetch s, rebuild s, monotonic time the group was ready) of
        # the view entered last, until its first commit is reported.
        self._entering: tuple[int, float, float, float] | None = None
        self.metrics = WorkerMetrics() if metrics_port is not None else None
        self._metrics_server = (
            serve(self.metrics.registry, metrics_port, host)
            if self.metrics is not None and metrics_port is not None  # both: mypy narrows each
            else None
        )
        self._last_commit: tuple[int, float] | None = None  # (epoch, monotonic time)
        self._progress_sent = (0, 0.0)  # (epoch, monotonic time) of the last report

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollcall", daemon=True)
        self._thread.start()
        self._client = RendezvousClient(addresses, self.job_name, self._token, self._config, tls)
        self._fetcher: StateFetcher | None = None
        self._server: grpc.aio.Server | None = None
        self.checkpoints = (
            CheckpointWriter(Path(checkpoint_dir), self._publish_checkpoint)
            if checkpoint_dir is not None
            else None
        )
        try:
            self._call(self._start(name))
        except BaseException:
            self._stop_loop()
            stop_metrics(self._metrics_server)
            self._loader.close()
            raise

    # --- the control thread -------------------------------------------------------

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    async def _start(self, name: str) -> None:
        server = grpc.aio.server(interceptors=[TokenInterceptor(self._token)])
        state_pb2_grpc.add_StateTransferServicer_to_server(
            StateServer(
                self.job_name,
                self._config,
                own_id=lambda: self.member_id,
                current_view=lambda: self._view,
                snapshot=lambda: self._snapshot,
                store_port=self._store_port,
                faults=self._faults,
            ),
            server,
        )
        port = server.add_insecure_port(f"{self._host}:0")
        await server.start()
        self._server = server
        self.address = f"{self._host}:{port}"
        self.member_id = await self._client.join(
            self.address,
            name=name,
            on_roll_call=self._on_roll_call,
            on_view=self._on_view,
            on_end=self._on_end,
        )
        self._launch_s = process_age()
        self._fetcher = StateFetcher(self.job_name, self.member_id, self._token)
        log.info(
            "joined job %s as %s (state server %s)", self.job_name, self.member_id, self.address
        )

    def _on_view(self, view: View) -> None:
        with self._view_changed:
            self._view = view
            self._view_changed.notify_all()

    def _on_end(self, error: RollcallError) -> None:
        """The session ended for good (evicted...): stop the step in flight."""
        self._abort.set()
        with self._view_changed:
            self._view_changed.notify_all()

    async def _on_roll_call(self, epoch: int) -> tuple[int | None, str]:
        """Abort the step in flight, then answer with the last committed step
        and the digest of the state this worker will serve."""
        self._rollcall_epoch = max(self._rollcall_epoch, epoch)
        self._abort.set()
        with self._view_changed:
            self._view_changed.notify_all()
        return await asyncio.get_running_loop().run_in_executor(None, self._freeze)

    def _freeze(self) -> tuple[int | None, str]:
        """(Control side, in a worker thread.) Once an answer is given, no
        further update may be applied until the next view."""
        with self._lock:
            # A step whose all-reduce completed has every member's
            # contribution: let it land first, so the answer names it and
            # every member that completed the reduce answers alike.
            self._applied.wait_for(lambda: not self._applying)
            self._frozen = True
            if self.committed_step < 0:
                return None, ""
            if self._snapshot is None or self._snapshot.step != self.committed_step:
                state = capture(
                    self.committed_step, self._model, self._optimizer, self._scheduler,
                    with_rng=False,
                )  # fmt: skip
                self._snapshot = Snapshot(self.committed_step, digest(state), to_bytes(state))
            return self.committed_step, self._snapshot.digest

    async def _store_port(self, epoch: int) -> int:
        future = self._store_ports.setdefault(epoch, self._loop.create_future())
        return await asyncio.wait_for(asyncio.shield(future), self._group_timeout)

    def _publish_store_port(self, epoch: int, port: int) -> None:
        future = self._store_ports.setdefault(epoch, self._loop.create_future())
        if not future.done():
            future.set_result(port)
        for old in [e for e in self._store_ports if e < epoch - 1]:
            del self._store_ports[old]

    # --- the training thread ---------------------------------------------------------

    def steps(self, max_steps: int) -> Iterator[Step]:
        """Steps ``committed + 1 .. max_steps - 1``, each handed out again
        after an aborted attempt, in whatever view is current then."""
        while self.committed_step + 1 < max_steps:
            view = self._wait_for_view()
            try:
                rank = self._enter(view)
            except StepAborted as exc:
                log.info("view %d abandoned while entering it: %s", view.epoch, exc)
                if isinstance(exc, PeerFailed):
                    self._note_failure(str(exc))
                # Not entered again: the next view (a roll call is coming, or
                # is asked for by _wait_for_view) replaces it.
                self._abandoned = view.epoch
                continue
            while self.committed_step + 1 < max_steps and not self._abort.is_set():
                step = Step(self, self.committed_step + 1, view, rank)
                yield step
                if not step.committed:
                    self._lost_work += time.monotonic() - step.started
                    if self.metrics is not None:
                        self.metrics.aborted.inc()
                    break

    def _wait_for_view(self) -> View:
        """The newest committed view that contains this worker and that it
        has not entered yet."""
        entered = max(self._group.epoch if self._group is not None else 0, self._abandoned)
        reported = False
        with self._view_changed:
            while True:
                ended = self._client.ended
                if ended is not None:
                    raise ended
                view = self._view
                if self.member_id in view and view.epoch > entered:
                    if self._rollcall_epoch <= view.epoch:
                        self._failure = None
                        return view
                failure = self._failure
                silent = failure is not None and time.monotonic() - failure[0]
                if silent and silent > self._config.detection_bound() and not reported:
                    reported = True
                    self._report_failure()
                self._view_changed.wait(timeout=ABORT_POLL * 10)

    def _enter(self, view: View) -> int:
        """Pull state if behind, build the group for ``view``; returns our rank.
        Raises ``StepAborted`` if a newer roll call, a dead peer or a timeout
        gets in the way (``steps`` then waits for the next view)."""
        fetched = 0.0
        assert self.member_id is not None and self._fetcher is not None
        rank = view.rank_of(self.member_id)
        assert rank is not None
        with self._lock:
            self._frozen = False
            if self._rollcall_epoch <= view.epoch:
                self._abort.clear()
        if self._abort.is_set():
            raise StepAborted(f"epoch {view.epoch}: a newer roll call is under way")
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
        if self.member_id in view.fetch or behind:
            sources = view.fetch.get(self.member_id) or tuple(
                m.id for m in view.members if m.id != self.member_id
            )
            addresses = [m.address for m in view.members if m.id in sources]
            blob, state, report = self._remote(
                self._fetcher.fetch(addresses, view.epoch, view.digest, self._group_timeout),
                f"epoch {view.epoch}: state fetch",
            )
            with self._lock:
                restore(state, self._model, self._optimizer, self._scheduler)
                self.committed_step = state.step
                self._snapshot = Snapshot(state.step, view.digest, blob)
            fetched = report.seconds
            log.info(
                "pulled step %d (%d bytes) from %d peers in %.3f s (%d whole refetches)",
                state.step, report.size, len(report.sources), report.seconds, report.retries,
            )  # fmt: skip
        built = time.perf_counter()
        old, self._group = self._group, None
        if old is not None:
            old.close()
        if rank == 0:
            _, port = host_store(self._group_timeout, host=self._host)  # the group owns it
            self._loop.call_soon_threadsafe(self._publish_store_port, view.epoch, port)
            host = self._host
        else:
            leader = view.members[0]
            port = self._remote(
                self._fetcher.group_store_port(leader.address, view.epoch, self._group_timeout),
                f"epoch {view.epoch}: asking rank 0 for the group store",
            )
            host = leader.address.rpartition(":")[0]
        self._group = EpochGroup.build(
            view.epoch, rank, view.size, host, port, rank == 0, self._group_timeout, self._abort,
            listen_host=self._host,
        )  # fmt: skip
        ready = time.perf_counter()
        self._loader.enter_view(rank, view.size, self.committed_step + 1)
        self._entering = (view.epoch, fetched, ready - built, time.monotonic())
        if self.metrics is not None:
            self.metrics.epoch.set(view.epoch)
            self.metrics.world.set(view.size)
        log.info(
            "entered view %d as rank %d of %d (state fetch %.3f s, group build %.3f s)",
            view.epoch, rank, view.size, fetched, time.perf_counter() - built,
        )  # fmt: skip
        return rank

    def _remote(self, coro: Any, what: str) -> Any:
        """Run a peer call on the control loop; give up (``StepAborted``) as
        soon as a newer roll call aborts this view, or when the call fails:
        a failed peer means a new view is coming anyway."""
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        while True:
            try:
                return future.result(timeout=ABORT_POLL)
            except FutureTimeout:
                if self._abort.is_set():
                    future.cancel()
                    raise StepAborted(f"{what}: aborted by a newer roll call") from None
            except (
                grpc.aio.AioRpcError,
                TransferFailed,
                CorruptState,
                ControlPlaneUnavailable,
            ) as exc:
                self._note_failure(f"{what} failed: {exc}")
                raise StepAborted(f"{what} failed: {exc}") from exc

    def _commit(self, step: Step) -> bool:
        group = self._group
        if step.aborted or self._abort.is_set() or group is None:
            self._optimizer.zero_grad(set_to_none=True)
            return False
        grads = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype)
            for p in self._params
        ]
        flat = torch.cat(
            [*grads, torch.tensor([float(step._count), step._loss], dtype=grads[0].dtype)]
        )
        try:
            group.allreduce_sum([flat])
        except PeerFailed as exc:
            self._note_failure(f"epoch {step.epoch}: {exc}")
            self._optimizer.zero_grad(set_to_none=True)
            return False
        except StepAborted:
            self._optimizer.zero_grad(set_to_none=True)
            return False
        count, loss = float(flat[-2]), float(flat[-1])
        with self._lock:
            if self._frozen or self._client.ended is not None:
                # Our answer to the roll call already named the previous
                # step: applying this one now would run it twice.
                self._optimizer.zero_grad(set_to_none=True)
                return False
            self._applying = True
        snapshot = None
        try:
            if not self._still_a_member() or self._client.ended is not None:
                self._optimizer.zero_grad(set_to_none=True)
                if self._client.ended is None:
                    # The others may have applied this step: a roll call
                    # realigns the view (this worker then pulls the state).
                    self._ask_for_rollcall(
                        f"epoch {step.epoch}: step {step.number} dropped (no fresh heartbeat ack)"
                    )
                return False
            with self._lock:
                offset = 0
                for p in self._params:
                    n = p.numel()
                    p.grad = (flat[offset : offset + n] / count).view_as(p).clone()
                    offset += n
                self._optimizer.step()
                if self._scheduler is not None:
                    self._scheduler.step()
                self._optimizer.zero_grad(set_to_none=True)
                self.committed_step = step.number
                if self._checkpoint_due(step):
                    snapshot = capture(step.number, self._model, self._optimizer, self._scheduler)
        finally:
            with self._lock:
                self._applying = False
                self._applied.notify_all()
        self._time_step(step.epoch)
        self._account(step)
        if snapshot is not None:
            assert self.checkpoints is not None and self.member_id is not None
            self.checkpoints.submit(snapshot, step.epoch, self.member_id, self._step_seconds)
        step.loss = loss / count
        self.ledger.record(
            step.number, step.epoch, step.world_size, self.plan.step_samples(step.number)
        )
        self._loader.step_committed(step.number)
        now = time.monotonic()
        if step.epoch != self._progress_sent[0] or now - self._progress_sent[1] >= (
            self._config.heartbeat_interval
        ):
            # Waking the control thread costs the training thread a GIL
            # hand-off: report the first step of a view, then at most once
            # per heartbeat interval.
            self._progress_sent = (step.epoch, now)
            self._loop.call_soon_threadsafe(self._client.report_progress, step.number)
        return True

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

    def _checkpoint_due(self, step: Step) -> bool:
        """Rank 0 writes a checkpoint after every ``checkpoint_every``-th step."""
        return (
            self.checkpoints is not None
            and step.rank == 0
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
        """(Writer thread.) Publish through the rendezvous service."""
        return self._call(
            self._client.publish_checkpoint(manifest), timeout=self._config.client_call_deadline
        )

    def _resume_from_checkpoint(self, view: View) -> None:
        """No member of ``view`` holds any state: load the newest usable
        durable checkpoint, if the job has one, and report the replay cost.
        Raises ``CheckpointUnusable`` when checkpoints exist but none loads
        (the worker must not start the job from scratch on its own)."""
        launch = process_age()
        status = self._remote(self._client.status(), f"epoch {view.epoch}: reading checkpoints")
        if not status.checkpoints:
            return
        loaded = load_newest(status.checkpoints)
        with self._lock:
            restore(loaded.state, self._model, self._optimizer, self._scheduler)
            self.committed_step = loaded.state.step
            self._snapshot = None  # served without RNG states, captured at the roll call
        s_ckpt = loaded.manifest.step
        self.resumed = ReplayCost(
            s_done=max(s_ckpt, status.last_step if status.last_step is not None else s_ckpt),
            s_ckpt=s_ckpt,
            t_step=loaded.manifest.step_seconds,
            t_launch=launch,
            t_load=loaded.seconds,
        )
        log.warning(
            "no live replica: resumed from the checkpoint of step %d (%s); replay cost %.2f s "
            "(%d steps x %.3f s + launch %.2f s + load %.3f s)",
            s_ckpt, loaded.manifest.uri, self.resumed.seconds, self.resumed.replay_steps,
            self.resumed.t_step, launch, loaded.seconds,
        )  # fmt: skip

    def _still_a_member(self) -> bool:
        """Fencing before an update: the leader must have acknowledged a
        heartbeat sent within ``fence_window`` (it evicts a member only after
        the detector's earliest suspicion, later than that). A frozen or
        cut-off worker (a partition drops its writes silently) has no such
        acknowledgement and must not commit in its old epoch; a live one
        gets the next within a heartbeat interval."""
        client, window = self._client, self._config.fence_window
        deadline = time.monotonic() + window
        while time.monotonic() - client.last_acked > window:
            if client.ended is not None or self._abort.is_set() or time.monotonic() > deadline:
                log.warning("no recent heartbeat acknowledgement: not applying the step")
                return False
            time.sleep(ABORT_POLL)
        return True

    def _note_failure(self, reason: str) -> None:
        """A peer call or collective failed. Usually the failed peer's own
        session broke too and a roll call is already coming; if none comes
        within the detector's bound, ``_wait_for_view`` reports it."""
        log.info("%s", reason)
        if self._failure is None:
            self._failure = (time.monotonic(), reason[:200])

    def _ask_for_rollcall(self, reason: str) -> None:
        """Our state or group no longer matches the view: ask for a roll call
        now, and again after the detector's bound if no view follows."""
        self._note_failure(reason)
        self._loop.call_soon_threadsafe(self._client.request_rollcall, reason)

    def _report_failure(self) -> None:
        """No roll call followed a failure: we cannot tell which peer broke
        the collective, so ask for a roll call, which calls everyone (live
        members answer and keep their place)."""
        assert self._failure is not None
        self._loop.call_soon_threadsafe(self._client.request_rollcall, self._failure[1])

    # --- shutdown ---------------------------------------------------------------------

    def close(self, leave: bool = True) -> None:
        """Leave the job cleanly (the others reconfigure at once), stop the
        state server, and wait until no abandoned collective is in flight."""
        if self._closed:
            return
        self._closed = True
        if self.checkpoints is not None and not self.checkpoints.wait(self._group_timeout):
            log.warning("a checkpoint was still being written at exit; it is not published")
        try:
            if leave and self._client.ended is None:
                self._call(self._client.leave(), timeout=self._config.client_call_deadline)
        except (RollcallError, TimeoutError) as exc:
            log.warning("leave failed: %s", exc)
        finally:
            self._loader.close()
            if self._group is not None:
                self._group.close()
            self._stop_loop()
            wait_parked(self._group_timeout + 5)
            stop_metrics(self._metrics_server)

    def _stop_loop(self) -> None:
        async def shutdown() -> None:
            await self._client.close()
            if self._fetcher is not None:
                await self._fetcher.close()
            if self._server is not None:
                await self._server.stop(0.5)

        try:
            self._call(shutdown(), timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def __enter__(self) -> Elastic:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = ["Batch", "CheckpointUnusable", "Elastic", "Evicted", "Step", "default_collate"]
