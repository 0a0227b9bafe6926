"""Member secrets and epoch secrets (membership/credentials.py): pure checks."""

from __future__ import annotations

import secrets

from rollcall.membership.credentials import (
    epoch_secret,
    is_secret_text,
    secret_hash,
    secret_matches,
    secrets_equal,
)
from rollcall.membership.view import Member, View

KEY = "ab" * 32
VIEW = View(4, (Member("a", "127.0.0.1:1"), Member("b", "127.0.0.1:2")), 9, "sha256:x")


def test_a_member_secret_matches_its_own_hash_only() -> None:
    mine, other = secrets.token_hex(32), secrets.token_hex(32)

    assert secret_matches(mine, secret_hash(mine))
    assert not secret_matches(other, secret_hash(mine))
    assert not secret_matches("", secret_hash(mine))
    assert not secret_matches(secret_hash(mine), secret_hash(mine)), "the hash is no secret"


def test_an_empty_or_malformed_stored_hash_matches_nothing() -> None:
    for stored in ("", "zz" * 32, secret_hash("s")[:-1], secret_hash("s").upper()):
        assert not secret_matches("s", stored)
        assert not secret_matches("", stored)


def test_hashes_and_secrets_have_the_documented_form() -> None:
    assert is_secret_text(secret_hash("anything"))
    assert is_secret_text(secrets.token_hex(32))
    assert not is_secret_text(secrets.token_hex(16))


def test_every_replica_derives_the_same_epoch_secret_for_a_view() -> None:
    assert epoch_secret(KEY, "job1", VIEW) == epoch_secret(KEY, "job1", VIEW)
    assert is_secret_text(epoch_secret(KEY, "job1", VIEW))


def test_the_epoch_secret_depends_on_the_key_the_job_and_the_view() -> None:
    base = epoch_secret(KEY, "job1", VIEW)
    others = {
        epoch_secret("cd" * 32, "job1", VIEW),
        epoch_secret(KEY, "job2", VIEW),
        epoch_secret(KEY, "job1", View(5, VIEW.members, 9, "sha256:x")),
        epoch_secret(KEY, "job1", View(4, VIEW.members[:1], 9, "sha256:x")),
    }
    assert base not in others and len(others) == 4


def test_epoch_secrets_compare_equal_only_to_themselves() -> None:
    held = epoch_secret(KEY, "job1", VIEW)

    flipped = held[:-1] + ("1" if held[-1] == "0" else "0")

    assert secrets_equal(held, held)
    assert not secrets_equal(flipped, held)
    assert not secrets_equal("", held)
    assert not secrets_equal(held, None)
    assert not secrets_equal("", "")
