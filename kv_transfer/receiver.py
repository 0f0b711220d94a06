"""Decode side of KV transfer: lands pushed KV straight into the blocks the decode engine reserved.

Per prefill node, one ``Connect`` stream (control, protobuf) and one 2-rank pair group (data), together a
``ReceiverPair`` (receiver_pair.py). Chunk recvs land directly in ``kv_cache.blocks(dst, dst + n)`` views.
A prefill node on the same host instead copies into our blocks itself (kv_transfer/transport.py): the KV
tensor lives in a shared-memory segment (CPU) or is shared by CUDA IPC handle, and every reserved block
carries a grant that is revoked before the block goes back to the caller (kv_transfer/block_grants.py).

Lifetimes: a transfer ends in exactly one of success or failure, and it is reported (``wait`` resolves) only
once no recv into its blocks is in flight. A refused chunk (unknown transfer, foreign block, transfer already
failed) is still received, into a scratch tensor, so the pair stays in step; the sender is told with
TransferAbort. Every transfer's state lives in one ``TransferTable`` (transfer_table.py) behind one lock;
the pairs' bookkeeping here is touched only on the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from kv_transfer.errors import TransferFailed
from kv_transfer.layout import PROTOCOL_VERSION, layout_mismatch
from kv_transfer.pair_group import WILDCARD_HOSTS, PairGroupConfig
from kv_transfer.receiver_pair import ReceiverPair
from kv_transfer.shared_kv_owner import SharedKVOwner
from kv_transfer.transfer_table import TransferTable
from kv_transfer.transport import SHM, SOCKET, check_transport, choose_transport, host_id
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

if TYPE_CHECKING:
    import grpc

    from common.kv.kv_cache import KVCache
    from kv_transfer.receiver_transfer import ExpectedTransfer, TransferResult

log = logging.getLogger(__name__)

KVMessage = kv_transfer_pb2.KVMessage


class KVReceiver:
    """The decode node's end: hosts the pair-group store and the KVTransfer service, tracks expected transfers."""

    def __init__(
        self,
        kv_cache: KVCache,
        layout: kv_transfer_pb2.KVLayout,
        node_id: str,
        host: str = "127.0.0.1",
        store_port: int = 0,
        group_timeout_s: float = 30.0,
        transport: str = "auto",
        on_finished: Callable[[str, int | None, str | None], None] | None = None,
        host_identity: str = "",
    ) -> None:
        """``transport``: auto (shared memory for same-host senders, sockets otherwise) | shm | socket;
        ``host_identity``: this node's host for that choice ("": the machine's, ``transport.host_id``).

        ``on_finished(transfer_id, first_token, error)``: each expected transfer's end, reported once no recv
        for it is in flight and its blocks are the caller's again (the decode engine's ``KVConsumer``).

        Unless it is ``socket``, the KV tensor is moved into shared memory here (CPU; see KVCache.share_memory),
        so build the receiver before anything keeps a view of ``kv_cache.data``. ``shm`` fails when shared
        memory cannot be set up; ``auto`` then logs why and pairs over sockets only.
        """
        import datetime

        import torch.distributed as dist

        self.transport = check_transport(transport)
        self.kv_cache = kv_cache
        self.layout = layout
        self.node_id = node_id
        self.host = host
        self.group_timeout_s = group_timeout_s
        self._on_finished = on_finished
        self._table = TransferTable(kv_cache, node_id)
        self._pairs: set[ReceiverPair] = set()
        # Lost pairs whose threads may still be dropping their group. close() waits for them as well: a
        # process that finalizes while a thread is inside the group's destructor aborts ("terminate called").
        self._retiring: set[ReceiverPair] = set()
        self._epochs = itertools.count()
        # TCPStore's own server listens on every interface; listening on a socket we bound ourselves keeps it
        # on the configured host. The store takes ownership of the fd.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, store_port))
        listener.listen(128)
        self.store_port: int = listener.getsockname()[1]
        loopback = "::1" if family == socket.AF_INET6 else "127.0.0.1"
        self._store_client_host = loopback if host in WILDCARD_HOSTS else host
        self._store: dist.TCPStore | None = dist.TCPStore(
            self._store_client_host, self.store_port, None, True,
            timeout=datetime.timedelta(seconds=group_timeout_s), wait_for_workers=False,
            master_listen_fd=listener.detach(), use_libuv=True,
        )
        self._host_id = host_identity or host_id()
        self._shared: SharedKVOwner | None = None
        if self.transport != SOCKET:
            self._shared = SharedKVOwner.maybe_create(kv_cache, node_id, required=self.transport == SHM)

    # ------------------------------------------------------------------ public API

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the KVTransfer service on the decode node's grpc.aio server."""
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(_KVTransferServicer(self), server)

    def expect(self, transfer_id: str, block_ids: list[int], num_cached_tokens: int) -> None:
        """Accept chunks for ``transfer_id`` into ``block_ids`` past the first ``num_cached_tokens`` tokens.

        Thread-safe (the decode engine may call it from its own thread). Call it before handing the reservation
        to anyone: chunks for a transfer id not expected yet are refused.
        """
        transfer = self._table.expect(transfer_id, block_ids, num_cached_tokens)
        if self._shared is not None:
            self._shared.grant(transfer_id, transfer.allowed)

    @property
    def shared_segment(self) -> str | None:
        """The name of the shared-memory segment same-host senders map, None when pairs use sockets only."""
        return self._shared.segment.name if self._shared is not None else None

    async def wait(self, transfer_id: str, timeout_s: float, start_timeout_s: float | None = None) -> TransferResult:
        """Resolve once TransferComplete arrived and every announced chunk landed.

        ``timeout_s`` runs from the first chunk (the prefill has started computing: time spent in the prefill
        node's queue does not count against it); until a first chunk arrives the wait is bounded by
        ``start_timeout_s`` (None: ``timeout_s`` from now, the first chunk notwithstanding).
        Raises TransferFailed on abort by the sender, peer death / broken pair group, or timeout (the sender
        is then told). Cancelling the wait abandons the transfer. Either way, when this returns or raises no
        recv for the transfer is in flight and its blocks are the caller's again.
        """
        transfer, fut = self._table.watch(transfer_id, asyncio.get_running_loop())
        try:
            try:
                await _until_resolved(transfer, fut, timeout_s, start_timeout_s)
            except TimeoutError as exc:
                await self._give_up(transfer, str(exc))
            except asyncio.CancelledError:
                await self._give_up(transfer, "the decode side stopped waiting")
                raise
            finally:
                if self._shared is not None:
                    await self._shared.revoke(transfer_id, transfer.allowed, self.group_timeout_s)
        finally:
            self._table.release(transfer)
            self._report(transfer)
        if transfer.error is not None:
            raise TransferFailed(transfer_id, transfer.error)
        return transfer.result()

    async def abandon(self, transfer_id: str, reason: str) -> None:
        """Give up on a transfer (client cancelled, deadline): tell the sender, and return once no recv for it
        is in flight (bounded by the group timeout). The caller frees the blocks afterwards."""
        transfer = self._table.abandon(transfer_id, f"abandoned by decode node {self.node_id}: {reason}")
        if transfer is not None:
            await self._drain(transfer)
            if self._shared is not None:
                await self._shared.revoke(transfer_id, transfer.allowed, self.group_timeout_s)
            self._report(transfer)

    def _report(self, transfer: ExpectedTransfer) -> None:
        """The transfer's end, to whoever tracks it (the consumer ignores a second report)."""
        if self._on_finished is None:
            return
        if transfer.error is None and transfer.complete is not None:
            self._on_finished(transfer.transfer_id, transfer.complete.first_token, None)
        else:
            self._on_finished(transfer.transfer_id, None, transfer.error or "ended before it completed")

    async def close(self) -> None:
        """Fail every transfer, drop every pair, stop the store, revoke every grant and unlink the segment."""
        self._table.close()
        pairs = list(self._pairs | self._retiring)
        for pair in pairs:
            pair.shut(f"decode node {self.node_id} is shutting down")  # idempotent: lost pairs are shut already
        for pair in pairs:
            await asyncio.to_thread(pair.group.join, self.group_timeout_s + 5)
        self._table.fail_all(f"decode node {self.node_id} is shutting down")
        self._store = None
        if self._shared is not None:
            await self._shared.close(self.group_timeout_s)

    # ------------------------------------------------------------------ waiting (event loop)

    async def _give_up(self, transfer: ExpectedTransfer, reason: str) -> None:
        self._table.fail(transfer, reason, notify_sender=True)
        await self._drain(transfer)

    async def _drain(self, transfer: ExpectedTransfer) -> None:
        """Return once the (failed or finished) transfer has no recv in flight."""
        fut = self._table.resolved_future(transfer, asyncio.get_running_loop())
        try:
            # A recv in flight ends by itself: it completes, or fails when the group times out.
            await asyncio.wait_for(asyncio.shield(fut), self.group_timeout_s + 5)
        except TimeoutError:
            log.error("KV transfer %s: a recv is still in flight after the group timeout", transfer.transfer_id)

    # ------------------------------------------------------------------ pairs (event loop)

    def _check_handshake(self, msg: KVMessage) -> str | None:
        if msg.WhichOneof("kind") != "handshake":
            return f"first message must be a handshake, got {msg.WhichOneof('kind')}"
        hs = msg.handshake
        if hs.protocol_version != PROTOCOL_VERSION:
            return f"protocol_version differs: prefill {hs.protocol_version}, decode {PROTOCOL_VERSION}"
        mismatch = layout_mismatch(self.layout, hs.layout)
        if mismatch is not None:
            return mismatch
        ours = self.kv_cache.data.device.type
        if hs.device_type != ours:
            return f"device_type differs: prefill {hs.device_type!r}, decode {ours!r}"
        if self._table.closed:
            return f"decode node {self.node_id} is shutting down"
        return None

    def _pick_transport(self, hs: kv_transfer_pb2.Handshake) -> tuple[str | None, str | None]:
        return choose_transport(self.transport, list(hs.transports), hs.host_id, self._host_id,
                                shm_ready=self._shared is not None)

    def _pair_lost(self, pair: ReceiverPair) -> None:
        self._pairs.discard(pair)
        self._retiring = {p for p in self._retiring if p.group.running} | {pair}

    async def _connect(self, requests: AsyncIterator[KVMessage]) -> AsyncIterator[KVMessage]:
        try:
            first = await asyncio.wait_for(anext(requests), self.group_timeout_s)
        except (StopAsyncIteration, TimeoutError):
            return
        refusal = self._check_handshake(first)
        transport: str | None = SOCKET
        if refusal is None:
            transport, refusal = self._pick_transport(first.handshake)
        if refusal is not None:
            log.warning("KV handshake from %r refused: %s", first.handshake.sender_id, refusal)
            reply = kv_transfer_pb2.HandshakeReply(accepted=False, error=refusal, receiver_id=self.node_id)
            yield KVMessage(handshake_reply=reply)
            return
        local = transport == SHM
        pair = ReceiverPair(self._table, self.kv_cache, first.handshake.sender_id, next(self._epochs),
                            asyncio.get_running_loop(), self._pair_lost, local=local)
        self._pairs.add(pair)
        reply = kv_transfer_pb2.HandshakeReply(
            accepted=True, receiver_id=self.node_id, group_prefix=pair.prefix, sender_rank=0,
            timeout_seconds=self.group_timeout_s, transport=transport,
        )
        if local:
            assert self._shared is not None
            reply.shared_kv.CopyFrom(self._shared.description)
        else:
            pair.group.start(PairGroupConfig(
                store_host=self._store_client_host, store_port=self.store_port, prefix=pair.prefix, rank=1,
                timeout_s=self.group_timeout_s, bind_host=self.host,
            ))
            reply.store_host = "" if self.host in WILDCARD_HOSTS else self.host
            reply.store_port = self.store_port
        log.info("KV pair %s with prefill node %s over %s", pair.prefix, first.handshake.sender_id, transport)
        yield KVMessage(handshake_reply=reply)
        reader = asyncio.create_task(pair.read(requests))
        try:
            while (out := await pair.outbox.get()) is not None:
                pair.sent(out)
                yield out
        finally:
            reader.cancel()
            pair.shut("control stream ended")


class _KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self, receiver: KVReceiver) -> None:
        self._receiver = receiver

    async def Connect(
        self, request_iterator: AsyncIterator[KVMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[KVMessage]:
        async for msg in self._receiver._connect(request_iterator):
            yield msg


# While no chunk has arrived, the wait wakes this often to see whether the first one came (then the
# transfer's own timeout starts).
_FIRST_CHUNK_POLL_S = 0.5


async def _until_resolved(transfer: ExpectedTransfer, fut: asyncio.Future[None], timeout_s: float,
                          start_timeout_s: float | None) -> None:
    """Wait for ``fut``: ``timeout_s`` from the transfer's first chunk, ``start_timeout_s`` for that chunk.
    Raises TimeoutError naming the limit that ran out."""
    if start_timeout_s is None:
        try:
            await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no complete KV within {timeout_s:g}s") from None
        return
    started = time.perf_counter()
    while True:
        first = transfer.first_chunk_at  # set by a pair thread; a float read is atomic
        now = time.perf_counter()
        if first is not None:
            remaining, step = first + timeout_s - now, first + timeout_s - now
            reason = f"no complete KV within {timeout_s:g}s of its first chunk"
        else:
            remaining = started + start_timeout_s - now
            step = min(remaining, _FIRST_CHUNK_POLL_S)
            reason = f"the prefill sent no KV within {start_timeout_s:g}s"
        if remaining <= 0:
            raise TimeoutError(reason)
        try:
            await asyncio.wait_for(asyncio.shield(fut), step)
            return
        except TimeoutError:
            continue
