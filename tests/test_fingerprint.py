"""The configuration fingerprint's pure core: validation, comparison, the
message a refused worker reads, and the decision about a joiner."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollcall.membership.errors import InvalidRequest
from rollcall.membership.fingerprint import (
    FIELDS,
    MAX_FIELDS,
    MAX_VALUE_LENGTH,
    NAMES,
    Difference,
    JobActivity,
    JobFingerprint,
    Verdict,
    admit,
    check_fingerprint,
    compare,
    describe_mismatch,
)

#: A job's fingerprint with a value in every field.
JOB = JobFingerprint.of(
    {
        "global_batch": "48",
        "micro_batch": "8",
        "seed": "0",
        "num_samples": "30769",
        "data": "sha256:" + "c" * 64,
        "model": "30 tensors, 137,216 elements, sha256:" + "a" * 64,
        "modules": "29 modules, sha256:" + "e" * 64,
        "optimizer": "torch.optim.adamw.AdamW",
        "optimizer_settings": "betas=(0.9,0.999) eps=1e-08 lr=0.003 weight_decay=0.01",
        "scheduler": "none",
        "scheduler_settings": "none",
        "grad_scaler": "none",
        "extras": "[]",
        "before_update": "__main__.main.<locals>.clip",
        "code": "__main__=1a2b3c4d models=5e6f7a8b",
        "settings": "amp=true label_smoothing=0.1",
        "initial_state": "sha256:" + "b" * 64,
        "torch": "2.13.0+cpu",
        "min_workers": "1",
        "sync_buffers": "true",
        "exact": "false",
        "data_division": "2",
        "reduction": "2",
        "overlap": "true",
        "drift_check": "100",
        "shard_partitions": "64",
        "shard_redundancy": "2",
        "checkpoint_every": "100",
        "checkpoints": "on",
    }
)
EMPTY_FRESH = JobActivity(members=0, joiners=0, progress=False, checkpoints=False)
BUSY = JobActivity(members=2, joiners=0, progress=True, checkpoints=False)


def changed(name: str, value: str) -> JobFingerprint:
    return JobFingerprint.of({**JOB.as_dict(), name: value})


def test_a_worker_of_another_torch_version_is_told_why_it_matters() -> None:
    (difference,) = compare(changed("torch", "2.12.1+cpu"), JOB)
    said = describe_mismatch("run1", (difference,))
    assert "torch is 2.12.1+cpu but job run1's is 2.13.0+cpu" in said
    assert "replicas drift apart: run one version on every worker" in said


def test_a_worker_that_read_other_samples_is_told_what_to_do() -> None:
    (difference,) = compare(changed("data", "sha256:" + "d" * 64), JOB)
    said = describe_mismatch("run1", (difference,))
    assert "data is sha256:ddd" in said
    assert "train every worker on the same data" in said
    assert "data_probe=False on every worker" in said


# --- validation ------------------------------------------------------------------


def test_every_declared_field_is_in_the_test_job() -> None:
    assert set(NAMES) == set(JOB.as_dict())
    assert len(set(NAMES)) == len(FIELDS) <= MAX_FIELDS


def test_a_fingerprint_is_the_same_whatever_the_order_of_its_fields() -> None:
    reordered = JobFingerprint.of(dict(reversed(list(JOB.as_dict().items()))))
    assert reordered == JOB
    assert compare(reordered, JOB) == ()


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({f"f{i}": "1" for i in range(MAX_FIELDS + 1)}, f"more than {MAX_FIELDS}"),
        ({"Global_batch": "1"}, "field name 'Global_batch' is not"),
        ({"global batch": "1"}, "field name 'global batch' is not"),
        ({"": "1"}, "field name '' is not"),
        ({"_x": "1"}, "field name '_x' is not"),
        ({"x" * 33: "1"}, "is not 1-32 characters"),
        ({"seed": "1" * (MAX_VALUE_LENGTH + 1)}, "field seed is longer than 256"),
        ({"seed": "1\n2"}, "field seed has characters outside printable ASCII"),
        ({"seed": "\u00e9"}, "field seed has characters outside printable ASCII"),
        ({"seed": "\x7f"}, "field seed has characters outside printable ASCII"),
        ({"seed": 1}, "field seed is not text"),
    ],
)
def test_a_malformed_fingerprint_is_refused_naming_the_field(values: dict, says: str) -> None:
    with pytest.raises(InvalidRequest, match=says):
        check_fingerprint(values)


def test_the_largest_fingerprint_passes() -> None:
    values = {f"f{i}": "~" * MAX_VALUE_LENGTH for i in range(MAX_FIELDS)}
    assert len(check_fingerprint(values)) == MAX_FIELDS


# --- comparison ------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_a_difference_in_any_field_is_named_with_both_values(name: str) -> None:
    joiner = changed(name, "other")
    assert compare(joiner, JOB) == (Difference(name, "other", JOB.get(name)),)
    message = describe_mismatch("run1", compare(joiner, JOB))
    assert f"this worker's {name} is other but job run1's is {JOB.get(name)}" in message


def test_a_field_only_one_side_has_differs_and_reads_unset() -> None:
    values = JOB.as_dict()
    del values["exact"]
    joiner = JobFingerprint.of(values)
    assert compare(joiner, JOB) == (Difference("exact", None, "false"),)
    assert "this worker's exact is unset but job run1's is false" in describe_mismatch(
        "run1", compare(joiner, JOB)
    )
    assert compare(JOB, joiner) == (Difference("exact", "false", None),)


def test_differences_come_in_the_order_of_the_fields_then_unknown_names() -> None:
    joiner = JobFingerprint.of(
        {**JOB.as_dict(), "zeta": "1", "initial_state": "sha256:c", "global_batch": "96"}
    )
    assert [d.name for d in compare(joiner, JOB)] == ["global_batch", "initial_state", "zeta"]


@given(st.dictionaries(st.sampled_from(NAMES), st.text("0123456789abc", max_size=5)))
def test_compare_finds_exactly_the_fields_that_differ(changes: dict[str, str]) -> None:
    joiner = JobFingerprint.of({**JOB.as_dict(), **changes})
    differing = {name for name, value in changes.items() if value != JOB.get(name)}
    assert {d.name for d in compare(joiner, JOB)} == differing


# --- the message -----------------------------------------------------------------


def test_the_message_names_the_field_both_values_and_what_to_do() -> None:
    message = describe_mismatch("run1", compare(changed("global_batch", "96"), JOB))
    assert message == (
        "this worker's global_batch is 96 but job run1's is 48: every worker of a job must "
        "use the same settings; fix this worker's settings, or start a new job under another "
        "name"
    )


def test_several_differences_are_listed_in_one_line() -> None:
    joiner = JobFingerprint.of({**JOB.as_dict(), "global_batch": "96", "seed": "1"})
    message = describe_mismatch("run1", compare(joiner, JOB))
    assert message.startswith(
        "this worker's global_batch is 96 but job run1's is 48, and its seed is 1 but the "
        "job's is 0: every worker"
    )
    assert "\n" not in message


def test_settings_that_differ_are_shown_alone() -> None:
    joiner = changed("optimizer_settings", "betas=(0.9,0.999) eps=1e-08 lr=0.001 weight_decay=0.01")
    message = describe_mismatch("run1", compare(joiner, JOB))
    assert "this worker's optimizer_settings has lr=0.001 but job run1's has lr=0.003:" in message


def test_a_setting_only_one_side_has_is_shown_as_missing() -> None:
    joiner = changed("optimizer_settings", "betas=(0.9,0.999) eps=1e-08 lr=0.003")
    message = describe_mismatch("run1", compare(joiner, JOB))
    assert "has no weight_decay but job run1's has weight_decay=0.01" in message


def test_a_different_initial_state_says_what_it_means() -> None:
    message = describe_mismatch("run1", compare(changed("initial_state", "sha256:c"), JOB))
    assert f"is sha256:c but job run1's is {JOB.get('initial_state')}" in message
    assert "another model seed, or other pretrained weights" in message


def test_there_is_no_message_without_a_difference() -> None:
    with pytest.raises(ValueError):
        describe_mismatch("run1", ())


# --- admission -------------------------------------------------------------------


def test_the_first_fingerprint_of_a_job_is_recorded() -> None:
    assert admit(JOB, None, BUSY).verdict is Verdict.RECORD


def test_the_job_own_fingerprint_is_admitted() -> None:
    assert admit(JOB, JOB, BUSY).verdict is Verdict.MATCHES


def test_a_different_fingerprint_replaces_the_job_s_when_the_job_is_empty_and_fresh() -> None:
    joiner = changed("global_batch", "96")
    admission = admit(joiner, JOB, EMPTY_FRESH)
    assert admission.verdict is Verdict.REPLACE
    assert admission.differences == (Difference("global_batch", "96", "48"),)


@pytest.mark.parametrize(
    "activity",
    [
        JobActivity(members=1, joiners=0, progress=False, checkpoints=False),
        JobActivity(members=0, joiners=1, progress=False, checkpoints=False),
        JobActivity(members=0, joiners=0, progress=True, checkpoints=False),
        JobActivity(members=0, joiners=0, progress=False, checkpoints=True),
    ],
    ids=["members", "pending joiners", "progress", "checkpoints"],
)
def test_a_different_fingerprint_is_refused_by_a_job_that_is_not_empty_and_fresh(
    activity: JobActivity,
) -> None:
    joiner = changed("seed", "1")
    admission = admit(joiner, JOB, activity)
    assert admission.verdict is Verdict.REFUSE
    assert admission.differences == (Difference("seed", "1", "0"),)
