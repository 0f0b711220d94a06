"""The decode node's expected transfers: one lock, the table, and every state change of a transfer.

A transfer ends in exactly one of success or failure, and it is resolved (its waiters are woken) only once
no recv into its blocks is in flight. The lock is taken on the event loop, the pairs' worker threads and the
decode engine's thread (``expect``), and never held across a blocking call; every method here takes it
itself, so callers never hold it. Pairs are seen only through ``PairLink``; this module knows no pair.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kv_transfer.errors import TransferFailed
from kv_transfer.receiver_transfer import ExpectedTransfer, PairLink

if TYPE_CHECKING:
    from common.kv.kv_cache import KVCache
    from kv_transfer.block_runs import BlockRun
    from tandem.v1 import kv_transfer_pb2


class TransferTable:
    """Thread-safe table of the transfers a decode node expects, keyed by transfer id."""

    def __init__(self, kv_cache: KVCache, node_id: str) -> None:
        self.num_blocks = kv_cache.num_blocks
        self.block_size = kv_cache.spec.block_size
        self.bytes_per_block = kv_cache.spec.elements_per_block * kv_cache.data.element_size()
        self.node_id = node_id
        self._lock = threading.Lock()
        self._transfers: dict[str, ExpectedTransfer] = {}
        # Why recently failed transfers ended, so a chunk that arrives late is refused with the real reason.
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ the decode side (engine thread, loop)

    def expect(self, transfer_id: str, block_ids: list[int], num_cached_tokens: int) -> ExpectedTransfer:
        """Accept chunks for ``transfer_id`` into ``block_ids`` past the first ``num_cached_tokens`` tokens."""
        if num_cached_tokens < 0:
            raise ValueError(f"num_cached_tokens must be >= 0, got {num_cached_tokens}")
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block_ids {bad} outside 0..{self.num_blocks - 1}")
        # A partially cached block is still written (the prefill's KV for its cached slots is identical).
        num_cached_blocks = num_cached_tokens // self.block_size
        transfer = ExpectedTransfer(transfer_id, frozenset(block_ids[num_cached_blocks:]), time.perf_counter())
        with self._lock:
            if self._closed:
                raise TransferFailed(transfer_id, "receiver closed")
            if transfer_id in self._transfers:
                raise ValueError(f"transfer {transfer_id!r} is already expected")
            self._transfers[transfer_id] = transfer
        return transfer

    def watch(
        self, transfer_id: str, loop: asyncio.AbstractEventLoop
    ) -> tuple[ExpectedTransfer, asyncio.Future[None]]:
        """The expected transfer and a future set (on ``loop``) once it resolves; TransferFailed if unknown."""
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            if transfer is None:
                raise TransferFailed(transfer_id, f"not expected on decode node {self.node_id} (or already ended)")
            return transfer, transfer.add_waiter(loop)

    def resolved_future(self, transfer: ExpectedTransfer, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A future set (on ``loop``) once ``transfer`` resolves, i.e. has no recv in flight."""
        with self._lock:
            return transfer.add_waiter(loop)

    def release(self, transfer: ExpectedTransfer) -> None:
        """The waiter is done with ``transfer``: drop it from the table if it resolved."""
        with self._lock:
            if self._transfers.get(transfer.transfer_id) is transfer and transfer.resolved:
                self._forget(transfer)

    def fail(self, transfer: ExpectedTransfer, reason: str, notify_sender: bool) -> None:
        """Fail ``transfer`` unless it already ended; ``notify_sender``: send TransferAbort on its pair."""
        with self._lock:
            self._fail(transfer, reason, notify_sender)

    def abandon(self, transfer_id: str, reason: str) -> ExpectedTransfer | None:
        """Fail (telling the sender) and drop ``transfer_id``; the transfer to drain, None if unknown."""
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            if transfer is not None:
                self._fail(transfer, reason, notify_sender=True)
                self._forget(transfer)
        return transfer

    def close(self) -> None:
        """Refuse new transfers (``expect`` raises, handshakes are refused)."""
        with self._lock:
            self._closed = True

    def fail_all(self, reason: str) -> None:
        """Fail every transfer (the sender is not told: its pairs are gone) and empty the table."""
        with self._lock:
            for transfer in self._transfers.values():
                self._fail(transfer, reason, notify_sender=False)
            self._transfers.clear()

    # ------------------------------------------------------------------ control messages (event loop)

    def accept_chunk(
        self, pair: PairLink, transfer_id: str, runs: list[BlockRun], trace_context: Mapping[str, str]
    ) -> tuple[ExpectedTransfer | None, str | None]:
        """Count a KVChunk read from ``pair``: (the transfer, None) if its recvs land, else (None, refusal).

        A refused chunk fails its transfer when ``pair`` may feed it; its recvs go to scratch either way.
        """
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            refusal = self._chunk_refusal(transfer_id, transfer, pair, runs)
            if transfer is not None and refusal is None:
                transfer.pair = pair
                transfer.num_chunks += 1
                transfer.first_chunk_at = transfer.first_chunk_at or time.perf_counter()
                transfer.trace_context.update(trace_context)
            elif transfer is not None and refusal is not None and transfer.pair in (None, pair):
                transfer.pair = pair
                self._fail(transfer, refusal, notify_sender=False)
        return (transfer, None) if refusal is None else (None, refusal)

    def complete_read(
        self, pair: PairLink, transfer_id: str, trace_context: Mapping[str, str]
    ) -> ExpectedTransfer | None:
        """TransferComplete read from ``pair``: the transfer to finish once its chunks landed, None to ignore it
        (refused earlier, so the sender was told, or abandoned)."""
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            if transfer is None or transfer.pair not in (None, pair) or transfer.error or transfer.complete_seen:
                return None
            transfer.pair = pair
            transfer.complete_seen = True
            transfer.trace_context.update(trace_context)
            return transfer

    def complete_landed(
        self, transfer: ExpectedTransfer, complete: kv_transfer_pb2.TransferComplete, error: str | None
    ) -> None:
        """Every chunk announced before TransferComplete landed (or the pair broke first: ``error``)."""
        with self._lock:
            if error is not None:
                self._fail(transfer, error, notify_sender=False)
            elif transfer.error is None:
                transfer.complete = complete
                self._maybe_resolve(transfer)

    def sender_aborted(
        self, pair: PairLink, transfer_id: str, reason: str, trace_context: Mapping[str, str]
    ) -> None:
        """TransferAbort read from ``pair``: fail the transfer if ``pair`` may feed it."""
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            if transfer is not None and transfer.pair in (None, pair):
                transfer.pair = pair
                transfer.trace_context.update(trace_context)
                self._fail(transfer, reason, notify_sender=False)

    def pair_lost(self, pair: PairLink, reason: str) -> None:
        """Fail every transfer ``pair`` fed; each resolves once its recvs are done."""
        with self._lock:
            for transfer in self._transfers.values():
                if transfer.pair is pair:
                    self._fail(transfer, reason, notify_sender=False)

    # ------------------------------------------------------------------ chunk recvs (pair worker threads)

    def start_recv(self, transfer: ExpectedTransfer) -> bool:
        """A recv for ``transfer`` is about to be posted: True if it lands in its blocks (counted in flight),
        False if the transfer failed meanwhile (receive into scratch)."""
        with self._lock:
            if transfer.error is not None:
                return False
            transfer.inflight += 1
            return True

    def end_recv(
        self, transfer: ExpectedTransfer, landed: bool, num_blocks: int, error: str | None
    ) -> dict[str, str] | None:
        """A chunk's recvs for ``transfer`` ended (``landed``: into its blocks, as ``start_recv`` decided).

        Returns the trace context to ack the chunk with, or None when no ack is due.
        """
        with self._lock:
            if landed:
                transfer.inflight -= 1
                if error is None:
                    transfer.num_landed += 1
                    transfer.bytes += num_blocks * self.bytes_per_block
            if error is not None:
                self._fail(transfer, error, notify_sender=False)
            self._maybe_resolve(transfer)
            ack = landed and error is None and transfer.error is None
            return dict(transfer.trace_context) if ack else None

    # ------------------------------------------------------------------ under self._lock

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

    def _chunk_refusal(
        self, transfer_id: str, transfer: ExpectedTransfer | None, pair: PairLink, runs: list[BlockRun]
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


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
