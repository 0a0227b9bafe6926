"""TLS on both sides of a replica: the service requiring client certificates,
and etcd's client port (with and without client-certificate auth)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from rollcall.etcd_local import EtcdServerTLS, LocalEtcd, free_port
from rollcall.membership.config import Config
from rollcall.membership.errors import ControlPlaneUnavailable
from rollcall.protocol.client import ClientTLS, RendezvousClient, Status
from tests.conftest import TLSFiles
from tests.harness import ROOT, Process

pytestmark = pytest.mark.integration  # starts processes

JOB = "tls-job"
TOKEN = "tls-test-token"
#: How long a client that cannot connect keeps trying before it gives up.
GIVE_UP = 2.0


class TLSReplica(Process):
    """``rollcall rendezvous`` with extra flags (TLS), on a free loopback port."""

    def __init__(self, etcd: str, token_file: Path, log_path: Path, flags: Sequence[str]) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        argv = [
            sys.executable, "-m", "rollcall.cli", "rendezvous", "--etcd", etcd,
            "--listen", self.address, "--job", JOB, "--token-file", str(token_file), *flags,
        ]  # fmt: skip
        super().__init__(argv, None, log_path)
        try:
            self.wait_line(lambda line: line.startswith("rendezvous ready at"), timeout=30)
        except BaseException:
            self.stop()
            raise


def token_file(directory: Path) -> Path:
    path = directory / "token"
    path.write_text(TOKEN)
    return path


def status(address: str, tls: ClientTLS | None, deadline: float = 10.0) -> Status:
    async def ask() -> Status:
        client = RendezvousClient([address], JOB, TOKEN, Config(client_call_deadline=deadline), tls)
        try:
            return await client.status()
        finally:
            await client.close()

    return asyncio.run(ask())


def status_with_leader(address: str, tls: ClientTLS | None, timeout: float = 15.0) -> Status:
    """Status once a leader is elected (it has written to etcd by then)."""
    deadline = time.monotonic() + timeout
    while True:
        result = status(address, tls)
        if result.leader or time.monotonic() > deadline:
            return result
        time.sleep(0.1)


@pytest.fixture(scope="module")
def tls_replica(
    tls_files: TLSFiles, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TLSReplica]:
    """A replica that serves TLS only and requires a client certificate."""
    directory = tmp_path_factory.mktemp("tls-replica")
    with LocalEtcd() as etcd:
        replica = TLSReplica(
            etcd.endpoint,
            token_file(directory),
            directory / "replica.log",
            [
                "--tls-cert", tls_files.server_cert, "--tls-key", tls_files.server_key,
                "--tls-client-ca", tls_files.ca_cert,
            ],
        )  # fmt: skip
        try:
            yield replica
        finally:
            replica.stop()


def client_tls(files: TLSFiles) -> ClientTLS:
    return ClientTLS(files.ca_cert, files.client_cert, files.client_key)


def test_client_with_a_certificate_gets_status(tls_replica: TLSReplica, tls_files: TLSFiles):
    result = status_with_leader(tls_replica.address, client_tls(tls_files))
    assert result.leader == tls_replica.address
    assert result.replica == tls_replica.address


def test_client_with_a_certificate_joins(tls_replica: TLSReplica, tls_files: TLSFiles) -> None:
    async def join_and_leave() -> tuple[str, tuple[str, ...]]:
        client = RendezvousClient([tls_replica.address], JOB, TOKEN, tls=client_tls(tls_files))
        try:
            member_id = await client.join("127.0.0.1:29500", name="tls")
            view = await client.wait_member(timeout=15)
            await client.leave()
            return member_id, view.ids
        finally:
            await client.close()

    member_id, members = asyncio.run(join_and_leave())
    assert members == (member_id,)


def test_client_without_a_certificate_is_refused(
    tls_replica: TLSReplica, tls_files: TLSFiles
) -> None:
    with pytest.raises(ControlPlaneUnavailable):
        status(tls_replica.address, ClientTLS(tls_files.ca_cert), deadline=GIVE_UP)


def test_plaintext_client_is_refused(tls_replica: TLSReplica) -> None:
    with pytest.raises(ControlPlaneUnavailable):
        status(tls_replica.address, None, deadline=GIVE_UP)


def test_status_command_speaks_tls(tls_replica: TLSReplica, tls_files: TLSFiles) -> None:
    status_with_leader(tls_replica.address, client_tls(tls_files))
    result = subprocess.run(
        [
            sys.executable, "-m", "rollcall.cli", "status", "--rendezvous", tls_replica.address,
            "--job", JOB, "--json", "--tls-ca", tls_files.ca_cert,
            "--tls-cert", tls_files.client_cert, "--tls-key", tls_files.client_key,
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "ROLLCALL_TOKEN": TOKEN},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["leader"] == tls_replica.address


@pytest.mark.parametrize("client_cert_auth", [False, True], ids=["server-auth", "mutual"])
def test_replica_reaches_etcd_over_tls(
    tls_files: TLSFiles, tmp_path: Path, client_cert_auth: bool
) -> None:
    server_tls = EtcdServerTLS(
        tls_files.server_cert, tls_files.server_key, tls_files.ca_cert, client_cert_auth
    )
    flags = ["--etcd-ca", tls_files.ca_cert]
    if client_cert_auth:
        flags += ["--etcd-cert", tls_files.client_cert, "--etcd-key", tls_files.client_key]
    with LocalEtcd(tls=server_tls) as etcd:
        assert etcd.endpoint.startswith("https://")
        replica = TLSReplica(etcd.endpoint, token_file(tmp_path), tmp_path / "replica.log", flags)
        try:
            result = status_with_leader(replica.address, None)
        finally:
            replica.stop()
    assert result.leader == replica.address
    assert result.view.epoch == 0
