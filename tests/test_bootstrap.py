"""The sealed bootstrap store (rollcall.worker.bootstrap) on a real TCPStore and a
real gloo group, in this process: whoever reaches the store's port without
the view's epoch secret can neither read the ranks' keys nor plant a value
the ranks accept (finding 10: the TCPStore accepted an unauthenticated
client that read and wrote keys)."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
from torch.distributed import AllreduceOptions, ProcessGroupGloo, TCPStore

from rollcall.membership.errors import StoreTampered
from rollcall.worker.bootstrap import epoch_store

SECRET = "ab" * 32
OTHER = "cd" * 32
TIMEOUT = datetime.timedelta(seconds=10)


def _host() -> TCPStore:
    return TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False)


def _client(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, None, False, TIMEOUT, wait_for_workers=False)


def test_a_guesser_sees_no_key_and_cannot_read_a_value_back() -> None:
    host = _host()
    sealed = epoch_store(4, host, SECRET)
    sealed.set("rollcall/gloo/0", "10.0.0.1:4242")
    guesser = _client(host.port)
    names = guesser.list_keys()
    assert names and not any("rollcall" in n or "epoch" in n for n in names), names
    assert sealed.get("rollcall/gloo/0") == b"10.0.0.1:4242"
    for guess in ("rollcall/gloo/0", "epoch4/rollcall/gloo/0"):
        assert not guesser.check([guess])


@pytest.mark.parametrize(
    "planter",
    [
        lambda store, name, key: store.set(name, b"\0" * 32 + b"6.6.6.6:1"),  # no MAC
        lambda store, name, key: epoch_store(4, store, OTHER).set(key, "6.6.6.6:1"),  # other secret
        lambda store, name, key: epoch_store(5, store, SECRET).set(key, "6.6.6.6:1"),  # other view
        lambda store, name, key: store.set(name, b"short"),  # shorter than a MAC
    ],
    ids=["unsealed", "another secret", "another view", "truncated"],
)
def test_a_value_planted_without_the_epoch_secret_is_refused(planter) -> None:
    host = _host()
    sealed = epoch_store(4, host, SECRET)
    sealed.set("rollcall/gloo/1", "10.0.0.2:4242")
    name = next(iter(host.list_keys()))
    host.delete_key(name)
    planter(host, name, "rollcall/gloo/1")
    if not host.check([name]):  # planted under its own name (another secret or view)
        host.set(name, host.get(next(iter(host.list_keys()))))
    with pytest.raises(StoreTampered, match="not sealed with this view's epoch secret"):
        sealed.get("rollcall/gloo/1")
    with pytest.raises(StoreTampered):
        sealed.multi_get(["rollcall/gloo/1"])


def test_a_sealed_store_refuses_a_malformed_secret() -> None:
    with pytest.raises(ValueError, match="64 hex digits"):
        epoch_store(1, _host(), "not a secret")


def test_gloo_builds_its_group_through_the_sealed_store() -> None:
    host = _host()
    size, results = 3, {}

    def rank(r: int) -> None:
        store = host if r == 0 else _client(host.port)
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = TIMEOUT
        options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        group = ProcessGroupGloo(epoch_store(7, store, SECRET), r, size, options)
        tensor = torch.ones(4) * (r + 1)
        group.allreduce([tensor], AllreduceOptions()).wait()
        results[r] = tensor.tolist()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == {r: [6.0] * 4 for r in range(size)}
    assert not any("rollcall" in n for n in host.list_keys())
