"""State transfer over real gRPC: striping, digest check, retry elsewhere,
and the rule that only members of the server's view may pull."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from rollcall.etcd_local import free_port
from rollcall.membership.config import Config
from rollcall.membership.errors import InvalidRequest
from rollcall.membership.view import Member, View
from rollcall.pb import state_pb2_grpc
from rollcall.protocol.wire import TokenInterceptor
from rollcall.worker.digest import digest, tree_digest
from rollcall.worker.state import capture
from rollcall.worker.state_bytes import to_bytes, tree_to_bytes
from rollcall.worker.transfer import Snapshot, StateFetcher, StateServer, TransferFailed

TOKEN = "transfer-test-token"
JOB = "job1"


def make_snapshot() -> Snapshot:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    state = capture(7, model, optimizer)
    return Snapshot(7, digest(state), to_bytes(state))


def corrupted(snap: Snapshot) -> Snapshot:
    data = bytearray(snap.data)
    # Zeros inside tensor bytes (it still loads), in the first of two stripes.
    quarter = len(data) // 4
    data[quarter : quarter + 64] = bytes(64)
    return Snapshot(snap.step, snap.digest, bytes(data))


#: The epoch secret of VIEW, as its members received it.
SECRET = "5e" * 32

async def serve(snapshot: Snapshot, view: View) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=[TokenInterceptor(TOKEN)])

    async def no_store(epoch: int) -> int:
        raise AssertionError("not used here")

    state_pb2_grpc.add_StateTransferServicer_to_server(
        StateServer(
            JOB, Config(), lambda: "src", lambda: view, lambda: snapshot, no_store,
            epoch_secret=lambda epoch: SECRET if epoch == view.epoch else None,
        ),  # fmt: skip
        server,
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


VIEW = View(epoch=3, members=(Member("src", "127.0.0.1:1"), Member("fetcher", "127.0.0.1:2")))


def test_a_corrupt_source_is_detected_and_the_state_fetched_again_elsewhere():
    good = make_snapshot()

    async def scenario():
        servers = [await serve(corrupted(good), VIEW), await serve(good, VIEW)]
        fetcher = StateFetcher(JOB, "fetcher", TOKEN, epoch_secret=lambda _: SECRET)
        try:
            return await fetcher.fetch([a for _, a in servers], 3, good.digest, timeout=20)
        finally:
            await fetcher.close()
            for server, _ in servers:
                await server.stop(0)

    blob, state, report = asyncio.run(scenario())
    assert blob == good.data
    assert digest(state) == good.digest and state.step == 7
    assert report.retries >= 1
    assert len(report.sources) == 2  # striped across both at first


def test_an_unreachable_source_is_skipped():
    good = make_snapshot()

    async def scenario():
        server, address = await serve(good, VIEW)
        fetcher = StateFetcher(JOB, "fetcher", TOKEN, epoch_secret=lambda _: SECRET)
        try:
            dead = f"127.0.0.1:{free_port()}"
            return await fetcher.fetch([dead, address], 3, good.digest, timeout=5)
        finally:
            await fetcher.close()
            await server.stop(0)

    blob, _, report = asyncio.run(scenario())
    assert blob == good.data
    assert len(report.sources) == 1


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
    good = make_snapshot()

    async def scenario():
        server, address = await serve(good, VIEW)
        fetcher = StateFetcher(JOB, member_id, token, epoch_secret=lambda _: secret)
        try:
            await fetcher.fetch([address], epoch, good.digest, timeout=1.5)
        finally:
            await fetcher.close()
            await server.stop(0)

    with pytest.raises(TransferFailed):
        asyncio.run(scenario())


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
            JOB, Config(), lambda: "src", lambda: VIEW, lambda: None, no_store,
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
