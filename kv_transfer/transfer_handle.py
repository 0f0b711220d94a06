"""One request's transfer on the prefill side: the handle the prefill engine pushes blocks into.

``push`` / ``complete`` / ``abort`` are called from the prefill engine's thread; they only hand work to the
event loop (``call_soon_threadsafe``), where all of the handle's state lives. The pair that carries the
transfer (``sender.SenderPair``, seen here only as a ``TransferCarrier``) turns that work into control
messages and data ops, and reports back through the handle's pair-side methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kv_transfer.block_runs import BlockRun, coalesce_runs
from kv_transfer.errors import TransferFailed
from tandem.v1 import common_pb2, kv_transfer_pb2

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from common.kv.kv_cache import KVCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferStats:
    """What one finished transfer moved."""

    bytes: int
    seconds: float  # open() -> every chunk acked
    num_chunks: int
    num_sends: int


@dataclass(frozen=True)
class Chunk:
    """Blocks pushed together: one KVChunk message, then one send per run."""

    runs: list[BlockRun]
    ready: torch.cuda.Event | None  # CUDA: recorded after the forward that wrote the blocks


class TransferCarrier(Protocol):
    """What a handle needs from the pair that carries its transfer (``sender.SenderPair``); event loop only."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def kv_cache(self) -> KVCache: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def timeout_s(self) -> float:
        """The pair group's timeout: how long an announced send may take at most."""
        ...

    def enqueue(self, handle: TransferHandle, item: Chunk | kv_transfer_pb2.TransferComplete) -> None:
        """Queue a chunk or the completion for the pair's writer, in order."""
        ...

    def write_abort(self, handle: TransferHandle, reason: str) -> None:
        """Queue a TransferAbort for the pair's writer, in order."""
        ...

    def release(self, transfer_id: str) -> None:
        """The transfer ended (its outcome is final, nothing of it in flight): forget it."""
        ...


class TransferHandle:
    """One request's transfer. ``push`` / ``complete`` / ``abort`` are thread-safe; ``wait`` runs on the loop."""

    def __init__(self, pair: TransferCarrier, transfer_id: str, trace_context: dict[str, str]) -> None:
        self.transfer_id = transfer_id
        self.trace_context = trace_context  # W3C context sent with every control message of the transfer
        self._pair = pair
        self._loop = pair.loop
        self._opened_at = time.perf_counter()
        # Caller-thread view, guarded by _lock: which calls are still allowed.
        self._lock = threading.Lock()
        self._completed = False
        self._aborted = False
        # Event-loop state.
        self._num_chunks = 0  # announced
        self._num_sends = 0
        self._bytes = 0
        self._num_acked = 0
        self._sends_pending = 0  # chunks whose sends are queued or in flight
        self._ack_wait_since: float | None = None  # since when an announced chunk waits for its ack
        self._complete_sent = False
        self._error: str | None = None
        self._done: asyncio.Future[TransferStats] = self._loop.create_future()
        self._done.add_done_callback(_consume_exception)
        self._on_finished: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ engine thread

    def push(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        """Queue these freshly written blocks (prefill ids -> decode ids); returns at once. Thread-safe.

        Runs where both sides are consecutive are coalesced: one KVChunk, then one send per run, in order.
        """
        runs = coalesce_runs(src_block_ids, dst_block_ids)
        num_blocks = self._pair.kv_cache.num_blocks
        if any(r.src_start + r.num_blocks > num_blocks or r.src_start < 0 for r in runs):
            raise ValueError(f"src_block_ids {src_block_ids} outside 0..{num_blocks - 1}")
        if not runs:
            return
        ready = None
        if self._pair.device.type == "cuda":
            import torch

            # The forward that wrote these blocks may still be queued on the engine's stream.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._pair.device))
        with self._lock:
            if self._aborted:
                return
            if self._completed:
                raise RuntimeError(f"push() after complete() on KV transfer {self.transfer_id}")
            self._post(self._pair.enqueue, self, Chunk(runs, ready))

    def complete(
        self, first_token: int, first_logprob: common_pb2.TokenLogprob | None, prefill_cached_tokens: int
    ) -> None:
        """After the last push: tell the receiver the prompt is done and what the first token is. Thread-safe."""
        complete = kv_transfer_pb2.TransferComplete(
            transfer_id=self.transfer_id, first_token=first_token, prefill_cached_tokens=prefill_cached_tokens
        )
        if first_logprob is not None:
            complete.first_logprob.CopyFrom(first_logprob)
        with self._lock:
            if self._aborted:
                return
            if self._completed:
                raise RuntimeError(f"complete() twice on KV transfer {self.transfer_id}")
            self._completed = True
            self._post(self._pair.enqueue, self, complete)

    def abort(self, reason: str) -> None:
        """Give up: the receiver is told and frees its blocks. Thread-safe; later pushes are ignored."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            self._post(self._fail, f"aborted by prefill node: {reason}", reason)

    def when_finished(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the event loop) once the transfer ended, succeeded or failed, and no send
        reads the blocks any more; at once if it has. Thread-safe: the prefill engine's connector asks."""
        self._post(self._add_finished_callback, callback)

    # ------------------------------------------------------------------ event loop

    def _add_finished_callback(self, callback: Callable[[], None]) -> None:
        if self._done.done():
            callback()
        else:
            self._on_finished.append(callback)

    async def wait(self, timeout_s: float) -> TransferStats:
        """Resolve once every chunk was acked and TransferComplete was written; raise TransferFailed otherwise.

        On timeout (or cancellation) the transfer is aborted first. Either way, when this returns or raises no
        send for the transfer is in flight: the prefill side may free its blocks.
        """
        try:
            return await asyncio.wait_for(asyncio.shield(self._done), timeout_s)
        except TimeoutError:
            self._fail(f"not finished within {timeout_s:g}s", "prefill side timed out")
            await self._drain()
        except asyncio.CancelledError:
            self._fail("the prefill side stopped waiting", "prefill side cancelled")
            await self._drain()
            raise
        return self._done.result()  # raises TransferFailed unless it finished successfully meanwhile

    async def _drain(self) -> None:
        try:
            # Sends already announced run to their end, or fail when the group times out.
            await asyncio.wait_for(asyncio.shield(self._done), self._pair.timeout_s + 5)
        except TimeoutError:
            log.error("KV transfer %s: a send is still in flight after the group timeout", self.transfer_id)
            raise TransferFailed(self.transfer_id, self._error or "send stuck past the group timeout") from None
        except TransferFailed:
            pass

    # ------------------------------------------------------------------ pair side (event loop)

    @property
    def waiting_for_ack_since(self) -> float | None:
        """``perf_counter`` time since which an announced chunk waits for its ack (the last ack, or the announce
        that followed a full ack); None when nothing waits, or once the transfer ended."""
        return None if self._done.done() or self._error is not None else self._ack_wait_since

    @property
    def error(self) -> str | None:
        """Why the transfer failed, None while it has not."""
        return self._error

    def announce(self, num_runs: int, num_bytes: int) -> int:
        """The pair announces a chunk and queues its sends: count it; returns its seq."""
        seq = self._num_chunks
        if self._num_acked == self._num_chunks:
            self._ack_wait_since = time.perf_counter()
        self._num_chunks += 1
        self._num_sends += num_runs
        self._bytes += num_bytes
        self._sends_pending += 1
        return seq

    def fill_totals(self, complete: kv_transfer_pb2.TransferComplete) -> None:
        """Stamp TransferComplete, just before it is written, with the bytes and seconds so far."""
        complete.bytes = self._bytes
        complete.seconds = time.perf_counter() - self._opened_at

    def complete_written(self) -> None:
        """The pair wrote TransferComplete: the transfer finishes once every chunk is acked."""
        self._complete_sent = True
        self._maybe_finish()

    def on_sent(self, error: str | None) -> None:
        """A chunk's sends ended (``error``: they failed)."""
        self._sends_pending -= 1
        if error is not None:
            self._fail(error)
        self._maybe_finish()

    def on_ack(self, seq: int) -> None:
        """The receiver acked chunks 0..seq (acks are cumulative: chunks land in order)."""
        if seq + 1 > self._num_acked:
            self._num_acked = seq + 1
            self._ack_wait_since = time.perf_counter() if self._num_acked < self._num_chunks else None
        self._maybe_finish()

    def on_failure(self, reason: str) -> None:
        """The receiver aborted the transfer, or the pair was lost: the receiver needs no TransferAbort."""
        self._fail(reason)

    # ------------------------------------------------------------------ internals (event loop)

    def _post(self, fn: Callable[..., object], *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed: the sender is gone
            self._loop.call_soon_threadsafe(fn, *args)

    def _fail(self, reason: str, tell_receiver: str | None = None) -> None:
        """Mark failed; ``tell_receiver`` is the TransferAbort reason when the receiver does not know yet."""
        if self._done.done() or self._error is not None:
            return
        self._error = reason
        if tell_receiver is not None:
            self._pair.write_abort(self, tell_receiver)
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self._done.done() or self._sends_pending:
            return
        if self._error is not None:
            self._done.set_exception(TransferFailed(self.transfer_id, self._error))
        elif self._complete_sent and self._num_acked == self._num_chunks:
            self._done.set_result(TransferStats(self._bytes, time.perf_counter() - self._opened_at,
                                                self._num_chunks, self._num_sends))
        else:
            return
        self._pair.release(self.transfer_id)
        callbacks, self._on_finished = self._on_finished, []
        for callback in callbacks:
            callback()


def _consume_exception(fut: asyncio.Future[TransferStats]) -> None:
    # A failure nobody waits for (e.g. the caller aborted and moved on) is not an unhandled error.
    if not fut.cancelled():
        fut.exception()
