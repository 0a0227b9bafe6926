"""State transfer between live workers: control over gRPC, bytes over the
state data channel.

Every worker runs a ``StateServer``: it serves the serialized replica state it
captured at its last roll call, and, on the view's rank 0, the port of the
process group's bootstrap store. ``Describe`` names the state held and the
port of the worker's data channel (``rollcall.worker.data_channel``), opened
on demand on the host of its address in the view. A joiner or a member that
is behind calls ``StateFetcher.fetch``: the bytes come over data channels,
striped across every source and checked piece by piece as they arrive
against the digest agreed at the roll call (``rollcall.worker.piece_fetch``);
from sources that name no data channel they come over gRPC (``Fetch``), one
byte range per source, checked once complete, a corrupt result fetched
again whole, one source at a time.

Every call, and every data connection, proves that its caller is a member
of the server's current view with that view's epoch secret
(``rollcall.membership.credentials``), which the leader sends on the
sessions of the view's members only: the job token and a member id read
from ``Status`` are not enough (PERMISSION_DENIED).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import mmap
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import psutil

from rollcall.membership.backoff import Backoff
from rollcall.membership.config import Config
from rollcall.membership.credentials import secrets_equal
from rollcall.membership.errors import InvalidRequest, PermissionDenied, RollcallError, StaleEpoch
from rollcall.membership.view import View
from rollcall.pb import state_pb2 as pb
from rollcall.pb import state_pb2_grpc as pb_grpc
from rollcall.protocol import validation as check
from rollcall.protocol.client import ClientTLS, open_channel
from rollcall.protocol.wire import status_of, token_metadata
from rollcall.worker.data_channel import DataServer
from rollcall.worker.data_wire import Hello, Kind, Request
from rollcall.worker.digest import hash_threads, tree_digest
from rollcall.worker.faults import SLOW_DESCRIBE_S, Faults
from rollcall.worker.piece_fetch import DataSource, PieceFetch, PieceFetchFailed
from rollcall.worker.pieces import piece_hashes
from rollcall.worker.state import CorruptState, ReplicaState
from rollcall.worker.state_bytes import PREFIX_BYTES, from_bytes, header_size, tree_from_bytes
from rollcall.worker.stripes import Assembler, ranges

log = logging.getLogger("rollcall.transfer")
T = TypeVar("T")

#: Bytes per streamed chunk. Small enough that the sender produces the next
#: chunk while the receiver copies the last one (1 MiB and up measured slower,
#: 4 MiB half the speed of 256 KiB), large enough to keep per-message costs
#: low.
CHUNK_BYTES = 1 << 18


#: A serialized state: as serialized, or the buffer a fetch received it in.
Blob = bytes | bytearray | mmap.mmap


@dataclass(frozen=True)
class Snapshot:
    """The state a worker serves: captured at a safe point, serialized once."""

    step: int
    digest: str
    #: A fetched state is served from the buffer it was assembled in.
    data: Blob


class TransferFailed(RollcallError):
    """No source could deliver state with the agreed digest."""


class StateServer(pb_grpc.StateTransferServicer):
    """Serves this worker's snapshot to members of its current view, who
    prove it with the view's epoch secret (``epoch_secret(epoch)``: the one
    this worker received, None if none), over gRPC and over its data
    channel, which ``close`` ends (it also closes by itself when unused)."""

    def __init__(
        self,
        job: str,
        config: Config,
        own_id: Callable[[], str | None],
        current_view: Callable[[], View],
        snapshot: Callable[[], Snapshot | None],
        store_port: Callable[[int], Awaitable[int]],
        epoch_secret: Callable[[int], str | None],
        faults: Faults | None = None,
        partition: Callable[[int, int], Awaitable[tuple[str, bytes]]] | None = None,
    ) -> None:
        self._epoch_secret = epoch_secret
        self._partition = partition
        self._job = job
        self._faults = faults or Faults()
        self._own_id = own_id
        self._config = config
        self._current_view = current_view
        self._snapshot = snapshot
        self._store_port = store_port
        self._data = DataServer(self, config)
        self._faults_lock = threading.Lock()
        #: (digest, the piece digests of that snapshot), computed when asked.
        self._listed: tuple[str, bytes] | None = None
        self._listing = threading.Lock()

    def close(self) -> None:
        """End the data channel and its connections now."""
        self._data.close()

    def _member_of_view(self, job: str, member_id: str, epoch: int) -> View:
        """The current view, if ``member_id`` in ``epoch`` is one of its members."""
        check.check_id(job, "job", self._config)
        check.check_id(member_id, "member_id", self._config)
        if job != self._job:
            raise InvalidRequest(f"job {job!r} is not this worker's job {self._job!r}")
        view = self._current_view()
        if epoch != view.epoch or member_id not in view:
            raise StaleEpoch(
                f"member {member_id} in epoch {epoch} is not in this worker's view {view.epoch}"
            )
        return view

    def _admit(self, job: str, member_id: str, epoch: int, secret: str) -> View:
        view = self._member_of_view(job, member_id, epoch)
        if not secrets_equal(secret, self._epoch_secret(epoch)):
            raise PermissionDenied(
                f"the request naming member {member_id} does not carry view {epoch}'s epoch "
                "secret: only the view's members may call this worker"
            )
        return view

    def admit_data(self, job: str, member_id: str, epoch: int) -> str | None:
        """(Data channel.) The secret a caller must prove, if it is a member."""
        self._member_of_view(job, member_id, epoch)
        return self._epoch_secret(epoch)

    def answer_data(self, caller: Hello, request: Request) -> Sequence[Any]:
        """(Data channel, in its connection's thread.) The snapshot's bytes
        [offset, offset + length), or its piece digests; the caller must
        still be a member of the current view."""
        self._member_of_view(caller.job, caller.member_id, caller.epoch)
        snap = self._held(request.digest)
        if request.kind == Kind.PIECES:
            return [self._piece_list(snap)]
        end = request.offset + request.length
        if request.length == 0 or end > len(snap.data):
            raise InvalidRequest(
                f"range {request.offset}+{request.length} is outside 0..{len(snap.data)}"
            )
        data = memoryview(snap.data)[request.offset : end]
        with self._faults_lock:
            if self._faults.corrupt_serves <= 0:
                return [data]
            # The range's first byte: never padding, always bytes a fetcher uses.
            first = self._faults.corrupt(bytes(data[:1]), at=0)
        return [first, data[1:]]

    def _held(self, digest: str) -> Snapshot:
        """The snapshot, if it has ``digest``; StaleEpoch if not."""
        check.check_digest(digest, self._config)  # it is echoed below
        snap = self._snapshot()
        if snap is None or snap.digest != digest:
            raise StaleEpoch(f"this worker does not hold state {digest}")
        return snap

    def _piece_list(self, snap: Snapshot) -> bytes:
        with self._listing:
            if self._listed is None or self._listed[0] != snap.digest:
                try:
                    self._listed = (snap.digest, piece_hashes(snap.data))
                except CorruptState as exc:
                    raise InvalidRequest(f"this worker's state does not decode: {exc}") from exc
            return self._listed[1]

    def _data_port(self, view: View) -> int:
        """The data channel's port, on the host of this worker's address in
        ``view`` (0 if it is not in it or the channel cannot be opened)."""
        own = self._own_id()
        address = next((m.address for m in view.members if m.id == own), None)
        if address is None:
            return 0
        try:
            return self._data.port(address.rpartition(":")[0].strip("[]"))
        except OSError as exc:
            log.warning("no state data channel on %s: %s; serving over gRPC only", address, exc)
            return 0

    async def _fail(self, context: grpc.aio.ServicerContext, error: RollcallError) -> None:
        await context.abort(status_of(error), str(error))

    async def Describe(self, request: pb.StateRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            view = self._admit(request.job, request.member_id, request.epoch, request.epoch_secret)
        except RollcallError as error:
            await self._fail(context, error)
        with self._faults_lock:
            slow = self._faults.slow_describe()
        if slow:
            await asyncio.sleep(SLOW_DESCRIBE_S)
        # The first ask serializes a captured state (a copy of all of it):
        # not on this loop, which the worker's session and group builds share.
        snap = await asyncio.get_running_loop().run_in_executor(None, self._snapshot)
        if snap is None:
            return pb.StateInfo(step=-1, digest="", size=0)
        try:
            header = header_size(snap.data[:PREFIX_BYTES])
        except CorruptState:
            header = 0
        info = pb.StateInfo(
            step=snap.step, digest=snap.digest, size=len(snap.data),
            data_port=self._data_port(view), header_size=header,
        )  # fmt: skip
        if request.whole_if_small and len(snap.data) <= self._config.transfer_whole_bytes:
            with self._faults_lock:
                info.data = self._faults.corrupt(bytes(snap.data))
        return info

    async def Fetch(self, request: pb.FetchRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            self._admit(request.job, request.member_id, request.epoch, request.epoch_secret)
            # As in Describe: the first ask may serialize the state.
            snap = await asyncio.get_running_loop().run_in_executor(
                None, self._held, request.digest
            )
            end = request.offset + request.length
            if request.length == 0 or end > len(snap.data):
                raise InvalidRequest(
                    f"range {request.offset}+{request.length} is outside 0..{len(snap.data)}"
                )
        except RollcallError as error:
            await self._fail(context, error)
            return
        data = memoryview(snap.data)
        for offset in range(request.offset, end, CHUNK_BYTES):
            chunk = bytes(data[offset : min(offset + CHUNK_BYTES, end)])
            if offset == request.offset:
                with self._faults_lock:
                    chunk = self._faults.corrupt(chunk)
            yield pb.Chunk(offset=offset, data=chunk)

    async def FetchPartition(
        self, request: pb.PartitionRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            self._admit(request.job, request.member_id, request.epoch, request.epoch_secret)
            if self._partition is None:
                raise InvalidRequest("this worker's optimizer state is not sharded")
            found, data = await self._partition(request.partition, request.step)
        except RollcallError as error:
            await self._fail(context, error)
            return
        if request.digest_only:
            yield pb.PartitionChunk(digest=found, size=len(data))
            return
        view = memoryview(data)
        for offset in range(0, max(len(data), 1), CHUNK_BYTES):
            chunk = bytes(view[offset : offset + CHUNK_BYTES])
            if offset == 0:
                chunk = self._faults.corrupt(chunk)
            yield pb.PartitionChunk(digest=found, size=len(data), offset=offset, data=chunk)

    async def GroupStore(self, request: pb.StateRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            view = self._admit(request.job, request.member_id, request.epoch, request.epoch_secret)
            if not view.members or view.members[0].id != self._own_id():
                raise InvalidRequest("only the view's rank 0 hosts the group store")
        except RollcallError as error:
            await self._fail(context, error)
        port = await self._store_port(request.epoch)
        return pb.GroupStoreInfo(port=port)


@dataclass
class FetchReport:
    """What a fetch cost, for progress lines and benchmarks."""

    size: int
    seconds: float
    sources: tuple[str, ...]
    #: Times the whole state was fetched again (gRPC path).
    retries: int
    #: Pieces fetched again after they failed the agreed digest (data channel).
    refetched_pieces: int = 0
    #: Sources given up on, with why.
    failed: tuple[str, ...] = ()


class StateFetcher:
    """Client side of the transfer for one member; ``epoch_secret(epoch)``
    is the secret of the view it acts in (None: not received). ``config``
    (default: ``Config()``) paces its retries (``transfer_*``)."""

    def __init__(
        self,
        job: str,
        member_id: str,
        token: str,
        tls: ClientTLS | None = None,
        progress: Callable[[int, int], None] | None = None,
        *,
        epoch_secret: Callable[[int], str | None],
        config: Config | None = None,
    ) -> None:
        self._epoch_secret = epoch_secret
        self._config = config or Config()
        self._job = job
        self._member_id = member_id
        self._metadata = token_metadata(token)
        self._tls = tls
        self._progress = progress
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> pb_grpc.StateTransferStub:
        channel = self._channels.get(address)
        if channel is None:
            # A chunk, or a small state sent whole with its description.
            limit = max(2 * CHUNK_BYTES, self._config.transfer_whole_bytes + (64 << 10))
            options = [("grpc.max_receive_message_length", limit)]
            channel = open_channel(address, self._tls, options)
            self._channels[address] = channel
        return pb_grpc.StateTransferStub(channel)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def group_store_port(self, address: str, epoch: int, timeout: float) -> int:
        """The bootstrap-store port rank 0 hosts for ``epoch``; waits (within
        ``timeout``) for rank 0 to learn of the view and host it."""
        deadline = time.monotonic() + timeout
        info = await self._retrying(
            lambda: self._stub(address).GroupStore(
                self._request(epoch),
                metadata=self._metadata,
                timeout=self._call_timeout(deadline),
            ),
            deadline,
        )
        return int(info.port)

    async def fetch_partition(
        self,
        sources: Sequence[str],
        epoch: int,
        partition: int,
        step: int,
        timeout: float,
        witness: str | None = None,
    ) -> tuple[Any, int]:
        """The optimizer state of ``partition`` as of ``step`` (a tree, see
        ``rollcall.worker.sharded``) and its size in bytes, from the first
        of ``sources`` (addresses) that delivers it whole and with the
        digest it names; with ``witness`` (another holder's address) that
        digest must also be the witness's. ``TransferFailed`` if none can."""
        deadline = time.monotonic() + timeout
        expected = None
        if witness is not None:
            chunks = await self._retrying(
                lambda: self._partition_chunks(witness, epoch, partition, step, deadline, True),
                deadline,
            )
            expected = chunks[0].digest
        failures = []
        for address in sources:
            try:
                chunks = await self._retrying(
                    lambda a=address: self._partition_chunks(  # type: ignore[misc]
                        a, epoch, partition, step, deadline, False
                    ),
                    deadline,
                )
            except grpc.aio.AioRpcError as exc:
                failures.append(f"{address}: {exc.code().name} {exc.details()}")
                continue
            except TransferFailed as exc:
                failures.append(str(exc))
                continue
            data = b"".join(c.data for c in chunks)
            named = chunks[0].digest
            try:
                tree = tree_from_bytes(data)
            except CorruptState as exc:
                failures.append(f"{address}: {exc}")
                continue
            found = tree_digest(tree)
            if found != named or (expected is not None and found != expected):
                failures.append(
                    f"{address}: content digest {found}, it named {named}"
                    + ("" if expected is None else f", holder {witness} named {expected}")
                )
                continue
            return tree, len(data)
        raise TransferFailed(
            f"partition {partition} of step {step}: no holder delivered it: " + "; ".join(failures)
        )

    async def _partition_chunks(
        self, address: str, epoch: int, partition: int, step: int, deadline: float,
        digest_only: bool,
    ) -> list[pb.PartitionChunk]:  # fmt: skip
        request = pb.PartitionRequest(
            job=self._job, member_id=self._member_id, epoch=epoch,
            epoch_secret=self._secret(epoch), partition=partition, step=step,
            digest_only=digest_only,
        )  # fmt: skip
        stream = self._stub(address).FetchPartition(
            request, metadata=self._metadata, timeout=self._call_timeout(deadline)
        )
        chunks = [chunk async for chunk in stream]
        if not chunks:
            raise TransferFailed(f"{address} sent nothing for partition {partition}")
        return chunks

    def _call_timeout(self, deadline: float) -> float:
        """Timeout of one call made for a transfer that ends at ``deadline``."""
        return max(self._config.transfer_min_call_timeout, deadline - time.monotonic())

    def _secret(self, epoch: int) -> str:
        return self._epoch_secret(epoch) or ""

    def _request(self, epoch: int) -> pb.StateRequest:
        return pb.StateRequest(
            job=self._job, member_id=self._member_id, epoch=epoch, epoch_secret=self._secret(epoch)
        )

    async def _retrying(self, attempt: Callable[[], Awaitable[T]], deadline: float) -> T:
        """Retry while the peer has not caught up with the view yet
        (FAILED_PRECONDITION) or is briefly unreachable."""
        backoff = Backoff(self._config.transfer_retry_initial, self._config.transfer_retry_max)
        while True:
            try:
                return await attempt()
            except grpc.aio.AioRpcError as exc:
                retryable = exc.code() in (
                    grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.UNAVAILABLE,
                )
                pause = backoff.next()
                if not retryable or time.monotonic() + pause >= deadline:
                    raise
            await asyncio.sleep(pause)

    async def fetch(
        self, sources: Sequence[str], epoch: int, expected: str, timeout: float
    ) -> tuple[Blob, ReplicaState, FetchReport]:
        """The state with digest ``expected`` (blob and decoded), striped
        across ``sources`` (addresses). Raises ``TransferFailed`` if none can
        deliver it. The decoded state's tensors are views into the blob
        (``rollcall.worker.state_bytes.decode``): neither may be changed in
        place. ``progress(done, size)``, if given, is called from the
        fetch's threads."""
        started = time.perf_counter()
        deadline = time.monotonic() + timeout
        answers = await self._described(sources, epoch, expected, deadline)
        holders = [
            (a, s)
            for a, s in zip(sources, answers, strict=True)
            if isinstance(s, pb.StateInfo) and s.digest == expected and s.size > 0
        ]
        if not holders:
            raise TransferFailed(f"no source holds state {expected}: {answers}")
        size = self._agreed_size(holders)
        holders = [(a, s) for a, s in holders if s.size == size]
        first, info = holders[0]
        if not info.data and size <= self._config.transfer_whole_bytes and first != sources[0]:
            # The source asked for the whole state did not answer: ask the
            # first that did.
            try:
                info = await self._describe(first, epoch, deadline, whole=True)
            except grpc.aio.AioRpcError as exc:
                log.warning("state %s whole from %s unavailable: %s", expected, first, exc)
        # Checked on this loop: at most transfer_whole_bytes (4 MiB, a few
        # ms), where a hand-off to a thread would cost a hot-add's path more.
        whole = self._whole(first, info, expected) if info.size == size else None
        if whole is not None:
            seconds = time.perf_counter() - started
            return whole[0], whole[1], FetchReport(len(whole[0]), seconds, (first,), 0)
        channels = [
            DataSource(a, a.rpartition(":")[0].strip("[]"), s.data_port, s.header_size)
            for a, s in holders
            if s.data_port
        ]
        if channels:
            blob, state, report = await self._over_data_channels(
                channels, epoch, expected, size, deadline
            )
        else:
            addresses = [a for a, _ in holders]
            blob, state, retries = await self._over_grpc(addresses, epoch, expected, size, deadline)
            report = FetchReport(size, 0.0, tuple(addresses), retries)
        report.seconds = time.perf_counter() - started
        return blob, state, report

    @staticmethod
    def _agreed_size(holders: Sequence[tuple[str, pb.StateInfo]]) -> int:
        """The size most holders name (the first named, on a tie), if this
        machine has the memory for it: a holder cannot make the fetch
        allocate more."""
        named = collections.Counter(s.size for _, s in holders)
        most = max(named.values())
        size = next(s.size for _, s in holders if named[s.size] == most)
        available = psutil.virtual_memory().available
        if size > available:
            raise TransferFailed(
                f"the holders name a state of {size} bytes, more than the {available} bytes "
                "of memory available here"
            )
        return size

    async def _over_data_channels(
        self, channels: Sequence[DataSource], epoch: int, expected: str, size: int,
        deadline: float,
    ) -> tuple[Blob, ReplicaState, FetchReport]:  # fmt: skip
        """The state over the data channels of ``channels``, from a thread
        of its own (the streams have theirs); cancelling ends it."""
        hello = Hello(self._job, self._member_id, epoch, b"", b"")
        fetch = PieceFetch(
            channels, size, expected, hello, self._secret(epoch), self._config, deadline,
            self._progress,
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        try:
            state, outcome = await loop.run_in_executor(None, fetch.run)
        except asyncio.CancelledError:
            fetch.cancel()
            raise
        except PieceFetchFailed as exc:
            raise TransferFailed(str(exc)) from exc
        report = FetchReport(
            size, 0.0, tuple(c.address for c in channels), 0, outcome.refetched_pieces,
            tuple(f"{a}: {why}" for a, why in outcome.failed.items()),
        )  # fmt: skip
        assert fetch.buffer is not None  # run() returned
        return fetch.buffer, state, report

    async def _over_grpc(
        self, addresses: Sequence[str], epoch: int, expected: str, size: int, deadline: float
    ) -> tuple[bytearray, ReplicaState, int]:
        """The state over gRPC ``Fetch`` calls, and how many times it was
        fetched again whole."""
        retries = 0
        loop = asyncio.get_running_loop()
        blob = await self._striped(addresses, epoch, expected, size, deadline)
        # Hashing all of a large state: not on this loop, which the
        # worker's session (its heartbeats) shares.
        state = await loop.run_in_executor(None, self._verified, blob, expected)
        if state is None:
            # Corrupt somewhere: take it whole from one source at a time.
            log.warning(
                "state %s from %s fails its digest: fetching it again whole, one source at a time",
                expected, ", ".join(addresses),
            )  # fmt: skip
            for address in addresses:
                retries += 1
                try:
                    candidate = await self._striped([address], epoch, expected, size, deadline)
                except (grpc.aio.AioRpcError, TransferFailed) as exc:
                    log.warning("refetch from %s failed: %s", address, exc)
                    continue
                state = await loop.run_in_executor(None, self._verified, candidate, expected)
                if state is not None:
                    blob = candidate
                    break
                log.warning("state %s from %s alone fails its digest", expected, address)
            if state is None:
                raise TransferFailed(f"every source delivered state that fails digest {expected}")
        return blob, state, retries

    async def _described(
        self, sources: Sequence[str], epoch: int, expected: str, deadline: float
    ) -> list[pb.StateInfo | BaseException]:
        """Every source's answer to ``Describe`` (the first is asked for a
        small state whole), or why it gave none. A source that cannot be
        reached or has not caught up is asked again until ``deadline``; but
        once one source named the ``expected`` state the others get only
        ``transfer_describe_grace`` more (a holder that died must not hold
        the fetch from a live one up to its deadline)."""

        def named(task: asyncio.Task[pb.StateInfo]) -> bool:
            return not task.cancelled() and task.exception() is None and (
                task.result().digest == expected and task.result().size > 0
            )  # fmt: skip

        tasks = [
            asyncio.ensure_future(self._describe(a, epoch, deadline, whole=i == 0))
            for i, a in enumerate(sources)
        ]
        try:
            pending: set[asyncio.Future[pb.StateInfo]] = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(named(t) for t in done):  # type: ignore[arg-type]
                    break
            if pending:
                await asyncio.wait(pending, timeout=self._config.transfer_describe_grace)
        finally:
            late = [t for t in tasks if not t.done()]
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        answers: list[pb.StateInfo | BaseException] = []
        for address, task in zip(sources, tasks, strict=True):
            if task.cancelled():
                answers.append(TransferFailed(f"{address} gave no answer in time"))
            elif task.exception() is not None:
                answers.append(task.exception())  # type: ignore[arg-type]
            else:
                answers.append(task.result())
        return answers

    async def _describe(
        self, address: str, epoch: int, deadline: float, whole: bool = False
    ) -> pb.StateInfo:
        request = self._request(epoch)
        request.whole_if_small = whole
        return await self._retrying(
            lambda: self._stub(address).Describe(
                request, metadata=self._metadata, timeout=self._call_timeout(deadline)
            ),
            deadline,
        )

    def _whole(
        self, address: str, answer: pb.StateInfo | BaseException, expected: str
    ) -> tuple[bytearray, ReplicaState] | None:
        """The state a source sent whole with its description, if it did,
        it is the agreed one and it checks out against its digest; None
        otherwise (it is then fetched as a larger one would be)."""
        if not isinstance(answer, pb.StateInfo) or not answer.data or answer.digest != expected:
            return None
        blob = bytearray(answer.data)
        state = self._verified(blob, expected)
        if state is None:
            log.warning(
                "corrupt state from %s: the state it sent whole fails the agreed digest %s; "
                "fetching it piece by piece", address, expected,
            )  # fmt: skip
        return None if state is None else (blob, state)

    async def _striped(
        self, addresses: Sequence[str], epoch: int, expected: str, size: int, deadline: float
    ) -> bytearray:
        assembler = Assembler(size)
        work = list(zip(ranges(size, len(addresses)), addresses, strict=False))
        done = 0

        async def pull(offset: int, length: int, address: str) -> None:
            nonlocal done
            call = self._stub(address).Fetch(
                pb.FetchRequest(
                    job=self._job, member_id=self._member_id, epoch=epoch, digest=expected,
                    offset=offset, length=length, epoch_secret=self._secret(epoch),
                ),
                metadata=self._metadata,
                timeout=self._call_timeout(deadline),
            )  # fmt: skip
            async for chunk in call:
                assembler.add(chunk.offset, chunk.data)
                done += len(chunk.data)
                if self._progress is not None:
                    self._progress(done, size)

        results = await asyncio.gather(
            *(pull(o, n, a) for (o, n), a in work), return_exceptions=True
        )
        failed = [a for ((_, _), a), r in zip(work, results, strict=True) if r is not None]
        healthy = [a for a in addresses if a not in failed] or list(addresses)
        for index, (offset, length) in enumerate(assembler.missing()):
            # A range whose source failed: fetch it again from the others.
            for attempt in range(len(healthy)):
                address = healthy[(index + attempt) % len(healthy)]
                try:
                    await pull(offset, length, address)
                    break
                except grpc.aio.AioRpcError as exc:
                    log.warning("range %d+%d from %s failed: %s", offset, length, address, exc)
        if not assembler.complete():
            raise TransferFailed(f"could not fetch {assembler.missing()} of state {expected}")
        return assembler.result()

    @staticmethod
    def _verified(blob: bytearray, expected: str) -> ReplicaState | None:
        """The decoded state if ``blob`` decodes, has digest ``expected`` and
        carries no RNG states (which the digest does not cover)."""
        try:  # the fetcher waits for it: every core hashes
            state = from_bytes(blob, expect_digest=expected, threads=hash_threads())
        except CorruptState:
            return None
        return None if state.rng else state
