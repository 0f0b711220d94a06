"""A subscriber's bounded queue of prefix-cache event batches: a slow reader loses the oldest, never blocks.

Nodes (``common.engine.kv_event_publisher``) and the gateway (``gateway.kv_event_merger``) give each
``SubscribeKvEvents`` stream one of these. ``put`` never waits, so neither the engine thread's fan-out nor
the gateway's merge can be held up by a reader; when the queue is full the oldest batch goes and its
events are counted into the ``dropped`` of the next batch the reader gets.
"""

from __future__ import annotations

import asyncio
from collections import deque

from tandem.v1 import common_pb2

DEFAULT_MAX_QUEUED_BATCHES = 256


class KvEventQueue:
    """Drop-oldest queue of ``KvEventBatch`` messages for one subscriber (asyncio, single loop)."""

    def __init__(self, max_batches: int = DEFAULT_MAX_QUEUED_BATCHES) -> None:
        assert max_batches > 0, f"max_batches must be positive, got {max_batches}"
        self._batches: deque[common_pb2.KvEventBatch] = deque()
        self._max = max_batches
        self._dropped = 0  # events lost to overflow since the reader last got a batch
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._batches)

    def put(self, batch: common_pb2.KvEventBatch) -> None:
        """Enqueue (the message may be shared with other queues: it is never mutated here)."""
        if len(self._batches) >= self._max:
            oldest = self._batches.popleft()
            self._dropped += len(oldest.events) + oldest.dropped
        self._batches.append(batch)
        self._ready.set()

    async def get(self) -> common_pb2.KvEventBatch:
        while not self._batches:
            self._ready.clear()
            await self._ready.wait()
        batch = self._batches.popleft()
        if self._dropped:
            copy = common_pb2.KvEventBatch()
            copy.CopyFrom(batch)
            copy.dropped += self._dropped
            self._dropped = 0
            return copy
        return batch
