"""Prefill side of KV transfer: pushes KV blocks into a decode node's reserved blocks as they are produced.

Per decode node, made on first use and reused: one gRPC channel, one ``Connect`` stream and one 2-rank pair
group. After any failure the pair is dropped and the next ``open`` pairs again under a new epoch.

Order is everything: one writer task per pair takes pushes, completions and aborts of every transfer in the
order they were made; for each chunk it queues the chunk's sends on the pair's worker thread and writes
the KVChunk message. The receiver queues its recvs in the order it reads the messages, so both sides post
data ops in the same order. Chunks already announced are always sent, even after an abort, because the receiver will
post (scratch) recvs for them; a transfer's ``wait`` therefore reports only once its announced sends ended.
Handle state lives on the event loop; the engine thread reaches it only through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import TYPE_CHECKING

import grpc

from kv_transfer.errors import TransferFailed
from kv_transfer.layout import PROTOCOL_VERSION
from kv_transfer.pair_group import DataOp, PairGroup, PairGroupConfig
from kv_transfer.transfer_handle import Chunk, TransferHandle, TransferStats
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import Coroutine

    import torch

    from common.kv.kv_cache import KVCache
    from tandem.v1 import prefill_pb2

log = logging.getLogger(__name__)

KVMessage = kv_transfer_pb2.KVMessage

__all__ = ["KVSender", "TransferHandle", "TransferStats"]


class SenderPair:
    """The connection to one decode node: channel, Connect stream, pair group, writer and reader tasks.

    It carries its handles (``transfer_handle.TransferCarrier``) and reports back through their pair-side methods.
    """

    def __init__(self, sender: KVSender, endpoint: str, channel: grpc.aio.Channel,
                 call: grpc.aio.StreamStreamCall, receiver_id: str, epoch_prefix: str, timeout_s: float) -> None:
        self.sender = sender
        self.kv_cache = sender.kv_cache
        self.device = sender.kv_cache.data.device
        self.endpoint = endpoint
        self.channel = channel
        self.call = call
        self.receiver_id = receiver_id
        self.timeout_s = timeout_s
        self.loop = asyncio.get_running_loop()
        self.handles: dict[str, TransferHandle] = {}
        self.group = PairGroup(epoch_prefix, self.device, self._broken)
        self.error: str | None = None
        self._outbox: asyncio.Queue[tuple[TransferHandle, Chunk | kv_transfer_pb2.TransferComplete | str] | None]
        self._outbox = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    def start_io(self) -> None:
        self._tasks = [asyncio.create_task(self._write_loop()), asyncio.create_task(self._read_loop())]

    def enqueue(self, handle: TransferHandle, item: Chunk | kv_transfer_pb2.TransferComplete) -> None:
        self._outbox.put_nowait((handle, item))

    def write_abort(self, handle: TransferHandle, reason: str) -> None:
        self._outbox.put_nowait((handle, reason))

    def release(self, transfer_id: str) -> None:
        """The transfer ended: its id may be opened again on this pair."""
        self.handles.pop(transfer_id, None)

    async def _write_loop(self) -> None:
        try:
            while (entry := await self._outbox.get()) is not None:
                handle, item = entry
                if isinstance(item, str):  # abort: always written, the receiver may hold blocks for it
                    abort = kv_transfer_pb2.TransferAbort(transfer_id=handle.transfer_id, reason=item)
                    await self.call.write(KVMessage(abort=abort, trace_context=handle.trace_context))
                elif handle.error is not None:
                    continue  # not announced yet, so never sent
                elif isinstance(item, Chunk):
                    await self._announce(handle, item)
                else:
                    handle.fill_totals(item)
                    await self.call.write(KVMessage(complete=item, trace_context=handle.trace_context))
                    handle.complete_written()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.shut(f"control stream broke while writing: {_describe(exc)}")

    async def _announce(self, handle: TransferHandle, chunk: Chunk) -> None:
        # Announced: the receiver will post recvs for these runs, so the sends must happen. They are queued
        # before the message is written so the worker posts them while the message travels (sends only
        # complete against the matching recvs; if the write fails the stream is dead and the pair with it).
        num_bytes = sum(r.num_blocks for r in chunk.runs) * self.sender.bytes_per_block
        seq = handle.announce(len(chunk.runs), num_bytes)
        runs = [kv_transfer_pb2.BlockRun(src_start=r.src_start, dst_start=r.dst_start, num_blocks=r.num_blocks)
                for r in chunk.runs]
        msg = KVMessage(chunk=kv_transfer_pb2.KVChunk(transfer_id=handle.transfer_id, seq=seq, runs=runs),
                        trace_context=handle.trace_context)
        self.group.submit(self._send_op(handle, chunk))
        await self.call.write(msg)

    def _send_op(self, handle: TransferHandle, chunk: Chunk) -> DataOp:
        cache, loop = self.kv_cache, self.loop

        def tensors() -> list[torch.Tensor]:
            if chunk.ready is not None:
                import torch

                torch.cuda.current_stream(self.device).wait_event(chunk.ready)
            # Zero-copy: each run is one contiguous [n, num_layers, 2, block_size, heads, head_dim] view.
            return [cache.blocks(r.src_start, r.src_start + r.num_blocks) for r in chunk.runs]

        def finish(error: str | None) -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(handle.on_sent, error)

        return DataOp(send=True, tensors=tensors, finish=finish)

    async def _read_loop(self) -> None:
        reason = f"the stream from decode node {self.receiver_id} ended"
        try:
            while (msg := await self.call.read()) is not grpc.aio.EOF:
                assert isinstance(msg, KVMessage)
                kind = msg.WhichOneof("kind")
                if kind == "chunk_ack":
                    handle = self.handles.get(msg.chunk_ack.transfer_id)
                    if handle is not None:
                        handle.on_ack(msg.chunk_ack.seq)
                elif kind == "abort":
                    handle = self.handles.get(msg.abort.transfer_id)
                    if handle is not None:
                        handle.on_failure(f"decode node {self.receiver_id} aborted: {msg.abort.reason}")
                else:
                    reason = f"unexpected {kind} message from decode node {self.receiver_id}"
                    break
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = f"control stream broke: {_describe(exc)}"
        self.shut(reason)

    def shut(self, reason: str) -> None:
        """Drop this pair (event loop): its transfers fail once their sends ended; the next open() re-pairs."""
        if self.error is not None:
            return
        self.error = reason
        self.sender._forget(self)
        self.group.close(reason)
        for handle in list(self.handles.values()):
            handle.on_failure(f"connection to decode node {self.receiver_id} lost: {reason}")
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self.call.cancel()
        self.sender._background(self.channel.close())

    def _broken(self, reason: str) -> None:  # worker thread
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.shut, reason)


class KVSender:
    """The prefill node's end: one pair per decode node, made on first ``open`` and reused."""

    def __init__(
        self,
        kv_cache: KVCache,
        layout: kv_transfer_pb2.KVLayout,
        node_id: str,
        group_timeout_s: float = 30.0,
        host: str | None = None,
    ) -> None:
        """``host``: local address the data plane listens on; None = the one that routes to the decode node."""
        self.kv_cache = kv_cache
        self.layout = layout
        self.node_id = node_id
        self.group_timeout_s = group_timeout_s
        self.host = host
        self.bytes_per_block = kv_cache.spec.elements_per_block * kv_cache.data.element_size()
        self._pairs: dict[str, SenderPair] = {}
        self._connect_locks: dict[str, asyncio.Lock] = {}
        self._all_pairs: list[SenderPair] = []
        self._background_tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    async def open(
        self,
        transfer_id: str,
        destination: prefill_pb2.KVDestination,
        trace_context: dict[str, str] | None = None,
    ) -> TransferHandle:
        """A handle for one request's transfer into ``destination`` (pairs with that decode node if needed).

        Raises TransferFailed when the decode node is unreachable or refuses the pair (the reason names the
        layout field that differs).
        """
        if self._closed:
            raise TransferFailed(transfer_id, f"prefill node {self.node_id} is shutting down")
        pair = await self._pair_for(destination.kv_endpoint)
        if transfer_id in pair.handles:
            raise ValueError(f"KV transfer {transfer_id!r} is already open")
        handle = TransferHandle(pair, transfer_id, dict(trace_context or {}))
        pair.handles[transfer_id] = handle
        return handle

    async def close(self) -> None:
        """Fail open transfers (after their announced sends) and drop every pair."""
        self._closed = True
        pairs = list(self._all_pairs)  # live pairs; broken ones already left, their threads exit by themselves
        for pair in pairs:
            pair.shut(f"prefill node {self.node_id} is shutting down")
        for pair in pairs:
            await asyncio.to_thread(pair.group.join, self.group_timeout_s + 5)
            await asyncio.gather(*pair._tasks, return_exceptions=True)
        if self._background_tasks:
            await asyncio.gather(*self._background_tasks, return_exceptions=True)

    # ------------------------------------------------------------------ pairing

    async def _pair_for(self, endpoint: str) -> SenderPair:
        pair = self._pairs.get(endpoint)
        if pair is not None and pair.error is None:
            return pair
        async with self._connect_locks.setdefault(endpoint, asyncio.Lock()):
            pair = self._pairs.get(endpoint)
            if pair is None or pair.error is not None:
                pair = await self._connect(endpoint)
                self._pairs[endpoint] = pair
            return pair

    async def _connect(self, endpoint: str) -> SenderPair:
        channel = grpc.aio.insecure_channel(endpoint)
        call = kv_transfer_pb2_grpc.KVTransferStub(channel).Connect()
        pair: SenderPair | None = None
        try:
            async with asyncio.timeout(self.group_timeout_s):
                handshake = kv_transfer_pb2.Handshake(protocol_version=PROTOCOL_VERSION, sender_id=self.node_id,
                                                      layout=self.layout, device_type=self.kv_cache.data.device.type)
                await call.write(KVMessage(handshake=handshake))
                msg = await call.read()
                if msg is grpc.aio.EOF or msg.WhichOneof("kind") != "handshake_reply":
                    raise TransferFailed(None, f"decode node at {endpoint} sent no handshake reply")
                reply = msg.handshake_reply
                if not reply.accepted:
                    raise TransferFailed(None, f"decode node {reply.receiver_id or endpoint} refused to pair: "
                                               f"{reply.error}")
                timeout_s = reply.timeout_seconds or self.group_timeout_s
                pair = SenderPair(self, endpoint, channel, call, reply.receiver_id, reply.group_prefix, timeout_s)
                store_host = reply.store_host or _host_of(endpoint)
                bind_host = self.host if self.host is not None else _local_address_towards(store_host)
                ready = pair.group.start(PairGroupConfig(store_host, reply.store_port, reply.group_prefix,
                                                         reply.sender_rank, timeout_s, bind_host))
                await asyncio.wrap_future(ready)
        except BaseException as exc:
            if pair is not None:
                pair.group.close("pairing failed")
            call.cancel()
            await channel.close()
            if isinstance(exc, TransferFailed):
                raise
            if isinstance(exc, TimeoutError):
                raise TransferFailed(None, f"pairing with decode node at {endpoint} timed out after "
                                           f"{self.group_timeout_s:g}s") from None
            if isinstance(exc, grpc.aio.AioRpcError):
                raise TransferFailed(None, f"cannot reach decode node at {endpoint}: {_describe(exc)}") from None
            raise
        pair.start_io()
        self._all_pairs.append(pair)
        log.info("KV pair %s with decode node %s at %s formed", reply.group_prefix, reply.receiver_id, endpoint)
        return pair

    def _forget(self, pair: SenderPair) -> None:
        if self._pairs.get(pair.endpoint) is pair:
            del self._pairs[pair.endpoint]
        if pair in self._all_pairs:
            self._all_pairs.remove(pair)

    def _background(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background_tasks.add(task)
        task.add_done_callback(self._background_tasks.discard)


def _host_of(endpoint: str) -> str:
    host = endpoint.rsplit(":", 1)[0]
    return host.removeprefix("ipv4:").removeprefix("ipv6:").strip("[]")


def _local_address_towards(host: str) -> str:
    """The local address that routes to ``host`` (no packet is sent); loopback for loopback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return ""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
