"""Decode side of KV transfer: lands pushed KV straight into the blocks the decode engine reserved.

Per prefill node, one ``Connect`` stream (control, protobuf) and one 2-rank pair group (data). Each KVChunk
message is followed, on the data plane, by one send per run; the stream's reader queues one recv per run on
the pair's worker thread in message order, so both sides post data ops in the same order. Chunk recvs land
directly in ``kv_cache.blocks(dst, dst + n)`` views; TransferComplete travels through the same worker queue
as a marker, so by the time it is processed every chunk announced before it has landed.

Lifetimes: a transfer ends in exactly one of success or failure, and it is reported (``wait`` resolves) only
once no recv into its blocks is in flight. A refused chunk (unknown transfer, foreign block, transfer already
failed) is still received, into a scratch tensor, so the pair stays in step; the sender is told with
TransferAbort. Locking: ``KVReceiver._lock`` guards every ``ExpectedTransfer``; it is taken on the event loop, the
pair threads and the decode engine's thread (``expect``), and never held across a blocking call.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from kv_transfer.block_runs import BlockRun
from kv_transfer.errors import TransferFailed
from kv_transfer.layout import PROTOCOL_VERSION, layout_mismatch
from kv_transfer.pair_group import WILDCARD_HOSTS, DataOp, PairGroupConfig
from kv_transfer.receiver_pair import ChunkRecv, ReceiverPair
from kv_transfer.receiver_transfer import ExpectedTransfer, TransferResult
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

if TYPE_CHECKING:
    import grpc

    from common.kv.kv_cache import KVCache

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
    ) -> None:
        import datetime

        import torch.distributed as dist

        self.kv_cache = kv_cache
        self.bytes_per_block = kv_cache.spec.elements_per_block * kv_cache.data.element_size()
        self.layout = layout
        self.node_id = node_id
        self.host = host
        self.group_timeout_s = group_timeout_s
        self._lock = threading.Lock()
        self._transfers: dict[str, ExpectedTransfer] = {}
        # Why recently failed transfers ended, so a chunk that arrives late is refused with the real reason.
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._pairs: set[ReceiverPair] = set()
        # Lost pairs whose threads may still be dropping their group. close() waits for them as well: a
        # process that finalizes while a thread is inside the group's destructor aborts ("terminate called").
        self._retiring: set[ReceiverPair] = set()
        self._epochs = itertools.count()
        self._closed = False
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

    # ------------------------------------------------------------------ public API

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the KVTransfer service on the decode node's grpc.aio server."""
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(_KVTransferServicer(self), server)

    def expect(self, transfer_id: str, block_ids: list[int], num_cached_tokens: int) -> None:
        """Accept chunks for ``transfer_id`` into ``block_ids`` past the first ``num_cached_tokens`` tokens.

        Thread-safe (the decode engine may call it from its own thread). Call it before handing the reservation
        to anyone: chunks for a transfer id not expected yet are refused.
        """
        if num_cached_tokens < 0:
            raise ValueError(f"num_cached_tokens must be >= 0, got {num_cached_tokens}")
        bad = [b for b in block_ids if not 0 <= b < self.kv_cache.num_blocks]
        if bad:
            raise ValueError(f"block_ids {bad} outside 0..{self.kv_cache.num_blocks - 1}")
        # A partially cached block is still written (the prefill's KV for its cached slots is identical).
        num_cached_blocks = num_cached_tokens // self.kv_cache.spec.block_size
        transfer = ExpectedTransfer(transfer_id, frozenset(block_ids[num_cached_blocks:]), time.perf_counter())
        with self._lock:
            if self._closed:
                raise TransferFailed(transfer_id, "receiver closed")
            if transfer_id in self._transfers:
                raise ValueError(f"transfer {transfer_id!r} is already expected")
            self._transfers[transfer_id] = transfer

    async def wait(self, transfer_id: str, timeout_s: float) -> TransferResult:
        """Resolve once TransferComplete arrived and every announced chunk landed.

        Raises TransferFailed on abort by the sender, peer death / broken pair group, or timeout (the sender
        is then told). Cancelling the wait abandons the transfer. Either way, when this returns or raises no
        recv for the transfer is in flight and its blocks are the caller's again.
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            if transfer is None:
                raise TransferFailed(transfer_id, f"not expected on decode node {self.node_id} (or already ended)")
            fut = transfer.add_waiter(loop)
        try:
            await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            await self._give_up(transfer, f"no complete KV within {timeout_s:g}s")
        except asyncio.CancelledError:
            await self._give_up(transfer, "the decode side stopped waiting")
            raise
        finally:
            with self._lock:
                if self._transfers.get(transfer_id) is transfer and transfer.resolved:
                    self._forget(transfer)
        if transfer.error is not None:
            raise TransferFailed(transfer_id, transfer.error)
        complete = transfer.complete
        assert complete is not None and transfer.num_landed == transfer.num_chunks
        started = transfer.first_chunk_at or transfer.resolved_at
        return TransferResult(
            first_token=complete.first_token,
            first_logprob=complete.first_logprob if complete.HasField("first_logprob") else None,
            prefill_cached_tokens=complete.prefill_cached_tokens,
            bytes=transfer.bytes,
            seconds=transfer.resolved_at - started,
            trace_context=dict(transfer.trace_context),
        )

    async def abandon(self, transfer_id: str, reason: str) -> None:
        """Give up on a transfer (client cancelled, deadline): tell the sender, and return once no recv for it
        is in flight (bounded by the group timeout). The caller frees the blocks afterwards."""
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            if transfer is not None:
                self._fail(transfer, f"abandoned by decode node {self.node_id}: {reason}", notify_sender=True)
                self._forget(transfer)
        if transfer is not None:
            await self._drain(transfer)

    async def close(self) -> None:
        """Fail every transfer, drop every pair, stop the store."""
        with self._lock:
            self._closed = True
            pairs = list(self._pairs | self._retiring)
        for pair in pairs:
            pair.shut(f"decode node {self.node_id} is shutting down")  # idempotent: lost pairs are shut already
        for pair in pairs:
            await asyncio.to_thread(pair.group.join, self.group_timeout_s + 5)
        with self._lock:
            for transfer in self._transfers.values():
                self._fail(transfer, f"decode node {self.node_id} is shutting down", notify_sender=False)
            self._transfers.clear()
        self._store = None

    # ------------------------------------------------------------------ transfer state (under self._lock)

    def _forget(self, transfer: ExpectedTransfer) -> None:
        del self._transfers[transfer.transfer_id]
        if transfer.error is not None:
            self._ended[transfer.transfer_id] = transfer.error
            if len(self._ended) > 1024:
                self._ended.popitem(last=False)

    def _fail(self, transfer: ExpectedTransfer, reason: str, notify_sender: bool) -> None:
        if transfer.resolved or transfer.error is not None:
            return
        transfer.error = reason
        if notify_sender and transfer.pair is not None:
            transfer.pair.post_abort(transfer.transfer_id, reason, transfer.trace_context)
        self._maybe_resolve(transfer)

    def _maybe_resolve(self, transfer: ExpectedTransfer) -> None:
        if transfer.resolved or transfer.inflight:
            return
        if transfer.error is None and transfer.complete is None:
            return
        transfer.resolved = True
        transfer.resolved_at = time.perf_counter()
        for fut in transfer.waiters:
            fut.get_loop().call_soon_threadsafe(_set_done, fut)
        transfer.waiters.clear()

    async def _give_up(self, transfer: ExpectedTransfer, reason: str) -> None:
        with self._lock:
            self._fail(transfer, reason, notify_sender=True)
        await self._drain(transfer)

    async def _drain(self, transfer: ExpectedTransfer) -> None:
        """Return once the (failed or finished) transfer has no recv in flight."""
        with self._lock:
            fut = transfer.add_waiter(asyncio.get_running_loop())
        try:
            # A recv in flight ends by itself: it completes, or fails when the group times out.
            await asyncio.wait_for(asyncio.shield(fut), self.group_timeout_s + 5)
        except TimeoutError:
            log.error("KV transfer %s: a recv is still in flight after the group timeout", transfer.transfer_id)

    # ------------------------------------------------------------------ control stream (event loop)

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
        if self._closed:
            return f"decode node {self.node_id} is shutting down"
        return None

    def _on_chunk(self, pair: ReceiverPair, msg: KVMessage) -> None:
        chunk = msg.chunk
        runs = [BlockRun(r.src_start, r.dst_start, r.num_blocks) for r in chunk.runs]
        if any(not 0 < r.num_blocks <= self.kv_cache.num_blocks for r in runs):
            limit = self.kv_cache.num_blocks
            pair.shut(f"malformed KVChunk for {chunk.transfer_id}: a run of 0 or more than {limit} blocks")
            return
        with self._lock:
            transfer = self._transfers.get(chunk.transfer_id)
            refusal = self._chunk_refusal(chunk.transfer_id, transfer, pair, runs)
            if transfer is not None and refusal is None:
                transfer.pair = pair
                transfer.num_chunks += 1
                transfer.first_chunk_at = transfer.first_chunk_at or time.perf_counter()
                transfer.trace_context.update(msg.trace_context)
            elif transfer is not None and refusal is not None and transfer.pair in (None, pair):
                transfer.pair = pair
                self._fail(transfer, refusal, notify_sender=False)
        if refusal is not None:
            pair.refuse(chunk.transfer_id, refusal, dict(msg.trace_context))
        pair.group.submit(ChunkRecv(self, pair, transfer if refusal is None else None, chunk.transfer_id,
                                     chunk.seq, runs).as_op())

    def _chunk_refusal(
        self, transfer_id: str, transfer: ExpectedTransfer | None, pair: ReceiverPair, runs: list[BlockRun]
    ) -> str | None:
        if transfer is None:
            ended = self._ended.get(transfer_id)
            return ended or f"not expected on decode node {self.node_id} (never, or no longer)"
        if transfer.pair is not None and transfer.pair is not pair:
            return "already fed by another prefill connection"
        if transfer.error is not None:
            return transfer.error
        if transfer.complete_seen:
            return "KVChunk after TransferComplete"
        for run in runs:
            for block in range(run.dst_start, run.dst_start + run.num_blocks):
                if block not in transfer.allowed:
                    return f"destination block {block} is not a reserved, uncached block of this transfer"
        return None

    def _on_complete(self, pair: ReceiverPair, msg: KVMessage) -> None:
        complete = msg.complete
        with self._lock:
            transfer = self._transfers.get(complete.transfer_id)
            if transfer is None or transfer.pair not in (None, pair) or transfer.error or transfer.complete_seen:
                return  # refused earlier (the sender was told) or abandoned
            transfer.pair = pair
            transfer.complete_seen = True
            transfer.trace_context.update(msg.trace_context)

        def landed(error: str | None) -> None:
            with self._lock:
                if error is not None:
                    self._fail(transfer, error, notify_sender=False)
                elif transfer.error is None:
                    transfer.complete = complete
                    self._maybe_resolve(transfer)

        # A marker behind the chunk recvs: when it is reached, everything announced before it has landed.
        pair.group.submit(DataOp(send=False, tensors=None, finish=landed))

    def _on_abort(self, pair: ReceiverPair, msg: KVMessage) -> None:
        with self._lock:
            transfer = self._transfers.get(msg.abort.transfer_id)
            if transfer is not None and transfer.pair in (None, pair):
                transfer.pair = pair
                transfer.trace_context.update(msg.trace_context)
                self._fail(transfer, f"prefill node {pair.sender_id} aborted: {msg.abort.reason}", notify_sender=False)

    def _on_pair_lost(self, pair: ReceiverPair, reason: str) -> None:
        with self._lock:
            self._pairs.discard(pair)
            self._retiring = {p for p in self._retiring if p.group.running} | {pair}
            for transfer in self._transfers.values():
                if transfer.pair is pair:
                    self._fail(transfer, f"connection to prefill node {pair.sender_id} lost: {reason}", False)

    async def _connect(self, requests: AsyncIterator[KVMessage]) -> AsyncIterator[KVMessage]:
        try:
            first = await asyncio.wait_for(anext(requests), self.group_timeout_s)
        except (StopAsyncIteration, TimeoutError):
            return
        refusal = self._check_handshake(first)
        if refusal is not None:
            log.warning("KV handshake from %r refused: %s", first.handshake.sender_id, refusal)
            reply = kv_transfer_pb2.HandshakeReply(accepted=False, error=refusal, receiver_id=self.node_id)
            yield KVMessage(handshake_reply=reply)
            return
        sender_id = first.handshake.sender_id
        pair = ReceiverPair(self, sender_id, next(self._epochs), asyncio.get_running_loop())
        with self._lock:
            self._pairs.add(pair)
        pair.group.start(PairGroupConfig(
            store_host=self._store_client_host, store_port=self.store_port, prefix=pair.prefix, rank=1,
            timeout_s=self.group_timeout_s, bind_host=self.host,
        ))
        yield KVMessage(handshake_reply=kv_transfer_pb2.HandshakeReply(
            accepted=True, receiver_id=self.node_id,
            store_host="" if self.host in WILDCARD_HOSTS else self.host, store_port=self.store_port,
            group_prefix=pair.prefix, sender_rank=0, timeout_seconds=self.group_timeout_s,
        ))
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


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
