"""Generated hostile requests for every gRPC method of the replica and of a
worker's state server (real etcd, real gRPC): whatever the fields, message
sequences or raw bytes, a request that must be refused is refused with a
documented status code, changes nothing, and the service goes on serving.

Each example starts from a request the service would accept and replaces
one or more of its fields with arbitrary values, or sends arbitrary bytes.
An oracle written from the documented grammar (independent of the code under
test) tells which requests might be accepted; those are not sent. The
helpers and the hand-picked cases are in tests/test_bad_input.py."""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from google.protobuf.message import Message
from hypothesis import HealthCheck, Phase, assume, event, given, settings
from hypothesis import strategies as st

from rollcall.membership.config import Config
from rollcall.pb import rendezvous_pb2 as pb
from tests.test_bad_input import (
    ADDRESS,
    CHECKPOINT_STEP,
    PUPPET_FINGERPRINT,
    RENDEZVOUS,
    SNAPSHOT,
    STATE,
    STATE_JOB,
    STATE_REJECTIONS,
    STATE_SECRET,
    STATE_VIEW,
    UNDECODABLE,
    Code,
    Job,
    Target,
    assert_refused,
    assert_refused_with_a_documented_code,
    assert_state_refused,
    decodes,
    fetch_request,
    open_,
    publish,
    settled_target,
    state_request,
    unchanging_job,
)

pytestmark = pytest.mark.integration  # the module's job starts etcd and a replica


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    yield from unchanging_job(tmp_path_factory.mktemp("fuzz"))


@pytest.fixture(scope="module")
def target(job: Job) -> Target:
    """The job's view, the same for every example: nothing may change it."""
    return settled_target(job)


def fuzzing(examples: int) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Deterministic (derandomized, no example database) and without
    shrinking: every failing example a shrinker would try again could change
    the live job (an accepted Join does) and so the examples after it."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


# --- the documented grammar, read strictly (ASCII only) ---------------------------------

INT64_MAX = 2**63 - 1
STRICT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
STRICT_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):([0-9]{1,5})")
STRICT_DIGEST = re.compile(r"[A-Za-z0-9:+/=_-]{0,128}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
#: Longest failure reason and checkpoint uri (docs/protocol.md).
MAX_REASON, MAX_URI = 256, 4096


def is_id(value: str) -> bool:
    return STRICT_ID.fullmatch(value) is not None


def is_time(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def might_join(t: Target, request: pb.JoinRequest) -> bool:
    """Well-formed, and with no fingerprint (not checked) or the job's own:
    any other is malformed or refused as another configuration."""
    address = STRICT_ADDRESS.fullmatch(request.address)
    return (
        request.job == t.job
        and address is not None
        and 0 < int(address.group(2)) < 65536
        and (request.name == "" or is_id(request.name))
        and dict(request.fingerprint) in ({}, PUPPET_FINGERPRINT)
    )


def might_publish(t: Target, request: pb.PublishCheckpointRequest) -> bool:
    """Whether the replica might take the manifest (or answer that it is not
    newer): a member of the view, at its epoch, with a well-formed manifest."""
    c = request.checkpoint
    return (
        request.job == t.job
        and request.member_id in t.in_view
        and request.member_secret == t.secret_of(request.member_id)
        and request.epoch == t.epoch
        and c.step <= CHECKPOINT_STEP + 1  # the job's progress, and one step ahead
        and c.epoch <= t.epoch
        and 0 < len(c.uri) <= MAX_URI
        and "\x00" not in c.uri
        and c.size > 0
        and SHA256_HEX.fullmatch(c.sha256) is not None
        and c.digest != ""
        and STRICT_DIGEST.fullmatch(c.digest) is not None
        and is_id(c.writer)
        and is_time(c.created_unix)
        and is_time(c.step_seconds)
        and well_formed_parts(c)
    )


def well_formed_parts(c: pb.Checkpoint) -> bool:
    """No parts, or parts that hold partitions 0..n-1 once each, in files of
    their own, each part well-formed."""
    if not c.parts:
        return True
    listed = sorted(p for part in c.parts for p in part.partitions)
    files = {part.uri for part in c.parts} | {c.uri}
    return (
        listed == list(range(len(listed)))
        and len(listed) <= 512
        and len(files) == len(c.parts) + 1
        and all(
            0 < len(part.uri) <= MAX_URI and "\x00" not in part.uri and part.size > 0
            and SHA256_HEX.fullmatch(part.sha256) is not None
            and part.partitions and len(part.partitions) == len(part.digests)
            and all(d and STRICT_DIGEST.fullmatch(d) is not None for d in part.digests)
            for part in c.parts
        )
    )  # fmt: skip


class Fate(enum.Enum):
    """What the leader does with one session message."""

    REFUSED = "ends the session with a status"
    HARMLESS = "taken, changes nothing the job reports"
    CHANGES = "taken, changes the job (or takes over a member process's session)"


def opening_fate(t: Target, first: pb.SessionRequest | bytes) -> Fate:
    """The fate of a session's first message."""
    if isinstance(first, bytes) or first.WhichOneof("kind") != "open":
        return Fate.REFUSED
    request = first.open
    if request.job != t.job or request.member_id not in t.in_view or request.epoch > t.epoch:
        return Fate.REFUSED
    if request.member_secret != t.secret_of(request.member_id):
        return Fate.REFUSED
    return Fate.HARMLESS if request.member_id == t.puppet else Fate.CHANGES


def message_fate(t: Target, message: pb.SessionRequest | bytes) -> Fate:
    """The fate of a message on the puppet's open session (no roll call held)."""
    if isinstance(message, bytes):
        return Fate.REFUSED
    kind = message.WhichOneof("kind")
    if kind == "heartbeat":
        beat = message.heartbeat
        return Fate.HARMLESS if beat.epoch <= t.epoch and is_time(beat.sent_at) else Fate.REFUSED
    if kind == "progress":
        progress = message.progress
        if progress.epoch > t.epoch or progress.step > INT64_MAX:
            return Fate.REFUSED
        return Fate.CHANGES if progress.epoch == t.epoch else Fate.HARMLESS  # the job's step
    if kind == "answer":
        answer = message.answer
        well_formed = (
            answer.epoch <= INT64_MAX
            and (not answer.HasField("step") or answer.step <= INT64_MAX)
            and STRICT_DIGEST.fullmatch(answer.digest) is not None
        )
        return Fate.HARMLESS if well_formed else Fate.REFUSED  # no roll call to answer
    if kind == "failure":
        failure = message.failure
        if (
            failure.epoch > t.epoch
            or not is_id(failure.peer_id)
            or len(failure.reason) > MAX_REASON
        ):
            return Fate.REFUSED
        rechecks = failure.epoch == t.epoch and failure.peer_id in t.in_view
        return Fate.CHANGES if rechecks else Fate.HARMLESS  # a roll call
    if kind == "view_report":
        r = message.view_report
        durations = (r.fetch_s, r.rebuild_s, r.first_step_s, r.lost_work_s, r.step_s, r.launch_s)
        in_range = all(0 <= d < 1e6 for d in durations)
        return Fate.HARMLESS if r.epoch <= t.epoch and in_range else Fate.REFUSED
    if kind == "busy":
        busy = message.busy
        in_range = is_time(busy.seconds) and busy.seconds < Config().busy_max + 1
        valid = busy.epoch <= t.epoch and in_range and len(busy.reason) <= MAX_REASON
        # A member's busy period changes only how long its peers wait for
        # it: nothing the job reports.
        return Fate.HARMLESS if valid else Fate.REFUSED
    if kind == "checkpoint_failure":
        failure = message.checkpoint_failure
        if failure.epoch > t.epoch or failure.step > INT64_MAX or len(failure.reason) > MAX_REASON:
            return Fate.REFUSED
        # The puppet is in the view: at its epoch the failure is recorded.
        return Fate.CHANGES if failure.epoch == t.epoch else Fate.HARMLESS
    return Fate.REFUSED  # empty, or a second Open


def refused_session(t: Target, messages: list[pb.SessionRequest | bytes]) -> list[Any] | None:
    """``messages`` up to the first one the leader must refuse (it reads none
    after it, and a client writing on past a refusal loses its status to a
    local error); None if a message before it would be taken and change the
    job, or if none is refused."""
    fates = [opening_fate(t, messages[0]), *(message_fate(t, m) for m in messages[1:])]
    for index, fate in enumerate(fates):
        if fate is Fate.REFUSED:
            return messages[: index + 1]
        if fate is Fate.CHANGES:
            return None
    return None


# --- strategies ------------------------------------------------------------------------

short_texts = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["", "w", "job1", "a b", "-x", "\u00e9", "\x00", "x" * 65, "ghost-0"]),
)
#: Anything, up to well past the 64 KiB message limit.
texts = st.one_of(short_texts, st.integers(60_000, 70_000).map("n".__mul__))
#: Digits of every kind: str.isdigit() accepts more than int() and than ASCII.
ports = st.one_of(
    st.integers(-10, 70_000).map(str),
    st.text(st.characters(categories=["Nd", "No"]), min_size=1, max_size=6),
    st.text(max_size=8),
)
addresses = st.one_of(
    st.builds("{}:{}".format, st.sampled_from(["127.0.0.1", "localhost", "[::1]"]), ports),
    st.builds("{}:{}".format, texts, ports),
    st.text(max_size=300),
)
counters = st.one_of(
    st.integers(0, 2**64 - 1),
    st.sampled_from([0, 1, 2, 3, 2**63 - 1, 2**63, 2**64 - 1]),
)
numbers = st.one_of(
    st.floats(),
    st.sampled_from([0.0, 0.5, -0.0, -1.0, 1e6, math.inf, -math.inf, math.nan]),
)
digests = st.one_of(
    st.text(max_size=140),
    st.sampled_from(["", "sha256:ab", SNAPSHOT.digest, "a" * 128, "a" * 129, "sha256 ab"]),
)
#: A sharded checkpoint's parts: none, well-formed ones, and any mix.
checkpoint_parts = st.lists(
    st.builds(
        pb.CheckpointPart, uri=texts, size=counters,
        sha256=st.one_of(st.just("1" * 64), st.text(max_size=70)),
        partitions=st.lists(st.integers(0, 2**32 - 1), max_size=4),
        digests=st.lists(st.one_of(st.just("sha256:ab"), st.text(max_size=140)), max_size=4),
    ),
    max_size=3,
)  # fmt: skip
sha256s = st.one_of(
    st.text(max_size=70),
    st.just("0" * 64),
    st.text("0123456789abcdefABCDEF", min_size=64, max_size=64),
)


#: Fingerprints: none, the job's own with one field changed, dropped or
#: added, and arbitrary maps (bad names, long or odd values, too many fields).
fingerprint_names = st.one_of(
    st.sampled_from([*PUPPET_FINGERPRINT, "model", "exact", "Seed", "a b", "_x", "x" * 33]),
    st.text(max_size=40),
)
fingerprint_values = st.one_of(
    st.sampled_from(["", "0", "48", "96", "\n", "\u00e9", "\x7f", "v" * 256, "v" * 257]),
    st.text(max_size=300),
)
fingerprints = st.one_of(
    st.just({}),
    st.builds(
        lambda changes, dropped: {
            k: v for k, v in {**PUPPET_FINGERPRINT, **changes}.items() if k not in dropped
        },
        st.dictionaries(fingerprint_names, fingerprint_values, max_size=3),
        st.sets(st.sampled_from(sorted(PUPPET_FINGERPRINT)), max_size=1),
    ),
    st.dictionaries(fingerprint_names, fingerprint_values, max_size=40),
)


def epochs(epoch: int) -> st.SearchStrategy[int]:
    """Epochs around ``epoch`` (old, current, future) and anywhere."""
    near = [max(0, epoch - 1), epoch, epoch + 1, 0, INT64_MAX, 2**63, 2**64 - 1]
    return st.one_of(st.sampled_from(near), counters)


def member_secrets(t: Target) -> st.SearchStrategy[str]:
    """Member secrets: the job's own (each member's), empty, well-formed
    strangers and anything."""
    known = sorted(t.secrets.values())
    return st.one_of(st.sampled_from([*known, "", "0" * 64, "f" * 63]), short_texts)


def ids(t: Target) -> st.SearchStrategy[str]:
    """Member ids: the job's own, unknown ones and anything."""
    known = sorted(t.in_view)
    return st.one_of(st.sampled_from([*known, "ghost-0"]), short_texts)


def undecodable(message_type: type[Message]) -> st.SearchStrategy[bytes]:
    """Bytes that are no ``message_type``: a well-formed start broken by a
    corrupt field (bad wire type, truncated varint or length, field 0, bad
    UTF-8 in a string), or anything."""
    start = st.sampled_from([b"", pb.StatusRequest(job="job1").SerializeToString()])
    corrupt = st.sampled_from(
        [b"\x0f", b"\x0e", b"\x08\xff", b"\x0a\x05ab", b"\x00\x01", b"\x0a\x02\xff\xfe", b"\xff"]
    )
    garbage = st.one_of(
        st.builds(lambda a, b, c: a + b + c, start, corrupt, st.binary(max_size=8)),
        st.binary(min_size=1, max_size=64),
    )
    return garbage.filter(lambda data: not decodes(message_type, data))


def fuzzed_fields(
    data: st.DataObject, valid: dict[str, Any], strategies: dict[str, st.SearchStrategy[Any]]
) -> dict[str, Any]:
    """``valid``, with one or more fields replaced by draws from ``strategies``."""
    fields = dict(valid)
    for name in data.draw(st.sets(st.sampled_from(sorted(fields)), min_size=1), label="fuzzed"):
        fields[name] = data.draw(strategies[name], label=name)
    return fields


VIEW_REPORT_DURATIONS = (
    "fetch_s",
    "rebuild_s",
    "first_step_s",
    "lost_work_s",
    "step_s",
    "launch_s",
)


def session_messages(t: Target) -> st.SearchStrategy[pb.SessionRequest | bytes]:
    """Any session message (below the message limit) or bytes that are none."""
    epoch = epochs(t.epoch)
    heartbeats = st.builds(pb.Heartbeat, epoch=epoch, sent_at=numbers)
    progress = st.builds(pb.Progress, epoch=epoch, step=counters)
    answers = st.builds(pb.RollCallAnswer, epoch=epoch, step=st.none() | counters, digest=digests)
    reasons = st.one_of(short_texts, st.just("r" * (MAX_REASON + 1)))
    failures = st.builds(pb.FailureReport, epoch=epoch, peer_id=ids(t), reason=reasons)
    durations = {name: numbers for name in VIEW_REPORT_DURATIONS}
    reports = st.builds(
        pb.ViewReport, epoch=epoch, global_batch=st.integers(0, 2**32 - 1), **durations
    )
    opens = st.builds(
        pb.Open, job=short_texts, member_id=ids(t), epoch=epoch, member_secret=member_secrets(t)
    )
    busy = st.builds(pb.Busy, epoch=epoch, seconds=numbers, reason=reasons)
    checkpoint_failures = st.builds(
        pb.CheckpointFailure, epoch=epoch, step=counters, reason=reasons
    )
    return st.one_of(
        checkpoint_failures.map(lambda m: pb.SessionRequest(checkpoint_failure=m)),
        heartbeats.map(lambda m: pb.SessionRequest(heartbeat=m)),
        progress.map(lambda m: pb.SessionRequest(progress=m)),
        answers.map(lambda m: pb.SessionRequest(answer=m)),
        failures.map(lambda m: pb.SessionRequest(failure=m)),
        reports.map(lambda m: pb.SessionRequest(view_report=m)),
        busy.map(lambda m: pb.SessionRequest(busy=m)),
        opens.map(lambda m: pb.SessionRequest(open=m)),
        st.just(pb.SessionRequest()),
        undecodable(pb.SessionRequest),
    )


def harmless_messages(t: Target) -> st.SearchStrategy[pb.SessionRequest]:
    """Messages a member may send on its session that change nothing the
    job reports: heartbeats, answers to closed roll calls, reports of old
    epochs or on strangers, view reports."""
    old = st.integers(max(0, t.epoch - 1), t.epoch)
    times = st.floats(0, 1e5)
    heartbeats = st.builds(pb.Heartbeat, epoch=old, sent_at=times)
    answers = st.builds(
        pb.RollCallAnswer,
        epoch=st.integers(0, t.epoch),
        step=st.none() | st.integers(0, INT64_MAX),
        digest=st.sampled_from(["", "sha256:ab", "a" * 128]),
    )
    failures = st.builds(
        pb.FailureReport, epoch=st.just(max(0, t.epoch - 1)), peer_id=ids(t), reason=short_texts
    )
    durations = {name: st.floats(0, 1e5) for name in VIEW_REPORT_DURATIONS}
    reports = st.builds(pb.ViewReport, epoch=old, **durations)
    progress = st.builds(pb.Progress, epoch=st.just(max(0, t.epoch - 1)), step=st.integers(0, 9))
    return st.one_of(
        heartbeats.map(lambda m: pb.SessionRequest(heartbeat=m)),
        answers.map(lambda m: pb.SessionRequest(answer=m)),
        failures.map(lambda m: pb.SessionRequest(failure=m)),
        reports.map(lambda m: pb.SessionRequest(view_report=m)),
        progress.map(lambda m: pb.SessionRequest(progress=m)),
    )


# --- the replica -------------------------------------------------------------------------


@fuzzing(examples=40)
@given(data=st.data())
def test_arbitrary_join_is_refused_with_a_documented_code(
    job: Job, target: Target, data: st.DataObject
) -> None:
    valid = {"job": target.job, "address": ADDRESS, "name": "fuzz", "fingerprint": {}}
    strategies = {"job": texts, "address": addresses, "name": texts, "fingerprint": fingerprints}
    request = pb.JoinRequest(**fuzzed_fields(data, valid, strategies))
    assume(not might_join(target, request))
    event("with a fingerprint" if request.fingerprint else "without a fingerprint")
    assert_refused_with_a_documented_code(job, "Join", request)


@fuzzing(examples=20)
@given(data=st.data())
def test_arbitrary_leave_is_refused_with_a_documented_code(
    job: Job, target: Target, data: st.DataObject
) -> None:
    first = target.members[0]
    valid = {
        "job": target.job, "member_id": first, "epoch": target.epoch,
        "member_secret": target.secret_of(first),
    }  # fmt: skip
    strategies = {
        "job": texts,
        "member_id": st.one_of(ids(target), texts),
        "epoch": epochs(target.epoch),
        "member_secret": member_secrets(target),
    }
    request = pb.LeaveRequest(**fuzzed_fields(data, valid, strategies))
    member = request.member_id in target.in_view
    own = request.member_secret == target.secret_of(request.member_id)
    assume(not (request.job == target.job and member and own and request.epoch <= target.epoch))
    event("with the member's secret" if own else "without the member's secret")
    assert_refused_with_a_documented_code(job, "Leave", request)


@fuzzing(examples=25)
@given(data=st.data())
def test_arbitrary_session_opening_is_refused_with_a_documented_code(
    job: Job, target: Target, data: st.DataObject
) -> None:
    """A session whose first message is not a valid Open: an Open with
    fields replaced (unknown or malformed member, stale or future epoch,
    another job...), any other message, or bytes that are no message."""
    assert target.puppet is not None
    valid = {
        "job": target.job, "member_id": target.puppet, "epoch": target.epoch,
        "member_secret": target.secret_of(target.puppet),
    }  # fmt: skip
    strategies = {
        "job": texts,
        "member_id": st.one_of(ids(target), texts),
        "epoch": epochs(target.epoch),
        "member_secret": member_secrets(target),
    }
    fuzzed_open = pb.SessionRequest(open=pb.Open(**fuzzed_fields(data, valid, strategies)))
    first = data.draw(st.one_of(st.just(fuzzed_open), session_messages(target)), label="first")
    assume(opening_fate(target, first) is Fate.REFUSED)
    assert_refused_with_a_documented_code(job, "Session", [first])


@fuzzing(examples=35)
@given(data=st.data())
def test_arbitrary_message_on_an_open_session_is_refused_with_a_documented_code(
    job: Job, target: Target, data: st.DataObject
) -> None:
    """The puppet's Open (of the current or the previous epoch), harmless
    messages (heartbeats, replayed roll-call answers, old reports...), then
    any messages, sent up to the first the leader must refuse (a malformed
    field, an epoch from the future, a second Open, bytes that are no
    message...). The refused session ends with a documented status and
    changes nothing: the puppet keeps its place in the view."""
    epoch = data.draw(st.sampled_from([target.epoch, target.epoch - 1]), label="open epoch")
    harmless = data.draw(st.lists(harmless_messages(target), max_size=3), label="harmless")
    anything = data.draw(st.lists(session_messages(target), min_size=1, max_size=3), label="then")
    messages = refused_session(target, [open_(target, epoch=epoch), *harmless, *anything])
    assume(messages is not None)
    event(f"{len(messages) - 1} message(s) after the Open")  # --hypothesis-show-statistics
    assert_refused_with_a_documented_code(job, "Session", messages)


@fuzzing(examples=10)
@given(name=texts)
def test_arbitrary_status_is_refused_with_a_documented_code(
    job: Job, target: Target, name: str
) -> None:
    assume(name != target.job)
    assert_refused_with_a_documented_code(job, "Status", pb.StatusRequest(job=name))


@fuzzing(examples=12)
@given(data=st.data())
def test_arbitrary_watch_is_refused_with_a_documented_code(
    job: Job, target: Target, data: st.DataObject
) -> None:
    valid = {"job": target.job, "after_epoch": target.epoch}
    strategies = {"job": texts, "after_epoch": epochs(target.epoch)}
    request = pb.WatchRequest(**fuzzed_fields(data, valid, strategies))
    watched = request.job == target.job and request.after_epoch <= INT64_MAX
    assume(not watched)  # a well-formed Watch is answered by waiting for views
    assert_refused_with_a_documented_code(job, "Watch", request)


@fuzzing(examples=30)
@given(data=st.data())
def test_arbitrary_checkpoint_is_refused_with_a_documented_code(
    job: Job, target: Target, data: st.DataObject
) -> None:
    base = publish(0, step=CHECKPOINT_STEP - 1)(target)  # well-formed, not newer
    manifest = {f.name: getattr(base.checkpoint, f.name) for f in pb.Checkpoint.DESCRIPTOR.fields}
    manifest["checkpoint_epoch"] = manifest.pop("epoch")
    valid = {
        "job": base.job, "member_id": base.member_id, "epoch": base.epoch,
        "member_secret": base.member_secret, **manifest,
    }  # fmt: skip
    strategies = {
        "job": texts, "member_id": ids(target), "epoch": epochs(target.epoch),
        "member_secret": member_secrets(target),
        "step": counters, "digest": digests, "uri": texts, "size": counters, "sha256": sha256s,
        "checkpoint_epoch": epochs(target.epoch), "writer": ids(target),
        "created_unix": numbers, "step_seconds": numbers, "parts": checkpoint_parts,
    }  # fmt: skip
    fields = fuzzed_fields(data, valid, strategies)
    who, epoch, name = fields.pop("member_id"), fields.pop("epoch"), fields.pop("job")
    request = publish(who, epoch, name, secret=fields.pop("member_secret"), **fields)(target)
    assume(not might_publish(target, request))
    assert_refused_with_a_documented_code(job, "PublishCheckpoint", request)


@fuzzing(examples=30)
@given(data=st.data())
def test_undecodable_bytes_are_refused_on_every_method(job: Job, data: st.DataObject) -> None:
    rpc = data.draw(st.sampled_from(sorted(RENDEZVOUS)), label="rpc")
    method = RENDEZVOUS[rpc]
    raw = data.draw(undecodable(method.request), label="bytes")
    request = [raw] if method.request_streaming else raw
    assert_refused(job, rpc, request, {Code.INVALID_ARGUMENT}, "undecodable request")


# --- a worker's state server ---------------------------------------------------------------


def might_serve(rpc: str, request: Any) -> bool:
    """Whether the state server might answer: a member of its view at its
    epoch with the view's epoch secret (and for Fetch, its digest and a
    range inside its state)."""
    admitted = (
        request.job == STATE_JOB
        and request.member_id in STATE_VIEW
        and request.epoch == STATE_VIEW.epoch
        and request.epoch_secret == STATE_SECRET
    )
    if rpc != "Fetch":
        return admitted
    in_range = 0 < request.length and request.offset + request.length <= len(SNAPSHOT.data)
    return admitted and request.digest == SNAPSHOT.digest and in_range


@fuzzing(examples=60)
@given(data=st.data())
def test_arbitrary_state_request_is_refused_with_a_documented_code(data: st.DataObject) -> None:
    rpc = data.draw(st.sampled_from(sorted(STATE)), label="rpc")
    members = st.one_of(st.sampled_from([*STATE_VIEW.ids, "ghost-0"]), texts)
    strategies: dict[str, st.SearchStrategy[Any]] = {
        "job": texts, "member_id": members, "epoch": epochs(STATE_VIEW.epoch),
        "digest": digests, "offset": st.one_of(counters, st.integers(0, len(SNAPSHOT.data) + 1)),
        "length": st.one_of(counters, st.integers(0, len(SNAPSHOT.data) + 1)),
        "epoch_secret": st.one_of(
            st.just(STATE_SECRET), st.just(""), st.text("0123456789abcdef", max_size=66), texts
        ),
        "whole_if_small": st.booleans(),
    }  # fmt: skip
    valid = fetch_request() if rpc == "Fetch" else state_request()
    fields = {f.name: getattr(valid, f.name) for f in valid.DESCRIPTOR.fields}
    request = type(valid)(**fuzzed_fields(data, fields, strategies))
    assume(not might_serve(rpc, request))
    assert_state_refused(rpc, request, STATE_REJECTIONS)


@fuzzing(examples=20)
@given(data=st.data())
def test_undecodable_bytes_are_refused_by_the_state_server(data: st.DataObject) -> None:
    rpc = data.draw(st.sampled_from(sorted(STATE)), label="rpc")
    raw = data.draw(st.one_of(st.just(UNDECODABLE), undecodable(STATE[rpc].request)))
    assert_state_refused(rpc, raw, {Code.INVALID_ARGUMENT}, "undecodable request")
