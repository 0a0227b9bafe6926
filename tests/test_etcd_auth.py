"""etcd with authentication on, as rollcall starts it (rendezvous/etcd_auth.py):
a local user without the credentials can neither read nor write the jobs;
the rendezvous service with them works; wrong or missing credentials are
one clear line; tokens that etcd no longer takes are replaced."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from pyetcd.client import Endpoint, MultiEndpointEtcd3Client

from rollcall.etcd_local import LocalEtcd, free_port
from rollcall.membership.config import Config
from rollcall.membership.errors import EtcdCredentialsRefused
from rollcall.membership.view import Member, View
from rollcall.rendezvous.etcd_auth import (
    ROLLCALL_USER,
    ROOT_USER,
    EtcdCredentials,
    enable_auth,
    password_file,
)
from rollcall.rendezvous.store import EtcdStore
from tests.harness import ROOT, MemberProcess, Process, wait_for

pytestmark = pytest.mark.integration

#: A refusal is one answer, not a retry loop.
QUICK = 10.0


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[LocalEtcd, EtcdCredentials, Path]]:
    """An etcd with authentication on, the rollcall user's credentials and
    the directory holding the passwords."""
    with LocalEtcd() as server:
        directory = tmp_path / "auth"
        yield server, enable_auth([server.endpoint], directory), directory


def anonymous_client(endpoint: str) -> MultiEndpointEtcd3Client:
    """pyetcd as any local user would use it, without credentials."""
    host, _, port = endpoint.removeprefix("http://").rpartition(":")
    return MultiEndpointEtcd3Client([Endpoint(host, int(port), secure=False)], timeout=5)


def etcdctl(
    endpoint: str, *args: str, user: EtcdCredentials | None = None
) -> subprocess.CompletedProcess[str]:
    """etcdctl, as the given user or none."""
    login = [f"--user={user.user}:{user.password}"] if user is not None else []
    return subprocess.run(
        ["etcdctl", f"--endpoints={endpoint}", "--command-timeout=5s", *login, *args],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_the_passwords_are_generated_once_in_a_private_directory(
    secured: tuple[LocalEtcd, EtcdCredentials, Path],
) -> None:
    server, credentials, directory = secured
    assert credentials.user == ROLLCALL_USER
    assert mode(directory) == 0o700
    for user in (ROOT_USER, ROLLCALL_USER):
        assert mode(password_file(directory, user)) == 0o600
    # Again (a restart, or `rollcall up` on the same --data-dir): same passwords.
    assert enable_auth([server.endpoint], directory) == credentials
    assert credentials.password not in repr(credentials)


def test_without_credentials_nothing_can_be_read_or_written(
    secured: tuple[LocalEtcd, EtcdCredentials, Path],
) -> None:
    server, credentials, _ = secured
    assert etcdctl(server.endpoint, "put", "/rollcall/jobs/j/view", "secret view",
                   user=credentials).returncode == 0  # fmt: skip
    with anonymous_client(server.endpoint) as anonymous:
        with pytest.raises(grpc.RpcError, match="user name is empty"):
            anonymous.get("/rollcall/jobs/j/view")
        with pytest.raises(grpc.RpcError, match="user name is empty"):
            anonymous.put("/rollcall/jobs/j/leader", "planted")
    for args in (("get", "--prefix", "/rollcall/"), ("put", "/rollcall/jobs/j/leader", "x")):
        result = etcdctl(server.endpoint, *args)
        assert result.returncode != 0 and "user name is empty" in result.stderr, result
    stored = etcdctl(server.endpoint, "get", "--prefix", "/rollcall/", user=credentials)
    assert stored.stdout.split() == ["/rollcall/jobs/j/view", "secret", "view"]


def test_the_rollcall_user_may_touch_rollcall_keys_only(
    secured: tuple[LocalEtcd, EtcdCredentials, Path],
) -> None:
    server, credentials, _ = secured
    assert (
        etcdctl(server.endpoint, "put", "/rollcall/jobs/j/x", "1", user=credentials).returncode == 0
    )
    for args in (("put", "/other", "1"), ("get", "/other"), ("get", "--prefix", "/")):
        result = etcdctl(server.endpoint, *args, user=credentials)
        assert result.returncode != 0 and "permission denied" in result.stderr, result


def test_the_store_works_with_the_credentials_and_refuses_wrong_ones(
    secured: tuple[LocalEtcd, EtcdCredentials, Path], config: Config
) -> None:
    server, credentials, _ = secured
    with EtcdStore([server.endpoint], "j", config, credentials=credentials) as store:
        store.ping()
        assert store.commit_view(View(1, (Member("a", "10.0.0.1:1"),)), 0, *_leading(store))
    wrong = EtcdCredentials(ROLLCALL_USER, "not the password")
    for given, says in ((wrong, "etcd refused our credentials"), (None, "requires auth")):
        with EtcdStore([server.endpoint], "j", config, credentials=given) as store:
            started = time.monotonic()
            with pytest.raises(EtcdCredentialsRefused, match=says):
                store.ping()
            assert time.monotonic() - started < QUICK


def _leading(store: EtcdStore) -> tuple[object]:
    leader = store.campaign("replica-1", "127.0.0.1:1")
    assert leader is not None
    return (leader,)


def test_the_store_authenticates_again_when_etcd_drops_its_token(
    secured: tuple[LocalEtcd, EtcdCredentials, Path], config: Config
) -> None:
    server, credentials, directory = secured
    root = EtcdCredentials.from_file(ROOT_USER, password_file(directory, ROOT_USER))
    with EtcdStore([server.endpoint], "j", config, credentials=credentials) as store:
        seen: list[View] = []
        store.watch_view(seen.append)
        store.write_progress(1, 10)
        # Users and roles changed by etcd's administrator.
        assert etcdctl(server.endpoint, "role", "add", "another", user=root).returncode == 0
        store.write_progress(1, 11)
        assert store.read_progress() == (1, 11)
        # A crashed and restarted etcd has forgotten the token.
        server.kill()
        server.start()
        leader = store.campaign("replica-1", "127.0.0.1:1")
        assert leader is not None
        view = View(1, (Member("a", "10.0.0.1:1"),))
        assert store.commit_view(view, 0, leader)
        wait_for(lambda: view in seen, "the watch to deliver the view", 15)


def rendezvous(etcd: str, log: Path, *flags: str, token: Path) -> Process:
    argv = [
        sys.executable, "-m", "rollcall.cli", "rendezvous", "--etcd", etcd,
        "--listen", f"127.0.0.1:{free_port()}", "--job", "authjob", "--token-file", str(token),
        "--set", "member_lease_ttl=6", "--set", "takeover_grace=2", *flags,
    ]  # fmt: skip
    return Process(argv, None, log)


def test_a_replica_with_the_credentials_serves_a_job(
    secured: tuple[LocalEtcd, EtcdCredentials, Path], tmp_path: Path
) -> None:
    server, _, directory = secured
    token = tmp_path / "token"
    token.write_text("auth-test-token")
    replica = rendezvous(
        server.endpoint, tmp_path / "replica.log", "--etcd-user", ROLLCALL_USER,
        "--etcd-password-file", str(password_file(directory)), token=token,
    )  # fmt: skip
    try:
        ready = replica.wait_line(lambda line: line.startswith("rendezvous ready at"), 30)
        address = ready.split()[-1]
        member = MemberProcess([address], "authjob", "auth-test-token", tmp_path / "m.log")
        try:
            member.wait_event(lambda e: e["event"] == "view" and member.member_id in e["members"],
                              30)  # fmt: skip
        finally:
            member.stop()
    finally:
        replica.stop()


@pytest.mark.parametrize("given", ["wrong", "none"])
def test_wrong_or_missing_credentials_are_one_clear_line(
    secured: tuple[LocalEtcd, EtcdCredentials, Path], tmp_path: Path, given: str
) -> None:
    server, _, _ = secured
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not the password\n")
    flags = ["--etcd-user", ROLLCALL_USER, "--etcd-password-file", str(wrong)]
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "rollcall.cli", "rendezvous", "--etcd", server.endpoint,
         "--listen", "127.0.0.1:0", "--job", "authjob", *(flags if given == "wrong" else [])],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "ROLLCALL_TOKEN": "t"},
    )  # fmt: skip
    assert time.monotonic() - started < QUICK + 5
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    if given == "wrong":
        assert line.startswith("rollcall: error: etcd refused our credentials: "), line
    else:
        assert "etcd requires authentication" in line and "--etcd-password-file" in line, line
