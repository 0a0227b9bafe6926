"""State transfer over real gRPC and real data-channel sockets: striping,
checking piece by piece, repairing pieces from another source, a source
dying mid-transfer, and the rule that only members of the server's view
may pull; the data channel's refusals and bounds."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollcall.etcd_local import free_port
from rollcall.membership.config import Config
from rollcall.membership.errors import InvalidRequest
from rollcall.membership.view import Member, View
from rollcall.pb import state_pb2 as pb
from rollcall.pb import state_pb2_grpc
from rollcall.protocol.wire import TokenInterceptor, token_metadata
from rollcall.worker.data_channel import DataConnection, SourceFailed
from rollcall.worker.data_wire import (
    GREETING,
    HELLO,
    STATUS,
    Code,
    Hello,
    Kind,
    Request,
    Status,
    server_proof,
)
from rollcall.worker.digest import digest, tree_digest
from rollcall.worker.faults import Faults
from rollcall.worker.landing import CHUNK_BYTES as LANDING_CHUNK
from rollcall.worker.landing import Landing
from rollcall.worker.served import ServedState
from rollcall.worker.state import ReplicaState, capture
from rollcall.worker.state_bytes import header_size, to_bytes, tree_to_bytes
from rollcall.worker.transfer import Snapshot, StateFetcher, StateServer, TransferFailed

TOKEN = "transfer-test-token"
JOB = "job1"
#: The epoch secret of VIEW, as its members received it.
SECRET = "5e" * 32
VIEW = View(epoch=3, members=(Member("src", "127.0.0.1:1"), Member("fetcher", "127.0.0.1:2")))
#: Units of 64 KiB: even the small test state is striped over many requests
#: (none is sent whole with its description).
SMALL_UNITS = Config(transfer_unit_bytes=1 << 16, transfer_whole_bytes=1)


def make_snapshot(with_rng: bool = False) -> Snapshot:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    state = capture(7, model, optimizer, with_rng=with_rng)  # a worker serves it without
    return Snapshot(7, digest(state), to_bytes(state))


def big_snapshot(megabytes: int) -> Snapshot:
    """A state of about ``megabytes`` MB, the same in every process."""
    weight = torch.arange(megabytes * (1 << 18), dtype=torch.float32)
    state = ReplicaState(
        step=7, model={"weight": weight, "bias": torch.ones(3)},
        optimizer={"state": {}, "param_groups": []}, scheduler=None, grad_scaler=None,
        data_position={"step": 7}, rng={}, extras={},
    )  # fmt: skip
    return Snapshot(7, digest(state), to_bytes(state))


def corrupted(snap: Snapshot) -> Snapshot:
    """The same digest over bytes of which one in every 64 KiB of the tensor
    bytes (it still loads) is flipped: a worker whose memory went bad, which
    every range it serves shows."""
    data = bytearray(snap.data)
    for position in range(header_size(data[:24]) + 100, len(data) - 1024, 1 << 16):
        data[position] ^= 0xFF
    return Snapshot(snap.step, snap.digest, bytes(data))


@contextlib.asynccontextmanager
async def serving(
    snapshot: Snapshot | Callable[[], Snapshot | None], view: View = VIEW, own_id: str = "src",
    config: Config = SMALL_UNITS, faults: Faults | None = None,
) -> AsyncIterator[tuple[str, StateServer]]:  # fmt: skip
    """A real StateServer on a real gRPC server, set up as a worker's (it
    serves ``snapshot``, or what that callable returns); its address and the
    servicer. Everything is closed on the way out."""
    server = grpc.aio.server(interceptors=[TokenInterceptor(TOKEN)])

    async def no_store(epoch: int) -> int:
        raise AssertionError("not used here")

    servicer = StateServer(
        JOB, config, lambda: own_id, lambda: view,
        snapshot if callable(snapshot) else lambda: snapshot, no_store,
        epoch_secret=lambda epoch: SECRET if epoch == view.epoch else None, faults=faults,
    )  # fmt: skip
    state_pb2_grpc.add_StateTransferServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        servicer.close()
        await server.stop(0)


async def fetch_from(
    addresses: list[str], expected: str, timeout: float = 20, config: Config = SMALL_UNITS,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[bytearray, Any, Any]:  # fmt: skip
    fetcher = StateFetcher(
        JOB, "fetcher", TOKEN, progress=progress, epoch_secret=lambda _: SECRET, config=config
    )
    try:
        return await fetcher.fetch(addresses, VIEW.epoch, expected, timeout=timeout)
    finally:
        await fetcher.close()


def fetched(*servers: dict[str, Any], expected: str, **options: Any) -> tuple[Any, Any, Any]:
    """Fetch ``expected`` from servers set up with ``servers`` (each the
    keyword arguments of ``serving``)."""

    async def scenario() -> tuple[Any, Any, Any]:
        async with contextlib.AsyncExitStack() as stack:
            addresses = [(await stack.enter_async_context(serving(**s)))[0] for s in servers]
            return await fetch_from(addresses, expected, **options)

    return asyncio.run(scenario())


GOOD = make_snapshot()


@contextlib.asynccontextmanager
async def longest_stand_still() -> AsyncIterator[list[float]]:
    """The gaps between the ticks of a task that wakes every 10 ms on the
    running loop while the body runs: how long the loop stood still."""
    gaps = [0.0]
    stop = asyncio.Event()

    async def ticking() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(ticking())
    try:
        yield gaps
    finally:
        stop.set()
        await ticker


# --- fetching -------------------------------------------------------------------------


def test_the_state_is_striped_over_every_source_and_checked():
    seen: list[int] = []
    blob, state, report = fetched(
        {"snapshot": GOOD}, {"snapshot": GOOD}, expected=GOOD.digest,
        progress=lambda done, size: seen.append(done),
    )  # fmt: skip
    assert blob[:] == GOOD.data
    assert digest(state) == GOOD.digest and state.step == 7
    assert len(report.sources) == 2 and report.retries == report.refetched_pieces == 0
    assert report.failed == () and seen[-1] == len(GOOD.data) and seen == sorted(seen)


def test_a_state_served_as_captured_is_serialized_once_when_first_asked_for():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    state = capture(7, model, torch.optim.AdamW(model.parameters()), with_rng=False)
    served = ServedState()
    served.serve_captured(7, digest(state), state)
    # What a roll-call answer names is known before any byte form exists.
    assert served.held() == (7, digest(state))
    blob, fetched_state, _ = fetched({"snapshot": served.snapshot}, expected=digest(state))
    snapshot = served.snapshot()
    assert snapshot is not None and snapshot is served.snapshot()  # made once
    assert blob[:] == snapshot.data == to_bytes(state)
    assert digest(fetched_state) == digest(state) and fetched_state.step == 7
    served.serve(None)
    assert served.held() is None and served.snapshot() is None


def test_a_live_capture_is_served_until_an_update_unless_serialized_before():
    """A capture sharing the live tensors (``live``) is dropped by
    ``release_live``, called before they change; once serialized it is a
    copy and stays. A cloned capture is never dropped by it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    state = capture(7, model, optimizer, with_rng=False, live=True)
    answered = digest(state)
    served = ServedState()
    served.serve_captured(7, answered, state, live=True)
    served.release_live()
    assert served.held() is None and served.snapshot() is None
    served.serve_captured(7, answered, state, live=True)
    snapshot = served.snapshot()  # serialized: a copy of the bytes
    served.release_live()
    with torch.no_grad():
        model.weight.add_(1.0)  # the update that followed
    assert served.held() == (7, answered) and served.snapshot() is snapshot
    assert snapshot is not None and snapshot.data != to_bytes(state)  # the capture moved on
    cloned = capture(8, model, optimizer, with_rng=False)
    served.serve_captured(8, digest(cloned), cloned)
    served.release_live()
    assert served.held() == (8, digest(cloned))


def _header(snap: Snapshot) -> int:
    return header_size(snap.data[:24])


def test_the_state_s_tensors_are_views_into_the_fetched_blob():
    blob, state, _ = fetched({"snapshot": GOOD}, expected=GOOD.digest)
    weight = state.model["0.weight"]

    assert weight.untyped_storage().data_ptr() >= _address_of(blob)
    assert weight.untyped_storage().data_ptr() < _address_of(blob) + len(blob)


def _address_of(blob: bytearray) -> int:
    return torch.frombuffer(blob, dtype=torch.uint8).data_ptr()


#: 4 MB in 64 units of 64 KiB: each of two sources surely serves some.
STRIPED = big_snapshot(4)


def test_a_small_state_comes_whole_with_the_first_description_in_one_round_trip():
    blob, state, report = fetched(
        {"snapshot": GOOD, "config": Config()}, {"snapshot": GOOD, "config": Config()},
        expected=GOOD.digest, config=Config(),
    )  # fmt: skip
    assert blob[:] == GOOD.data and digest(state) == GOOD.digest and state.step == 7
    assert len(report.sources) == 1 and report.retries == report.refetched_pieces == 0


def test_a_state_sent_whole_that_fails_the_digest_is_fetched_again_piece_by_piece():
    lying = {"snapshot": GOOD, "config": Config(), "faults": Faults(corrupt_serves=1)}

    blob, state, report = fetched(
        lying, {"snapshot": GOOD, "config": Config()}, expected=GOOD.digest, config=Config()
    )

    assert blob[:] == GOOD.data and digest(state) == GOOD.digest
    assert len(report.sources) == 2  # then over the data channels of both


def test_a_corrupt_source_is_detected_and_its_pieces_fetched_again_elsewhere():
    # The header comes from the corrupt source (its tensor bytes are bad) and
    # so is the first list of pieces asked for, which gives another digest.
    blob, state, report = fetched(
        {"snapshot": corrupted(STRIPED)}, {"snapshot": STRIPED}, expected=STRIPED.digest
    )
    assert blob[:] == STRIPED.data
    assert digest(state) == STRIPED.digest and state.step == 7
    assert report.refetched_pieces >= 1 and report.retries == 0  # pieces, not the whole
    assert len(report.sources) == 2  # striped across both at first
    assert [line.split(": ")[0] for line in report.failed] == [report.sources[0]]


def test_a_small_state_comes_whole_with_its_header_and_is_still_checked_and_repaired():
    # GOOD fits in one unit: asked for whole, from the (corrupt) first source.
    default = {"config": Config()}
    blob, state, report = fetched(
        {"snapshot": corrupted(GOOD), **default}, {"snapshot": GOOD, **default},
        expected=GOOD.digest, config=Config(),
    )  # fmt: skip
    assert blob[:] == GOOD.data and digest(state) == GOOD.digest
    assert report.refetched_pieces >= 1 and report.retries == 0
    assert [line.split(": ")[0] for line in report.failed] == [report.sources[0]]


def test_a_source_corrupting_every_range_it_serves_is_caught_piece_by_piece():
    lying = {"snapshot": STRIPED, "faults": Faults(corrupt_serves=1000)}

    blob, state, report = fetched({"snapshot": STRIPED}, lying, expected=STRIPED.digest)

    assert blob[:] == STRIPED.data and digest(state) == STRIPED.digest
    assert report.refetched_pieces >= 1 and report.retries == 0
    assert [line.split(": ")[0] for line in report.failed] == [report.sources[1]]


def test_a_source_whose_header_does_not_decode_is_not_streamed_from():
    lying = {"snapshot": GOOD, "faults": Faults(corrupt_serves=1000)}

    blob, state, report = fetched(lying, {"snapshot": GOOD}, expected=GOOD.digest)

    assert blob[:] == GOOD.data and digest(state) == GOOD.digest
    assert report.refetched_pieces == 0
    assert [line.split(": ")[0] for line in report.failed] == [report.sources[0]]


def test_a_single_corrupt_source_is_refused_and_nothing_loaded():
    with pytest.raises(TransferFailed, match="fails digest"):
        fetched({"snapshot": corrupted(GOOD)}, expected=GOOD.digest, timeout=5)


def test_a_served_state_carrying_rng_states_is_refused():
    """The digest does not cover RNG states: a source could set them."""
    with_rng = make_snapshot(with_rng=True)
    with pytest.raises(TransferFailed, match="RNG"):
        fetched({"snapshot": with_rng}, expected=with_rng.digest, timeout=5)


@pytest.mark.parametrize("config", [Config(), SMALL_UNITS], ids=["whole", "pieces"])
def test_an_unreachable_source_is_skipped_without_waiting_for_it(config: Config) -> None:
    """A holder that died is listed first: the fetch takes the state from
    the live one at once instead of retrying the dead one until the
    fetch's deadline."""
    dead = f"127.0.0.1:{free_port()}"

    async def scenario() -> tuple[Any, Any, Any]:
        async with serving(GOOD, config=config) as (address, _):
            return await fetch_from([dead, address], GOOD.digest, timeout=60, config=config)

    blob, _, report = asyncio.run(scenario())
    assert blob[:] == GOOD.data
    assert report.sources == (report.sources[0],) and report.sources[0] != dead
    assert report.seconds < 20, "the fetch waited for the dead source"


def test_a_source_that_names_no_data_channel_is_fetched_from_over_grpc():
    """A worker not in its own view has no address to open the channel on."""
    elsewhere = {"own_id": "elsewhere"}
    blob, state, report = fetched(
        {"snapshot": corrupted(GOOD), **elsewhere}, {"snapshot": GOOD, **elsewhere},
        expected=GOOD.digest,
    )  # fmt: skip
    assert blob[:] == GOOD.data and digest(state) == GOOD.digest
    assert report.retries >= 1  # the old path: fetched again whole


def test_a_fetch_over_grpc_checks_the_digest_off_the_workers_control_loop(monkeypatch):
    """The check of a fetched state hashes all of it (seconds for a large
    one); the fetcher's loop also carries its session's heartbeats, which
    must go on meanwhile."""
    checking = 0.6
    check = StateFetcher._verified

    def slow_check(blob: bytearray, expected: str) -> ReplicaState | None:
        time.sleep(checking)  # as hashing a large state
        return check(blob, expected)

    monkeypatch.setattr(StateFetcher, "_verified", staticmethod(slow_check))

    async def scenario() -> tuple[Any, float]:
        async with longest_stand_still() as gaps:
            async with serving(GOOD, own_id="elsewhere") as (address, _):  # no data channel
                _, state, _ = await fetch_from([address], GOOD.digest)
        return state, max(gaps)

    state, longest_gap = asyncio.run(scenario())
    assert digest(state) == GOOD.digest
    assert longest_gap < checking / 2, f"the loop stood still for {longest_gap:.2f} s"


def serve_in_child(megabytes: int, out: Any) -> None:
    """(Child process.) Serve ``big_snapshot(megabytes)`` until killed."""

    async def main() -> None:
        async with serving(big_snapshot(megabytes)) as (address, _):
            out.put(address)
            await asyncio.sleep(120)

    asyncio.run(main())


@pytest.mark.integration  # starts a process
def test_a_source_dying_mid_transfer_has_its_ranges_fetched_from_another():
    snap = big_snapshot(48)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=serve_in_child, args=(48, out), daemon=True)
    child.start()
    killed = threading.Event()

    def kill_at_a_quarter(done: int, size: int) -> None:
        if done > size // 4 and not killed.is_set():
            killed.set()
            os.kill(child.pid or 0, signal.SIGKILL)

    async def scenario() -> tuple[Any, Any, Any]:
        address = await asyncio.get_running_loop().run_in_executor(None, out.get, True, 120)
        async with serving(snap) as (local, _):
            return await fetch_from(
                [address, local], snap.digest, config=Config(transfer_unit_bytes=1 << 20),
                progress=kill_at_a_quarter,
            )  # fmt: skip

    try:
        blob, state, report = asyncio.run(scenario())
    finally:
        child.kill()
        child.join(10)
    assert killed.is_set()
    assert blob[:] == snap.data and digest(state) == snap.digest
    assert any(line.startswith(report.sources[0]) for line in report.failed), report.failed


@pytest.mark.parametrize(
    ("member_id", "epoch", "token", "secret"),
    [
        ("stranger", 3, TOKEN, SECRET),
        ("fetcher", 2, TOKEN, SECRET),
        ("fetcher", 3, "wrong-token", SECRET),
        ("fetcher", 3, TOKEN, ""),
        ("fetcher", 3, TOKEN, "0" * 64),
    ],
    ids=["not a member", "stale epoch", "wrong token", "no epoch secret", "wrong epoch secret"],
)
def test_only_members_of_the_current_view_may_pull(member_id, epoch, token, secret):
    async def scenario() -> None:
        async with serving(GOOD) as (address, _):
            fetcher = StateFetcher(JOB, member_id, token, epoch_secret=lambda _: secret)
            try:
                await fetcher.fetch([address], epoch, GOOD.digest, timeout=1.5)
            finally:
                await fetcher.close()

    with pytest.raises(TransferFailed):
        asyncio.run(scenario())


def test_a_landing_is_zeroed_and_put_in_place_from_the_start_on():
    landing = Landing(3 * LANDING_CHUNK + 5)

    assert landing.claim(2 * LANDING_CHUNK, 2 * LANDING_CHUNK + 1, timeout=10)  # out of order
    assert landing.claim(0, landing.size, timeout=10)
    assert landing.buffer[:] == bytes(landing.size)
    with pytest.raises(ValueError):
        Landing(0)


def _thp_mode() -> str:
    """The kernel's transparent huge page mode (the bracketed word), or ""."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return text.partition("[")[2].partition("]")[0]


def _smaps_field(address: int, field: str) -> str:
    """``field`` of this process's mapping that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == f"{field}:":
            return line.split()[1]
    raise AssertionError(f"no {field} for the mapping at {address:#x}")


def test_a_landing_asks_for_huge_pages_where_the_kernel_has_them():
    # Touching fresh 4 KiB pages is slower than loopback TCP here; 2 MiB ones
    # are not. With the kernel's huge pages off the landing is ordinary memory.
    landing = Landing(8 * LANDING_CHUNK)
    assert landing.claim(0, landing.size, timeout=10)
    address = ctypes.addressof(ctypes.c_char.from_buffer(landing.buffer))
    eligible = _smaps_field(address, "THPeligible")
    assert eligible == ("1" if _thp_mode() in {"always", "madvise"} else "0")


# --- the data channel -----------------------------------------------------------------


async def data_port(address: str, member_id: str = "fetcher") -> int:
    """The data channel's port, as a member's Describe learns it."""
    async with grpc.aio.insecure_channel(address) as channel:
        info = await state_pb2_grpc.StateTransferStub(channel).Describe(
            pb.StateRequest(job=JOB, member_id=member_id, epoch=3, epoch_secret=SECRET),
            metadata=token_metadata(TOKEN), timeout=10,
        )  # fmt: skip
    assert info.data_port > 0
    return int(info.data_port)


def connect(port: int, member_id: str = "fetcher", secret: str = SECRET, epoch: int = 3):
    return DataConnection.open(
        "src", "127.0.0.1", port, Hello(JOB, member_id, epoch, b"", b""), secret, Config(),
        timeout=5,
    )  # fmt: skip


def on_data_channel(action: Callable[[int], Any], **options: Any) -> Any:
    """``action(port)`` (run in a thread) against a real StateServer's data
    channel serving GOOD."""

    async def scenario() -> Any:
        async with serving(GOOD, **options) as (address, _):
            port = await data_port(address)
            return await asyncio.get_running_loop().run_in_executor(None, action, port)

    return asyncio.run(scenario())


@pytest.mark.parametrize(
    ("who", "code"),
    [
        ({"secret": "0" * 64}, Code.PERMISSION_DENIED),
        ({"secret": ""}, Code.PERMISSION_DENIED),
        ({"secret": SECRET[:-1] + "f"}, Code.PERMISSION_DENIED),
        ({"member_id": "stranger"}, Code.FAILED_PRECONDITION),
        ({"epoch": 2}, Code.FAILED_PRECONDITION),
    ],
    ids=["wrong secret", "no secret", "near miss", "not a member", "stale epoch"],
)
def test_an_unauthorised_data_connection_is_refused(who, code):
    def attempt(port: int) -> SourceFailed:
        with pytest.raises(SourceFailed) as refused:
            connect(port, **who)
        return refused.value

    assert on_data_channel(attempt).code == code


@pytest.mark.parametrize(
    ("request_", "code", "says"),
    [
        (Request(Kind.RANGE, GOOD.digest, len(GOOD.data), 1), Code.INVALID_ARGUMENT, "outside"),
        (Request(Kind.RANGE, GOOD.digest, 1, len(GOOD.data)), Code.INVALID_ARGUMENT, "outside"),
        (Request(Kind.RANGE, GOOD.digest, 2**63, 2**63), Code.INVALID_ARGUMENT, "outside"),
        (Request(Kind.RANGE, GOOD.digest, 0, 0), Code.INVALID_ARGUMENT, "outside"),
        (Request(Kind.RANGE, "sha256-pieces:00", 0, 1), Code.FAILED_PRECONDITION, "not hold"),
        (Request(Kind.PIECES, "sha256-pieces:00", 0, 0), Code.FAILED_PRECONDITION, "not hold"),
        (Request(Kind.RANGE, "sha256 00", 0, 1), Code.INVALID_ARGUMENT, "characters"),
    ],
    ids=["past the end", "one too many", "huge", "empty", "other digest", "other list", "bad"],
)
def test_a_data_request_outside_the_snapshot_is_refused(request_, code, says):
    def attempt(port: int) -> SourceFailed:
        conn = connect(port)
        try:
            with pytest.raises(SourceFailed) as refused:
                conn.ask(request_, 1 << 30)
        finally:
            conn.close()
        return refused.value

    refused = on_data_channel(attempt)
    assert refused.code == code and says in str(refused)


def test_a_hello_announcing_long_names_is_refused_without_waiting_for_them():
    def attempt(port: int) -> tuple[Status, float]:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.settimeout(5)
            greeting = _read(sock, len(GREETING) + STATUS.size + 32)
            assert greeting.startswith(GREETING)
            started = time.monotonic()
            sock.sendall(HELLO.pack(65535, 65535, 3, bytes(32), bytes(32)))
            fixed = _read(sock, STATUS.size)
            status = Status.decode(fixed, _read(sock, Status.message_length(fixed)))
            assert sock.recv(1) == b""  # and closed
            return status, time.monotonic() - started

    status, took = on_data_channel(attempt)
    assert status.code == Code.INVALID_ARGUMENT and "job of 65535 bytes" in status.message
    assert took < 2  # it read 76 bytes, not 128 KiB that never come


def test_a_data_server_serves_a_bounded_number_of_connections():
    def attempt(port: int) -> SourceFailed:
        held = [connect(port), connect(port)]
        try:
            with pytest.raises(SourceFailed) as refused:
                connect(port)
        finally:
            for conn in held:
                conn.close()
        return refused.value

    refused = on_data_channel(attempt, config=Config(transfer_max_connections=2))
    assert refused.code == Code.RESOURCE_EXHAUSTED


def test_an_idle_data_listener_closes_and_opens_again_when_asked():
    async def scenario() -> None:
        config = Config(transfer_listener_idle=0.2)
        async with serving(GOOD, config=config) as (address, _):
            port = await data_port(address)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                # Each probe is a use: probe less often than idle + the accept poll.
                await asyncio.sleep(1.0)
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                except ConnectionRefusedError:
                    break
            else:
                raise AssertionError("the idle listener stayed open")
            port = await data_port(address)
            conn = await asyncio.get_running_loop().run_in_executor(None, connect, port)
            conn.close()

    asyncio.run(scenario())


def fake_source(answer: Callable[[socket.socket, bytes, Hello], None]) -> tuple[int, Any]:
    """A listener that greets, reads a hello and lets ``answer`` go on."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def run() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(10)
                nonce = os.urandom(32)
                conn.sendall(GREETING + Status.encode(Code.OK, payload=32) + nonce)
                fixed = _read(conn, HELLO.size)
                lengths = Hello.lengths(fixed, 64)
                answer(conn, nonce, Hello.decode(fixed, _read(conn, sum(lengths))))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener.getsockname()[1], (listener, thread)


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            break
        data += more
    return data


def test_a_server_that_cannot_prove_the_epoch_secret_is_refused():
    def answer(conn: socket.socket, nonce: bytes, hello: Hello) -> None:
        conn.sendall(Status.encode(Code.OK, payload=32) + os.urandom(32))

    port, (listener, thread) = fake_source(answer)
    with pytest.raises(SourceFailed, match="does not prove the epoch secret"):
        connect(port)
    listener.close()
    thread.join(10)


@pytest.mark.parametrize(
    "frame",
    [STATUS.pack(0, 0, 2**60), STATUS.pack(0, 0, 1), STATUS.pack(0, 65535, 0)],
    ids=["a huge payload", "another length", "a huge message"],
)
def test_a_source_announcing_an_answer_out_of_bounds_is_refused_without_reading_it(frame):
    def answer(conn: socket.socket, nonce: bytes, hello: Hello) -> None:
        conn.sendall(Status.encode(Code.OK, payload=32) + server_proof(SECRET, nonce, hello))
        _read(conn, 64)  # the request
        conn.sendall(frame)
        _read(conn, 1)  # until the fetcher hangs up

    port, (listener, thread) = fake_source(answer)
    conn = connect(port)
    try:
        with pytest.raises(SourceFailed, match="expected 4096|at most 1024"):
            conn.ask(Request(Kind.RANGE, GOOD.digest, 0, 4096), 4096, exact=True)
    finally:
        conn.close()
        listener.close()
        thread.join(10)


class Claimed:
    """A snapshot's bytes that claim to be far more than they are."""

    def __len__(self) -> int:
        return 2**60

    def __getitem__(self, index: Any) -> bytes:
        return GOOD.data[index]


def test_a_holder_claiming_more_bytes_than_memory_holds_makes_no_allocation():
    claiming = Snapshot(GOOD.step, GOOD.digest, Claimed())  # type: ignore[arg-type]
    with pytest.raises(TransferFailed, match="more than the .* bytes of memory available"):
        fetched({"snapshot": claiming}, expected=GOOD.digest, timeout=5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(garbage=st.binary(min_size=1, max_size=200))
def test_arbitrary_bytes_on_a_data_connection_are_refused_and_change_nothing(garbage):
    def attempt(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.settimeout(5)
            _read(sock, len(GREETING) + STATUS.size + 32)
            sock.sendall(garbage)
            sock.shutdown(socket.SHUT_WR)  # no more: the server must not wait for more
            answer = b""
            while more := sock.recv(4096):
                answer += more
        conn = connect(port)  # and it still serves members
        try:
            conn.ask(Request(Kind.RANGE, GOOD.digest, 0, 64), 64, exact=True)
            head = bytearray(64)
            conn.read_into(memoryview(head))
        finally:
            conn.close()
        assert bytes(head) == GOOD.data[:64]
        return answer

    answer = on_data_channel(attempt)
    if answer:  # a refusal with a documented code, or nothing at all
        fixed = answer[: STATUS.size]
        message = answer[STATUS.size : STATUS.size + Status.message_length(fixed)]
        refused = (Code.INVALID_ARGUMENT, Code.PERMISSION_DENIED, Code.FAILED_PRECONDITION)
        assert Status.decode(fixed, message).code in refused


def test_describe_names_the_header_and_the_data_channel():
    async def scenario() -> pb.StateInfo:
        async with serving(GOOD) as (address, _):
            async with grpc.aio.insecure_channel(address) as channel:
                return await state_pb2_grpc.StateTransferStub(channel).Describe(
                    pb.StateRequest(job=JOB, member_id="fetcher", epoch=3, epoch_secret=SECRET),
                    metadata=token_metadata(TOKEN), timeout=10,
                )  # fmt: skip

    info = asyncio.run(scenario())
    assert (info.step, info.digest, info.size) == (7, GOOD.digest, len(GOOD.data))
    assert info.header_size == _header(GOOD) and info.data_port > 0


def test_serializing_the_state_for_a_description_leaves_the_workers_control_loop_running():
    """The first ``Describe`` of a captured state serializes it (a copy of
    the whole state: seconds for a large one). The server shares its loop
    with the worker's session (its heartbeats) and group builds, which must
    not stop meanwhile."""
    serializing = 0.6

    def slow_snapshot() -> Snapshot:
        time.sleep(serializing)  # as ``ServedState.snapshot`` copying a large state
        return GOOD

    async def scenario() -> tuple[pb.StateInfo, float]:
        async with longest_stand_still() as gaps:
            async with serving(slow_snapshot) as (address, _):
                async with grpc.aio.insecure_channel(address) as channel:
                    info = await state_pb2_grpc.StateTransferStub(channel).Describe(
                        pb.StateRequest(job=JOB, member_id="fetcher", epoch=3,
                                        epoch_secret=SECRET),
                        metadata=token_metadata(TOKEN), timeout=10,
                    )  # fmt: skip
        return info, max(gaps)

    info, longest_gap = asyncio.run(scenario())
    assert (info.step, info.digest) == (7, GOOD.digest)
    assert longest_gap < serializing / 2, f"the loop stood still for {longest_gap:.2f} s"


# --- partitions of a sharded optimizer state ------------------------------------------

PART = [{"exp_avg": torch.arange(6.0), "step": torch.tensor(4.0)}]


async def serve_partition(tree: list, named: str | None = None) -> tuple[grpc.aio.Server, str]:
    """A StateServer whose worker holds partition 2 of step 7 as ``tree``,
    naming ``named`` as its digest (default: the true one)."""
    server = grpc.aio.server(interceptors=[TokenInterceptor(TOKEN)])

    async def no_store(epoch: int) -> int:
        raise AssertionError("not used here")

    async def partition(p: int, step: int) -> tuple[str, bytes]:
        if (p, step) != (2, 7):
            raise InvalidRequest(f"does not hold partition {p} of step {step}")
        return named or tree_digest(tree), tree_to_bytes(tree)

    state_pb2_grpc.add_StateTransferServicer_to_server(
        StateServer(
            JOB,
            Config(),
            lambda: "src",
            lambda: VIEW,
            lambda: None,
            no_store,
            epoch_secret=lambda epoch: SECRET if epoch == VIEW.epoch else None,
            partition=partition,
        ),  # fmt: skip
        server,
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def fetch_partition(trees: list[tuple[list, str | None]], witness: int | None, p: int = 2):
    """Fetch partition ``p`` of step 7 from servers holding ``trees`` (in
    order), with the server at index ``witness`` as the second holder."""

    async def scenario():
        servers = [await serve_partition(tree, named) for tree, named in trees]
        fetcher = StateFetcher(JOB, "fetcher", TOKEN, epoch_secret=lambda _: SECRET)
        addresses = [a for _, a in servers]
        try:
            return await fetcher.fetch_partition(
                [a for i, a in enumerate(addresses) if i != witness], 3, p, 7, timeout=10,
                witness=None if witness is None else addresses[witness],
            )  # fmt: skip
        finally:
            await fetcher.close()
            for server, _ in servers:
                await server.stop(0)

    return asyncio.run(scenario())


def test_a_partition_is_fetched_with_its_digest_checked_against_a_second_holder():
    tree, size = fetch_partition([(PART, None), (PART, None)], witness=1)
    assert tree_digest(tree) == tree_digest(PART) and size == len(tree_to_bytes(PART))


def test_a_holder_whose_bytes_do_not_match_the_digest_it_names_is_passed_over():
    other = [{"exp_avg": torch.zeros(6), "step": torch.tensor(4.0)}]
    tree, _ = fetch_partition([(other, tree_digest(PART)), (PART, None)], witness=None)
    assert tree_digest(tree) == tree_digest(PART)


def test_a_partition_the_second_holder_disagrees_on_is_refused():
    other = [{"exp_avg": torch.zeros(6), "step": torch.tensor(4.0)}]
    with pytest.raises(TransferFailed, match="named"):
        fetch_partition([(other, None), (PART, None)], witness=1)


def test_a_partition_nobody_holds_is_refused_naming_each_holder():
    with pytest.raises(TransferFailed, match="does not hold partition 5"):
        fetch_partition([(PART, None)], witness=None, p=5)
