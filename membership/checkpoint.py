"""Durable checkpoints: the manifest that publishes one, and the replay cost
of resuming from it.

A checkpoint is the fallback for losing every live replica (DESIGN.md, "Steps,
commits and coherent state"). A worker writes the replica state of a committed
step to a file, and only once the file is complete and synced does it publish
a :class:`CheckpointManifest` through the rendezvous service, which records
it in etcd. A job that later finds no live replica loads the newest one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from membership.errors import InvalidRequest

#: File names of checkpoints, by step (sorting them sorts by step).
FILE_PATTERN = re.compile(r"ckpt-(\d{12})\.rcs")
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: Longest checkpoint location accepted.
MAX_URI_LENGTH = 4096


def file_name(step: int) -> str:
    return f"ckpt-{step:012d}.rcs"


@dataclass(frozen=True)
class CheckpointManifest:
    """What etcd records about one complete checkpoint."""

    step: int
    digest: str
    uri: str
    size: int
    sha256: str
    epoch: int
    writer: str
    created_unix: float
    step_seconds: float

    def __post_init__(self) -> None:
        if self.step < 0:
            raise InvalidRequest(f"checkpoint step must be >= 0, got {self.step}")
        if not self.uri or len(self.uri) > MAX_URI_LENGTH or "\x00" in self.uri:
            raise InvalidRequest(
                f"checkpoint uri must be 1-{MAX_URI_LENGTH} characters without NUL"
            )
        if self.size <= 0:
            raise InvalidRequest(f"checkpoint size must be positive, got {self.size}")
        if not _SHA256.fullmatch(self.sha256):
            raise InvalidRequest("checkpoint sha256 must be 64 lowercase hex digits")
        if not self.digest:
            raise InvalidRequest("checkpoint digest is empty")
        if not all(math.isfinite(t) and t >= 0 for t in (self.step_seconds, self.created_unix)):
            raise InvalidRequest("checkpoint times must be finite, non-negative numbers")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckpointManifest:
        return cls(
            step=int(data["step"]),
            digest=str(data["digest"]),
            uri=str(data["uri"]),
            size=int(data["size"]),
            sha256=str(data["sha256"]),
            epoch=int(data["epoch"]),
            writer=str(data["writer"]),
            created_unix=float(data["created_unix"]),
            step_seconds=float(data["step_seconds"]),
        )


def record(
    kept: list[CheckpointManifest], new: CheckpointManifest, keep: int
) -> tuple[bool, list[CheckpointManifest]]:
    """Add ``new`` to the manifests ``kept`` (newest first) if it is newer
    than all of them; keep at most ``keep``. Returns (accepted, manifests)."""
    if kept and new.step <= kept[0].step:
        return False, kept
    return True, [new, *kept][:keep]


@dataclass(frozen=True)
class ReplayCost:
    """What resuming from a checkpoint costs compared with the job's last
    committed step: ``(s_done - s_ckpt) * T_step + T_launch + T_load``."""

    s_done: int
    s_ckpt: int
    t_step: float
    t_launch: float
    t_load: float

    @property
    def replay_steps(self) -> int:
        return max(0, self.s_done - self.s_ckpt)

    @property
    def seconds(self) -> float:
        return self.replay_steps * self.t_step + self.t_launch + self.t_load

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "replay_steps": self.replay_steps, "replay_cost_s": self.seconds}
