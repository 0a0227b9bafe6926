"""Durable checkpoints: the manifest that publishes one, the rules a job
trusts manifests by, what durability is stuck at, and the replay cost of
resuming from a checkpoint.

A checkpoint is the fallback for losing every live replica (DESIGN.md, "Steps,
commits and coherent state"). A worker writes the replica state of a committed
step to a file, and only once the file is complete and synced does it publish
a :class:`CheckpointManifest` through the rendezvous service, which records
it in etcd. A job that later finds no live replica loads the newest one.

In a job with sharded optimizer state, the optimizer state is not in that
file: each partition is written by one of its owners, in a *part* file of
its own (``part+<job>+<step>+<writer>.rcs``), and the manifest lists every
part (:class:`CheckpointPart`: its file, size and SHA-256, the partitions it
holds and each one's digest). It is published only once every part is
written, and is complete only with all of them.

Everything here is pure: no files, no clock (times are passed in).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from rollcall.membership.errors import InvalidRequest

#: A checkpoint file's name: ``ckpt+<job>+<step, 12 digits>+<writer>.rcs``.
#: ``+`` is outside the charset of job names and member ids, so the three
#: never run together: a job's files are told apart from every other job's
#: sharing the directory, and two writers (or two runs of one job name)
#: never write the same name.
FILE_PATTERN = re.compile(r"ckpt\+(?P<job>[^+/]+)\+(?P<step>\d{12})\+(?P<writer>[^+/]+)\.rcs")
#: A part file's name (a sharded job's partitions written by one owner):
#: ``part+<job>+<step, 12 digits>+<writer>.rcs``; never a ``FILE_PATTERN``.
PART_PATTERN = re.compile(r"part\+(?P<job>[^+/]+)\+(?P<step>\d{12})\+(?P<writer>[^+/]+)\.rcs")
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: Suffix of the manifest copy kept beside each checkpoint file.
MANIFEST_SUFFIX = ".manifest.json"
#: Longest checkpoint location accepted.
MAX_URI_LENGTH = 4096
#: Longest failure reason kept (the service refuses longer ones).
MAX_REASON_LENGTH = 200
#: Longest digest of a partition a part may name.
MAX_DIGEST_LENGTH = 128
#: Most partitions a manifest may list: every one is named with its digest,
#: and the manifest must fit one message of the service (64 KiB).
MAX_PARTITIONS = 512


def file_name(job: str, step: int, writer: str) -> str:
    """The name of ``writer``'s checkpoint of ``step`` for ``job``."""
    return f"ckpt+{job}+{step:012d}+{writer}.rcs"


def manifest_file_name(name: str) -> str:
    """The name of the copy of a checkpoint's manifest kept beside its file
    ``name``: what a worker checks the file against when etcd no longer
    holds the manifest (etcd lost the job's data). It never matches
    ``FILE_PATTERN``."""
    return f"{name}{MANIFEST_SUFFIX}"


def parse_file_name(name: str, job: str) -> int | None:
    """The step of one of ``job``'s checkpoint files; None for any other name
    (another job's, a temporary file, a part file, anything else)."""
    match = FILE_PATTERN.fullmatch(name)
    if match is None or match.group("job") != job:
        return None
    return int(match.group("step"))


def part_file_name(job: str, step: int, writer: str) -> str:
    """The name of ``writer``'s part of the checkpoint of ``step``."""
    return f"part+{job}+{step:012d}+{writer}.rcs"


def parse_part_name(name: str, job: str) -> int | None:
    """The step of one of ``job``'s part files; None for any other name."""
    match = PART_PATTERN.fullmatch(name)
    if match is None or match.group("job") != job:
        return None
    return int(match.group("step"))


def started_over_file_name(job: str) -> str:
    """The name of the file in a checkpoint directory that lists ``job``'s
    checkpoint files of runs started over on purpose (``start_over``):
    never resumed from (``rollcall.worker.checkpoint.mark_started_over``).
    It matches no checkpoint, part or copy name."""
    return f"started-over+{job}.json"


def is_job_file(name: str, job: str) -> bool:
    """Whether ``name`` is one of ``job``'s checkpoint or part files."""
    return parse_file_name(name, job) is not None or parse_part_name(name, job) is not None


@dataclass(frozen=True)
class CheckpointPart:
    """One file of a sharded checkpoint's optimizer state: the partitions
    one owner wrote, each with the digest of its state."""

    uri: str
    size: int
    sha256: str
    partitions: tuple[int, ...]
    digests: tuple[str, ...]

    def __post_init__(self) -> None:
        _check_location(self.uri, self.size, self.sha256, "checkpoint part")
        if not self.partitions or len(self.partitions) != len(self.digests):
            raise InvalidRequest("a checkpoint part names its partitions, one digest each")
        if any(not isinstance(p, int) or isinstance(p, bool) or p < 0 for p in self.partitions):
            raise InvalidRequest("checkpoint part partitions must be non-negative ints")
        if any(not isinstance(d, str) or not 0 < len(d) <= MAX_DIGEST_LENGTH for d in self.digests):
            raise InvalidRequest(
                f"checkpoint part digests must be strings of 1-{MAX_DIGEST_LENGTH} characters"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"uri": self.uri, "size": self.size, "sha256": self.sha256,
                "partitions": list(self.partitions), "digests": list(self.digests)}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Any) -> CheckpointPart:
        """Strict, as :meth:`CheckpointManifest.from_dict`."""
        if not isinstance(data, Mapping):
            raise InvalidRequest(f"a manifest part must be an object, got {type(data).__name__}")
        uri, size, sha256 = data.get("uri"), data.get("size"), data.get("sha256")
        partitions, digests = data.get("partitions"), data.get("digests")
        if not isinstance(uri, str) or not isinstance(sha256, str):
            raise InvalidRequest("manifest part uri and sha256 must be strings")
        if not isinstance(size, int) or isinstance(size, bool):
            raise InvalidRequest("manifest part size must be an int")
        if not isinstance(partitions, list) or not isinstance(digests, list):
            raise InvalidRequest("manifest part partitions and digests must be lists")
        return cls(uri, size, sha256, tuple(partitions), tuple(digests))


def _check_location(uri: str, size: int, sha256: str, what: str) -> None:
    if not uri or len(uri) > MAX_URI_LENGTH or "\x00" in uri:
        raise InvalidRequest(f"{what} uri must be 1-{MAX_URI_LENGTH} characters without NUL")
    if size <= 0:
        raise InvalidRequest(f"{what} size must be positive, got {size}")
    if not _SHA256.fullmatch(sha256):
        raise InvalidRequest(f"{what} sha256 must be 64 lowercase hex digits")


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
    #: A sharded job's parts (the optimizer state, partition by partition):
    #: every partition ``0 .. n-1`` in exactly one of them. Empty otherwise.
    parts: tuple[CheckpointPart, ...] = ()

    def __post_init__(self) -> None:
        if self.step < 0:
            raise InvalidRequest(f"checkpoint step must be >= 0, got {self.step}")
        _check_location(self.uri, self.size, self.sha256, "checkpoint")
        if not self.digest:
            raise InvalidRequest("checkpoint digest is empty")
        if not all(math.isfinite(t) and t >= 0 for t in (self.step_seconds, self.created_unix)):
            raise InvalidRequest("checkpoint times must be finite, non-negative numbers")
        if self.parts:
            listed = sorted(p for part in self.parts for p in part.partitions)
            if listed != list(range(len(listed))) or len(listed) > MAX_PARTITIONS:
                raise InvalidRequest(
                    f"checkpoint parts must hold partitions 0..n-1 (n <= {MAX_PARTITIONS}) "
                    "once each"
                )
            if len({part.uri for part in self.parts} | {self.uri}) != len(self.parts) + 1:
                raise InvalidRequest("checkpoint parts must be files of their own")

    @property
    def files(self) -> tuple[str, ...]:
        """Every file the checkpoint is made of: its own, then its parts'."""
        return (self.uri, *(part.uri for part in self.parts))

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["parts"] = [part.to_dict() for part in self.parts]
        return record

    @classmethod
    def from_dict(cls, data: Any) -> CheckpointManifest:
        """A manifest from its stored form, checked strictly (types included:
        ``"5"`` is not a step, ``true`` is not a size); ``InvalidRequest``
        naming the problem otherwise."""
        if not isinstance(data, Mapping):
            raise InvalidRequest(f"a manifest must be an object, got {type(data).__name__}")
        values: dict[str, Any] = {}
        for field in fields(cls):
            if field.name == "parts":
                # Absent in manifests of replicated jobs written before parts.
                parts = data.get("parts", [])
                if not isinstance(parts, list):
                    raise InvalidRequest(f"manifest parts is a {type(parts).__name__}")
                values["parts"] = tuple(CheckpointPart.from_dict(part) for part in parts)
                continue
            if field.name not in data:
                raise InvalidRequest(f"manifest has no {field.name}")
            value = data[field.name]
            if field.type == "int":
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif field.type == "float":
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                value = float(value) if ok else value
            else:
                ok = isinstance(value, str)
            if not ok:
                raise InvalidRequest(f"manifest {field.name} is a {type(value).__name__}")
            values[field.name] = value
        return cls(**values)


def record(
    kept: list[CheckpointManifest], new: CheckpointManifest, keep: int
) -> tuple[bool, list[CheckpointManifest]]:
    """Add ``new`` to the manifests ``kept`` (newest first) if it is newer
    than all of them; keep at most ``keep``. Returns (accepted, manifests)."""
    if kept and new.step <= kept[0].step:
        return False, kept
    return True, [new, *kept][:keep]


def progress_limit(*steps: int | None) -> int | None:
    """The highest step a manifest of the job may hold: one past its
    progress (the highest of ``steps`` known: the leader's current step, the
    view's resume step, the progress record). None if the job has none: it
    never committed a step, so no checkpoint of it can exist."""
    known = [step for step in steps if step is not None]
    return max(known) + 1 if known else None


def beyond_progress(
    manifests: Sequence[CheckpointManifest], limit: int | None
) -> tuple[list[CheckpointManifest], list[CheckpointManifest]]:
    """Split ``manifests`` into those the job's progress allows and those
    beyond it (forged, or from another run), which are not trusted."""
    trusted = [m for m in manifests if limit is not None and m.step <= limit]
    return trusted, [m for m in manifests if limit is None or m.step > limit]


def superseded(
    files: Mapping[str, int],
    kept: Sequence[CheckpointManifest],
    verified: Collection[str],
    written_step: int,
) -> list[str]:
    """Which of a writer's ``files`` (location -> step) a prune may delete.

    Only those no kept manifest names (its own file or a part) and older
    than the newest kept checkpoint that counts: its files were verified
    (``verified`` holds the locations of the kept manifests whose files,
    parts included, exist with their recorded size and SHA-256) and its
    step is not beyond the step the writer has just written (a manifest
    claiming more is not believed, even if it names a real file). If none
    counts, nothing is deleted: the newest
    complete checkpoint is never among the deleted."""
    counting = [m.step for m in kept if m.uri in verified and m.step <= written_step]
    if not counting:
        return []
    newest = max(counting)
    named = {uri for m in kept for uri in m.files}
    return sorted(uri for uri, step in files.items() if uri not in named and step < newest)


@dataclass(frozen=True)
class CheckpointFailure:
    """The job's durability is stuck: checkpoints fail to be written or
    published. Recorded by the leader from the writers' reports."""

    #: Step of the latest checkpoint that failed.
    step: int
    reason: str
    #: Unix time of the first failure since the newest recorded checkpoint.
    since_unix: float
    #: Failed attempts since then.
    failures: int
    writer: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> CheckpointFailure:
        """Strict, as :meth:`CheckpointManifest.from_dict`."""
        if not isinstance(data, Mapping):
            raise InvalidRequest(f"a failure record must be an object, got {type(data).__name__}")
        step, failures = data.get("step"), data.get("failures")
        since, reason, writer = data.get("since_unix"), data.get("reason"), data.get("writer")
        counters_ok = all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (step, failures)
        )
        if not counters_ok or not isinstance(reason, str) or not isinstance(writer, str):
            raise InvalidRequest("malformed failure record")
        if isinstance(since, bool) or not isinstance(since, (int, float)):
            raise InvalidRequest("malformed failure record")
        if not (math.isfinite(since) and since >= 0):
            raise InvalidRequest("malformed failure record")
        assert isinstance(step, int) and isinstance(failures, int)
        return cls(step, reason[:MAX_REASON_LENGTH], float(since), failures, writer)


def next_failure(
    previous: CheckpointFailure | None,
    durable_step: int | None,
    step: int,
    reason: str,
    writer: str,
    now_unix: float,
) -> CheckpointFailure:
    """The failure record after a writer reported that the checkpoint of
    ``step`` failed: the same streak (first failure time kept, one more
    attempt) unless a checkpoint was recorded since ``previous``."""
    reason = reason[:MAX_REASON_LENGTH]
    if previous is None or not stuck_since(previous, durable_step):
        return CheckpointFailure(step, reason, now_unix, 1, writer)
    return CheckpointFailure(
        max(step, previous.step), reason, previous.since_unix, previous.failures + 1, writer
    )


def stuck_since(failure: CheckpointFailure | None, durable_step: int | None) -> bool:
    """Whether ``failure`` still holds: no checkpoint of a later step was
    recorded after it."""
    return failure is not None and (durable_step is None or failure.step > durable_step)


@dataclass(frozen=True)
class Durability:
    """How far the job's progress is durable, and whether it is stuck."""

    #: Step of the newest recorded checkpoint the job's progress allows.
    durable_step: int | None
    #: Set while checkpoints fail (none recorded since the failure).
    failure: CheckpointFailure | None = None

    @property
    def stuck(self) -> bool:
        return self.failure is not None


def durability(
    manifests: Sequence[CheckpointManifest],
    failure: CheckpointFailure | None,
    limit: int | None,
) -> Durability:
    """The job's durability from its record: the newest manifest within
    the job's progress (``limit``, see :func:`progress_limit`; a forged one
    beyond it does not count), and the failure if it still holds."""
    trusted, _ = beyond_progress(manifests, limit)
    durable = trusted[0].step if trusted else None
    return Durability(durable, failure if stuck_since(failure, durable) else None)


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
