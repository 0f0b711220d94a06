"""A node's ``SubscribeKvEvents``: the engine thread's prefix-cache event batches, fanned out to subscribers.

The engine records events from the first subscriber on (``SetKVEventSink(self)``) and keeps recording for
the process's life: a subscriber that reconnects (the gateway's prefix index, after a dropped connection)
must find every batch since it left in the history, even if it was the only one. The engine thread calls
``publish`` after each step and command with what the KV cache manager recorded; ``publish`` numbers the
batch (``sequence``: 1, 2, ... within this process's ``incarnation``) and hands it to the event loop, where it
is converted to protobuf once (the one edge), kept in a bounded history and put on every subscriber's
drop-oldest queue, so a slow subscriber never holds up the engine.

A subscriber that lost batches (a dropped connection, an overflowing queue) resumes with the incarnation it
saw and the next sequence it needs: the node replays from its history when it still holds that sequence,
and otherwise (another incarnation: the node restarted; a sequence older than the history; a batch whose
events the engine's log dropped) starts the stream with a snapshot of every cached block
(``SnapshotKVBlocks``, exact as of the last batch published before it), then the batches after it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from common.engine.commands import SetKVEventSink, SnapshotKVBlocks
from common.kv.kv_events import AllBlocksCleared, BlockDigest, BlockRemoved, BlockStored, KVEventBatch, KVSnapshot
from common.serving.kv_event_queue import DEFAULT_MAX_QUEUED_BATCHES, KvEventQueue
from tandem.v1 import common_pb2

if TYPE_CHECKING:
    from common.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

DEFAULT_HISTORY_BATCHES = 1024


class KVEventPublisher:
    """Fans one engine's event batches out to any number of asyncio subscribers (one event loop)."""

    def __init__(self, engine: AsyncEngine, node_id: str, role: str,
                 history_batches: int = DEFAULT_HISTORY_BATCHES) -> None:
        assert history_batches > 0, f"history_batches must be positive, got {history_batches}"
        self._engine = engine
        self.node_id = node_id
        self.role = role
        self.incarnation = secrets.token_hex(8)  # fixed for this process: a new one tells subscribers it restarted
        self.last_sequence = 0  # engine thread: the sequence publish gave the last batch
        self._queues: set[KvEventQueue] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recording = False
        # Event loop: the last batches fanned out, and the oldest sequence a subscriber can resume from (0: none
        # yet). Contiguous: a batch whose events the engine's log dropped restarts it after that batch.
        self._history: deque[common_pb2.KvEventBatch] = deque(maxlen=history_batches)
        self._history_from = 0
        self._fanned_out = 0  # event loop: the sequence of the last batch fanned out

    @property
    def num_subscribers(self) -> int:
        return len(self._queues)

    async def subscribe(self, request: common_pb2.SubscribeKvEventsRequest | None = None
                        ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """Yield batches until the caller stops iterating: a replay or a snapshot first when ``request`` asks
        to resume or for a snapshot (see the module docstring), then the live batches."""
        request = request or common_pb2.SubscribeKvEventsRequest()
        self._loop = asyncio.get_running_loop()
        q = KvEventQueue(request.max_queued_batches or DEFAULT_MAX_QUEUED_BATCHES)
        self._queues.add(q)  # from here on no live batch is missed: the replay or snapshot joins onto q
        try:
            if not self._recording:
                await self._engine.call(SetKVEventSink(self))
                self._recording = True
            after = 0  # yield only live batches with a later sequence (0: all of them)
            replay = self.replay(request)
            if replay is not None:
                for batch in replay:
                    yield batch
                after = replay[-1].sequence if replay else request.from_sequence - 1
            elif request.snapshot or request.incarnation:
                snapshot: KVSnapshot = await self._engine.call(SnapshotKVBlocks())
                yield snapshot_to_proto(snapshot, self.node_id, self.role, self.incarnation)
                after = snapshot.sequence
            while True:
                batch = await q.get()
                if batch.sequence > after:
                    yield batch
        finally:
            self._queues.discard(q)

    def replay(self, request: common_pb2.SubscribeKvEventsRequest) -> list[common_pb2.KvEventBatch] | None:
        """The history from ``request.from_sequence`` on (possibly empty: nothing missed), or None when the
        request does not resume this incarnation or the history no longer reaches back that far."""
        if request.snapshot or request.incarnation != self.incarnation:
            return None
        start = request.from_sequence
        if not self._history_from or not self._history_from <= start <= self._fanned_out + 1:
            return None
        return [batch for batch in self._history if batch.sequence >= start]

    def publish(self, batch: KVEventBatch) -> None:
        """Engine thread: number ``batch`` and hand it to the event loop; never blocks."""
        self.last_sequence += 1
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._fan_out, batch, self.last_sequence)
        except RuntimeError:  # the loop is closed: the server is gone
            log.debug("KV events dropped: event loop closed")

    def _fan_out(self, batch: KVEventBatch, sequence: int) -> None:
        msg = batch_to_proto(batch, self.node_id, self.role)
        msg.incarnation = self.incarnation
        msg.sequence = sequence
        self._fanned_out = sequence
        if batch.dropped:  # the engine's log lost events here: no replay can cross this batch
            self._history.clear()
            self._history_from = sequence + 1
        else:
            self._history.append(msg)
            if not self._history_from:
                self._history_from = sequence
            elif self._history[0].sequence > self._history_from:  # the bounded history let its oldest go
                self._history_from = self._history[0].sequence
        for q in self._queues:
            q.put(msg)


def digest_to_proto(digest: BlockDigest) -> common_pb2.KvDigest:
    return common_pb2.KvDigest(sum=digest.sum, count=digest.count)


def snapshot_to_proto(snapshot: KVSnapshot, node_id: str, role: str, incarnation: str) -> common_pb2.KvEventBatch:
    msg = common_pb2.KvEventBatch(node_id=node_id, role=role, incarnation=incarnation, sequence=snapshot.sequence,
                                  digest=digest_to_proto(snapshot.digest))
    msg.snapshot.block_hashes.extend(snapshot.block_hashes)
    return msg


def batch_to_proto(batch: KVEventBatch, node_id: str, role: str) -> common_pb2.KvEventBatch:
    msg = common_pb2.KvEventBatch(node_id=node_id, role=role, dropped=batch.dropped, timestamp=batch.timestamp,
                                  digest=digest_to_proto(batch.digest))
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
