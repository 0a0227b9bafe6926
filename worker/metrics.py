"""Prometheus metrics of a worker (``Elastic(metrics_port=...)``,
``rollcall worker --metrics-port``); names in docs/events.md ("Metrics")."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rollcall.protocol.serving import STALL_BUCKETS


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.steps = Counter("rollcall_worker_steps", "Steps committed", registry=registry)
        self.samples = Counter(
            "rollcall_worker_samples", "Samples committed (global)", registry=registry
        )
        self.aborted = Counter(
            "rollcall_worker_aborted_steps", "Steps aborted by view changes", registry=registry
        )
        self.epoch = Gauge("rollcall_worker_view_epoch", "Current view", registry=registry)
        self.world = Gauge("rollcall_worker_world_size", "Ranks in the view", registry=registry)
        self.step_seconds = Gauge(
            "rollcall_worker_step_seconds", "Mean wall time of a step", registry=registry
        )
        self.stall = Histogram(
            "rollcall_worker_stall_phase_seconds", "Time spent entering views, by phase",
            ["phase"], registry=registry, buckets=STALL_BUCKETS,
        )  # fmt: skip
        self.lost_work = Counter(
            "rollcall_worker_lost_work_seconds", "Compute thrown away by aborted steps",
            registry=registry,
        )  # fmt: skip
        self.checkpoints = Counter(
            "rollcall_worker_checkpoints", "Checkpoints this worker wrote and had recorded",
            registry=registry,
        )  # fmt: skip
        self.checkpoint_failures = Counter(
            "rollcall_worker_checkpoint_failures",
            "Checkpoints this worker failed to write or publish", registry=registry,
        )  # fmt: skip
        self.drifted = Counter(
            "rollcall_worker_drifted_states",
            "View changes at which its state of the resume step was not the one agreed "
            "(sharded: checks at which its copy of a partition differed from the sender's)",
            registry=registry,
        )  # fmt: skip
        self.durable_step = Gauge(
            "rollcall_worker_durable_step",
            "Step of the newest checkpoint this worker had recorded (-1: none)",
            registry=registry,
        )  # fmt: skip
        self.durable_step.set(-1)
