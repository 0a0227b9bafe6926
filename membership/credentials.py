"""What proves that a request comes from a member, as pure functions.

The job token only admits a client. A member id is a name anyone who read a
view knows, so the ``Join`` answer hands each member a *member secret*
(random, made at the edge: ``rollcall.rendezvous.service``) that its later calls
carry; the replicas keep only its SHA-256 (in the member's etcd record), so
reading etcd or a replica's memory does not give it away.

Each committed view has an *epoch secret*, derived from the job's epoch key
(random, kept in etcd) and the view itself, so that every replica derives
the same one without storing it and a member of an older view cannot guess
the next. The leader sends it on the sessions of the view's members only
(never in ``Status`` or ``Watch``); members present it to each other's state
servers and use it to seal the view's bootstrap store (``rollcall.worker.bootstrap``).
"""

from __future__ import annotations

import hashlib
import hmac
import re

from rollcall.membership.view import View

#: Bytes of randomness in a member secret, an epoch key and an epoch secret.
SECRET_BYTES = 32
#: A secret, a secret's hash or a key as it travels and is stored: lowercase hex.
_HEX = re.compile(rf"[0-9a-f]{{{2 * SECRET_BYTES}}}")


def is_secret_text(value: str) -> bool:
    """Whether ``value`` has the form of a secret, hash or key (64 lowercase hex)."""
    return _HEX.fullmatch(value) is not None


def secret_hash(secret: str) -> str:
    """What a replica keeps of a member secret (hex SHA-256)."""
    return hashlib.sha256(b"rollcall member secret\0" + secret.encode()).hexdigest()


def secret_matches(presented: str, expected_hash: str) -> bool:
    """Whether ``presented`` is the secret whose hash is ``expected_hash``, in
    constant time (hashes of fixed length are compared). An empty or
    malformed stored hash matches nothing."""
    if not is_secret_text(expected_hash):
        return False
    return hmac.compare_digest(secret_hash(presented), expected_hash)


def epoch_secret(epoch_key: str, job: str, view: View) -> str:
    """The secret of committed ``view``: the same on every replica, unknown
    to anyone without the job's epoch key (hex HMAC-SHA256)."""
    message = f"rollcall epoch secret\0{job}\0".encode() + view.to_json().encode()
    return hmac.new(bytes.fromhex(epoch_key), message, hashlib.sha256).hexdigest()


def secrets_equal(presented: str, expected: str | None) -> bool:
    """Constant-time comparison of a presented epoch secret with the one
    held (``None``: none held, nothing matches)."""
    if expected is None or not expected:
        return False
    return hmac.compare_digest(
        hashlib.sha256(presented.encode()).digest(), hashlib.sha256(expected.encode()).digest()
    )
