"""The decode side of one prefill node's connection: its stream's outbox, its pair group, its chunk recvs.

The pair reads the control messages of its ``Connect`` stream and posts the data ops they announce; what a
message does to a transfer is the ``TransferTable``'s business. Each KVChunk queues one recv per run on the
pair's worker thread in message order, so both sides post data ops in the same order; TransferComplete
travels through the same worker queue as a marker, so by the time it is processed every chunk announced
before it has landed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kv_transfer.block_runs import BlockRun
from kv_transfer.local_plane import LocalPlane
from kv_transfer.pair_group import DataOp, PairGroup
from tandem.v1 import kv_transfer_pb2

if TYPE_CHECKING:
    import torch

    from common.kv.kv_cache import KVCache
    from kv_transfer.receiver_transfer import ExpectedTransfer
    from kv_transfer.transfer_table import TransferTable

log = logging.getLogger(__name__)

KVMessage = kv_transfer_pb2.KVMessage


class ReceiverPair:
    """One prefill node's connection: its stream's outbox, its pair group, the transfer ids refused on it.

    ``on_lost`` is called once, on the event loop, when the pair ends (after its transfers were failed).
    ``local``: a same-host pair, whose sender copies into our blocks itself (``LocalPlane``, no pair group).
    """

    def __init__(
        self,
        table: TransferTable,
        kv_cache: KVCache,
        sender_id: str,
        epoch: int,
        loop: asyncio.AbstractEventLoop,
        on_lost: Callable[[ReceiverPair], None],
        local: bool = False,
    ) -> None:
        self.table = table
        self.kv_cache = kv_cache
        self.sender_id = sender_id
        self.prefix = f"pair/{sender_id}/{epoch}"
        self.loop = loop
        self.outbox: asyncio.Queue[KVMessage | None] = asyncio.Queue()
        # Acks are cumulative (seq k: chunks 0..k landed; they land in order), so while one waits in the
        # outbox, later ones for the same transfer just raise its seq: fewer messages when the loop is busy.
        self._acks: dict[str, KVMessage] = {}
        self._on_lost = on_lost
        name = f"{sender_id}/{epoch}"
        self.group: PairGroup | LocalPlane = (LocalPlane(name) if local
                                              else PairGroup(name, kv_cache.data.device, self._broken))
        self.refused: set[str] = set()
        self.closed = False

    # ------------------------------------------------------------------ to the sender (thread-safe)

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
        """Queue a TransferAbort to the sender. Thread-safe."""
        abort = kv_transfer_pb2.TransferAbort(transfer_id=transfer_id, reason=reason)
        self.post(KVMessage(abort=abort, trace_context=trace_context))

    def refuse(self, transfer_id: str, reason: str, trace_context: dict[str, str]) -> None:
        if transfer_id not in self.refused:  # once per transfer: it may have many chunks in flight
            if len(self.refused) >= 4096:  # a memory bound, not a correctness one: at worst an extra abort
                self.refused.clear()
            self.refused.add(transfer_id)
            log.warning("KV transfer %s from %s refused: %s", transfer_id, self.sender_id, reason)
            self.post_abort(transfer_id, reason, trace_context)

    # ------------------------------------------------------------------ from the sender (event loop)

    async def read(self, requests: AsyncIterator[KVMessage]) -> None:
        """Handle the stream's messages after the handshake until it ends; then shut the pair."""
        reason = f"the stream from prefill node {self.sender_id} ended"
        handlers = {"chunk": self._on_chunk, "complete": self._on_complete, "abort": self._on_abort}
        try:
            async for msg in requests:
                handler = handlers.get(msg.WhichOneof("kind") or "")
                if handler is None:
                    reason = f"unexpected {msg.WhichOneof('kind')} message"
                    break
                handler(msg)
                if self.closed:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = f"control stream broke: {exc}"
        self.shut(reason)

    def _on_chunk(self, msg: KVMessage) -> None:
        chunk = msg.chunk
        runs = [BlockRun(r.src_start, r.dst_start, r.num_blocks) for r in chunk.runs]
        limit = self.kv_cache.num_blocks
        if any(not 0 < r.num_blocks <= limit for r in runs):
            self.shut(f"malformed KVChunk for {chunk.transfer_id}: a run of 0 or more than {limit} blocks")
            return
        transfer, refusal = self.table.accept_chunk(self, chunk.transfer_id, runs, msg.trace_context)
        if refusal is None and chunk.not_written:  # same host: its blocks were granted to another transfer
            assert transfer is not None
            refusal = "a same-host chunk found its destination blocks granted to another transfer"
            self.table.fail(transfer, refusal, notify_sender=False)
            transfer = None
        if refusal is not None:
            self.refuse(chunk.transfer_id, refusal, dict(msg.trace_context))
        self.group.submit(ChunkRecv(self, transfer, chunk.transfer_id, chunk.seq, runs).as_op())

    def _on_complete(self, msg: KVMessage) -> None:
        complete = msg.complete
        transfer = self.table.complete_read(self, complete.transfer_id, msg.trace_context)
        if transfer is None:
            return

        def landed(error: str | None) -> None:
            self.table.complete_landed(transfer, complete, error)

        # A marker behind the chunk recvs: when it is reached, everything announced before it has landed.
        self.group.submit(DataOp(send=False, tensors=None, finish=landed))

    def _on_abort(self, msg: KVMessage) -> None:
        reason = f"prefill node {self.sender_id} aborted: {msg.abort.reason}"
        self.table.sender_aborted(self, msg.abort.transfer_id, reason, msg.trace_context)

    def shut(self, reason: str) -> None:
        """End this pair (event loop): its transfers fail once their recvs are done; the stream closes."""
        if self.closed:
            return
        self.closed = True
        self.group.close(reason)
        self.table.pair_lost(self, f"connection to prefill node {self.sender_id} lost: {reason}")
        self._on_lost(self)
        self.outbox.put_nowait(None)

    def _broken(self, reason: str) -> None:  # worker thread
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.shut, reason)


@dataclass
class ChunkRecv:
    """The recvs of one KVChunk: into the reserved blocks, or into scratch when the chunk was refused."""

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

        cache = self.pair.kv_cache
        self.lands = self.transfer is not None and self.pair.table.start_recv(self.transfer)
        if self.lands:
            # Zero-copy: each run is one contiguous [n, num_layers, 2, block_size, heads, head_dim] view.
            return [cache.blocks(r.dst_start, r.dst_start + r.num_blocks) for r in self.runs]
        shape = cache.data.shape[1:]
        return [torch.empty((r.num_blocks, *shape), dtype=cache.data.dtype, device=cache.data.device)
                for r in self.runs]

    def finish(self, error: str | None) -> None:
        if self.transfer is None:
            return
        num_blocks = sum(r.num_blocks for r in self.runs)
        ack_context = self.pair.table.end_recv(self.transfer, self.lands, num_blocks, error)
        if ack_context is not None:
            self.pair.post_ack(self.transfer_id, self.seq, ack_context)
