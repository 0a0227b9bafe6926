"""The job's checkpoint record on the leader: publishing a manifest
(checked against the job's progress), members' reports of checkpoints that
could not be made durable, and forgetting manifests on an operator's
request."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc

from rollcall.membership.checkpoint import (
    CheckpointFailure,
    CheckpointManifest,
    next_failure,
    progress_limit,
)
from rollcall.membership.errors import (
    ControlPlaneUnavailable,
    InvalidRequest,
    NotLeader,
    RollcallError,
    StaleEpoch,
)
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.protocol import validation as check
from rollcall.protocol.wire import manifest_from_pb, manifest_to_pb
from rollcall.rendezvous.replica.actions import LeaderActions
from rollcall.rendezvous.replica.base import MAX_REASON
from rollcall.rendezvous.replica.leadership import Leadership

log = logging.getLogger("rollcall.rendezvous")


class CheckpointCalls(LeaderActions):
    """The checkpoint RPCs and the durability record."""

    async def PublishCheckpoint(
        self, request: pb.PublishCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            self._check_job(request.job)
            check.check_id(request.member_id, "member_id", self._config)
            manifest = manifest_from_pb(request.checkpoint)
            for digest in (manifest.digest, *(d for part in manifest.parts for d in part.digests)):
                check.check_digest(digest, self._config)
            check.check_id(manifest.writer, "checkpoint writer", self._config)
            check.check_counter(manifest.step, "checkpoint step")
            lead = self._acting_for(request.member_id, request.epoch, request.member_secret)
            view = lead.coordinator.view
            if request.epoch != view.epoch or request.member_id not in view:
                raise StaleEpoch(
                    f"member {request.member_id} is not in view {view.epoch}: "
                    "only members of the current view publish checkpoints"
                )
            if manifest.epoch > view.epoch:
                raise InvalidRequest(
                    f"checkpoint epoch {manifest.epoch} is ahead of view {view.epoch}"
                )
            limit = await self._checkpoint_limit(lead, manifest.step)
            if limit is None or manifest.step > limit:
                progress = "no committed step" if limit is None else f"step {limit - 1}"
                raise InvalidRequest(
                    f"checkpoint of step {manifest.step} is beyond the job's progress "
                    f"({progress}): a checkpoint holds a committed step"
                )
            accepted, kept = await self._etcd(
                self._store.publish_checkpoint, manifest, self._config.checkpoint_keep, limit
            )
            if accepted and self._events.checkpoint_step != manifest.step:
                log.info("checkpoint of step %d published by %s", manifest.step, manifest.writer)
                self._remember(checkpoints=tuple(kept))
                self._emit(self._events.checkpoint(self._clock(), manifest))
                await self._durability_restored(manifest)
            if accepted:
                await self._progress_covers(lead, manifest.step)
            return pb.PublishCheckpointResponse(
                accepted=accepted, checkpoints=[manifest_to_pb(m) for m in kept]
            )
        except RollcallError as error:
            await self._abort(context, error)

    async def _checkpoint_limit(self, lead: Leadership, step: int) -> int | None:
        """The highest step the job's progress allows a checkpoint of
        (``rollcall.membership.checkpoint.progress_limit``), waiting at most
        ``checkpoint_progress_wait`` for it to reach ``step``: the writer
        reports its progress just before publishing, on another stream."""
        progress = await self._etcd(self._store.read_progress)
        deadline = self._clock() + self._config.checkpoint_progress_wait
        while True:
            limit = progress_limit(
                lead.leader.step,
                lead.coordinator.view.resume_step,
                progress[1] if progress else None,
            )
            if (limit is not None and step <= limit) or self._clock() >= deadline:
                return limit
            if lead.lost.is_set():
                raise NotLeader("replica lost leadership while checking a checkpoint")
            await asyncio.sleep(self._config.heartbeat_interval / 2)

    async def _progress_covers(self, lead: Leadership, step: int) -> None:
        """The progress record is never more than one step behind the
        newest recorded checkpoint (a resuming worker checks manifests
        against it, and its replay cost counts from it): the reported step
        is written at once if the record is further behind."""
        write = lead.leader.progress_for_checkpoint(step)
        if write is None:
            return
        try:
            await self._put_progress(lead, write)
        except ControlPlaneUnavailable as exc:  # the manifest is recorded; the next write follows
            log.warning("progress of step %d not recorded with its checkpoint: %s", step, exc)

    async def _durability_restored(self, manifest: CheckpointManifest) -> None:
        """A checkpoint was recorded: a failure recorded before it is over."""
        if self._metrics is not None:
            self._metrics.durable_step.set(manifest.step)
        if self._failure is None:
            return
        failure, self._failure = self._failure, None
        log.warning(
            "checkpoints recorded again at step %d after %d failed attempts since %s",
            manifest.step, failure.failures,
            time.strftime("%H:%M:%S", time.localtime(failure.since_unix)),
        )  # fmt: skip
        try:
            await self._etcd(self._store.write_checkpoint_failure, None)
        except ControlPlaneUnavailable as exc:  # it no longer counts once a later step is recorded
            log.warning("checkpoint failure record not cleared: %s", exc)

    def _checkpoint_failed(self, lead: Leadership, member_id: str, report: Any) -> None:
        """A member of the view could not make a checkpoint durable: record
        it (etcd, events) at most every progress_write_interval, count it
        every time."""
        self._fence(lead, member_id, report.epoch)
        check.check_counter(report.step, "checkpoint step")
        check.check_text(report.reason, "checkpoint failure reason", MAX_REASON)
        now = self._clock()
        lead.leader.heard(member_id, now)
        view = lead.coordinator.view
        if report.epoch != view.epoch or member_id not in view:
            return  # late: the member is not in the view in force
        self._failure = next_failure(
            self._failure, self._events.checkpoint_step, report.step, report.reason, member_id,
            time.time(),
        )  # fmt: skip
        if self._metrics is not None:
            self._metrics.checkpoint_failures.inc()
        if now - self._failure_written < self._config.progress_write_interval:
            return
        self._failure_written = now
        failure = self._failure
        log.warning(
            "durability stuck at step %s: %s's checkpoint of step %d failed (%d attempts): %s",
            self._events.checkpoint_step, member_id, report.step, failure.failures,
            report.reason,
        )  # fmt: skip
        self._emit(self._events.checkpoint_failed(now, failure))
        asyncio.create_task(self._write_failure(failure))

    async def _write_failure(self, failure: CheckpointFailure) -> None:
        try:
            await self._etcd(self._store.write_checkpoint_failure, failure)
        except ControlPlaneUnavailable as exc:
            log.warning("checkpoint failure not recorded in etcd: %s", exc)

    async def ForgetCheckpoints(
        self, request: pb.ForgetCheckpointsRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            self._check_job(request.job)
            for step in request.steps:
                check.check_counter(step, "checkpoint step")
            if request.all == bool(request.steps):
                raise InvalidRequest("name the steps of the checkpoints to forget, or all")
            self._leader()
            forgotten, kept = await self._etcd(
                self._store.forget_checkpoints, None if request.all else list(request.steps)
            )
            newest = kept[0].step if kept else None
            self._remember(checkpoints=tuple(kept))
            log.warning(
                "checkpoint record: the manifests of steps %s were removed on request "
                "(%d kept)", ", ".join(str(m.step) for m in forgotten) or "none", len(kept),
            )  # fmt: skip
            self._emit(self._events.checkpoints_forgotten(self._clock(), forgotten, newest))
            return pb.ForgetCheckpointsResponse(
                forgotten=[manifest_to_pb(m) for m in forgotten],
                kept=[manifest_to_pb(m) for m in kept],
            )
        except RollcallError as error:
            await self._abort(context, error)
