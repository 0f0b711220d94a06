"""A node's ``SubscribeKvEvents``: the engine thread's prefix-cache event batches, fanned out to subscribers.

The engine records events only while someone listens: the first subscriber sends ``SetKVEventSink(self)``
to the engine thread, the last one to leave sends ``SetKVEventSink(None)``. The engine thread calls
``publish`` after each step and command with what the KV cache manager recorded; ``publish`` only hands
the batch to the event loop, where it is converted to protobuf once (the one edge) and put on every
subscriber's drop-oldest queue, so a slow subscriber never holds up the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from common.engine.commands import SetKVEventSink
from common.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from common.serving.kv_event_queue import DEFAULT_MAX_QUEUED_BATCHES, KvEventQueue
from tandem.v1 import common_pb2

if TYPE_CHECKING:
    from common.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)


class KVEventPublisher:
    """Fans one engine's event batches out to any number of asyncio subscribers (one event loop)."""

    def __init__(self, engine: AsyncEngine, node_id: str, role: str) -> None:
        self._engine = engine
        self.node_id = node_id
        self.role = role
        self._queues: set[KvEventQueue] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def num_subscribers(self) -> int:
        return len(self._queues)

    async def subscribe(self, max_queued_batches: int = 0) -> AsyncIterator[common_pb2.KvEventBatch]:
        """Yield batches from now on until the caller stops iterating (the engine records from the first)."""
        self._loop = asyncio.get_running_loop()
        q = KvEventQueue(max_queued_batches or DEFAULT_MAX_QUEUED_BATCHES)
        self._queues.add(q)
        try:
            if len(self._queues) == 1:
                await self._engine.call(SetKVEventSink(self))
            while True:
                yield await q.get()
        finally:
            self._queues.discard(q)
            if not self._queues:
                self._engine.submit(SetKVEventSink(None))

    def publish(self, batch: KVEventBatch) -> None:
        """Engine thread: hand ``batch`` to the event loop; never blocks."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._fan_out, batch)
        except RuntimeError:  # the loop is closed: the server is gone
            log.debug("KV events dropped: event loop closed")

    def _fan_out(self, batch: KVEventBatch) -> None:
        if not self._queues:
            return
        msg = batch_to_proto(batch, self.node_id, self.role)
        for q in self._queues:
            q.put(msg)


def batch_to_proto(batch: KVEventBatch, node_id: str, role: str) -> common_pb2.KvEventBatch:
    msg = common_pb2.KvEventBatch(node_id=node_id, role=role, dropped=batch.dropped, timestamp=batch.timestamp)
    for event in batch.events:
        out = msg.events.add(event_id=event.event_id)
        match event:
            case BlockStored():
                out.stored.block_hashes.extend(event.block_hashes)
                out.stored.parent_block_hash = event.parent_block_hash or b""
                out.stored.token_ids.extend(event.token_ids)
                out.stored.block_size = event.block_size
            case BlockRemoved():
                out.removed.block_hashes.extend(event.block_hashes)
            case AllBlocksCleared():
                out.cleared.SetInParent()
    return msg
