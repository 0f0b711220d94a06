"""The prefill side of one decode node's connection: channel, Connect stream, data plane, writer and reader.

One writer task takes pushes, completions and aborts of every transfer of the pair in the order they were
made. Over sockets, for each chunk it queues the chunk's sends on the pair group and writes the KVChunk
message (the receiver posts its recvs in message order, so both sides post data ops in the same order).
On the same host it copies the chunk's runs into the decode node's blocks on the pair's copy thread, under
their grants (``SharedKVWriter``), and writes the KVChunk only once they landed; without sends to time out,
a watchdog fails the pair when the decode node acks nothing for the group timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc

from kv_transfer.local_plane import LocalPlane
from kv_transfer.pair_group import DataOp, PairGroup
from kv_transfer.transfer_handle import Chunk, TransferHandle
from kv_transfer.transport import SHM, SOCKET
from tandem.v1 import kv_transfer_pb2

if TYPE_CHECKING:
    from collections.abc import Coroutine

    import torch

    from common.kv.kv_cache import KVCache
    from kv_transfer.shared_kv_writer import SharedKVWriter

KVMessage = kv_transfer_pb2.KVMessage


class PairOwner(Protocol):
    """What a pair needs from the ``KVSender`` that made it."""

    @property
    def kv_cache(self) -> KVCache: ...

    @property
    def bytes_per_block(self) -> int: ...

    def forget(self, pair: SenderPair) -> None: ...

    def background(self, coro: Coroutine[object, object, None]) -> None: ...


class SenderPair:
    """The connection to one decode node: channel, Connect stream, pair group, writer and reader tasks.

    It carries its handles (``transfer_handle.TransferCarrier``) and reports back through their pair-side methods.
    """

    def __init__(self, sender: PairOwner, endpoint: str, channel: grpc.aio.Channel,
                 call: grpc.aio.StreamStreamCall, receiver_id: str, epoch_prefix: str, timeout_s: float,
                 writer: SharedKVWriter | None = None) -> None:
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
        self.writer = writer  # same host: we copy into the decode node's blocks ourselves
        self.group: PairGroup | LocalPlane = (LocalPlane(epoch_prefix) if writer is not None
                                              else PairGroup(epoch_prefix, self.device, self._broken))
        self._release_lock = threading.Lock()
        self._writer_closed = False
        self._copier = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kv-copy-{epoch_prefix}")
                        if writer is not None else None)
        self.transport = SHM if writer is not None else SOCKET
        self.error: str | None = None
        self._outbox: asyncio.Queue[tuple[TransferHandle, Chunk | kv_transfer_pb2.TransferComplete | str] | None]
        self._outbox = asyncio.Queue()
        # Same host: messages in order, each written once the copy before it finished (None: stop).
        self._writes: asyncio.Queue[_Write | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    def start_io(self) -> None:
        self._tasks = [asyncio.create_task(self._write_loop()), asyncio.create_task(self._read_loop())]
        if self.writer is not None:
            self._tasks += [asyncio.create_task(self._announce_loop()), asyncio.create_task(self._watch_acks())]

    def join(self, timeout_s: float) -> bool:
        """Wait (blocking) until no data op of this pair runs anymore: the group's threads, the copy thread."""
        done = self.group.join(timeout_s)
        self._release_writer()
        return done

    def _release_writer(self) -> None:
        """Blocking: wait for the copy thread to end, then unmap the decode node's KV (once)."""
        if self._copier is None or self.writer is None:
            return
        self._copier.shutdown(wait=True)
        with self._release_lock:
            if not self._writer_closed:
                self._writer_closed = True
                self.writer.close()

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
                    await self._write(KVMessage(abort=abort, trace_context=handle.trace_context))
                elif handle.error is not None:
                    continue  # not announced yet, so never sent
                elif isinstance(item, Chunk) and self.writer is not None:
                    self._copy_and_announce(handle, item)
                elif isinstance(item, Chunk):
                    await self._announce(handle, item)
                else:
                    handle.fill_totals(item)
                    await self._write(KVMessage(complete=item, trace_context=handle.trace_context),
                                      handle.complete_written)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.shut(f"control stream broke while writing: {describe(exc)}")

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

    async def _write(self, message: KVMessage, after: Callable[[], None] | None = None) -> None:
        """Write ``message`` now (sockets), or behind the copies queued before it (same host)."""
        if self.writer is None:
            await self.call.write(message)
            if after is not None:
                after()
        else:
            self._writes.put_nowait(_Write(None, lambda _: message, after))

    def _copy_and_announce(self, handle: TransferHandle, chunk: Chunk) -> None:
        # Copied first, announced after: a KVChunk says its runs are in place. The copy thread runs the copies
        # back to back, in order; the announcer writes each chunk's message once its copy finished. A run
        # whose blocks are no longer granted to the transfer is not copied, yet the chunk is still announced
        # (not_written), so that the decode node refuses it with its own reason.
        assert self.writer is not None and self._copier is not None
        num_bytes = sum(r.num_blocks for r in chunk.runs) * self.sender.bytes_per_block
        seq = handle.announce(len(chunk.runs), num_bytes)
        loop, receiver_id = self.loop, self.receiver_id

        def copied(done: concurrent.futures.Future[bool]) -> None:  # copy thread; runs even if we are cancelled
            if done.cancelled():  # the pair shut before the copy started: nothing was written
                error: str | None = "the pair closed before the copy"
            else:
                exc = done.exception()
                error = None if exc is None else f"copy into decode node {receiver_id} failed: {describe(exc)}"
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(handle.on_sent, error)

        copy = self._copier.submit(self.writer.copy, handle.transfer_id, self.kv_cache, chunk.runs, chunk.ready)
        copy.add_done_callback(copied)
        runs = [kv_transfer_pb2.BlockRun(src_start=r.src_start, dst_start=r.dst_start, num_blocks=r.num_blocks)
                for r in chunk.runs]

        def message(written: bool) -> KVMessage:
            chunk_msg = kv_transfer_pb2.KVChunk(transfer_id=handle.transfer_id, seq=seq, runs=runs,
                                                not_written=not written)
            return KVMessage(chunk=chunk_msg, trace_context=handle.trace_context)

        self._writes.put_nowait(_Write(asyncio.wrap_future(copy), message, None))

    async def _announce_loop(self) -> None:
        try:
            while (entry := await self._writes.get()) is not None:
                written = True
                if entry.copy is not None:
                    try:
                        written = await entry.copy
                    except Exception as exc:
                        self.shut(f"same-host copy failed: {describe(exc)}")
                        return
                await self.call.write(entry.message(written))
                if entry.after is not None:
                    entry.after()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.shut(f"control stream broke while writing: {describe(exc)}")

    async def _watch_acks(self) -> None:
        """Same host: fail the pair when chunks wait for acks longer than the group timeout."""
        while True:
            await asyncio.sleep(min(1.0, self.timeout_s / 4))
            now = time.perf_counter()
            for handle in list(self.handles.values()):
                since = handle.waiting_for_ack_since
                if since is not None and now - since > self.timeout_s:
                    self.shut(f"decode node {self.receiver_id} acked no KV for {self.timeout_s:g}s")
                    return

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
            reason = f"control stream broke: {describe(exc)}"
        self.shut(reason)

    def shut(self, reason: str) -> None:
        """Drop this pair (event loop): its transfers fail once their sends ended; the next open() re-pairs."""
        if self.error is not None:
            return
        self.error = reason
        self.sender.forget(self)
        self.group.close(reason)
        if self._copier is not None:
            # Queued copies are dropped (their transfers fail); one in progress finishes and reports by itself,
            # then the decode node's KV is unmapped (off the loop: it waits for that copy).
            self._copier.shutdown(wait=False, cancel_futures=True)
            self.sender.background(asyncio.to_thread(self._release_writer))
        for handle in list(self.handles.values()):
            handle.on_failure(f"connection to decode node {self.receiver_id} lost: {reason}")
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self.call.cancel()
        self.sender.background(self.channel.close())

    async def wait_stopped(self) -> None:
        """Until the pair's loops (write, read, announce, acks) have ended, as ``shut`` makes them."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _broken(self, reason: str) -> None:  # worker thread
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.shut, reason)


@dataclass(frozen=True)
class _Write:
    """A control message of a same-host pair, written once ``copy`` (the chunk's copy, if any) finished."""

    copy: asyncio.Future[bool] | None  # True: every run was copied
    message: Callable[[bool], KVMessage]
    after: Callable[[], None] | None


def describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
