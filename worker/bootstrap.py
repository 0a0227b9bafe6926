"""The bootstrap store of a view's process group, sealed with the view's
epoch secret.

The view's rank 0 hosts a ``TCPStore`` through which the ranks meet and
gloo exchanges its connection addresses. A TCPStore authenticates nobody:
whoever reaches its port may list every key (``list_keys``), read and write
any, so a secret key prefix would be read straight back. Every key and
value of the group therefore goes through :class:`SealedStore`: a key's name
in the TCPStore is an HMAC of the view's scope and the key under the epoch
secret (names reveal nothing and cannot be made without the secret), and
every value carries an HMAC of scope, key and value. A value that does not
verify (written without the secret, or copied from another key or view) is
refused with :class:`StoreTampered`, which fails the build as an absent peer
would: the ranks report it and a roll call follows.

What sealing does not do (docs/protocol.md, "Threat model"): hide the
values (gloo's listener addresses can be read; the data plane trusts the
network, as NCCL does), or stop whoever reaches the port from deleting keys
or filling the store (the build then fails; it is never subverted).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac

from torch.distributed import Store

from rollcall.membership.credentials import is_secret_text
from rollcall.membership.errors import StoreTampered

#: Bytes of HMAC-SHA256 in front of every sealed value.
_MAC_BYTES = 32
#: Hex digits of a sealed key name (128 bits).
_NAME_DIGITS = 32


class SealedStore(Store):
    """A view of ``store`` in which every key and value of ``scope`` is
    sealed with ``secret`` (an epoch secret, 64 hex digits). Supports what
    the group build uses: set, get, wait, check, multi_get, multi_set,
    delete_key."""

    def __init__(self, store: Store, scope: str, secret: str) -> None:
        if not is_secret_text(secret):
            raise ValueError("a sealed store needs an epoch secret of 64 hex digits")
        super().__init__()
        self._store = store
        self._scope = scope.encode()
        self._key = bytes.fromhex(secret)

    def _mac(self, kind: bytes, key: str, value: bytes = b"") -> bytes:
        message = b"\0".join((b"rollcall bootstrap", kind, self._scope, key.encode(), value))
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def _name(self, key: str) -> str:
        return "rc/" + self._mac(b"name", key).hex()[:_NAME_DIGITS]

    def _seal(self, key: str, value: str | bytes | list[int]) -> bytes:
        data = value.encode() if isinstance(value, str) else bytes(value)
        return self._mac(b"value", key, data) + data

    def _open(self, key: str, sealed: bytes) -> bytes:
        mac, data = bytes(sealed[:_MAC_BYTES]), bytes(sealed[_MAC_BYTES:])
        if len(sealed) < _MAC_BYTES or not hmac.compare_digest(mac, self._mac(b"value", key, data)):
            raise StoreTampered(
                f"bootstrap store: the value of {key!r} is not sealed with this view's epoch "
                "secret (someone without it wrote or moved it): the group is not built"
            )
        return data

    def set(self, key: str, value: str | bytes | list[int]) -> None:  # type: ignore[override]
        self._store.set(self._name(key), self._seal(key, value))  # type: ignore[arg-type]

    def get(self, key: str) -> bytes:
        return self._open(key, self._store.get(self._name(key)))

    def wait(  # type: ignore[override]
        self, keys: list[str], timeout: datetime.timedelta | None = None
    ) -> None:
        names = [self._name(k) for k in keys]
        if timeout is None:
            self._store.wait(names)
        else:
            self._store.wait(names, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._store.check([self._name(k) for k in keys])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._store.multi_get([self._name(k) for k in keys])
        return [self._open(k, v) for k, v in zip(keys, values, strict=True)]

    def multi_set(self, keys: list[str], values: list[str]) -> None:  # type: ignore[override]
        sealed = [self._seal(k, v) for k, v in zip(keys, values, strict=True)]
        self._store.multi_set([self._name(k) for k in keys], sealed)  # type: ignore[attr-defined]

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(self._name(key))

    def num_keys(self) -> int:
        return self._store.num_keys()

    def add(self, key: str, value: int) -> int:
        raise StoreTampered(f"bootstrap store: add({key!r}) is not supported when sealed")

    def compare_set(  # type: ignore[override]
        self, key: str, expected_value: str, desired_value: str
    ) -> bytes:
        raise StoreTampered(f"bootstrap store: compare_set({key!r}) is not supported when sealed")


def epoch_store(epoch: int, store: Store, secret: str) -> SealedStore:
    """The store of view ``epoch``'s group: ``store`` sealed with its epoch secret."""
    return SealedStore(store, f"epoch{epoch}", secret)
