"""Prometheus metrics of the rendezvous service (``--metrics-port``).

Each process keeps its own registry (no global state), served over HTTP by
``prometheus_client`` on the given port. Names are documented in
docs/events.md ("Metrics").
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rollcall.protocol.serving import STALL_BUCKETS


class ServiceMetrics:
    """What the leader knows about the job."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.leader = Gauge(
            "rollcall_leader", "1 while this replica leads the job", registry=self.registry
        )
        self.epoch = Gauge("rollcall_view_epoch", "Epoch of the committed view",
                           registry=self.registry)  # fmt: skip
        self.members = Gauge("rollcall_members", "Members in the committed view",
                             registry=self.registry)  # fmt: skip
        self.step = Gauge("rollcall_committed_step", "Last committed step reported",
                          registry=self.registry)  # fmt: skip
        self.samples = Counter(
            "rollcall_committed_samples", "Samples committed (steps x global batch)",
            registry=self.registry,
        )  # fmt: skip
        self.view_changes = Counter(
            "rollcall_view_changes", "Committed view changes by cause", ["cause"],
            registry=self.registry,
        )  # fmt: skip
        self.stall = Histogram(
            "rollcall_stall_seconds", "View-change stall (trigger to last member's first step)",
            registry=self.registry, buckets=STALL_BUCKETS,
        )  # fmt: skip
        self.phase = Histogram(
            "rollcall_stall_phase_seconds", "View-change stall by phase", ["phase"],
            registry=self.registry, buckets=STALL_BUCKETS,
        )  # fmt: skip
        self.lost_work = Counter(
            "rollcall_lost_work_seconds", "Compute thrown away by aborted steps",
            registry=self.registry,
        )  # fmt: skip
        self.checkpoint_failures = Counter(
            "rollcall_checkpoint_failures", "Checkpoints members failed to make durable",
            registry=self.registry,
        )  # fmt: skip
        self.durable_step = Gauge(
            "rollcall_durable_step", "Step of the newest recorded checkpoint (-1: none)",
            registry=self.registry,
        )  # fmt: skip
        self.durability_stuck = Gauge(
            "rollcall_durability_stuck", "1 while checkpoints fail (none recorded since)",
            registry=self.registry,
        )  # fmt: skip
        self.durable_step.set(-1)
        self._last_step: int | None = None

    def progress(self, step: int, global_batch: int | None) -> None:
        if self._last_step is not None and global_batch and step > self._last_step:
            self.samples.inc((step - self._last_step) * global_batch)
        self._last_step = step
        self.step.set(step)

    def record(self, event: dict[str, Any]) -> None:
        """Account for one event record (docs/events.md)."""
        if event["kind"] in ("checkpoint", "checkpoints_forgotten"):
            step = event["step"] if event["kind"] == "checkpoint" else event["durable_step"]
            self.durable_step.set(-1 if step is None else step)
            if event["kind"] == "checkpoint":
                self.durability_stuck.set(0)
            return
        if event["kind"] == "checkpoint_failed":
            self.durability_stuck.set(1)
            return
        if event["kind"] != "view_change":
            return
        self.view_changes.labels(event["cause"]).inc()
        if event["stall_s"] is not None:
            self.stall.observe(event["stall_s"])
        for phase, seconds in event["phases"].items():
            if seconds is not None:
                self.phase.labels(phase.removesuffix("_s")).observe(seconds)
        self.lost_work.inc(event["lost_work_s"])
