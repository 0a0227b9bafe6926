"""What must match across the workers of a job: the configuration fingerprint.

Averaging the gradients of two different experiments is never an option
(DESIGN.md, "The state contract"). Each worker describes, at construction,
everything that must be the same on every worker as a :class:`JobFingerprint`:
a map of field names to short texts. The first fingerprinted ``Join`` of a
job records it; a later joiner whose fingerprint differs is refused with a
:class:`~rollcall.membership.errors.ConfigurationMismatch` naming each differing field
and both values.

Pure code: the worker computes the values (``worker/fingerprint.py``), the
rendezvous service stores them (``rendezvous/store.py``); the comparison and
the decision whether a joiner is admitted live here, with no I/O.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from rollcall.membership.errors import InvalidRequest


@dataclass(frozen=True)
class FingerprintField:
    """One field a fingerprint may hold, and what its value describes."""

    name: str
    meaning: str
    #: Said after a difference in this field when its values alone (digests)
    #: do not tell a person what differs.
    hint: str = ""


#: Every field a fingerprint may hold, in the order differences are reported.
#: Adding a field is one line here (and its value on the worker's side: a
#: computed one in ``worker/fingerprint.py``, or a flag the runtime passes).
FIELDS: tuple[FingerprintField, ...] = (
    FingerprintField("global_batch", "samples per global step"),
    FingerprintField("micro_batch", "samples per microbatch"),
    FingerprintField("seed", "seed of the data order and of the microbatch RNG"),
    FingerprintField("num_samples", "length of the data set"),
    FingerprintField(
        "data",
        "digest of the data plan's first microbatch as this worker loaded it (twice), "
        "'varies between reads', or off",
        "other samples under the same length and seed (other files, another preprocessing "
        "or tokenizer) or a sample that holds something of the host (a path): train every "
        "worker on the same data; if the samples differ between hosts by design, pass "
        "data_probe=False on every worker",
    ),
    FingerprintField(
        "model",
        "names, shapes and dtypes of the parameters and buffers",
        "another model architecture",
    ),
    FingerprintField(
        "modules",
        "class and settings of every module (torch's own by their attributes, others by "
        "extra_repr())",
        "another module setting (a dropout rate, a norm's eps or momentum, an activation) or "
        "another module class with the same parameters",
    ),
    FingerprintField("optimizer", "class of the optimizer"),
    FingerprintField("optimizer_settings", "hyperparameters of each parameter group"),
    FingerprintField("scheduler", "class of the LR scheduler, or none"),
    FingerprintField("scheduler_settings", "the LR scheduler's settings at construction"),
    FingerprintField("grad_scaler", "class of the grad scaler, or none"),
    FingerprintField("extras", "names of the registered user state"),
    FingerprintField(
        "before_update",
        "the hook between the reduced gradient and the update (its module and name), or none",
        "another gradient hook (clipping): the ranks would apply other updates to the same "
        "reduced gradient, and the replicas would part",
    ),
    FingerprintField(
        "code",
        "digests of the source of the modules the job's code comes from (the one that "
        "constructs Elastic, those defining the model's modules, the optimizer, the "
        "scheduler, the data set, the registered state and the hook, and those imported "
        "from the projects these come from), or off",
        "other code under the same names (another version of the training script, or of a "
        "module that defines the model or the data set): run every worker from the same "
        "code; if it differs between hosts by design, pass code_check=False on every worker",
    ),
    FingerprintField(
        "settings",
        "the training script's own settings passed as Elastic(settings=...), as sorted "
        "name=value words",
        "another value of a setting of the training script's own (its command line: a loss "
        "weight, a label smoothing): start every worker with the same settings, and leave "
        "what differs by design (paths, host names) out of settings=",
    ),
    FingerprintField(
        "torch",
        "the torch build (torch.__version__)",
        "other torch versions compute differently and the replicas drift apart: run one "
        "version on every worker",
    ),
    FingerprintField(
        "initial_state",
        "digest of the model's state_dict at construction",
        "other initial weights: another model seed, or other pretrained weights",
    ),
    # Flags: set by the runtime when it has the setting, absent otherwise.
    FingerprintField("min_workers", "workers the job waits for before step 0"),
    FingerprintField(
        "sync_buffers", "whether buffers are kept identical across replicas (true, false)"
    ),
    FingerprintField("exact", "whether the job runs in bit-exact mode"),
    FingerprintField(
        "data_division",
        "the runtime's rule for dividing a step's microbatches among the ranks",
        "workers of rollcall versions that divide steps differently: run one version",
    ),
    FingerprintField(
        "reduction",
        "the layout of the runtime's reduction of a step (what its collectives carry)",
        "workers of rollcall versions whose collectives of a step differ: run one version",
    ),
    FingerprintField(
        "overlap", "whether gradients are reduced in buckets during the backward pass (true)"
    ),
    FingerprintField(
        "drift_check", "steps between the ranks' comparisons of their states' digests"
    ),
    FingerprintField("shard_partitions", "partitions of the sharded optimizer state"),
    FingerprintField("shard_redundancy", "copies kept of each partition of the optimizer state"),
    FingerprintField(
        "checkpoint_every", "steps between checkpoints (every rank of a sharded job takes part)"
    ),
    FingerprintField("checkpoints", "whether the sharded job writes checkpoints (on, off)"),
)
NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS)
_HINTS = {f.name: f.hint for f in FIELDS if f.hint}

#: Most fields a fingerprint may hold (well above ``len(FIELDS)``, so that a
#: worker of a newer version with more fields is still understood).
MAX_FIELDS = 32
#: Field names: lowercase letters, digits and ``_``, first a letter.
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,31}")
#: Longest value text; a worker shortens a longer one (keeping a digest of it).
MAX_VALUE_LENGTH = 256
#: Values: printable ASCII, so that every error message stays one line.
VALUE_PATTERN = re.compile(r"[\x20-\x7e]*")
#: How an absent field reads in a message.
UNSET = "unset"


@dataclass(frozen=True)
class JobFingerprint:
    """Field name -> value text, validated (see :func:`check_fingerprint`).

    Equal fingerprints describe jobs whose workers may train together."""

    fields: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, values: Mapping[str, str]) -> JobFingerprint:
        """A fingerprint of ``values``; ``InvalidRequest`` naming the field
        if one is malformed."""
        return check_fingerprint(values)

    def as_dict(self) -> dict[str, str]:
        return dict(self.fields)

    def get(self, name: str) -> str | None:
        return self.as_dict().get(name)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)


def check_fingerprint(values: Mapping[str, str]) -> JobFingerprint:
    """Validate a fingerprint from the network or from etcd: at most
    ``MAX_FIELDS`` fields, names matching ``NAME_PATTERN``, values of at most
    ``MAX_VALUE_LENGTH`` printable ASCII characters. Raises
    ``InvalidRequest`` naming the offending field."""
    if len(values) > MAX_FIELDS:
        raise InvalidRequest(f"fingerprint has {len(values)} fields, more than {MAX_FIELDS}")
    fields = []
    for name, value in values.items():
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise InvalidRequest(
                f"fingerprint field name {str(name)[:40]!r} is not 1-32 characters of "
                "[a-z0-9_] starting with a letter"
            )
        if not isinstance(value, str):
            raise InvalidRequest(f"fingerprint field {name} is not text")
        if len(value) > MAX_VALUE_LENGTH:
            raise InvalidRequest(
                f"fingerprint field {name} is longer than {MAX_VALUE_LENGTH} characters"
            )
        if not VALUE_PATTERN.fullmatch(value):
            raise InvalidRequest(
                f"fingerprint field {name} has characters outside printable ASCII"
            )
        fields.append((name, value))
    return JobFingerprint(tuple(sorted(fields)))


@dataclass(frozen=True)
class Difference:
    """One field on which a joiner differs from the job (None: absent)."""

    name: str
    joiner: str | None
    job: str | None


def _order(name: str) -> tuple[int, str]:
    return (NAMES.index(name), "") if name in NAMES else (len(NAMES), name)


def compare(joiner: JobFingerprint, job: JobFingerprint) -> tuple[Difference, ...]:
    """Every field on which ``joiner`` differs from ``job`` (a field present
    on one side only differs too), in the order of ``FIELDS``, then unknown
    names alphabetically. Empty when they are equal."""
    ours, theirs = joiner.as_dict(), job.as_dict()
    names = sorted(ours.keys() | theirs.keys(), key=_order)
    return tuple(
        Difference(name, ours.get(name), theirs.get(name))
        for name in names
        if ours.get(name) != theirs.get(name)
    )


def _settings(value: str) -> dict[str, str] | None:
    """``lr=0.001 betas=(0.9,0.999)`` as a dict; None if not of that form."""
    words = [word.partition("=") for word in value.split(" ")]
    if not all(name and sep for name, sep, _ in words):
        return None
    return {name: setting for name, _, setting in words}


def _narrowed(joiner: str, job: str) -> tuple[str, str] | None:
    """Only the settings that differ, when both values are ``name=value``
    words and some of them agree: ``lr=0.001`` against ``lr=0.003``."""
    ours, theirs = _settings(joiner), _settings(job)
    if ours is None or theirs is None:
        return None
    names = [n for n in {**ours, **theirs} if ours.get(n) != theirs.get(n)]
    if len(names) == len(ours.keys() | theirs.keys()):
        return None

    def side(settings: dict[str, str]) -> str:
        return " ".join(f"{n}={settings[n]}" if n in settings else f"no {n}" for n in names)

    return side(ours), side(theirs)


def _clause(difference: Difference, job_name: str, first: bool) -> str:
    owner = "this worker's" if first else "its"
    theirs = f"job {job_name}'s" if first else "the job's"
    ours, job = difference.joiner or UNSET, difference.job or UNSET
    if difference.joiner is not None and difference.job is not None:
        narrowed = _narrowed(difference.joiner, difference.job)
        if narrowed is not None:
            return f"{owner} {difference.name} has {narrowed[0]} but {theirs} has {narrowed[1]}"
    hint = _HINTS.get(difference.name)
    said = f"{owner} {difference.name} is {ours} but {theirs} is {job}"
    return f"{said} ({hint})" if hint else said


def describe_mismatch(job_name: str, differences: tuple[Difference, ...]) -> str:
    """One line naming each differing field with both values, and what to do:
    "this worker's global_batch is 96 but job run1's is 48: every worker of a
    job must use the same settings; ..."."""
    if not differences:
        raise ValueError("no differences to describe")
    clauses = [_clause(d, job_name, i == 0) for i, d in enumerate(differences)]
    listed = clauses[0] if len(clauses) == 1 else ", ".join(clauses[:-1]) + ", and " + clauses[-1]
    return (
        f"{listed}: every worker of a job must use the same settings; fix this worker's "
        "settings, or start a new job under another name"
    )


@dataclass(frozen=True)
class JobActivity:
    """What the job has done so far, as the leader sees it at a join."""

    #: Members of the committed view, but those that left cleanly
    #: (``Coordinator.staying``).
    members: int
    #: Members recorded but not in the view yet (pending joiners).
    joiners: int
    #: Whether any committed step is recorded (progress key, view, leader).
    progress: bool
    #: Whether durable checkpoints were published.
    checkpoints: bool

    @property
    def fresh(self) -> bool:
        """Empty and never trained: a new run may take the job's name."""
        return not (self.members or self.joiners or self.progress or self.checkpoints)


class Verdict(enum.Enum):
    """What the service does with a fingerprinted joiner."""

    #: The job's recorded fingerprint is the joiner's: admit.
    MATCHES = "matches"
    #: The job has no (valid) fingerprint yet: record the joiner's, admit.
    RECORD = "record"
    #: It differs, but the job is empty and fresh: replace it, admit.
    REPLACE = "replace"
    #: It differs: refuse the joiner, change nothing.
    REFUSE = "refuse"


@dataclass(frozen=True)
class Admission:
    verdict: Verdict
    #: How the joiner differs from the recorded fingerprint (REPLACE, REFUSE).
    differences: tuple[Difference, ...] = ()


def admit(
    joiner: JobFingerprint, recorded: JobFingerprint | None, activity: JobActivity
) -> Admission:
    """Decide about a joiner carrying ``joiner`` when the job has recorded
    ``recorded`` (None: nothing, or a malformed value)."""
    if recorded is None:
        return Admission(Verdict.RECORD)
    differences = compare(joiner, recorded)
    if not differences:
        return Admission(Verdict.MATCHES)
    if activity.fresh:
        return Admission(Verdict.REPLACE, differences)
    return Admission(Verdict.REFUSE, differences)

