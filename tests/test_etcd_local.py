"""LocalEtcd and LocalEtcdCluster start real etcd servers and never leak them."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from pyetcd import etcdrpc
from pyetcd.client import Endpoint, MultiEndpointEtcd3Client
from pyetcd.exceptions import Etcd3Exception

from rollcall.etcd_local import (
    AUTO_COMPACTION_RETENTION,
    EtcdServerTLS,
    LocalEtcd,
    LocalEtcdCluster,
    etcd_flags,
    free_port,
    free_ports,
    running_etcd_children,
)
from rollcall.etcd_local import pid_alive as alive
from tests.conftest import TLSFiles

pytestmark = pytest.mark.integration  # starts processes

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def client_for(*endpoints: str, tls: TLSFiles | None = None) -> MultiEndpointEtcd3Client:
    """A plain pyetcd client with failover, for checking the servers."""
    creds = None
    if tls is not None:
        creds = MultiEndpointEtcd3Client.get_secure_creds(
            tls.ca_cert, tls.client_key, tls.client_cert
        )
    eps = []
    for url in endpoints:
        host, port = url.split("//")[1].split(":")
        eps.append(Endpoint(host, int(port), secure=tls is not None, creds=creds, time_retry=0.0))
    return MultiEndpointEtcd3Client(eps, timeout=2.0, failover=True)


def wait_until_dead(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return False


def retrying(operation: Callable[[], T], timeout: float = 5.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return operation()
        except Etcd3Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_ports_picked_together_are_distinct() -> None:
    # The OS may hand out a port again as soon as the probe closes: a cluster
    # once got the same peer port for two members ("has duplicate url"). 300
    # ports picked one by one repeat one with high odds; picked together never.
    for _ in range(3):
        ports = free_ports(300)
        assert len(set(ports)) == 300
    taken = free_port()
    assert taken not in free_ports(300, besides=[taken])


def test_ports_it_is_told_to_avoid_are_never_picked_for_etcd() -> None:
    # `rollcall up --metrics-port P` starts etcd before it binds P: etcd must
    # not pick P (tests/test_up.py lost a run to this once in ~14,000). Ports
    # just released are the ones the OS hands out again first: ignoring them,
    # ~3 % of these pairs held one here, so 200 pairs hit one almost surely.
    avoid = free_ports(200)
    for _ in range(200):
        server = LocalEtcd(avoid=avoid)
        assert {server.client_port, server.peer_port}.isdisjoint(avoid)


def test_started_server_answers_on_its_endpoint(etcd: LocalEtcd) -> None:
    assert etcd.endpoint == f"http://127.0.0.1:{etcd.client_port}"
    with client_for(etcd.endpoint) as client:
        client.put("/k", "v")
        assert client.get("/k")[0] == b"v"


def test_stop_ends_the_process_and_deletes_owned_data() -> None:
    server = LocalEtcd().start()
    pid, data_dir = server.pid, server.data_dir
    assert pid is not None and alive(pid)

    server.stop()

    assert not alive(pid)
    assert server.pid is None
    assert not data_dir.exists()
    server.stop()  # idempotent


def test_stop_keeps_a_data_dir_it_was_given(tmp_path: Path) -> None:
    with LocalEtcd(data_dir=tmp_path / "etcd") as server:
        assert server.pid is not None  # it ran, with its data in the given dir
    assert (tmp_path / "etcd" / "member").is_dir()


def test_kill_then_start_keeps_data_and_endpoint(etcd: LocalEtcd) -> None:
    endpoint = etcd.endpoint
    with client_for(endpoint) as client:
        client.put("/survives", "yes")
    old_pid = etcd.pid

    etcd.kill()
    assert etcd.pid is None and old_pid is not None and not alive(old_pid)
    etcd.start()

    assert etcd.endpoint == endpoint
    with client_for(endpoint) as client:
        assert client.get("/survives")[0] == b"yes"


def test_paused_server_does_not_answer_until_resumed(etcd: LocalEtcd) -> None:
    with client_for(etcd.endpoint) as client:
        client.timeout = 0.3
        etcd.pause()
        try:
            with pytest.raises(Exception, match="timeout"):
                client.get("/k")
        finally:
            etcd.resume()
        client.timeout = 2.0
        deadline = time.monotonic() + 5
        while True:  # the endpoint is marked failed for a moment
            try:
                assert client.get("/k") == (None, None)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def test_start_failure_raises_with_log_tail() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = LocalEtcd(client_port=port, peer_port=free_port())
        try:
            with pytest.raises(RuntimeError, match="exited with code") as info:
                server.start(timeout=10)
        finally:
            server.stop()
    assert "address already in use" in str(info.value)


def test_a_port_taken_before_the_first_start_of_a_given_empty_data_dir_is_picked_again(
    tmp_path: Path,
) -> None:
    # As `rollcall up --data-dir DIR` starts its etcd: the directory is the
    # caller's, the ports are picked here, and someone takes one meanwhile.
    server = LocalEtcd(data_dir=tmp_path / "etcd")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", server.client_port))
        taken.listen()
        try:
            server.start(timeout=20)
            assert server.client_port != taken.getsockname()[1]
            with client_for(server.endpoint) as client:
                client.put("/k", "v")
                assert client.get("/k")[0] == b"v"
        finally:
            server.stop()


def test_a_data_dir_that_holds_etcd_data_is_never_wiped_to_pick_other_ports(
    tmp_path: Path,
) -> None:
    first = LocalEtcd(data_dir=tmp_path / "etcd")
    with first, client_for(first.endpoint) as client:
        client.put("/kept", "yes")
    again = LocalEtcd(data_dir=tmp_path / "etcd")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", again.client_port))
        taken.listen()
        try:
            with pytest.raises(RuntimeError, match="address already in use"):
                again.start(timeout=20)
        finally:
            again.stop()
    with again, client_for(again.endpoint) as client:
        assert client.get("/kept")[0] == b"yes"


def test_missing_binary_names_the_debian_package() -> None:
    server = LocalEtcd(binary="etcd-binary-that-does-not-exist")
    with pytest.raises(FileNotFoundError, match="etcd-server") as info:
        server.start()
    assert "scripts/setup" in str(info.value)
    server.stop()


def test_cluster_keeps_serving_with_one_member_killed(etcd_cluster: LocalEtcdCluster) -> None:
    assert len(set(etcd_cluster.endpoints)) == 3
    with client_for(*etcd_cluster.endpoints) as client:
        client.put("/before", "1")

    etcd_cluster.kill(0)
    survivors = etcd_cluster.endpoints[1:]
    with client_for(*survivors) as client:
        # If member 0 led the cluster, the first requests may meet the
        # election ("leader changed"): a bare pyetcd client does not retry.
        assert retrying(lambda: client.get("/before"))[0] == b"1"
        retrying(lambda: client.put("/during", "2"))

    etcd_cluster.start(0)
    with client_for(etcd_cluster.endpoints[0]) as client:
        assert client.get("/during")[0] == b"2"


def test_cluster_stop_leaves_no_process() -> None:
    cluster = LocalEtcdCluster(3).start()
    pids = [m.pid for m in cluster.members]
    cluster.stop()
    assert all(pid is not None and not alive(pid) for pid in pids)
    assert running_etcd_children() == []


def test_tls_server_requires_client_certificate(tls_files: TLSFiles) -> None:
    tls = EtcdServerTLS(
        cert_file=tls_files.server_cert,
        key_file=tls_files.server_key,
        trusted_ca_file=tls_files.ca_cert,
        client_cert_auth=True,
    )
    with LocalEtcd(tls=tls) as server:
        assert server.endpoint.startswith("https://127.0.0.1:")
        with client_for(server.endpoint, tls=tls_files) as client:
            client.put("/secure", "1")
            assert client.get("/secure")[0] == b"1"
        with grpc.insecure_channel(f"127.0.0.1:{server.client_port}") as channel:
            with pytest.raises(grpc.RpcError):
                etcdrpc.KVStub(channel).Range(etcdrpc.RangeRequest(key=b"/secure"), timeout=2)
        ca_only = grpc.ssl_channel_credentials(Path(tls_files.ca_cert).read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{server.client_port}", ca_only) as channel:
            with pytest.raises(grpc.RpcError):
                etcdrpc.KVStub(channel).Range(etcdrpc.RangeRequest(key=b"/secure"), timeout=2)


def run_python(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_server_dies_when_its_parent_is_killed() -> None:
    parent = run_python(
        """
        import time
        from rollcall.etcd_local import LocalEtcd
        server = LocalEtcd().start()
        print(server.pid, server.data_dir, flush=True)
        time.sleep(60)
        """
    )
    assert parent.stdout is not None
    pid_text, data_dir = parent.stdout.readline().split()
    try:
        assert alive(int(pid_text))
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert wait_until_dead(int(pid_text)), "etcd survived its parent's SIGKILL"
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
        shutil.rmtree(data_dir, ignore_errors=True)  # a SIGKILLed parent cannot clean up


def test_servers_left_running_are_killed_at_exit() -> None:
    parent = run_python(
        """
        from rollcall.etcd_local import LocalEtcd, LocalEtcdCluster
        single = LocalEtcd().start()
        cluster = LocalEtcdCluster(3).start()
        pids = [single.pid] + [m.pid for m in cluster.members]
        print(" ".join(map(str, pids)), single.data_dir, cluster.base_dir, flush=True)
        """
    )
    out, _ = parent.communicate(timeout=30)
    *pids, single_dir, cluster_dir = out.split()
    assert parent.returncode == 0
    assert all(wait_until_dead(int(pid)) for pid in pids)
    assert not Path(single_dir).exists()
    assert not Path(cluster_dir).exists()


def test_flags_configure_periodic_auto_compaction_and_the_quota(tmp_path: Path) -> None:
    flags = etcd_flags("m", tmp_path, "http://a:1", "http://a:2", "m=http://a:2", "t", alone=True)

    assert "--auto-compaction-mode=periodic" in flags
    assert f"--auto-compaction-retention={AUTO_COMPACTION_RETENTION}" in flags
    assert "--quota-backend-bytes=2147483648" in flags


@pytest.mark.integration
def test_started_server_compacts_its_history_by_itself() -> None:
    etcdctl = shutil.which("etcdctl")
    assert etcdctl is not None, "etcdctl is missing: apt-get install etcd-client"
    with LocalEtcd(compaction_retention="1s") as server:

        def ctl(*args: str) -> subprocess.CompletedProcess[str]:
            argv = [etcdctl, f"--endpoints={server.endpoint}", *args]
            env = {**os.environ, "ETCDCTL_API": "3"}
            return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=10)

        for value in range(5):
            assert ctl("put", "k", str(value)).returncode == 0
        first = ctl("get", "k", "--rev=2")
        assert first.returncode == 0 and "0" in first.stdout
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            old = ctl("get", "k", "--rev=2")
            if old.returncode != 0:
                break
            ctl("put", "k", "again")  # compaction needs revisions to compact to
            time.sleep(0.5)
        assert "compacted" in old.stderr, (old.returncode, old.stdout, old.stderr)
