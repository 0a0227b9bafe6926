"""Shared fixtures: real etcd servers on free loopback ports, a test config,
TLS material, and a session-wide check that no etcd process outlives the tests.

Two lanes: tests marked ``integration`` (any test that starts etcd, a
service, a worker or any other process) and the fast lane, ``pytest -m "not
integration"``, which starts no process: a test of the fast lane that tries
to is failed with a message saying to mark it. Tests that use the ``etcd``,
``etcd_cluster`` or ``control_plane`` fixtures are marked automatically.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollcall.etcd_local import LocalEtcd, LocalEtcdCluster, running_etcd_children
from rollcall.membership.config import Config
from tests.harness import ControlPlane

#: Fixtures that start processes: a test using one is an integration test.
PROCESS_FIXTURES = frozenset({"etcd", "etcd_cluster", "control_plane"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


class StartsAProcess(AssertionError):
    """A test of the fast lane tried to start a process."""


@contextlib.contextmanager
def _no_process_unless_integration(item: pytest.Item) -> Iterator[None]:
    """Outside ``integration``, starting a process fails the test, in its
    setup (module- and session-scoped fixtures included), call and teardown."""
    if item.get_closest_marker("integration") is not None:
        yield
        return

    def refuse(*_: object, **__: object) -> None:
        raise StartsAProcess(
            f"{item.nodeid} starts a process: mark it @pytest.mark.integration "
            "(the fast lane, -m 'not integration', starts none)"
        )

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse)
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _no_process_unless_integration(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _no_process_unless_integration(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    with _no_process_unless_integration(item):
        yield


@pytest.fixture
def etcd() -> Iterator[LocalEtcd]:
    """A single etcd server, started on free ports, stopped after the test."""
    with LocalEtcd() as server:
        yield server


@pytest.fixture
def etcd_cluster() -> Iterator[LocalEtcdCluster]:
    """A 3-member etcd cluster on loopback, stopped after the test."""
    with LocalEtcdCluster(3) as cluster:
        yield cluster


@pytest.fixture
def config() -> Config:
    """Config with short TTLs so that expiry and takeover happen within seconds."""
    return Config(member_lease_ttl=6, election_ttl=2, takeover_grace=2.0)


@dataclass(frozen=True)
class TLSFiles:
    """A throw-away CA with a server certificate for 127.0.0.1 and a client
    certificate, all signed by it (PEM files)."""

    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _signed_cert(directory: Path, name: str, extensions: str) -> None:
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=rollcall-{name}",
        cwd=directory,
    )  # fmt: skip
    (directory / f"{name}.ext").write_text(extensions)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-out", f"{name}.crt", "-extfile", f"{name}.ext",
        cwd=directory,
    )  # fmt: skip


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    """Certificates for etcd's client port (made with the openssl command)."""
    directory = tmp_path_factory.mktemp("tls")
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=rollcall-test-ca",
        cwd=directory,
    )  # fmt: skip
    _signed_cert(
        directory, "server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    _signed_cert(directory, "client", "extendedKeyUsage=clientAuth\n")
    return TLSFiles(
        ca_cert=str(directory / "ca.crt"),
        server_cert=str(directory / "server.crt"),
        server_key=str(directory / "server.key"),
        client_cert=str(directory / "client.crt"),
        client_key=str(directory / "client.key"),
    )


@pytest.fixture(scope="session", autouse=True)
def no_etcd_left_behind() -> Iterator[None]:
    """Fail the session if any etcd started by the tests is still running
    (and kill it, so that it does not outlive the run)."""
    yield
    leftovers = running_etcd_children()
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"etcd processes left running after the tests: {leftovers}"


@pytest.fixture
def control_plane(etcd: LocalEtcd, tmp_path: Path) -> Iterator[ControlPlane]:
    """One rendezvous replica (a real `rollcall rendezvous` process) on a real etcd."""
    plane = ControlPlane([etcd.endpoint], tmp_path)
    try:
        yield plane
    finally:
        plane.close()
