"""The decode side of one prefill node's connection: its stream's outbox, its pair group, its chunk recvs.

Both classes work on the receiver's transfer table (``KVReceiver._transfers``) under ``KVReceiver._lock``;
they are the receiver's private parts, kept in their own file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kv_transfer.block_runs import BlockRun
from kv_transfer.pair_group import DataOp, PairGroup
from tandem.v1 import kv_transfer_pb2

if TYPE_CHECKING:
    import torch

    from kv_transfer.receiver import KVReceiver
    from kv_transfer.receiver_transfer import ExpectedTransfer

log = logging.getLogger(__name__)

KVMessage = kv_transfer_pb2.KVMessage


class ReceiverPair:
    """One prefill node's connection: its stream's outbox, its pair group, the transfer ids refused on it."""

    def __init__(self, receiver: KVReceiver, sender_id: str, epoch: int, loop: asyncio.AbstractEventLoop) -> None:
        self.receiver = receiver
        self.sender_id = sender_id
        self.prefix = f"pair/{sender_id}/{epoch}"
        self.loop = loop
        self.outbox: asyncio.Queue[KVMessage | None] = asyncio.Queue()
        # Acks are cumulative (seq k: chunks 0..k landed; they land in order), so while one waits in the
        # outbox, later ones for the same transfer just raise its seq: fewer messages when the loop is busy.
        self._acks: dict[str, KVMessage] = {}
        self.group = PairGroup(f"{sender_id}/{epoch}", receiver.kv_cache.data.device, self._broken)
        self.refused: set[str] = set()
        self.closed = False

    def post(self, msg: KVMessage) -> None:
        """Queue a message to the sender. Thread-safe."""
        with contextlib.suppress(RuntimeError):  # loop closed: the stream is gone anyway
            self.loop.call_soon_threadsafe(self.outbox.put_nowait, msg)

    def post_ack(self, transfer_id: str, seq: int, trace_context: dict[str, str]) -> None:
        """Tell the sender chunks 0..seq of the transfer landed. Thread-safe."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._queue_ack, transfer_id, seq, trace_context)

    def _queue_ack(self, transfer_id: str, seq: int, trace_context: dict[str, str]) -> None:
        pending = self._acks.get(transfer_id)
        if pending is not None:
            pending.chunk_ack.seq = max(pending.chunk_ack.seq, seq)
            return
        ack = KVMessage(chunk_ack=kv_transfer_pb2.KVChunkAck(transfer_id=transfer_id, seq=seq),
                        trace_context=trace_context)
        self._acks[transfer_id] = ack
        self.outbox.put_nowait(ack)

    def sent(self, msg: KVMessage) -> None:
        """The stream took ``msg`` (event loop): a pending ack can no longer be raised."""
        if msg.WhichOneof("kind") == "chunk_ack":
            self._acks.pop(msg.chunk_ack.transfer_id, None)

    def post_abort(self, transfer_id: str, reason: str, trace_context: dict[str, str]) -> None:
        abort = kv_transfer_pb2.TransferAbort(transfer_id=transfer_id, reason=reason)
        self.post(KVMessage(abort=abort, trace_context=trace_context))

    def refuse(self, transfer_id: str, reason: str, trace_context: dict[str, str]) -> None:
        if transfer_id not in self.refused:  # once per transfer: it may have many chunks in flight
            if len(self.refused) >= 4096:  # a memory bound, not a correctness one: at worst an extra abort
                self.refused.clear()
            self.refused.add(transfer_id)
            log.warning("KV transfer %s from %s refused: %s", transfer_id, self.sender_id, reason)
            self.post_abort(transfer_id, reason, trace_context)

    async def read(self, requests: AsyncIterator[KVMessage]) -> None:
        reason = f"the stream from prefill node {self.sender_id} ended"
        handlers = {"chunk": self.receiver._on_chunk, "complete": self.receiver._on_complete,
                    "abort": self.receiver._on_abort}
        try:
            async for msg in requests:
                handler = handlers.get(msg.WhichOneof("kind") or "")
                if handler is None:
                    reason = f"unexpected {msg.WhichOneof('kind')} message"
                    break
                handler(self, msg)
                if self.closed:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = f"control stream broke: {exc}"
        self.shut(reason)

    def shut(self, reason: str) -> None:
        """End this pair (event loop): its transfers fail once their recvs are done; the stream closes."""
        if self.closed:
            return
        self.closed = True
        self.group.close(reason)
        self.receiver._on_pair_lost(self, reason)
        self.outbox.put_nowait(None)

    def _broken(self, reason: str) -> None:  # worker thread
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.shut, reason)


@dataclass
class ChunkRecv:
    """The recvs of one KVChunk: into the reserved blocks, or into scratch when the chunk was refused."""

    receiver: KVReceiver
    pair: ReceiverPair
    transfer: ExpectedTransfer | None  # None: refused, received into scratch only to keep the pair in step
    transfer_id: str
    seq: int
    runs: list[BlockRun]
    lands: bool = False  # decided when the op starts: the transfer may fail while queued

    def as_op(self) -> DataOp:
        return DataOp(send=False, tensors=self.tensors, finish=self.finish)

    def tensors(self) -> list[torch.Tensor]:
        import torch

        transfer, cache = self.transfer, self.receiver.kv_cache
        with self.receiver._lock:
            self.lands = transfer is not None and transfer.error is None
            if self.lands:
                assert transfer is not None
                transfer.inflight += 1
        if self.lands:
            # Zero-copy: each run is one contiguous [n, num_layers, 2, block_size, heads, head_dim] view.
            return [cache.blocks(r.dst_start, r.dst_start + r.num_blocks) for r in self.runs]
        shape = cache.data.shape[1:]
        return [torch.empty((r.num_blocks, *shape), dtype=cache.data.dtype, device=cache.data.device)
                for r in self.runs]

    def finish(self, error: str | None) -> None:
        transfer = self.transfer
        if transfer is None:
            return
        with self.receiver._lock:
            if self.lands:
                transfer.inflight -= 1
                if error is None:
                    transfer.num_landed += 1
                    transfer.bytes += sum(r.num_blocks for r in self.runs) * self.receiver.bytes_per_block
            if error is not None:
                self.receiver._fail(transfer, error, notify_sender=False)
            self.receiver._maybe_resolve(transfer)
            ack = self.lands and error is None and transfer.error is None
            trace_context = dict(transfer.trace_context)
        if ack:
            self.pair.post_ack(self.transfer_id, self.seq, trace_context)
